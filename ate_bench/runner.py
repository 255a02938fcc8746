"""The runner: one session per (task, framework, repeat) on a fresh copy of the framework.

OUT/<framework>/<task>/r<k>/ holds work/ (the copy the agent worked in, its own git repository
with the starting state committed, so `changes.diff` is what the agent changed), prompt.txt,
transcript.jsonl (the agent's stdout), agent.stderr, answer.txt, grade/ (acceptance copies) and
result.json (the metrics and the grade). The runner never writes into the framework checkout; what changed
there during a session (the agent has the path, $ATE_CHECKOUT) is recorded as `checkout_changed`.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import stat
import subprocess
import time
from dataclasses import asdict
from pathlib import Path

from ate_bench import transcripts
from ate_bench.gpu import GpuSampler
from ate_bench.grading import COPY_IGNORE, copy_tree, dump, fill, grade, write_file
from ate_bench.tasks import Task, UsageError

FOOTER = ("\n\nYou are working in a copy of the framework's repository (your working directory); change it as the task "
          "needs. End with your final answer as your last message.")
AGENT_FIELDS = ("prompt", "prompt_file", "workdir")  # the --agent template's placeholders


def _git(work: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=ate-bench", "-c", "user.email=ate-bench@localhost", *args],
                          cwd=work, capture_output=True, text=True).stdout


def _copy_ignore(work: Path):
    """What a copy into `work` leaves out: COPY_IGNORE, and the results directory when it lies in the checkout
    (README's --out ate_runs/...)."""
    inside = set(work.resolve().parents)
    return lambda folder, names: set(COPY_IGNORE(folder, names)) | {n for n in names if Path(folder, n).resolve() in inside}


def fresh_copy(checkout: Path, work: Path) -> list[Path]:
    """A standalone copy: no .git of the original (a worktree's .git file would point back into
    it); a new repository with the starting state committed instead. Returns the special files left out."""
    special = copy_tree(checkout, work, _copy_ignore(work))
    if shutil.which("git"):
        _git(work, "init", "-q")
        _git(work, "add", "-A")
        _git(work, "commit", "-q", "-m", "ATE-Bench start", "--no-verify")
    return special


def fingerprint(checkout: Path, work: Path) -> dict[str, tuple]:
    """Per path a fresh copy into `work` takes: (type and mode, size, mtime_ns, link target), from lstat alone (a few ms
    for PithTrain). A write with the usual tools changes mtime_ns; a directory counts by its entries, not its mtime
    (a __pycache__ made by importing from the checkout is no change)."""
    ignore, found = _copy_ignore(work), {}
    for folder, dirs, files in os.walk(checkout):
        left_out = set(ignore(folder, dirs + files))
        dirs[:] = [d for d in dirs if d not in left_out]
        for name in dirs + [f for f in files if f not in left_out]:
            path = os.path.join(folder, name)
            try:
                st = os.lstat(path)
            except OSError:
                continue
            link = os.readlink(path) if stat.S_ISLNK(st.st_mode) else ""
            timed = not stat.S_ISDIR(st.st_mode)
            found[os.path.relpath(path, checkout)] = (st.st_mode, st.st_size if timed else 0, st.st_mtime_ns if timed else 0, link)
    return found


def _kill_group(proc: subprocess.Popen) -> None:
    """The agent runs in its own session: end its process group (the agent and what it started)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=5)
            return
        except subprocess.TimeoutExpired:
            continue


def run_agent(template: str, prompt: str, run_dir: Path, work: Path, time_limit: float, env: dict | None = None) -> dict:
    prompt_file = run_dir / "prompt.txt"
    prompt_file.write_text(prompt)
    cmd = fill(template, prompt=shlex.quote(prompt), prompt_file=shlex.quote(str(prompt_file)), workdir=shlex.quote(str(work)))
    start = time.monotonic()
    with open(run_dir / "transcript.jsonl", "w") as out, open(run_dir / "agent.stderr", "w") as err:
        proc = subprocess.Popen(["bash", "-c", cmd], cwd=work, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                                start_new_session=True, env={**os.environ, **(env or {})})
        with GpuSampler() as gpu:
            try:
                rc = proc.wait(timeout=time_limit)
                status = "ok" if rc == 0 else "agent_error"
                try:  # what the agent left running (a background training) went on through grading and the next sessions
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                rc, status = None, "timeout"
            except BaseException:  # Ctrl-C: the agent has its own session, so it would outlive us
                _kill_group(proc)
                raise
    return {"status": status, "exit_code": rc, "session_seconds": round(time.monotonic() - start, 3),
            "gpu_seconds": round(gpu.busy_seconds, 3), "gpu_source": gpu.source, "gpus_seen": gpu.gpus}


def run_one(task: Task, framework: str, checkout: Path, keyset: str, repeat: int, out: Path, agent: str, fmt: str,
            time_limit: float, grade_timeout: float, judge: str | None = None) -> dict:
    run_dir = out / framework / task.id / f"r{repeat}"
    if run_dir.exists():
        shutil.rmtree(run_dir)  # run --overwrite: the CLI refuses an existing session without it
    run_dir.mkdir(parents=True)
    work = run_dir / "work"
    before = fingerprint(checkout, work)  # the agent can write into $ATE_CHECKOUT: every later session would copy that
    try:
        special = fresh_copy(checkout, work)
    except OSError as e:
        shutil.rmtree(run_dir, ignore_errors=True)  # the half-made session
        if not isinstance(e, shutil.Error):
            raise
        errors = e.args[0]  # (src, dst, why) per file
        raise UsageError(f"--framework {framework}={checkout}: cannot copy {errors[0][0]} ({errors[0][2]})"
                         + (f" and {len(errors) - 1} more" if len(errors) > 1 else "") + "; fix it or move it out of the checkout") from None
    start = _git(work, "rev-parse", "HEAD").strip() if shutil.which("git") else ""
    session = run_agent(agent, task.prompt_for(keyset) + FOOTER, run_dir, work, time_limit,
                        env={"ATE_TASK": task.id, "ATE_FRAMEWORK": framework, "ATE_CHECKOUT": str(checkout)})
    if session["exit_code"] == 127:  # bash: the agent's command (or one it ran) was not found; no session to record
        stderr = (run_dir / "agent.stderr").read_text(errors="replace") if (run_dir / "agent.stderr").is_file() else ""
        found = re.search(r": ([^:\n]+): (command not found|No such file or directory)", stderr)
        what = ": ".join(found.groups()) if found else f"{agent.split()[0]}: command not found"
        shutil.rmtree(run_dir, ignore_errors=True)
        raise UsageError(f"--agent: {what}; install it, or give its path (or a PATH=...) in the --agent command")
    transcript = run_dir / "transcript.jsonl"  # the agent may have deleted it (it ended the whole run)
    parsed = transcripts.parse(fmt, transcript.read_text(errors="replace") if transcript.is_file() else "")
    if shutil.which("git") and (work / ".git").is_dir():
        _git(work, "add", "-A")
        # against the starting commit: an agent that committed its work left an empty diff against HEAD
        write_file(run_dir / "changes.diff", _git(work, "diff", "--cached", "--binary", *([start] if start else [])), top=out)
    result = {"task": task.id, "category": task.category, "framework": framework, "keyset": keyset, "repeat": repeat,
              "format": fmt, **session, **asdict(parsed),
              "mean_context_tokens": round(sum(parsed.context_tokens) / len(parsed.context_tokens)) if parsed.context_tokens else 0,
              "max_context_tokens": max(parsed.context_tokens, default=0)}
    if special:
        result["not_copied"] = [str(f.relative_to(checkout)) for f in special]
    if session["status"] == "timeout":
        result.update(grade="fail", score=0.0, note=f"agent stopped at the time limit ({time_limit:g} s)")
    else:
        result.update(grade(task, keyset, run_dir, work, checkout, parsed.answer, judge, grade_timeout))
    after = fingerprint(checkout, work)  # after grading too: a verifier reruns the agent's command, a test imports its code
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    if changed:  # the paths (the first 20) that changed, appeared or went
        result["checkout_changed"] = changed[:20] + ([f"... {len(changed) - 20} more"] if len(changed) > 20 else [])
    dump(result, run_dir / "result.json", top=out)
    return result
