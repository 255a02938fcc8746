"""Seeing a run: the effective config (printed, OUT/run_config.json, --print-config, --dry-run, the
config fields in `train --help`), TensorBoard, Weights & Biases (a fake wandb module) and `pithtrain plot`."""

import dataclasses
import errno
import json
import random
import sys
import threading
import types
import warnings
from unittest import mock

import pytest

from cli_util import cli, one_line_error
from conftest import tiny_config, write_run_file
from pithtrain.config import SECTIONS, UserError, field_help, load_run_config, run_dict
from pithtrain.train import loop
from pithtrain.train.metrics import MetricsLog

pytestmark = pytest.mark.fast  # the fast tier (make test-fast)


@pytest.fixture(scope="module")
def run(tmp_path_factory, dataset_dir):
    """A finished 2-step run directory."""
    out = tmp_path_factory.mktemp("observe") / "run"
    loop.train(tiny_config(dataset_dir, steps=2), out, echo=False)
    return out


def test_help_lists_every_field_with_type_default_and_meaning(capsys):
    out, _ = cli(["train", "--help"], capsys)
    for section, cls in SECTIONS:
        meaning = field_help(cls)
        for f in dataclasses.fields(cls):
            assert meaning[f.name], f"{section}.{f.name} has no comment in config.py"
            line = next(line for line in out.splitlines() if line.startswith(f"  {section}.{f.name}: "))
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default  # optim.muon_exclude: a list
            assert f"= {default!r}" in line and meaning[f.name][:30] in out, line
    assert "train.fp8: str = 'off'" in out and "compute capability 8.9+" in out  # a comment block above the field
    for family in ("qwen3_moe (Qwen3MoeConfig)", "deepseek_v2 (DeepseekV2Config)", "deepseek_v3 (DeepseekV3Config)", "gpt_oss (GptOssConfig)",
                   "qwen3_5_moe_text (Qwen3_5MoeConfig)"):
        assert family in out


def test_config_printed_and_written(tmp_path, dataset_dir, capsys):
    path = write_run_file(tmp_path / "tiny.py", dataset_dir)
    out, _ = cli(["train", path, "--out", tmp_path / "run", "--steps", "1", "--set", "optim.lr=0.002"], capsys)
    assert "  optim.lr = 0.002\n" in out and "  model.model_type = \"qwen3_moe\"\n" in out
    assert out.index("train.steps = 1") < out.index("step 1/1")
    stored = json.loads((tmp_path / "run" / "run_config.json").read_text())
    expected = run_dict(load_run_config(path))
    expected["optim"]["lr"], expected["train"]["steps"] = 0.002, 1
    assert stored == expected and stored["model"]["hidden_size"] == 32


def test_print_config_and_dry_run_write_nothing(tmp_path, dataset_dir, run, capsys):
    path = write_run_file(tmp_path / "tiny.py", dataset_dir)
    out, _ = cli(["train", path, "--out", tmp_path / "new", "--print-config", "--set", "train.seed=3"], capsys)
    assert json.loads(out)["train"]["seed"] == 3 and not (tmp_path / "new").exists()
    out, _ = cli(["train", path, "--out", tmp_path / "new", "--dry-run", "--nproc", "4", "--ep", "2",
               "--set", "train.micro_batch_size=2"], capsys)
    assert "  parallel.ep = 2\n" in out and "mesh pp=1 dp=2 cp=1 ep=2" in out and "nothing was written" in out
    assert not (tmp_path / "new").exists()
    out, _ = cli(["train", path, "--out", run, "--dry-run", "--steps", "4"], capsys)  # resume checks run too
    assert "would resume from" in out and "step_00000002" in out
    for args, names in ((["--steps", "0"], "train.steps"), (["--nproc", "3", "--ep", "2"], "--nproc"),
                        (["--set", f"data.path={tmp_path}"], "meta.json"), (["--out", path], "tiny.py")):
        _, err = cli(["train", path, "--dry-run", "--out", tmp_path / "x", *args], capsys, code=2)
        one_line_error(err, names)
    _, err = cli(["train", path, "--out", run, "--print-config", "--steps", "1"], capsys, code=2)
    one_line_error(err, "past train.steps=1")


class FakeWandb(types.ModuleType):
    """A stand-in for the wandb package that records init, log and finish."""

    def __init__(self):
        super().__init__("wandb")
        self.calls = []

    def init(self, **kwargs):
        self.calls.append(("init", kwargs))
        return self

    def log(self, data, step=None):
        self.calls.append(("log", step, data))

    def finish(self, exit_code=None):
        self.calls.append(("finish",) if exit_code is None else ("finish", exit_code))


def test_wandb_logs_every_step_on_the_main_rank(tmp_path, dataset_dir, monkeypatch):
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setenv("WANDB_MODE", "offline")
    history = loop.train(tiny_config(dataset_dir, steps=3, wandb_project="moe"), tmp_path / "run", echo=False)
    (init, kwargs), *logs, finish = fake.calls
    assert init == "init" and kwargs["project"] == "moe" and kwargs["name"] == "run" and "mode" not in kwargs
    assert kwargs["config"]["model"]["hidden_size"] == 32 and finish == ("finish",)
    assert [(step, data["loss"]) for _, step, data in logs] == [(m["step"], m["loss"]) for m in history]
    fake.calls.clear()
    MetricsLog(tmp_path, tensorboard=False, enabled=False, wandb_project="moe").close()  # not the main rank
    assert fake.calls == []
    step, stop_at = loop.train_step, random.randint(0, 1)  # a failed run (Ctrl-C, a crash) ends its W&B run as failed
    monkeypatch.setattr(loop, "train_step", lambda run, i, stop: step(run, i, stop) if i < stop_at else exec("raise KeyboardInterrupt"))
    with pytest.raises(KeyboardInterrupt):
        loop.train(tiny_config(dataset_dir, steps=2, wandb_project="moe"), tmp_path / "failed", echo=False)
    assert fake.calls[-1] == ("finish", 1), fake.calls


def test_wandb_missing_is_refused_before_training(tmp_path, dataset_dir, capsys):
    path = write_run_file(tmp_path / "tiny.py", dataset_dir)
    with mock.patch.dict(sys.modules, {"wandb": None}):  # None: not importable, whatever is installed
        _, err = cli(["train", path, "--out", tmp_path / "run", "--set", "train.wandb_project=moe"], capsys, code=2)
    one_line_error(err, "train.wandb_project", "pip install wandb")
    assert not (tmp_path / "run").exists()


def test_tensorboard_scalars(tmp_path, dataset_dir, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    history = loop.train(tiny_config(dataset_dir, steps=2, tensorboard=True), tmp_path / "run", echo=False)
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard")).Reload()
    assert [e.value for e in events.Scalars("train/loss")] == pytest.approx([m["loss"] for m in history])
    hook = threading.excepthook  # a second run in this process wraps it no further
    loop.train(tiny_config(dataset_dir, steps=1, tensorboard=True), tmp_path / "again", echo=False)
    assert threading.excepthook is hook
    step, stop_at = loop.train_step, random.randint(0, 1)  # a failed call (Ctrl-C in a notebook) ends its writer thread too
    monkeypatch.setattr(loop, "train_step", lambda run, i, stop: step(run, i, stop) if i < stop_at else exec("raise KeyboardInterrupt"))
    with pytest.raises(KeyboardInterrupt):
        loop.train(tiny_config(dataset_dir, steps=2, tensorboard=True), tmp_path / "stopped", echo=False)
    assert not [t for t in threading.enumerate() if type(t).__module__.startswith("tensorboard")]
    monkeypatch.setattr(loop, "train_step", step)
    # a full disk under its writer thread: one error naming the directory, no thread traceback
    from tensorboard.summary.writer.record_writer import RecordWriter

    monkeypatch.setattr(RecordWriter, "write", lambda *a: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space left on device")))
    monkeypatch.setattr(threading, "excepthook", lambda args: seen.append(args.exc_value))
    seen = []
    with pytest.raises(UserError, match=f"writing {tmp_path}/full/tensorboard failed: No space left on device .*tensorboard=false"):
        loop.train(tiny_config(dataset_dir, steps=2, tensorboard=True), tmp_path / "full", echo=False)
    assert seen == []


def test_plot(tmp_path, run, capsys, monkeypatch):
    other = tmp_path / "other"
    other.mkdir()
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    (other / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows + [{"step": 2, "eval_loss": 3.9}]))
    out, _ = cli(["plot", run, other / "metrics.jsonl", "--out", tmp_path / "both.png"], capsys)
    assert out == f"wrote {tmp_path / 'both.png'}\n" and (tmp_path / "both.png").read_bytes()[:4] == b"\x89PNG"
    cli(["plot", other], capsys)
    assert (other / "metrics.png").stat().st_size > 0
    (other / "metrics.jsonl").write_text('{"step": 2, "eval_loss": 3.9}\n')  # eval rows alone: still in the legend
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # matplotlib's 'No artists with labels found to put in legend'
        cli(["plot", other, "--out", tmp_path / "eval.png"], capsys)
    import matplotlib.pyplot as plt

    figures = []
    monkeypatch.setattr(plt, "close", figures.append)  # the figure drawn, kept to look at
    (other / "metrics.jsonl").write_text(json.dumps(rows[0]) + "\n")  # a run of one step: a line of one point shows nothing
    cli(["plot", other, "--out", tmp_path / "one.png"], capsys)
    assert all(line.get_marker() not in (None, "None", "") for ax in figures[-1].axes for line in ax.get_lines())


def test_plot_errors(tmp_path, run, capsys):
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "metrics.jsonl").write_text("not json\n")
    for args, names in (([tmp_path], "no metrics.jsonl"), ([tmp_path / "bad"], "metrics.jsonl"),
                        ([run, "--out", tmp_path / "none" / "x.png"], "none does not exist"), ([run, f"{run}/../{run.name}"], "is named twice")):
        _, err = cli(["plot", *args], capsys, code=2)
        one_line_error(err, names, str(args[0] if len(args) == 1 else args[-1]))
    with mock.patch.dict(sys.modules, {"matplotlib": None}):
        _, err = cli(["plot", run, "--out", tmp_path / "x.png"], capsys, code=2)
    one_line_error(err, "pip install matplotlib")
    assert not (tmp_path / "x.png").exists() and not (tmp_path / "none").exists()  # nothing drawn, nothing made
