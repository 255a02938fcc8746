"""Compare two training runs step by step; ends with PASS or FAIL.

Run one config on two meshes (or two code versions) and compare:
  python .agents/skills/validate-correctness/compare_runs.py CONFIG --steps 4 \
      --a "--nproc 1" --b "--nproc 2 --ep 2" [--set train.dtype=fp32 ...] [--rtol 1e-5]
Or compare two existing metrics files:
  python .agents/skills/validate-correctness/compare_runs.py --metrics RUN_A/metrics.jsonl RUN_B/metrics.jsonl
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "_common"))
import runs  # noqa: E402  (the helpers the skill scripts share: launch a run, PASS/FAIL)

KEYS = ("loss", "lb_loss", "grad_norm")


def read(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def compare(a, b, rtol, rtol_aux=None):
    """rtol for the loss; rtol_aux (default rtol) for lb_loss and grad_norm, which in bf16 move
    more than the loss (a routing flip changes them directly)."""
    rtol_aux = rtol if rtol_aux is None else rtol_aux
    ok = len(a) == len(b) and len(a) > 0
    if not ok:
        print(f"step counts differ or are empty: {len(a)} vs {len(b)}")
    worst = {key: 0.0 for key in KEYS}
    for ma, mb in zip(a, b):
        for key in KEYS:
            tol = rtol if key == "loss" else rtol_aux
            err = abs(ma[key] - mb[key]) / max(abs(ma[key]), 1e-12)
            worst[key] = max(worst[key], err)
            flag = "" if err <= tol else "   <-- over tolerance"
            if flag or key == "loss":
                print(f"step {ma['step']:>4} {key:>9}: {ma[key]:.8f} vs {mb[key]:.8f} (rel {err:.1e}){flag}")
            ok &= err <= tol
    print("worst relative difference: " + ", ".join(f"{k} {v:.2e}" for k, v in worst.items())
          + f" (tolerance: loss {rtol:.0e}, lb_loss/grad_norm {rtol_aux:.0e})")
    return ok


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", nargs="?")
    parser.add_argument("--a", default="--nproc 1", help="extra `pithtrain train` arguments of run A")
    parser.add_argument("--b", default="--nproc 2 --ep 2", help="extra `pithtrain train` arguments of run B")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--set", action="append", default=[], help="config overrides for both runs")
    parser.add_argument("--rtol", type=float, default=1e-5, help="on the loss; fp32: 1e-5; bf16: about 2e-2")
    parser.add_argument("--rtol-aux", type=float, help="on lb_loss and grad_norm (default: --rtol); bf16: about 5e-2")
    parser.add_argument("--metrics", nargs=2, metavar=("A", "B"), help="compare two metrics.jsonl files instead")
    args = parser.parse_args()
    if args.metrics:
        ok = compare(read(args.metrics[0]), read(args.metrics[1]), args.rtol, args.rtol_aux)
    else:
        if not args.config:
            parser.error("give CONFIG or --metrics A B")
        work = Path(tempfile.mkdtemp(prefix="validate-"))
        metrics = []
        for name, extra in (("a", args.a), ("b", args.b)):
            code, _ = runs.train(args.config, work / name, args.steps, extra, args.set)
            if code != 0:
                return runs.verdict(False, f"run {name} did not finish (its output is above)")
            metrics.append(read(work / name / "metrics.jsonl"))
        ok = compare(*metrics, args.rtol, args.rtol_aux)
    return runs.verdict(ok)


if __name__ == "__main__":
    sys.exit(main())
