"""Muon (optim.name=muon): Newton-Schulz against an SVD reference, the update rule and its RMS, which
parameters Muon takes per family, training, checkpoints (bit-exact resume, one entry per expert) and
the refused optimizer switch. Meshes: tests/test_parallel.py."""

import math

import pytest
import torch

from conftest import tiny_config, tiny_deepseek_config, tiny_gpt_oss_config
from pithtrain.config import UserError
from pithtrain.train import checkpoint as ckpt
from pithtrain.train.loop import train
from pithtrain.train import optim
from pithtrain.train.metrics import read_metrics
from pithtrain.train.optim import build_optimizer, newton_schulz, takes_muon

pytestmark = pytest.mark.fast  # the fast tier (make test-fast)


def with_spectrum(m, n, cond, gen):
    """A float64 m x n matrix U diag(s) V^T with log-spaced singular values from 1 down to 1/cond."""
    k = min(m, n)
    u, _ = torch.linalg.qr(torch.randn(m, k, generator=gen, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(n, k, generator=gen, dtype=torch.float64))
    return u @ torch.diag(torch.logspace(0, -math.log10(cond), k, dtype=torch.float64)) @ v.T, u, v


@pytest.mark.parametrize("m, n", [(64, 64), (96, 32), (32, 96)])
def test_newton_schulz_against_svd(m, n):
    """What 5 quintic steps guarantee (measured in float64): the singular vectors are exactly G's (the
    iteration is an odd polynomial of G); singular values of a condition number up to 100 end in
    [0.68, 1.21] (not at 1: Keller Jordan's coefficients trade convergence for speed); so the result is
    within a third (Frobenius) of the orthogonal factor U V^T, and its direction at cosine >= 0.98."""
    gen = torch.Generator().manual_seed(m + n)
    for cond in (1, 10, 100):
        g, u, v = with_spectrum(m, n, cond, gen)
        x = newton_schulz(g, dtype=torch.float64)
        inner = u.T @ x @ v  # diagonal: the same singular vectors
        assert (inner - torch.diag(torch.diagonal(inner))).abs().max() < 1e-10
        sv = torch.linalg.svdvals(x)
        assert 0.65 <= sv.min() and sv.max() <= 1.25, (cond, sv.min(), sv.max())
        target = u @ v.T
        assert (x - target).norm() / target.norm() < 0.33  # at worst every singular value at 0.68
        assert (x * target).sum() / (x.norm() * target.norm()) > 0.98
    # any matrix: nothing grows past the band (tiny singular values of a random square matrix stay small)
    x = newton_schulz(torch.randn(m, n, generator=gen, dtype=torch.float64), dtype=torch.float64)
    assert torch.linalg.svdvals(x).max() <= 1.25
    # batched: each matrix of a stack separately; fp32 by default on the CPU
    stack = torch.randn(3, m, n, generator=gen)
    got = newton_schulz(stack)
    assert got.dtype == torch.float32
    for i in range(3):
        torch.testing.assert_close(got[i], newton_schulz(stack[i]), rtol=1e-5, atol=1e-6)
    # bf16 (the GPU dtype): within 10% (Frobenius) of the fp32 iteration. Measured here 3.8-7.2% on these
    # random matrices (the iteration's sums cancel, so every bf16 rounding before the last product counts:
    # the separate-op form B = bA + cA@A, X = aX + B@X measures the same; cuBLAS's fp32 epilogues 1.5-1.9%),
    # and 2.1% on the H200 at 768 x 2048 (docs/performance.md, Muon). A wrong term is off by O(1).
    low = newton_schulz(stack, dtype=torch.bfloat16)
    assert low.dtype == torch.float32 and low.shape == got.shape
    err = (low - got).flatten(1).norm(dim=1) / got.flatten(1).norm(dim=1)
    assert (err < 0.1).all() and (err > 0).all(), err  # > 0: bf16 really ran


def muon_step_reference(w, grads, lr, wd, mu=0.95):
    """Moonlight's update, written out per matrix: B <- mu B + G; W <- W(1 - lr wd) - lr 0.2 sqrt(max(m, n)) NS(G + mu B)."""
    buf = torch.zeros_like(w)
    for g in grads:
        buf = mu * buf + g
        w = w * (1 - lr * wd) - lr * 0.2 * math.sqrt(max(w.shape)) * newton_schulz(g + mu * buf)
    return w


def test_muon_update_rule_rms_and_expert_stacks():
    """Two steps on a dense matrix and on a [E, in, out] expert stack (E matrices, each its own NS)
    equal the written-out rule; an update's RMS is about 0.2 (AdamW's range), whatever the shape."""
    cfg = tiny_config("unused").optim
    cfg.name, cfg.weight_decay = "muon", 0.1
    gen = torch.Generator().manual_seed(0)
    dense = torch.nn.Parameter(torch.randn(48, 16, generator=gen))
    experts = torch.nn.Parameter(torch.randn(3, 16, 40, generator=gen))
    norm = torch.nn.Parameter(torch.ones(16))
    opt = build_optimizer([("layers.0.mlp.up_proj.weight", dense), ("layers.0.mlp.experts.gate_up", experts),
                           ("layers.0.input_layernorm.weight", norm)], cfg, "cpu")
    assert [len(g["params"]) for g in opt.param_groups if g["muon"]] == [2]
    start = (dense.detach().clone(), experts.detach().clone())
    grads = [(torch.randn(48, 16, generator=gen), torch.randn(3, 16, 40, generator=gen), torch.randn(16, generator=gen))
             for _ in range(2)]
    for gd, ge, gn in grads:
        dense.grad, experts.grad, norm.grad = gd, ge, gn
        opt.step()
    torch.testing.assert_close(dense.detach(), muon_step_reference(start[0], [g[0] for g in grads], cfg.lr, 0.1))
    for i in range(3):  # gate_up: gate and up are two matrices of each expert, each its own NS
        for half in (slice(0, 20), slice(20, 40)):
            torch.testing.assert_close(experts.detach()[i][:, half],
                                       muon_step_reference(start[1][i][:, half], [g[1][i][:, half] for g in grads], cfg.lr, 0.1))
    assert set(opt.state[dense]) == {"step", "momentum_buffer"} and set(opt.state[norm]) == {"step", "exp_avg", "exp_avg_sq"}
    for shape in ((48, 16), (16, 48), (64, 64), (4, 32, 96)):  # one step from zero momentum, no decay, lr 1
        p = torch.nn.Parameter(torch.zeros(shape))
        cfg.weight_decay, cfg.lr = 0.0, 1.0
        opt = build_optimizer([("layers.0.mlp.experts.down" if len(shape) == 3 else "x.weight", p)], cfg, "cpu")
        p.grad = torch.randn(shape, generator=gen)
        opt.step()
        assert 0.2 * 0.75 < p.detach().pow(2).mean().sqrt() < 0.2 * 1.15, shape


def per_matrix_muon(weights, grads_per_step, lr, wd, mu=0.95):
    """Muon written out one matrix at a time, independently of train/optim.py: an expert stack [E, in, out]
    is E matrices, its fused gate_up 2E (gate, up); momentum, Nesterov, Frobenius normalisation and 5
    quintic steps on the wide orientation, all in float32; decoupled decay; scale 0.2 sqrt(max(m, n))."""
    a, b, c = 3.4445, -4.7750, 2.0315

    def ns(x):
        tall = x.shape[0] > x.shape[1]
        x = x.T if tall else x
        x = x / (x.norm() + 1e-7)
        for _ in range(5):
            gram = x @ x.T
            x = a * x + (b * gram + c * gram @ gram) @ x
        return x.T if tall else x

    weights = {n: w.clone() for n, w in weights.items()}
    bufs = {n: torch.zeros_like(w) for n, w in weights.items()}
    for grads in grads_per_step:
        for name, g in grads.items():
            if g is None:
                continue
            w, buf = weights[name], bufs[name]
            halves = 2 if name.endswith("gate_up") else 1
            cols = w.shape[-1] // halves
            for e in range(w.shape[0]) if w.dim() == 3 else [None]:
                for k in range(halves):
                    at = (e, slice(None), slice(k * cols, (k + 1) * cols)) if e is not None else (slice(None),) * 2
                    buf[at] = mu * buf[at] + g[at]
                    update = ns(g[at] + mu * buf[at])
                    w[at] = w[at] * (1 - lr * wd) - lr * 0.2 * math.sqrt(max(update.shape)) * update
    return weights, bufs


@pytest.mark.parametrize("batch_bytes", [optim.NS_BATCH_BYTES, 10 * 16 * 32 * 4])
def test_batched_step_equals_per_matrix_muon(monkeypatch, batch_bytes):
    """The step (same-shape matrices of all layers batched: attention k/v with the experts' down, gate and
    up halves as separate matrices, fused momentum and update passes) equals the per-matrix rule to 1e-6
    over 3 steps, one with a parameter without a gradient; also with batches so small that one shape
    takes several (10 matrices of 16 x 32: some hold several parameters, a gate_up stack is alone)."""
    monkeypatch.setattr(optim, "NS_BATCH_BYTES", batch_bytes)
    cfg = tiny_config("unused")
    cfg.optim.name, cfg.optim.lr, cfg.optim.weight_decay = "muon", 0.02, 0.1
    gen = torch.Generator().manual_seed(3)
    params = {n: torch.nn.Parameter(torch.randn(p.shape, generator=gen) * 0.1) for n, p in cfg.model.build_model().named_parameters()}
    muon = {n: p for n, p in params.items() if takes_muon(n, p, cfg.optim.muon_exclude)}
    assert {tuple(p.shape) for p in muon.values()} == {(32, 32), (16, 32), (4, 32, 32), (4, 16, 32)}
    opt = build_optimizer(list(params.items()), cfg.optim, "cpu")
    start = {n: p.detach().clone() for n, p in muon.items()}
    grads_per_step = []
    for step in range(3):
        grads = {n: torch.randn(p.shape, generator=gen) for n, p in params.items()}
        if step == 1:
            grads["layers.1.mlp.experts.gate_up"] = None
        for n, p in params.items():
            p.grad = grads[n]
        opt.step()
        grads_per_step.append({n: grads[n] for n in muon})
    want_w, want_buf = per_matrix_muon(start, grads_per_step, cfg.optim.lr, 0.1)
    for name, p in muon.items():
        assert (p.detach() - start[name]).abs().max() > 1e-3, name  # the updates are large against the tolerance
        torch.testing.assert_close(p.detach(), want_w[name], rtol=0, atol=1e-6)
        torch.testing.assert_close(opt.state[p]["momentum_buffer"], want_buf[name], rtol=0, atol=1e-6)
        assert opt.state[p]["step"] == (2 if name == "layers.1.mlp.experts.gate_up" else 3)


@pytest.mark.parametrize("family, muon, adamw", [
    (tiny_config, ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                   "self_attn.o_proj.weight", "mlp.experts.gate_up", "mlp.experts.down"],
     ["input_layernorm.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
      "post_attention_layernorm.weight", "mlp.gate.weight"]),
    (tiny_deepseek_config, ["self_attn.q_a_proj.weight", "self_attn.q_b_proj.weight",
                            "self_attn.kv_a_proj_with_mqa.weight", "self_attn.kv_b_proj.weight", "self_attn.o_proj.weight",
                            "mlp.experts.gate_up", "mlp.experts.down", "mlp.shared_experts.gate_proj.weight",
                            "mlp.shared_experts.up_proj.weight", "mlp.shared_experts.down_proj.weight"],
     ["input_layernorm.weight", "self_attn.q_a_layernorm.weight", "self_attn.kv_a_layernorm.weight",
      "post_attention_layernorm.weight", "mlp.gate.weight"]),
    (tiny_gpt_oss_config, ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                           "self_attn.o_proj.weight", "mlp.experts.gate_up", "mlp.experts.down"],
     ["input_layernorm.weight", "self_attn.sinks", "self_attn.q_proj.bias", "self_attn.k_proj.bias",
      "self_attn.v_proj.bias", "self_attn.o_proj.bias", "post_attention_layernorm.weight", "mlp.router.weight",
      "mlp.router.bias", "mlp.experts.gate_up_bias", "mlp.experts.down_bias"]),
])
def test_which_parameters_muon_takes(family, muon, adamw):
    """Per family, the last (MoE) layer's matrices go to Muon; embeddings, head, norms, biases, router
    gates and sinks stay on AdamW; optim.muon_exclude moves more to AdamW by name pattern."""
    cfg = family("unused")
    model = cfg.model.build_model()
    last = f"layers.{cfg.model.num_hidden_layers - 1}."
    taken = {n[len(last):] for n, p in model.named_parameters() if takes_muon(n, p, cfg.optim.muon_exclude) and n.startswith(last)}
    left = {n[len(last):] for n, p in model.named_parameters() if not takes_muon(n, p, cfg.optim.muon_exclude) and n.startswith(last)}
    assert taken == set(muon) and left == set(adamw)
    assert not any(takes_muon(n, p, cfg.optim.muon_exclude) for n, p in model.named_parameters() if not n.startswith("layers."))
    if family is tiny_deepseek_config:  # the dense first layer's MLP too
        assert takes_muon("layers.0.mlp.down_proj.weight", model.layers["0"].mlp.down_proj.weight, cfg.optim.muon_exclude)
    p = model.layers["0"].self_attn.o_proj.weight
    assert not takes_muon("layers.0.self_attn.o_proj.weight", p, [*cfg.optim.muon_exclude, "*.o_proj.*"])


def muon_config(dataset_dir, **train_kw):
    cfg = tiny_config(dataset_dir, **train_kw)
    cfg.optim.name = "muon"
    return cfg


def test_tiny_model_trains_resumes_bit_exact_and_refuses_a_switch(tmp_path, dataset_dir):
    """Muon lowers the loss; a run stopped at step 3 and resumed equals the uninterrupted run bit for bit
    (loss, grad norm, weights, momentum); the checkpoint holds the momentum one entry per global expert;
    resuming with optim.name=adamw is refused unless optim.allow_switch (then the optimizer starts fresh)."""
    whole = train(muon_config(dataset_dir, steps=6, lb_coef=0.0), tmp_path / "whole", echo=False)
    assert whole[-1]["loss"] < whole[0]["loss"] - 0.2  # 4.16 -> 3.93 (AdamW: about the same)
    train(muon_config(dataset_dir, steps=6, lb_coef=0.0, checkpoint_every=3), tmp_path / "split", echo=False, stop_after=3)
    stored = torch.distributed.checkpoint.FileSystemReader(str(ckpt.resolve_checkpoint(tmp_path / "split"))).read_metadata()
    keys = set(stored.state_dict_metadata)
    assert {f"optim.state.layers.1.mlp.experts.down.{e}.momentum_buffer" for e in range(4)} <= keys
    assert "optim.state.layers.1.self_attn.q_proj.weight.momentum_buffer" in keys
    assert "optim.state.lm_head.weight.exp_avg" in keys and "optim.state.lm_head.weight.momentum_buffer" not in keys
    train(muon_config(dataset_dir, steps=6, lb_coef=0.0, checkpoint_every=3), tmp_path / "split", echo=False)
    assert [(m["loss"], m["grad_norm"]) for m in read_metrics(tmp_path / "split" / "metrics.jsonl")] == \
           [(m["loss"], m["grad_norm"]) for m in whole]
    states = []
    for run in ("whole", "split"):
        cfg = muon_config(dataset_dir)
        model = cfg.model.build_model()
        opt = build_optimizer(list(model.named_parameters()), cfg.optim, "cpu")
        ckpt.load_training_state(ckpt.resolve_checkpoint(tmp_path / run), model, opt)
        states.append({n: (p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items()}) for n, p in model.named_parameters()})
    for name, (w, st) in states[0].items():
        assert torch.equal(states[1][name][0], w) and st.keys() == states[1][name][1].keys(), name
        assert all(torch.equal(states[1][name][1][k], v) for k, v in st.items()), name
    switch = tiny_config(dataset_dir, steps=8, lb_coef=0.0)  # adamw
    with pytest.raises(UserError, match="optim.allow_switch=true"):
        train(switch, tmp_path / "split", echo=False)
    switch.optim.allow_switch = True
    more = train(switch, tmp_path / "split", echo=False)
    assert [m["step"] for m in more] == [7, 8] and all(math.isfinite(m["loss"]) for m in more)
