"""Compare two training runs step by step; ends with PASS or FAIL.

Run one config on two meshes (or two code versions) and compare:
  python .agents/skills/validate-correctness/compare_runs.py CONFIG --steps 4 \
      --a "--nproc 1" --b "--nproc 2 --ep 2" [--set train.dtype=fp32 ...] [--rtol 1e-5] [--work DIR]
Or compare two existing metrics files:
  python .agents/skills/validate-correctness/compare_runs.py --metrics RUN_A/metrics.jsonl RUN_B/metrics.jsonl

Steps are matched by number (a resumed run's repeated step counts once, its last line); both runs must
have logged the same steps. Both runs' arguments are checked before either trains; the runs go to
--work (kept), else to a temporary directory removed at the end.
"""

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "_common"))
import runs  # noqa: E402  (the helpers the skill scripts share: launch a run, PASS/FAIL)

KEYS = ("loss", "lb_loss", "grad_norm")
MTP = "mtp_loss"  # DeepSeek-V3's multi-token prediction loss (not in `loss`): gated as the loss where both runs log it
AUX_FLOOR = 1e-3  # the default --rtol-aux at least: fp32 meshes' grad_norm and lb_loss drift to 3.5e-4 in 20 steps (SKILL.md)


def compare(a, b, rtol, rtol_aux=None) -> tuple[bool, str]:
    """Metrics of runs A and B (lists of per-step dicts) matched by step: the loss within rtol, lb_loss and
    grad_norm within rtol_aux (default: the larger of rtol and AUX_FLOOR; they move more than the loss:
    sums over another mesh's shards in fp32, a routing flip in bf16), relative to A. A non-finite value
    never agrees. Returns (ok, why): the first quantity over tolerance (step, values, difference) and
    the steps only one run logged, or the worst differences."""
    rtol_aux = max(rtol, AUX_FLOOR) if rtol_aux is None else rtol_aux
    a, b = ({m["step"]: m for m in rows} for rows in (a, b))
    common = sorted(set(a) & set(b))
    problems = [] if common else [f"no step to compare (A logged {len(a)} steps, B {len(b)})"]
    if common and set(a) != set(b):
        only = [f"only {name} {sorted(set(x) - set(y))[:10]}" for name, x, y in (("A", a, b), ("B", b, a)) if set(x) - set(y)]
        problems.append(f"the runs logged different steps: {', '.join(only)}")
    logs_mtp = [bool(common) and all(MTP in x[s] for s in common) for x in (a, b)]
    if logs_mtp[0] != logs_mtp[1]:  # multi-token prediction on in one run only: its loss is not the other's
        problems.append(f"only {'AB'[logs_mtp[1]]} logged {MTP} (multi-token prediction in one run only)")
    keys = KEYS + ((MTP,) if all(logs_mtp) else ())
    errors, over = {key: [] for key in keys}, []
    for step in common:
        for key in keys:
            tol = rtol if key in ("loss", MTP) else rtol_aux
            # mtp_loss is not checked on reading: a null there is nan
            va, vb = (v if isinstance(v, (int, float)) else math.nan for v in (a[step][key], b[step][key]))
            err = abs(va - vb) / max(abs(va), 1e-12) if math.isfinite(va) and math.isfinite(vb) else math.nan
            errors[key].append(err)
            bad = not err <= tol
            if bad:
                over.append(f"{key} at step {step}: {va:.8g} vs {vb:.8g} (relative difference {err:.1e} > {tol:.0e})")
            if bad or key in ("loss", MTP):
                print(f"step {step:>4} {key:>9}: {va:.8f} vs {vb:.8f} (rel {err:.1e})" + ("   <-- over tolerance" if bad else ""))
    worst = {k: math.nan if any(map(math.isnan, v)) else max(v, default=0.0) for k, v in errors.items()}
    summary = ", ".join(f"{k} {v:.2e}" for k, v in worst.items())
    if common:
        print(f"worst relative difference: {summary} (tolerance: loss{'/' + MTP if MTP in keys else ''} {rtol:.0e}, lb_loss/grad_norm {rtol_aux:.0e})")
    if over:
        problems.insert(0, over[0] + (f" (+{len(over) - 1} more over tolerance above)" if len(over) > 1 else ""))
    return not problems, "; ".join(problems) or f"steps {common[0]}..{common[-1]} agree (worst relative difference: {summary})"


@runs.interruptible
def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", nargs="?")
    parser.add_argument("--a", default="--nproc 1", help="extra `pithtrain train` arguments of run A")
    parser.add_argument("--b", default="--nproc 2 --ep 2", help="extra `pithtrain train` arguments of run B")
    parser.add_argument("--steps", type=runs.COUNT, default=4)
    parser.add_argument("--set", action="append", default=[], help="config overrides for both runs")
    parser.add_argument("--rtol", type=runs.NON_NEGATIVE, default=1e-5, help="on the loss; fp32: 1e-5; bf16: about 2e-2")
    parser.add_argument("--rtol-aux", type=runs.NON_NEGATIVE, help=f"on lb_loss and grad_norm (default: the larger of "
                        f"--rtol and {AUX_FLOOR:g}); bf16: about 5e-2")
    parser.add_argument("--metrics", nargs=2, metavar=("A", "B"), help="compare two metrics.jsonl files instead")
    parser.add_argument("--work", type=runs.WORK_DIR, help="directory for the two runs, kept (default: a temporary one, removed at the end)")
    args = parser.parse_args()
    runs_only = [flag for flag, name in (("CONFIG", "config"), ("--a", "a"), ("--b", "b"), ("--steps", "steps"), ("--set", "set"),
                                         ("--work", "work")) if getattr(args, name) != parser.get_default(name)]
    if args.metrics and runs_only:  # would be ignored: the files were written by runs made elsewhere
        parser.error(f"{', '.join(runs_only)}: for training the two runs, but --metrics A B compares two existing files; "
                     f"drop {', '.join(runs_only)}, or drop --metrics to train CONFIG twice and compare")
    if args.metrics:
        try:
            a, b = (runs.by_step(runs.read_jsonl(path, ("step", *KEYS))) for path in args.metrics)
        except runs.BadInput as e:
            return runs.verdict(False, str(e))
        return runs.verdict(*compare(a, b, args.rtol, args.rtol_aux))
    if not args.config:
        parser.error("give CONFIG or --metrics A B")
    work = Path(args.work) if args.work else None
    if work and ((work / "a").exists() or (work / "b").exists()):
        return runs.verdict(False, f"--work {work} already holds run a or b: pass a new directory")
    refused = runs.refusal(args.config, args.steps, [(f"run {name}", extra, args.set, None)
                                                     for name, extra in (("a", args.a), ("b", args.b))])
    if refused:
        return runs.verdict(False, refused)
    with runs.workdir(args.work, "validate-") as work:
        metrics = []
        for name, extra in (("a", args.a), ("b", args.b)):
            code, _ = runs.train(args.config, work / name, args.steps, extra, args.set)
            if code != 0:
                return runs.verdict(False, f"run {name} did not finish (its output is above)")
            metrics.append(runs.metrics(work / name))
        return runs.verdict(*compare(*metrics, args.rtol, args.rtol_aux))


if __name__ == "__main__":
    sys.exit(main())
