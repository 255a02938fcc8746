"""Check that a run's logs are complete (every step logged); ends with PASS or FAIL.

  python .agents/skills/track-experiments/check_run.py RUN [--steps N] [--tensorboard] [--wandb]

metrics.jsonl must hold steps 1..N (N: train.steps of RUN/run_config.json, or --steps for a run
stopped early) with finite losses; RUN/tensorboard (checked when present, required with
--tensorboard) must hold train/loss for the same steps with the same values; --wandb requires
offline wandb runs under RUN/wandb that hold every step's loss and the run's config once each.
"""

import argparse
import itertools
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "_common"))
import runs  # noqa: E402  (the helpers the skill scripts share: read JSON files, argument types)


def loss_of(m: dict) -> float:
    """A metrics line's loss; nan when it has none (or not a number)."""
    loss = m.get("loss")
    return float(loss) if isinstance(loss, (int, float)) and not isinstance(loss, bool) else math.nan


def metrics_steps(run: Path, problems: list) -> dict | None:
    """Step -> its metrics (None: no metrics.jsonl); raises runs.BadInput for a line that is not a metrics line."""
    path = run / "metrics.jsonl"
    if not path.is_file():
        problems.append(f"{path} is missing")
        return None
    rows = runs.read_jsonl(path)
    steps = {m["step"]: m for m in rows}  # a resume after a crash may repeat steps: the last one counts
    print(f"metrics.jsonl: {len(rows)} lines, steps {min(steps, default=0)}..{max(steps, default=0)}"
          + (f" ({len(rows) - len(steps)} repeated after a resume)" if len(rows) > len(steps) else ""))
    bad = [s for s, m in steps.items() if not math.isfinite(loss_of(m))]
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


def wandb_problems(run: Path, logged: dict, config: dict | None) -> list:
    """The offline runs' record files (RUN/wandb/offline-run-*/run-*.wandb; a resume starts another) hold
    each logged value as the JSON text of its float, uncompressed, and the config as one record: so every
    step's loss must appear among them, and a config field once per file. A byte check, not wandb's own
    reader (wandb 0.2x+ reads its records in its Go core only): it cannot say at which step a value sits."""
    files = sorted((run / "wandb").glob("offline-run-*/run-*.wandb"))
    if not files:
        return [f"no offline wandb run under {run / 'wandb'} (train.wandb_project set, WANDB_MODE=offline?)"]
    records = [f.read_bytes() for f in files]
    print(f"wandb: {len(files)} offline run(s), {sum(map(len, records)):,} bytes of records")
    problems = []
    absent = [s for s, m in logged.items() if not any(json.dumps(m.get("loss")).encode() in r for r in records)]
    if absent:
        problems.append(f"wandb: the loss of steps {absent[:10]} is in no offline run (a run killed before wandb flushed?)")
    if config is None:
        return problems + [f"{run / 'run_config.json'} is missing: cannot check that wandb logged the config"]
    model = config.get("model") or {"model_type": 0}
    if not isinstance(model, dict):  # a number or a string is no config a run wrote (a string's first letter is no field)
        return problems + [f"{run / 'run_config.json'}: its \"model\" is {model!r}, not the model's fields (not a run's config?)"]
    field = f'"{next(iter(model))}"'.encode()  # "model_type"
    counts = [r.count(field) for r in records]
    if any(c != 1 for c in counts):
        problems.append(f"wandb: the run config (its field {field.decode()}) is logged {counts} times per offline run, not once")
    return problems


def steps_differ(source: str, logged, steps: int) -> str:
    """'SOURCE: missing steps [...], unexpected [...]' for the steps a log has beyond or short of 1..steps; ''
    when none. Counted, not listed: a run of train.steps=10**9 stopped early needs no set of 10**9 steps."""
    unexpected = sorted(s for s in logged if not 1 <= s <= steps)
    count = steps - len(logged) + len(unexpected)
    missing = list(itertools.islice((s for s in range(1, steps + 1) if s not in logged), 10 if count else 0))
    more = f" (+{count - 10} more)" if count > 10 else ""
    parts = [p for p in (missing and f"missing steps {missing}{more}", unexpected and f"unexpected {unexpected[:10]}") if p]
    return f"{source}: " + ", ".join(parts) if parts else ""


@runs.interruptible
def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path)
    parser.add_argument("--steps", type=runs.COUNT, help="steps the run should have logged (default: its train.steps)")
    parser.add_argument("--tensorboard", action="store_true", help="require TensorBoard event files")
    parser.add_argument("--wandb", action="store_true", help="require offline wandb runs (WANDB_MODE=offline) holding every step's loss and the config")
    args = parser.parse_args()
    try:
        return check(args)
    except runs.BadInput as e:
        return runs.verdict(False, str(e))


def check(args) -> int:
    problems = []
    if args.run.is_file() and args.run.name == "metrics.jsonl":  # the run's log named instead of its directory
        args.run = args.run.parent
    if not args.run.is_dir():
        return runs.verdict(False, f"{args.run}: {'a file' if args.run.exists() else 'no such directory'}; pass a run "
                                   "directory (the --out of pithtrain train)")
    path = args.run / "run_config.json"
    config = runs.read_json(path) if path.is_file() else None
    steps = args.steps
    if steps is None:
        if config is None:
            return runs.verdict(False, f"{path} is missing (not a run directory?); pass --steps")
        train = config.get("train") if isinstance(config, dict) else None
        steps = train.get("steps") if isinstance(train, dict) else None
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            return runs.verdict(False, f"{path} holds no train.steps (not a run's config?); pass --steps")
    logged = metrics_steps(args.run, problems)
    if logged is not None and (differ := steps_differ("metrics.jsonl", logged, steps)):
        problems.append(differ)
    logged = logged or {}
    if args.tensorboard or (args.run / "tensorboard").is_dir():
        if not (args.run / "tensorboard").is_dir():
            problems.append(f"{args.run / 'tensorboard'} is missing (train.tensorboard=true and the tensorboard package)")
        else:
            losses = tensorboard_losses(args.run, problems)
            if losses and (differ := steps_differ("tensorboard", losses, steps)):
                problems.append(differ)
            differ = [s for s in losses if s in logged and not math.isclose(losses[s], loss_of(logged[s]), rel_tol=1e-6)]
            if differ:
                problems.append(f"tensorboard: train/loss differs from metrics.jsonl at steps {differ[:10]}")
    if args.wandb:
        problems += wandb_problems(args.run, logged, config if isinstance(config, dict) else None)
    for p in problems[1:]:
        print("problem:", p)
    more = f" (+{len(problems) - 1} more above)" if len(problems) > 1 else ""
    return runs.verdict(not problems, f"{problems[0]}{more}" if problems else f"steps 1..{steps} logged")


if __name__ == "__main__":
    sys.exit(main())
