"""What a run claims, checked: the dataset a run trained on is recorded (real path, tokenizer and
content hashes) and convert, resume and data.eval_path are held to it; options that cannot take effect
are warned about at config time; every write a run makes fails in one line naming the file and the
fix, leaving no partial file (full disk, file-size limit, permissions, read-only filesystems)."""

import errno
import json
import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cli_util import ROOT, cli, one_line_error
from conftest import markov_docs, tiny_config, tiny_qwen3_5_config, write_run_file
from pithtrain.config import ignored_options
from pithtrain.tools.tokenize import train_bpe
from pithtrain.train import checkpoint as ckpt
from pithtrain.train.data import write_dataset
from pithtrain.train.metrics import MetricsLog, read_metrics


def _tokenized(path: Path, tokenizer: str, seed: int) -> Path:
    """A dataset of ids below 64 (the tiny model's vocabulary) that carries `tokenizer`."""
    write_dataset(path, markov_docs(np.random.default_rng(seed), 64, 120), vocab_size=64, eos_id=0, tokenizer_file=tokenizer)
    return path


def test_convert_from_another_directory_exports_the_runs_own_tokenizer(tmp_path, monkeypatch, capsys):
    """A run trained with a relative data.path; convert from another working directory, where a decoy
    dataset sits at the same relative path, exports the run's tokenizer byte for byte. A resume from
    there is refused; a tokenizer changed in place is refused by convert (or left out with
    --no-tokenizer) and by a resume."""
    a, b = tmp_path / "a", tmp_path / "b"
    own = train_bpe(["alpha beta gamma delta epsilon zeta eta theta " * 40], 260, str(tmp_path / "own.json"))
    decoy = train_bpe(["one two three four five six seven eight nine " * 40], 260, str(tmp_path / "decoy.json"))
    _tokenized(a / "data", own, 1)
    _tokenized(b / "data", decoy, 2)  # the decoy, at the same relative path
    monkeypatch.chdir(a)
    config = write_run_file(a / "tiny.py", "data")  # data.path='data', relative
    cli(["train", config, "--out", a / "run", "--stop-after", "1"], capsys)

    monkeypatch.chdir(b)
    _, err = cli(["convert", a / "run", b / "hf"], capsys)
    exported = (b / "hf" / "tokenizer.json").read_bytes()
    assert exported == Path(own).read_bytes() and exported != (b / "data" / "tokenizer.json").read_bytes(), err
    assert json.loads((b / "hf" / "generation_config.json").read_text())["eos_token_id"] == 0
    _, err = cli(["train", config, "--out", a / "run"], capsys, code=2)
    one_line_error(err, "cannot resume", f"data.path '{a / 'data'}' -> '{b / 'data'}'", "working directory")

    shutil.copyfile(decoy, a / "data" / "tokenizer.json")  # the run's dataset, changed in place
    _, err = cli(["convert", a / "run", b / "hf2"], capsys, code=2)
    one_line_error(err, f"{a / 'data' / 'tokenizer.json'} is not the tokenizer the run trained with", "--no-tokenizer")
    assert not (b / "hf2").exists() and not (b / "hf2.tmp").exists()
    _, err = cli(["convert", a / "run", b / "hf3", "--no-tokenizer"], capsys)
    assert "--no-tokenizer" in err and (b / "hf3" / "model.safetensors").is_file()
    assert not (b / "hf3" / "tokenizer.json").exists() and not (b / "hf3" / "generation_config.json").exists()
    monkeypatch.chdir(a)
    _, err = cli(["train", config, "--out", a / "run"], capsys, code=2)
    one_line_error(err, "cannot resume", f"the dataset at {a / 'data'} changed since it was written")
    shutil.copyfile(own, a / "data" / "tokenizer.json")  # restored: the run resumes
    out, _ = cli(["train", config, "--out", a / "run"], capsys)
    assert "resumed from" in out and [m["step"] for m in read_metrics(a / "run" / "metrics.jsonl")] == [1, 2]


def test_eval_path_checks_and_the_opt_in(tmp_path, dataset_dir, capsys):
    """data.eval_path is refused when it is the training data (unless data.eval_on_train) or another
    tokenizer's dataset (test_errors.py); with the opt-in the dry run passes."""
    config = write_run_file(tmp_path / "tiny.py", dataset_dir, "CONFIG.train.eval_every = 1\n"
                            f"CONFIG.data.eval_path = {str(dataset_dir)!r}\n")
    _, err = cli(["train", config, "--dry-run", "--out", tmp_path / "run"], capsys, code=2)
    one_line_error(err, "is a training dataset", "data.eval_on_train=true")
    out, _ = cli(["train", config, "--dry-run", "--out", tmp_path / "run", "--set", "data.eval_on_train=true"], capsys)
    assert "dry run ok" in out and not out.startswith("warning")
    write_dataset(tmp_path / "eval", [np.arange(1, 390) % 63 + 1], vocab_size=64, eos_id=0)  # 12 samples of 32 tokens
    for nproc, fit in (("1", 12), ("2", 8)):  # micro-batch 4 x data ranks, as validate asks of data.eval_samples
        _, err = cli(["train", config, "--dry-run", "--nproc", nproc, "--out", tmp_path / "run", "--set",
                      f"data.eval_path={tmp_path / 'eval'}", "--set", "data.eval_samples=16"], capsys, code=2)
        one_line_error(err, "12 samples of 32 tokens, fewer than data.eval_samples=16; use a larger eval set, or "
                       f"data.eval_samples of at most {fit} (a multiple of the micro-batch x data ranks)")
        out, _ = cli(["train", config, "--dry-run", "--nproc", nproc, "--out", tmp_path / "run", "--set",
                      f"data.eval_path={tmp_path / 'eval'}", "--set", f"data.eval_samples={fit}"], capsys)
        assert "dry run ok" in out
    write_dataset(tmp_path / "small", [np.arange(1, 60)], vocab_size=64, eos_id=0)  # 1 sample: less than a micro-batch
    _, err = cli(["train", config, "--dry-run", "--out", tmp_path / "run", "--set", f"data.eval_path={tmp_path / 'small'}"],
                 capsys, code=2)  # so no data.eval_samples fits (and 0 would mean all of them)
    one_line_error(err, "1 sample of 32 tokens, fewer than one global batch (8); use a larger eval set")
    assert "data.eval_samples" not in err
    out, _ = cli(["train", config, "--dry-run", "--out", tmp_path / "run", "--set", f"data.eval_path={tmp_path / 'small'}",
                  "--set", "train.eval_every=0"], capsys)  # never read: warned about, not refused
    assert "dry run ok" in out and "data.eval_path is never read" in out


@pytest.mark.fast
def test_options_without_effect_are_warned_about(tmp_path, dataset_dir, capsys):
    """Each option whose effect depends on another that is off gets one warning line naming it; the
    default config and the options set where they act get none."""
    base = tiny_config(dataset_dir)
    assert ignored_options(base) == []
    cases = [  # (section, field, value, what else is set, the field the warning names)
        ("optim", "decay_fraction", 0.3, {}, "optim.decay_fraction"),
        ("optim", "min_lr_ratio", 0.5, {"optim.schedule": "constant"}, "optim.min_lr_ratio"),
        ("optim", "momentum", 0.9, {}, "optim.momentum"),
        ("optim", "muon_exclude", ["lm_head.*"], {}, "optim.muon_exclude"),
        ("optim", "warmup_steps", 7, {}, "optim.warmup_steps"),  # train.steps=6
        ("optim", "warmup_steps", 6, {"optim.schedule": "wsd"}, "optim.warmup_steps=6 runs into wsd's decay (the last 1"),
        ("train", "lb_type", "global", {"train.lb_coef": 0.0}, "train.lb_type"),
        ("train", "keep_checkpoints", 5, {"train.checkpoint_every": -1}, "train.keep_checkpoints"),
        ("train", "mtp_coef", 0.1, {}, "train.mtp_coef has no effect without multi-token prediction layers (qwen3_moe "
         "has none)"),  # a Qwen3-MoE model: no MTP layers, nor a field for them
        ("train", "seed", 3, {"train.init_from": str(tmp_path)}, "train.seed"),
        ("data", "eval_path", str(dataset_dir), {}, "data.eval_path"),
        ("data", "eval_samples", 8, {}, "data.eval_samples=8"),
        ("data", "eval_on_train", True, {}, "data.eval_on_train"),
        ("parallel", "hsdp", True, {}, "parallel.hsdp"),
        ("parallel", "overlap_ep", False, {}, "parallel.overlap_ep"),
    ]
    for section, name, value, others, names in cases:
        config = tiny_config(dataset_dir)
        setattr(getattr(config, section), name, value)
        for key, other in others.items():
            setattr(getattr(config, key.split(".")[0]), key.split(".")[1], other)
        lines = ignored_options(config)
        assert len(lines) == 1 and lines[0].startswith("warning: ") and names in lines[0], (name, lines)
    where_they_act = tiny_config(dataset_dir)
    where_they_act.optim.name, where_they_act.optim.momentum = "muon", 0.9
    where_they_act.optim.schedule, where_they_act.optim.decay_fraction = "wsd", 0.3
    where_they_act.train.eval_every, where_they_act.data.eval_samples = 2, 8
    where_they_act.optim.warmup_steps = 4  # wsd's decay: the last 2 of the 6 steps
    assert ignored_options(where_they_act) == [] and ignored_options(base, world_size=2) == []
    base.optim.warmup_steps = 6  # cosine: the lr reaches optim.lr at the last step
    assert ignored_options(base) == []
    hybrid = tiny_qwen3_5_config(dataset_dir)  # its layer_types given: full_attention_interval places no layer
    assert ignored_options(hybrid) == []
    hybrid.model.full_attention_interval = 2
    assert ignored_options(hybrid) == ["warning: model.full_attention_interval=2 has no effect: model.layer_types is set "
                                       "(set model.layer_types=null to place the full-attention layers by the interval)"]
    hybrid.model.layer_types = None
    assert ignored_options(hybrid) == []
    from pithtrain.train.loop import check_muon_takes_some

    base.optim.name, base.optim.muon_exclude = "muon", ["embed_tokens.*", "embed_token.*", "*norm*"]
    check_muon_takes_some(base, echo=True)  # a pattern that matches nothing (a typo) is said, the others not
    assert "warning: optim.muon_exclude ['embed_token.*'] match no parameter" in capsys.readouterr().out
    hsdp = tiny_config(dataset_dir)
    hsdp.parallel.hsdp = True
    assert ignored_options(hsdp, world_size=2) == []  # dp=2: replicas to replicate over
    config = write_run_file(tmp_path / "tiny.py", dataset_dir, "CONFIG.optim.momentum = 0.9\n")
    out, _ = cli(["train", config, "--dry-run", "--out", tmp_path / "run"], capsys)
    assert out.splitlines()[0] == "warning: optim.momentum is Muon's; optim.name=adamw does not use it"


def test_every_write_of_a_run_fails_in_one_line_without_a_partial_file(tmp_path, dataset_dir, capsys, monkeypatch):
    """Injected: metrics.jsonl (ENOSPC mid-line), the run lock (EACCES), an HF export (safetensors' own
    exception naming ENOSPC), a tokenized dataset (EFBIG), a trained tokenizer (tokenizers' Exception).
    Each ends in one line naming the file, the reason and the fix; nothing partial stays."""
    from pithtrain.train import metrics, rundir

    log = MetricsLog(tmp_path, tensorboard=False)
    row = {"step": 1, "loss": 4.0, "tokens_per_s": 1.0, "step_time_s": 1.0, "peak_mem_bytes": 0, "lb_loss": 0.0,
           "lr": 1e-3, "grad_norm": 1.0}
    log.log(row, 2, echo=False)
    before = (tmp_path / "metrics.jsonl").read_bytes()

    class HalfWrite:  # writes half the line, then the disk is full
        def __init__(self, path, mode):
            self.f = open(path, mode)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, text):
            self.f.write(text[: len(text) // 2])
            self.f.flush()
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(metrics, "open", HalfWrite, raising=False)
    with pytest.raises(ValueError) as failure:
        log.log(dict(row, step=2), 2, echo=False)
    assert f"writing {tmp_path / 'metrics.jsonl'} failed: No space left on device (ENOSPC)" in str(failure.value)
    assert "free space" in str(failure.value) and (tmp_path / "metrics.jsonl").read_bytes() == before
    monkeypatch.undo()

    def no_permission(path, *args, **kwargs):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))

    config = write_run_file(tmp_path / "tiny.py", dataset_dir)
    monkeypatch.setattr(rundir.os, "open", no_permission)
    _, err = cli(["train", config, "--out", tmp_path / "locked"], capsys, code=2)
    one_line_error(err, f"writing {tmp_path / 'locked' / 'run.lock'} failed: Permission denied (EACCES)", "make it writable")
    assert not (tmp_path / "locked").exists()  # the folder this start made is gone again
    monkeypatch.undo()

    def full(*args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    # the disk fills as the lock's holder is written: no empty run.lock stays, nor the folders this start made
    # (a folder there before stays)
    monkeypatch.setattr(rundir.os, "pwrite", full)
    depth = np.random.default_rng().integers(1, 4)
    for out, made in ((tmp_path.joinpath(*["new"] * depth), tmp_path / "new"), (tmp_path / "mine", None)):
        if made is None:
            out.mkdir()
        _, err = cli(["train", config, "--out", out], capsys, code=2)
        one_line_error(err, f"writing {out / 'run.lock'} failed: No space left on device (ENOSPC)", "free space")
        assert not (out / "run.lock").exists() and (made is None) == out.is_dir() and not (made and made.exists())
    monkeypatch.undo()

    from pithtrain.tools import hf

    run = tmp_path / "run"
    cli(["train", config, "--out", run, "--stop-after", "1"], capsys)

    def full(*args, **kwargs):  # safetensors' Rust writer: its own exception type, the OS error in its text
        Path(args[1]).write_bytes(b"partial")
        raise Exception('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left on device" })')

    monkeypatch.setattr(hf, "save_file", full)
    _, err = cli(["convert", run, tmp_path / "hf"], capsys, code=2)
    note, error = err.strip().splitlines()  # the note: this run's dataset has no tokenizer
    assert note.startswith("note: no tokenizer written") and "Traceback" not in err
    one_line_error(error, f"writing {tmp_path / 'hf'} failed: No space left on device (ENOSPC)", f"removed {tmp_path / 'hf.tmp'}")
    assert not (tmp_path / "hf").exists() and not (tmp_path / "hf.tmp").exists()
    monkeypatch.undo()

    from pithtrain.train import data

    def too_big(*args, **kwargs):
        raise OSError(errno.EFBIG, os.strerror(errno.EFBIG))

    monkeypatch.setattr(data.np, "save", too_big)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("alpha beta gamma delta " * 100)
    tokenizer = train_bpe([corpus.read_text()], 260, str(tmp_path / "tok.json"))
    _, err = cli(["tokenize", corpus, "--tokenizer", tokenizer, "--out", tmp_path / "ds"], capsys, code=2)
    progress, error = err.strip().splitlines()  # tokenize's progress line, then the error
    one_line_error(error, f"writing {tmp_path / 'ds'} failed: File too large (EFBIG)", "ulimit -f")
    assert sorted(p.name for p in tmp_path.iterdir() if "ds" in p.name) == []  # no .ds.tmp-PID left
    monkeypatch.undo()

    import tokenizers

    def read_only(self, path, *args):
        raise Exception(f"Read-only file system (os error 30): {path}")

    monkeypatch.setattr(tokenizers.Tokenizer, "save", read_only)
    _, err = cli(["tokenize", corpus, "--train-tokenizer", "--vocab-size", "260", "--out", tmp_path / "ds2"], capsys, code=2)
    one_line_error(err, "tokenizer.json failed: Read-only file system (EROFS)", "choose a writable location")


def test_file_size_limit_during_a_checkpoint_save(tmp_path, dataset_dir):
    """A real EFBIG: the checkpoint's data file outgrows RLIMIT_FSIZE in a launched run. One line names
    the checkpoint, EFBIG and the fix; the partial step_N.tmp is gone."""
    config = write_run_file(tmp_path / "tiny.py", dataset_dir)
    limit = 48 << 10  # above metrics.jsonl and the configs, below the model and its optimizer state

    def limited():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    result = subprocess.run([sys.executable, "-m", "pithtrain", "train", config, "--out", tmp_path / "run"], cwd=ROOT,
                            env=dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                            preexec_fn=limited)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert "writing the checkpoint of step 2 failed: File too large (EFBIG)" in lines[0] and "ulimit -f" in lines[0], lines
    assert list((tmp_path / "run" / "checkpoints").iterdir()) == []


@pytest.mark.fast
def test_meta_json_carries_its_own_checksum(tmp_path, dataset_dir):
    """A same-size edit of meta.json's step is caught by its own CRC32 (tests/test_errors.py: the CLI's line);
    the other checkpoint files keep theirs; a checkpoint written before the field still passes."""
    from pithtrain.train import loop

    loop.train(tiny_config(dataset_dir, steps=1), tmp_path / "run", echo=False)
    (step,) = ckpt.list_checkpoints(tmp_path / "run")
    meta = json.loads((step / "meta.json").read_text())
    assert ckpt.check_checkpoint(step) is None and isinstance(meta["meta_crc32"], int)
    hashes = {k: meta["dataset"].get(k) for k in ("content_sha256", "tokens_sample_sha256")}
    assert meta["dataset"] == {"path": os.path.realpath(dataset_dir), "tokenizer_sha256": None, **hashes}
    assert all(len(h) == 64 for h in hashes.values()) and len(set(hashes.values())) == 2
    original = (step / "meta.json").read_text()
    edited = original.replace('"samples_consumed": 8', '"samples_consumed": 9')
    assert len(edited) == len(original) != 0 and edited != original
    (step / "meta.json").write_text(edited)
    assert "CRC32" in ckpt.check_checkpoint(step)
    del meta["meta_crc32"]
    (step / "meta.json").write_text(json.dumps(meta))  # as written before the field: still intact
    assert ckpt.check_checkpoint(step) is None


@pytest.mark.fast
def test_a_dataset_directory_that_cannot_be_made_and_an_input_that_does_not_read(tmp_path, monkeypatch):
    """write_dataset: a folder it cannot create is a write failure (one line, the fix); an input that
    fails to read while documents stream in is not misreported as one."""
    from pathlib import Path as P

    made = P.mkdir

    def read_only(self, *args, **kwargs):
        if "out" in str(self):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))
        return made(self, *args, **kwargs)

    monkeypatch.setattr(P, "mkdir", read_only)
    with pytest.raises(ValueError, match=r"writing .*ds failed: Read-only file system \(EROFS\).*choose a writable location"):
        write_dataset(tmp_path / "out" / "ds", [[1, 2, 3]], vocab_size=8, eos_id=0)
    monkeypatch.undo()

    def docs():
        yield [1, 2]
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(tmp_path / "corpus.txt"))

    with pytest.raises(PermissionError):  # the input's own error, naming the input
        write_dataset(tmp_path / "ds2", docs(), vocab_size=8, eos_id=0)
    assert sorted(p.name for p in tmp_path.iterdir()) == []
