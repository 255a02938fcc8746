"""Muon against AdamW on a real corpus: each optimizer at a few learning rates, 500 steps, one GPU.

The model and data of benchmarks/fp8_loss.py (Qwen3-MoE, ~138M active parameters, the Python
standard library's sources, seq 1024, 16 samples a step, warmup 50 + cosine). Every (optimizer, lr)
is its own process, all started at once (the model is small: the GPU has room for several). The
best learning rate of each optimizer (lowest mean loss over the last 100 steps) is its tuned one.
Prints a table, writes a plot of the tuned pair and one JSON line to benchmarks/results.jsonl.

    PYTHONPATH=. python benchmarks/muon_loss.py --steps 500 --adamw-lrs 5e-4,1e-3,2e-3 \
        --muon-lrs 1e-3,2e-3,4e-3 --plot docs/muon_loss.png
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fp8_loss import active_params, model_config, plot_losses  # noqa: E402
from results import record  # noqa: E402


def one_run(optim: str, lr: float, steps: int, data: str, out: str) -> None:
    """Train one (optimizer, lr) and write its loss curve and median tokens/s to `out`."""
    from pithtrain.config import DataConfig, OptimConfig, RunConfig, TrainConfig
    from pithtrain.train.loop import train

    run = RunConfig(model=model_config(), data=DataConfig(path=data, seq_len=1024, seed=1234),
                    optim=OptimConfig(name=optim, lr=lr, warmup_steps=50, schedule="cosine"),
                    train=TrainConfig(steps=steps, global_batch_size=16, micro_batch_size=8, seed=0, lb_coef=1e-2,
                                      tensorboard=False, checkpoint_every=-1, log_every=50, compile=True))
    with tempfile.TemporaryDirectory() as tmp:
        history = train(run, tmp, echo=False)
    speeds = sorted(m["tokens_per_s"] for m in history[2:])
    Path(out).write_text(json.dumps({"loss": [m["loss"] for m in history], "tokens_per_s": speeds[len(speeds) // 2]}))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--adamw-lrs", default="5e-4,1e-3,2e-3")
    parser.add_argument("--muon-lrs", default="1e-3,2e-3,4e-3")
    parser.add_argument("--plot", help="write a PNG of the tuned curves here")
    parser.add_argument("--curves", help="write every curve (JSON) here")
    parser.add_argument("--one", nargs=4, metavar=("OPTIM", "LR", "DATA", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        optim, lr, data, out = args.one
        return one_run(optim, float(lr), args.steps, data, out)
    grid = [("adamw", float(x)) for x in args.adamw_lrs.split(",")] + [("muon", float(x)) for x in args.muon_lrs.split(",")]
    cfg = model_config()
    print(f"active parameters: {active_params(cfg) / 1e6:.0f}M; runs: {grid}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        data = f"{tmp}/stdlib"
        subprocess.run([sys.executable, "-m", "pithtrain", "tokenize", "--stdlib", "--train-tokenizer",
                        "--vocab-size", "8192", "--out", data], check=True)
        procs = [(name, lr, f"{tmp}/{name}_{lr}.json", subprocess.Popen(
            [sys.executable, __file__, "--steps", str(args.steps), "--one", name, str(lr), data, f"{tmp}/{name}_{lr}.json"]))
            for name, lr in grid]
        runs = {}
        for name, lr, out, proc in procs:
            if proc.wait() != 0 or not Path(out).exists():
                print(f"{name} lr={lr:g}: FAILED (exit {proc.returncode})", flush=True)
                continue
            runs[(name, lr)] = json.loads(Path(out).read_text())
    tail = min(100, args.steps)
    rows = []
    print(f"\n| optimizer | lr | mean loss, last {tail} steps | final loss | tokens/s |\n|---|---|---|---|---|")
    for (name, lr), r in sorted(runs.items()):
        mean = sum(r["loss"][-tail:]) / tail
        rows.append({"optim": name, "lr": lr, "loss_last100": mean, "final_loss": r["loss"][-1],
                     "tokens_per_s": r["tokens_per_s"]})
        print(f"| {name} | {lr:g} | {mean:.4f} | {r['loss'][-1]:.4f} | {r['tokens_per_s']:.0f} |")
    tuned = {}
    for row in rows:
        if row["optim"] not in tuned or row["loss_last100"] < tuned[row["optim"]]["loss_last100"]:
            tuned[row["optim"]] = row
    for name, row in tuned.items():
        print(f"tuned {name}: lr {row['lr']:g}, last-{tail} mean {row['loss_last100']:.4f}")
    ok = len(tuned) == 2
    print("PASS" if ok else "FAIL: a run failed")
    record({"benchmark": "muon_loss", "family": "qwen3", "active_params": active_params(cfg), "steps": args.steps,
            "seq": 1024, "global_batch": 16, "runs": rows,
            "tuned": {k: {"lr": v["lr"], "loss_last100": v["loss_last100"]} for k, v in tuned.items()}})
    if args.curves:
        Path(args.curves).write_text(json.dumps({f"{n}_{lr:g}": r["loss"] for (n, lr), r in runs.items()}))
    if args.plot and ok:
        plot_losses(args.plot, {f"{name} (lr {row['lr']:g})": runs[(name, row["lr"])]["loss"] for name, row in tuned.items()},
                    f"Qwen3-MoE {active_params(cfg) / 1e6:.0f}M active, stdlib corpus, tuned lr each")

if __name__ == "__main__":
    main()
