"""Seeing a run: the effective config (printed, OUT/run_config.json, --print-config, --dry-run, the
config fields in `train --help`)."""

import dataclasses
import json

import pytest

from cli_util import cli, one_line_error
from conftest import tiny_config, write_run_file
from pithtrain.config import SECTIONS, field_help, load_run_config, run_dict
from pithtrain.train import loop


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
            assert f"= {f.default!r}" in line and meaning[f.name][:30] in out, line
    assert "train.fp8: str = 'off'" in out and "compute capability 8.9+" in out  # a comment block above the field
    for family in ("qwen3_moe (Qwen3MoeConfig)", "deepseek_v2 (DeepseekV2Config)", "gpt_oss (GptOssConfig)"):
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
