"""Move a run to another mesh mid-way and prove the curve continues; ends with PASS or FAIL.

  python .agents/skills/resume-and-reshard/reshard_resume.py CONFIG --steps 6 --stop-after 3 \
      --a "--nproc 2 --ep 2" --b "--nproc 1" [--ref "--nproc 1"] [--set train.dtype=fp32 ...] [--rtol 1e-5]

(a) trains steps 1..K on mesh A (checkpoint at K), (b) resumes the same run directory to N on
mesh B, (c) trains 1..N uninterrupted on the reference mesh (default: A) in another directory,
(d) compares the two metrics.jsonl step by step with validate-correctness's `compare`.
"""

import argparse
import importlib.util
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "compare_runs", Path(__file__).resolve().parent.parent / "validate-correctness" / "compare_runs.py")
compare_runs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(compare_runs)


def by_step(path):
    """The metrics of each step once (a resumed run appends; a repeated step keeps its last line)."""
    steps = {m["step"]: m for m in compare_runs.read(path)}
    return [steps[s] for s in sorted(steps)]


def train(config, out, steps, extra, sets, stop_after=None):
    cmd = [sys.executable, "-m", "pithtrain", "train", config, "--out", str(out), "--steps", str(steps), *shlex.split(extra)]
    if stop_after is not None:
        cmd += ["--stop-after", str(stop_after)]
    for s in sets:
        cmd += ["--set", s]
    print("$", shlex.join(cmd), flush=True)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:  # shown as it comes, kept to check what the run said
        print(line, end="", flush=True)
        lines.append(line)
    return proc.wait() == 0, "".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("--steps", type=int, default=6, help="N: the run's total steps")
    parser.add_argument("--stop-after", type=int, default=3, help="K: the step mesh A stops after (a checkpoint)")
    parser.add_argument("--a", default="--nproc 2 --ep 2", help="`pithtrain train` arguments of mesh A (steps 1..K)")
    parser.add_argument("--b", default="--nproc 1", help="`pithtrain train` arguments of mesh B (steps K+1..N)")
    parser.add_argument("--ref", help="arguments of the uninterrupted reference run (default: --a)")
    parser.add_argument("--set", action="append", default=[], help="config overrides for every run")
    parser.add_argument("--rtol", type=float, default=1e-5, help="on the loss; fp32: 1e-5; bf16: about 2e-2")
    parser.add_argument("--rtol-aux", type=float, help="on lb_loss and grad_norm (default: --rtol); bf16: about 5e-2")
    parser.add_argument("--work", help="directory for the two runs (default: a new temporary one)")
    args = parser.parse_args()
    if not 0 < args.stop_after < args.steps:
        parser.error(f"need 0 < --stop-after ({args.stop_after}) < --steps ({args.steps})")
    work = Path(args.work or tempfile.mkdtemp(prefix="reshard-"))
    moved, ref = work / "resharded", work / "reference"
    if moved.exists() or ref.exists():
        parser.error(f"{work} already holds a run: pass a new --work")
    said = {}
    for what, out, extra, stop in (("mesh A", moved, args.a, args.stop_after), ("mesh B", moved, args.b, None),
                                   ("reference", ref, args.ref or args.a, None)):
        ok, said[what] = train(args.config, out, args.steps, extra, args.set, stop)
        if not ok:
            print(f"FAIL: the {what} run did not finish (its output is above)")
            return 1
    resumed = re.search(r"resumed from \S+ \(step (\d+)\)", said["mesh B"])
    if not resumed or int(resumed.group(1)) != args.stop_after:
        print(f"FAIL: mesh B did not resume from the step-{args.stop_after} checkpoint "
              f"({'it resumed at step ' + resumed.group(1) if resumed else 'no resume line in its output'})")
        return 1
    a, b = by_step(ref / "metrics.jsonl"), by_step(moved / "metrics.jsonl")
    print(f"reference: {ref}, resharded: {moved} (A {args.a!r} to step {args.stop_after}, then B {args.b!r})")
    ok = [m["step"] for m in b] == list(range(1, args.steps + 1))
    if not ok:
        print(f"FAIL: the resharded run logged steps {[m['step'] for m in b]}, expected 1..{args.steps}")
        return 1
    ok = compare_runs.compare(a, b, args.rtol, args.rtol_aux)
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
