"""The launch-multi-node preflight: PASS on valid meshes, FAIL fast on impossible ones, and its
collective checks catch wrong data."""

import contextlib
import importlib.util
import io
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from dist_util import run_fn
from pithtrain.train.rundir import RunLock

SCRIPT = ".agents/skills/launch-multi-node/preflight.py"
CONFIG = "examples/qwen3_tiny.py"  # global batch 16, micro 8, 8 experts; its data is never read


def preflight(*args, timeout=300):
    start = time.monotonic()
    result = subprocess.run([sys.executable, SCRIPT, CONFIG, *args], capture_output=True, text=True, timeout=timeout)
    return result, time.monotonic() - start


def load_module():
    spec = importlib.util.spec_from_file_location("preflight", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_preflight_passes(tmp_path):
    # DualPipeV needs 2*pp = 4 micro-batches per data rank: 16 / (micro 2 x 2 data ranks) = 4
    out = tmp_path / "run"
    out.mkdir()
    (out / "run.lock").write_text("")  # a run directory no run holds: free for the launch, so a PASS (rank 0 alone probes it)
    result, _ = preflight("--nproc", "4", "--pp", "2", "--ep", "2", "--set", "train.micro_batch_size=2",
                          "--set", f"data.path={tmp_path}", "--out", str(out))  # a directory on every host
    text = result.stdout
    assert result.returncode == 0 and text.strip().splitlines()[-1] == (
        "PASS: 4 rank(s) on 1 host(s): all_reduce, all_to_all (EP), send/recv (PP) exact, one config and torch version, "
        f"data.path found, --out {out} shared"), text + result.stderr
    for line in ["mesh: pp=2 dp=1 cp=1 ep=2 (world 4)", "EP groups: [0, 1] [2, 3]", "pipeline stages of rank 0: [0, 2]",
                 "x 4 micro-batches", "all_reduce (world)", "all_to_all_single (EP)", "send/recv (pp neighbours)"]:
        assert line in text, text
    assert text.count(" cpu  torch ") == 4, text  # one line per rank: host, device
    assert not (out / ".preflight").exists()  # the shared-directory probe cleans up after itself


@pytest.mark.fast
def test_preflight_plans_a_data_parallel_mesh():
    """The plan rank 0 prints, for dp=2 x ep=2 (the collectives are the launch above's): 16 = micro 4 x 4 data ranks."""
    module = load_module()
    args = module.build_parser().parse_args(["train", CONFIG, "--ep", "2", "--set", "train.micro_batch_size=4"])
    assert module.plan(module.train_config(args), 4).splitlines() == [
        "mesh: pp=1 dp=2 cp=1 ep=2 (world 4)", "EP groups: [0, 1] [2, 3]", "pipeline stages of rank 0: [0]",
        "batch: 16 = micro 4 x data ranks 4 x 1 micro-batches"]


def test_preflight_fails_fast_on_impossible_mesh():
    result, seconds = preflight("--nproc", "3", "--ep", "2")
    assert result.returncode == 1, result.stdout + result.stderr
    last = result.stdout.strip().splitlines()[-1]
    assert last.startswith("FAIL: mesh pp=1 x cp=1 x ep=2 = 2 does not divide the 3 processes"), result.stdout
    assert "choose --nproc as a multiple of 2" in last
    assert "mesh: pp=" not in result.stdout and "backend" not in result.stdout  # no worker started
    assert seconds < 10, seconds


@pytest.mark.fast
def test_preflight_config_errors_start_nothing(monkeypatch, capsys, tmp_path):
    module = load_module()
    started = []
    monkeypatch.setattr(module, "launch_local", lambda *a: started.append("launch") or 0)
    monkeypatch.setattr("torch.distributed.init_process_group", lambda *a, **k: started.append("group"))
    monkeypatch.delenv("RANK", raising=False)
    assert module.main([CONFIG, "--nproc", "3", "--ep", "3"]) == 1
    assert capsys.readouterr().out.strip() == (
        "FAIL: parallel.ep=3 does not divide the 8 experts; choose ep among the divisors of 8")
    assert module.main([CONFIG, "--nproc", "2", "--pp", "2"]) == 1  # 16 / micro 8 = 2 micro-batches
    assert "parallel.pp=2 needs at least 2*pp = 4 micro-batches per data rank" in capsys.readouterr().out
    assert module.main([CONFIG, "--nproc", "4", "--pp", "4", "--set", "model.num_hidden_layers=2", "--set",
                        "train.micro_batch_size=2"]) == 1  # was: PASS for a launch `pithtrain train` refuses
    assert "parallel.pp=4: with model.num_hidden_layers=2 pipeline rank(s) 1, 2 hold no layer" in capsys.readouterr().out
    assert module.main([CONFIG, "--set", "train.stepz=3"]) == 1
    assert "unknown field 'stepz'" in capsys.readouterr().out
    other = tmp_path / random.choice(["hf", "a/b"])  # an --out train refuses: a directory of other files, a run a live process holds
    other.mkdir(parents=True)
    (other / "config.json").write_text("{}")
    assert module.main([CONFIG, "--nproc", "2", "--ep", "2", "--out", str(other)]) == 1
    assert capsys.readouterr().out.startswith(f"FAIL: --out {other} is neither empty nor a PithTrain run directory")
    lock = RunLock(tmp_path / "run")
    assert module.main([CONFIG, "--nproc", "2", "--ep", "2", "--out", str(tmp_path / "run")]) == 1
    assert capsys.readouterr().out.startswith(f"FAIL: run directory {tmp_path / 'run'} is in use by pid {os.getpid()}")
    lock.release()
    from pithtrain.config import load_run_config, run_dict

    other = load_run_config(CONFIG)  # a run directory of another model: was PASS, then train refused on every node
    other.model.num_hidden_layers = 3
    (tmp_path / "old" / "checkpoints" / "step_00000002").mkdir(parents=True)
    (tmp_path / "old" / "checkpoints" / "step_00000002" / "meta.json").write_text(json.dumps({"config": run_dict(other), "step": 2}))
    assert module.main([CONFIG, "--nproc", "2", "--ep", "2", "--out", str(tmp_path / "old")]) == 1
    assert "cannot resume from" in (said := capsys.readouterr().out) and "model.num_hidden_layers 3 -> 4" in said, said
    assert started == []
    assert module.main([CONFIG, "--nproc", "2", "--set", "train.micro_batch_size=4"]) == 0
    assert started == ["launch"]


@pytest.mark.fast
def test_preflight_interrupted_ends_in_one_fail_line(monkeypatch, capsys):
    """Ctrl-C (or the launcher's SignalException) while the workers run: one FAIL line, exit 130, no traceback;
    under torchrun rank 0 says it; a worker of --nproc interrupted even while it imports torch exits quietly."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    module = load_module()
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv(module._CHILD, "")  # launch_local sets it for its workers: unset again at the end
    for error in (KeyboardInterrupt(), SignalException("got signal: 2", sigval=2)):
        def interrupted(*a, error=error):
            raise error

        monkeypatch.setattr("torch.distributed.launcher.api.elastic_launch", lambda *a: interrupted)
        assert module.main([CONFIG, "--nproc", "2", "--ep", "2"]) == 130
        assert capsys.readouterr().out.splitlines() == [
            "FAIL: interrupted (Ctrl-C or a signal) before the checks ended; no verdict"]
    monkeypatch.delenv(module._CHILD, raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setattr(module, "checks", lambda *a: interrupted(error=KeyboardInterrupt()))
    assert module.main([CONFIG]) == 130
    assert capsys.readouterr().out.splitlines()[-1] == "FAIL: interrupted (Ctrl-C) before the checks ended; no verdict"
    worker = subprocess.Popen([sys.executable, SCRIPT], env={**os.environ, module._CHILD: "1"},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(0.3)  # importing torch takes longer
    worker.send_signal(signal.SIGINT)
    out, err = worker.communicate(timeout=60)
    assert worker.returncode == 130 and "Traceback" not in err, (worker.returncode, err)


def _checks(rank, world, corrupt):
    import torch.distributed as dist

    module = load_module()
    argv = [CONFIG, "--pp", "2", "--ep", "2", "--set", "train.micro_batch_size=2", "--set", f"data.path={Path(__file__).parent}"]
    args = module.build_parser().parse_args(["train", *argv])
    config = module.train_config(args)
    dist.destroy_process_group = lambda: None  # the harness ends the group itself
    if corrupt:  # deliver every EP block to the wrong receiver
        original = dist.all_to_all_single

        def swapped(recv, send, group):
            original(recv, send, group=group)
            recv.copy_(recv.roll(module.NUMEL))

        dist.all_to_all_single = swapped
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        code = module.checks(config, SimpleNamespace(out=None), module.pick_device("cpu"))
    return code, text.getvalue()


@pytest.mark.fast
def test_checks_detect_wrong_data():
    results = run_fn(4, _checks, False)
    assert [code for code, _ in results] == [0] * 4 and results[0][1].strip().splitlines()[-1].startswith(
        "PASS: 4 rank(s) on 1 host(s): all_reduce"), results[0][1]
    results = run_fn(4, _checks, True)
    assert [code for code, _ in results] == [1] * 4, results
    last = results[0][1].strip().splitlines()[-1]
    assert last.startswith("FAIL: rank 0 ("), last
    assert "all_to_all_single: wrong block from ranks [0, 1] (iteration 0)" in last, last
    assert results[1][1] == ""  # only rank 0 reports
