"""TFLOP/s of the expert grouped GEMM (torch._grouped_mm) at a model's expert shapes, for the three
products of training (forward, input gradient, weight gradient), against a dense matmul of the
same FLOPs. Balanced routing (every expert gets tokens*k/E rows).

    PYTHONPATH=. python benchmarks/grouped_gemm.py --tokens 4096 --experts 128 --topk 8 --hidden 2048 --inter 768
"""

import argparse

import torch
from kernels import median_ms  # benchmarks/kernels.py: CUDA-event median over repeats

from pithtrain.ops.grouped_gemm import grouped_mm, grouped_weight_grad


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("tokens", 4096), ("experts", 128), ("topk", 8), ("hidden", 2048), ("inter", 768)):
        parser.add_argument(f"--{name}", type=int, default=default)
    args = parser.parse_args()
    rows = args.tokens * args.topk
    counts = torch.full((args.experts,), rows // args.experts, device="cuda")
    rows = int(counts.sum())
    for k, m, label in ((args.hidden, 2 * args.inter, "gate_up"), (args.inter, args.hidden, "down")):
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(args.experts, k, m, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn(rows, m, device="cuda", dtype=torch.bfloat16)
        flops = 2 * rows * k * m
        dense_a, dense_b = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16), torch.randn(k, m, device="cuda", dtype=torch.bfloat16)
        for what, fn in (("forward", lambda: grouped_mm(x, w, counts)),
                         ("input grad", lambda: grouped_mm(dy, w.transpose(-1, -2), counts)),
                         ("weight grad", lambda: grouped_weight_grad(x, dy, counts, args.experts)),
                         ("dense same FLOPs", lambda: dense_a @ dense_b)):
            t = median_ms(fn, 20) / 1e3
            print(f"{label:8s} [{rows} x {k}] x [{args.experts} x {k} x {m}] {what:17s} {t * 1e3:7.3f} ms {flops / t / 1e12:6.0f} TFLOP/s")


if __name__ == "__main__":
    main()
