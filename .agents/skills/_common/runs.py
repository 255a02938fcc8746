"""Helpers the skill scripts share: load another skill's script, check and launch a short `pithtrain
train` and keep what it said, read a run's metrics and other JSON inputs, validated argument types,
the scripts' working directories.

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "_common"))
    import runs
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import importlib.util
import json
import math
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SKILLS = Path(__file__).resolve().parent.parent


class BadInput(Exception):
    """A file or argument a script cannot use; its message, one line naming it and what is wrong, is
    what the script prints (`FAIL: ...`)."""


def number(kind=float, low=None, high=None, above=None):
    """An argparse type: a finite `kind` (float or int) >= low, <= high, > above (each where given); any
    other value is argparse's one-line error naming the argument."""
    rule = " and ".join(r for r in (above is not None and f"> {above:g}", low is not None and f">= {low:g}",
                                    high is not None and f"<= {high:g}") if r)

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = None
        if (value is None or not math.isfinite(value) or (above is not None and not value > above)
                or (low is not None and value < low) or (high is not None and value > high)):
            raise argparse.ArgumentTypeError(f"{text!r}: expected {'an integer' if kind is int else 'a finite number'} {rule}")
        return value

    parse.__name__ = kind.__name__
    return parse


COUNT = number(int, low=1)  # steps, sizes, line numbers
POSITIVE = number(above=0)  # GiB, microseconds, a std
NON_NEGATIVE = number(low=0)  # margins, tolerances, gains
FRACTION = number(low=0, high=1)  # overlap shares


def WORK_DIR(text: str) -> str:  # noqa: N802 (an argparse type, named as the ones above)
    """An argparse type for --work: a directory, new or existing; a file there is argparse's one-line error."""
    if not text or os.path.isfile(text) or (os.path.lexists(text) and not os.path.exists(text)):
        raise argparse.ArgumentTypeError(f"{text!r}: a file, a broken link or empty; pass a directory (new or existing)")
    return text


def _file(path) -> Path:
    path = Path(path)
    if not path.is_file():
        raise BadInput(f"{path}: {'a directory, not a file' if path.is_dir() else 'no such file'}")
    return path


def read_json(path):
    """A JSON file's content; BadInput naming the file when it is missing, a directory or not JSON."""
    try:
        return json.loads(_file(path).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadInput(f"{path} is not JSON ({e})") from None


def read_jsonl(path, keys=("step",)) -> list[dict]:
    """Every line of a JSON-lines file (metrics.jsonl) as a dict holding the numbers `keys` (`step` an
    integer); BadInput naming the file and line otherwise. A last line without its newline that does not
    parse was cut short by a killed run: dropped, as pithtrain's read_metrics does."""
    lines = _file(path).read_text(errors="replace").splitlines(keepends=True)
    rows = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            if n == len(lines) and not line.endswith("\n"):
                break
            raise BadInput(f"{path} line {n} is not JSON ({e.msg})") from None
        for key in keys:
            value = row.get(key) if isinstance(row, dict) else None
            if isinstance(value, bool) or not isinstance(value, int if key == "step" else (int, float)):
                raise BadInput(f"{path} line {n} has no {key} ({'an integer' if key == 'step' else 'a number'}): "
                               f"not a metrics line of pithtrain")
        rows.append(row)
    return rows


def by_step(rows: list[dict]) -> list[dict]:
    """One row per step, in step order; a repeated step (a resumed run appends) keeps its last line."""
    steps = {m["step"]: m for m in rows}
    return [steps[s] for s in sorted(steps)]


@contextlib.contextmanager
def workdir(given, prefix: str):
    """The directory of a script's runs: `given` (its --work, kept), else a temporary one removed when
    the script ends."""
    if given:
        yield Path(given)
        return
    path = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def skill_script(relative: str):
    """Another skill's script as a module, e.g. skill_script("validate-correctness/compare_runs.py")."""
    path = SKILLS / relative
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def train_args(config: str, out: Path, steps: int, extra: str = "", sets=(), stop_after: int | None = None,
               checkpoints: bool = True) -> list[str]:
    """The arguments of `pithtrain train CONFIG --out OUT --steps N [extra] [--stop-after K] [--set ...]`.
    checkpoints=False: none written (a throwaway run of a large model saves minutes and disk)."""
    args = ["train", str(config), "--out", str(out), "--steps", str(steps), *shlex.split(extra)]
    if stop_after is not None:
        args += ["--stop-after", str(stop_after)]
    for s in [*sets, *([] if checkpoints else ["train.checkpoint_every=-1"])]:
        args += ["--set", s]
    return args


def check_train(what: str, *args, data: bool = True, **kwargs) -> str | None:
    """Why `pithtrain train` would refuse the run of train_args(*args, **kwargs) at its start (the config,
    the overrides and the mesh; with `data`, the data and init_from too, as --dry-run checks them), named
    `what`; None when it would start. A script checks every run it will make before training any."""
    from pithtrain.cli import build_parser, train_config
    from pithtrain.config import UserError, validate
    from pithtrain.train.loop import check_init_from, check_run

    try:
        argv = train_args(*args, **kwargs)
        extra = shlex.split(args[3] if len(args) > 3 else kwargs.get("extra", ""))
        alone = build_parser().parse_args(["train", "CONFIG", *extra])  # as argparse reads them: --ou is --out
        owned = next((f"--{f.replace('_', '-')}" for f in ("out", "steps", "stop_after") if getattr(alone, f) is not None), None)
        if owned:  # a second --out would make the runs share one directory
            return f"{what}: {owned} is the script's own (each run gets its directory and the same steps); leave it out"
        if alone.dry_run or alone.print_config:
            return f"{what}: --{'dry-run' if alone.dry_run else 'print-config'} trains nothing; leave it out"
        parsed = build_parser().parse_args(argv)
    except (SystemExit, ValueError) as e:  # argparse's own message is above; a shlex quote error is not
        return f"{what}: not `pithtrain train` arguments{f' ({e})' if isinstance(e, ValueError) else ''}"
    try:
        validate(config := train_config(parsed), world_size=parsed.nproc)
        if data:  # init_from without its checksums (--dry-run reads every file: minutes a run at 671B)
            plain = dataclasses.replace(config, train=dataclasses.replace(config.train, init_from=""))
            with tempfile.TemporaryDirectory() as fresh:  # an empty run directory: nothing to resume
                loader = check_run(plain, Path(fresh), parsed.stop_after, create=False, world_size=parsed.nproc)[0]
            if config.train.init_from:
                check_init_from(config, False, dataset=loader.dataset)
    except UserError as e:
        return f"{what}: {e}"
    return None


def refusal(config: str, steps: int, planned) -> str | None:
    """Why `pithtrain train` would refuse the first of the planned runs of CONFIG that it refuses: each
    (what, extra arguments, --set overrides, stop_after); None when every one would start. Every run's
    config and mesh first, then each one's data: a typo'd data.path of a later run is refused before the
    first trains."""
    return next((why for data in (False, True) for what, extra, sets, stop in planned
                 if (why := check_train(f"{what} ({extra})", config, "OUT", steps, extra, sets, stop, data=data))), None)


def train(config: str, out: Path, steps: int, extra: str = "", sets=(), stop_after: int | None = None,
          env: dict | None = None, quiet: bool = False, checkpoints: bool = True) -> tuple[int, str]:
    """`pithtrain train` with train_args(...); returns (exit code, output). Its step, error and done lines
    are shown as they come (all of them without quiet); all are kept."""
    cmd = [sys.executable, "-m", "pithtrain", *train_args(config, out, steps, extra, sets, stop_after, checkpoints)]
    shown_env = " ".join(f"{k}={v}" for k, v in (env or {}).items())
    print("$", (shown_env + " " if shown_env else "") + shlex.join(cmd), flush=True)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, **(env or {})})
    lines = []
    try:
        for line in proc.stdout:
            if not quiet or line.startswith(("step ", "error", "done", "Traceback")):
                print("  " + line, end="", flush=True)
            lines.append(line)
    except KeyboardInterrupt:  # Ctrl-C reached the run too (one process group): it stops after a step, or
        with contextlib.suppress(KeyboardInterrupt):  # at once on a second Ctrl-C; no verdict either way
            for line in proc.stdout:
                print("  " + line, end="", flush=True)
        if proc.poll() is None:
            proc.kill()
        verdict(False, f"interrupted (Ctrl-C) during `pithtrain train --out {out}` (exit {proc.wait()}); no verdict "
                       "(run the script again, into a new --work if you gave one)")
        raise SystemExit(130) from None
    return proc.wait(), "".join(lines)


def metrics(run_dir: Path, keys=("step",)) -> list[dict]:
    """The metrics of each step once (by_step); [] when the run wrote no metrics.jsonl."""
    path = Path(run_dir) / "metrics.jsonl"
    return by_step(read_jsonl(path, keys)) if path.exists() else []


VERDICTS: list[bool] = []  # the verdict lines printed so far


def interruptible(main):
    """A script's main (decorator): Ctrl-C ends it in one FAIL line and exit code 130, not a traceback."""
    @functools.wraps(main)
    def run(*args, **kwargs):
        VERDICTS.clear()
        try:
            return main(*args, **kwargs)
        except KeyboardInterrupt:  # after the verdict line (in cleanup) it stands: exit 130 without a second one
            if not VERDICTS:
                print()
                verdict(False, "interrupted (Ctrl-C); no verdict")
            return 130

    return run


def verdict(ok: bool, message: str = "") -> int:
    """The last line every skill script prints (PASS or FAIL, then why); its exit code."""
    VERDICTS.append(ok)
    print(("PASS" if ok else "FAIL") + (f": {message}" if message else ""))
    return 0 if ok else 1
