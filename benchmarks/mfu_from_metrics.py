"""Per-GPU tokens/s, TFLOP/s and MFU of a finished multi-GPU run, from its metrics.jsonl.

    PYTHONPATH=. python benchmarks/mfu_from_metrics.py RUN_DIR CONFIG --nproc 8 [--set model.num_hidden_layers=46]
        [--peak 790]   (bf16 matmul TFLOP/s of one GPU; measured on this GPU when omitted)

FLOPs per token as in train_throughput.py (6 x active non-embedding parameters + LM head + causal
attention). Medians over the steps after the first two, skipping a profiled step (slower).
"""

import argparse
import json
import statistics
from pathlib import Path

from train_throughput import flops_per_token, matmul_peak_tflops


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir")
    parser.add_argument("config")
    parser.add_argument("--nproc", type=int, required=True)
    parser.add_argument("--set", action="append", default=[])
    parser.add_argument("--peak", type=float, help="bf16 matmul peak TFLOP/s per GPU (default: measure it)")
    args = parser.parse_args()
    from pithtrain.config import apply_override, load_run_config

    config = load_run_config(args.config)
    for assignment in args.set:
        apply_override(config, assignment)
    metrics_path = Path(args.run_dir) / "metrics.jsonl"
    if not metrics_path.is_file():
        raise SystemExit(f"{metrics_path} not found: give the --out directory of a finished `pithtrain train` run")
    steps = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    profiled = config.train.profile_step
    warm = [m for m in steps[2:] if m["step"] != profiled] or steps
    total = statistics.median(m["tokens_per_s"] for m in warm)
    fpt = flops_per_token(config.model, config.data.seq_len)
    peak = args.peak or matmul_peak_tflops()
    per_gpu = total / args.nproc
    result = {"steps": len(warm), "tokens_per_s": total, "tokens_per_s_per_gpu": per_gpu,
              "tflops_per_gpu": per_gpu * fpt / 1e12, "mfu": per_gpu * fpt / 1e12 / peak, "peak_tflops": peak,
              "peak_mem_gib": max(m["peak_mem_bytes"] for m in steps) / 2**30}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
