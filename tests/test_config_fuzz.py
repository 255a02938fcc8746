"""The config surface under generated bad values: every field of every run config section (read from
the dataclasses, so a new field is covered the day it is added) takes a handful of values of the wrong
type, negative, zero, non-finite, empty and huge. Each ends in a one-line error naming the field, or is
valid by the allow-list below, with its reason. Checked in this process (`validate` and the pre-flight
`check_run` that `train` and `--dry-run` run); a few pairs go through the CLI to show it prints the one
line with exit code 2."""

import dataclasses
import math
import os
import subprocess
import sys
import types
import typing

import pytest

from cli_util import ROOT, cli, one_line_error
from conftest import tiny_config, write_run_file
from pithtrain.config import SECTIONS, UserError, validate
from pithtrain.train.loop import check_run

HUGE_INT, HUGE_FLOAT, LONG = 10**18, 1e300, "x" * 5000


def bad_values(hint) -> dict[str, object]:
    """{label: value} for a field annotated `hint`."""
    if hint is bool:
        return {"wrong type": 1, "wrong type str": "yes", "empty": None}
    if hint is int:
        return {"wrong type": "7", "wrong type float": 1.5, "wrong type bool": True, "negative": -1, "zero": 0,
                "non-finite": math.inf, "huge": HUGE_INT}
    if hint is float:
        return {"wrong type": "0.1", "negative": -1.0, "zero": 0.0, "non-finite nan": math.nan, "non-finite inf": math.inf,
                "huge": HUGE_FLOAT}
    if hint is str:
        return {"wrong type": 3, "empty": "", "huge": LONG, "blank": " "}
    if set(typing.get_args(hint)) == {str, dict, list}:  # data.path: one dataset, or a blend ({path: weight}, Megatron's list)
        return {"wrong type": 3, "empty": "", "huge": LONG, "blank": " ", "empty blend": {}, "negative": {"x": -1.0},
                "wrong item type": [0.5]}
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in typing.get_args(hint):
        inner = [a for a in typing.get_args(hint) if a is not type(None)]  # T | None: T's bad values (None is valid)
        return bad_values(inner[0]) if len(inner) == 1 else {"wrong type": object()}
    if hint is dict:
        return {"wrong type": "yarn", "wrong item type": {"type": 3}}
    if typing.get_origin(hint) is list and typing.get_args(hint) == (int,):  # layer ids (model.mlp_only_layers)
        return {"wrong type": "1", "wrong item type": ["a"], "negative": [-1], "huge": [10**6]}
    if typing.get_origin(hint) is list:
        return {"wrong type": "lm_head.*", "wrong item type": [1], "empty": [], "huge": ["*"] * 10000}
    raise AssertionError(f"no generator for {hint}: add one")


# (field, label) -> why the value is valid. Anything not here must be refused in one line naming the field.
VALID = {
    **{(f"optim.{name}", "zero"): "0 is in the documented range" for name in (
        "min_lr_ratio", "warmup_steps", "weight_decay", "beta1", "beta2", "grad_clip", "momentum")},
    **{(f"train.{name}", "zero"): "0 turns it off (documented)" for name in (
        "seed", "lb_coef", "eval_every", "checkpoint_every", "profile_step", "mtp_coef")},
    ("data.seed", "zero"): "a seed", ("data.eval_samples", "zero"): "0: no hold-out (the default)",
    ("train.checkpoint_every", "negative"): "-1: never (documented)",
    ("data.seed", "huge"): "any non-negative seed (numpy's generator takes big integers)",
    ("optim.warmup_steps", "huge"): "a warmup longer than the run: warned (ignored_options)",
    ("optim.weight_decay", "huge"): "a (useless) strength, not an error",
    ("optim.grad_clip", "huge"): "no clipping in practice",
    ("optim.eps", "huge"): "a (useless) epsilon, not an error",
    ("train.lb_coef", "huge"): "a (useless) strength: the loss diverges and the non-finite check stops the run",
    ("train.mtp_coef", "huge"): "a (useless) weight; without MTP layers it has no effect",
    ("optim.lr", "huge"): "the loss diverges: the non-finite check names optim.lr at that step",
    ("train.log_every", "huge"): "only the first 3 and the last steps printed",
    ("train.checkpoint_every", "huge"): "only the final checkpoint",
    ("train.keep_checkpoints", "huge"): "keep them all",
    ("parallel.timeout_s", "huge"): None,  # refused (more than a year): listed to say it was considered
    ("train.steps", "huge"): "a long run (stop it; it resumes)",
    ("data.eval_path", "empty"): "'' = hold out of data.path (documented)",
    ("train.init_from", "empty"): "'' = off (documented)",
    ("train.wandb_project", "empty"): "'' = off (documented)",
    ("train.wandb_project", "huge"): "wandb's own limit; WANDB_MODE=offline in this test",
    ("train.wandb_project", "blank"): "a project name; wandb decides",
    ("optim.muon_exclude", "empty"): "no exclusion (every matrix on Muon; optim.name=adamw ignores it)",
    ("optim.muon_exclude", "huge"): "patterns, repeated",
}
VALID = {k: v for k, v in VALID.items() if v}


def fields():
    for section, cls in SECTIONS:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            yield section, f.name, hints[f.name]


@pytest.fixture(autouse=True)
def offline_wandb(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")


def outcome(dataset_dir, tmp_path, section, name, value) -> str | None:
    """None when the config passes; else the error line (any other exception fails the test: a traceback, or
    an OSError whose line names a file, not the field)."""
    config = tiny_config(dataset_dir)
    setattr(getattr(config, section), name, value)
    try:
        validate(config)
        check_run(config, tmp_path / "run", create=False)
    except (UserError, ValueError) as e:  # the CLI's one line (cli._main): a UserError, or a ValueError from below
        return str(e)
    return None


def test_every_field_refuses_generated_bad_values_in_one_line(dataset_dir, tmp_path):
    tried = refused = 0
    unexpected, accepted = [], set()
    for section, name, hint in fields():
        for label, value in bad_values(hint).items():
            key = (f"{section}.{name}", label.split()[0] if label.split()[0] in ("zero", "negative", "empty", "huge") else label)
            tried += 1
            try:
                line = outcome(dataset_dir, tmp_path, section, name, value)
            except Exception as e:  # anything but a UserError is a traceback in the CLI
                unexpected.append(f"{key}: {type(e).__name__}: {e}"[:300])
                continue
            if line is None:
                accepted.add(key)
                if key not in VALID:
                    unexpected.append(f"{key} = {str(value)[:40]!r}: accepted, not in VALID")
                continue
            refused += 1
            if "\n" in line or f"{section}.{name}" not in line:
                unexpected.append(f"{key}: the error does not name the field in one line: {line[:300]}")
            if key in VALID:
                unexpected.append(f"{key}: listed as valid but refused ({line[:200]})")
    print(f"config fuzz: {tried} (field, value) pairs tried, {refused} refused in one line naming the field, "
          f"{tried - refused} valid by the allow-list")
    assert not unexpected, "\n".join(unexpected)
    assert accepted == set(VALID), f"VALID lists pairs no longer tried or accepted: {set(VALID) - accepted}"
    assert tried >= 150 and refused >= 100


def test_the_cli_turns_bad_values_into_one_line(dataset_dir, tmp_path, capsys):
    """--set values in this process, and one launch of `python -m pithtrain`: exit code 2, one line."""
    config = write_run_file(tmp_path / "tiny.py", dataset_dir)
    for assignment, name in (("optim.lr=nan", "optim.lr"), ("train.steps=-3", "train.steps"),
                             ("parallel.timeout_s=1e300", "parallel.timeout_s"), ("data.seq_len=0", "data.seq_len"),
                             ('optim.muon_exclude=[1]', "optim.muon_exclude")):
        _, err = cli(["train", config, "--dry-run", "--out", tmp_path / "run", "--set", assignment], capsys, code=2)
        one_line_error(err, name)
    result = subprocess.run([sys.executable, "-m", "pithtrain", "train", config, "--dry-run", "--out", tmp_path / "run",
                             "--set", "train.micro_batch_size=0"], cwd=ROOT, capture_output=True, text=True,
                            env=dict(os.environ, PYTHONPATH=ROOT))
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    one_line_error(result.stderr, "train.micro_batch_size")


# (model field, label) -> why the value is valid, for every family (tiny configs of tests/conftest.py)
VALID_MODEL = {
    **{(name, "zero"): "0 is documented as off / none" for name in (
        "first_k_dense_replace", "n_routed_experts", "n_shared_experts", "num_experts", "num_nextn_predict_layers",
        "bias_update_speed", "n_group", "topk_group", "bos_token_id", "eos_token_id", "pad_token_id")},
    **{(name, "huge"): "a (useless) value, not an inconsistent one: training runs" for name in (
        "bias_update_speed", "rms_norm_eps", "rope_theta", "routed_scaling_factor", "swiglu_alpha", "swiglu_limit")},
}


def test_every_model_field_of_every_family_refuses_bad_values_in_one_line(dataset_dir, tmp_path):
    """The model section, per family: every field of each family's config under the generated values;
    refused in one line naming model.<field>, or valid by VALID_MODEL. Sizes past any real model
    (2**31, more than 1e13 parameters, 1024 layers) are refused before a tensor is allocated."""
    from conftest import tiny_deepseek_config, tiny_deepseek_v3_config, tiny_gpt_oss_config, tiny_qwen3_5_config

    tried = refused = 0
    unexpected, accepted = [], set()
    for make in (tiny_config, tiny_deepseek_config, tiny_deepseek_v3_config, tiny_gpt_oss_config, tiny_qwen3_5_config):
        model = make(dataset_dir).model
        hints = typing.get_type_hints(type(model))
        for f in dataclasses.fields(model):
            for label, value in bad_values(hints[f.name]).items():
                key = (f.name, label.split()[0] if label.split()[0] in ("zero", "negative", "empty", "huge") else label)
                config = make(dataset_dir)
                setattr(config.model, f.name, value)
                tried += 1
                try:
                    validate(config)
                    check_run(config, tmp_path / "run", create=False)
                except (UserError, ValueError) as e:
                    refused += 1
                    if "\n" in str(e) or f"model.{f.name}" not in str(e) and "size field" not in str(e):
                        unexpected.append(f"{type(model).__name__} {key}: {str(e)[:200]}")
                    continue
                except Exception as e:
                    unexpected.append(f"{type(model).__name__} {key}: {type(e).__name__}: {str(e)[:200]}")
                    continue
                accepted.add(key)
                if key not in VALID_MODEL:
                    unexpected.append(f"{type(model).__name__} {key} = {str(value)[:40]!r}: accepted, not in VALID_MODEL")
    print(f"model fuzz: {tried} (family, field, value) triples tried, {refused} refused in one line")
    assert not unexpected, "\n".join(unexpected)
    assert accepted == set(VALID_MODEL), f"VALID_MODEL lists pairs no longer accepted: {set(VALID_MODEL) - accepted}"
    assert tried >= 500
