"""Helpers for tests that run the `pithtrain` CLI: a tiny run config file, in-process and
subprocess launches, and the processes a launcher started (from /proc)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pithtrain.cli import main

TESTS = str(Path(__file__).parent)
ROOT = str(Path(__file__).parent.parent)


def write_config(path: Path, dataset_dir, lines: str = "", **train) -> str:
    """A run config file of the tests' tiny Qwen3-MoE; `lines` run after CONFIG is defined. As many
    intra-op threads as this test process, so in-process and subprocess runs are bit-identical."""
    path.write_text(f"import sys, torch\nsys.path.insert(0, {TESTS!r})\nfrom conftest import tiny_config\n"
                    f"torch.set_num_threads({torch.get_num_threads()})\nCONFIG = tiny_config({str(dataset_dir)!r}, **{train!r})\n"
                    f"CONFIG.parallel.timeout_s = 30\n{lines}")
    return str(path)


def cli(args, capsys, code=0) -> tuple[str, str]:
    """`pithtrain ARGS` in this process; checks the exit code, returns (stdout, stderr)."""
    with pytest.raises(SystemExit) as exit_info:
        main([str(a) for a in args])
    out, err = capsys.readouterr()
    assert exit_info.value.code == code, out + err
    return out, err


def one_line_error(err: str, *parts: str) -> None:
    """The CLI's error format: `error: ...` on one line, the debug hint, no traceback."""
    lines = err.strip().splitlines()
    assert lines[0].startswith("error: ") and "Traceback" not in err and len(lines) <= 2, err
    for part in parts:
        assert part in lines[0], (part, err)


def spawn(args, **kwargs) -> subprocess.Popen:
    """`python -m pithtrain ARGS` as a subprocess of this worktree (stdout and stderr piped, text)."""
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.Popen([sys.executable, "-m", "pithtrain", *map(str, args)], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kwargs)


def read_until(proc: subprocess.Popen, text: str, stream: str = "stdout") -> list[str]:
    """Lines of stdout (or stderr) up to the first that contains `text` (fails if the process ends first)."""
    lines = []
    while text not in (lines[-1] if lines else ""):
        line = getattr(proc, stream).readline()
        assert line, f"process ended before printing {text!r}:\n" + "".join(lines)
        lines.append(line)
    return lines


def run_script(path: str, *args) -> subprocess.CompletedProcess:
    """A script's `main()` (it reads sys.argv, returns or exits with its code) in this process, its
    stdout captured: what `subprocess.run([python, path, *args])` reports (child processes the script
    starts print to this process's own output), without starting Python and torch again."""
    import contextlib
    import importlib.util
    import io

    spec = importlib.util.spec_from_file_location(Path(path).stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out, argv = io.StringIO(), sys.argv
    sys.argv = [path, *map(str, args)]
    try:
        with contextlib.redirect_stdout(out):
            try:
                code = module.main()
            except SystemExit as exit_info:
                code = exit_info.code
    finally:
        sys.argv = argv
    return subprocess.CompletedProcess([path, *map(str, args)], code or 0, out.getvalue(), "")


def _stat(pid: int) -> list[str] | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def children(pid: int) -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and (s := _stat(int(p))) and int(s[1]) == pid]


def alive(pid: int) -> bool:
    """Running (a zombie waiting to be reaped has ended)."""
    s = _stat(pid)
    return s is not None and s[0] != "Z"


def rank_of(pid: int) -> int:
    env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return int(next(v for v in env if v.startswith(b"RANK=")).split(b"=")[1])
