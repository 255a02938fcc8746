"""FP8 on CUDA (Triton quantization and grouped GEMMs, torch._scaled_mm) against the plain-PyTorch
reference of ops/fp8.py, which is what CI tests on the CPU (skipped without an FP8-capable GPU).

Tolerances: quantized values agree with the reference except for rare one-step rounding ties (at
most 0.1% of them, each one e4m3 step); scales agree to 1e-6 relative; GEMMs on identical FP8
operands agree to 5e-3 of the largest output (measured 1.6e-3: Hopper's FP8 tensor cores add
products with fewer mantissa bits than fp32, far below e4m3's own 2^-4 step), in bf16 to 1e-2;
layers (whose dense GEMMs write bf16 on the GPU) agree with the CPU emulation to 1e-2 relative.
"""

import pytest
import torch

from pithtrain.config import fp8_tensor_cores
from pithtrain.ops import fp8, grouped_gemm
from test_fp8 import fp8_head_loss_both_ways, random_fp8_linear  # the CPU FP8 tests' helpers

pytestmark = pytest.mark.skipif(not fp8_tensor_cores(),
                                reason="needs a GPU with FP8 tensor cores")
BF16 = torch.bfloat16


def rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-30)).item()


def same_fp8(a, b, x=None, inv=None):
    """Equal; with x and inv given (q = x * inv), differences are allowed only where x * inv is an exact
    tie between two e4m3 values (none expected: both convert round-to-nearest-even)."""
    diff = a.float() != b.float()
    if x is None:
        assert not diff.any(), f"{diff.float().mean().item():.3%} of quantized values differ"
        return
    v = (x.float() * inv)[diff]
    lo, hi = a.float()[diff], b.float()[diff]
    assert torch.equal((v - lo).abs(), (hi - v).abs()), "quantized values differ off a rounding tie"
    assert diff.float().mean().item() <= 1e-2


def counts_for(rows, experts, gen):
    cuts = torch.sort(torch.randint(0, rows + 1, (experts - 1,), generator=gen)).values
    counts = torch.diff(torch.cat([torch.tensor([0]), cuts, torch.tensor([rows])]))
    counts[1] = 0  # an empty expert
    counts[0] += rows - counts.sum()
    return counts


@pytest.mark.parametrize("cols", [64, 768, 2880])
def test_quantize_matches_reference(cols):
    gen = torch.Generator().manual_seed(cols)
    x = (torch.randn(1000, cols, generator=gen) * torch.rand(1000, 1, generator=gen) * 5).to(BF16)
    q, s = fp8.quantize(x.cuda())
    rq, rs = fp8.quantize_reference(x)
    same_fp8(q.cpu(), rq)
    assert rel(s.cpu(), rs) < 1e-6
    counts = counts_for(1000, 7, gen)
    qt, st = fp8.quantize_t(x.cuda(), counts.cuda())
    rqt, rst = fp8.quantize_t_reference(x, counts)
    assert qt.shape == rqt.shape and st.shape == rst.shape
    used = int(sum(-(-int(c) // fp8.SEGMENT_ALIGN) * fp8.SEGMENT_ALIGN for c in counts))  # later columns: never read
    xt = torch.zeros(cols, rqt.shape[1])  # x's transposed, padded layout, and each value's 1 / scale
    inv = torch.zeros(cols, rqt.shape[1])
    col = 0
    for g, seg in enumerate(x.split(counts.tolist())):
        xt[:, col:col + seg.shape[0]] = seg.t().float()
        inv[:, col:col + seg.shape[0]] = (1.0 / rst[g]).unsqueeze(1)
        col += -(-seg.shape[0] // fp8.SEGMENT_ALIGN) * fp8.SEGMENT_ALIGN
    assert torch.equal(st.cpu(), rst)  # scales bit for bit (a scalar division was an ulp off: failed on the H200)
    same_fp8(qt[:, :used].cpu(), rqt[:, :used], xt[:, :used], inv[:, :used])  # (the kernel leaves later columns unwritten)


@pytest.mark.parametrize("k,m", [(256, 384), (2880, 5760), (768, 2048)])
def test_grouped_gemms_match_reference(k, m):
    gen = torch.Generator().manual_seed(k + m)
    rows, experts = 3000, 8
    counts = counts_for(rows, experts, gen)
    x, dy = torch.randn(rows, k, generator=gen), torch.randn(rows, m, generator=gen)
    w = torch.randn(experts, m, k, generator=gen)
    xq, xs = fp8.quantize_reference(x)
    wq, ws = fp8.quantize_reference(w)
    got = fp8.grouped_mm(xq.cuda(), xs.cuda(), wq.cuda(), ws.cuda(), counts.cuda(), torch.float32)
    assert rel(got.cpu(), fp8.grouped_mm_reference(xq, xs, wq, ws, counts, torch.float32)) < 5e-3
    got16 = fp8.grouped_mm(xq.cuda(), xs.cuda(), wq.cuda(), ws.cuda(), counts.cuda(), BF16)
    assert rel(got16.cpu(), fp8.grouped_mm_reference(xq, xs, wq, ws, counts, torch.float32)) < 1e-2
    with pytest.MonkeyPatch.context() as mp:  # one program a tile: the same tiles and sums, bit for bit
        mp.setattr(fp8, "GMM_PERSISTENT", 1 - min(fp8.GMM_PERSISTENT, 1))
        assert torch.equal(fp8.grouped_mm(xq.cuda(), xs.cuda(), wq.cuda(), ws.cuda(), counts.cuda(), BF16), got16)
    xt, sx = fp8.quantize_t_reference(x, counts)
    dyt, sdy = fp8.quantize_t_reference(dy, counts)
    dw = fp8.grouped_wgrad(xt.cuda(), sx.cuda(), dyt.cuda(), sdy.cuda(), counts.cuda())
    ref = fp8.grouped_wgrad_reference(xt, sx, dyt, sdy, counts)
    assert rel(dw.cpu(), ref) < 5e-3
    assert dw[1].abs().max() == 0  # the empty expert


@pytest.mark.parametrize("recipe", [True, "rowwise_bf16_wgrad"])
def test_layers_match_cpu_emulation(recipe):
    """FP8 Linear and expert GEMM on CUDA vs the CPU emulation: outputs and every gradient."""
    from torch import nn

    gen = torch.Generator().manual_seed(0)
    lin = random_fp8_linear(256, 512, gen, 0.05)
    x = torch.randn(4, 96, 256, generator=gen)
    dy = torch.randn(4, 96, 512, generator=gen)

    def run(device):
        m = fp8.Linear(256, 512, bias=True).to(device)
        m.load_state_dict(lin.state_dict())
        m.fp8 = recipe
        xi = x.to(device).requires_grad_()
        y = m(xi)
        y.backward(dy.to(device))
        return y, xi.grad, m.weight.grad, m.bias.grad

    for a, b in zip(run("cuda"), run("cpu")):
        assert rel(a.cpu(), b) < 1e-2

    experts = nn.Module()
    experts.w = nn.Parameter(torch.randn(6, 256, 384, generator=gen) * 0.05)
    counts = counts_for(800, 6, gen)
    xe, dye = torch.randn(800, 256, generator=gen), torch.randn(800, 384, generator=gen)

    def run_experts(device):
        mod = nn.Module()
        mod.fp8 = recipe
        mod.w = nn.Parameter(experts.w.detach().to(device).clone())
        xi = xe.to(device).requires_grad_()
        y = grouped_gemm.fp8_expert_mm(xi, mod, "w", counts.to(device), torch.float32)
        y.backward(dye.to(device))
        return y, xi.grad, mod.w.grad

    for a, b in zip(run_experts("cuda"), run_experts("cpu")):
        assert rel(a.cpu(), b) < 1e-2


@pytest.mark.parametrize("shape, dtype", [((300, 1000), torch.float32), ((8, 256, 384), torch.float32),
                                          ((5, 130, 72), BF16)])
def test_weight_quantization_in_both_layouts(shape, dtype):
    """The weight cache's one-pass kernel vs quantize_reference of w and of its transpose (scales
    exactly), and bit for bit vs the per-layout Triton kernel it replaces. Shapes: not multiples of
    the tiles, an expert stack."""
    gen = torch.Generator().manual_seed(len(shape))
    *lead, rows, cols = shape
    w = (torch.randn(shape, generator=gen) * torch.rand(*lead, rows, 1, generator=gen)
         * torch.rand(*lead, 1, cols, generator=gen) * 5).to(dtype)
    w[..., 7, :] = 0
    both = fp8.quantize_both(w.cuda())
    for (q, s), x in zip(both, (w, w.transpose(-1, -2).contiguous())):
        ref_q, ref_s = fp8.quantize_reference(x)
        assert q.shape == ref_q.shape and torch.equal(s.cpu(), ref_s)
        same_fp8(q.cpu(), ref_q)
        old_q, old_s = fp8._quantize_nd(x.cuda())
        assert torch.equal(q.view(torch.uint8), old_q.view(torch.uint8)) and torch.equal(s, old_s)


def test_weight_cache_refreshes_in_place_on_cuda():
    """After an in-place update the cache's same tensors hold the new weight's layouts (experts' and
    Linear's orientation)."""
    from torch import nn

    gen = torch.Generator().manual_seed(3)
    mod = nn.Module()
    mod.w = nn.Parameter(torch.randn(6, 200, 328, generator=gen).cuda())
    for contraction_last in (False, True):
        first = fp8.cached_weight(mod, "w", contraction_last)
        tensors = (*first.fwd, *first.bwd)
        with torch.no_grad():
            mod.w.mul_(torch.rand(6, 200, 1, generator=gen).cuda() * 3)  # new row amaxes: new scales
        again = fp8.cached_weight(mod, "w", contraction_last)
        assert again is first and all(a is b for a, b in zip((*again.fwd, *again.bwd), tensors))
        w = mod.w.detach().cpu()
        along_last, along_prev = fp8.quantize_reference(w), fp8.quantize_reference(w.transpose(-1, -2).contiguous())
        expect = (along_last, along_prev) if contraction_last else (along_prev, along_last)
        for (q, s), (ref_q, ref_s) in zip((again.fwd, again.bwd), expect):
            assert torch.equal(s.cpu(), ref_s)
            same_fp8(q.cpu(), ref_q)
        del mod._fp8_cache


def test_fp8_head_matches_reference():
    """train.fp8_head on CUDA (Triton quantization, torch._scaled_mm, the weight gradient added into the
    fp32 .grad by cuBLAS) against the CPU emulation on the same bf16 activations: logits and the input
    gradient 1e-2 of the largest value (bf16 outputs), the weight gradient 1e-2."""
    gen = torch.Generator().manual_seed(21)
    w_cpu = torch.nn.Parameter(torch.randn(4096, 256, generator=gen) * 0.05)  # [vocab, hidden]
    w_gpu = torch.nn.Parameter(w_cpu.detach().cuda())
    x = torch.randn(2, 300, 256, generator=gen).to(BF16)
    dy = (torch.randn(2, 300, 4096, generator=gen) * 1e-3).to(BF16)
    outs = {}
    for name, w, dev in (("cpu", w_cpu, "cpu"), ("gpu", w_gpu, "cuda")):
        xi = x.clone().to(dev).requires_grad_()  # a leaf of its own per device
        y = grouped_gemm.head_logits(xi, w, fp8_head=True)
        y.backward(dy.to(dev))
        outs[name] = (y.cpu(), xi.grad.cpu(), w.grad.cpu())
    for got, want in zip(outs["gpu"], outs["cpu"]):
        assert rel(got, want) < 1e-2
    assert outs["gpu"][2].dtype == torch.float32


def test_fp8_head_takes_the_cross_entropy_backwards_fp8_gradient(monkeypatch):
    """The FP8 head under kernels.cross_entropy_sum (in place, as training runs it): the cross-entropy backward writes
    d logits' FP8 copy and the head's input gradient takes it, against the head quantizing bf16 d logits itself (the
    slot dropped): the weight gradients equal, the input gradients within 2e-2 (the copy rounds the fp32 d, not its
    bf16 rounding); the copy's q and s against quantize of d logits, q one e4m3 step at most."""
    from pithtrain.ops import kernels

    gen = torch.Generator().manual_seed(22)
    w = torch.nn.Parameter((torch.randn(8192, 256, generator=gen) * 0.05).cuda())
    x = torch.randn(2, 300, 256, generator=gen).to(BF16).cuda()
    labels = torch.randint(0, 8192, (2, 300), generator=gen).cuda()
    labels[0, :7] = -100
    copies, launch = [], kernels._launch_ce_bwd
    monkeypatch.setattr(kernels, "_launch_ce_bwd", lambda *a: copies.append(a[5:]) or launch(*a))
    (dx, dw, d), (dx_plain, dw_plain, _) = fp8_head_loss_both_ways(w, x, labels, 1e-3)
    assert [len(c) for c in copies] == [1, 0] and torch.equal(dw, dw_plain) and rel(dx, dx_plain) < 2e-2
    amax, q_made, s_made = copies[0][0]
    q, s = fp8.quantize(d.reshape(-1, 8192))  # d logits in bf16, written over the logits
    assert rel(s_made, s) < 1e-2 and (q_made.float() - q.float()).abs().max() <= 32


@pytest.mark.parametrize("inter, clamp", [(768, None), (2880, (1.702, 7.0))])
def test_activation_quantization_in_the_activation_kernel(inter, clamp):
    """fp8.glu_quantized on CUDA (one kernel: the activation and its row-wise FP8) against the separate
    kernels it replaces (kernels.swiglu / clamped_swiglu, then fp8.quantize): the activation and the
    scales bit for bit, the FP8 values up to rounding ties, h's gradient exactly; likewise the backward's
    kernel that also quantizes h's gradient."""
    from pithtrain.ops import kernels

    gen = torch.Generator().manual_seed(inter)
    h = (torch.randn(3000, 2 * inter, generator=gen) * 3).to(BF16).cuda().requires_grad_()
    dy = torch.randn(3000, inter, generator=gen).to(BF16).cuda()
    a, q, s = fp8.glu_quantized(h, *(clamp or (1.0, 0.0)), clamped=clamp is not None)
    want = kernels.swiglu(h) if clamp is None else kernels.clamped_swiglu(h, *clamp)
    wq, ws = fp8.quantize(want.detach())
    assert torch.equal(a, want) and torch.equal(s, ws)
    same_fp8(q.cpu(), wq.cpu(), want.detach().cpu(), (1.0 / ws).unsqueeze(1).cpu())
    dh = torch.autograd.grad(want, h, dy)[0]
    assert torch.equal(torch.autograd.grad(a, h, dy)[0], dh)
    # the backward's kernel with dh's FP8 copy (fp8.GLU_FP8_GRAD): dh exactly, the copy as fp8.quantize(dh) makes it
    qb = torch.empty(dh.shape, dtype=fp8.FP8, device="cuda")
    dh2, sb = kernels.glu_bwd_quantized(h.detach(), dy, *(clamp or (1.0, 0.0)), clamp is not None, qb)
    wq, ws = fp8.quantize(dh)
    assert torch.equal(dh2, dh) and torch.equal(sb, ws)
    same_fp8(qb.cpu(), wq.cpu(), dh.cpu(), (1.0 / ws).unsqueeze(1).cpu())


def test_dispatch_quantizes_the_tokens_for_the_expanded_rows():
    """LocalDispatch's offer to FP8 experts on CUDA (fp8.expand_quantized: each of the T tokens quantized and stored
    at its k rows by one Triton kernel) against fp8.quantize of the expanded rows: bit for bit."""
    from pithtrain.parallel.expert import LocalDispatch
    from pithtrain.protocol import RoutingInfo

    x = torch.randn(4096, 2048, device="cuda").to(BF16) * 3
    ids = torch.rand(4096, 128, device="cuda").topk(8, dim=1).indices
    routing = RoutingInfo(ids, torch.rand(4096, 8, device="cuda"), torch.rand(4096, 128, device="cuda"), 128)
    rows, counts, order = LocalDispatch().dispatch(x, routing)
    q, s = rows._fp8_rows()
    want_q, want_s = fp8.quantize(rows)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(s, want_s)


def test_combine_backward_writes_the_down_gradients_fp8_copy():
    """kernels.weighted_combine's backward for FP8 experts (kernels.COMBINE_FP8_GRAD) at Qwen3 width: drows and dw bit
    for bit as without the copy, the copy in the slot bit for bit fp8.quantize's of drows (the scale from |w| times
    dout's row max, rounded as drows is), its pointer that of the gradient the experts' output gets."""
    from pithtrain.ops import kernels

    gen = torch.Generator().manual_seed(31)
    t, k, h = 4096, 8, 2048
    rows = (torch.randn(t * k, h, generator=gen) * 2).to(BF16).cuda().requires_grad_()
    index = torch.randperm(t * k, generator=gen).cuda()
    weights = torch.rand(t, k, generator=gen).cuda().requires_grad_()
    residual = torch.randn(t, h, generator=gen).to(BF16).cuda()
    dout = torch.randn(t, h, generator=gen).to(BF16).cuda()
    dout[3] = 0
    plain = torch.autograd.grad(kernels.weighted_combine(rows, index, weights, residual), [rows, weights], dout)
    y = rows * 1
    y._fp8_dgrad, arrived = (slot := {}), []
    y.register_hook(lambda g: arrived.append(g.data_ptr()))
    got = torch.autograd.grad(kernels.weighted_combine(y, index, weights, residual), [rows, weights], dout)
    assert torch.equal(got[0], plain[0]) and torch.equal(got[1], plain[1]) and arrived == [slot["ptr"]]
    want_q, want_s = fp8.quantize(plain[0])
    assert torch.equal(slot["s"], want_s) and torch.equal(slot["q"].view(torch.uint8), want_q.view(torch.uint8))


def test_compiled_quantization_fuses_into_the_norm():
    """In a compiled graph fp8.quantize is the plain-PyTorch one (inductor fuses it into the norm before
    the projection, and into dy's producer in the backward): the compiled RMSNorm + FP8 Linear is as
    close to the bf16 layer as the eager one (the Triton quantization kernel) in output and every
    gradient (within 1.25x its error, which is e4m3's, plus one bf16 step of the largest value), and
    its graph has no quantization custom op left. Not bit for bit: inductor's norm differs from
    eager's in the last fp32 bits, which moves the few values near an e4m3 or bf16 rounding boundary
    by a step (measured: 1.5e-2 of the largest output against eager; dw, bf16 on both, 3.1e-3 apart)."""
    from torch._inductor.utils import run_and_get_code

    gen = torch.Generator().manual_seed(3)
    lin = random_fp8_linear(512, 768, gen, 0.05).cuda()
    lin.fp8 = "rowwise_bf16_wgrad"
    norm_w = (1 + 0.1 * torch.randn(512, generator=gen)).cuda().requires_grad_()
    x = torch.randn(4, 256, 512, generator=gen).cuda()
    dy = torch.randn(4, 256, 768, generator=gen).to(BF16).cuda()

    def block(t):
        with torch.autocast("cuda", BF16):
            normed = t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6) * norm_w
            return lin(normed)

    def run(fn):
        xi = x.clone().requires_grad_()
        y = fn(xi)
        y.backward(dy)
        grads = (xi.grad, lin.weight.grad.clone(), lin.bias.grad.clone(), norm_w.grad.clone())
        lin.weight.grad = lin.bias.grad = norm_w.grad = None
        return (y, *grads)

    lin.fp8 = False
    bf16 = run(block)
    lin.fp8 = "rowwise_bf16_wgrad"
    eager = run(block)
    fp8.refresh_fp8_weights(lin)
    compiled_block = torch.compile(block, fullgraph=True)
    compiled, code = run_and_get_code(run, compiled_block)
    for name, got, want, ref in zip(("y", "dx", "dw", "db", "dnorm"), compiled, eager, bf16):
        assert rel(got, ref) <= 1.25 * rel(want, ref) + 2 ** -8, (name, rel(got, ref), rel(want, ref))
    assert not any("fp8_quantize" in c for c in code), "a quantization custom op left in the compiled graph"


def test_stacked_projections_compiled_match_the_linears_alone(monkeypatch):
    """fp8.projections over three FP8 Linears of one recipe, compiled on CUDA (their FP8 layouts concatenated in
    the graph, one FP8 GEMM forward): outputs and every gradient as the three Linears alone in eager, within the
    rounding of values near an e4m3 or bf16 boundary (inductor's fused quantization differs in the last bits)."""
    gen = torch.Generator().manual_seed(5)
    mods = [random_fp8_linear(512, n, gen, 0.05, "rowwise_bf16_wgrad").cuda() for n in (1024, 256, 256)]
    x = torch.randn(4, 256, 512, generator=gen).cuda()
    dy = torch.randn(4, 256, 1536, generator=gen).to(BF16).cuda()

    def block(t):
        with torch.autocast("cuda", BF16):
            return torch.cat(fp8.projections(t, *mods), -1)

    def run(fn):
        xi = x.clone().requires_grad_()
        y = fn(xi)
        y.backward(dy)
        out = [y, xi.grad] + [m.weight.grad.clone() for m in mods] + [m.bias.grad.clone() for m in mods]
        for m in mods:
            m.weight.grad = m.bias.grad = None
        return out

    monkeypatch.setattr(fp8, "FUSED_PROJECTIONS", False)
    alone = run(block)
    monkeypatch.setattr(fp8, "FUSED_PROJECTIONS", True)
    for m in mods:
        fp8.refresh_fp8_weights(m)
    for got, want in zip(run(torch.compile(block, fullgraph=True)), alone):
        assert got.shape == want.shape and rel(got, want) < 2e-2
