"""Run directories: what counts as one, their one-writer lock, and what a killed run leaves behind.

A run directory holds `run.lock`, `checkpoints/` or `metrics.jsonl`. `run.lock` marks it and, while a
run writes to it, names the writer (host, pid, process start time); it is emptied when the writer
ends. Taking it is atomic through flock; the recorded holder names a live writer in the refusal and
tells a stale lock (same host, that process gone) from a live one where flock is unavailable."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import socket
import threading
from pathlib import Path

from pithtrain.config import disk_error

LOCK = "run.lock"


def is_run_dir(path: Path) -> bool:
    return any((path / name).exists() for name in (LOCK, "checkpoints", "metrics.jsonl"))


def start_time(pid: int) -> str | None:
    """The process start time in clock ticks since boot (Linux), so that a reused pid is not taken for the holder."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def alive(pid: int, start: str | None = None) -> bool:
    """Whether process `pid` runs on this host (and, given its recorded `start`, is that process, not a reuse)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's live process
    now = start_time(pid)
    return now is None or start in (None, now)


class RunLock:
    """Held by the one process that owns a run directory for writing: the single process of
    `pithtrain train`, our launcher (its workers skip the lock), or rank 0 under torchrun."""

    def __init__(self, out: Path):
        self.path = out / LOCK
        self.note = None  # what taking the lock over says, if it was stale
        # what this start makes, removed again if the lock cannot be written: no empty run.lock marks a run directory
        made, existed = [p for p in (out, *out.parents) if not p.exists()], self.path.exists()
        try:
            out.mkdir(parents=True, exist_ok=True)
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise self._undo(e, made, existed)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            taken = True
        except BlockingIOError:
            taken = False
        except OSError:  # no flock on this filesystem: the recorded holder decides alone
            taken = True
        holder, me = _holder(self.fd), {"host": socket.gethostname(), "pid": os.getpid(), "start": start_time(os.getpid())}
        if holder and taken and holder["host"] == me["host"] and not alive(holder["pid"], holder.get("start")):
            self.note = f"note: took over the stale lock {self.path} of pid {holder['pid']} on {holder['host']} (no longer running)"
        elif holder or not taken:
            os.close(self.fd)
            raise _in_use(self.path, holder, "wait for it to end or stop it" if not holder or holder["host"] == me["host"]
                          else f"if that run is gone, delete {self.path}")
        try:
            os.ftruncate(self.fd, 0)
            os.pwrite(self.fd, json.dumps(me).encode(), 0)
        except OSError as e:
            os.close(self.fd)
            raise self._undo(e, made, existed)

    def _undo(self, error: OSError, made: list[Path], existed: bool) -> Exception:  # what this start made, removed
        if not existed:
            self.path.unlink(missing_ok=True)
        for folder in made:  # innermost first; one that holds anything stays
            with contextlib.suppress(OSError):
                folder.rmdir()
        return disk_error(error, self.path, then="run again or choose another --out") or error

    def release(self) -> None:
        if self.fd is not None:
            os.ftruncate(self.fd, 0)  # emptied, not deleted: unlinking a flocked file lets two writers in
            os.close(self.fd)
            self.fd = None


def _holder(fd: int) -> dict | None:
    """The writer an open run.lock names; None when it is empty, being written by a starting holder, or damaged."""
    try:
        holder = json.loads(os.pread(fd, 4096, 0) or b"null")
        return holder if isinstance(holder["pid"], int) and isinstance(holder["host"], str) else None
    except (ValueError, TypeError, KeyError):
        return None


def _in_use(lock: Path, holder: dict | None, hint: str) -> ValueError:
    who = f"pid {holder['pid']} on host {holder['host']}" if holder else "another process"
    return ValueError(f"run directory {lock.parent} is in use by {who} (lock {lock}); {hint}, or choose another directory")


def check_unheld(out: Path) -> None:
    """Refuse, as RunLock would, a run directory whose lock a live process holds; takes nothing."""
    try:
        fd = os.open(out / LOCK, os.O_RDONLY)
    except OSError:  # no lock file: nobody holds it
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released by the close below
    except BlockingIOError:
        raise _in_use(out / LOCK, _holder(fd), "wait for it to end or stop it") from None
    except OSError:
        pass  # no flock on this filesystem
    finally:
        os.close(fd)


def check_out(out: Path) -> None:
    """`out` is new, empty or a run directory."""
    if out.is_symlink() and not out.exists():
        raise ValueError(f"--out {out} is a symbolic link to {os.readlink(out)}, which does not exist; create that "
                         "directory, or pass another --out")
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file; pass a directory (new, empty, or a PithTrain run directory)")
    if not out.exists() and (up := next((p for p in out.parents if p.exists()), None)) and not up.is_dir():
        raise ValueError(f"--out {out}: {up} is a file, not a directory; choose another --out")
    # a new run within a run's checkpoints/ too: pruning that run's checkpoints would delete it
    under = next((p for p in list(out.parents)[:3] if is_run_dir(p) and out.relative_to(p).parts[0] == "checkpoints"), None)
    if under or out.is_dir() and any(out.iterdir()) and not is_run_dir(out):
        if run := under or next((p for p in list(out.parents)[:2] if is_run_dir(p)), None):  # its checkpoints/ or a step of them
            raise ValueError(f"--out {out} lies inside the run directory {run}; pass --out {run} to resume that run, "
                             "or choose a new directory")
        raise ValueError(f"--out {out} is neither empty nor a PithTrain run directory (one holding {LOCK}, checkpoints/ "
                         f"or metrics.jsonl); choose a new or empty directory")


def claim(out: Path, echo=print) -> RunLock:
    """Check that `out` is new, empty or a run directory, take its lock and remove what a killed
    run left: unpublished checkpoints (`checkpoints/step_N.tmp`, ours only)."""
    check_out(out)
    lock = RunLock(out)
    if lock.note:
        echo(lock.note)
    steps = [p for p in (out / "checkpoints").glob("step_*") if re.fullmatch(r"step_\d+(\.tmp)?", p.name)]
    for tmp in [p for p in steps if p.suffix == ".tmp"]:
        shutil.rmtree(tmp, ignore_errors=True)
        echo(f"note: removed {tmp}, a checkpoint a stopped run did not finish writing")
    done = [p for p in steps if p.suffix != ".tmp"]
    if done and not any((p / "meta.json").is_file() for p in done):
        lock.release()
        raise ValueError(f"{out / 'checkpoints'}: no checkpoint has its meta.json ({', '.join(sorted(p.name for p in done))}): "
                         f"none can be resumed; move or delete that directory to start over, or choose another --out")
    return lock


_OWNED: dict[Path, int] = {}  # the run directories an `owned` holds now, each with its thread


@contextlib.contextmanager
def owned(out: Path, echo=print):
    """`out` claimed for one run and released after it, unless an `owned` of this thread holds it already
    (the CLI's, around loop.train); a directory this made is removed again if the run ended before its first step."""
    if _OWNED.get(key := out.resolve()) == threading.get_ident():  # another thread's run is another writer: refused
        yield
        return
    created, lock = not out.exists(), claim(out, echo)  # in this order: claim makes the directory
    _OWNED[key] = threading.get_ident()
    try:
        yield
    finally:
        _OWNED.pop(key, None)
        if created:
            drop_unused(out)
        lock.release()


def drop_unused(out: Path) -> None:
    """Remove the run directory a run created if it ended before its first step: then it holds only
    what train wrote on the way (lock, config.json, an empty checkpoints/...), nothing to resume."""
    ours = {LOCK, "config.json", "run_config.json", "checkpoints", "tensorboard", "wandb", "wandb_id"}
    if not out.is_dir() or {p.name for p in out.iterdir()} - ours or any((out / "checkpoints").glob("*")):
        return
    for path in (out / name for name in ours - {LOCK}):
        shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
    (out / LOCK).unlink()  # still held: a process that opens it now makes a new file, and then OUT stays
    with contextlib.suppress(OSError):
        out.rmdir()
