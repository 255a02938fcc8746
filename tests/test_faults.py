"""Faults through the CLI on the CPU (tiny configs): kill -9 at random points of a run that saves
every step (it resumes from an intact checkpoint, bit-exact to an uninterrupted run), a closed
stdout, SIGINT/SIGTERM (stop after the step with a checkpoint and the resume command; a second
signal aborts), and the 2-process launcher (a graceful stop reaches every worker, a SIGKILLed
launcher leaves no worker alive, the first failing rank is named). The kill trials beyond the
first two are marked slow: PITHTRAIN_SLOW=1 or `-m slow` runs them."""

import os
import random
import shlex
import signal
import sys
import threading
import time

import pytest
import torch

from cli_util import alive, children, cli, one_line_error, rank_of, read_until, spawn, write_config
from conftest import tiny_config
from pithtrain import launch
from pithtrain.launch import launch_local
from pithtrain.train import checkpoint as ckpt
from pithtrain.train.metrics import read_metrics

STEPS = 8
# steps of a second (test config only), so that a second signal lands inside the step the first one ends
SLOW_STEPS = """
import time, pithtrain.train.loop as loop
_lr_at = loop.lr_at
loop.lr_at = lambda *a: (time.sleep(1), _lr_at(*a))[1]
"""


def curve(run):
    return [(m["step"], m["loss"], m["lb_loss"], m["grad_norm"]) for m in read_metrics(run / "metrics.jsonl")]


def final_weights(run, dataset_dir):
    model = tiny_config(dataset_dir).model.build_model()
    ckpt.read_model_state(ckpt.resolve_checkpoint(run), model)
    return model.state_dict()


@pytest.fixture(scope="module")
def reference(tmp_path_factory, dataset_dir):
    """The uninterrupted run, with its reader gone after step 1's line (`pithtrain train ... | head -2`):
    it must train on and write its metrics. Returns (config, its directory, the time from step 1's
    line to the end of the last save, estimated: the save loop that the kills aim at)."""
    base = tmp_path_factory.mktemp("faults")
    cfg = write_config(base / "cfg.py", dataset_dir, steps=STEPS, checkpoint_every=1, keep_checkpoints=2)
    proc = spawn(["train", cfg, "--out", base / "ref"])
    read_until(proc, "step 1/")
    started = time.time()
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 0 and "Traceback" not in err, err
    assert [m["step"] for m in read_metrics(base / "ref" / "metrics.jsonl")] == list(range(1, STEPS + 1))
    last_line = (base / "ref" / "metrics.jsonl").stat().st_mtime  # step 8's line, before its save
    return cfg, base, (last_line - started) * STEPS / (STEPS - 1)


@pytest.mark.parametrize("trial", [pytest.param(i, marks=[pytest.mark.slow] if i >= 2 else []) for i in range(22)])
def test_kill9_at_a_random_point_resumes_bit_exact(trial, reference, dataset_dir, capsys):
    cfg, base, window = reference
    run = base / f"kill{trial}"
    proc = spawn(["train", cfg, "--out", run])
    read_until(proc, "step 1/")  # every step saves a checkpoint, the first one now
    time.sleep(random.Random(trial).uniform(0, window))
    proc.kill()
    proc.communicate(timeout=60)
    found = ckpt.list_checkpoints(run)
    assert [ckpt.check_checkpoint(p) for p in found] == [None] * len(found)  # published means intact
    held = (run / "run.lock").exists() and (run / "run.lock").read_text() != ""  # killed before it released the lock
    out = cli(["train", cfg, "--out", run], capsys)[0]
    assert (f"took over the stale lock {run / 'run.lock'} of pid {proc.pid}" in out) == held
    assert f"resumed from {found[-1]}" in out if found else "resumed" not in out
    assert curve(run) == curve(base / "ref")
    ref_weights, weights = final_weights(base / "ref", dataset_dir), final_weights(run, dataset_dir)
    assert all(torch.equal(ref_weights[k], weights[k]) for k in ref_weights)
    assert not [p for p in (run / "checkpoints").iterdir() if p.suffix == ".tmp"]


def test_sigint_stops_after_the_step_and_a_second_one_aborts(reference, tmp_path, dataset_dir, capfd, monkeypatch):
    capsys = capfd  # the signal handler writes to file descriptor 2 directly
    cfg, base, _ = reference
    run = tmp_path / "run"

    def interrupt():  # Ctrl-C once the first step is logged
        while not (run / "metrics.jsonl").exists():
            time.sleep(0.002)
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=interrupt, daemon=True).start()
    out, err = cli(["train", cfg, "--out", run], capsys, code=130)
    step = len(read_metrics(run / "metrics.jsonl"))
    assert 1 <= step < STEPS and "SIGINT: stopping after this step" in err and "Traceback" not in err
    assert f"stopped by SIGINT after step {step} of {STEPS}; checkpoint {run}/checkpoints/step_{step:08d}" in out
    assert out.splitlines()[-1] == f"resume with: pithtrain train {cfg} --out {run}"
    assert ckpt.check_checkpoint(ckpt.list_checkpoints(run)[-1]) is None
    assert f"resumed from {run}/checkpoints/step_{step:08d}" in cli(shlex.split(out.splitlines()[-1])[3:], capsys)[0]
    assert curve(run) == curve(base / "ref") and signal.getsignal(signal.SIGINT) is signal.default_int_handler  # called from Python
    # as the process's command line the handler stays after a stop: a second Ctrl-C in the teardown aborts in one line
    monkeypatch.setattr(launch, "ENDS_PROCESS", True)  # (Python's handler printed a KeyboardInterrupt traceback from atexit)
    stop = launch.GracefulStop(loud=False)
    stop._handle(signal.SIGINT, None)
    stop.restore()
    assert signal.getsignal(signal.SIGINT) == stop._handle
    stop.signum = 0
    stop.restore()

    # another process: a second writer is refused while it runs; Ctrl-C twice aborts it at once
    slow = write_config(tmp_path / "slow.py", dataset_dir, SLOW_STEPS, steps=STEPS, checkpoint_every=1)
    proc = spawn(["train", slow, "--out", tmp_path / "run2"])
    read_until(proc, "step 1/")
    err = cli(["train", cfg, "--out", tmp_path / "run2"], capsys, code=2)[1]
    one_line_error(err, f"run directory {tmp_path / 'run2'} is in use by pid {proc.pid}")
    proc.send_signal(signal.SIGINT)
    read_until(proc, "SIGINT: stopping after this step", "stderr")
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "SIGINT again: aborting now" in err and "Traceback" not in err, err
    assert "stopped by" not in out and len(read_metrics(tmp_path / "run2" / "metrics.jsonl")) < STEPS


@pytest.mark.fast
def test_launcher_reports_an_abort_only_when_the_second_signal_cut_the_stop_short(tmp_path, monkeypatch, capsys):
    """launch_local with stand-in workers: a second SIGINT after a worker has finished its graceful stop
    (exit 130: the stop's checkpoint is whole) kills the rest without an 'aborted' line; one that
    comes while every worker is still stopping does report the abort. Both exit 130."""
    fake = tmp_path / "python"
    fake.write_text(f"""#!{sys.executable}
import os, signal, sys, time
signal.pthread_sigmask(signal.SIG_UNBLOCK, {{signal.SIGINT}})
rank = os.environ["RANK"]
stops = rank in sys.argv[3:]  # ends on SIGINT as a finished graceful stop does; the others go on stopping
signal.signal(signal.SIGINT, (lambda *a: (open(os.path.join({str(tmp_path)!r}, "down" + rank), "w"), sys.exit(130)))
              if stops else signal.SIG_IGN)
open(os.path.join({str(tmp_path)!r}, "up" + rank), "w").close()
time.sleep(60)
""")
    fake.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(fake))
    monkeypatch.setattr(launch, "ENDS_PROCESS", True)  # the launcher's own command line: it ends after launch_local

    def signal_twice(stopped: bool):
        while not all((tmp_path / f"up{r}").exists() for r in range(2)):
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGINT)
        while stopped and not (tmp_path / "down0").exists():
            time.sleep(0.01)
        time.sleep(0.3)  # the launcher reaps rank 0 first
        os.kill(os.getpid(), signal.SIGINT)

    for stopped in (True, False):
        for f in tmp_path.glob("up*"):
            f.unlink()
        thread = threading.Thread(target=signal_twice, args=(stopped,))
        thread.start()
        code = launch_local(["0"] if stopped else [], 2)
        thread.join()
        err = capsys.readouterr().err
        assert code == 130 and ("aborted by a second SIGINT" in err) == (not stopped), (stopped, err)
        kept = signal.getsignal(signal.SIGINT).__self__  # one more in its teardown: the one-line abort, not a traceback
        assert kept.signum == signal.SIGINT and not kept.loud
        kept.signum = 0
        kept.restore()


def test_launcher_sigint_in_startup_sigterm_stops_every_worker_and_a_killed_launcher_leaves_none(tmp_path, dataset_dir, capsys):
    cfg = write_config(tmp_path / "cfg.py", dataset_dir, steps=100)
    run = tmp_path / "run"
    # Ctrl-C while the workers import torch: the launcher's one line, no worker's KeyboardInterrupt traceback
    proc = spawn(["train", cfg, "--out", run, "--nproc", "2", "--ep", "2"])
    while len(children(proc.pid)) < 2 and proc.poll() is None:
        time.sleep(0.005)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and not run.exists(), err
    assert err.strip().splitlines() == ["stopped by SIGINT while the workers started; nothing was trained"], err

    proc = spawn(["train", cfg, "--out", run, "--nproc", "2", "--ep", "2"])
    read_until(proc, "step 1/")
    workers = children(proc.pid)
    assert sorted(rank_of(w) for w in workers) == [0, 1]
    err = cli(["train", cfg, "--out", run], capsys, code=2)[1]  # the launcher holds the lock, its workers do not
    one_line_error(err, f"in use by pid {proc.pid}")
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    step = len(read_metrics(run / "metrics.jsonl"))
    assert proc.returncode == 143 and "Traceback" not in err and err.count("SIGTERM: stopping") == 1, err
    assert f"stopped by SIGTERM after step {step} of 100; checkpoint {run}/checkpoints/step_{step:08d}" in out
    command = out.splitlines()[-1]
    assert command == f"resume with: pithtrain train {cfg} --out {run} --nproc 2 --ep 2"
    assert ckpt.check_checkpoint(ckpt.list_checkpoints(run)[-1]) is None and not any(map(alive, workers))

    proc = spawn(shlex.split(command)[3:])  # `resume with: pithtrain ARGS`
    read_until(proc, f"resumed from {run}/checkpoints/step_{step:08d}")
    read_until(proc, f"step {step + 1}/")
    workers = children(proc.pid)
    proc.kill()
    proc.communicate(timeout=60)
    deadline = time.monotonic() + 10
    while any(map(alive, workers)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(workers) == 2 and not any(map(alive, workers))
    size = (run / "metrics.jsonl").stat().st_size
    time.sleep(1)
    assert (run / "metrics.jsonl").stat().st_size == size  # nothing writes to the run directory any more


def test_the_first_failing_rank_is_named(tmp_path, dataset_dir):
    # rank 1 hangs in step 2: rank 0 gives up after parallel.timeout_s, in one line saying a rank hangs.
    # Started first: the failing run below runs while rank 0 waits out the timeout.
    hangs = write_config(tmp_path / "hangs.py", dataset_dir, """
import os, time, pithtrain.train.loop as loop
CONFIG.parallel.timeout_s = 10
_lr_at = loop.lr_at
def lr_at(step, *a):
    if os.environ["RANK"] == "1" and step == 1:
        time.sleep(120)
    return _lr_at(step, *a)
loop.lr_at = lr_at
""", steps=6)
    hung = spawn(["train", hangs, "--nproc", "2", "--ep", "2", "--out", tmp_path / "hung"])
    read_until(hung, "step 1/")  # both ranks are past the rendezvous and step 1: rank 1 now sleeps in step 2
    # rank 1 fails in step 1; rank 0 then fails too (or is stopped), in the collective that waits for it
    fails = write_config(tmp_path / "fails.py", dataset_dir, """
import os, pithtrain.train.loop as loop
_lr_at = loop.lr_at
def lr_at(step, *a):
    if os.environ["RANK"] == "1":
        raise RuntimeError("boom on rank 1")
    return _lr_at(step, *a)
loop.lr_at = lr_at
""", steps=6)
    started = time.perf_counter()
    proc = spawn(["train", fails, "--nproc", "2", "--ep", "2", "--out", tmp_path / "run"])
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1 and "RuntimeError: boom on rank 1" in err
    assert err.strip().splitlines()[-1].startswith("error: rank 1 (pid "), err
    assert "failed first (exit code 1; its error is above); the other ranks were stopped" in err
    assert time.perf_counter() - started < 90
    # a non-finite loss: every rank meets the same all-reduced value, its error line comes once, before the launcher's
    # (one micro-batch a rank and step: NaN from the drawn step on)
    step = random.randint(1, 2)
    nan = write_config(tmp_path / "nan.py", dataset_dir, f"""
import pithtrain.train.loop as loop
_ce, calls = loop.cross_entropy_sum, []
loop.cross_entropy_sum = lambda *a, **k: _ce(*a, **k) * (1 if len(calls.append(1) or calls) < {step} else float("nan"))
""", steps=2)
    proc = spawn(["train", nan, "--nproc", "2", "--ep", "2", "--out", tmp_path / "nan"])
    out, err = proc.communicate(timeout=120)
    said = err.strip().splitlines()
    assert proc.returncode == 2 and len(said) == 2 and said[0].startswith("error: non-finite loss (nan)"), err
    assert f"at step {step};" in said[0] and "failed first (exit code 2; its error is above)" in said[1], err
    out, err = hung.communicate(timeout=100)
    assert hung.returncode == 2 and "Traceback" not in err, err
    assert "error: rank 0: no answer in a collective within parallel.timeout_s=10: another rank hangs" in err, err
    assert "error: rank 0 (pid " in err.strip().splitlines()[-1] and "resumes from the last checkpoint" in err
