"""Grading a finished session: required facts (understand), a verifier script over the agent's
artifacts (operate), an acceptance test run on a fresh copy of the final checkout (extend), or a
user's judge command where the task has nothing for the framework.

A grade is {"grade": "pass" | "fail" | "ungraded", "score": 0..1 or None, "note": str}.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import stat
import subprocess
import sys
from pathlib import Path

from ate_bench.tasks import Task

# never copied: version control (a fresh repository is made), environments, caches, earlier run outputs
COPY_IGNORE = shutil.ignore_patterns(".git", ".venv", "__pycache__", "*.pyc", ".pytest_cache", "runs")
# a command template's {name}; ${VAR} (a shell variable) and other braces ({}, {a,b}, awk's {print $1}) pass as written
PLACEHOLDER = re.compile(r"\$\{[^}]*\}|\{\{|\}\}|\{(\w+)\}")
JUDGE_FIELDS = ("prompt_file", "answer_file", "workdir", "task", "framework")


def placeholders(template: str) -> set[str]:
    return {m.group(1) for m in PLACEHOLDER.finditer(template) if m.group(1)}


def fill(template: str, **values: str) -> str:
    """`template` with its {name}s replaced by `values` ({{ and }} give a brace, as in str.format)."""
    return PLACEHOLDER.sub(lambda m: values[m.group(1)] if m.group(1) else {"{{": "{", "}}": "}"}.get(m.group(0), m.group(0)), template)


def copy_tree(src: Path, dst: Path, ignore=COPY_IGNORE) -> list[Path]:
    """shutil.copytree keeping symlinks and leaving out special files (named pipes, sockets, devices), which it returns."""
    special = []

    def skip(folder, names):
        left_out = set(ignore(folder, names))
        for n in set(names) - left_out:
            try:
                mode = os.lstat(os.path.join(folder, n)).st_mode
            except OSError:
                continue  # gone or unreadable: copytree reports it
            if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode) or stat.S_ISLNK(mode)):
                left_out.add(n)
                special.append(Path(folder, n))
        return left_out

    shutil.copytree(src, dst, ignore=skip, symlinks=True)
    return sorted(special)


def normalize(text: str) -> str:
    """Lower case, letters and digits only: `parallel/mesh.py` ~ "parallel mesh.py", and
    "(pp, dp, cp, ep)" ~ "pp x dp x cp x ep"."""
    return re.sub(r"[^a-z0-9]", "", text.lower().replace(" x ", " ").replace("×", ""))


def grade_facts(answer: str, facts: list[list[str]]) -> dict:
    text = normalize(answer)
    missing = [alts[0] for alts in facts if not any(normalize(a) in text for a in alts)]
    score = 1 - len(missing) / len(facts) if facts else 0.0
    note = "all facts present" if not missing else "missing: " + ", ".join(missing)
    return {"grade": "pass" if facts and not missing else "fail", "score": round(score, 3), "note": note}


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""


def _env(pythonpath: Path) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(pythonpath)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


def _run(cmd: list[str], timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """subprocess.run in a session of its own: at the timeout its whole process group ends. subprocess.run killed the
    grader alone, and what it started (a verifier's training rerun) went on beside the next sessions, costing their time."""
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
                          errors="replace", start_new_session=True, **kwargs) as p:
        try:
            out, err = p.communicate(timeout=timeout)
        except BaseException:  # the timeout, or Ctrl-C
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
            raise
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


def run_verifier(script: Path, workdir: Path, answer_file: Path, checkout: Path, timeout: float) -> dict:
    """The verifier checks the artifacts the agent left in `workdir` and the numbers in its answer,
    rerunning with the unmodified `checkout` where it needs to; exit 0 passes."""
    cmd = [sys.executable, str(script), "--workdir", str(workdir), "--answer", str(answer_file), "--checkout", str(checkout)]
    try:
        p = _run(cmd, timeout, cwd=workdir, env=_env(checkout))
    except subprocess.TimeoutExpired:
        return {"grade": "fail", "score": 0.0, "note": f"verifier timed out after {timeout:.0f} s"}
    note = _last_line(p.stdout) or _last_line(p.stderr)
    return {"grade": "pass" if p.returncode == 0 else "fail", "score": 1.0 if p.returncode == 0 else 0.0, "note": note}


def run_acceptance(test_file: Path, workdir: Path, grade_dir: Path, timeout: float) -> dict:
    """Copy the agent's final checkout to `grade_dir` (the agent's directory stays as it left it),
    drop the acceptance test in and run it there; it passes when pytest passes."""
    if grade_dir.is_symlink() or grade_dir.is_file():  # made by the agent: rmtree refused a link and ended the run
        grade_dir.unlink()
    elif grade_dir.exists():
        shutil.rmtree(grade_dir)
    copy_tree(workdir, grade_dir)
    dest = grade_dir / "ate_acceptance" / test_file.name  # the agent's ate_acceptance/ (a link) came along in the copy
    write_file(dest, test_file.read_bytes(), top=grade_dir)
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "--rootdir", str(dest.parent), str(dest)]
    try:
        p = _run(cmd, timeout, cwd=grade_dir, env=_env(grade_dir))
    except subprocess.TimeoutExpired:
        return {"grade": "fail", "score": 0.0, "note": f"acceptance test timed out after {timeout:.0f} s"}
    write_file(grade_dir.parent / "acceptance.log", p.stdout + p.stderr)
    ok = p.returncode == 0
    return {"grade": "pass" if ok else "fail", "score": 1.0 if ok else 0.0, "note": _last_line(p.stdout) or _last_line(p.stderr)}


def run_judge(judge: str, task: Task, framework: str, workdir: Path, answer_file: Path, timeout: float) -> dict:
    """`--judge "CMD {prompt_file} {answer_file} {workdir} {task} {framework}"`: exit 0 passes;
    a last stdout line `score=<0..1>` is recorded (anything else there: the exit code scores it, 1 or 0)."""
    prompt_file = answer_file.parent / "prompt.txt"
    cmd = fill(judge, prompt_file=shlex.quote(str(prompt_file)), answer_file=shlex.quote(str(answer_file)),
               workdir=shlex.quote(str(workdir)), task=shlex.quote(task.id), framework=shlex.quote(framework))
    try:
        # the agent may have removed its workdir
        p = _run(["bash", "-c", cmd], timeout, cwd=workdir if workdir.is_dir() else answer_file.parent)
    except subprocess.TimeoutExpired:
        return {"grade": "fail", "score": 0.0, "note": "judge timed out"}
    last = _last_line(p.stdout)
    score, note = (1.0 if p.returncode == 0 else 0.0), "judge: " + last
    m = re.match(r"score\s*=\s*(\S*)", last)
    if m:  # "score=1.2.3" was a ValueError that ended the run; 5e-1 was read as 5, 7 and nan kept as scores
        try:
            value = float(m.group(1))
        except ValueError:
            value = None
        if value is not None and 0 <= value <= 1:
            score = value
        else:
            note += f" (not a score in 0..1; scored by the exit code, {score:g})"
    return {"grade": "pass" if p.returncode == 0 else "fail", "score": score, "note": note}


def grade(task: Task, keyset: str, run_dir: Path, workdir: Path, checkout: Path, answer: str,
          judge: str | None, timeout: float) -> dict:
    answer_file = run_dir / "answer.txt"
    write_file(answer_file, answer, top=run_dir.parents[2])  # OUT/<framework>/<task>/r<k>
    if task.category == "understand" and keyset in task.keys:
        return grade_facts(answer, task.keys[keyset])
    if not workdir.is_dir() and (keyset in task.verifier or keyset in task.acceptance):  # was a traceback ending the run
        return {"grade": "fail", "score": 0.0, "note": "the agent removed its working directory"}
    if task.category == "operate" and keyset in task.verifier:
        return run_verifier(task.verifier[keyset], workdir, answer_file, checkout, timeout)
    if task.category == "extend" and keyset in task.acceptance:
        return run_acceptance(task.acceptance[keyset], workdir, run_dir / "grade", timeout)
    if judge:
        return run_judge(judge, task, keyset, workdir, answer_file, timeout)
    return {"grade": "ungraded", "score": None, "note": f"no key for {keyset}; pass --judge to grade it"}


def write_file(path: Path, data: str | bytes, top: Path | None = None) -> None:
    """Write `path` as a file of the runner's own. The runner makes no symlinks: one at `path`, or at a directory between
    `top` and it, is the agent's (which can write anywhere around its work/), and writing through it landed outside
    --out. Such a link is replaced (by the file, or an empty directory), what it points to left alone."""
    top = top or path.parent
    for p in [*(top / q for q in reversed(path.relative_to(top).parents) if q != Path(".")), path]:
        if p.is_symlink():
            print(f"warning: {p} is a symlink the runner did not make (to {os.readlink(p)}); replaced, its target left alone",
                  file=sys.stderr)
            p.unlink()
        if p != path and not p.is_dir():
            p.mkdir()
    with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0), 0o666), "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)


def dump(obj, path: Path, top: Path | None = None) -> None:
    write_file(path, json.dumps(obj, indent=2) + "\n", top)
