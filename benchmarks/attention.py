"""Attention on one GPU: ops/attention.py's Triton flash kernel against the SDPA paths it replaces.

    PYTHONPATH=. python benchmarks/attention.py [--batches 1 2 4] [--seq 4096] [--docs 0] [--repeats 20]

GPT-OSS-20B shapes (Hq=64, Hkv=8, D=64, a sink per head), full causal and a 128-token window: the
kernel vs `sink_attention` (SDPA with the sink as one extra key and an explicit boolean mask, what
GPT-OSS ran before); Qwen3-30B-A3B shapes (Hq=32, Hkv=4, D=128, no sink): the kernel vs plain
causal SDPA. `--docs N` packs N equal documents per row (masks by document on both sides).
FLOPs count only the visible (query, key) pairs: forward 4 * B * Hq * D * pairs (two matmuls),
backward 2.5 times that (five), so a window's TFLOP/s is useful work, not the S x S square.
Times are medians of CUDA events after warm-up (which includes Triton's compiles and autotuning).

`--mla`: the DeepSeek families' Multi-head Latent Attention shape instead (16 heads, q/k head 192, v head 128,
plain causal, or with `--docs N` the models' documents mask), SDPA with v as it is (what CUDA trains with, models/deepseek_v2.UNPADDED_V) against v padded to
192 and the output sliced back (what the CPU and masked attention run), both as SDPA picks its backend, then
cuDNN alone. TFLOP/s count the unpadded work on both sides: forward 2 * B * H * pairs * (192 + 128), backward
2 * B * H * pairs * (3 * 192 + 2 * 128).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels import median_ms  # noqa: E402
from results import record  # noqa: E402

from pithtrain.ops import attention  # noqa: E402

BF16 = torch.bfloat16
CASES = [  # name, Hq, Hkv, D, sink, window
    ("gpt_oss_full", 64, 8, 64, True, None),
    ("gpt_oss_window128", 64, 8, 64, True, 128),
    ("qwen3_full", 32, 4, 128, False, None),
]


def time_case(fn, inputs, dout, repeats):
    def fwd():
        with torch.no_grad():
            fn(*inputs)

    def fwd_bwd():
        torch.autograd.grad(fn(*inputs), inputs, dout)

    return median_ms(fwd, repeats), median_ms(fwd_bwd, repeats)


SDPA_BACKENDS = [("flash", "FLASH_ATTENTION"), ("cudnn", "CUDNN_ATTENTION"), ("efficient", "EFFICIENT_ATTENTION")]


def pinned(fn, backend: str, expand_kv: bool = False):
    """fn with SDPA held to one backend (torch.nn.attention.sdpa_kernel); expand_kv: k and v repeated
    to the query heads first (for a backend without GQA; the repeat is timed too)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def call(q, k, v, *rest):
        if expand_kv:
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        with sdpa_kernel(getattr(SDPBackend, backend)):
            return fn(q, k, v, *rest)
    return call


def mla(batches: list[int], s: int, repeats: int, docs: int) -> dict:
    """The MLA shape, v unpadded against padded (the module docstring), with `docs` packed documents a row as
    the models mask them (0: plain causal); returns results.jsonl's figures."""
    from torch.nn.attention import SDPBackend

    from pithtrain.models.deepseek_v2 import mla_attention
    from pithtrain.ops.core import attention_mask

    heads, dqk, dv, figures, mask = 16, 192, 128, {}, None

    def padded(q, k, v):
        return mla_attention(q, k, v, mask, dqk**-0.5, pad_v=True)

    def unpadded(q, k, v):
        return mla_attention(q, k, v, mask, dqk**-0.5, pad_v=False)

    for b in batches:
        if docs:
            mask = attention_mask((torch.arange(s, device="cuda") * docs // s).expand(b, s), s, "cuda")
        q, k = (torch.randn(b, heads, s, dqk, device="cuda", dtype=BF16, requires_grad=True) for _ in range(2))
        v = torch.randn(b, heads, s, dv, device="cuda", dtype=BF16, requires_grad=True)
        dout = torch.randn(b, s, heads * dv, device="cuda", dtype=BF16)
        pairs = docs * (s // docs) * (s // docs + 1) // 2 if docs else s * (s + 1) // 2
        fwd_flops, bwd_flops = 2 * b * heads * pairs * (dqk + dv), 2 * b * heads * pairs * (3 * dqk + 2 * dv)
        # the backend SDPA picks for each (with gradients): cuDNN's sm90 rules take q/k 192 with v 128, not 192 with 192
        padded_v = torch.nn.functional.pad(v, (0, dqk - dv))
        choice = dict(attn_mask=mask) if docs else dict(is_causal=True)
        row = {"backend": {name: SDPBackend(torch._fused_sdp_choice(q, k, vv, scale=dqk**-0.5, **choice)).name
                           for name, vv in (("unpadded", v), ("padded", padded_v))}}
        print(f"mla B={b} SDPA picks: {row['backend']}", flush=True)
        for label, fn in [("unpadded", unpadded), ("padded", padded),
                          ("unpadded_cudnn", pinned(unpadded, "CUDNN_ATTENTION")),
                          ("padded_cudnn", pinned(padded, "CUDNN_ATTENTION"))]:
            try:
                f, fb = time_case(fn, [q, k, v], dout, repeats)
            except RuntimeError as e:  # a pinned backend that does not take this shape
                print(f"mla B={b} {label}: {str(e).splitlines()[0][:120]}")
                continue
            tf, tfb = fwd_flops / f / 1e9, (fwd_flops + bwd_flops) / fb / 1e9
            row[label] = {"fwd_ms": round(f, 3), "fwd_bwd_ms": round(fb, 3), "fwd_tflops": round(tf, 1),
                          "fwd_bwd_tflops": round(tfb, 1)}
            print(f"mla B={b} S={s} {label:15s}  fwd {f:7.3f} ms {tf:6.1f} TFLOP/s   fwd+bwd {fb:7.3f} ms {tfb:6.1f} TFLOP/s",
                  flush=True)
        if "fwd_ms" in row.get("unpadded", {}) and "fwd_ms" in row.get("padded", {}):
            print(f"mla B={b} unpadded speed-up: fwd {row['padded']['fwd_ms'] / row['unpadded']['fwd_ms']:.2f}x, "
                  f"fwd+bwd {row['padded']['fwd_bwd_ms'] / row['unpadded']['fwd_bwd_ms']:.2f}x")
        figures[f"mla_b{b}"] = row
    return figures


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--docs", type=int, default=0, help="documents packed per row (0: one)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--sdpa-backends", action="store_true", help="Qwen3's plain causal case only: also time "
                        "each SDPA backend alone (flash, cuDNN, efficient), to find the fastest on this GPU")
    parser.add_argument("--mla", action="store_true", help="the DeepSeek MLA shape alone: v unpadded against padded")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (it times the GPU kernels); run it on the GPU machine")
    s, figures = args.seq, {}
    if args.mla:
        record({"benchmark": "attention_mla", "seq": s, "docs": args.docs, **mla(args.batches, s, args.repeats, args.docs)})
        return
    for name, hq, hkv, d, sink, window in CASES:
        for b in args.batches:
            q = torch.randn(b, hq, s, d, device="cuda", dtype=BF16, requires_grad=True)
            k, v = (torch.randn(b, hkv, s, d, device="cuda", dtype=BF16, requires_grad=True) for _ in range(2))
            inputs = [q, k, v] + ([torch.randn(hq, device="cuda", requires_grad=True)] if sink else [])
            doc_ids = (torch.arange(s, device="cuda") * args.docs // s).expand(b, s) if args.docs else None
            dout = torch.randn(b, s, hq * d, device="cuda", dtype=BF16)
            flops = attention.attention_flops(b, hq, s, d, window)
            if args.docs:  # the pairs within the documents (equal lengths)
                flops = args.docs * attention.attention_flops(b, hq, s // args.docs, d, window)

            def run(path):
                return lambda q, k, v, *z: path(q, k, v, d**-0.5, z[0] if z else None, window, doc_ids)

            row, paths = {}, [("flash", run(attention.attention)), ("sdpa", run(attention.attention_reference))]
            if args.sdpa_backends and name == "qwen3_full" and not args.docs:
                paths += [(f"sdpa_{label}", pinned(run(attention.attention_reference), backend))
                          for label, backend in SDPA_BACKENDS]
                paths += [("sdpa_cudnn_mha", pinned(run(attention.attention_reference), "CUDNN_ATTENTION", True))]
            for label, fn in paths:
                try:
                    f, fb = time_case(fn, inputs, dout, args.repeats)
                except torch.OutOfMemoryError:
                    print(f"{name} B={b} {label}: out of memory")
                    continue
                except RuntimeError as e:  # a pinned SDPA backend that does not take this shape
                    print(f"{name} B={b} {label}: {str(e).splitlines()[0][:120]}")
                    continue
                tf, tfb = flops / f / 1e9, 3.5 * flops / fb / 1e9
                row[label] = {"fwd_ms": round(f, 3), "fwd_bwd_ms": round(fb, 3), "fwd_tflops": round(tf, 1),
                              "fwd_bwd_tflops": round(tfb, 1)}
                print(f"{name:18s} B={b} S={s} docs={args.docs} {label:14s}  fwd {f:7.3f} ms {tf:6.1f} TFLOP/s   "
                      f"fwd+bwd {fb:7.3f} ms {tfb:6.1f} TFLOP/s   (bwd/fwd {(fb - f) / f:.2f})", flush=True)
                torch.cuda.empty_cache()
            if "flash" in row and "sdpa" in row:
                print(f"{'':18s} flash speed-up: fwd {row['sdpa']['fwd_ms'] / row['flash']['fwd_ms']:.2f}x, "
                      f"fwd+bwd {row['sdpa']['fwd_bwd_ms'] / row['flash']['fwd_bwd_ms']:.2f}x")
            figures[f"{name}_b{b}"] = row
    record({"benchmark": "attention", "seq": s, "docs": args.docs, **figures})


if __name__ == "__main__":
    main()
