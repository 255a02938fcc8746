"""Process lifecycle of `pithtrain train`: the local launcher, graceful stop on SIGINT/SIGTERM, workers
that die with their launcher, and a stdout whose reader may go away."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time

STOPPED = (128 + signal.SIGINT, 128 + signal.SIGTERM)  # exit codes of a run stopped by a signal (shell convention)
ENDS_PROCESS = False  # set by cli.main run as the process's command line (not called from Python): it exits after


def _say(text: str) -> None:
    with contextlib.suppress(OSError):
        os.write(2, text.encode())  # not print: a signal handler may interrupt a print in progress


class GracefulStop:
    """While installed, the first SIGINT/SIGTERM asks the loop to stop after the current step, with a
    checkpoint (`signum` is set; the loop sets `stopped_at`); a second one aborts at once."""

    def __init__(self, loud: bool = True):
        self.signum, self.stopped_at, self.loud = 0, None, loud
        self.previous = {s: signal.signal(s, self._handle) for s in (signal.SIGINT, signal.SIGTERM)}

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.signum:
            _say(f"{name} again: aborting now; a rerun resumes from the last checkpoint written, if any\n")
            os._exit(128 + signum)
        self.signum = signum
        if self.loud:
            _say(f"{name}: stopping after this step ({name} again aborts at once)\n")

    def restore(self) -> None:
        if self.signum and ENDS_PROCESS:  # kept: a second signal in the teardown still aborts in one line (Python's
            return  # handler would print a KeyboardInterrupt traceback from an atexit callback)
        for s, handler in self.previous.items():
            signal.signal(s, handler)


def die_with_launcher(launcher: int) -> None:
    """For a worker of launch_local: the kernel kills it when the launcher dies, even by SIGKILL (Linux
    PR_SET_PDEATHSIG), so an orphan never runs on and writes to the run directory; elsewhere a thread
    watches the parent pid."""
    try:
        import ctypes

        if ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL)) != 0:  # 1 = PR_SET_PDEATHSIG
            raise OSError
    except (OSError, AttributeError):
        def watch():
            while os.getppid() == launcher:
                time.sleep(0.2)
            os._exit(1)

        threading.Thread(target=watch, daemon=True).start()
    if os.getppid() != launcher:  # it died before the death signal was armed
        os._exit(1)


class SafeStdout:
    """sys.stdout for a run whose reader may go away (`pithtrain train ... | head -1`): on a broken
    pipe stdout is pointed at /dev/null and the run goes on (metrics.jsonl is still written)."""

    def __init__(self, stream):
        self.stream = stream

    def __getattr__(self, name):
        return getattr(self.stream, name)

    def write(self, text: str) -> int:
        try:
            return self.stream.write(text)
        except BrokenPipeError:
            self._drop()
            return len(text)

    def flush(self) -> None:
        try:
            self.stream.flush()
        except BrokenPipeError:
            self._drop()

    def _drop(self) -> None:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, self.stream.fileno())  # what is still buffered goes there too, also at exit
        os.close(null)


def launch_local(argv: list[str], nproc: int) -> int:
    """Run `python -m pithtrain ARGV` as `nproc` workers on this host (RANK, WORLD_SIZE, LOCAL_RANK, and
    a rendezvous store hosted here, so there is no free-port race). The first worker to fail is named
    and the others are killed at once (a failed job must not write on). The first SIGINT/SIGTERM is
    passed on to each worker once (they stop after the same step, with a checkpoint); a second kills
    them. Workers run in their own sessions, so a terminal's Ctrl-C reaches them only this way."""
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, nproc, is_master=True, wait_for_workers=False)
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port), WORLD_SIZE=str(nproc),
               LOCAL_WORLD_SIZE=str(nproc), TORCHELASTIC_USE_AGENT_STORE="True", PITHTRAIN_LAUNCHER=str(os.getpid()))
    procs, ranks, codes, signals = [], {}, {}, []

    previous = {s: signal.signal(s, lambda signum, frame: signals.append(signum)) for s in (signal.SIGINT, signal.SIGTERM)}
    first, sent, killed = None, 0, False  # killed: a second signal cut a graceful stop short
    # workers start with SIGINT blocked (held, not lost) until __main__ makes it end them quietly: one that came
    # while Python imports would print a KeyboardInterrupt traceback from each worker
    unblocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        for rank in range(nproc):
            procs.append(subprocess.Popen([sys.executable, "-m", "pithtrain", *argv], start_new_session=True,
                                          env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank))))
            ranks[procs[-1].pid] = rank
        signal.pthread_sigmask(signal.SIG_SETMASK, unblocked)
        while len(codes) < nproc:
            if len(signals) > sent:  # passed on here, to every worker (one started after the signal too), none reaped
                sent = len(signals)
                for proc in procs:
                    if proc.pid not in codes:  # os.kill, not proc.send_signal: that would reap the child behind waitpid's back
                        os.kill(proc.pid, signals[0] if sent == 1 else signal.SIGKILL)
                        # once one has stopped on the first signal, the stop's checkpoint is whole: no abort to report
                        killed |= sent > 1 and not any(c in STOPPED for c in codes.values())
            # not a blocking wait: a signal that another thread took (this one blocks it while it forks) runs its
            # handler only when this thread runs Python
            pid, status = os.waitpid(-1, os.WNOHANG)  # in the order they end: the first failure is the root cause
            if pid not in ranks:
                time.sleep(0.02 if pid == 0 else 0)
                continue
            codes[pid] = code = os.waitstatus_to_exitcode(status)
            if first is None and code not in (0, *STOPPED, *(-s for s in signals)) and len(signals) < 2:
                first = pid
                for proc in procs:
                    if proc.pid not in codes:
                        os.kill(proc.pid, signal.SIGKILL)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, unblocked)
        for s, handler in previous.items():
            signal.signal(s, handler)
        if signals and ENDS_PROCESS:  # as after a run's stop (GracefulStop.restore)
            GracefulStop(loud=False).signum = signals[0]
        for proc in procs:
            if proc.pid not in codes:
                os.kill(proc.pid, signal.SIGKILL)
            proc.returncode = codes.get(proc.pid, -signal.SIGKILL)  # reaped here; Popen must not wait for it
    if killed:
        print(f"error: aborted by a second {signal.Signals(signals[-1]).name}; a rerun resumes from the last checkpoint "
              "written, if any", file=sys.stderr)
        return 128 + signals[-1]
    if signals and all(code == -signals[0] for code in codes.values()):  # ended by the signal itself: still starting
        print(f"stopped by {signal.Signals(signals[0]).name} while the workers started; nothing was trained", file=sys.stderr)
    if first is not None:
        code = codes[first]
        how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}; its error is above"
        print(f"error: rank {ranks[first]} (pid {first}) failed first ({how}); the other ranks were stopped; the same "
              "command resumes from the last checkpoint written, if any", file=sys.stderr)
        return max(code, 1)  # 2 stays 2: a bad input the worker reported
    return 128 + signals[0] if signals and any(codes.values()) else next((c for c in codes.values() if c), 0)
