"""Move a run to another mesh mid-way and prove the curve continues; ends with PASS or FAIL.

  python .agents/skills/resume-and-reshard/reshard_resume.py CONFIG --steps 6 --stop-after 3 \
      --a "--nproc 2 --ep 2" --b "--nproc 1" [--ref "--nproc 1"] [--set train.dtype=fp32 ...] [--rtol 1e-5]

(a) trains steps 1..K on mesh A (checkpoint at K), (b) resumes the same run directory to N on
mesh B, (c) trains 1..N uninterrupted on the reference mesh (default: A) in another directory,
(d) compares the two metrics.jsonl step by step with validate-correctness's `compare`. The three runs'
arguments, and B's resume of A's checkpoint (loop.check_resume), are checked before any trains; they go
to --work (kept), else to a temporary directory removed at the end.
"""

import argparse
import json
import re
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "_common"))
import runs  # noqa: E402  (the helpers the skill scripts share: launch a run, read metrics, PASS/FAIL)

compare_runs = runs.skill_script("validate-correctness/compare_runs.py")


@runs.interruptible
def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("--steps", type=runs.COUNT, default=6, help="N: the run's total steps")
    parser.add_argument("--stop-after", type=runs.COUNT, default=3, help="K: the step mesh A stops after (a checkpoint)")
    parser.add_argument("--a", default="--nproc 2 --ep 2", help="`pithtrain train` arguments of mesh A (steps 1..K)")
    parser.add_argument("--b", default="--nproc 1", help="`pithtrain train` arguments of mesh B (steps K+1..N)")
    parser.add_argument("--ref", help="arguments of the uninterrupted reference run (default: --a)")
    parser.add_argument("--set", action="append", default=[], help="config overrides for every run")
    parser.add_argument("--rtol", type=runs.NON_NEGATIVE, default=1e-5, help="on the loss; fp32: 1e-5; bf16: about 2e-2")
    parser.add_argument("--rtol-aux", type=runs.NON_NEGATIVE, help=f"on lb_loss and grad_norm (default: the larger of "
                        f"--rtol and {compare_runs.AUX_FLOOR:g}); bf16: about 5e-2")
    parser.add_argument("--work", type=runs.WORK_DIR, help="directory for the two runs, kept (default: a temporary one, removed at the end)")
    args = parser.parse_args()
    if not args.stop_after < args.steps:
        parser.error(f"need --stop-after ({args.stop_after}) < --steps ({args.steps})")
    if args.work and ((Path(args.work) / "resharded").exists() or (Path(args.work) / "reference").exists()):
        parser.error(f"{args.work} already holds a run: pass a new --work")
    plan = (("mesh A", "resharded", args.a, args.stop_after), ("mesh B", "resharded", args.b, None),
            ("reference", "reference", args.ref or args.a, None))
    refused = runs.refusal(args.config, args.steps, [(what, extra, args.set, stop) for what, _, extra, stop in plan])
    if refused or (refused := resume_refusal(args)):
        return runs.verdict(False, refused)
    with runs.workdir(args.work, "reshard-") as work:
        return run(args, plan, work)


def resume_refusal(args) -> str | None:
    """Why mesh B would refuse to resume mesh A's checkpoint (a changed model, data order, global batch, optimizer),
    from the two runs' configs, before A trains: loop.check_resume against the meta.json A would write. data.path
    is left to B's start, which reads the datasets' identities (a moved dataset is taken there)."""
    from pithtrain.cli import build_parser, train_config
    from pithtrain.config import UserError, run_dict
    from pithtrain.train.loop import check_resume

    a, b = (train_config(build_parser().parse_args(runs.train_args(args.config, "OUT", args.steps, extra, args.set)))
            for extra in (args.a, args.b))
    if a.train.checkpoint_every == -1:
        return (f"mesh A ({args.a}): train.checkpoint_every=-1 writes no checkpoint, so mesh B would have nothing to "
                "resume; leave it out")
    b.data.path = a.data.path
    with tempfile.TemporaryDirectory() as ck:
        (Path(ck) / "meta.json").write_text(json.dumps({"config": run_dict(a), "step": args.stop_after}))
        try:
            check_resume(b, Path(ck), echo=False)
        except UserError as e:
            return f"mesh B ({args.b}): " + str(e).replace(ck, f"mesh A's step-{args.stop_after} checkpoint")
    return None


def run(args, plan, work: Path) -> int:
    moved, ref = work / "resharded", work / "reference"
    said = {}
    for what, name, extra, stop in plan:
        code, said[what] = runs.train(args.config, work / name, args.steps, extra, args.set, stop)
        if code != 0:
            return runs.verdict(False, f"the {what} run did not finish (its output is above)")
        if what == "mesh A" and not list((work / name / "checkpoints").glob(f"step_{args.stop_after:08d}/meta.json")):
            return runs.verdict(False, f"mesh A wrote no checkpoint of step {args.stop_after} in {work / name / 'checkpoints'}, "
                                       "so mesh B has nothing to resume")
    resumed = re.search(r"resumed from \S+ \(step (\d+)\)", said["mesh B"])
    if not resumed or int(resumed.group(1)) != args.stop_after:
        return runs.verdict(False, f"mesh B did not resume from the step-{args.stop_after} checkpoint "
                            f"({'it resumed at step ' + resumed.group(1) if resumed else 'no resume line in its output'})")
    a, b = runs.metrics(ref), runs.metrics(moved)
    print(f"reference: {ref}, resharded: {moved} (A {args.a!r} to step {args.stop_after}, then B {args.b!r})")
    ok = [m["step"] for m in b] == list(range(1, args.steps + 1))
    if not ok:
        return runs.verdict(False, f"the resharded run logged steps {[m['step'] for m in b]}, expected 1..{args.steps}")
    return runs.verdict(*compare_runs.compare(a, b, args.rtol, args.rtol_aux))


if __name__ == "__main__":
    sys.exit(main())
