"""Triton kernels of pithtrain.ops.kernels on CUDA against their plain-PyTorch references (skipped without
CUDA): fresh random inputs, outputs and gradients, empty expert groups, cross-entropy at real
vocabulary sizes in bf16 and fp32, and bit-identical gradients run to run.

Tolerances: fp32 results agree with the reference (or float64) to ~1e-6 relative; bf16 results to one
bf16 rounding (the kernels compute in fp32 and round once, the references round after each op), checked
as relative error against float64 no worse than the reference's own. Gathers, scatters, the dispatch
plan and the bias add are exact.
"""

import threading

import pytest
import torch

from pithtrain.ops import core, kernels
from test_kernels import grads, rel_err  # the CPU kernel tests' helpers

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")  # Triton: a test dependency
BF16, FP32 = torch.bfloat16, torch.float32


def check_against_float64(fn, ref, inputs, grad_out, dtype):
    """Kernel vs reference in `dtype`, both measured against the reference in float64."""
    out, dx = grads(fn, inputs, grad_out)
    ref_out, ref_dx = grads(ref, inputs, grad_out)
    exact_out, exact_dx = grads(ref, [x.double() if x.is_floating_point() else x for x in inputs], grad_out.double())
    assert out.dtype == ref_out.dtype and out.shape == ref_out.shape
    for a, b, exact in [(out, ref_out, exact_out), *zip(dx, ref_dx, exact_dx)]:
        if exact.numel() == 0:
            continue
        if dtype == FP32:
            assert rel_err(a, exact) < 2e-6
        else:
            assert rel_err(a, exact) < 5e-3 and rel_err(a, exact) <= 1.05 * rel_err(b, exact) + 1e-4


def routed_ids(tokens, topk, experts, empty=()):
    allowed = torch.tensor([e for e in range(experts) if e not in empty], device="cuda")
    scores = torch.rand(tokens, len(allowed), device="cuda")
    return allowed[scores.topk(topk, dim=1).indices]


@pytest.mark.parametrize("dtype", [BF16, FP32])
@pytest.mark.parametrize("shape", [(4099, 2 * 384), (333, 2 * 1440), (0, 64)])
def test_glu_kernels(dtype, shape):
    x = torch.randn(shape, device="cuda") * 4  # beyond the clamp limit often
    dy = torch.randn(shape[0], shape[1] // 2, device="cuda", dtype=dtype)
    x = x.to(dtype)
    assert kernels.use_triton(x)
    check_against_float64(kernels.swiglu, core.swiglu, [x], dy, dtype)
    check_against_float64(lambda t: kernels.clamped_swiglu(t, 1.702, 7.0),
                          lambda t: kernels.clamped_swiglu_reference(t, 1.702, 7.0), [x], dy, dtype)


@pytest.mark.parametrize("dtype, hidden", [(BF16, 2048), (FP32, 1000)])
def test_permute_unpermute(dtype, hidden):
    t, k, e = 4096, 8, 128
    ids = routed_ids(t, k, e, empty=range(0, e, 8))  # 16 empty expert groups
    order = torch.argsort(ids.flatten(), stable=True)
    assert torch.bincount(ids.flatten(), minlength=e)[::8].sum() == 0
    x = torch.randn(t, hidden, device="cuda", dtype=dtype)
    dy = torch.randn(t * k, hidden, device="cuda", dtype=dtype)
    assert torch.equal(kernels.permute(x, order // k), kernels.permute_reference(x, order // k))
    check_against_float64(kernels.permute, kernels.permute_reference, [x, order // k], dy, dtype)
    # LocalDispatch's expand: each row stored at its k places, the backward without a sort
    fresh = torch.randn_like(x)  # not x: a freed buffer holds x's permutation
    assert torch.equal(kernels.expand(fresh, order, k), kernels.permute_reference(fresh, order // k))
    check_against_float64(lambda a: kernels.expand(a, order, k), lambda a: kernels.permute_reference(a, order // k),
                          [fresh], dy, dtype)
    y, (dy_y,) = grads(lambda a: kernels.unpermute(a, order, t * k), [dy], dy.flip(0))
    ref, (ref_dy,) = grads(lambda a: kernels.unpermute_reference(a, order, t * k), [dy], dy.flip(0))
    assert torch.equal(y, ref) and torch.equal(dy_y, ref_dy)
    # the expert-parallel receiver: 1..k copies per row, rows never picked
    index = torch.randint(0, t, (3 * t,), device="cuda")
    check_against_float64(kernels.permute, kernels.permute_reference, [x, index], dy[: 3 * t], dtype)
    first = grads(kernels.permute, [x, index], dy[: 3 * t])[1][0]
    assert torch.equal(first, grads(kernels.permute, [x, index], dy[: 3 * t])[1][0])  # deterministic


@pytest.mark.parametrize("tokens, topk, experts, ep, empty", [
    (4096, 8, 128, 8, ()),
    (2048, 8, 256, 64, range(8, 16)),  # rank 2 receives nothing
    (333, 6, 96, 3, ()),
    (1000, 1, 8, 1, ()),
    (0, 8, 128, 8, ()),
])
def test_dispatch_plan_matches_reference_exactly(tokens, topk, experts, ep, empty):
    ids = routed_ids(tokens, topk, experts, empty)
    plan = kernels.dispatch_plan(ids, experts // ep, ep)
    ref = kernels.dispatch_plan_reference(ids, experts // ep, ep)
    for name, a, b in zip(plan._fields, plan, ref):
        assert a.dtype == b.dtype and torch.equal(a, b), name


@pytest.mark.parametrize("dtype, dim", [(BF16, 2880), (FP32, 4096)])
def test_expert_bias_add(dtype, dim):
    counts = torch.randint(0, 600, (32,), device="cuda")
    counts[[0, 7, 31]] = 0
    x = torch.randn(int(counts.sum()), dim, device="cuda", dtype=dtype)
    bias = torch.randn(32, dim, device="cuda")  # fp32 parameter, rounded to x's dtype as the model does
    dy = torch.randn_like(x)
    out, (dx, dbias) = grads(kernels.expert_bias_add, [x, bias, counts], dy)
    ref, (ref_dx, _) = grads(kernels.expert_bias_add_reference, [x, bias, counts], dy)
    assert torch.equal(out, ref) and torch.equal(dx, ref_dx)
    sums = torch.stack([rows.double().sum(0) for rows in dy.split(counts.tolist())])
    assert rel_err(dbias, sums) < 1e-6 and (dbias[[0, 7, 31]] == 0).all()
    assert torch.equal(dbias, grads(kernels.expert_bias_add, [x, bias, counts], dy)[1][1])  # deterministic


@pytest.mark.parametrize("vocab", [32000, 128000, 200064])
@pytest.mark.parametrize("dtype", [BF16, FP32])
def test_cross_entropy(vocab, dtype):
    logits = (torch.randn(2, 512, vocab, device="cuda") * 2).to(dtype)
    labels = torch.randint(0, vocab, (2, 512), device="cuda")
    labels[torch.rand(2, 512, device="cuda") < 0.1] = -100
    grad_out = torch.tensor(0.37, device="cuda")
    loss, (dlogits,) = grads(kernels.cross_entropy_sum, [logits, labels], grad_out)
    ref, (ref_dlogits,) = grads(core.cross_entropy_sum, [logits, labels], grad_out)
    assert loss.dtype == FP32 and dlogits.dtype == dtype and dlogits.shape == logits.shape
    assert abs(loss.item() - ref.item()) <= 1e-5 * abs(ref.item())
    # fp32: same softmax to ~1e-6 relative; bf16: the same fp32 values rounded once (at most one ulp apart)
    rtol = 1e-4 if dtype == FP32 else 1e-2
    torch.testing.assert_close(dlogits, ref_dlogits, rtol=rtol, atol=1e-7)
    assert (dlogits[labels == -100] == 0).all()


def test_cross_entropy_gradient_in_place_equals_the_plain_one_without_a_second_buffer():
    """cross_entropy_sum(grad_in_place=True), as the training loop calls it: the same loss and gradient bit for bit
    as the plain path, written over the logits (the LM head's non-leaf output), so the backward's peak memory is
    lower by about one logits-sized buffer (1.2 GB here)."""
    labels = torch.randint(0, 151936, (4096,), device="cuda")
    labels[::5] = -100
    x = torch.randn(4096, 64, device="cuda", dtype=BF16)
    w = torch.randn(151936, 64, device="cuda", dtype=BF16) * 0.3
    results = []
    for in_place in (False, True):
        w_leaf = w.clone().requires_grad_()
        logits = x @ w_leaf.T
        loss = kernels.cross_entropy_sum(logits, labels, grad_in_place=in_place)
        del logits
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        loss.backward()
        results.append((loss, w_leaf.grad, torch.cuda.max_memory_allocated() - start))
    (loss, grad, peak), (loss_ip, grad_ip, peak_ip) = results
    assert torch.equal(loss, loss_ip) and torch.equal(grad, grad_ip)
    assert peak - peak_ip >= 0.9 * 4096 * 151936 * 2, (peak, peak_ip)


def test_cross_entropy_backward_is_bit_identical_run_to_run():
    logits = torch.randn(2048, 200064, device="cuda", dtype=BF16)
    labels = torch.randint(0, 200064, (2048,), device="cuda")
    labels[::7] = -100
    one = torch.tensor(1.0, device="cuda")
    loss1, (g1,) = grads(kernels.cross_entropy_sum, [logits, labels], one)
    loss2, (g2,) = grads(kernels.cross_entropy_sum, [logits, labels], one)
    assert torch.equal(loss1, loss2) and torch.equal(g1, g2)


@pytest.mark.parametrize("dtype", [FP32, BF16])
def test_local_dispatch_round_trip_on_cuda_matches_the_cpu(dtype):
    """LocalDispatch uses the Triton permute on CUDA, stage 5 the fused weighted combine: dispatch ->
    per-row scale -> combine -> weighted sum gives the CPU (index_select/index_copy, then the sum)
    result, values and gradients of the input and the weights; bf16 within its rounding (the
    kernels sum in fp32)."""
    from pithtrain.protocol import RoutingInfo
    from pithtrain.parallel.expert import LocalDispatch

    tokens, topk, experts, hidden = 1000, 4, 16, 2304  # hidden above the kernels' column block
    ids = routed_ids(tokens, topk, experts, empty=(3, 7))
    x = torch.randn(tokens, hidden, device="cuda", dtype=dtype)
    weights = torch.rand(tokens, topk, device="cuda")
    scale = torch.rand(tokens * topk, 1, device="cuda", dtype=dtype) + 0.5
    grad_out = torch.randn(tokens, hidden, device="cuda", dtype=dtype)

    def run(device):
        xi = x.detach().to(device).clone().requires_grad_()  # fresh leaves per run
        wi = weights.detach().to(device).clone().requires_grad_()
        routing = RoutingInfo(ids.to(device), wi, None, experts)
        dispatch = LocalDispatch()
        rows, counts, handle = dispatch.dispatch(xi, routing)
        out = kernels.weighted_combine(*dispatch.combine(rows * scale.to(device), handle), wi)
        out.backward(grad_out.to(device))
        return [t.detach().float().cpu().clone() for t in (out, xi.grad, wi.grad)] + [counts.cpu()]

    *got, counts = run("cuda")
    *ref, ref_counts = run("cpu")
    assert torch.equal(counts, ref_counts) and counts[3] == 0 and counts[7] == 0
    tol = 1e-6 if dtype == FP32 else 1e-2
    for name, a, b in zip(("out", "dx", "dweights"), got, ref):
        assert rel_err(a, b) < tol, name


@pytest.mark.parametrize("shape", [(128, 2048, 1536), (3, 1001)])
def test_add_into_accumulates_bf16_into_fp32_exactly(shape):
    """The gradient accumulation kernel: fp32 += bf16 and fp32 = bf16 equal PyTorch's cast-then-add bit for bit."""
    dst = torch.randn(shape, device="cuda")
    src = torch.randn(shape, device="cuda", dtype=BF16)
    expected = dst + src.float()
    assert torch.equal(kernels.add_into(dst, src), expected)
    assert torch.equal(kernels.add_into(torch.empty_like(dst), src, assign=True), src.float())


@pytest.mark.parametrize("k_dim, m_dim", [(2048, 1536), (768, 2048), (200, 72)])  # Qwen3 gate_up, down; ragged
@pytest.mark.parametrize("assign", [False, True])
@pytest.mark.parametrize("tma", [None, False])  # the default (tensor descriptors on Hopper), pointer loads
def test_fused_weight_grad_into_against_cutlass_and_float64(k_dim, m_dim, assign, tma):
    """kernels.wgrad_into at Qwen3-30B-A3B expert widths (128 experts, skewed counts, empty experts) against
    torch._grouped_mm + add_into (grouped_gemm's reference path) and float64. The fused kernel keeps the
    product in fp32: ~1e-6 relative to float64 (the reference rounds it to bf16 first: ~2e-3, and the two
    agree to 1e-2). Bit-identical run to run, and the bulk-reduce epilogue (one add an element) to the
    load-add-store. A row stride that is no multiple of 16 bytes takes the pointer loads by itself, a
    misaligned grad the load-add-store. The sweep's best tiles (BN=32, 4 stages: a candidate for
    WGRAD_INTO_CONFIG) to float64 as closely, and run to run bit for bit."""
    from pithtrain.ops.grouped_gemm import grouped_weight_grad, grouped_weight_grad_into

    torch.manual_seed(k_dim)
    counts = torch.randint(0, 160, (128,), device="cuda") * (torch.rand(128, device="cuda") < 0.9)
    counts[[0, 77]] = 0
    rows = int(counts.sum())
    x, dy = torch.randn(rows, k_dim, device="cuda", dtype=BF16), torch.randn(rows, m_dim, device="cuda", dtype=BF16)
    grad = torch.randn(128, k_dim, m_dim, device="cuda")
    exact = torch.zeros_like(grad, dtype=torch.float64) if assign else grad.double()
    for e, (xe, de) in enumerate(zip(x.double().split(counts.tolist()), dy.double().split(counts.tolist()))):
        exact[e] += xe.T @ de
    reference = kernels.add_into(grad.clone(), grouped_weight_grad(x, dy, counts, 128), assign=assign)
    fused = kernels.wgrad_into(grad.clone(), x, dy, counts, assign, tma=tma)
    assert rel_err(fused, exact) < 1e-5 and rel_err(fused, reference) < 1e-2
    assert rel_err(fused, exact) <= rel_err(reference, exact) + 1e-6
    assert torch.equal(kernels.wgrad_into(grad.clone(), x, dy, counts, assign, tma=tma), fused)
    if tma is None:
        assert kernels._tma_ok(x, dy) and kernels._tma_ok(grad.view(-1, m_dim))  # Hopper: the descriptors ran
        tiles = dict(BK=128, BM=128, BN=32, num_warps=4, num_stages=4)
        got = kernels.wgrad_into(grad.clone(), x, dy, counts, assign, cfg=tiles)
        assert rel_err(got, exact) < 1e-5
        assert torch.equal(kernels.wgrad_into(grad.clone(), x, dy, counts, assign, cfg=tiles), got)
        assert torch.equal(kernels.wgrad_into(grad.clone(), x, dy, counts, assign, reduce=False), fused)
        for host in (False, True):  # the descriptors made on the host (the partial tile masked in dy): as exact
            got = kernels.wgrad_into(grad.clone(), x, dy, counts, assign, host=host)
            assert rel_err(got, exact) < 1e-5
            assert torch.equal(kernels.wgrad_into(grad.clone(), x, dy, counts, assign, host=host, reduce=False), got)
        shifted = torch.empty(grad.numel() + 1, device="cuda")[1:].view(grad.shape).copy_(grad)  # 4-byte aligned
        assert not kernels._tma_ok(shifted.view(-1, m_dim))
        assert torch.equal(kernels.wgrad_into(shifted, x, dy, counts, assign), fused)
        assert torch.equal(grouped_weight_grad_into(grad.clone(), x, dy, counts, assign), fused)  # the dispatch
        odd = torch.empty(rows, k_dim + 3, device="cuda", dtype=BF16)[:, :k_dim].copy_(x)  # 2 * (k + 3) bytes a row
        assert not kernels._tma_ok(odd, dy)
        assert rel_err(kernels.wgrad_into(grad.clone(), odd, dy, counts, assign), exact) < 1e-5
        # Triton's scratch allocator is per thread (a context variable): a fresh thread, as autograd's is
        out = []
        worker = threading.Thread(target=lambda: out.append(kernels.wgrad_into(grad.clone(), x, dy, counts, assign)))
        worker.start()
        worker.join()
        assert out and torch.equal(out[0], fused)
    if not assign:
        assert torch.equal(fused[77], grad[77])


@pytest.mark.parametrize("batch_bytes", [None, 3 * 2 * 64 * 96 * 2])
def test_muon_step_triton_against_the_reference_passes(monkeypatch, batch_bytes):
    """Two Muon steps on CUDA (expert stacks with gate|up halves, dense matrices, tall and wide, bf16
    Newton-Schulz batches) with the Triton passes equal the same steps with the PyTorch passes:
    momentum to 1e-6, the weight updates to 1e-2 relative (a bf16 rounding may differ, then NS)."""
    from pithtrain.config import OptimConfig
    from pithtrain.train import optim

    if batch_bytes:
        monkeypatch.setattr(optim, "NS_BATCH_BYTES", batch_bytes)
    gen = torch.Generator(device="cuda").manual_seed(0)
    shapes = {"a.q_proj.weight": (96, 64), "a.k_proj.weight": (64, 96), "a.mlp.experts.gate_up": (3, 96, 128),
              "a.mlp.experts.down": (3, 64, 96), "b.mlp.experts.gate_up": (5, 96, 128)}
    start = {n: torch.randn(s, device="cuda", generator=gen) for n, s in shapes.items()}
    grads = [{n: torch.randn(s, device="cuda", generator=gen) for n, s in shapes.items()} for _ in range(2)]
    results = []
    for triton in (True, False):
        monkeypatch.setattr(kernels, "use_triton", lambda t, on=triton: on and t.is_cuda)
        params = {n: torch.nn.Parameter(w.clone()) for n, w in start.items()}
        opt = optim.build_optimizer(list(params.items()), OptimConfig(name="muon", lr=1e-2, weight_decay=0.1), "cuda")
        for g in grads:
            for n, p in params.items():
                p.grad = g[n]
            opt.step()
        results.append({n: (p.detach().clone(), opt.state[p]["momentum_buffer"]) for n, p in params.items()})
    for n in shapes:
        (w, buf), (ref_w, ref_buf) = results[0][n], results[1][n]
        assert torch.allclose(buf, ref_buf, rtol=1e-6, atol=1e-6), n
        assert rel_err(w - start[n], ref_w - start[n]) < 1e-2, n


def test_head_logits_accumulates_into_the_fp32_gradient_in_the_gemm():
    """The LM head on CUDA under bf16 autocast: cuBLAS adds the weight gradient into the fp32 .grad
    (torch.mm / addmm with an fp32 output): two micro-batches against float64 (the product is never
    rounded to bf16, so within bf16 input rounding only), logits bit-identical to autocast's F.linear,
    input gradients within a bf16 rounding of its."""
    from pithtrain.ops.grouped_gemm import head_logits

    torch.manual_seed(8)
    weight = torch.nn.Parameter(torch.randn(32000, 512, device="cuda") * 0.05)
    twin = torch.nn.Parameter(weight.detach().clone())
    ref = torch.zeros(32000, 512, dtype=torch.float64, device="cuda")
    for _ in range(2):
        x, dy = torch.randn(2, 1024, 512, device="cuda"), torch.randn(2, 1024, 32000, device="cuda").bfloat16()
        got_x, want_x = x.clone().requires_grad_(), x.clone().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            got, want = head_logits(got_x, weight), torch.nn.functional.linear(want_x, twin)
        assert torch.equal(got, want)
        got.backward(dy)
        want.backward(dy)
        torch.testing.assert_close(got_x.grad, want_x.grad, rtol=8e-3, atol=1e-3)
        ref += dy.double().reshape(-1, 32000).t() @ x.bfloat16().double().reshape(-1, 512)
    assert weight.grad.dtype == torch.float32
    err = (weight.grad.double() - ref).norm() / ref.norm()
    twin_err = (twin.grad.double() - ref).norm() / ref.norm()
    assert err < 1e-5 and err <= twin_err, (err, twin_err)


def test_triton_adamw_matches_torchs_fused_and_writes_the_compute_copy(monkeypatch):
    """train/optim.TRITON_ADAMW on CUDA against torch's fused AdamW with clip_grads, three clipped steps over two
    groups: weights and moments to fp32 rounding (1e-6), the experts' bf16 compute copy written in the pass bit for
    bit a fresh cast, and current for compute_weight; an FP8 weight's maxima taken in the pass exactly |w|'s (a
    ragged [300, 77] too), its FP8 layouts made from them bit for bit those of quantize_both's own amax pass."""
    from torch import nn

    from pithtrain.ops import fp8, grouped_gemm
    from pithtrain.parallel.fsdp import clip_grads
    from pithtrain.train import optim

    torch.manual_seed(0)
    shapes = [(16, 512, 384), (1000,), (300, 77)]
    params = [nn.Parameter(torch.randn(s, device="cuda")) for s in shapes]
    twins = [nn.Parameter(p.detach().clone()) for p in params]
    module = nn.Module()
    module.w = params[0]

    def make(ps):
        groups = [{"params": [ps[0], ps[2]], "weight_decay": 0.1}, {"params": [ps[1]], "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, fused=True)

    ours, ref = make(params), make(twins)
    monkeypatch.setattr(optim, "TRITON_ADAMW", True)
    module.v = params[2]
    for name in ("w", "v"):  # the first quantization leaves the optimizer a buffer for the maxima
        fp8.cached_weight(module, name, contraction_last=name == "v")
    for _ in range(3):
        cast = grouped_gemm.compute_weight(module, "w", torch.bfloat16)
        grads = [torch.randn(s, device="cuda") * 3 for s in shapes]
        norm = torch.stack([g.norm() for g in grads]).norm().item()
        for p, t, g in zip(params, twins, grads):
            p.grad, t.grad = g.clone(), g.clone()
        optim.optimizer_step(ours, params, 1.0, norm)
        clip_grads(twins, 1.0, norm)
        ref.step()
        for p, t in zip(params, twins):
            for got, want in ((p, t), (ours.state[p]["exp_avg"], ref.state[t]["exp_avg"]),
                              (ours.state[p]["exp_avg_sq"], ref.state[t]["exp_avg_sq"])):
                assert rel_err(got.detach(), want.detach()) < 1e-6
        assert grouped_gemm.compute_weight(module, "w", torch.bfloat16) is cast
        assert torch.equal(cast.detach(), params[0].detach().to(torch.bfloat16))
        for name, p in (("w", params[0]), ("v", params[2])):
            w = p.detach()
            amax = fp8.optimizer_amax(p)
            assert amax is not None and torch.equal(amax, torch.cat([w.abs().amax(-1).flatten(), w.abs().amax(-2).flatten()]))
            made = fp8.cached_weight(module, name, contraction_last=name == "v")
            along_last, along_prev = fp8.quantize_both(w)
            got = (made.fwd, made.bwd) if name == "v" else (made.bwd, made.fwd)
            for a, b in zip((*got[0], *got[1]), (*along_last, *along_prev)):
                assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.dtype == fp8.FP8 else torch.equal(a, b)


def test_qk_norm_rope_topk_ids_and_the_combine_with_its_residual_at_qwen3_width_compiled():
    """Qwen3-30B-A3B's attention inputs (32 q heads, 4 kv heads of 128) from the stacked bf16 projection under
    Inductor, outputs and the gradients of qkv and both norm weights against float64 no worse than the reference
    in bf16 (which rounds after each op); the router's top-8 of 128 experts equal to torch.topk's; stage 5's
    weighted combine with the residual added in its sum against float64."""
    b, s, heads, kv, d = 2, 512, 32, 4, 128
    qkv = torch.randn(b, s, (heads + 2 * kv) * d, device="cuda", dtype=BF16)
    wq, wk = 1 + 0.3 * torch.randn(d, device="cuda"), 1 + 0.3 * torch.randn(d, device="cuda")
    cos, sin = core.rope_cos_sin(torch.arange(s, device="cuda").expand(b, s),
                                 1.0 / 1e6 ** (torch.arange(0, d, 2, device="cuda") / d), dtype=BF16)
    douts = [torch.randn(b, n, s, d, device="cuda", dtype=BF16) for n in (heads, kv, kv)]

    def reference(qkv, wq, wk):
        return kernels.qk_norm_rope_reference(*qkv.split([heads * d, kv * d, kv * d], -1), wq, wk, cos.to(qkv.dtype),
                                              sin.to(qkv.dtype), 1e-6)

    fused = torch.compile(lambda qkv, wq, wk: kernels.qk_norm_rope(qkv, wq, wk, cos, sin, heads, kv, 1e-6), fullgraph=True)
    out, dx = grads(fused, [qkv, wq, wk], douts)
    ref_out, ref_dx = grads(reference, [qkv, wq, wk], douts)
    exact_out, exact_dx = grads(reference, [qkv.double(), wq.double(), wk.double()], [g.double() for g in douts])
    for a, r, e in [*zip(out, ref_out, exact_out), *zip(dx, ref_dx, exact_dx)]:
        assert rel_err(a, e) < 5e-3 and rel_err(a, e) <= 1.05 * rel_err(r, e) + 1e-4, (rel_err(a, e), rel_err(r, e))
    probs = torch.randn(16384, 128, device="cuda").softmax(-1)
    assert torch.equal(kernels.topk_ids(probs, 8), torch.topk(probs, 8, dim=-1).indices)
    t, k, h = 4096, 8, 2048
    index, rows = torch.randperm(t * k, device="cuda"), torch.randn(t * k, h, device="cuda", dtype=BF16)
    weights, residual = torch.rand(t, k, device="cuda"), torch.randn(2, t // 2, h, device="cuda", dtype=BF16)
    dout = torch.randn(2, t // 2, h, device="cuda", dtype=BF16)
    out, dx = grads(lambda y, w, r: kernels.weighted_combine(y, index, w, r), [rows, weights, residual], dout)
    exact, exact_dx = grads(lambda y, w, r: r + kernels.weighted_combine_reference(y, index, w).view_as(r),
                            [rows.double(), weights.double(), residual.double()], dout.double())
    assert out.dtype == BF16 and torch.equal(dx[2], dout)
    for a, e in [(out, exact), *zip(dx, exact_dx)]:
        assert rel_err(a, e) < 5e-3, rel_err(a, e)

