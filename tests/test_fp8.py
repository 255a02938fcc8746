"""FP8 row-wise training (ops/fp8.py) on the CPU, where the recipe is emulated in plain PyTorch.

Against float64 computations of the recipe and of the unquantized math: quantization scales and
round-trip bounds, FP8 Linear and expert GEMM outputs and gradients, the per-version weight cache
(invalidated by an optimizer step and by a weight load, refreshed in place), training close to fp32
with a bit-exact resume, FP8 <-> bf16 resumes, an HF import, nothing FP8 in a checkpoint, and the
refusals of bad input. Mesh invariance with FP8 is in test_parallel.py; the GPU kernels against this
reference in tests/gpu/test_fp8_gpu.py.
"""

import pytest
import torch
from torch import nn

from conftest import tiny_config
from pithtrain.config import ConfigError, validate
from pithtrain.ops import fp8, grouped_gemm, kernels
from pithtrain.train import checkpoint as ckpt
from pithtrain.train import loop
from pithtrain.train.optim import build_optimizer, optimizer_step

E4M3_STEP = 2.0**-4  # half the spacing of e4m3's 3 mantissa bits, relative, for normal values


@pytest.mark.fast
def test_scales_and_round_trip_bounds():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(64, 200, generator=gen) * torch.logspace(-6, 3, 64).unsqueeze(1)  # rows over 9 decades
    x[5] = 0
    q, s = fp8.quantize_reference(x)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    amax = x.abs().amax(1)
    assert torch.allclose(s[amax > 0], amax[amax > 0] / 448, rtol=1e-7)
    assert q.float().abs().amax(1)[amax > 0].eq(448).all()  # each row's largest value lands on e4m3's max
    back = fp8.dequantize(q, s)
    assert back[5].eq(0).all()
    # normal range: relative error <= 2^-4; subnormals (below 2^-6 s): absolute <= 2^-10 s
    bound = torch.maximum(E4M3_STEP * x.abs(), 2.0**-10 * s.unsqueeze(1)) * (1 + 1e-6)
    assert ((back - x).abs() <= bound).all()
    assert ((back - x).abs() > 0.2 * bound).any()  # the bound is tight, not vacuous


@pytest.mark.fast
def test_transposed_copies_are_per_segment_and_aligned():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(300, 48, generator=gen) * torch.rand(300, 1, generator=gen)
    counts = torch.tensor([70, 0, 130, 100])
    qt, s = fp8.quantize_t_reference(x, counts)
    assert qt.shape == (48, fp8.t_width(300, 4)) and s.shape == (4, 48)
    starts = [0, 128, 128, 384]  # segments start at multiples of 128
    for g, (start, c) in enumerate(zip(starts, counts.tolist())):
        seg = x[sum(counts[:g]) : sum(counts[: g + 1])]
        if c:
            assert torch.allclose(s[g], seg.abs().amax(0) / 448, rtol=1e-7)
            got = fp8.dequantize(qt[:, start : start + c], s[g]).t()
            assert ((got - seg).abs() <= E4M3_STEP * seg.abs() + 2.0**-10 * s[g] * 1.000001).all()
    assert qt[:, 70:128].float().eq(0).all() and qt[:, 258:384].float().eq(0).all()  # padding is zero


def quantized64(x):
    """The recipe's rounding of x (per row), as float64."""
    return fp8.dequantize(*fp8.quantize_reference(x)).double()


def fp8_head_loss_both_ways(w, x, labels, scale: float) -> list[tuple]:
    """The FP8 head under kernels.cross_entropy_sum in place (as training runs it), backward of scale * loss: with
    the logits' slot (the CE backward's FP8 copy of d logits taken), then with it dropped (the head quantizes d
    logits); [(x.grad, w.grad, d logits)] for each, after checking that the slot was let go."""
    from pithtrain.ops import kernels

    got = []
    for fused in (True, False):
        w.grad = None
        xs = x.clone().requires_grad_()
        logits = grouped_gemm.head_logits(xs, w, fp8_head=True)
        slot = logits._fp8_dgrad
        if not fused:
            del logits._fp8_dgrad
        (kernels.cross_entropy_sum(logits, labels, grad_in_place=True) * scale).backward()
        assert slot == {}  # taken and let go (or never filled)
        got.append((xs.grad, w.grad.clone(), logits.detach().clone()))
    return got


def random_fp8_linear(inp: int, out: int, gen, scale: float, recipe=True) -> fp8.Linear:
    """An FP8 Linear with a random weight (times `scale`) and a random bias."""
    layer = fp8.Linear(inp, out, bias=True)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(out, inp, generator=gen) * scale)
        layer.bias.copy_(torch.randn(out, generator=gen))
    layer.fp8 = recipe
    return layer


@pytest.mark.fast
def test_fp8_linear_gradients():
    """Against float64: (a) the recipe exactly (each GEMM's operands rounded as specified), 1e-5;
    (b) the unquantized layer, within e4m3's error (relative Frobenius error < 6%)."""
    gen = torch.Generator().manual_seed(3)
    layer = random_fp8_linear(40, 24, gen, 0.1)
    x = torch.randn(3, 10, 40, generator=gen).requires_grad_()
    dy = torch.randn(3, 10, 24, generator=gen)
    y = layer(x)
    y.backward(dy)
    w, x2, dy2 = layer.weight.detach(), x.detach().reshape(30, 40), dy.reshape(30, 24)
    y_recipe = quantized64(x2) @ quantized64(w).t() + layer.bias.double()
    dx_recipe = quantized64(dy2) @ quantized64(w.t().contiguous()).t()
    dw_recipe = quantized64(dy2.t().contiguous()) @ quantized64(x2.t().contiguous()).t()
    for got, want in ((y.reshape(30, 24), y_recipe), (x.grad.reshape(30, 40), dx_recipe), (layer.weight.grad, dw_recipe)):
        assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    assert torch.allclose(layer.bias.grad.double(), dy2.double().sum(0), rtol=1e-6, atol=1e-5)
    exact = {"y": x2.double() @ w.double().t() + layer.bias.double(), "dx": dy2.double() @ w.double(),
             "dw": dy2.double().t() @ x2.double()}
    for got, want in ((y.reshape(30, 24), exact["y"]), (x.grad.reshape(30, 40), exact["dx"]), (layer.weight.grad, exact["dw"])):
        err = (got.double() - want).norm() / want.norm()
        assert 1e-4 < err < 0.06  # quantized (not exact), within e4m3's step


@pytest.mark.fast
def test_fp8_projections_stack_as_their_parts(monkeypatch):
    """fp8.projections over FP8 Linears of one recipe: one FP8 GEMM forward (and, with FP8 weight gradients, one
    for those), the input gradient one a part; outputs and input, weight and bias gradients equal each Linear
    alone (the quantization is the parts' own; 1e-5, the products' summation order), both recipes, with and
    without biases, under bf16 autocast too. Mixed recipes: each Linear alone."""
    gen = torch.Generator().manual_seed(11)
    gemms = []
    plain_mm = fp8.scaled_mm
    monkeypatch.setattr(fp8, "scaled_mm", lambda a, *rest: gemms.append(a.shape) or plain_mm(a, *rest))
    for recipe, bias, autocast in [("rowwise", True, False), ("rowwise_bf16_wgrad", False, False),
                                   ("rowwise_bf16_wgrad", True, True)]:
        mods = [random_fp8_linear(40, n, gen, 0.1, recipe) for n in (32, 16, 16)]
        twins = [random_fp8_linear(40, n, gen, 0.1, recipe) for n in (32, 16, 16)]
        for m, t in zip(mods, twins):
            if not bias:
                m.bias = t.bias = None
            t.load_state_dict(m.state_dict())
        x = torch.randn(3, 10, 40, generator=gen).requires_grad_()
        x2 = x.detach().clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            gemms.clear()
            outs = fp8.projections(x, *mods)
            assert len(gemms) == 1
            wants = [t(x2) for t in twins]
        dys = [torch.randn(w.shape, generator=gen).to(w.dtype) for w in wants]
        gemms.clear()
        sum((o * d).sum() for o, d in zip(outs, dys)).backward()
        assert len(gemms) == 3 + (recipe == "rowwise")
        sum((w * d).sum() for w, d in zip(wants, dys)).backward()
        pairs = [*zip(outs, wants), (x.grad, x2.grad)] + [(m.weight.grad, t.weight.grad) for m, t in zip(mods, twins)]
        pairs += [(m.bias.grad, t.bias.grad) for m, t in zip(mods, twins) if bias]
        for got, want in pairs:
            assert got.dtype == want.dtype and got.shape == want.shape
            torch.testing.assert_close(got.float(), want.float(), rtol=1e-5, atol=1e-5 * want.abs().max().item())
    monkeypatch.setattr(mods[1], "fp8", "rowwise")
    monkeypatch.setattr(fp8.Linear, "forward", lambda self, x: ("own", self))
    assert fp8.projections(x, *mods) == tuple(("own", m) for m in mods)


@pytest.mark.fast
def test_fp8_expert_gemm_gradients_and_deferred_weight_pass():
    from pithtrain.ops.grouped_gemm import DeferredWeightGrads, accumulate_grad

    gen = torch.Generator().manual_seed(4)
    experts = nn.Module()
    experts.w = nn.Parameter(torch.randn(4, 32, 48, generator=gen) * 0.1)
    counts = torch.tensor([9, 0, 21, 14])
    x = torch.randn(44, 32, generator=gen).requires_grad_()
    dy = torch.randn(44, 48, generator=gen)
    y = grouped_gemm.fp8_expert_mm(x, experts, "w", counts, torch.float32)
    y.backward(dy)
    rows = [slice(0, 9), slice(9, 9), slice(9, 30), slice(30, 44)]
    for e, r in enumerate(rows):
        if r.start == r.stop:
            assert experts.w.grad[e].eq(0).all()
            continue
        want_y = quantized64(x.detach()[r]) @ quantized64(experts.w.detach()[e].t().contiguous()).t()
        want_dx = quantized64(dy[r]) @ quantized64(experts.w.detach()[e]).t()
        want_dw = quantized64(x.detach()[r].t().contiguous()) @ quantized64(dy[r].t().contiguous()).t()
        for got, want in ((y[r], want_y), (x.grad[r], want_dx), (experts.w.grad[e], want_dw)):
            assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    # deferred: the same weight gradient, delivered by the queue's W pass
    queue = DeferredWeightGrads(accumulate_grad)
    other = nn.Module()
    other.w = nn.Parameter(experts.w.detach().clone())
    grouped_gemm.fp8_expert_mm(x.detach().requires_grad_(), other, "w", counts, torch.float32, queue).backward(dy)
    assert other.w.grad is None and len(queue.work) == 1
    queue.run()
    assert torch.equal(other.w.grad, experts.w.grad)


@pytest.mark.fast
def test_fp8_head(monkeypatch):
    """train.fp8_head (grouped_gemm.head_logits): logits and the input gradient are the recipe's FP8
    GEMMs (float64 of the rounded operands, 1e-5); the weight gradient the plain product, returned
    for an fp32 computation (1e-5) and added into an fp32 master's .grad by the GEMM for bf16
    activations (bf16's tolerance); the weight's FP8 layouts come from the tensor's own cache; an
    enabled model's head and the pipeline's take it, its eval (no grad) does not."""
    monkeypatch.setattr(grouped_gemm, "HEAD_DGRAD_ROWS", 4)  # the input gradient by blocks of 4, 4, 2 rows
    gen = torch.Generator().manual_seed(11)
    w = nn.Parameter(torch.randn(48, 32, generator=gen) * 0.1)  # [vocab, hidden]
    x = torch.randn(2, 5, 32, generator=gen).requires_grad_()
    dy = torch.randn(2, 5, 48, generator=gen)
    logits = grouped_gemm.head_logits(x, w, fp8_head=True)
    logits.backward(dy)
    x2, dy2 = x.detach().reshape(10, 32), dy.reshape(10, 48)
    want = {"y": quantized64(x2) @ quantized64(w.detach()).t(),
            "dx": quantized64(dy2) @ quantized64(w.detach().t().contiguous()).t(), "dw": dy2.double().t() @ x2.double()}
    for got, ref in ((logits.reshape(10, 48), want["y"]), (x.grad.reshape(10, 32), want["dx"]), (w.grad, want["dw"])):
        assert torch.allclose(got.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    plain = x2.double() @ w.detach().double().t()
    assert 1e-4 < (logits.reshape(10, 48).double() - plain).norm() / plain.norm() < 0.06  # FP8, not the bf16 GEMM
    cache = fp8.cached_param(w)
    assert fp8.cached_param(w) is cache and w._fp8_cache["weight"] is cache
    w.grad = torch.ones_like(w)  # bf16 activations: the weight gradient accumulates into the fp32 .grad
    xb = x.detach().bfloat16().requires_grad_()
    grouped_gemm.head_logits(xb, w, fp8_head=True).backward(dy.bfloat16())
    ref = 1 + dy2.bfloat16().double().t() @ x2.bfloat16().double()
    assert w.grad.dtype == torch.float32 and torch.allclose(w.grad.double(), ref, rtol=1e-2, atol=1e-2)
    assert xb.grad.dtype == torch.bfloat16
    with torch.no_grad():  # eval: the plain GEMM
        assert torch.equal(grouped_gemm.head_logits(x, w, fp8_head=True), torch.nn.functional.linear(x, w))
    from pithtrain.parallel.pipeline import ChunkPair, build_chunks

    model = tiny_config("x").model.build_model()
    fp8.enable_fp8(model, compiled=False, recipe="rowwise", head=True)
    assert model.head_fp8 is True
    fp8.enable_fp8(model, compiled=False, recipe="rowwise")
    assert model.head_fp8 is False
    from pithtrain.protocol import all_layers

    for combine_copy in (False, True):  # compiled stages (lazily: nothing compiles here); stage 5 eager for the copy
        model = tiny_config("x").model.build_model()
        loop.compile_stages(model)
        monkeypatch.setattr(kernels, "COMBINE_FP8_GRAD", combine_copy)
        fp8.enable_fp8(model, compiled=True, recipe="rowwise_bf16_wgrad")
        layers = all_layers(model).values()
        assert all(("stage5" in layer.__dict__) != combine_copy and "stage1" in layer.__dict__ for layer in layers)
    chunks = build_chunks(tiny_config("x").model, 2, 0, seed=0)  # rank 0 of pp2 holds the head chunk
    pair = ChunkPair(*chunks)
    fp8.enable_fp8(pair, compiled=False, recipe="rowwise", head=True)  # the pair does not hold its chunks as modules:
    assert [c.head_fp8 for c in chunks] == [False, False]  # the loop enables each chunk (loop.build_model)
    for chunk in chunks:
        fp8.enable_fp8(chunk, compiled=False, recipe="rowwise", head=True)
    assert [c.head_fp8 for c in chunks] == [True, True] and chunks[1].lm_head is not None


@pytest.mark.fast
def test_weight_cache_is_reused_and_invalidated():
    layer = fp8.Linear(16, 16, bias=False)
    first = fp8.cached_weight(layer, "weight", True)
    tensors = [t for t in (*first.fwd, *first.bwd)]
    snapshot = [t.clone() for t in tensors]
    assert fp8.cached_weight(layer, "weight", True) is first  # same version: no new quantization
    params = list(layer.parameters())
    layer.weight.grad = torch.randn(16, 16)
    opt = build_optimizer(list(layer.named_parameters()), tiny_config("x").optim, "cpu")
    optimizer_step(opt, params)
    again = fp8.cached_weight(layer, "weight", True)
    assert again is first and all(a is b for a, b in zip((*again.fwd, *again.bwd), tensors))  # refreshed in place
    assert any(not torch.equal(a, b) for a, b in zip(tensors, snapshot))
    assert torch.equal(fp8.dequantize(*again.fwd).float(), fp8.dequantize(*fp8.quantize_reference(layer.weight.detach())))
    # FSDP2 steps the shards, then its all-gather writes them into this unsharded weight keeping its version
    # counter and address: the step alone must renew the layouts
    layer.weight.grad = None
    with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(layer.weight):
        layer.weight.mul_(2)
    optimizer_step(opt, [])
    assert torch.equal(fp8.dequantize(*fp8.cached_weight(layer, "weight", True).fwd),
                       fp8.dequantize(*fp8.quantize_reference(layer.weight.detach())))
    layer.load_state_dict({"weight": torch.randn(16, 16)})  # a checkpoint/HF load copies in place: a new version
    assert torch.equal(fp8.dequantize(*fp8.cached_weight(layer, "weight", True).fwd),
                       fp8.dequantize(*fp8.quantize_reference(layer.weight.detach())))


def fp8_config(dataset_dir, **kw):
    """FP8 training with the LM head in FP8 too (train.fp8_head)."""
    cfg = tiny_config(dataset_dir, **kw)
    cfg.train.fp8, cfg.train.fp8_emulate, cfg.train.fp8_head = "rowwise", True, True
    return cfg


def test_training_resume_and_checkpoints(tmp_path, dataset_dir):
    plain = loop.train(tiny_config(dataset_dir, steps=6), tmp_path / "fp32", echo=False)
    full = loop.train(fp8_config(dataset_dir, steps=6, checkpoint_every=2), tmp_path / "a", echo=False)
    for a, b in zip(plain, full):  # close to fp32, not equal to it
        assert b["loss"] == pytest.approx(a["loss"], rel=2e-3)
    assert any(a["loss"] != b["loss"] for a, b in zip(plain, full))
    # stop at 4, resume: bit-exact to the uninterrupted FP8 run (the cache is rebuilt after the load)
    loop.train(fp8_config(dataset_dir, steps=6, checkpoint_every=2), tmp_path / "b", echo=False, stop_after=4)
    resumed = loop.train(fp8_config(dataset_dir, steps=6, checkpoint_every=2), tmp_path / "b", echo=False)
    assert [(m["loss"], m["grad_norm"]) for m in resumed] == [(m["loss"], m["grad_norm"]) for m in full[4:]]
    # nothing FP8 in the checkpoint: master weights and optimizer state only, the same keys as without FP8
    import torch.distributed.checkpoint as dcp

    saved = {path: dcp.FileSystemReader(str(ckpt.resolve_checkpoint(run))).read_metadata().state_dict_metadata
             for path, run in (("fp8", tmp_path / "a"), ("fp32", tmp_path / "fp32"))}
    dtypes = {m.properties.dtype for m in saved["fp8"].values() if hasattr(m, "properties")}
    assert dtypes == {torch.float32}, dtypes
    assert set(saved["fp8"]) == set(saved["fp32"])
    # FP8 run resumed without FP8, and a bf16/fp32 run resumed with FP8
    loop.train(tiny_config(dataset_dir, steps=6, checkpoint_every=2), tmp_path / "a", echo=False, steps=8)
    loop.train(tiny_config(dataset_dir, steps=4, checkpoint_every=2), tmp_path / "c", echo=False)
    more = loop.train(fp8_config(dataset_dir, steps=6, checkpoint_every=2), tmp_path / "c", echo=False)
    assert [m["step"] for m in more] == [5, 6] and all(m["loss"] < plain[0]["loss"] for m in more)


@pytest.mark.fast
def test_hf_import_refreshes_the_cache(tmp_path, dataset_dir):
    """A model that ran FP8 forwards, then loaded HF weights: its next forward uses the new weights."""
    cfg = tiny_config(dataset_dir).model
    source = cfg.build_model()
    source.init_weights(seed=5)
    hf = source.hf_state_dict()
    model = cfg.build_model()
    model.init_weights(seed=6)
    fp8.enable_fp8(model, compiled=False)
    from pithtrain.parallel.expert import ExpertEngine, LocalDispatch

    ids = torch.randint(0, cfg.vocab_size, (2, 16))
    pos = torch.arange(16).expand(2, 16)
    model(ids, pos, ExpertEngine(LocalDispatch()))  # fills the caches with seed 6's weights
    model.load_hf_state_dict(hf)
    got = model(ids, pos, ExpertEngine(LocalDispatch()))
    fresh = cfg.build_model()
    fresh.load_hf_state_dict(hf)
    fp8.enable_fp8(fresh, compiled=False)
    assert torch.equal(got, fresh(ids, pos, ExpertEngine(LocalDispatch())))
    ref = source.reference_forward(ids)
    assert ((got - ref).norm() / ref.norm()) < 0.05  # FP8 of the imported weights, not of the old ones


@pytest.mark.fast
def test_bad_fp8_input_is_refused(dataset_dir):
    cfg = tiny_config(dataset_dir)
    cfg.train.fp8 = "tensorwise"
    with pytest.raises(ConfigError, match=r"train.fp8=.tensorwise.: use off, rowwise or rowwise_bf16_wgrad"):
        validate(cfg)
    cfg.train.fp8, cfg.train.device = "rowwise", "cpu"
    with pytest.raises(ConfigError, match=r"train.fp8=rowwise on the CPU.*train.fp8_emulate=true"):
        validate(cfg)
    cfg.train.fp8_emulate = True
    validate(cfg)
    cfg.train.fp8, cfg.train.fp8_emulate, cfg.train.fp8_head = "off", False, True
    with pytest.raises(ConfigError, match=r"train.fp8_head=true needs FP8 GEMMs: set train.fp8=rowwise_bf16_wgrad"):
        validate(cfg)
    # sizes torch._scaled_mm refuses on a GPU are refused on the CPU too, not left to a silent bf16 head or a GPU error
    cfg.train.fp8, cfg.train.fp8_emulate, cfg.model.vocab_size = "rowwise", True, 4097
    with pytest.raises(ConfigError, match=r"model.vocab_size=4097, model.hidden_size=32; pad the vocabulary"):
        validate(cfg)
    cfg.model.vocab_size = 4096
    assert loop.fp8_text(cfg.train) == ", FP8 rowwise + head (emulated)" and loop.fp8_text(tiny_config("x").train) == ""
    cfg.model.hidden_size, cfg.train.fp8_head = 40, False
    validate(cfg)
    with pytest.raises(ConfigError, match=r"train.fp8=rowwise: .* multiples of 16, and layers.0.self_attn.q_proj "
                                          r"\[\d+ x 40\] \(and \d+ more\) is not"):
        fp8.enable_fp8(cfg.model.build_model(), compiled=False, recipe="rowwise")


@pytest.mark.fast
def test_bf16_weight_gradient_recipe():
    """rowwise_bf16_wgrad: forward and input gradient as in `rowwise`, the weight gradient the plain
    product (fp32 on the CPU) of the saved activations, for Linear and the expert GEMM, queued too."""
    from pithtrain.ops.grouped_gemm import DeferredWeightGrads, accumulate_grad

    gen = torch.Generator().manual_seed(7)
    layer = fp8.Linear(40, 24, bias=False)
    layer.fp8 = "rowwise_bf16_wgrad"
    x, dy = torch.randn(30, 40, generator=gen).requires_grad_(), torch.randn(30, 24, generator=gen)
    layer(x).backward(dy)
    assert torch.allclose(layer.weight.grad.double(), dy.double().t() @ x.detach().double(), rtol=1e-5, atol=1e-5)
    assert torch.allclose(x.grad.double(), quantized64(dy) @ quantized64(layer.weight.detach().t().contiguous()).t(),
                          rtol=1e-5, atol=1e-5)
    experts = nn.Module()
    experts.fp8 = "rowwise_bf16_wgrad"
    experts.w = nn.Parameter(torch.randn(3, 32, 48, generator=gen) * 0.1)
    counts = torch.tensor([10, 0, 20])
    xe, dye = torch.randn(30, 32, generator=gen).requires_grad_(), torch.randn(30, 48, generator=gen)
    queue = DeferredWeightGrads(accumulate_grad)
    grouped_gemm.fp8_expert_mm(xe, experts, "w", counts, torch.float32, queue).backward(dye)
    queue.run()
    want = torch.stack([xe[:10].double().t() @ dye[:10].double(), torch.zeros(32, 48, dtype=torch.float64),
                        xe[10:].double().t() @ dye[10:].double()])
    assert torch.allclose(experts.w.grad.double(), want.detach(), rtol=1e-5, atol=1e-5)


@pytest.mark.fast
def test_fp8_activation_feeds_its_own_quantization(monkeypatch):
    """activation_mm on FP8 experts: the down GEMM takes the activation's FP8 copy from the activation
    (fp8.glu_quantized) instead of quantizing it again (one quantization in the forward, not two);
    the output and h's gradient match float64 math of the recipe (SwiGLU and GPT-OSS's clamped one),
    with the activation recomputed for the backward too."""
    from pithtrain.ops import core, kernels

    gen = torch.Generator().manual_seed(12)
    counts = torch.tensor([7, 0, 13])
    h0, dy = torch.randn(20, 2 * 24, generator=gen) * 2, torch.randn(20, 16, generator=gen)
    calls = []
    quantize = fp8.quantize
    monkeypatch.setattr(fp8, "quantize", lambda x: calls.append(x.shape) or quantize(x))
    for clamp, act64 in ((None, core.swiglu), ((1.702, 1.5), lambda t: kernels.clamped_swiglu_reference(t, 1.702, 1.5))):
        for recompute in (False, True):
            experts = nn.Module()
            experts.fp8, experts.recompute_act = "rowwise_bf16_wgrad", recompute
            experts.down = nn.Parameter(torch.randn(3, 24, 16, generator=gen) * 0.2)
            h = h0.clone().requires_grad_()
            calls.clear()
            y = grouped_gemm.activation_mm(h, experts, counts, torch.float32, clamp=clamp)
            assert [c for c in calls if c[0] == 20] == [(20, 24)]  # in glu_quantized; not again in the GEMM
            y.backward(dy)
            h64 = h0.double().requires_grad_()
            a64 = act64(h64)
            want_y = torch.cat([quantized64(a64.detach()[r].float()) @ quantized64(experts.down.detach()[e].t().contiguous()).t()
                                for e, r in ((0, slice(0, 7)), (2, slice(7, 20)))])
            assert torch.allclose(y.double(), want_y, rtol=1e-5, atol=1e-5)
            da = torch.cat([quantized64(dy[r]) @ quantized64(experts.down.detach()[e]).t()
                            for e, r in ((0, slice(0, 7)), (2, slice(7, 20)))])
            a64.backward(da)
            assert torch.allclose(h.grad.double(), h64.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.fast
def test_fp8_experts_take_their_input_quantized_by_the_dispatch(monkeypatch):
    """LocalDispatch offers the expanded rows' FP8 copy made from the T tokens (fp8.expand_quantized): bit for
    bit quantize() of the T*k rows; FP8 experts take it (one quantization of T rows, none of T*k; the offer is
    dropped from the rows once taken) with the same output, and without grouped_gemm.EXPAND_FP8 they quantize
    the rows themselves."""
    from pithtrain.parallel.expert import LocalDispatch
    from pithtrain.protocol import RoutingInfo

    gen = torch.Generator().manual_seed(14)
    tokens, hidden, experts_n, topk = 10, 32, 4, 2
    x = torch.randn(tokens, hidden, generator=gen)
    ids = torch.stack([torch.randperm(experts_n, generator=gen)[:topk] for _ in range(tokens)])
    routing = RoutingInfo(ids, torch.rand(tokens, topk, generator=gen), torch.rand(tokens, experts_n), experts_n)
    experts = nn.Module()
    experts.fp8 = "rowwise_bf16_wgrad"
    experts.w = nn.Parameter(torch.randn(experts_n, hidden, 16, generator=gen) * 0.2)
    fp8.cached_weight(experts, "w", contraction_last=False)  # the weight's layouts first: the spy sees activations
    quantized, quantize = [], fp8.quantize
    monkeypatch.setattr(fp8, "quantize", lambda t: quantized.append(t.shape[0]) or quantize(t))
    outs = []
    for offered in (True, False):
        monkeypatch.setattr(grouped_gemm, "EXPAND_FP8", offered)
        rows, counts, order = LocalDispatch().dispatch(x, routing)
        if offered:
            q, s = rows._fp8_rows()
            want_q, want_s = fp8.quantize_reference(rows)
            assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(s, want_s)
        quantized.clear()
        outs.append(grouped_gemm.fp8_expert_mm(rows, experts, "w", counts, torch.float32))
        assert quantized == ([tokens] if offered else [tokens * topk]) and hasattr(rows, "_fp8_rows") != offered
    assert torch.equal(outs[0], outs[1])
