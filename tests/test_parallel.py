"""Expert parallelism + FSDP2 on CPU processes (gloo): the loss curve does not depend on the mesh.

Two launches (2 and 4 processes) run every mesh job; single-process references run here.
Checks: per-step loss, lb_loss and grad norm equal to one process (fp32, rel <= 1e-5), equal
parameters afterwards, load-balance variants across ranks, and checkpoints resharded across
meshes (ep4 -> dp2 x ep2 -> ep2 -> one process) continuing the uninterrupted curve;
train.recompute on pp2 x ep2 (full), dp2 x ep2 (selective) and cp2 (full).
"""

import copy

import pytest
import torch

from conftest import tiny_config, tiny_deepseek_config, tiny_gpt_oss_config, tiny_qwen3_5_config
from dist_util import run_world
from pithtrain.train import checkpoint as ckpt
from pithtrain.train.loop import train
from pithtrain.train.metrics import read_metrics
from pithtrain.train.optim import build_optimizer

STEPS = 4
FP8_MESH_REL = 2e-3  # loss; grad norm 25x (measured up to 2.4e-2 at pp2 x ep2); see test_fp8_meshes_equal_one_process


def mesh_config(dataset_dir, ep=1, hsdp=False, steps=STEPS, family=tiny_config, pp=1, cp=1, packed=False, **train_kw):
    train_kw = {"global_batch_size": 8, "micro_batch_size": 2, **train_kw}
    cfg = family(dataset_dir, steps=steps, **train_kw)
    cfg.parallel.ep, cfg.parallel.hsdp, cfg.parallel.pp, cfg.parallel.cp = ep, hsdp, pp, cp
    cfg.data.pack_documents = packed
    return cfg


def evals(cfg):
    """Held-out loss every 2 steps and at the end, on the first 8 windows of the training data
    (data.eval_path: the training order stays that of the other runs)."""
    cfg.train.eval_every, cfg.data.eval_path, cfg.data.eval_samples = 2, cfg.data.path, 8
    return cfg


def fp8(cfg):
    """FP8 row-wise, emulated on the CPU (ops/fp8.py's reference numerics)."""
    cfg.train.fp8, cfg.train.fp8_emulate = "rowwise", True
    return cfg


def muon(cfg):
    """optim.name=muon: Newton-Schulz on whole matrices, gathered from FSDP shards."""
    cfg.optim.name = "muon"
    return cfg


def recompute(cfg, mode):
    """train.recompute: stages 1 and 3 (full) or the SwiGLU output (selective) recomputed in backward."""
    cfg.train.recompute = mode
    return cfg


def deep_config(dataset_dir, **train):
    """Six layers (one of them dense), one sample per micro-batch: enough micro-batches and
    layers for pp up to 4 (DualPipeV needs 2*pp micro-batches per step)."""
    cfg = tiny_config(dataset_dir, **{**train, "micro_batch_size": 1})
    cfg.model.num_hidden_layers, cfg.model.mlp_only_layers = 6, [2]
    return cfg


@pytest.fixture(scope="module")
def runs(tmp_path_factory, dataset_dir):
    root = tmp_path_factory.mktemp("parallel")
    chain = root / "chain"
    four = [
        (mesh_config(dataset_dir, ep=4), root / "ep4", {}),
        (mesh_config(dataset_dir, ep=2), root / "dp2ep2", {}),
        (evals(mesh_config(dataset_dir, ep=2, hsdp=True)), root / "hsdp_dp2ep2", {}),
        (mesh_config(dataset_dir, ep=1), root / "dp4", {}),
        (mesh_config(dataset_dir, ep=4, steps=8, checkpoint_every=2), chain, {"stop_after": 2}),
        (evals(mesh_config(dataset_dir, pp=2, ep=2, steps=3, family=deep_config)), root / "pp2ep2", {}),
        (mesh_config(dataset_dir, pp=2, steps=3, family=deep_config), root / "pp2dp2", {}),
        (mesh_config(dataset_dir, pp=4, steps=3, family=deep_config), root / "pp4", {}),
        (evals(mesh_config(dataset_dir, cp=2)), root / "cp2", {}),
        (mesh_config(dataset_dir, cp=4), root / "cp4", {}),
        (mesh_config(dataset_dir, cp=2, ep=2), root / "cp2ep2", {}),
        (mesh_config(dataset_dir, cp=2, ep=2, steps=3, packed=True, lb_type="seq"), root / "cp2ep2_packed", {}),
        (mesh_config(dataset_dir, ep=2, steps=8, checkpoint_every=2), chain, {"stop_after": 4}),
        (fp8(mesh_config(dataset_dir, pp=2, ep=2, steps=3, family=deep_config)), root / "fp8_pp2ep2", {}),
        (muon(mesh_config(dataset_dir, ep=2, steps=3)), root / "muon_dp2ep2", {}),
        (muon(mesh_config(dataset_dir, pp=2, ep=2, steps=3, family=deep_config)), root / "muon_pp2ep2", {}),
        (muon(mesh_config(dataset_dir, ep=2, steps=3, checkpoint_every=2)), root / "muon_chain", {"stop_after": 2}),
        (recompute(mesh_config(dataset_dir, pp=2, ep=2, steps=3, family=deep_config), "full"), root / "recompute_pp2ep2", {}),
        (recompute(mesh_config(dataset_dir, ep=2), "selective"), root / "recompute_dp2ep2", {}),
    ]
    no_overlap = mesh_config(dataset_dir, pp=1, ep=2, steps=3, family=deep_config)
    no_overlap.parallel.overlap_ep = False
    two = [
        (evals(mesh_config(dataset_dir, ep=1)), root / "dp2", {}),
        (evals(mesh_config(dataset_dir, ep=2)), root / "ep2", {}),
        (mesh_config(dataset_dir, ep=1, steps=2, lb_type="global", lb_coef=0.5), root / "global_dp2", {}),
        (mesh_config(dataset_dir, ep=2, steps=2, lb_type="seq", lb_coef=0.5), root / "seq_ep2", {}),
        (mesh_config(dataset_dir, ep=2, steps=8, checkpoint_every=2), chain, {"stop_after": 6}),
        (mesh_config(dataset_dir, ep=2, steps=3, family=tiny_deepseek_config), root / "ds_ep2", {}),
        (mesh_config(dataset_dir, ep=1, steps=3, family=tiny_deepseek_config), root / "ds_dp2", {}),
        (mesh_config(dataset_dir, ep=2, steps=3, family=tiny_gpt_oss_config), root / "oss_ep2", {}),
        (evals(mesh_config(dataset_dir, pp=2, steps=3, family=deep_config)), root / "pp2", {}),
        # pp = 1 with EP: DualPipeV still overlaps two micro-batches on one rank
        (evals(mesh_config(dataset_dir, pp=1, ep=2, steps=3, family=deep_config)), root / "pp1ep2", {}),
        (no_overlap, root / "ep2_no_overlap", {}),  # the same mesh, one micro-batch at a time
        (fp8(mesh_config(dataset_dir, ep=2)), root / "fp8_ep2", {}),
        (fp8(mesh_config(dataset_dir, ep=1)), root / "fp8_dp2", {}),  # FSDP-gathered weights: a new version each gather
        (muon(mesh_config(dataset_dir, ep=1, steps=3)), root / "muon_dp2", {}),  # experts sharded too
        (muon(mesh_config(dataset_dir, ep=2, steps=3)), root / "muon_ep2", {}),  # experts whole, local
        (muon(mesh_config(dataset_dir, cp=2, steps=3)), root / "muon_cp2", {}),
        (recompute(mesh_config(dataset_dir, cp=2), "full"), root / "recompute_cp2", {}),  # the ring runs again in backward
    ]
    run_world(4, four)
    run_world(2, two)
    run_world(8, [(evals(mesh_config(dataset_dir, pp=2, cp=2, ep=2, steps=3, family=deep_config)), root / "pp2cp2ep2", {})])
    train(mesh_config(dataset_dir, steps=8, checkpoint_every=2), chain, echo=False)  # the last leg: one process
    train(muon(mesh_config(dataset_dir, steps=3, checkpoint_every=2)), root / "muon_chain", echo=False)  # dp2 x ep2 -> 1
    refs = {
        "ref": train(evals(mesh_config(dataset_dir)), root / "ref", echo=False),
        "ref8": train(mesh_config(dataset_dir, steps=8), root / "ref8", echo=False),
        # `global` on 2 data ranks == `micro` on one process with micro-batches twice as large
        "ref_global": train(mesh_config(dataset_dir, steps=2, lb_type="micro", lb_coef=0.5, micro_batch_size=4),
                            root / "ref_global", echo=False),
        "ref_seq": train(mesh_config(dataset_dir, steps=2, lb_type="seq", lb_coef=0.5), root / "ref_seq", echo=False),
        "packed_ref": train(mesh_config(dataset_dir, steps=3, packed=True, lb_type="seq"), root / "packed_ref", echo=False),
        "deep_ref": train(evals(mesh_config(dataset_dir, steps=3, family=deep_config)), root / "deep_ref", echo=False),
        "ds_ref": train(mesh_config(dataset_dir, steps=3, family=tiny_deepseek_config), root / "ds_ref", echo=False),
        "oss_ref": train(mesh_config(dataset_dir, steps=3, family=tiny_gpt_oss_config), root / "oss_ref", echo=False),
        "fp8_ref": train(fp8(mesh_config(dataset_dir)), root / "fp8_ref", echo=False),
        "fp8_deep_ref": train(fp8(mesh_config(dataset_dir, steps=3, family=deep_config)), root / "fp8_deep_ref", echo=False),
        "muon_ref": train(muon(mesh_config(dataset_dir, steps=3)), root / "muon_ref", echo=False),
        "muon_deep_ref": train(muon(mesh_config(dataset_dir, steps=3, family=deep_config)), root / "muon_deep_ref", echo=False),
    }
    return root, refs


def assert_same_curve(reference, other, rel=1e-5):
    assert [m["step"] for m in other] == [m["step"] for m in reference]
    for a, b in zip(reference, other):
        for key in ("loss", "lb_loss", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=rel), (a["step"], key)


def final_weights(run_dir, dataset_dir, family=tiny_config):
    model = mesh_config(dataset_dir, family=family).model.build_model()
    ckpt.read_model_state(ckpt.resolve_checkpoint(run_dir), model)
    return model.state_dict()


@pytest.mark.parametrize("name", ["dp2", "ep2", "ep4", "dp2ep2", "hsdp_dp2ep2", "dp4", "cp2", "cp4", "cp2ep2",
                                  "recompute_dp2ep2", "recompute_cp2"])
def test_loss_curve_and_weights_do_not_depend_on_the_mesh(runs, dataset_dir, name):
    root, refs = runs
    metrics = read_metrics(root / name / "metrics.jsonl")
    assert_same_curve(refs["ref"], metrics)
    assert all(0.5 <= m["ep_load_balance"] <= 1 for m in metrics) if "ep" in name else "ep_load_balance" not in metrics[0]
    ref_w, got_w = final_weights(root / "ref", dataset_dir), final_weights(root / name, dataset_dir)
    for key in ref_w:
        # Adam turns ~1e-7 gradient differences on near-zero gradients into ~1e-6 weight differences
        assert torch.allclose(got_w[key], ref_w[key], rtol=1e-5, atol=1e-5), key


@pytest.mark.parametrize("family, ref, names", [
    (deep_config, "deep_ref", ["pp2", "pp1ep2", "ep2_no_overlap", "pp2ep2", "pp2dp2", "pp4", "pp2cp2ep2", "recompute_pp2ep2"]),
    (tiny_config, "packed_ref", ["cp2ep2_packed"]),
    (tiny_deepseek_config, "ds_ref", ["ds_ep2", "ds_dp2"]),
    (tiny_gpt_oss_config, "oss_ref", ["oss_ep2"]),
])
def test_pipeline_other_families_and_aux_free_bias_do_not_depend_on_the_mesh(runs, dataset_dir, family, ref, names):
    root, refs = runs
    ref_w = final_weights(root / ref, dataset_dir, family)
    biases = [k for k in ref_w if k.endswith("e_score_correction_bias")]
    assert (family is not tiny_deepseek_config) or (biases and all(ref_w[k].abs().sum() > 0 for k in biases))
    for name in names:
        assert_same_curve(refs[ref], read_metrics(root / name / "metrics.jsonl"))
        got_w = final_weights(root / name, dataset_dir, family)
        for key in ref_w:
            assert torch.allclose(got_w[key], ref_w[key], rtol=1e-5, atol=1e-5), (name, key)
        for key in biases:  # updated from integer loads summed over ranks and micro-batches: exact
            assert torch.equal(got_w[key], ref_w[key]), (name, key)


@pytest.mark.parametrize("family, ref, names", [(tiny_config, "muon_ref", ["muon_dp2", "muon_ep2", "muon_dp2ep2", "muon_cp2"]),
                                                 (deep_config, "muon_deep_ref", ["muon_pp2ep2"])])
def test_muon_does_not_depend_on_the_mesh(runs, dataset_dir, family, ref, names):
    """Muon orthogonalises whole matrices (dense ones gathered from their FSDP shards, expert stacks
    per expert on the shard that holds them): every mesh equals one process, weights included."""
    root, refs = runs
    assert refs[ref][-1]["loss"] != refs["ref" if family is tiny_config else "deep_ref"][2]["loss"]  # Muon really ran
    ref_w = final_weights(root / ref, dataset_dir, family)
    for name in names:
        assert_same_curve(refs[ref], read_metrics(root / name / "metrics.jsonl"))
        got_w = final_weights(root / name, dataset_dir, family)
        for key in ref_w:
            assert torch.allclose(got_w[key], ref_w[key], rtol=1e-5, atol=1e-5), (name, key)


def test_muon_momentum_reshards(runs, dataset_dir):
    """Muon's momentum, saved on dp2 x ep2 (one entry per global expert) and resumed on one process,
    continues the one-process curve and ends with the same weights and momentum."""
    root, refs = runs
    assert_same_curve(refs["muon_ref"], read_metrics(root / "muon_chain" / "metrics.jsonl"))
    states = []
    for run in ("muon_ref", "muon_chain"):
        cfg = muon(mesh_config(dataset_dir))
        model = cfg.model.build_model()
        optimizer = build_optimizer(list(model.named_parameters()), cfg.optim, "cpu")
        ckpt.load_training_state(ckpt.resolve_checkpoint(root / run), model, optimizer)
        states.append({n: (p.detach().clone(), optimizer.state[p]) for n, p in model.named_parameters()})
    for name, (w, st) in states[0].items():
        got_w, got_st = states[1][name]
        assert torch.allclose(got_w, w, rtol=1e-5, atol=1e-5), name
        for key in st.keys() & {"momentum_buffer", "exp_avg"}:
            assert torch.allclose(got_st[key], st[key], rtol=1e-4, atol=1e-7), (name, key)
    assert sum("momentum_buffer" in st for _, st in states[1].values()) == 12  # 2 layers x (q, k, v, o, 2 expert stacks)


@pytest.mark.parametrize("ref, names", [("ref", ["dp2", "ep2", "cp2", "hsdp_dp2ep2"]),
                                        ("deep_ref", ["pp2", "pp1ep2", "pp2ep2", "pp2cp2ep2"])])
def test_eval_loss_does_not_depend_on_the_mesh(runs, ref, names):
    """The held-out loss (forward only, on every layout: FSDP, EP, CP, both DualPipeV chunks in
    sequence) equals one process's."""
    root, refs = runs
    want = {m["step"]: m["eval_loss"] for m in refs[ref] if "eval_loss" in m}
    assert sorted(want) == ([2, 4] if ref == "ref" else [2, 3])  # every 2 steps and the last
    for name in names:
        got = {m["step"]: m["eval_loss"] for m in read_metrics(root / name / "metrics.jsonl") if "eval_loss" in m}
        assert got.keys() == want.keys() and all(got[s] == pytest.approx(want[s], rel=1e-5) for s in want), (name, got, want)


def test_load_balance_variants_across_ranks(runs):
    root, refs = runs
    assert_same_curve(refs["ref_global"], read_metrics(root / "global_dp2" / "metrics.jsonl"))
    assert_same_curve(refs["ref_seq"], read_metrics(root / "seq_ep2" / "metrics.jsonl"))
    # the variants really differ (so the comparisons above can fail)
    assert refs["ref_global"][0]["lb_loss"] != pytest.approx(refs["ref_seq"][0]["lb_loss"], rel=1e-3)


def test_checkpoints_reshard_across_meshes(runs, dataset_dir):
    root, refs = runs
    assert_same_curve(refs["ref8"], read_metrics(root / "chain" / "metrics.jsonl"))
    states = []
    for run in (root / "ref8", root / "chain"):
        cfg = mesh_config(dataset_dir)
        model = cfg.model.build_model()
        optimizer = build_optimizer(list(model.named_parameters()), cfg.optim, "cpu")
        ckpt.load_training_state(ckpt.resolve_checkpoint(run), model, optimizer)
        states.append((copy.deepcopy(model.state_dict()), {n: optimizer.state[p] for n, p in model.named_parameters()}))
    (w_ref, o_ref), (w_got, o_got) = states
    for key in w_ref:
        assert torch.allclose(w_got[key], w_ref[key], rtol=1e-5, atol=1e-5), key
    for name in o_ref:
        for key in ("exp_avg", "exp_avg_sq", "step"):
            # fp32 rounding of another mesh's sums is relative to the tensor's scale, not to each entry:
            # an entry that sums to near zero differs by ~1e-9 absolute (measured), a wrong reshard by O(1)
            ref = o_ref[name][key]
            assert torch.allclose(o_got[name][key], ref, rtol=1e-4, atol=1e-5 * float(ref.abs().max())), (name, key)


@pytest.mark.parametrize("ref, name, rel", [("fp8_ref", "fp8_dp2", FP8_MESH_REL), ("fp8_ref", "fp8_ep2", FP8_MESH_REL),
                                             ("fp8_deep_ref", "fp8_pp2ep2", FP8_MESH_REL)])
def test_fp8_meshes_equal_one_process(runs, ref, name, rel):
    """FP8 emulated, to FP8's tolerance. The scales are per token row, per weight row/column and per
    expert segment, but fp32 summation order (threads, FSDP's reduce-scatter) differs between meshes
    and a 1e-7 difference can flip an e4m3 rounding (dp2 measured 1e-5 to 3e-4 from run to run).
    Under EP the expert weight gradient's scales also span the rows of every data rank's micro-batch
    in that expert's GEMM (one process: one micro-batch). Adam carries the differences on."""
    root, refs = runs
    bf = refs["ref"] if ref == "fp8_ref" else refs["deep_ref"]
    assert refs[ref][-1]["loss"] != bf[-1]["loss"]  # FP8 really ran
    got = read_metrics(root / name / "metrics.jsonl")
    assert [m["step"] for m in got] == [m["step"] for m in refs[ref]]
    for a, b in zip(refs[ref], got):
        assert b["loss"] == pytest.approx(a["loss"], rel=rel), (a["step"], "loss")
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=25 * rel), (a["step"], "grad_norm")


def qwen3_5_deep(dataset_dir, **train):
    """The hybrid tiny model with one sample per micro-batch: 8 micro-batches a step for DualPipeV."""
    return tiny_qwen3_5_config(dataset_dir, **{**train, "micro_batch_size": 1})


@pytest.fixture(scope="module")
def hybrid_runs(tmp_path_factory, dataset_dir):
    """Qwen3.5-MoE (Gated DeltaNet + gated attention) on every mesh kind, against one process."""
    root = tmp_path_factory.mktemp("hybrid")
    run_world(4, [
        (mesh_config(dataset_dir, ep=2, steps=3, family=tiny_qwen3_5_config), root / "dp2ep2", {}),
        (mesh_config(dataset_dir, pp=2, ep=2, steps=3, family=qwen3_5_deep), root / "pp2ep2", {}),
        (mesh_config(dataset_dir, cp=2, ep=2, steps=3, family=tiny_qwen3_5_config, packed=True), root / "cp2ep2_packed", {}),
    ])
    run_world(2, [(mesh_config(dataset_dir, ep=2, steps=3, family=tiny_qwen3_5_config), root / "ep2", {})])
    refs = {
        "ref": train(mesh_config(dataset_dir, steps=3, family=tiny_qwen3_5_config), root / "ref", echo=False),
        "deep_ref": train(mesh_config(dataset_dir, steps=3, family=qwen3_5_deep), root / "deep_ref", echo=False),
        "packed_ref": train(mesh_config(dataset_dir, steps=3, family=tiny_qwen3_5_config, packed=True),
                            root / "packed_ref", echo=False),
    }
    return root, refs


@pytest.mark.parametrize("name, ref", [("ep2", "ref"), ("dp2ep2", "ref"), ("pp2ep2", "deep_ref"),
                                       ("cp2ep2_packed", "packed_ref")])
def test_hybrid_family_does_not_depend_on_the_mesh(hybrid_runs, dataset_dir, name, ref):
    """Loss per step within 1e-6 of one process (grad norm 1e-5), weights after the run too: the
    recurrence under pp (DualPipeV, deferred expert weight gradients) and under cp2 with packed
    documents (the gathered sequence; states and conv windows reset at each document)."""
    root, refs = hybrid_runs
    got = read_metrics(root / name / "metrics.jsonl")
    assert [m["step"] for m in got] == [m["step"] for m in refs[ref]]
    for a, b in zip(refs[ref], got):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6), (a["step"], "loss")
        for key in ("lb_loss", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-5), (a["step"], key)
    family = qwen3_5_deep if ref == "deep_ref" else tiny_qwen3_5_config
    ref_w, got_w = final_weights(root / ref, dataset_dir, family), final_weights(root / name, dataset_dir, family)
    for key in ref_w:
        # The decay parameters' gradients agree to ~1e-5 relative under cp2 (measured on one micro-batch:
        # A_log 3.6e-6, in_proj_a 9.5e-6), but they are small, and Adam's normalised first steps turn
        # that into up to 1.4e-4 of a 9e-3 update after three steps (measured); the loss holds to 1e-6.
        decay = name.startswith("cp") and key.endswith(("A_log", "dt_bias", "in_proj_a.weight"))
        assert torch.allclose(got_w[key], ref_w[key], rtol=1e-5, atol=5e-4 if decay else 1e-5), (name, key)
