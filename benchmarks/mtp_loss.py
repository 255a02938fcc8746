"""Multi-token prediction on and off: the tiny DeepSeek-V3 (examples/deepseek_v3_tiny.py, one MTP depth,
train.mtp_coef 0.3) from the same initialisation on the stdlib corpus (`make data`), 500 steps each, CPU.

Both runs draw the same main-model weights (init_by_name seeds each parameter by its name) and the same
batches; the only difference is the MTP layer and its loss. Compares the main loss (the logged `loss`,
MTP excluded) at the end: the mean over the last 50 steps, and the held-out loss (the last 64 samples
of the corpus, out of both runs' training) at the last step.
Writes a plot and one JSON line to benchmarks/results.jsonl.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/mtp_loss.py --steps 500 --plot docs/mtp_loss.png
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fp8_loss import plot_losses  # noqa: E402
from results import record  # noqa: E402

EXAMPLE = "examples/deepseek_v3_tiny.py"


def train(out: str, steps: int, depths: int, eval_every: int) -> list[dict]:
    cmd = [sys.executable, "-m", "pithtrain", "train", EXAMPLE, "--out", out, "--steps", str(steps),
           "--set", f"model.num_nextn_predict_layers={depths}", "--set", f"train.eval_every={eval_every}", "--set", "data.eval_samples=64",
           "--set", "train.checkpoint_every=0", "--set", "train.log_every=50"]
    subprocess.run(cmd, check=True)
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--plot", default="docs/mtp_loss.png")
    args = parser.parse_args()
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for label, depths in (("MTP on", 1), ("MTP off", 0)):
            runs[label] = train(f"{tmp}/{depths}", args.steps, depths, eval_every=args.steps)
    figures = {}
    for label, rows in runs.items():
        losses = [r["loss"] for r in rows if "loss" in r]
        figures[label] = {"final_loss_mean50": statistics.mean(losses[-50:]),
                          "eval_loss": [r["eval_loss"] for r in rows if "eval_loss" in r][-1],
                          "mtp_loss_mean50": statistics.mean([r["mtp_loss"] for r in rows if "mtp_loss" in r][-50:])
                          if label == "MTP on" else None}
    on, off = figures["MTP on"], figures["MTP off"]
    change = on["final_loss_mean50"] / off["final_loss_mean50"] - 1
    print(json.dumps(figures, indent=2))
    print(f"main loss with MTP vs without, last 50 steps: {100 * change:+.2f}% "
          f"(eval {100 * (on['eval_loss'] / off['eval_loss'] - 1):+.2f}%)")
    plot_losses(args.plot, {label: [r["loss"] for r in rows if "loss" in r] for label, rows in runs.items()},
                f"tiny DeepSeek-V3, main loss with and without MTP ({args.steps} steps)")
    record({"benchmark": "mtp_loss", "example": EXAMPLE, "steps": args.steps, "mtp_on": on, "mtp_off": off,
            "main_loss_change": change})


if __name__ == "__main__":
    main()
