"""Run-directory safety through the CLI (in this process, tiny configs): convert never deletes its
source or an unrelated directory, train --out takes only a new, empty or run directory, one writer
per run directory, checkpoint checksums with fallback to the newest intact checkpoint, and what a
killed run leaves behind. Signals, kill -9 and the launcher are in test_faults.py."""

import pytest
import json
import os
import random
import shutil
import socket
import subprocess
import threading

import numpy as np

from cli_util import cli, one_line_error, write_config
from conftest import tiny_config
from pithtrain.tools.hf import convert, write_hf_dir
from pithtrain.train import checkpoint as ckpt
from pithtrain.train import loop
from pithtrain.train.metrics import read_metrics
from pithtrain.train.rundir import RunLock, owned

pytestmark = pytest.mark.fast  # the fast tier (make test-fast)


def _refusal(call) -> list:
    try:
        call()
    except ValueError as e:
        return [str(e)]
    return []


def files_of(path):
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_convert_never_deletes_its_source_or_an_unrelated_directory(tmp_path, dataset_dir, capsys):
    cfg = write_config(tmp_path / "cfg.py", dataset_dir, steps=2)
    run, hf, ck, data = tmp_path / "run", tmp_path / "hf", tmp_path / "ck", tmp_path / "data"
    cli(["train", cfg, "--out", run], capsys)
    cli(["convert", run, hf], capsys)
    cli(["convert", hf, ck], capsys)
    data.mkdir()
    (data / "tokens.bin").write_bytes(b"precious")
    before = {p: files_of(p) for p in (run, hf, ck, data)}
    for dst in (hf, data):  # an existing export, a dataset
        one_line_error(cli(["convert", run, dst], capsys, code=2)[1], f"DST {dst} exists and is not empty", "--overwrite")
    one_line_error(cli(["convert", hf, ck], capsys, code=2)[1], f"DST {ck} exists and is not empty")
    for src, dst in ((run, run), (run, run / "checkpoints" / "x"), (ck, ck / "sub"), (run / "checkpoints", run), (hf, hf)):
        one_line_error(cli(["convert", src, dst, "--overwrite"], capsys, code=2)[1], "would delete the source")
    one_line_error(cli(["convert", run, cfg], capsys, code=2)[1], f"DST {cfg} is a file")
    twin = tmp_path / "x.tmp"  # DST is written to DST.tmp first: that must not be SRC either
    twin.mkdir()
    one_line_error(cli(["convert", twin, tmp_path / "x", "--overwrite"], capsys, code=2)[1],
                   f"{tmp_path / 'x'}.tmp, where DST is written first, is SRC", "would delete the source")
    lock = RunLock(run)  # a run writing there: even --overwrite must not replace it
    one_line_error(cli(["convert", hf, run, "--overwrite"], capsys, code=2)[1], f"in use by pid {os.getpid()}")
    lock.release()
    (hf / "README.md").write_text("a model card")  # an export with a user's file in it: not replaced either
    before[hf] = files_of(hf)
    for dst, held in ((run, "checkpoints"), (data, "tokens.bin"), (hf, "README.md")):  # not only an export: kept
        one_line_error(cli(["convert", run if dst == hf else hf, dst, "--overwrite"], capsys, code=2)[1],
                       "is not only an HF export or a checkpoint", held, "move the rest out")
    with pytest.raises(ValueError, match="convert: overwrite='no'; pass True or False"):  # from Python: a true string
        convert(run, ck, overwrite="no")
    with pytest.raises(ValueError, match="convert: tokenizer='no'; pass True or False"):  # would export the tokenizer
        convert(run, tmp_path / "z", tokenizer="no")
    assert not (tmp_path / "z").exists()
    (tmp_path / "y.tmp").mkdir()  # write_hf_dir from Python keeps them too, and what lies in its OUT.tmp
    (tmp_path / "y.tmp" / "notes.txt").write_text("mine")
    model, step = ckpt.load_model(run), ckpt.list_checkpoints(run)[-1]
    for out, held in ((run, "checkpoints"), (data, "tokens.bin"), (hf, "README.md"), (tmp_path / "y", "notes.txt"),
                      (step, "a training checkpoint")):
        with pytest.raises(ValueError, match=f"write_hf_dir: {out} or {out.name}.tmp holds .*{held}.*choose another out"):
            write_hf_dir(model, out)
    assert (tmp_path / "y.tmp" / "notes.txt").read_text() == "mine" and not (tmp_path / "y").exists()
    assert {p: files_of(p) for p in (run, hf, ck, data)} == before
    (hf / "README.md").unlink()
    del before[hf]["README.md"]
    cli(["convert", run, hf, "--overwrite"], capsys)
    assert files_of(hf) == before[hf]  # same weights written again


def test_train_out_must_be_new_empty_or_a_run_directory(tmp_path, dataset_dir, capsys, monkeypatch):
    cfg = write_config(tmp_path / "cfg.py", dataset_dir, steps=1)
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text('{"model_type": "qwen3_moe"}')
    (hf / "model.safetensors").write_bytes(b"weights")
    err = cli(["train", cfg, "--out", hf], capsys, code=2)[1]
    one_line_error(err, f"--out {hf} is neither empty nor a PithTrain run directory", "run.lock, checkpoints/ or metrics.jsonl")
    config = tiny_config(dataset_dir, steps=1)  # the Python API takes only such a directory too, and one writer
    with pytest.raises(ValueError, match="neither empty nor a PithTrain run directory"):
        loop.train(config, hf, echo=False)
    assert (hf / "config.json").read_text() == '{"model_type": "qwen3_moe"}' and sorted(os.listdir(hf)) == ["config.json", "model.safetensors"]
    one_line_error(cli(["train", cfg, "--out", cfg], capsys, code=2)[1], f"--out {cfg} is a file")
    under = os.path.join(cfg, *random.choice([["sub"], ["a", "b"]]))  # a file on the way: named, not "[Errno 20]"
    one_line_error(cli(["train", cfg, "--out", under], capsys, code=2)[1], f"--out {under}: {cfg} is a file, not a directory")
    empty = tmp_path / "empty"
    empty.mkdir()
    cli(["train", cfg, "--out", empty], capsys)
    assert (empty / "run.lock").read_text() == ""  # the marker stays; the lock is released (emptied)
    lock = RunLock(empty)  # a live writer: a second train is refused, naming it
    err = cli(["train", cfg, "--out", empty], capsys, code=2)[1]
    one_line_error(err, f"run directory {empty} is in use by pid {os.getpid()} on host {socket.gethostname()}")
    with pytest.raises(ValueError, match=f"run directory {empty} is in use by pid {os.getpid()}"):
        loop.train(config, empty, echo=False)
    lock.release()
    with owned(empty):  # as the CLI holds it around loop.train: a train on another thread is a second writer, refused
        refused = []
        worker = threading.Thread(target=lambda: refused.extend(_refusal(lambda: loop.train(config, empty, echo=False))))
        worker.start()
        worker.join()
        assert refused and refused[0].startswith(f"run directory {empty} is in use by pid {os.getpid()}"), refused
    steps = random.randint(2, 3)  # the caller's config is left as it was; the lock is released after the run
    assert len(loop.train(config, empty, steps=steps, echo=False)) == steps - 1 and config.train.steps == 1
    assert (empty / "run.lock").read_text() == ""
    with pytest.raises(ValueError, match="config: expected a RunConfig, got str; read a run file with"):
        loop.train(cfg, tmp_path / "new", echo=False)
    config.train.device = "tpu"  # set after the run file was read: set_up picks the device before it validates
    with pytest.raises(ValueError, match="train.device='tpu': use auto, cpu or cuda"):
        loop.train(config, tmp_path / "new", echo=False)
    assert not (tmp_path / "new").exists()  # the run directory it made, removed again
    step = next((empty / "checkpoints").iterdir())  # the run's folders, and a new one in them: named, not entered
    for inside in (empty / "checkpoints", step, step / "new", empty / "checkpoints" / "new"):
        one_line_error(cli(["train", cfg, "--out", inside], capsys, code=2)[1],
                       f"--out {inside} lies inside the run directory {empty}; pass --out {empty} to resume")
    gone = tmp_path / "gone"  # a new run directory deleted during the run: the error names the write that failed
    monkeypatch.setattr(loop, "lr_at", lambda *a: (shutil.rmtree(gone), 1e-3)[1])
    one_line_error(cli(["train", cfg, "--out", gone], capsys, code=2)[1], f"writing {gone / 'metrics.jsonl'} failed",
                   "its folder was moved or deleted during the run")
    special = f"/proc/pithtrain-{os.getpid()}"  # a folder that takes no new files: not 'moved or deleted'
    one_line_error(cli(["train", cfg, "--out", special], capsys, code=2)[1], "(ENOENT); its folder takes no new files")


def test_checksums_name_damaged_checkpoints_and_resume_falls_back(tmp_path, dataset_dir, capsys):
    cfg = write_config(tmp_path / "cfg.py", dataset_dir, steps=4, checkpoint_every=1, keep_checkpoints=3)
    ref, run = tmp_path / "ref", tmp_path / "run"
    cli(["train", cfg, "--out", ref], capsys)
    cli(["train", cfg, "--out", run, "--stop-after", "3"], capsys)
    s1, s2, s3 = ckpt.list_checkpoints(run)
    files = json.loads((s3 / "meta.json").read_text())["files"]
    assert sorted(files) == [".metadata", "__0_0.distcp", "config.json"]
    assert all(files[n] == [(s3 / n).stat().st_size, ckpt._crc32(s3 / n)] for n in files)
    blob = bytearray((s3 / "__0_0.distcp").read_bytes())
    blob[len(blob) // 2] ^= 0x01  # one bit, same size
    (s3 / "__0_0.distcp").write_bytes(blob)
    with open(s2 / "__0_0.distcp", "r+b") as f:
        f.truncate(files["__0_0.distcp"][0] - 10)
    np.save(tmp_path / "tokens.npy", np.arange(40).reshape(2, 20) % 64)
    tokens = ["--tokens", tmp_path / "tokens.npy"]
    one_line_error(cli(["eval", s3, *tokens], capsys, code=2)[1], f"checkpoint {s3} is damaged: __0_0.distcp is corrupted")
    one_line_error(cli(["eval", s2, *tokens], capsys, code=2)[1], "__0_0.distcp has", "(truncated or overwritten)")
    err = cli(["eval", run, *tokens], capsys)[1]
    assert f"checkpoint {s3} is damaged" in err and f"checkpoint {s2} is damaged" in err

    out = cli(["train", cfg, "--out", run], capsys)[0]
    assert f"warning: checkpoint {s3} is damaged (__0_0.distcp is corrupted (CRC32 mismatch))" in out
    assert f"warning: checkpoint {s2} is damaged (__0_0.distcp has" in out and f"resumed from {s1} (step 1)" in out
    assert [(m["loss"], m["grad_norm"]) for m in read_metrics(run / "metrics.jsonl")] == \
           [(m["loss"], m["grad_norm"]) for m in read_metrics(ref / "metrics.jsonl")]
    assert [ckpt.check_checkpoint(p) for p in ckpt.list_checkpoints(run)] == [None] * 3  # damaged ones were rewritten
    (s3 / "meta.json").write_text('{"step": "3", "files": 5}')  # edited by hand, without its meta_crc32: named
    one_line_error(cli(["eval", s3, *tokens], capsys, code=2)[1], f"checkpoint {s3} is damaged: meta.json")

    for p in ckpt.list_checkpoints(run):
        (p / ".metadata").unlink()
    err = cli(["train", cfg, "--out", run], capsys, code=2)[1]
    one_line_error(err, "no intact checkpoint (step_00000004: .metadata is missing; step_00000003", "move or delete")
    for p in ckpt.list_checkpoints(run):
        (p / "meta.json").unlink()
    err = cli(["train", cfg, "--out", run], capsys, code=2)[1]
    one_line_error(err, f"{run / 'checkpoints'}: no checkpoint has its meta.json (step_00000002, step_00000003, step_00000004)")
    left = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert len(left) == 5 and left[1:4:2] == ["step_00000002.damaged", "step_00000003.damaged"]  # nothing started over them


def test_leftovers_of_a_killed_run(tmp_path, dataset_dir, capsys, monkeypatch):
    cfg = write_config(tmp_path / "cfg.py", dataset_dir, steps=4, checkpoint_every=1, keep_checkpoints=2)
    run = tmp_path / "run"
    # a deletion cut short after its first act (kill -9 inside rotation): the marker is gone, the files stay
    monkeypatch.setattr(ckpt.shutil, "rmtree", lambda *a, **k: None)
    cli(["train", cfg, "--out", run, "--stop-after", "3"], capsys)
    monkeypatch.undo()
    root = run / "checkpoints"
    assert sorted(os.listdir(root)) == ["step_00000001", "step_00000002", "step_00000003"]
    assert not (root / "step_00000001" / "meta.json").exists() and ckpt.list_checkpoints(run) == [root / "step_00000002", root / "step_00000003"]
    (root / "step_00000004.tmp").mkdir()  # a save cut short
    (root / "step_00000004.tmp" / "__0_0.distcp").write_bytes(b"partial")
    (root / "notes.tmp").write_text("not ours")
    (root / "step_00000000").symlink_to(shutil.copytree(root / "step_00000002", tmp_path / "other"))  # a link to another run's
    dead = subprocess.Popen(["true"])
    dead.wait()
    (run / "run.lock").write_text(json.dumps({"host": socket.gethostname(), "pid": dead.pid, "start": "1"}))
    out = cli(["train", cfg, "--out", run], capsys)[0]
    assert f"note: took over the stale lock {run / 'run.lock'} of pid {dead.pid}" in out
    assert f"note: removed {root / 'step_00000004.tmp'}" in out and f"resumed from {root / 'step_00000003'} (step 3)" in out
    assert sorted(os.listdir(root)) == ["notes.tmp", "step_00000003", "step_00000004"]  # the half-deleted one went at rotation
    assert ckpt.check_checkpoint(root / "step_00000004") is None and (run / "run.lock").read_text() == ""
    assert ckpt.check_checkpoint(tmp_path / "other") is None  # rotation removed the link, not what it points to
    assert [m["step"] for m in read_metrics(run / "metrics.jsonl")] == [1, 2, 3, 4]
