"""train.recompute (off | selective | full): the gradients do not change (three families, with and
without the deferred expert weight gradients, eager and compiled), and the tensors saved for the
backward shrink by what estimate-memory's activation model says. Meshes: tests/test_parallel.py."""

import importlib.util

import pytest
import torch

from conftest import tiny_config, tiny_deepseek_config, tiny_gpt_oss_config, tiny_qwen3_5_config
from pithtrain.ops.grouped_gemm import DeferredWeightGrads, accumulate_grad
from pithtrain.parallel.expert import ExpertEngine, LocalDispatch
from pithtrain.train.balance import LoadBalance
from pithtrain.train.loop import compile_stages, recompute_stages

FAMILIES = {"qwen3": tiny_config, "deepseek_v2": tiny_deepseek_config, "gpt_oss": tiny_gpt_oss_config,
            "qwen3_5": tiny_qwen3_5_config}


def _estimator():
    spec = importlib.util.spec_from_file_location("estimate_memory", ".agents/skills/estimate-memory/estimate_memory.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _model(family, mode, compile=False):
    cfg = FAMILIES[family]("/unused").model
    model = cfg.build_model()
    model.init_weights(0)
    with torch.no_grad():  # large enough that routing is far from uniform
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.1)
    if compile:
        compile_stages(model)
    recompute_stages(model, mode)
    return model


def _batch(cfg, b=2, s=24):
    gen = torch.Generator().manual_seed(7)
    return torch.randint(0, cfg.vocab_size, (b, s), generator=gen), torch.arange(s).expand(b, s), gen


def _grads(family, mode, queue=False, compile=False):
    """Every parameter's gradient of a random projection of the logits plus the load-balance loss."""
    model = _model(family, mode, compile)
    ids, pos, gen = _batch(model.cfg)
    weights = DeferredWeightGrads(accumulate_grad) if queue else None
    engine = ExpertEngine(LocalDispatch(), LoadBalance("micro", None), *ids.shape, weight_queue=weights)
    logits = model(ids, pos, engine)
    (logits * torch.randn(logits.shape, generator=gen)).sum().add(engine.lb_loss()).backward()
    if queue:
        assert weights.work  # the expert weight gradients were deferred, to be run now
        weights.run()
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert all(g is not None for g in grads.values())
    return grads


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("queue", [False, True])
def test_recompute_leaves_the_gradients_unchanged(family, queue):
    """fp32 on the CPU: the recomputed stages redo the same operations, so the gradients agree to
    1e-6 (relative to each tensor's largest entry), the deferred expert weight gradients included."""
    ref = _grads(family, "off", queue)
    for mode in ("selective", "full"):
        got = _grads(family, mode, queue)
        for name, g in ref.items():
            assert (got[name] - g).abs().max() <= 1e-6 * g.abs().max().clamp_min(1e-12), (mode, name)


def test_recompute_under_compile_gives_the_eager_gradients(capture_only_compile):
    """The checkpoint wraps the compiled stage 1 (fullgraph, no graph break): the gradients of the
    compiled run with recompute equal the compiled run without it, and eager to rounding."""
    from torch._dynamo.utils import counters

    eager = _grads("qwen3", "off")
    torch._dynamo.reset()
    counters.clear()
    compiled = _grads("qwen3", "off", compile=True)
    for mode in ("selective", "full"):
        got = _grads("qwen3", mode, queue=True, compile=True)
        for name, g in compiled.items():
            assert (got[name] - g).abs().max() <= 1e-6 * g.abs().max().clamp_min(1e-12), (mode, name)
            assert (got[name] - eager[name]).abs().max() <= 1e-4 * g.abs().max().clamp_min(1e-12), (mode, name)
    assert not counters["graph_break"]


def _saved_bytes_per_token(mode):
    """Bytes of the distinct non-parameter storages saved for the backward by one forward (what a
    checkpointed stage keeps, its inputs, is held by the stage before it anyway)."""
    model = _model("qwen3", mode)
    ids, pos, _ = _batch(model.cfg, b=2, s=64)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(ids, pos, ExpertEngine(LocalDispatch(), LoadBalance("micro", None), *ids.shape))
    return sum(seen.values()) / ids.numel(), model.cfg


@pytest.mark.fast
def test_saved_activations_shrink_as_the_estimate_models():
    """Measured on the CPU (fp32, 4 bytes; the estimate counts bf16, 2): selective stops saving the
    SwiGLU output, top-k x I per token per MoE layer, exactly (the routing counts, 8 bytes per
    layer, go uncounted: 1%). full keeps nothing inside stages 1 and 3: at least the estimate's drop and
    at most 1.5x it, since the CPU's eager kernels save more than the fused GPU ones the estimate
    models (the norms' products, the SiLU output: 1.44x here)."""
    est = _estimator()
    off, cfg = _saved_bytes_per_token("off")
    model_bytes = {mode: 2 * sum(est.layer_activation_bytes(cfg, i, 64, mode) for i in range(cfg.num_hidden_layers))
                   for mode in ("off", "selective", "full")}  # fp32: twice the estimate's bf16 bytes
    assert model_bytes["off"] - model_bytes["selective"] == 4 * 2 * cfg.num_experts_per_tok * cfg.moe_intermediate_size
    selective, _ = _saved_bytes_per_token("selective")
    assert off - selective == pytest.approx(model_bytes["off"] - model_bytes["selective"], rel=0.01)
    full, _ = _saved_bytes_per_token("full")
    drop = model_bytes["off"] - model_bytes["full"]
    assert drop <= off - full <= 1.5 * drop, (off - full, drop)


@pytest.mark.fast
def test_estimate_knows_recompute():
    """estimate(): the activation term drops by the factor-scaled model drop per token, nothing
    else changes; at 8 GPUs full recompute is what lets the real depth fit (docs/performance.md)."""
    from pithtrain.config import apply_override, load_run_config

    est = _estimator()
    config = load_run_config("benchmarks/qwen3_width.py")
    apply_override(config, "train.micro_batch_size=4")
    apply_override(config, "model.num_hidden_layers=9")
    tokens = 4 * config.data.seq_len
    results = {}
    for mode in ("off", "selective", "full"):
        config.train.recompute = mode
        results[mode] = est.estimate(config, 1)[0]
        per_layer = sum(est.layer_activation_bytes(config.model, i, 0, mode) for i in range(9))
        results[mode + "_layers"] = est.ACTIVATION_FACTOR * tokens * per_layer / est.GIB
    for mode in ("selective", "full"):
        drop = results["off"]["activations"] - results[mode]["activations"]
        assert drop == pytest.approx(results["off_layers"] - results[mode + "_layers"], rel=1e-9)
        assert 0 < drop and results[mode]["total"] == pytest.approx(results["off"]["total"] - drop, rel=1e-9)
    assert results["full"]["activations"] < results["selective"]["activations"] < results["off"]["activations"]
    # the 48-layer Qwen3-30B-A3B on 8 GPUs (ep8, micro-batch 1): only with full recompute inside 95% of an H200
    config = load_run_config("examples/qwen3_30b_a3b.py")
    config.parallel.ep = 8
    totals = {}
    for mode in ("off", "full"):
        config.train.recompute = mode
        totals[mode] = max(r["total"] for r in est.estimate(config, 8))
    assert totals["full"] <= 0.95 * 139 < totals["off"], totals
    # Qwen3.5 under cp: a Gated DeltaNet layer saves its mixer's tensors over the gathered sequence (full attention does not)
    config = load_run_config("examples/qwen3_5_35b_a3b.py")
    cfg, acts = config.model, {}
    for i in (0, 3):
        assert (est.layer_activation_bytes(cfg, i, 0, "off", 2) > est.layer_activation_bytes(cfg, i, 0, "off")) == (
            cfg.layer_type(i) == "linear_attention")
    for cp in (1, 2):  # two ranks: cp2 against dp2, the same micro-batch
        config.parallel.cp = cp
        acts[cp] = est.estimate(config, 2)[0]["activations"]
    assert acts[2] > 0.6 * acts[1], acts  # not half: the linear layers hold the whole sequence


@pytest.mark.fast
def test_fp8_with_recompute_trains_like_fp8(tmp_path, dataset_dir):
    """FP8 (emulated): the recomputed stages quantize again with the cached weight layouts; losses
    and gradient norms (step 2's loss reads step 1's update) equal the run without recompute."""
    from pithtrain.train.loop import train

    def run(mode):
        cfg = tiny_config(dataset_dir, steps=3, lb_coef=0.1)
        cfg.train.fp8, cfg.train.fp8_emulate, cfg.train.recompute = "rowwise", True, mode
        return train(cfg, tmp_path / mode, echo=False)

    ref = run("off")
    for mode in ("selective", "full"):
        for a, b in zip(ref, run(mode), strict=True):
            for key in ("loss", "lb_loss", "grad_norm"):
                assert b[key] == pytest.approx(a[key], rel=1e-6), (mode, key)


@pytest.mark.fast
@pytest.mark.parametrize("mode", ["off", "selective"])
def test_selective_really_frees_the_activation(mode, monkeypatch):
    """Memory, not only the saved-tensor count: after the forward, the experts' SwiGLU outputs are
    still alive with recompute off and gone with selective (a hook holding on to them, as a closure
    did once, would keep the memory while the counted saved tensors shrink)."""
    import gc
    import weakref

    from pithtrain.ops import kernels

    outputs = []

    def recorded_swiglu(gate_up, original=kernels.swiglu):
        out = original(gate_up)
        outputs.append(weakref.ref(out))
        return out

    monkeypatch.setattr(kernels, "swiglu", recorded_swiglu)  # what grouped_gemm.activation_mm calls
    model = _model("qwen3", mode)
    ids, pos, gen = _batch(model.cfg)
    queue = DeferredWeightGrads(accumulate_grad)
    logits = model(ids, pos, ExpertEngine(LocalDispatch(), LoadBalance("micro", None), *ids.shape, weight_queue=queue))
    gc.collect()
    alive = [ref() is not None for ref in outputs]
    assert outputs and all(alive) if mode == "off" else not any(alive), (mode, alive)
    (logits * torch.randn(logits.shape, generator=gen)).sum().backward()  # the recomputation still works
    queue.run()
    assert all(p.grad is not None for n, p in model.named_parameters() if ".experts." in n)
