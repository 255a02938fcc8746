"""Muon's optimizer step alone at Qwen3-30B-A3B width on one GPU, against AdamW's: (a) the whole step
for an L-layer model (random gradients, fp32 master weights as in training), (b) Newton-Schulz alone
on each batched shape (the Muon group's matrices of one shape, in batches of NS_BATCH_BYTES) in TFLOP/s
(5 iterations of 4 m^2 n + 2 m^3 FLOPs per m x n matrix, m <= n), (c) the elementwise passes alone
(ops/kernels.muon_momentum + muon_apply over every Muon parameter).

    PYTHONPATH=. python benchmarks/muon_step.py --layers 8 [--batch-gib 2]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from results import record  # noqa: E402
from train_throughput import qwen3_config  # noqa: E402

from pithtrain.config import OptimConfig  # noqa: E402
from pithtrain.ops import kernels  # noqa: E402
from pithtrain.train import optim  # noqa: E402


def timed(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch-gib", type=float, default=optim.NS_BATCH_BYTES / 2**30,
                        help="optim.NS_BATCH_BYTES in GiB: the bound on one Newton-Schulz batch")
    args = parser.parse_args()
    optim.NS_BATCH_BYTES = int(args.batch_gib * 2**30)
    cfg = qwen3_config(args.layers)
    with torch.device("cuda"):
        model = cfg.build_model()
    params = [(n, p) for n, p in model.named_parameters()]
    for _, p in params:
        p.grad = torch.randn_like(p) * 1e-3
    result = {"family": "qwen3", "layers": args.layers, "ns_batch_gib": args.batch_gib}
    for name in ("adamw", "muon"):
        opt = optim.build_optimizer(params, OptimConfig(name=name, lr=1e-4), "cuda")
        result[f"{name}_step_s"] = timed(lambda: optim.optimizer_step(opt, [p for _, p in params]), args.repeats)
        print(f"{name}: optimizer step {result[f'{name}_step_s'] * 1e3:.1f} ms", flush=True)
        del opt
        torch.cuda.empty_cache()

    muon = [(n, p) for n, p in params if optim.takes_muon(n, p, OptimConfig().muon_exclude)]
    shapes = {}  # (rows, cols) of one matrix -> how many the Muon group holds
    for n, p in muon:
        halves = 2 if n.endswith(".experts.gate_up") else 1
        rows, cols = p.shape[-2], p.shape[-1] // halves
        shapes[rows, cols] = shapes.get((rows, cols), 0) + p.numel() // (rows * cols)
    result["newton_schulz"], ns_total = {}, 0.0
    for (rows, cols), count in shapes.items():  # one batch as large as NS_BATCH_BYTES allows, scaled to all
        size = max(1, min(count, optim.NS_BATCH_BYTES // (rows * cols * 2)))
        g = torch.randn(size, rows, cols, device="cuda", dtype=torch.bfloat16)
        m, n = min(rows, cols), max(rows, cols)
        t = timed(lambda: optim.newton_schulz(g), args.repeats)
        tflops = 5 * (4 * m * m * n + 2 * m**3) * size / t / 1e12
        ns_total += t * count / size
        result["newton_schulz"][f"{rows}x{cols}"] = {"count": count, "batch": size, "batch_s": t, "tflops": tflops}
        print(f"newton_schulz [{size}, {rows}, {cols}] (of {count}): {t * 1e3:.2f} ms, {tflops:.0f} TFLOP/s", flush=True)
        del g
    result["newton_schulz_total_s"] = ns_total
    print(f"newton_schulz, all shapes: {ns_total * 1e3:.1f} ms", flush=True)

    scratch = torch.empty(max(p.numel() for _, p in muon), device="cuda", dtype=torch.bfloat16)
    bufs = [torch.zeros_like(p) for _, p in muon]

    def elementwise():
        with torch.no_grad():
            for (n, p), buf in zip(muon, bufs):
                halves = 2 if n.endswith(".experts.gate_up") else 1
                out = scratch[:p.numel()].view(-1, p.shape[-2], p.shape[-1] // halves)
                kernels.muon_momentum(p.grad, buf, 0.95, out, halves)
                kernels.muon_apply(p, out, 1 - 1e-5, 1e-5 * math.sqrt(max(out.shape[-2:])), halves)

    result["elementwise_s"] = timed(elementwise, args.repeats)
    gb = sum(p.numel() * (4 * 5 + 2 * 2) for _, p in muon) / 1e9  # grad, buf r/w, weight r/w; the batch w/r
    print(f"elementwise (momentum + update passes): {result['elementwise_s'] * 1e3:.1f} ms, "
          f"{gb / result['elementwise_s']:.0f} GB/s", flush=True)
    record({"benchmark": "muon_step", **result})


if __name__ == "__main__":
    main()
