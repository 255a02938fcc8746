"""ops/delta_rule.dqkwg_torch against FLA 0.6.0's Triton chunk_bwd_kernel_dqkwg, and FLA's whole gated
delta rule (forward + backward, dqkwg_torch swapped in) against the PyTorch chunked path, on the CPU
under the Triton interpreter (float32; GVA, varlen documents, rows of whole chunks and ragged rows).

    TRITON_INTERPRET=1 PYTHONPATH=.:FLA_SITE python benchmarks/delta_rule_interpreter.py

Not a CI test: it needs fla (pip install flash-linear-attention==0.6.0, or its wheels unzipped into
FLA_SITE). Tolerance 1e-5 of the largest entry (fp32; both sides sum in fp32, in different orders;
seen: 2e-7 for dqkwg, 1e-6 for the whole op). The whole-op part needs one FLA kernel line made
interpreter-safe: fla/ops/common/chunk_delta_h.py's `i_t.to(tl.int64)` on a Python loop counter (an
int under the interpreter) as `tl.cast(i_t, tl.int64)`; with vanilla fla that part reports the
interpreter error and is skipped. Autotuning is cut to each kernel's first config (no benchmarker).
"""

import os
import sys

import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    sys.exit("run with TRITON_INTERPRET=1 (set before Triton is imported)")
try:
    import fla.ops.common.chunk_o as chunk_o
    import fla.ops.gated_delta_rule.chunk as chunk
    from fla.ops.utils.index import prepare_chunk_indices
except ImportError:
    sys.exit("needs fla: pip install flash-linear-attention==0.6.0")
import triton.runtime.autotuner as autotuner
from triton.runtime.errors import InterpreterError

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from pithtrain.ops import delta_rule as dr  # noqa: E402

autotuner.Autotuner._bench = lambda self, *a, config=None, **k: [0.0, 0.0, 0.0]  # first config wins
gen = torch.Generator().manual_seed(0)
TOL = 1e-5


def rn(*shape):
    return torch.randn(*shape, generator=gen)


def rel(a, b):
    return float((a - b).detach().abs().max() / b.abs().max())


def check_dqkwg():
    # (rows, tokens, cu_seqlens): ragged rows, rows of whole chunks (no gather), varlen documents
    for b, t, cu in ((2, 70, None), (2, 128, None), (1, 100, torch.tensor([0, 30, 64, 100]))):
        h, hv, k, v, c = 2, 4, 32, 16, 64
        idx = None if cu is None else prepare_chunk_indices(cu, c)
        nt = -(-t // c) if cu is None else len(idx)
        g = chunk.chunk_local_cumsum(-torch.rand(b, t, hv, generator=gen) * 3, chunk_size=c, scale=1 / 0.6931471805599453,
                                     cu_seqlens=cu, chunk_indices=idx)  # log2 units, as FLA's forward gives
        kw = dict(q=rn(b, t, h, k), k=rn(b, t, h, k), v=rn(b, t, hv, v), w=rn(b, t, hv, k), g=g, h=rn(b, nt, hv, k, v),
                  dv=rn(b, t, hv, v), do=rn(b, t, hv, v), dh=rn(b, nt, hv, k, v), scale=k**-0.5, cu_seqlens=cu,
                  chunk_indices=idx, chunk_size=c)
        for name, a, r in zip(("dq", "dk", "dw", "dg"), dr.dqkwg_torch(**kw), chunk_o.chunk_bwd_dqkwg(**kw)):
            err = rel(a, r)
            print(f"dqkwg B={b} T={t} varlen={cu is not None} {name}: {err:.1e}")
            assert a.shape == r.shape and a.dtype == r.dtype and err < TOL, name


def check_whole_op():
    chunk.chunk_bwd_dqkwg = dr.dqkwg_torch  # what _patch_fla does on Hopper with Triton < 3.7.1
    for docs in (None, torch.tensor([[0] * 30 + [1] * 34 + [2] * 16, [3] * 64 + [4] * 16])):
        q, k = dr.l2norm(rn(2, 80, 2, 32)), dr.l2norm(rn(2, 80, 2, 32))  # 2 q/k heads for 4 value heads
        x = [t.requires_grad_() for t in (q, k, rn(2, 80, 4, 16), -torch.rand(2, 80, 4, generator=gen) * 0.5,
                                          torch.rand(2, 80, 4, generator=gen))]
        dout = rn(2, 80, 4, 16)

        def grads(fn):
            o = fn(*x)
            return [o, *torch.autograd.grad(o, x, dout)]

        try:
            got = grads(lambda *t: dr._fla_path(*t, docs, 64, None))
        except InterpreterError as e:
            print(f"whole op skipped: FLA's kernels do not run under this interpreter ({e}); see the docstring")
            return
        want = grads(lambda *t: dr.gated_delta_rule_chunked(*t, doc_ids=docs, chunk_size=64))
        for name, a, r in zip(("o", "dq", "dk", "dv", "dg", "dbeta"), got, want):
            err = rel(a, r)
            print(f"FLA fwd+bwd docs={docs is not None} {name}: {err:.1e}")
            assert err < TOL, name


if __name__ == "__main__":
    check_dqkwg()
    check_whole_op()
    print("PASS")
