"""Muon's optimizer step alone at Qwen3-30B-A3B width on one GPU: the whole step for an L-layer model
(random gradients, fp32 master weights as in training) against AdamW's, and Newton-Schulz alone per
matrix shape in TFLOP/s (5 iterations of 2 m^2 n + 2 m^3 + 2 m^2 n FLOPs each, m <= n).

    PYTHONPATH=. python benchmarks/muon_step.py --layers 8
"""

from __future__ import annotations

import argparse
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
from pithtrain.train.optim import build_optimizer, newton_schulz, optimizer_step  # noqa: E402


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
    args = parser.parse_args()
    cfg = qwen3_config(args.layers)
    with torch.device("cuda"):
        model = cfg.build_model()
    params = [(n, p) for n, p in model.named_parameters()]
    for _, p in params:
        p.grad = torch.randn_like(p) * 1e-3
    result = {"family": "qwen3", "layers": args.layers}
    for name in ("adamw", "muon"):
        opt = build_optimizer(params, OptimConfig(name=name, lr=1e-4), "cuda")
        result[f"{name}_step_s"] = timed(lambda: optimizer_step(opt, [p for _, p in params]), args.repeats)
        print(f"{name}: optimizer step {result[f'{name}_step_s'] * 1e3:.1f} ms", flush=True)
        del opt
        torch.cuda.empty_cache()
    shapes = {"expert gate or up / down (x128)": (128, 768, 2048), "q_proj / o_proj": (2048, 4096),
              "k_proj / v_proj": (512, 2048)}
    result["newton_schulz_tflops"] = {}
    for label, shape in shapes.items():
        g = torch.randn(shape, device="cuda")
        m, n = shape[-2:]
        flops = 5 * (4 * m * m * n + 2 * m**3) * (shape[0] if len(shape) == 3 else 1)
        t = timed(lambda: newton_schulz(g), args.repeats)
        result["newton_schulz_tflops"][label] = flops / t / 1e12
        print(f"newton_schulz {label} {tuple(shape)}: {t * 1e3:.2f} ms, {flops / t / 1e12:.0f} TFLOP/s", flush=True)
    record({"benchmark": "muon_step", **result})


if __name__ == "__main__":
    main()
