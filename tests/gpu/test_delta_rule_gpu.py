"""pithtrain.ops.delta_rule on CUDA (skipped without CUDA; the FLA cases without flash-linear-attention):
FLA's chunk_gated_delta_rule (with ops/delta_rule.dqkwg_torch in its backward where FLA refuses its own
kernel: Hopper, Triton < 3.7.1) against the PyTorch chunked path at the Qwen3.5-MoE shape with packed
documents, output and the gradients of q, k, v, g, beta; both compiled; the fallback without fla.

Reference: the chunked path in float64 (itself checked against the recurrence in tests/test_delta_rule.py).
Errors are relative norms of the difference (rel_err). Tolerances:
  fp32: FLA's Triton dots take fp32 operands at TF32 (10-bit mantissa, ~5e-4 a rounding, summed over
        Dk = 128 and carried through 64 chunk states): below 1e-2.
  bf16: both paths get the same bf16 inputs; FLA also keeps A, h, v_new and the gradients' partial
        products in bf16: within 3x the PyTorch path's own error (which rounds only the output, in
        fp32 otherwise) plus 1e-2, and below 5e-2.
"""

import sys

import pytest
import torch
import torch.nn.functional as F

from pithtrain.ops import delta_rule as dr
from test_kernels import rel_err

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
NAMES = "o dq dk dv dg dbeta".split()


def qwen35_inputs(b=2, s=4096, h=32, dk=128, dv=128, seed=0):
    """q, k L2-normed; g = -exp(A_log) softplus(a + dt_bias)-like decays (mostly near 1, some fast);
    beta = sigmoid(b). fp32 leaves: each dtype case casts them."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = F.normalize(torch.randn(b, s, h, dk, device="cuda", generator=gen), dim=-1)
    k = F.normalize(torch.randn(b, s, h, dk, device="cuda", generator=gen), dim=-1)
    v = torch.randn(b, s, h, dv, device="cuda", generator=gen)
    g = -torch.rand(b, s, h, device="cuda", generator=gen).mul(4).exp().mul(0.05)  # 0.05 .. 2.7
    beta = torch.randn(b, s, h, device="cuda", generator=gen).sigmoid()
    dout = torch.randn(b, s, h, dv, device="cuda", generator=gen)
    # row 0: documents start at 1000, 2048 (a chunk boundary) and 2053 (at S=4096; scaled for other S);
    # the other rows: one document
    starts = torch.tensor([s * 1000 // 4096, s // 2, s // 2 + 5], device="cuda")
    doc_ids = torch.zeros(b, s, dtype=torch.long, device="cuda")
    doc_ids[0] = torch.searchsorted(starts, torch.arange(s, device="cuda"), right=True)
    return [q, k, v, g, beta], dout, doc_ids


def run(fn, leaves, dout):
    x = [t.detach().requires_grad_() for t in leaves]
    o = fn(*x)
    return [o, *torch.autograd.grad(o, x, dout.to(o.dtype))]


@pytest.fixture(scope="module")
def case():
    leaves, dout, doc_ids = qwen35_inputs()
    ref = run(lambda *t: dr.gated_delta_rule_chunked(*t, doc_ids=doc_ids), [t.double() for t in leaves], dout)
    return leaves, dout, doc_ids, ref


@pytest.mark.parametrize("triton_dqkwg", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fla_matches_chunked(case, dtype, triton_dqkwg, monkeypatch):
    """Where FLA refuses its dqkwg (Hopper, Triton < 3.7.1), both of ours in its backward; elsewhere
    the two cases run FLA's own twice."""
    pytest.importorskip("fla")
    monkeypatch.setattr(dr, "DQKWG_TRITON", triton_dqkwg)
    leaves, dout, doc_ids, ref = case
    cast = [t.to(dtype) if i < 3 or i == 4 else t for i, t in enumerate(leaves)]  # g stays fp32, as the model's
    cu = dr.doc_cu_seqlens(doc_ids)
    fla = run(lambda *t: dr.gated_delta_rule(*t, doc_ids=doc_ids, cu_seqlens=cu), cast, dout)
    dr.USE_FLA = False
    try:
        torch_path = run(lambda *t: dr.gated_delta_rule(*t, doc_ids=doc_ids), cast, dout)
    finally:
        dr.USE_FLA = True
    for name, a, t, r in zip(NAMES, fla, torch_path, ref):
        assert a.dtype == t.dtype and a.shape == r.shape, name
        e_fla, e_torch = rel_err(a, r), rel_err(t, r)
        print(f"{dtype} triton_dqkwg={triton_dqkwg} {name}: fla {e_fla:.2e} torch {e_torch:.2e}")
        assert torch.isfinite(a).all(), name
        if dtype == torch.float32:
            assert e_fla < 1e-2, (name, e_fla)
        else:
            assert e_fla < min(5e-2, 3 * e_torch + 1e-2), (name, e_fla, e_torch)


@pytest.mark.parametrize("varlen, dtype, d", [(False, torch.bfloat16, 128), (True, torch.bfloat16, 128),
                                              (True, torch.float32, 64)])
def test_triton_dqkwg_matches_pytorch(varlen, dtype, d):
    """ops/delta_rule.dqkwg_triton against dqkwg_torch at the Qwen3.5 shape (16 q/k heads, 32 value
    heads, D = 128, chunk 64) on bf16 inputs, compiled for this GPU (the interpreter case in
    tests/triton_interpreter_cases.py checks the same at small shapes in fp32). Both get the same bf16
    tensors; the kernel multiplies ds and the states in bf16 (as FLA's does) where dqkwg_torch stays
    in fp32: below 2e-2 (a few bf16 roundings, summed over 64 tokens and 128 channels)."""
    gen = torch.Generator(device="cuda").manual_seed(7)
    b, t, hk, hv, c = (1, 8192, 16, 32, 64) if varlen else (2, 4096, 16, 32, 64)
    bf16 = dtype  # fp32 at D = 64: full-precision dots (no TF32), 64-wide tiles

    def rnd(*shape, s=1.0):
        return (torch.randn(*shape, device="cuda", generator=gen) * s).to(bf16)

    q, k = F.normalize(rnd(b, t, hk, d).float(), dim=-1).to(bf16), F.normalize(rnd(b, t, hk, d).float(), dim=-1).to(bf16)
    w, v, do, dv = rnd(b, t, hv, d), rnd(b, t, hv, d), rnd(b, t, hv, d), rnd(b, t, hv, d)
    g = -torch.rand(b, t, hv, device="cuda", generator=gen).cumsum(1) * 0.01  # any decays test the formula
    cu, idx = None, None
    if varlen:
        cu = torch.tensor([0, 1000, 4096, 4101, 8192], device="cuda")
        lens = (cu[1:] - cu[:-1]).tolist()
        idx = torch.tensor([(n, i) for n, n_len in enumerate(lens) for i in range(-(-n_len // c))], device="cuda")
    nc = len(idx) if varlen else b * t // c
    h, dh = rnd(nc, hv, d, d, s=0.1), rnd(nc, hv, d, d, s=0.1)
    kw = dict(q=q, k=k, v=v, do=do, h=h, dh=dh, w=w, g=g, dv=dv, scale=d ** -0.5, cu_seqlens=cu,
              chunk_size=c, chunk_indices=idx)
    for name, a, r in zip(("dq", "dk", "dw", "dg"), dr.dqkwg_triton(**kw), dr.dqkwg_torch(**kw)):
        err = rel_err(a, r)
        print(f"dqkwg varlen={varlen} {dtype} D={d} {name}: {err:.2e}")
        assert a.dtype == r.dtype and a.shape == r.shape and torch.isfinite(a).all(), name
        assert err < (2e-2 if dtype == torch.bfloat16 else 1e-5), (name, err)


def test_fla_without_documents_and_compiled():
    """B rows without doc_ids (no varlen), and the FLA custom ops traced by torch.compile(fullgraph=True)."""
    pytest.importorskip("fla")
    leaves, dout, _ = qwen35_inputs(b=2, s=1000, h=8)
    cast = [t.to(torch.bfloat16) if i != 3 else t for i, t in enumerate(leaves)]
    ref = run(lambda *t: dr.gated_delta_rule_chunked(*t), [t.double() for t in cast], dout)
    eager = run(dr.gated_delta_rule, cast, dout)
    compiled = run(torch.compile(dr.gated_delta_rule, fullgraph=True), cast, dout)
    for name, a, c, r in zip(NAMES, eager, compiled, ref):
        assert rel_err(a, r) < 5e-2, (name, rel_err(a, r))
        assert rel_err(c, a) < 1e-6, (name, rel_err(c, a))  # the same kernels, compiled or not


def test_chunked_compiled_on_cuda():
    """The PyTorch chunked path through inductor on CUDA equals eager (fp32, a smaller case)."""
    leaves, dout, doc_ids = qwen35_inputs(b=1, s=512, h=4)
    doc_ids = doc_ids[:1, :512]
    eager = run(lambda *t: dr.gated_delta_rule_chunked(*t, doc_ids=doc_ids), leaves, dout)
    fn = torch.compile(lambda *t: dr.gated_delta_rule_chunked(*t, doc_ids=doc_ids), fullgraph=True)
    for name, a, c in zip(NAMES, eager, run(fn, leaves, dout)):
        assert rel_err(c, a) < 1e-5, (name, rel_err(c, a))


def test_fallback_warns_once_without_fla(monkeypatch):
    """fla hidden: one one-line warning naming the package, then silence; the chunked path's numbers."""
    for name in [m for m in sys.modules if m == "fla" or m.startswith("fla.")] + ["fla"]:
        monkeypatch.setitem(sys.modules, name, None)  # `import fla...` now raises ImportError
    dr._fla.cache_clear()
    monkeypatch.setattr(dr, "_warned", False)
    leaves, dout, doc_ids = qwen35_inputs(b=1, s=100, h=2, dk=16, dv=16)
    doc_ids = doc_ids[:1, :100]
    try:
        with pytest.warns(UserWarning, match="pip install flash-linear-attention") as caught:
            got = run(lambda *t: dr.gated_delta_rule(*t, doc_ids=doc_ids), leaves, dout)
            run(lambda *t: dr.gated_delta_rule(*t, doc_ids=doc_ids), leaves, dout)
        ours = [w for w in caught if "flash-linear-attention" in str(w.message)]
        assert len(ours) == 1 and "\n" not in str(ours[0].message)
        want = run(lambda *t: dr.gated_delta_rule_chunked(*t, doc_ids=doc_ids), leaves, dout)
        for a, b in zip(got, want):
            assert torch.equal(a, b)
    finally:
        dr._fla.cache_clear()  # the next caller imports fla again (monkeypatch restores sys.modules)
