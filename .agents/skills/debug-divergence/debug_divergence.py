"""Find where a run diverges (a loss spike or a non-finite loss) and which component it depends on; PASS/FAIL.

    python .agents/skills/debug-divergence/debug_divergence.py CONFIG [--run RUN_DIR] --steps N \
        [--args "--nproc 2 --ep 2"] [--set optim.lr=...] [--factors mesh,compile,triton,dtype] [--jump 3] [--rtol 1e-5]

1. The first bad step S: the first non-finite loss or grad norm, or a jump (loss or grad norm
   above --jump times the median of the up to 20 steps before it). From RUN_DIR/metrics.jsonl
   when --run names the run (a non-finite step ends a run before it is logged: the step after
   the last logged one, when the run stopped short); otherwise from a run of CONFIG made here.
2. The first tensor: steps S-1 and S again (from step 1, the same schedule) with per-layer norms
   (PITHTRAIN_DEBUG_NORMS, pithtrain/train/debug.py); in the order they were made at step S,
   per rank, the first tensor (layer, stage, forward or backward, or a parameter's gradient) that
   is non-finite, and the first whose norm is above --jump times its norm at step S-1.
3. Bisection: the same steps with one factor changed at a time (one process instead of the
   mesh, train.compile flipped, the PyTorch references instead of the Triton kernels, fp32
   instead of bf16 or the reverse); each run against the re-run of step 2, loss by loss
   (validate-correctness's compare) up to step S, and whether it still diverges.
Ends with the component the divergence depends on, or that no single factor changes it. PASS only
when no step diverged and, with --bisect, no factor changed the losses beyond --rtol. The --run
directory and every run's arguments are checked before anything runs; the runs go to --work (kept),
else to a temporary directory removed at the end.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shlex
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "_common"))
import runs  # noqa: E402

compare_runs = runs.skill_script("validate-correctness/compare_runs.py")
MESH_FLAGS = ("--nproc", "--pp", "--ep", "--cp")
REPEATED = ("model.", "optim.", "data.", "train.global_batch_size", "train.micro_batch_size", "train.seed", "train.init_from",
            "train.dtype", "train.lb_coef", "train.mtp_coef", "train.lb_type", "train.fp8")  # what a --run's re-run must repeat
NOT_REPEATED = ("data.path", "data.eval_path", "optim.allow_switch")  # a dataset moved; eval and switching change no step
FACTORS = ("mesh", "compile", "triton", "dtype")


def factor_list(text: str) -> list[str]:
    """--factors: comma-separated FACTORS (argparse's one-line error otherwise)."""
    factors = text.split(",")
    unknown = [f for f in factors if f not in FACTORS]
    if unknown:
        raise argparse.ArgumentTypeError(f"{unknown[0]!r} is not one of {', '.join(FACTORS)}")
    return factors


def first_bad_step(steps: list[dict], jump: float) -> tuple[int, str] | None:
    """(step, why) of the first non-finite or jumping loss / grad norm / mtp_loss (DeepSeek-V3's, where logged)."""
    for i, m in enumerate(steps):
        for key in ("loss", "grad_norm", "mtp_loss"):
            if not isinstance(m.get(key), (int, float)):  # mtp_loss: only runs with multi-token prediction
                continue
            if not math.isfinite(m[key]):
                return m["step"], f"{key} is {m[key]}"
            before = [p[key] for p in steps[max(0, i - 20):i] if isinstance(p.get(key), (int, float))]
            if before and m[key] > jump * statistics.median(before):
                return m["step"], f"{key} {m[key]:.4g} > {jump:g} x the median {statistics.median(before):.4g} of the steps before"
    return None


def nonfinite_step(output: str) -> int | None:
    """The step a run ended at with a non-finite loss or grad norm (loop.py's error line)."""
    found = re.search(r"non-finite loss \(.*?\) or grad norm \(.*?\) at step (\d+)", output)
    return int(found.group(1)) if found else None


def divergence(run_dir: Path, code: int, output: str, jump: float) -> tuple[int, str] | None:
    bad = first_bad_step(runs.metrics(run_dir), jump)
    step = nonfinite_step(output)
    if step is not None and (bad is None or step < bad[0]):
        return step, "the run stopped: non-finite loss or grad norm"
    return bad


def first_tensors(norms_file: Path, step: int, jump: float) -> dict[str, str]:
    """At `step`, in the order the tensors were made: the first non-finite one, the first whose
    norm is above `jump` times its norm at the step before, and the five largest such ratios."""
    rows = [json.loads(line) for line in norms_file.read_text().splitlines()]
    before = {}
    for r in rows:
        if r["step"] == step - 1:
            before.setdefault((r["tensor"], r["kind"]), r["norm"])
    now = [(r, before.get((r["tensor"], r["kind"]))) for r in rows if r["step"] == step]
    name = lambda r: f"{r['tensor']} ({r['kind']})"  # noqa: E731
    found = {"non-finite": next((f"{name(r)}: norm {r['norm']}" for r, _ in now if not math.isfinite(r["norm"])), "none"),
             "jumped": next((f"{name(r)}: norm {r['norm']:.4g}, {r['norm'] / prev:.3g}x step {step - 1}'s"
                             for r, prev in now if prev and r["norm"] > jump * prev), "none")}
    ratios = sorted(((r["norm"] / prev, name(r)) for r, prev in now if prev and math.isfinite(r["norm"])), reverse=True)
    found["largest ratios"] = "".join(f"\n    {ratio:10.3g}x  {what}" for ratio, what in ratios[:5]) or "none"
    return found


def one_process(extra: str) -> str | None:
    """The run's `pithtrain train` arguments with its mesh replaced by --nproc 1; None if it had none."""
    mesh = argparse.ArgumentParser(add_help=False)
    for flag in MESH_FLAGS:
        mesh.add_argument(flag, type=int)
    mesh.add_argument("--hsdp", action="store_true")
    found, rest = mesh.parse_known_args(shlex.split(extra))
    return shlex.join(rest + ["--nproc", "1"]) if (found.nproc or 1) > 1 else None


def variants(args, config, cuda: bool) -> list[tuple[str, str, str, list, dict]]:
    """(factor, what changes, extra args, extra --set, env) for each factor that applies."""
    t = config.train
    single = one_process(args.args)
    dtype = {"auto": "bf16" if cuda else "fp32"}.get(t.dtype, t.dtype)
    table = {
        "mesh": ("the mesh -> one process", single, [], {}) if single else None,
        "compile": (f"train.compile {t.compile} -> {not t.compile}", args.args, [f"train.compile={not t.compile}"], {}),
        "triton": ("Triton kernels -> PyTorch references", args.args, [], {"PITHTRAIN_TRITON": "0"}) if cuda else None,
        "dtype": (f"{dtype} -> {'fp32' if dtype == 'bf16' else 'bf16'}", args.args,
                  [f"train.dtype={'fp32' if dtype == 'bf16' else 'bf16'}"], {}),
    }
    out = []
    for factor in args.factors:
        if table[factor] is None:
            print(f"factor {factor}: does not apply ({'one process already' if factor == 'mesh' else 'no CUDA: the references run'})")
        else:
            out.append((factor, *table[factor]))
    return out


@runs.interruptible
def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("--run", help="the diverged run's directory (its metrics.jsonl); default: make a run here")
    parser.add_argument("--steps", type=runs.COUNT, required=True, help="the run's train.steps (the lr schedule depends on it)")
    parser.add_argument("--args", default="--nproc 1", help="the run's `pithtrain train` mesh arguments")
    parser.add_argument("--set", action="append", default=[], help="the run's config overrides")
    parser.add_argument("--factors", type=factor_list, default=list(FACTORS), help="what the bisection changes, one at a "
                        f"time: some of {','.join(FACTORS)} (default: all)")
    parser.add_argument("--jump", type=runs.number(above=1), default=3.0, help="a jump: above this times the median before (> 1)")
    parser.add_argument("--rtol", type=runs.NON_NEGATIVE, default=1e-5, help="on the loss (fp32: 1e-5; bf16: about 2e-2); "
                        "lb_loss and grad_norm: the larger of it and 1e-3")
    parser.add_argument("--bisect", action="store_true", help="bisect even when no step diverged")
    parser.add_argument("--work", type=runs.WORK_DIR, help="directory for the runs made here, kept (default: a temporary one, removed at the end)")
    args = parser.parse_args()
    import torch

    from pithtrain.config import ConfigError, apply_override, load_run_config

    try:
        config = load_run_config(args.config)
        for s in args.set:
            apply_override(config, s)
    except ConfigError as err:
        return runs.verdict(False, str(err))
    cuda = torch.cuda.is_available() and config.train.device != "cpu"
    logged, stored = None, {}
    if args.run:  # the run's metrics, before anything runs
        if Path(args.run).name == "metrics.jsonl" and Path(args.run).is_file():  # the run's log named, not its directory
            args.run = str(Path(args.run).parent)
        if not (Path(args.run) / "metrics.jsonl").is_file():
            return runs.verdict(False, f"--run {args.run}: no metrics.jsonl (not a run directory)")
        try:
            logged = runs.metrics(args.run, ("step", "loss", "grad_norm"))
        except runs.BadInput as e:
            return runs.verdict(False, f"--run: {e}")
        if not logged:
            return runs.verdict(False, f"--run {args.run}: metrics.jsonl logs no step; nothing to diagnose")
        ran = Path(args.run) / "run_config.json"  # the run's own train.steps, which set its lr schedule
        try:
            stored = runs.read_json(ran) if ran.is_file() else {}
        except runs.BadInput as e:
            return runs.verdict(False, f"--run: {e}")
        steps = stored.get("train", {}).get("steps") if isinstance(stored, dict) and isinstance(stored.get("train"), dict) else None
        if steps is not None and steps != args.steps:
            return runs.verdict(False, f"--steps {args.steps}: the run's train.steps is {steps} ({ran}); pass --steps {steps}, "
                                       "the schedule the re-runs must repeat")
    if args.work and any((Path(args.work) / name).exists() for name in ("run", *FACTORS)):
        return runs.verdict(False, f"--work {args.work} already holds runs of this script: pass a new directory")
    factors = variants(args, config, cuda)
    refused = runs.refusal(args.config, args.steps, [("the run", args.args, args.set, None)]
                           + [(f"factor {f}", extra, args.set + sets, None) for f, _, extra, sets, _ in factors])
    if refused or (args.run and (refused := run_differs(args, stored))):
        return runs.verdict(False, refused)
    with runs.workdir(args.work, "divergence-") as work:
        return diagnose(args, factors, logged, work)


def run_differs(args, stored) -> str | None:
    """Why re-runs of CONFIG with --set and --args would not repeat the --run (its run_config.json, `stored`): the
    fields of REPEATED that differ (another model, lr, batch...); None when they agree or the run recorded none."""
    from pithtrain.cli import build_parser, train_config
    from pithtrain.config import run_dict

    flat = lambda d: {f"{s}.{k}": v for s, fields in d.items() if isinstance(fields, dict) for k, v in fields.items()}  # noqa: E731
    want = flat(json.loads(json.dumps(run_dict(train_config(build_parser().parse_args(
        runs.train_args(args.config, "OUT", args.steps, args.args, args.set)))))))
    ran = flat(stored) if isinstance(stored, dict) else {}
    differ = [f"{k} {ran[k]!r} vs {v!r}" for k, v in want.items()
              if k.startswith(REPEATED) and k not in NOT_REPEATED and k in ran and ran[k] != v]
    return (f"--run {args.run}: its run_config.json differs from CONFIG, --set and --args given (the run's value first): "
            f"{'; '.join(differ[:5])}{f' (+{len(differ) - 5} more)' if len(differ) > 5 else ''}; pass those of the run, "
            "or its re-runs do not repeat it") if differ else None


def diagnose(args, factors, logged, work: Path) -> int:
    # 1. the first bad step
    if args.run:
        found = first_bad_step(logged, args.jump)
        logged = [m["step"] for m in logged]
        stopped_short = found is None and logged[-1] < args.steps
        if stopped_short:
            found = logged[-1] + 1, f"the run stopped after step {logged[-1]} of {args.steps} (a non-finite step is not logged)"
    else:  # norms of every step: the script's own runs are short
        code, said = runs.train(args.config, work / "run", args.steps, args.args, args.set,
                                env={"PITHTRAIN_DEBUG_NORMS": f"1-{args.steps}"}, quiet=True, checkpoints=False)
        found = divergence(work / "run", code, said, args.jump)
        if found is None and code != 0:
            return runs.verdict(False, "the run failed for another reason than divergence (its output is above)")
    if found is None and not args.bisect:
        return runs.verdict(True, f"no step diverged (non-finite, or loss / grad norm above {args.jump:g}x the median before)")
    step = found[0] if found else args.steps
    if found:
        print(f"\nfirst bad step: {step} ({found[1]})")

    # 2. the first tensor: the baseline again to step S, with norms of S-1 and S (the run of 1. when made here)
    base, stop = work / "run", step if step < args.steps else None
    if args.run:
        code, said = runs.train(args.config, base, args.steps, args.args, args.set, stop_after=stop,
                                env={"PITHTRAIN_DEBUG_NORMS": f"{max(1, step - 1)}-{step}"}, quiet=True, checkpoints=False)
        again = divergence(base, code, said, args.jump)
        if code != 0 and again is None:
            return runs.verdict(False, "the re-run failed for another reason than divergence (its output is above)")
        if found and again is None and stopped_short:  # the run was stopped (--stop-after, a kill), not diverged
            return runs.verdict(True, f"no divergence: {found[1].split(' (')[0]}, and its re-run goes through step "
                                      f"{step} with finite, steady losses")
        if found and again is None:
            return runs.verdict(False, f"divergence at step {step} not reproduced: its re-run does not diverge (data, "
                                       "code or nondeterministic kernels changed since); nothing to bisect")
        if found and again[0] != step:
            print(f"note: the re-run diverges at step {again[0]}, not {step}: the run is not reproducible (data, code "
                  f"or nondeterministic kernels changed); the norms below are the re-run's")
    if found:
        for path in sorted(base.glob("norms_rank*.jsonl"), key=lambda p: int(p.stem.removeprefix("norms_rank"))):
            rank = path.stem.removeprefix("norms_rank")  # each rank holds its own layers (pipeline) or shards
            for what, tensor in first_tensors(path, step, args.jump).items():
                print(f"step {step}, rank {rank}, first tensor {what}: {tensor}" if what != "largest ratios"
                      else f"  largest norm ratios to step {step - 1}: {tensor}")
    base_steps = runs.metrics(base)

    # 3. bisection: one factor at a time, to step S
    results = []
    for factor, change, extra, sets, env in factors:
        print(f"\n--- factor {factor}: {change}")
        out = work / factor
        code, said = runs.train(args.config, out, args.steps, extra, args.set + sets, stop_after=stop, env=env,
                                quiet=True, checkpoints=False)
        bad = divergence(out, code, said, args.jump)
        if code != 0 and bad is None:
            print(said[-2000:])
            return runs.verdict(False, f"the {factor} run failed for another reason than divergence (its output is above)")
        mine = runs.metrics(out)
        n = min(len(mine), len(base_steps))
        agree = compare_runs.compare(base_steps[:n], mine[:n], args.rtol)[0] if n else None  # None: no step to compare
        results.append((factor, change, bad, agree))
    print("\nfactor   change                                   diverges           metrics agree (rtol %.0e)" % args.rtol)
    for factor, change, bad, agree in results:
        diverges = f"at step {bad[0]}" if bad else "no"
        print(f"{factor:8} {change:40} {diverges:18} {({True: 'yes', False: 'NO', None: '-'})[agree]}")
    if not results:
        return runs.verdict(False, f"{f'divergence at step {step}' if found else 'no step diverged'}; no factor was "
                                   "tested: none of --factors applies here (see 'does not apply' above)")
    if found:
        cured = [f"{factor} ({change})" for factor, change, bad, _ in results if bad is None]
        if cured:
            return runs.verdict(False, f"divergence at step {step}; it goes away when changing: {', '.join(cured)}")
        return runs.verdict(False, f"divergence at step {step}; no single factor removes it: the optimisation "
                                   f"(optim.lr, warmup, grad_clip), the data of step {step} or the weights; see the first tensor above")
    differ = [f"{factor} ({change})" for factor, change, _, agree in results if agree is False]
    if differ:
        return runs.verdict(False, f"no step diverged; the metrics change beyond --rtol with: {', '.join(differ)}")
    return runs.verdict(True, "no step diverged and no factor changed the metrics beyond --rtol")


if __name__ == "__main__":
    sys.exit(main())
