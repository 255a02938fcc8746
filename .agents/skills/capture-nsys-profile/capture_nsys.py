"""Capture chosen training steps with Nsight Systems, export to SQLite and analyse it; PASS/FAIL.

    python .agents/skills/capture-nsys-profile/capture_nsys.py CONFIG --capture 3:4 [--train-args "--nproc 2 --ep 2"]
        [--set a.b=v ...] [--out DIR] [--min-overlap 0.5]

Runs `nsys profile --capture-range=cudaProfilerApi ... pithtrain train CONFIG --steps LAST` with
PITHTRAIN_NVTX=1 (the NVTX ranges of protocol.named_range) and PITHTRAIN_PROFILE_STEPS=FIRST:LAST
(the loop starts the CUDA profiler API before step FIRST and stops it after step LAST), exports
the report with `nsys export --type sqlite`, then runs the analyze-nsys-profile skill's script on
it; its verdict is this script's. Without `nsys` on PATH it prints the command and FAILs.
"""

import argparse
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_common"))
import runs  # noqa: E402  (argument types)
from timeline import verdict  # noqa: E402

ANALYZE = Path(__file__).resolve().parents[1] / "analyze-nsys-profile" / "analyze_nsys.py"


@runs.interruptible
def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("--capture", default="3:4", help="FIRST:LAST steps to capture (1-based, after warm-up)")
    parser.add_argument("--train-args", default="", help="extra `pithtrain train` arguments, e.g. '--nproc 2 --ep 2'")
    parser.add_argument("--set", action="append", default=[])
    parser.add_argument("--out", type=Path, help="a new directory for the run, the report and its SQLite export")
    parser.add_argument("--min-overlap", type=runs.FRACTION, default=0.0, help="FAIL below this NCCL overlap (per process, 0..1)")
    args = parser.parse_args()
    first, _, last = args.capture.partition(":")
    if not (first.isdigit() and last.isdigit() and 1 <= int(first) <= int(last)):
        return verdict([f"--capture {args.capture!r}: expected FIRST:LAST with 1 <= FIRST <= LAST, e.g. 3:4"])
    if args.out is not None and args.out.exists():
        return verdict([f"--out {args.out} exists; give a new directory (nothing is overwritten)"])
    if refused := runs.refusal(args.config, int(last), [("the run", args.train_args, args.set, None)]):
        return verdict([refused])  # a config or mesh `pithtrain train` refuses: said before nsys starts
    out = args.out or Path(tempfile.mkdtemp(prefix="nsys-"))
    report, sqlite = out / "capture.nsys-rep", out / "capture.sqlite"
    env = dict(os.environ, PITHTRAIN_NVTX="1", PITHTRAIN_PROFILE_STEPS=args.capture)
    train = [sys.executable, "-m", "pithtrain", "train", args.config, "--out", str(out / "run"), "--steps", last,
             *shlex.split(args.train_args)] + [a for s in args.set for a in ("--set", s)]
    profile = ["nsys", "profile", "--trace=cuda,nvtx", "--capture-range=cudaProfilerApi", "--capture-range-end=stop",
               "--force-overwrite=true", f"--output={report}", *train]
    print(f"$ PITHTRAIN_NVTX=1 PITHTRAIN_PROFILE_STEPS={args.capture} {shlex.join(profile)}", flush=True)
    if shutil.which("nsys") is None:
        if args.out is None:  # the temporary directory made above, still empty
            out.rmdir()
        return verdict(["nsys is not on PATH: install Nsight Systems (NVIDIA's installer, or the CUDA toolkit's "
                        "nsight-systems package) and put its bin directory on PATH; without it, use the capture-profile "
                        "skill (torch profiler, the same ranges) or profile-kernel (ncu)"])
    out.mkdir(parents=True, exist_ok=True)
    failed = ("the profiled run did not finish (its error is above)" if subprocess.run(profile, env=env).returncode
              else None if report.is_file() else f"nsys wrote no {report}: did the run reach step {first}?")
    if failed:
        if not any(out.rglob("*.*")):  # nothing of use: the retry may take the same --out (no empty nsys-* left)
            shutil.rmtree(out, ignore_errors=True)
        # the run's directory and nsys's files: a temporary one is named nowhere else
        return verdict([failed + (f"; its files are in {out}" if out.exists() else "")])
    export = ["nsys", "export", "--type=sqlite", "--force-overwrite=true", f"--output={sqlite}", str(report)]
    print(f"$ {shlex.join(export)}", flush=True)
    if subprocess.run(export).returncode != 0:
        return verdict(["nsys export failed (its error is above)"])
    print(f"report: {report} (open in the Nsight Systems GUI); SQLite: {sqlite}", flush=True)
    return subprocess.run([sys.executable, str(ANALYZE), str(sqlite), "--min-overlap", str(args.min_overlap)]).returncode


if __name__ == "__main__":
    sys.exit(main())
