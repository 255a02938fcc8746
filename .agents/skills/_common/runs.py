"""Helpers the skill scripts share: load another skill's script, launch a short `pithtrain train`
and keep what it said, read a run's metrics.

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "_common"))
    import runs
"""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

SKILLS = Path(__file__).resolve().parent.parent


def skill_script(relative: str):
    """Another skill's script as a module, e.g. skill_script("validate-correctness/compare_runs.py")."""
    path = SKILLS / relative
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def train(config: str, out: Path, steps: int, extra: str = "", sets=(), stop_after: int | None = None,
          env: dict | None = None, quiet: bool = False, checkpoints: bool = True) -> tuple[int, str]:
    """`pithtrain train CONFIG --out OUT --steps N [extra] [--set ...]`; returns (exit code, output).
    checkpoints=False: none written (a throwaway run of a large model saves minutes and disk).
    Its step, error and done lines are shown as they come (all of them without quiet); all are kept."""
    cmd = [sys.executable, "-m", "pithtrain", "train", config, "--out", str(out), "--steps", str(steps), *shlex.split(extra)]
    if stop_after is not None:
        cmd += ["--stop-after", str(stop_after)]
    for s in [*sets, *([] if checkpoints else ["train.checkpoint_every=-1"])]:
        cmd += ["--set", s]
    shown_env = " ".join(f"{k}={v}" for k, v in (env or {}).items())
    print("$", (shown_env + " " if shown_env else "") + shlex.join(cmd), flush=True)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, **(env or {})})
    lines = []
    for line in proc.stdout:
        if not quiet or line.startswith(("step ", "error", "done", "Traceback")):
            print("  " + line, end="", flush=True)
        lines.append(line)
    return proc.wait(), "".join(lines)


def metrics(run_dir: Path) -> list[dict]:
    """The metrics of each step once (a resumed run appends; a repeated step keeps its last line)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    steps = {m["step"]: m for m in (json.loads(line) for line in path.read_text().splitlines() if line.strip())}
    return [steps[s] for s in sorted(steps)]


def verdict(ok: bool, message: str = "") -> int:
    """The last line every skill script prints (PASS or FAIL, then why); its exit code."""
    print(("PASS" if ok else "FAIL") + (f": {message}" if message else ""))
    return 0 if ok else 1
