"""Triton kernels of pithtrain.ops.kernels (and ops/fp8.py's weight quantization) under the Triton
interpreter, against their references.

Not collected by default (the name does not start with test_): tests/test_kernels.py runs this
file in a fresh process with TRITON_INTERPRET=1, which must be set before Triton is imported.
"""

import os

import pytest
import torch

from pithtrain.ops import core, fp8, kernels
from test_fp8 import fp8_head_loss_both_ways
from test_kernels import grads, rel_err, routed_ids


@pytest.fixture
def interpreter():
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1 (see tests/test_kernels.py)"


def check_kernel(fn, ref, inputs, grad_out, tol):
    out, dx = grads(fn, inputs, grad_out)
    ref_out, ref_dx = grads(ref, inputs, grad_out)
    assert out.dtype == ref_out.dtype and out.shape == ref_out.shape
    for a, b in [(out, ref_out), *zip(dx, ref_dx)]:
        if tol == 0:
            assert torch.equal(a, b)
        else:
            assert torch.allclose(a.double(), b.double(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, inter", [(37, 24), (5, 300), (0, 8)])
def test_triton_glu_kernels(interpreter, dtype, rows, inter):
    torch.manual_seed(rows)
    x = (torch.randn(rows, 2 * inter) * 3).to(dtype)
    dy = torch.randn(rows, inter, dtype=dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: the kernel rounds once, the reference per op
    check_kernel(lambda t: kernels._GLU.apply(t, 1.0, 0.0, False), core.swiglu, [x], dy, tol)
    check_kernel(lambda t: kernels._GLU.apply(t, 1.702, 2.5, True),
                 lambda t: kernels.clamped_swiglu_reference(t, 1.702, 2.5), [x], dy, tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_permute_kernels(interpreter, dtype, monkeypatch):
    torch.manual_seed(7)
    t, k, e, h = 23, 4, 9, 600  # h above the column block: several column programs
    ids = routed_ids(t, k, e, empty=(0, 4))
    order = torch.argsort(ids.flatten(), stable=True)
    x, dy = torch.randn(t, h).to(dtype), torch.randn(t * k, h).to(dtype)
    tol = 0 if dtype == torch.float32 else 1e-2  # bf16: fp32 sums of the copies vs the reference's bf16 adds
    check_kernel(kernels._Permute.apply, kernels.permute_reference, [x, order // k], dy, tol)
    with monkeypatch.context() as m:  # expand (LocalDispatch's permute): the Triton path on CPU tensors
        m.setattr(kernels, "use_triton", lambda _: True)
        fresh = torch.randn(t, h).to(dtype)  # not x: a buffer freed above holds x's permutation, which new_empty may reuse
        for rows, grad in ((fresh, dy), (fresh[:0], dy[:0])):  # and no tokens
            pairs = torch.argsort(ids[: len(rows)].flatten(), stable=True)
            check_kernel(lambda y: kernels.expand(y, pairs, k), lambda y: kernels.permute_reference(y, pairs // k),
                         [rows], grad, 1e-6 if dtype == torch.float32 else 1e-2)  # fp32: the sums' order differs
    check_kernel(lambda y: kernels._Unpermute.apply(y, order, t * k),
                 lambda y: kernels.unpermute_reference(y, order, t * k), [dy], x.repeat_interleave(k, 0), 0)
    # varying copies per row (the expert-parallel receiver), a row never picked, and a larger output
    index = torch.tensor([3, 3, 0, 7, 3, 1, 7])
    check_kernel(kernels._Permute.apply, kernels.permute_reference, [x[:8], index], dy[:7], tol)
    check_kernel(lambda y: kernels._Unpermute.apply(y, index.unique(), 12),
                 lambda y: kernels.unpermute_reference(y, index.unique(), 12), [dy[:4]], dy[:12], 0)
    # more source rows than uint8 holds: the backward sorts the row ids as int16
    big, index = torch.randn(300, 8).to(dtype), torch.randint(0, 300, (500,))
    check_kernel(kernels._Permute.apply, kernels.permute_reference, [big, index], torch.randn(500, 8).to(dtype), tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t, k, h", [(19, 4, 600), (5, 1, 8), (0, 2, 8)])  # h above the column block; T = 0
def test_triton_weighted_combine(interpreter, monkeypatch, dtype, t, k, h):
    """Stages 4-5 fused (rows placed by index and weighted, forward and backward) against the reference."""
    torch.manual_seed(t)
    index = torch.randperm(t * k)
    rows, weights, dout = torch.randn(t * k, h).to(dtype), torch.rand(t, k).to(dtype), torch.randn(t, h).to(dtype)
    out, (drows, dw) = grads(lambda y, w: kernels._WeightedCombine.apply(y, index, w, None), [rows, weights], dout)
    ref, (ref_drows, ref_dw) = grads(lambda y, w: kernels.weighted_combine_reference(y, index, w), [rows, weights], dout)
    tol = 1e-6 if dtype == torch.float32 else 1e-2  # bf16: fp32 sums in the kernel, bf16 products in the reference
    for got, want in [(out, ref), (drows, ref_drows), (dw, ref_dw)]:  # dw: a dot over h, to the scale of dw
        assert got.dtype == want.dtype and got.shape == want.shape and rel_err(got, want) <= tol
    # the residual added in the kernel (fp32 here under bf16 rows: its dtype and shape kept, its gradient dout)
    residual = torch.randn(1, t, h)
    monkeypatch.setattr(kernels, "use_triton", lambda t: True)
    out, (drows, dw, dres) = grads(lambda y, w, r: kernels.weighted_combine(y, index, w, r), [rows, weights, residual],
                                   dout.float().view(1, t, h))
    assert out.dtype == torch.float32 and out.shape == (1, t, h) and torch.equal(dres, dout.float().view(1, t, h))
    exact = residual.double() + kernels.weighted_combine_reference(rows.double(), index, weights.double()).view(1, t, h)
    assert rel_err(out, exact) <= 1e-6 and rel_err(drows, ref_drows) <= tol and rel_err(dw, ref_dw) <= tol
    # FP8 experts (kernels.COMBINE_FP8_GRAD): the backward also writes drows' FP8 copy into the rows' slot, bit for bit
    # quantize_reference's of the stored drows (q into fp32: the interpreter rounds to FP8 its own way), with negative
    # weights and a zero row of dout; the same drows and dw as without
    weights, dout = torch.randn(t, k).to(dtype), dout.float().view(1, t, h).clone()
    dout[0, :1] = 0
    plain = grads(lambda y, w: kernels.weighted_combine(y, index, w, residual), [rows, weights], dout)
    slots, arrived, q = [], [], torch.empty(t * k, h)
    monkeypatch.setattr(torch, "empty", lambda *a, dtype=None, **kw: q if dtype == torch.float8_e4m3fn else empty(*a, dtype=dtype, **kw))

    def with_slot(y, w):
        y = y * 1  # a non-leaf the experts' output would be, carrying the down GEMM's slot
        y._fp8_dgrad = slots.append({}) or slots[-1]
        y.register_hook(lambda g: arrived.append(g.data_ptr()))
        return kernels.weighted_combine(y, index, w, residual)
    _, (drows, dw) = grads(with_slot, [rows, weights], dout)
    assert torch.equal(drows, plain[1][0]) and torch.equal(dw, plain[1][1])
    want_q, want_s = fp8.quantize_reference(drows)
    slot = slots[0]
    assert torch.equal(slot["s"], want_s) and torch.equal(q.to(fp8.FP8).view(torch.uint8), want_q.view(torch.uint8))
    assert t == 0 or [slot["ptr"]] == arrived  # the gradient the slot names is the one the experts' output gets


empty = torch.empty


@pytest.mark.parametrize("tokens, topk, experts, ep, empty", [
    (100, 8, 64, 16, ()),  # 32 tokens per block: several blocks
    (300, 4, 16, 8, (4, 5)),  # rank 2 receives nothing
    (9, 3, 6, 3, ()),  # ep and k not powers of two
    (17, 1, 8, 1, ()),
    (0, 2, 4, 2, ()),
])
def test_triton_dispatch_plan_matches_reference_exactly(interpreter, tokens, topk, experts, ep, empty):
    ids = routed_ids(tokens, topk, experts, empty, seed=tokens)
    plan = kernels.DispatchPlan(*kernels._dispatch_plan(ids, experts // ep, ep))
    ref = kernels.dispatch_plan_reference(ids, experts // ep, ep)
    for name, a, b in zip(plan._fields, plan, ref):
        assert a.dtype == b.dtype and torch.equal(a, b), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_expert_bias_add(interpreter, dtype):
    torch.manual_seed(8)
    counts = torch.tensor([0, 40, 3, 0, 70, 1, 0])  # empty groups, groups longer than the row block
    x = torch.randn(int(counts.sum()), 300).to(dtype)
    bias = torch.randn(len(counts), 300)  # fp32 bias on bf16 rows: rounded to bf16 before the add
    out, (dx, dbias) = grads(kernels._ExpertBiasAdd.apply, [x, bias, counts], x)
    ref, (ref_dx, ref_dbias) = grads(kernels.expert_bias_add_reference, [x, bias, counts], x)
    if dtype == torch.float32:
        assert torch.equal(out, ref)
    else:  # the interpreter rounds fp32 -> bf16 toward zero (the GPU to nearest even, tested exact there)
        assert torch.allclose(out.float(), ref.float(), rtol=2**-6, atol=2**-6)
    assert torch.equal(dx, ref_dx)
    # per-expert row sums in fp32 (the reference adds in x's dtype): against float64 sums
    sums = torch.stack([rows.double().sum(0) for rows in x.split(counts.tolist())])
    assert torch.allclose(dbias.double(), sums, rtol=1e-5, atol=1e-5) and (dbias[[0, 3, 6]] == 0).all()
    assert rel_err(dbias, sums) <= rel_err(ref_dbias, sums) + 1e-7
    empty = torch.zeros(0, 300, dtype=dtype)
    assert kernels._ExpertBiasAdd.apply(empty, bias, torch.zeros(7, dtype=torch.long)).shape == (0, 300)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_cross_entropy(interpreter, dtype):
    torch.manual_seed(9)
    wide = (torch.randn(6, 9100) * 3).to(dtype)
    logits = wide[:, :9000]  # rows strided (not contiguous), more than two vocabulary chunks
    labels = torch.randint(0, 9000, (6,))
    labels[[1, 4]] = -100
    check_kernel(lambda z: kernels._CrossEntropySum.apply(z, labels) * 0.7,
                 lambda z: core.cross_entropy_sum(z, labels) * 0.7, [logits], torch.tensor(1.0),
                 1e-5 if dtype == torch.float32 else 1e-2)
    # -inf logits (a masked vocabulary, whole chunks of them), a chunk all -inf after the first, and a spike
    # far above the rest, against float64's logsumexp
    spiky = (torch.randn(4, 9000) * 40).to(dtype)
    spiky[0, :5000], spiky[1, 4096:], spiky[2, 100], spiky[3, 8999] = float("-inf"), float("-inf"), 500.0, 300.0
    spiky_labels = torch.tensor([6000, 5, 100, 3])
    losses, lse = kernels._ce_fwd(spiky, spiky_labels)
    exact = torch.logsumexp(spiky.double(), -1)
    assert (lse.double() - exact).abs().max() < 1e-5 * exact.abs().max()
    assert (losses.double() - (exact - spiky.double()[range(4), spiky_labels])).abs().max() < 1e-5 * exact.abs().max()
    logits3 = torch.randn(2, 3, 50, dtype=dtype)
    labels3 = torch.full((2, 3), -100)
    loss, (grad,) = grads(lambda z: kernels._CrossEntropySum.apply(z, labels3), [logits3], torch.tensor(1.0))
    assert loss == 0 and (grad == 0).all() and grad.shape == logits3.shape
    # grad_in_place: the same loss and gradient, written over the logits when their rows are dense; strided
    # logits go through a copy, and theirs stay as they were
    labels3[0, 1], labels3[1, 2] = 7, 49
    for strided in (False, True):
        leaf = (wide if strided else logits3).detach().clone().requires_grad_()
        head = leaf * 1  # what the LM head hands the loss: a non-leaf tensor
        head = head[:2, :150].reshape(2, 3, 50) if strided else head  # rows 9100 apart
        want_loss, (want,) = grads(lambda z: kernels._CrossEntropySum.apply(z, labels3), [head], torch.tensor(0.7))
        before, seen = head.detach().clone(), []
        head.register_hook(lambda g: seen.append(g.data_ptr()))
        loss = kernels._CrossEntropySum.apply(head, labels3, True)
        (loss * 0.7).backward()
        grad = leaf.grad[:2, :150].reshape(2, 3, 50) if strided else leaf.grad
        assert torch.equal(loss, want_loss) and torch.equal(grad, want) and (want != 0).any()
        assert (seen == [head.data_ptr()]) != strided and torch.equal(head, before) == strided


@pytest.mark.parametrize("amax_tile, tile", [(128, 64), (32, 16)])
@pytest.mark.parametrize("shape, dtype", [((37, 100), torch.float32), ((3, 70, 130), torch.bfloat16)])
def test_triton_weight_quantization_in_both_layouts(interpreter, monkeypatch, amax_tile, tile, shape, dtype):
    """fp8._quantize_both_cuda vs quantize_reference of w and of its transpose, exactly. The kernel
    writes q into fp32 tensors here (the clamped products before FP8 rounding), cast by torch: the
    interpreter's own e4m3 rounding is wrong where rounding carries into the exponent (128 -> 64)."""
    monkeypatch.setattr(fp8, "_AMAX_CONFIG", dict(BR=amax_tile, BC=amax_tile))
    monkeypatch.setattr(fp8, "_QUANT_BOTH_CONFIG", dict(BR=tile, BC=2 * tile))
    torch.manual_seed(len(shape))
    *lead, rows, cols = shape
    w = (torch.randn(shape) * torch.rand(*lead, rows, 1) * torch.rand(*lead, 1, cols) * 5).to(dtype)
    w[..., 3, :] = 0  # an all-zero row: the scale floor
    q, s, qt, st = torch.empty(shape), torch.empty(*lead, rows), torch.empty(*lead, cols, rows), torch.empty(*lead, cols)
    fp8._quantize_both_cuda(w, q, s, qt, st)
    for got_q, got_s, x in ((q, s, w), (qt, st, w.transpose(-1, -2).contiguous())):
        ref_q, ref_s = fp8.quantize_reference(x)
        assert torch.equal(got_s, ref_s)
        assert torch.equal(got_q.to(fp8.FP8).view(torch.uint8), ref_q.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_row_quantization_narrow_and_wide(interpreter, dtype):
    """fp8's activation quantization (q into fp32, as above) vs quantize_reference, exactly: whole rows
    a program (_quant_rows_kernel), a row a program over column blocks (_quant_wide_rows_kernel,
    the LM head's gradient), a partial last block and an all-zero row included; and a token row a program
    stored at its k expanded rows (_quant_expand_kernel, the dispatch's)."""
    torch.manual_seed(5)
    x = (torch.randn(9, 150) * torch.rand(9, 1) * 5).to(dtype)
    x[4] = 0
    ref_q, ref_s = fp8.quantize_reference(x)
    for kernel, grid, sizes, tiles in ((fp8._quant_rows_kernel, (3,), (9, 150), dict(BLOCK_R=4, BLOCK_C=256)),
                                       (fp8._quant_wide_rows_kernel, (9,), (150,), dict(BLOCK_C=32))):
        q, s = torch.empty(9, 150), torch.empty(9)
        kernel[grid](x, q, s, *sizes, **tiles)
        assert torch.equal(s, ref_s)
        assert torch.equal(q.to(fp8.FP8).view(torch.uint8), ref_q.view(torch.uint8))
    # each token's row quantized and stored at its k expanded rows (fp8.expand_quantized's kernel): the rows' own
    order = torch.randperm(9 * 3)
    q, s = torch.empty(27, 150), torch.empty(27)
    fp8._quant_expand_kernel[(9,)](x, kernels._inverse(order), q, s, 150, TOPK=3, BLOCK_C=256)
    assert torch.equal(s, ref_s[order // 3])
    assert torch.equal(q.to(fp8.FP8).view(torch.uint8), ref_q.view(torch.uint8)[order // 3])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_glu_quantized(interpreter, dtype):
    """fp8._glu_quant_kernel: the activation exactly as kernels._glu_fwd makes it, and its row-wise FP8
    exactly as quantize_reference makes it from the stored values (q into fp32, as above); plain and
    clamped, a partial row block and rows padded to the column block. Through fp8.glu_quantized's
    autograd function: h's gradient is kernels._GLU's. The backward's kernel with d h's FP8 copy likewise."""
    torch.manual_seed(11)
    rows, inter = 7, 24
    x = (torch.randn(rows, 2 * inter) * 3).to(dtype)
    x[2] = 0  # an all-zero row: the scale floor
    dy = torch.randn(rows, inter, dtype=dtype)
    for clamped, alpha, limit in ((False, 1.0, 0.0), (True, 1.702, 2.5)):
        out, q, s = torch.empty(rows, inter, dtype=dtype), torch.empty(rows, inter), torch.empty(rows)
        fp8._glu_quant_kernel[(2,)](x, out, q, s, rows, inter, alpha, limit, CLAMPED=clamped, BLOCK_R=4, BLOCK_C=32)
        assert torch.equal(out, kernels._glu_fwd(x, alpha, limit, clamped))
        ref_q, ref_s = fp8.quantize_reference(out)
        assert torch.equal(s, ref_s) and s[2] == 1e-12 / 448
        assert torch.equal(q.to(fp8.FP8).view(torch.uint8), ref_q.view(torch.uint8))
        a, _, s2 = fp8._GLUQuantized.apply(x.requires_grad_(), alpha, limit, clamped)
        assert torch.equal(a, out) and torch.equal(s2, ref_s)
        (dx,) = torch.autograd.grad(a, x, dy)
        (want,) = torch.autograd.grad(kernels._GLU.apply(x, alpha, limit, clamped), x, dy)
        assert torch.equal(dx, want)
        x = x.detach()
        # the backward's kernel with d gate_up's FP8 copy (fp8.GLU_FP8_GRAD): the same d gate_up, and the copy
        # exactly as quantize_reference makes it from the stored values; through the autograd function, into a slot
        q_bwd = torch.empty(rows, 2 * inter)
        dh, s_bwd = kernels.glu_bwd_quantized(x, dy, alpha, limit, clamped, q_bwd)
        assert torch.equal(dh, want)
        ref_q, ref_s = fp8.quantize_reference(dh)
        assert torch.equal(s_bwd, ref_s)
        assert torch.equal(q_bwd.to(fp8.FP8).view(torch.uint8), ref_q.view(torch.uint8))
        slot = {}
        a, _, _ = fp8._GLUQuantized.apply(x.requires_grad_(), alpha, limit, clamped, slot)
        (dx,) = torch.autograd.grad(a, x, dy)
        assert torch.equal(dx, want) and slot["ptr"] == dx.data_ptr() and torch.equal(slot["s"], ref_s)
        x = x.detach()


@pytest.mark.parametrize("shape, halves", [((37, 300), 1), ((3, 20, 300), 1), ((3, 20, 600), 2), ((0, 5, 8), 2)])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_triton_muon_passes(interpreter, shape, halves, out_dtype):
    """Muon's momentum pass (momentum in place, Nesterov update into the batch layout, gate and up apart)
    and its decay + update pass against the references: fp32 to 1e-6, the bf16 batch to one rounding."""
    torch.manual_seed(len(shape) + halves)
    grad, buf, weight = torch.randn(shape), torch.randn(shape), torch.randn(shape)
    count = grad.numel() // (shape[-2] * shape[-1] // halves) if grad.numel() else 0
    out = torch.empty(count, shape[-2], shape[-1] // halves, dtype=out_dtype)
    ref_buf, ref_out = buf.clone(), out.clone()
    kernels._muon_launch(grad, buf, out, halves, mu=0.95)
    kernels.muon_momentum_reference(grad, ref_buf, 0.95, ref_out, halves)
    tol = 1e-6 if out_dtype == torch.float32 else 1e-2
    assert torch.allclose(buf, ref_buf, rtol=1e-6, atol=1e-6)
    assert torch.allclose(out.float(), ref_out.float(), rtol=tol, atol=tol)
    ref_weight = weight.clone()
    kernels._muon_launch(out, weight, None, halves, decay=0.99, step=0.3)
    kernels.muon_apply_reference(ref_weight, out, 0.99, 0.3, halves)
    assert torch.allclose(weight, ref_weight, rtol=1e-6, atol=1e-6)


def test_triton_ops_are_sound_custom_ops_and_compile(interpreter, monkeypatch):
    """Schemas and fakes of every launch (opaque to torch.compile), then a fullgraph compile through all of them."""
    ops = torch.ops.pithtrain
    x, ends = torch.randn(5, 16), torch.tensor([2, 2, 5], dtype=torch.int32)
    labels = torch.tensor([1, -100, 3, 0, 2])
    ids = routed_ids(6, 2, 8)
    for op, args in [
        (ops.glu_fwd, (x, 1.702, 2.0, True)), (ops.glu_bwd, (x, torch.randn(5, 8), 1.0, 0.0, False)),
        (ops.gather_rows, (x, torch.tensor([4, 0, 4]))), (ops.scatter_rows, (x, torch.tensor([3, 0, 6, 1, 2]), 7)),
        (ops.expand_rows, (x, torch.randperm(10))),
        (ops.segment_sum, (x, torch.tensor([1, 0, 2, 4, 3]), ends)), (ops.dispatch_plan, (ids, 2, 4)),
        (ops.expert_bias_add, (x, torch.randn(3, 16), ends)), (ops.expert_bias_grad, (x, ends, torch.float32)),
        (ops.cross_entropy_fwd, (x, labels)), (ops.cross_entropy_bwd, (x, labels, torch.randn(5), torch.ones(1))),
        (ops.segment_sum, (x, torch.tensor([1, 0, 2, 4, 3]), ends, torch.rand(5))),  # weighted: the combine
        (ops.segment_sum, (x, torch.tensor([1, 0, 2, 4, 3]), ends, torch.rand(5), torch.randn(3, 16))),  # + residual
        (ops.weighted_combine_bwd, (x[:4], torch.tensor([2, 0, 3, 1]), torch.rand(2, 2), torch.randn(2, 16))),
    ]:
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))

    monkeypatch.setattr(kernels, "use_triton", lambda t: True)  # the Triton path on CPU tensors
    t, k, e = 16, 2, 8
    ids = routed_ids(t, k, e, empty=(3,))
    counts, order = torch.bincount(ids.flatten(), minlength=e), torch.argsort(ids.flatten(), stable=True)

    def layer(x, w, bias, logits, weights):
        h = kernels.expert_bias_add(kernels.permute(x, order // k) @ w, bias, counts)
        act = kernels.swiglu(h) + kernels.clamped_swiglu(h, 1.702, 2.0)
        out = kernels.unpermute(act, order, t * k).view(t, k, -1).sum(1) + kernels.weighted_combine(act, order, weights)
        out = out + (kernels.expand(x, order, k) @ w).square().sum()
        plan = kernels.dispatch_plan(ids, e // 4, 4)
        return out.square().sum() + kernels.cross_entropy_sum(logits, labels.repeat(4)[:t]) + plan.send_counts.sum()

    inputs = [torch.randn(t, 8), torch.randn(8, 12), torch.randn(e, 12), torch.randn(t, 40), torch.rand(t, k)]
    eager, eager_grads = grads(layer, inputs, torch.tensor(1.0))
    compiled, compiled_grads = grads(torch.compile(layer, fullgraph=True, backend="aot_eager"), inputs,
                                     torch.tensor(1.0))
    assert torch.equal(eager, compiled) and all(map(torch.equal, eager_grads, compiled_grads))


def _wgrad_reference(grad, x, dy, counts, assign):
    """float64 grad[e] (+)= x_e^T dy_e."""
    ref = torch.zeros_like(grad, dtype=torch.float64) if assign else grad.double()
    for e, (xe, de) in enumerate(zip(x.double().split(counts.tolist()), dy.double().split(counts.tolist()))):
        ref[e] += xe.T @ de
    return ref


# float16, not bfloat16: the interpreter's tl.dot multiplies bf16 bit patterns (Triton 3.9); bf16 is tests/gpu's
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("assign", [False, True])
@pytest.mark.parametrize("tma", [False, True, "host"])  # pointer loads; tensor descriptors (the Hopper path), host-made
def test_triton_weight_grad_into(interpreter, dtype, assign, tma):
    """Segments not multiples of the row block, an empty expert (first and in the middle), K and M not
    multiples of the tile; a strided dy (a column slice). With descriptors bounded to each expert's rows,
    the rows past a segment read as zeros; with host-made ones over all rows, a segment's partial tile
    is masked instead (the next expert's rows must not leak in)."""
    host = tma == "host"
    cfg = dict(BK=16, BM=8, BN=16)
    torch.manual_seed(9)
    counts = torch.tensor([0, 21, 5, 0, 40, 16])
    rows, k_dim, m_dim = int(counts.sum()), 37, 22
    pad = 1
    if tma:  # descriptors want 16-byte aligned rows and bases (the interpreter checks as the hardware does)
        k_dim, m_dim, pad = 40, 24, 8
    x, dy = torch.randn(rows, k_dim).to(dtype), torch.randn(rows, m_dim + pad).to(dtype)[:, pad:]
    grad = torch.randn(len(counts), k_dim, m_dim)
    before = grad.clone()
    out = kernels.wgrad_into(grad, x, dy, counts, assign, cfg=cfg, tma=bool(tma), host=host)
    assert out is grad
    ref = _wgrad_reference(before, x, dy, counts, assign)
    assert (grad.double() - ref).abs().max() <= 1e-5 * ref.abs().max()
    assert (grad[0] == 0).all() if assign else torch.equal(grad[3], before[3])
    again = kernels.wgrad_into(before.clone(), x, dy, counts, assign, cfg=cfg, tma=bool(tma), host=host)
    assert torch.equal(again, grad)  # no atomics: bit-identical
    if host:  # a first expert shorter than a tile: its partial tile starts before row 0 (zeros there)
        counts = torch.tensor([3, 0, 30, 7])
        x, dy = x[:40], dy[:40]
        got = kernels.wgrad_into(before[:4].clone(), x, dy, counts, assign, cfg=cfg, tma=True, host=True)
        ref = _wgrad_reference(before[:4], x, dy, counts, assign)
        assert (got.double() - ref).abs().max() <= 1e-5 * ref.abs().max()


@pytest.mark.parametrize("deferred", [False, True])
def test_fused_weight_grad_dispatch(interpreter, monkeypatch, deferred):
    """grouped_gemm.FUSED_WGRAD with the Triton path taken (CPU tensors, the interpreter): two micro-batches'
    weight gradients of a cast fp32 master weight (the first assigns .grad, the second adds) against float64;
    a queue whose add_grad is not plain accumulation still receives the product."""
    from pithtrain.ops import grouped_gemm
    from pithtrain.ops.grouped_gemm import DeferredWeightGrads, accumulate_grad, expert_mm

    monkeypatch.setattr(kernels, "use_triton", lambda t: True)
    monkeypatch.setattr(grouped_gemm, "FUSED_WGRAD", True)
    monkeypatch.setattr(kernels, "WGRAD_INTO_CONFIG", dict(BK=16, BM=16, BN=16))
    calls, launch = [], kernels.wgrad_into
    monkeypatch.setattr(kernels, "wgrad_into", lambda *a, **k: calls.append(1) or launch(*a, **k))
    torch.manual_seed(4)
    counts = torch.tensor([7, 0, 19, 6])
    module = torch.nn.Module()
    module.w = torch.nn.Parameter(torch.randn(4, 24, 20))
    queue = DeferredWeightGrads(accumulate_grad) if deferred else None
    xs = [torch.randn(int(counts.sum()), 24).half() for _ in range(2)]
    dys = [torch.randn(int(counts.sum()), 20).half() for _ in range(2)]
    for x, dy in zip(xs, dys):
        expert_mm(x, module, "w", counts, torch.float16, queue).backward(dy)
        if queue:
            queue.run()
    ref = _wgrad_reference(_wgrad_reference(module.w, xs[0], dys[0], counts, True), xs[1], dys[1], counts, False)
    assert len(calls) == 2 and (module.w.grad.double() - ref).abs().max() <= 1e-5 * ref.abs().max()
    other = DeferredWeightGrads(lambda p, g: calls.append(g.dtype))  # e.g. fsdp.add_grad of a sharded parameter
    expert_mm(xs[0], module, "w", counts, torch.float16, other).backward(dys[0])
    other.run()
    assert calls[2:] == [torch.float16]


@pytest.mark.parametrize("varlen", [False, True])
def test_triton_dqkwg_matches_pytorch(interpreter, varlen):
    """ops/delta_rule.dqkwg_triton (what FLA's gated-delta-rule backward calls on Hopper with Triton
    < 3.7.1) against dqkwg_torch, the batched PyTorch form of the same chunk formulas: fp32, 1e-4
    (the kernel's sums run in another order). Two value heads per q/k head, V = 80 (two V blocks, the
    second partial), a last chunk cut short; varlen: three documents, chunks that end mid-chunk."""
    from pithtrain.ops import delta_rule as dr

    torch.manual_seed(3 + varlen)
    c, hk, hv, kd, vd = 16, 2, 4, 32, 80
    b, t = (1, 53) if varlen else (2, 37)
    cu = torch.tensor([0, 20, 21, 53]) if varlen else None
    if varlen:
        idx = [(n, i) for n in range(3) for i in range(-(-int(cu[n + 1] - cu[n]) // c))]
    else:
        idx = [(n, i) for n in range(b) for i in range(-(-t // c))]
    chunk_indices = torch.tensor(idx) if varlen else None
    nc = len(idx)
    q, k, w = torch.randn(b, t, hk, kd), torch.randn(b, t, hk, kd), torch.randn(b, t, hv, kd)
    v, do, dv = (torch.randn(b, t, hv, vd) for _ in range(3))
    g = -torch.rand(b, t, hv).cumsum(1) * 0.1  # log2-unit decays; any values test the same formula
    h, dh = torch.randn(nc, hv, kd, vd) * 0.3, torch.randn(nc, hv, kd, vd) * 0.3
    kw = dict(q=q, k=k, v=v, do=do, w=w, g=g, dv=dv, scale=kd ** -0.5, cu_seqlens=cu, chunk_size=c,
              chunk_indices=chunk_indices)
    for transposed in (False, True):
        hh, dhh = (x.transpose(-1, -2).contiguous() for x in (h, dh)) if transposed else (h, dh)
        ref = dr.dqkwg_torch(h=hh, dh=dhh, state_v_first=transposed, **kw)
        out = dr.dqkwg_triton(h=hh, dh=dhh, state_v_first=transposed, **kw)
        for name, a, r in zip(("dq", "dk", "dw", "dg"), out, ref):
            assert a.shape == r.shape and a.dtype == r.dtype, name
            err = ((a - r).norm() / r.norm()).item()
            assert err < 1e-4, f"{name} varlen={varlen} transposed={transposed}: {err:.2e}"


@pytest.mark.parametrize("triton", [True, False])
def test_adamw_pass_is_torchs_with_the_clip_and_the_compute_copy(interpreter, monkeypatch, triton):
    """train/optim.TRITON_ADAMW (kernels.adamw, a pass a parameter; `triton` False: its PyTorch reference) against
    torch.optim.AdamW with clip_grads over three steps: two groups (decay and none), clipped gradients, the state
    torch's fused path makes (1e-6); the experts' bf16 compute copy written in the pass and re-keyed, so
    compute_weight returns it, equal to a fresh cast; then a resumed optimizer's state (its step read once)
    continues as torch's does. The FP8 weight's maxima taken in the pass (ops/fp8.optimizer_amax) are |w|'s, and
    the FP8 layouts made from them (one read of w) equal those made with quantize_both's own amax pass."""
    import copy

    from torch import nn

    from pithtrain.ops import grouped_gemm
    from pithtrain.parallel.fsdp import clip_grads
    from pithtrain.train import optim

    torch.manual_seed(0)
    shapes = [(4, 16, 24), (33,), (7, 5)]
    params = [nn.Parameter(torch.randn(s)) for s in shapes]
    twins = [nn.Parameter(p.detach().clone()) for p in params]
    module = nn.Module()
    module.w = params[0]
    groups = lambda ps: [{"params": [ps[0], ps[2]], "weight_decay": 0.1}, {"params": [ps[1]], "weight_decay": 0.0}]  # noqa: E731
    make = lambda ps: torch.optim.AdamW(groups(ps), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, foreach=True)  # noqa: E731
    ours, ref = make(params), make(twins)
    monkeypatch.setattr(kernels, "use_triton", lambda t: True)
    monkeypatch.setattr(fp8, "use_triton", lambda t: True)
    monkeypatch.setattr(kernels, "ADAMW_AMAX_TILE", dict(BR=2, BC=16, STEPS=3))  # w's [16, 24]: several, ragged tiles
    monkeypatch.setattr(optim, "TRITON_ADAMW", True)
    if not triton:  # the optimizer's pass through kernels.adamw's PyTorch reference
        monkeypatch.setattr(kernels, "adamw", kernels.adamw_reference)
    for step in range(4):
        if step == 3:  # a resume: a new optimizer loading the state
            ours = make(params)
            ours.load_state_dict(copy.deepcopy(ref.state_dict()))
        cast = grouped_gemm.compute_weight(module, "w", torch.bfloat16)  # the experts' cast, made in a forward
        if step == 0:  # the FP8 layouts' first quantization leaves the optimizer a buffer for the maxima
            fp8.cached_weight(module, "w", contraction_last=False)
        grads = [torch.randn(s) * 3 for s in shapes]
        norm = torch.stack([g.norm() for g in grads]).norm().item()
        assert norm > 1.0  # the clip applies
        for p, t, g in zip(params, twins, grads):
            p.grad, t.grad = g.clone(), g.clone()
        optim.optimizer_step(ours, params, 1.0, norm)
        clip_grads(twins, 1.0, norm)
        ref.step()
        for p, t in zip(params, twins):
            a, b = ours.state[p], ref.state[t]
            assert float(a["step"]) == float(b["step"]) == step + 1
            for got, want in ((p, t), (a["exp_avg"], b["exp_avg"]), (a["exp_avg_sq"], b["exp_avg_sq"])):
                torch.testing.assert_close(got.detach(), want.detach(), rtol=1e-6, atol=1e-7)
        assert grouped_gemm.compute_weight(module, "w", torch.bfloat16) is cast  # written in the pass, current
        w = params[0].detach()
        amax = fp8.optimizer_amax(params[0])
        assert amax is not None and torch.equal(amax, torch.cat([w.abs().amax(-1).flatten(), w.abs().amax(-2).flatten()]))
        amax_pass = fp8._AMAX_CONFIG
        monkeypatch.setattr(fp8, "_AMAX_CONFIG", None)  # a second read of w would fail
        made = fp8.cached_weight(module, "w", contraction_last=False)
        monkeypatch.setattr(fp8, "_AMAX_CONFIG", amax_pass)
        (q, s), (qt, st) = fp8.quantize_both(w)
        for got, want in ((made.bwd[0], q), (made.bwd[1], s), (made.fwd[0], qt), (made.fwd[1], st)):
            assert torch.equal(got.view(torch.uint8) if got.dtype == fp8.FP8 else got,
                               want.view(torch.uint8) if want.dtype == fp8.FP8 else want)
        fresh = params[0].detach().to(torch.bfloat16)
        if triton:  # the interpreter rounds fp32 to bf16 toward zero, CUDA to nearest (tests/gpu: bit for bit)
            assert ((cast.detach().float() - fresh.float()).abs() <= fresh.float().abs() * 2**-7).all()
        else:
            assert torch.equal(cast.detach(), fresh)
    with torch.no_grad():
        params[0].mul_(1.0)  # any other in-place update: the maxima are stale
    assert fp8.optimizer_amax(params[0]) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_qk_norm_rope_against_float64(interpreter, monkeypatch, dtype):
    """Qwen3's attention inputs from the stacked projection: q, k, v and the gradients of qkv and both norm weights
    against the reference in float64 (one block of rows and three, the last partial; the output gradients in the
    layout SDPA hands back and in another), with the fp32 weights the kernel reads; the launches are sound custom
    ops and compile in a full graph."""
    monkeypatch.setattr(kernels, "use_triton", lambda t: True)
    heads, kv, d, eps = 4, 2, 8, 1e-6
    for (b, s), block_t in [((2, 5), 32), ((3, 30), 32), ((3, 30), 64)]:  # the tiles a setting: any rows a program
        monkeypatch.setattr(kernels, "QK_NORM_ROPE_TILES", {k: dict(BLOCK_T=block_t, num_warps=4) for k in ("fwd", "bwd")})
        qkv = torch.randn(b, s, (heads + 2 * kv) * d).to(dtype)
        wq, wk = 1 + 0.3 * torch.randn(d), 1 + 0.3 * torch.randn(d)
        cos, sin = core.rope_cos_sin(torch.randint(0, 500, (b, s)), 1.0 / 1e4 ** (torch.arange(0, d, 2) / d), dtype=dtype)
        douts = (torch.randn(b, s, heads, d).transpose(1, 2).to(dtype), torch.randn(b, kv, s, d).to(dtype),
                 torch.randn(b, s, kv, d).transpose(1, 2).to(dtype))

        def fused(qkv, wq, wk):
            return kernels.qk_norm_rope(qkv, wq, wk, cos, sin, heads, kv, eps)

        def reference(qkv, wq, wk):  # float64
            q, k, v = qkv.double().split([heads * d, kv * d, kv * d], -1)
            return kernels.qk_norm_rope_reference(q, k, v, wq.double(), wk.double(), cos.double(), sin.double(), eps)

        inputs = [qkv, wq, wk]
        outs, dx = grads(fused, inputs, douts)
        ref_outs, ref_dx = grads(reference, inputs, douts)
        tol = 1e-5 if dtype == torch.float32 else 1.5e-2
        for a, r in zip(outs, ref_outs):
            assert a.dtype == dtype and a.shape == r.shape and rel_err(a, r) < tol
        assert [g.dtype for g in dx] == [dtype, torch.float32, torch.float32]
        for a, r in zip(dx, ref_dx):
            assert rel_err(a, r) < tol, (rel_err(a, r), tol)
    ops = torch.ops.pithtrain
    x, w = torch.randn(6, 64), torch.randn(8)
    cs = torch.randn(6, 8), torch.randn(6, 8)
    torch.library.opcheck(ops.qk_norm_rope_fwd, (x, w, w, *cs, 4, 2, 1e-6), test_utils=("test_schema", "test_faketensor"))
    grads_in = torch.randn(2, 4, 3, 8), torch.randn(2, 2, 3, 8), torch.randn(2, 3, 2, 8).transpose(1, 2)
    torch.library.opcheck(ops.qk_norm_rope_bwd, (x, w, w, *cs, *grads_in, 1e-6),
                          test_utils=("test_schema", "test_faketensor"))
    eager = grads(fused, inputs, douts)
    compiled = grads(torch.compile(fused, fullgraph=True, backend="aot_eager"), inputs, douts)
    assert all(map(torch.equal, eager[0], compiled[0])) and all(map(torch.equal, eager[1], compiled[1]))


def test_triton_topk_ids_is_torch_topk(interpreter, monkeypatch):
    """The router's selection against torch.topk: the ids largest first, over a power of two of columns and not
    (the padded columns never chosen), rows with -inf scores (DeepSeek's masked groups: no id twice), k = all
    columns; a sound custom op."""
    for rows, cols, k in [(37, 128, 8), (5, 6, 6), (70, 40, 3)]:
        x = torch.randn(rows, cols)
        if cols == 40:
            x[:, 8:] = float("-inf")  # only 8 finite scores per row, k = 3 of them
        ids = kernels._topk_ids(x, k)
        assert ids.dtype == torch.int64 and torch.equal(ids, torch.topk(x, k, dim=-1).indices)
    x = torch.full((3, 16), float("-inf"))
    x[:, 0] = 1.0  # k beyond the finite scores: still distinct ids
    assert all(len(set(row)) == 4 for row in kernels._topk_ids(x, 4).tolist())
    torch.library.opcheck(torch.ops.pithtrain.topk_ids, (torch.randn(9, 32), 4), test_utils=("test_schema", "test_faketensor"))



def test_fp8_head_input_gradient_quantized_by_the_cross_entropy_backward(interpreter, monkeypatch):
    """train.fp8_head: kernels.cross_entropy_sum of the FP8 head's logits writes d logits' row-wise FP8 copy in its
    backward (the row amax from the forward: the largest other probability or 1 - p_label, times |grad|), and the
    head's input gradient takes it. The kernels against quantize_reference of the fp32 d logits, bit for bit (q into
    fp32 as in the cases above: the interpreter rounds to FP8 its own way), with an ignored row and a row whose label
    is its argmax; through the head, its gradients against the path that quantizes d logits
    itself (the slot dropped): the copy is taken, then let go."""
    torch.manual_seed(12)
    rows, hidden, vocab = 6, 32, 4512  # multiples of 16 (the FP8 GEMMs); more than one chunk each way
    logits = torch.randn(rows, vocab) * 3
    labels = torch.randint(0, vocab, (rows,))
    labels[2], labels[4] = -100, logits[4].argmax()  # an ignored row; a row whose label is its argmax (amax 1 - p)
    p = torch.softmax(logits.double(), -1)
    d64 = 0.3 * (p - torch.nn.functional.one_hot(labels.clamp(min=0), vocab))
    d64[2] = 0
    losses, lse, amax = kernels._ce_fwd_amax(logits, labels)
    assert torch.allclose(amax.double() * 0.3, d64.abs().amax(-1), rtol=1e-6, atol=0) and amax[2] == 0
    d, q, scale = logits.clone(), torch.empty(rows, vocab), torch.empty(rows)
    kernels._launch_ce_bwd(d, labels, lse, torch.tensor([0.3]), d, (amax, q, scale))
    want_q, want_s = fp8.quantize_reference(d)  # fp32 logits: d is the kernel's fp32 d
    assert torch.equal(scale, want_s) and torch.equal(q.to(fp8.FP8).view(torch.uint8), want_q.view(torch.uint8))
    assert torch.allclose(d.double(), d64, atol=1e-6)
    monkeypatch.setattr(kernels, "use_triton", lambda t: True)
    w = torch.nn.Parameter(torch.randn(vocab, hidden) * 0.2)
    x = torch.randn(rows, hidden)
    launches, launch = [], kernels._launch_ce_bwd
    monkeypatch.setattr(kernels, "_launch_ce_bwd", lambda *a: launches.append(len(a)) or launch(*a))
    fp8.cached_param(w)  # the weight's FP8 layouts first: the spy below sees activations only
    quantized, quantize = [], fp8.quantize
    monkeypatch.setattr(fp8, "quantize", lambda t: quantized.append(t.shape[-1]) or quantize(t))
    (dx, dw, _), (dx_plain, dw_plain, _) = fp8_head_loss_both_ways(w, x, labels, 0.3)
    assert launches == [6, 5]  # with the FP8 copy's outputs, then without
    assert quantized == [hidden, hidden, vocab]  # x twice; d logits only where the slot was dropped
    assert torch.equal(dw, dw_plain) and (dx - dx_plain).norm() < 2e-2 * dx_plain.norm()


def test_fp8_expert_input_gradients_quantized_by_their_producers(interpreter, monkeypatch):
    """FP8 experts: each expert GEMM's output carries a slot. fp8.glu_quantized's backward kernel writes d gate_up's
    FP8 copy into gate_up's, and the combine's backward (kernels.weighted_combine) d down-output's into down's; each
    GEMM's input gradient takes its copy rather than quantizing its dy again. Against fp8.GLU_FP8_GRAD and
    kernels.COMBINE_FP8_GRAD off (the quantize passes): one quantize fewer of a [N, 2I] and of a [N, H] tensor, the
    slots let go, the same down weight gradient and the rest within e4m3's error."""
    from pithtrain.ops import grouped_gemm

    inter, hidden = 24, 32
    monkeypatch.setattr(fp8, "use_triton", lambda t: t.dim() == 2 and t.shape[-1] == 2 * inter)  # the activation only
    monkeypatch.setattr(kernels, "use_triton", lambda t: t.dim() == 2 and t.shape[-1] == hidden)  # the combine only
    quantized, quantize = [], fp8.quantize
    monkeypatch.setattr(fp8, "quantize", lambda t: quantized.append(t.shape[-1]) or quantize(t))
    torch.manual_seed(13)
    counts, index, weights = torch.tensor([7, 0, 13]), torch.randperm(20), torch.rand(10, 2)
    experts = torch.nn.Module()
    experts.fp8 = "rowwise_bf16_wgrad"
    experts.gate_up = torch.nn.Parameter(torch.randn(3, hidden, 2 * inter) * 0.2)
    experts.down = torch.nn.Parameter(torch.randn(3, inter, hidden) * 0.2)
    x0, dy = torch.randn(20, hidden), torch.randn(10, hidden)
    bias = torch.randn(3, 2 * inter) * 0.1
    for gpt_oss in (False, True):  # GPT-OSS: the experts' bias added in between, the clamped activation
        got = []
        for fused in (True, False):
            monkeypatch.setattr(fp8, "GLU_FP8_GRAD", fused)
            monkeypatch.setattr(kernels, "COMBINE_FP8_GRAD", fused)
            experts.zero_grad(set_to_none=True)
            x = x0.clone().requires_grad_()
            h = grouped_gemm.expert_mm(x, experts, "gate_up", counts, torch.float32)
            slot = h._fp8_dgrad
            if gpt_oss:
                h = kernels.expert_bias_add(h, bias, counts)
            y = grouped_gemm.activation_mm(h, experts, counts, torch.float32, clamp=(1.702, 7.0) if gpt_oss else None)
            down_slot = y._fp8_dgrad
            out = kernels.weighted_combine(y, index, weights)
            quantized.clear()
            out.backward(dy)
            assert slot == {} and down_slot == {}
            got.append((x.grad, experts.gate_up.grad, experts.down.grad, sorted(quantized)))
        (dx, dw, dw2, q_fused), (dx_plain, dw_plain, dw2_plain, q_plain) = got
        assert q_fused == [] and q_plain == [hidden, 2 * inter]
        # down's weight gradient (bf16 recipe: no FP8 in it) the same; what follows down's FP8 input gradient within
        # e4m3's error: the interpreter rounds the copy to FP8 its own way (4.5% from float64 where quantize's is 3.3%)
        assert torch.equal(dw2, dw2_plain) and (dw - dw_plain).norm() < 8e-2 * dw_plain.norm()
        assert (dx - dx_plain).norm() < 8e-2 * dx_plain.norm()


def test_triton_fp8_grouped_mm_one_tile_a_program_and_persistent(interpreter, monkeypatch):
    """fp8._grouped_mm_kernel against grouped_mm_reference: ragged groups (one empty, one under a tile), K not a
    multiple of the tile; fp32 outputs one tile a program; bf16 ones also persistent (fp8.GMM_PERSISTENT: 4 programs,
    an SM's worth on the CPU, each taking every 4th tile), bit for bit the one-tile kernel's."""
    monkeypatch.setattr(fp8, "_GMM_CONFIG", dict(BM=32, BN=32, BK=64))
    gen = torch.Generator().manual_seed(7)
    counts = torch.tensor([70, 0, 5, 49], dtype=torch.int32)
    x, w = torch.randn(int(counts.sum()), 96, generator=gen), torch.randn(4, 80, 96, generator=gen)
    xq, xs = fp8.quantize_reference(x)
    wq, ws = fp8.quantize_reference(w)
    want = fp8.grouped_mm_reference(xq, xs, wq, ws, counts, torch.float32)
    torch.testing.assert_close(fp8._grouped_mm_cuda(xq, xs, wq, ws, counts, torch.float32), want, rtol=1e-5, atol=1e-4)
    by_tile = {}
    for persistent in (0, 1):
        monkeypatch.setattr(fp8, "GMM_PERSISTENT", persistent)
        by_tile[persistent] = fp8._grouped_mm_cuda(xq, xs, wq, ws, counts, torch.bfloat16)
    assert torch.equal(by_tile[0], by_tile[1])
    torch.testing.assert_close(by_tile[1].float(), want, rtol=1e-2, atol=1e-2)
