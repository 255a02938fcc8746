"""Going on from where a run or an export left off: continued pretraining from our own HF export
(`train.init_from` with the example config as it is), `--dry-run` printing the real run's warnings and
sizes, W&B and TensorBoard continuing across a resume, and eval at the training sequence length."""

import json
import os
import re
import shutil
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch

from cli_util import ROOT, cli, one_line_error, write_config
from conftest import markov_docs
from pithtrain.tools.tokenize import train_bpe
from pithtrain.train.data import BatchLoader, TokenDataset, write_dataset
from pithtrain.train.metrics import read_metrics

EXAMPLE = "examples/qwen3_tiny.py"


def test_init_from_our_export_continues_from_its_loss(tmp_path, dataset_dir, capsys):
    """Train the example, export it to HF (which sets bos/eos ids the example leaves None), and start a
    new run of the unchanged example from the export: its first step's loss is the export's eval loss
    on that step's batch, on one process and on pp2. A run whose architecture differs is refused naming the field and both values,
    by --dry-run too; eval reads rows of the run's data.seq_len unless --seq-len says otherwise."""
    data = f"data.path={dataset_dir}"
    # another seed than the example's: the new run's own initial weights are not the export's
    cli(["train", EXAMPLE, "--out", tmp_path / "a", "--steps", "2", "--set", data, "--set", "train.seed=7"], capsys)
    out, err = cli(["convert", tmp_path / "a", tmp_path / "hf"], capsys)
    assert f"the weights of step 2 ({tmp_path / 'a' / 'checkpoints' / 'step_00000002'})" in out, out + err
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["eos_token_id"] == 0  # the example has None

    init = ["--set", data, "--set", f"train.init_from={tmp_path / 'hf'}"]
    dry, _ = cli(["train", EXAMPLE, "--out", tmp_path / "b", "--steps", "1", "--dry-run", *init], capsys)
    out, _ = cli(["train", EXAMPLE, "--out", tmp_path / "b", "--steps", "1", *init], capsys)
    said = f"init_from: the weights of {tmp_path / 'hf'} (the run keeps its own bos_token_id, eos_token_id)"
    assert said in dry and said in out, dry
    first = read_metrics(tmp_path / "b" / "metrics.jsonl")[0]
    # a DualPipeV run loads the same weights: each rank's chunks take their layers of the export
    cli(["train", EXAMPLE, "--out", tmp_path / "pp", "--steps", "1", "--nproc", "2", "--pp", "2", "--set",
         "train.micro_batch_size=4", *init], capsys)
    assert read_metrics(tmp_path / "pp" / "metrics.jsonl")[0]["loss"] == pytest.approx(first["loss"], rel=1e-6)

    batch = BatchLoader(TokenDataset(dataset_dir), 128, 16, 1234).global_batch(0)  # the example's seq_len, batch, seed
    np.save(tmp_path / "batch.npy", torch.cat([batch["input_ids"], batch["labels"][:, -1:]], 1).numpy())
    out, _ = cli(["eval", tmp_path / "hf", "--tokens", tmp_path / "batch.npy", "--json"], capsys)
    assert json.loads(out)["loss"] == pytest.approx(first["loss"], abs=1e-5)
    cli(["train", EXAMPLE, "--out", tmp_path / "fresh", "--steps", "1", "--set", data], capsys)
    assert abs(read_metrics(tmp_path / "fresh" / "metrics.jsonl")[0]["loss"] - first["loss"]) > 1e-3  # weights were loaded

    for dry_run in ([], ["--dry-run"]):
        _, err = cli(["train", EXAMPLE, "--out", tmp_path / "c", *init, "--set", "model.hidden_size=64", *dry_run],
                     capsys, code=2)
        one_line_error(err, "train.init_from", "model.hidden_size (128 there, 64 in the run)")
        assert "eos_token_id" not in err and not (tmp_path / "c").exists()

    # data whose tokenizer gives the export's tokens other ids is refused (the weights would read other tokens)
    for name, text in (("tok_a", "alpha beta"), ("tok_b", "gamma delta")):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a tiny corpus fills few of the 300 tokens
            train_bpe([text] * 20, 300, str(tmp_path / name / "tokenizer.json"))
        write_dataset(tmp_path / f"data_{name}", markov_docs(np.random.default_rng(7), 64, 400), 300, 0,
                      tokenizer_file=str(tmp_path / name / "tokenizer.json"))
    shutil.copyfile(tmp_path / "tok_a" / "tokenizer.json", tmp_path / "hf" / "tokenizer.json")
    dry = ["train", EXAMPLE, "--out", tmp_path / "c", "--dry-run", *init, "--set"]
    _, err = cli([*dry, f"data.path={tmp_path / 'data_tok_b'}"], capsys, code=2)
    one_line_error(err, "train.init_from", "other ids", f"--tokenizer {tmp_path / 'hf' / 'tokenizer.json'}")
    cli([*dry, f"data.path={tmp_path / 'data_tok_a'}"], capsys)
    out, _ = cli(["train", EXAMPLE, "--out", tmp_path / "c", "--dry-run", "--set", f"data.path={tmp_path / 'data_tok_a'}",
                  "--set", "model.vocab_size=100"], capsys)  # its ids fit, its tokenizer's 300 do not: said
    assert "warning: model.vocab_size=100 is below the 300 tokens of" in out and "set model.vocab_size=300 or more" in out
    cli(["convert", tmp_path / "hf", tmp_path / "ck"], capsys)  # a checkpoint of the export keeps its tokenizer: checked too
    _, err = cli([*dry, f"data.path={tmp_path / 'data_tok_b'}", "--set", f"train.init_from={tmp_path / 'ck'}"], capsys, code=2)
    one_line_error(err, f"train.init_from={tmp_path / 'ck'}", "other ids")

    # eval of a dataset directory: rows of the run's data.seq_len (128), from the run, its export or --seq-len
    for source, why in ((tmp_path / "a", "data.seq_len of the run"), (tmp_path / "hf", "seq_length of")):
        out, _ = cli(["eval", source, "--tokens", dataset_dir, "--max-tokens", "1280"], capsys)
        assert "in rows of 128 predicted tokens" in out and why in out, out
    out, _ = cli(["eval", tmp_path / "hf", "--tokens", dataset_dir, "--seq-len", "20", "--max-tokens", "200", "--json"], capsys)
    assert json.loads(out)["seq_len"] == 20


@pytest.mark.fast
def test_init_from_ignores_only_fields_that_do_not_change_the_computation(tmp_path, dataset_dir):
    """Every family's tiny config against itself through an HF export (to_hf -> from_hf) with other token
    ids and init scale: accepted; one changed shape or routing field each: refused, naming it."""
    from safetensors.torch import save_file

    from conftest import tiny_config, tiny_deepseek_v3_config, tiny_gpt_oss_config, tiny_qwen3_5_config
    from pithtrain.config import UserError
    from pithtrain.train.loop import check_init_from

    changes = {tiny_config: ("num_experts_per_tok", 1), tiny_deepseek_v3_config: ("routed_scaling_factor", 1.0),
               tiny_gpt_oss_config: ("sliding_window", 4), tiny_qwen3_5_config: ("linear_conv_kernel_dim", 2)}
    for family, (field, value) in changes.items():
        config = family(dataset_dir)
        hf = dict(config.model.to_hf(), eos_token_id=3, bos_token_id=2, initializer_range=0.5, max_position_embeddings=4096)
        (tmp_path / "hf").mkdir(exist_ok=True)
        (tmp_path / "hf" / "config.json").write_text(json.dumps(hf))
        m = config.model  # check_init_from reads config.json and the weights' names (the MTP layers they hold)
        save_file({f"model.layers.{m.num_hidden_layers + k}.eh_proj.weight": torch.zeros(1)
                   for k in range(m.num_nextn_predict_layers)} or {"lm_head.weight": torch.zeros(1)},
                  str(tmp_path / "hf" / "model.safetensors"))
        config.train.init_from = str(tmp_path / "hf")
        check_init_from(config, echo=False)
        setattr(config.model, field, value)
        with pytest.raises(UserError, match=rf"model\.{field} \(.* there, {value!r} in the run\)"):
            check_init_from(config, echo=False)


def test_dry_run_under_another_launcher_prints_on_rank_0_alone(tmp_path, dataset_dir, capsys, monkeypatch):
    """`torchrun ... --print-config > run.json` is one JSON document, not one a rank (each rank still checks)."""
    config = write_config(tmp_path / "tiny.py", dataset_dir, steps=2)
    monkeypatch.setenv("WORLD_SIZE", "2")
    for rank, flag in (("1", "--print-config"), ("1", "--dry-run"), ("0", "--print-config")):
        monkeypatch.setenv("RANK", rank)
        out, _ = cli(["train", config, "--out", tmp_path / "run", flag], capsys)
        assert bool(out) == (rank == "0"), out


def test_dry_run_warns_as_the_run_does_and_logs_continue_across_a_resume(tmp_path, dataset_dir, capsys, monkeypatch):
    """A fresh --dry-run prints the startup line's sizes; a run with W&B (offline) and TensorBoard; its
    newest checkpoint damaged: --dry-run prints the same warning and fallback as the resumed run then
    does. The resume re-runs steps 3-4: metrics.jsonl and TensorBoard hold each step once (the
    resumed values), and both attempts log to one W&B run."""
    pytest.importorskip("wandb")  # in the test extra: CI has it
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")

    def train(*args):  # in a child process: wandb's service and threads must not outlive it in this one (a
        # later forked gloo test inherits them and can hang)
        done = subprocess.run([sys.executable, "-m", "pithtrain", "train", *map(str, args)], capture_output=True,
                              text=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout
    config = write_config(tmp_path / "tiny.py", dataset_dir, steps=4, checkpoint_every=2, tensorboard=True,
                          wandb_project="moe")
    run = tmp_path / "run"
    dry, _ = cli(["train", config, "--out", run, "--dry-run"], capsys)
    lost, _ = cli(["train", config, "--out", run, "--dry-run", "--stop-after", "2", "--set", "train.checkpoint_every=-1",
                   "--set", "optim.allow_switch=true"], capsys)
    assert "warning: --stop-after 2 with train.checkpoint_every=-1 writes no checkpoint" in lost and "--stop-after" not in dry
    assert f"warning: optim.allow_switch has no effect: {run} holds no checkpoint" in lost and "no effect" not in dry
    out = train(config, "--out", run)
    total, sizes = re.search(r"^(model qwen3_moe: [\d,]+ parameters) \| (.*steps per epoch [\d.]+)$", dry, re.M).groups()
    banner = next(line for line in out.splitlines() if line.startswith("model "))
    assert banner.startswith(f"{total} |") and banner.endswith(f" | {sizes}"), (dry, banner)
    assert "parameters active per token" in sizes and "256 tokens per step" in sizes
    assert re.search(r"^estimated peak memory per GPU .*: \d+ MiB$", dry, re.M), dry

    with open(next((run / "checkpoints" / "step_00000004").glob("*.distcp")), "r+b") as f:
        f.seek(100)
        f.write(b"\xff" * 8)  # a damaged newest checkpoint: the run falls back to step 2 and logs steps 3-4 again
    dry, _ = cli(["train", config, "--out", run, "--dry-run", "--steps", "5"], capsys)
    out = train(config, "--out", run, "--steps", "5")
    warnings = [line for line in dry.splitlines() if line.startswith("warning: ")]
    assert len(warnings) == 2 and "step_00000004 is damaged" in warnings[0] and "falling back to step_00000002" in warnings[0]
    assert "train.steps 4 -> 5" in warnings[1] and all(w in out.splitlines() for w in warnings)
    assert f"would resume from {run / 'checkpoints' / 'step_00000002'}" in dry
    assert "done: step 5 of 5 (3 after resuming at step 2)" in out

    metrics = read_metrics(run / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    losses = EventAccumulator(str(run / "tensorboard")).Reload().Scalars("train/loss")
    assert [e.step for e in losses] == [1, 2, 3, 4, 5]
    assert [e.value for e in losses] == pytest.approx([m["loss"] for m in metrics], rel=1e-6)
    assert len(list((run / "tensorboard").glob("events.*"))) == 2  # the first attempt's steps 3-4 are in the files, purged

    run_id = (run / "wandb_id").read_text().strip()
    offline = sorted(p.name for p in (run / "wandb").glob("offline-run-*"))
    assert len(offline) == 2 and all(name.endswith(f"-{run_id}") for name in offline), offline
