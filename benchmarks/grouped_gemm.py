"""TFLOP/s of the expert grouped GEMM (torch._grouped_mm) at a model's expert shapes, for the three
products of training (forward, input gradient, weight gradient), against a dense matmul of the
same FLOPs. Balanced routing (every expert gets tokens*k/E rows).

    PYTHONPATH=. python benchmarks/grouped_gemm.py --tokens 4096 --experts 128 --topk 8 --hidden 2048 --inter 768

`--wgrad` (default --tokens 8192: 65,536 rows): the weight gradient accumulated into an fp32 .grad, as
training does it, balanced and skewed routing: torch._grouped_mm + kernels.add_into against the fused
kernels.wgrad_into (the add in the GEMM's epilogue; grouped_gemm.FUSED_WGRAD): as training runs it (tensor-
descriptor (TMA) loads, the add a bulk reduce in L2), with the descriptors made on the host or by each
program, assigning (no old values read), with the epilogue's load-add-store instead, and with plain pointer
loads. `--host on|off` sets
kernels.WGRAD_HOST_DESCRIPTORS for the sweep. Records a line in benchmarks/results.jsonl. `--sweep` also times
tiles of the fused kernel (both routings, both shapes, `--rounds` passes over the tiles) and records the best over both
(`sweep_best_both`, for train_throughput.py --wgrad-config).

    PYTHONPATH=. python benchmarks/grouped_gemm.py --wgrad [--sweep]
"""

import argparse
import statistics

import torch
from kernels import median_ms  # benchmarks/kernels.py: CUDA-event median over repeats
from results import record

from pithtrain.ops import kernels
from pithtrain.ops.grouped_gemm import grouped_mm, grouped_weight_grad

SWEEP = [dict(BK=bk, BM=bm, BN=bn, num_warps=w, num_stages=st)
         for bk, bm, bn, w, st in ((128, 128, 64, 8, 3), (128, 128, 64, 4, 3), (128, 128, 64, 4, 4), (128, 128, 64, 4, 2),
                                   (128, 128, 32, 4, 4), (128, 128, 128, 4, 3), (128, 64, 64, 4, 3), (64, 128, 64, 4, 3),
                                   (256, 64, 64, 4, 3), (64, 256, 64, 4, 3), (128, 256, 64, 8, 3), (256, 128, 64, 8, 3),
                                   (64, 64, 64, 4, 4), (64, 64, 128, 4, 3), (128, 128, 32, 4, 3), (128, 128, 32, 4, 5),
                                   (128, 128, 32, 8, 4), (128, 256, 32, 8, 4))]


def skewed_counts(rows: int, experts: int) -> torch.Tensor:
    """Log-normal expert loads (a few experts several times the mean, some near zero), summing to rows."""
    gen = torch.Generator().manual_seed(0)
    share = torch.exp(torch.randn(experts, generator=gen))
    counts = (share / share.sum() * rows).long()
    counts[0] += rows - counts.sum()
    return counts.cuda()


def wgrad(args):
    rows = args.tokens * args.topk
    figures = {"benchmark": "grouped_wgrad_into", "rows": rows, "experts": args.experts,
               "host_descriptors": kernels.WGRAD_HOST_DESCRIPTORS}
    for k, m, label in ((args.hidden, 2 * args.inter, "gate_up"), (args.inter, args.hidden, "down")):
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn(rows, m, device="cuda", dtype=torch.bfloat16)
        grad = torch.randn(args.experts, k, m, device="cuda")
        flops = 2 * rows * k * m
        for routing, counts in (("balanced", torch.full((args.experts,), rows // args.experts, device="cuda")),
                                ("skewed", skewed_counts(rows, args.experts))):
            runs = {"cutlass+add_into": lambda: kernels.add_into(grad, grouped_weight_grad(x, dy, counts, args.experts)),
                    "cutlass alone": lambda: grouped_weight_grad(x, dy, counts, args.experts),
                    "fused": lambda: kernels.wgrad_into(grad, x, dy, counts, False),
                    "fused host descriptors": lambda: kernels.wgrad_into(grad, x, dy, counts, False, host=True),
                    "fused device descriptors": lambda: kernels.wgrad_into(grad, x, dy, counts, False, host=False),
                    "fused assign": lambda: kernels.wgrad_into(grad, x, dy, counts, True),  # no old values read
                    "fused load-add-store": lambda: kernels.wgrad_into(grad, x, dy, counts, False, reduce=False),
                    "fused pointer loads": lambda: kernels.wgrad_into(grad, x, dy, counts, False, tma=False)}
            ref = kernels.add_into(grad.clone(), grouped_weight_grad(x, dy, counts, args.experts))
            err = (kernels.wgrad_into(grad.clone(), x, dy, counts, False) - ref).norm() / ref.norm()
            err = err.item()  # the fused one is the more exact: it does not round the product to bf16
            del ref
            for what, fn in runs.items():
                t = median_ms(fn, args.repeats)
                figures[f"{label}_{routing}_{what.replace(' ', '_').replace('/', '_per_')}_ms"] = round(t, 4)
                print(f"{label:8s} {routing:8s} [{rows} x {k}]^T [{rows} x {m}] {what:20s} {t:7.3f} ms "
                      f"{flops / t / 1e9:6.0f} TFLOP/s", flush=True)
            print(f"{label:8s} {routing:8s} fused vs cutlass+add_into: relative difference {err:.1e}")
            figures[f"{label}_{routing}_rel_diff"] = float(f"{err:.2e}")
        if args.sweep:  # the tiles in turn, `--rounds` times over (the GPU's clock drifts between one tile's
            # timing and the next's), on both routings: the median of each tile's per-round medians
            routings = {"balanced": torch.full((args.experts,), rows // args.experts, device="cuda"),
                        "skewed": skewed_counts(rows, args.experts)}
            times = {}
            for _ in range(args.rounds):
                for i, cfg in enumerate(SWEEP):
                    for routing, counts in routings.items():
                        try:
                            t = median_ms(lambda: kernels.wgrad_into(grad, x, dy, counts, False, cfg=cfg),
                                          args.repeats)
                        except Exception as e:  # out of shared memory, say
                            t = float("nan")
                            print(f"  sweep {cfg}: failed ({type(e).__name__})")
                        times.setdefault((i, routing), []).append(t)
            best = None
            for i, cfg in enumerate(SWEEP):
                t = {r: statistics.median(times[i, r]) for r in routings}
                print(f"  sweep {cfg}: balanced {t['balanced']:7.3f} ms, skewed {t['skewed']:7.3f} ms "
                      f"({flops / t['balanced'] / 1e9:4.0f} TFLOP/s balanced)", flush=True)
                if not best or sum(t.values()) < sum(best[0].values()):
                    best = (t, cfg)
            if best:
                print(f"best: {best[1]} {best[0]} (kernels.WGRAD_INTO_CONFIG is {kernels.WGRAD_INTO_CONFIG})")
                figures[f"{label}_sweep_best"] = str(best[1])
                figures[f"{label}_sweep_best_ms"] = {r: round(v, 4) for r, v in best[0].items()}
                figures[f"{label}_sweep_ms"] = {str(tuple(c.values())): [round(statistics.median(times[i, r]), 4)
                                                                       for r in routings]
                                                for i, c in enumerate(SWEEP)}
    if args.sweep:  # the tile for training: the least time over both GEMMs and both routings
        totals = [sum(sum(figures[f"{label}_sweep_ms"][str(tuple(c.values()))]) for label in ("gate_up", "down"))
                  for c in SWEEP]
        figures["sweep_best_both"] = SWEEP[min(range(len(SWEEP)), key=lambda i: (totals[i] != totals[i], totals[i]))]
        print(f"best over both GEMMs: {figures['sweep_best_both']}")
    record(figures)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("tokens", None), ("experts", 128), ("topk", 8), ("hidden", 2048), ("inter", 768)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--wgrad", action="store_true", help="the fused weight gradient against cutlass + add_into")
    parser.add_argument("--sweep", action="store_true", help="with --wgrad: tiles of the fused kernel")
    parser.add_argument("--host", choices=["on", "off"], help="with --sweep: kernels.WGRAD_HOST_DESCRIPTORS")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3, help="with --sweep: passes over the tiles")
    args = parser.parse_args()
    if args.rounds < 1 or args.repeats < 1:
        parser.error("--rounds and --repeats must be at least 1")
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (it times the GPU kernels); run it on the GPU machine")
    # --wgrad: 65,536 routed rows a micro-batch, as measured in docs/performance.md
    args.tokens = args.tokens or (8192 if args.wgrad else 4096)
    if args.wgrad:
        if args.host:
            kernels.WGRAD_HOST_DESCRIPTORS = args.host == "on"
        return wgrad(args)
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
            t = median_ms(fn, args.repeats) / 1e3
            print(f"{label:8s} [{rows} x {k}] x [{args.experts} x {k} x {m}] {what:17s} {t * 1e3:7.3f} ms {flops / t / 1e12:6.0f} TFLOP/s")


if __name__ == "__main__":
    main()
