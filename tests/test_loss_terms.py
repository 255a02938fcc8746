"""The loss's auxiliary terms (protocol.AUX_TERMS, LossTerms; docs/architecture.md "Loss"): a throwaway
term added as a new one would be, model code (a value in Stage1Out.aux) plus one AuxTerm entry, enters
the gradients and is logged, and its curve does not depend on the mesh: one process against ep2 (the
DualPipeV pp = 1 path, segmented backward), ep2 without the overlap (the plain loop) and pp2 (the
pipeline's one-call backward), in one two-process launch."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import tiny_config
from dist_util import run_world

from pithtrain import protocol
from pithtrain.config import TrainConfig
from pithtrain.models import qwen3_moe
from pithtrain.protocol import AuxTerm, LossTerms
from pithtrain.train.loop import train
from pithtrain.train.metrics import read_metrics

PROBE = AuxTerm("probe", "probe_coef", "probe_loss")


@dataclasses.dataclass
class ProbeTrainConfig(TrainConfig):
    """TrainConfig with the probe's scale (a real term adds its field to config.TrainConfig itself)."""

    probe_coef: float = 0.0


def probe_config(dataset_dir, coef, **parallel):
    """4 layers (pp2 cuts them into 4 chunks), 4 micro-batches of 2 per step, and the probe's scale."""
    cfg = tiny_config(dataset_dir, steps=3, global_batch_size=8, micro_batch_size=2)
    cfg.model.num_hidden_layers = 4
    cfg.train = ProbeTrainConfig(**vars(cfg.train), probe_coef=coef)
    for key, value in parallel.items():
        setattr(cfg.parallel, key, value)
    return cfg


@pytest.fixture(scope="module")
def runs(dataset_dir, tmp_path_factory):
    """The term's model code: each MoE layer's stage 1 records the mean square of the tokens it
    routes (a function of the attention and norm weights, the same on every mesh for a sample)."""
    root = tmp_path_factory.mktemp("loss_terms")
    stage1 = qwen3_moe.DecoderLayer.stage1

    def with_probe(self, x, attn):
        s1 = stage1(self, x, attn)
        if s1.routing is not None:
            s1.aux = {"probe": s1.moe_input.float().pow(2).mean()}
        return s1

    patch = pytest.MonkeyPatch()
    patch.setattr(qwen3_moe.DecoderLayer, "stage1", with_probe)
    patch.setattr(protocol, "AUX_TERMS", protocol.AUX_TERMS + (PROBE,))  # the one registration
    try:  # the forked workers inherit both
        out = {"one": train(probe_config(dataset_dir, 0.3), root / "one", echo=False),
               "off": train(probe_config(dataset_dir, 0.0), root / "off", echo=False)}
        run_world(2, [(probe_config(dataset_dir, 0.3, ep=2), root / "ep2", {}),
                      (probe_config(dataset_dir, 0.3, ep=2, overlap_ep=False), root / "ep2_plain", {}),
                      (probe_config(dataset_dir, 0.3, pp=2), root / "pp2", {})])
    finally:
        patch.undo()
    for name in ("ep2", "ep2_plain", "pp2"):
        out[name] = read_metrics(root / name / "metrics.jsonl")
    return out


def test_a_new_term_enters_the_gradient_and_the_metrics(runs):
    one, off = runs["one"], runs["off"]
    assert all(m["probe_loss"] > 0 and "lb_loss" in m for m in one + off)
    # step 1 sees the same weights: the same value logged, a different gradient (the term is in the loss)
    assert one[0]["probe_loss"] == off[0]["probe_loss"] and one[0]["loss"] == off[0]["loss"]
    assert one[0]["grad_norm"] != pytest.approx(off[0]["grad_norm"], rel=1e-4)
    assert one[-1]["loss"] != off[-1]["loss"]


@pytest.mark.parametrize("name", ["ep2", "ep2_plain", "pp2"])
def test_a_new_term_does_not_depend_on_the_mesh(runs, name):
    ref, got = runs["one"], runs[name]
    assert [m["step"] for m in got] == [m["step"] for m in ref]
    for a, b in zip(ref, got):
        for key in ("loss", "lb_loss", "probe_loss", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-5), (name, a["step"], key)


def test_a_value_without_a_registration_is_refused():
    with pytest.raises(ValueError, match="no AuxTerm"):
        LossTerms.layer_sums({"lb": [torch.ones(())], "unregistered": [torch.ones(())]}, mean=True)
