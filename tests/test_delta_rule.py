"""pithtrain.ops.delta_rule on the CPU: the chunked gated delta rule against the token-by-token
recurrence (float64, forward and the gradients of q, k, v, g, beta), packed documents against each
document run alone, causal_conv1d against F.conv1d, and the chunked path under torch.compile.

Tolerances: float64 cases 1e-10 relative to the largest entry (the two forms differ only in summation
order, ~1e-15 each); the compiled float32 case 1e-5 (inductor may reorder fp32 sums).
FLA's Triton kernels and the PyTorch dqkwg that replaces one of them: tests/gpu/test_delta_rule_gpu.py
and benchmarks/delta_rule_interpreter.py (CPU, under the Triton interpreter; needs fla, so not in CI).
"""

import pytest
import torch
import torch.nn.functional as F

from pithtrain.ops import delta_rule as dr

pytestmark = pytest.mark.fast  # the fast tier (make test-fast)

F64 = torch.float64


def inputs(gen, b, s, h, dk, dv, dtype=F64, hk=None):
    hk = hk or h
    q = dr.l2norm(torch.randn(b, s, hk, dk, generator=gen, dtype=dtype))
    k = dr.l2norm(torch.randn(b, s, hk, dk, generator=gen, dtype=dtype))
    v = torch.randn(b, s, h, dv, generator=gen, dtype=dtype)
    g = -torch.rand(b, s, h, generator=gen, dtype=dtype) * 1.5  # log decay <= 0
    beta = torch.rand(b, s, h, generator=gen, dtype=dtype)
    return [t.requires_grad_() for t in (q, k, v, g, beta)]


def out_and_grads(fn, x, dout):
    o = fn(*x)
    return [o, *torch.autograd.grad(o, x, dout)]


def rel(a, b):
    return float((a - b).detach().abs().max() / b.detach().abs().max().clamp_min(1e-30))


def assert_close(got, want, tol, names="o dq dk dv dg dbeta".split()):
    for name, a, b in zip(names, got, want):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert rel(a, b) < tol, (name, rel(a, b))


@pytest.mark.parametrize("docs", [False, True])
@pytest.mark.parametrize("hk", [3, 1])  # q/k heads: one per value head, or one shared by all three
def test_chunked_matches_recurrence(docs, hk):
    gen = torch.Generator().manual_seed(1 + docs + 2 * hk)
    b, s, h, chunk = 2, 29, 3, 8  # S not a multiple of the chunk
    x = inputs(gen, b, s, h, dk=6, dv=5, hk=hk)
    # row 0: boundaries at 8 (a chunk boundary) and 13 (inside a chunk); row 1: one document
    doc_ids = torch.tensor([[4] * 8 + [9] * 5 + [2] * 16, [0] * 29]) if docs else None
    dout = torch.randn(b, s, h, 5, generator=gen, dtype=F64)
    got = out_and_grads(lambda *t: dr.gated_delta_rule(*t, doc_ids=doc_ids, chunk_size=chunk), x, dout)
    want = out_and_grads(lambda *t: dr.gated_delta_rule_recurrent(*t, doc_ids=doc_ids), x, dout)
    assert_close(got, want, 1e-10)


def test_packed_documents_equal_each_document_alone():
    """A packed row equals its documents run one by one: the state never crosses a document start.
    Boundaries at 8 (a chunk boundary), 19 (inside one), and a one-token document at 26."""
    gen = torch.Generator().manual_seed(7)
    lengths, chunk, h = [8, 11, 7, 1, 6], 8, 2
    s = sum(lengths)
    x = inputs(gen, 1, s, h, dk=4, dv=3)
    doc_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
    dout = torch.randn(1, s, h, 3, generator=gen, dtype=F64)
    packed = out_and_grads(lambda *t: dr.gated_delta_rule(*t, doc_ids=doc_ids, chunk_size=chunk), x, dout)
    alone = [[] for _ in packed]
    for piece in zip(*(t.detach().split(lengths, 1) for t in [*x, dout])):
        xs = [t.requires_grad_() for t in piece[:5]]
        for acc, t in zip(alone, out_and_grads(lambda *t: dr.gated_delta_rule(*t, chunk_size=chunk), xs, piece[5])):
            acc.append(t)
    assert_close(packed, [torch.cat(a, 1) for a in alone], 1e-10)

    # causal_conv1d: the same for the conv (K = 4 reaches across the 1-token document too)
    xc = torch.randn(1, s, 5, generator=gen, dtype=F64, requires_grad=True)
    w = torch.randn(5, 4, generator=gen, dtype=F64, requires_grad=True)
    dy = torch.randn(1, s, 5, generator=gen, dtype=F64)
    y = dr.causal_conv1d(xc, w, doc_ids)
    dx, dw = torch.autograd.grad(y, (xc, w), dy)
    ys, dxs, dws = [], [], torch.zeros_like(w)
    for xp, dyp in zip(xc.detach().split(lengths, 1), dy.split(lengths, 1)):
        xp.requires_grad_()
        yp = dr.causal_conv1d(xp, w)
        gx, gw = torch.autograd.grad(yp, (xp, w), dyp)
        ys.append(yp)
        dxs.append(gx)
        dws += gw
    assert_close([y, dx, dw], [torch.cat(ys, 1), torch.cat(dxs, 1), dws], 1e-12, ["y", "dx", "dw"])


@pytest.mark.parametrize("dtype", [F64, torch.float32])
def test_causal_conv1d_matches_conv1d(dtype):
    gen = torch.Generator().manual_seed(3)
    for b, s, c, kw in ((2, 11, 6, 4), (2, 3, 6, 9)):  # and a kernel longer than the sequence (its far taps add zeros)
        x = torch.randn(b, s, c, generator=gen, dtype=dtype)
        w = torch.randn(c, kw, generator=gen, dtype=dtype)
        want = F.silu(F.conv1d(x.transpose(1, 2), w[:, None], padding=kw - 1, groups=c)[..., :s]).transpose(1, 2)
        got = dr.causal_conv1d(x, w)
        assert got.dtype == dtype
        assert rel(got, want) < (1e-12 if dtype == F64 else 1e-6)


def test_chunked_compiles_fullgraph():
    """One tiny case through torch.compile(fullgraph=True): no graph break, no host sync; forward and
    backward equal eager (fp32). The aot_eager backend traces forward and backward as inductor would
    but skips its code generation (a minute on 2 cores); the GPU test and benchmark run inductor."""
    gen = torch.Generator().manual_seed(5)
    x = inputs(gen, 1, 12, 2, dk=4, dv=4, dtype=torch.float32)
    doc_ids = torch.tensor([[0] * 5 + [1] * 7])
    dout = torch.randn(1, 12, 2, 4, generator=gen)
    torch._dynamo.reset()
    fn = torch.compile(lambda *t: dr.gated_delta_rule(*t, doc_ids=doc_ids, chunk_size=8), fullgraph=True, backend="aot_eager")
    got = out_and_grads(fn, x, dout)
    want = out_and_grads(lambda *t: dr.gated_delta_rule(*t, doc_ids=doc_ids, chunk_size=8), x, dout)
    assert_close(got, want, 1e-5)


def test_chunked_flops_counts_the_matmuls():
    c, dk, dv = 64, 128, 128
    per_chunk = 2 * (c * c * dk + c**3 / 3 + c * c * (dk + dv) + c * c * dk + 3 * c * dk * dv + c * c * dv)
    assert dr.chunked_flops(2, 100, 3, dk, dv) == int(per_chunk * 2 * 3 * 2)  # 100 tokens: two chunks


def test_fla_missing_on_cpu_is_silent(recwarn):
    """The CPU never asks for fla: no warning there, the chunked path."""
    gen = torch.Generator().manual_seed(2)
    dr.gated_delta_rule(*inputs(gen, 1, 4, 1, 2, 2), chunk_size=4)
    assert not [w for w in recwarn if "flash-linear-attention" in str(w.message)]
