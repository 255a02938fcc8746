"""Gated DeltaNet's gated delta rule on one GPU: FLA's Triton kernels (ops/delta_rule.py's GPU path, with
our dqkwg in the backward where FLA refuses its own: Triton, and the PyTorch one as `fla_dqkwg_torch`;
that kernel alone per launch config under "dqkwg") against the PyTorch chunked path, eager and
torch.compile'd, at the Qwen3.5-35B-A3B shape (B=4, S=4096, 32 value heads, Dk=Dv=128, bf16).

    PYTHONPATH=. python benchmarks/delta_rule.py [--batch 4] [--seq 4096] [--docs 0] [--repeats 10]

FLOPs: delta_rule.chunked_flops, the matmuls of the chunked algorithm per chunk of C=64 tokens and head
(k k^T C*C*Dk, the triangular inverse C^3/3, w/u C*C*(Dk+Dv), q k^T C*C*Dk, q S, w S and k^T v_new
C*Dk*Dv each, attn v_new C*C*Dv; 2 FLOPs a multiply-add); backward counted as 2x the forward, so
fwd+bwd TFLOP/s = 3 x forward FLOPs / time. `--docs N` packs N equal documents a row (FLA: varlen,
cu_seqlens computed once outside the timed region). Medians of CUDA events after warm-up.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels import median_ms  # noqa: E402
from results import record  # noqa: E402

from pithtrain.ops import delta_rule as dr  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--docs", type=int, default=0, help="documents packed per row (0: one)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--paths", default="fla,fla_dqkwg_torch,torch_eager,torch_compiled",
                        help="which to time (torch_compiled compiles for minutes)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (it times the GPU kernels); run it on the GPU machine")
    b, s, h, d = args.batch, args.seq, args.heads, args.dim
    bf16 = torch.bfloat16
    q = F.normalize(torch.randn(b, s, h, d, device="cuda"), dim=-1).to(bf16).requires_grad_()
    k = F.normalize(torch.randn(b, s, h, d, device="cuda"), dim=-1).to(bf16).requires_grad_()
    v = torch.randn(b, s, h, d, device="cuda", dtype=bf16, requires_grad=True)
    g = (-torch.rand(b, s, h, device="cuda").mul(4).exp().mul(0.05)).requires_grad_()
    beta = torch.randn(b, s, h, device="cuda").sigmoid().to(bf16).requires_grad_()
    inputs = [q, k, v, g, beta]
    dout = torch.randn(b, s, h, d, device="cuda", dtype=bf16)
    doc_ids = (torch.arange(s, device="cuda") * args.docs // s).expand(b, s).contiguous() if args.docs else None
    cu = dr.doc_cu_seqlens(doc_ids) if args.docs else None
    flops = dr.chunked_flops(b, s, h, d, d)

    def fla(*t):
        return dr.gated_delta_rule(*t, doc_ids=doc_ids, cu_seqlens=cu)

    def chunked(*t):
        return dr.gated_delta_rule_chunked(*t, doc_ids=doc_ids)

    paths = [("torch_eager", chunked), ("torch_compiled", torch.compile(chunked, fullgraph=True))]
    patched = False
    if dr._fla_ready():
        import fla.ops.gated_delta_rule.chunk as chunk
        patched = chunk.chunk_bwd_dqkwg is dr._our_dqkwg
        paths[:0] = [("fla", fla)] + ([("fla_dqkwg_torch", fla)] if patched else [])
        print(f"FLA backward's dqkwg: {'ours (FLA refuses its kernel here)' if patched else 'FLA'}")
    else:
        print("fla not installed: timing the PyTorch paths only")
    paths = [(label, fn) for label, fn in paths if label in args.paths.split(",")]
    figures = {"dqkwg": time_dqkwg(b, s, h, d, args.repeats)} if patched else {}
    for label, fn in paths:
        dr.DQKWG_TRITON = label != "fla_dqkwg_torch"
        def fwd():
            with torch.no_grad():
                fn(*inputs)

        def fwd_bwd():
            torch.autograd.grad(fn(*inputs), inputs, dout)

        try:
            f, fb = median_ms(fwd, args.repeats), median_ms(fwd_bwd, args.repeats)
        except torch.OutOfMemoryError:
            print(f"{label}: out of memory")
            continue
        tf, tfb = flops / f / 1e9, 3 * flops / fb / 1e9
        figures[label] = {"fwd_ms": round(f, 3), "fwd_bwd_ms": round(fb, 3), "fwd_tflops": round(tf, 1),
                          "fwd_bwd_tflops": round(tfb, 1)}
        print(f"{label:15s} B={b} S={s} H={h} D={d} docs={args.docs}  fwd {f:8.3f} ms {tf:6.1f} TFLOP/s   "
              f"fwd+bwd {fb:8.3f} ms {tfb:6.1f} TFLOP/s", flush=True)
        torch.cuda.empty_cache()
    dr.DQKWG_TRITON = True
    record({"benchmark": "delta_rule", "batch": b, "seq": s, "heads": h, "dim": d, "docs": args.docs,
            "fwd_gflop": round(flops / 1e9, 1), "dqkwg_ours": patched, **figures})


def time_dqkwg(b, s, h, d, repeats):
    """The backward's dqkwg alone (where ours replaces FLA's): dqkwg_torch, and dqkwg_triton per
    (num_warps, num_stages); the module's DQKWG_WARPS / DQKWG_STAGES come from these figures."""
    bf16, c = torch.bfloat16, 64
    nc = b * s // c
    q, k, w = (torch.randn(b, s, h // 2 if i < 2 else h, d, device="cuda", dtype=bf16) for i in range(3))
    v, do, dv = (torch.randn(b, s, h, d, device="cuda", dtype=bf16) for _ in range(3))
    g = -torch.rand(b, s // c, c, h, device="cuda").cumsum(2).reshape(b, s, h) * 0.05
    st, dst = (torch.randn(b, nc // b, h, d, d, device="cuda", dtype=bf16) * 0.1 for _ in range(2))
    kw = dict(q=q, k=k, v=v, do=do, h=st, dh=dst, w=w, g=g, dv=dv, scale=d ** -0.5, chunk_size=c)
    ref = dr.dqkwg_torch(**kw)
    out = {"torch_ms": round(median_ms(lambda: dr.dqkwg_torch(**kw), repeats), 3)}
    best = dr.DQKWG_WARPS, dr.DQKWG_STAGES
    for warps in (4, 8):
        for stages in (1, 2, 3):
            dr.DQKWG_WARPS, dr.DQKWG_STAGES = warps, stages
            try:
                got = dr.dqkwg_triton(**kw)
                err = max(((a.float() - r.float()).norm() / r.float().norm()).item() for a, r in zip(got, ref))
                ms = median_ms(lambda: dr.dqkwg_triton(**kw), repeats)
            except Exception as e:  # a config out of shared memory or registers: say so, go on
                print(f"dqkwg_triton warps={warps} stages={stages}: {type(e).__name__}: {str(e)[:120]}")
                continue
            out[f"triton_w{warps}s{stages}_ms"] = round(ms, 3)
            print(f"dqkwg_triton warps={warps} stages={stages}: {ms:.3f} ms, rel err vs torch {err:.1e}")
    dr.DQKWG_WARPS, dr.DQKWG_STAGES = best
    print(f"dqkwg_torch: {out['torch_ms']:.3f} ms", flush=True)
    return out


if __name__ == "__main__":
    main()
