"""Check that a run's logs are complete (every step logged); ends with PASS or FAIL.

  python .agents/skills/track-experiments/check_run.py RUN [--steps N] [--tensorboard] [--wandb]

metrics.jsonl must hold steps 1..N (N: train.steps of RUN/run_config.json, or --steps for a run
stopped early) with finite losses; RUN/tensorboard (checked when present, required with
--tensorboard) must hold train/loss for the same steps with the same values; --wandb requires
an offline wandb run under RUN/wandb.
"""

import argparse
import json
import math
import sys
from pathlib import Path


def metrics_steps(run: Path, problems: list) -> dict:
    from pithtrain.train.metrics import read_metrics

    path = run / "metrics.jsonl"
    if not path.is_file():
        problems.append(f"{path} is missing")
        return {}
    rows = read_metrics(path)
    steps = {m["step"]: m for m in rows}  # a resume after a crash may repeat steps: the last one counts
    print(f"metrics.jsonl: {len(rows)} lines, steps {min(steps, default=0)}..{max(steps, default=0)}"
          + (f" ({len(rows) - len(steps)} repeated after a resume)" if len(rows) > len(steps) else ""))
    bad = [s for s, m in steps.items() if not math.isfinite(m.get("loss", math.nan))]
    if bad:
        problems.append(f"metrics.jsonl: loss missing or not finite at steps {bad[:10]}")
    return steps


def tensorboard_losses(run: Path, problems: list) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0})  # 0: keep every point
    events.Reload()
    if "train/loss" not in events.Tags()["scalars"]:
        problems.append(f"{run / 'tensorboard'}: no train/loss scalars")
        return {}
    losses = {e.step: e.value for e in events.Scalars("train/loss")}
    print(f"tensorboard: train/loss at {len(losses)} steps, tags {sorted(events.Tags()['scalars'])}")
    return losses


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path)
    parser.add_argument("--steps", type=int, help="steps the run should have logged (default: its train.steps)")
    parser.add_argument("--tensorboard", action="store_true", help="require TensorBoard event files")
    parser.add_argument("--wandb", action="store_true", help="require an offline wandb run (WANDB_MODE=offline)")
    args = parser.parse_args()
    problems = []
    steps = args.steps
    if steps is None:
        config = args.run / "run_config.json"
        if not config.is_file():
            print(f"FAIL: {config} is missing (not a run directory?); pass --steps")
            return 1
        steps = json.loads(config.read_text())["train"]["steps"]
    want = set(range(1, steps + 1))
    logged = metrics_steps(args.run, problems)
    if logged and set(logged) != want:
        problems.append(f"metrics.jsonl: missing steps {sorted(want - set(logged))[:10]}, "
                        f"unexpected {sorted(set(logged) - want)[:10]}")
    if args.tensorboard or (args.run / "tensorboard").is_dir():
        if not (args.run / "tensorboard").is_dir():
            problems.append(f"{args.run / 'tensorboard'} is missing (train.tensorboard=true and the tensorboard package)")
        else:
            losses = tensorboard_losses(args.run, problems)
            if losses and set(losses) != want:
                problems.append(f"tensorboard: missing steps {sorted(want - set(losses))[:10]}")
            differ = [s for s in losses if s in logged and not math.isclose(losses[s], logged[s]["loss"], rel_tol=1e-6)]
            if differ:
                problems.append(f"tensorboard: train/loss differs from metrics.jsonl at steps {differ[:10]}")
    if args.wandb and not list((args.run / "wandb").glob("offline-run-*")):
        problems.append(f"no offline wandb run under {args.run / 'wandb'} (train.wandb_project set, WANDB_MODE=offline?)")
    for p in problems:
        print("problem:", p)
    print(f"PASS: steps 1..{steps} logged" if not problems else "FAIL")
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
