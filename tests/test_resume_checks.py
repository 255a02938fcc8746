"""Resume against a changed config, token ids outside the vocabulary, and HF weights of the wrong shape:
each case a run of the CLI (in-process `cli.main`) on the CPU with a tiny Qwen3-MoE (HF shapes: every family)."""

import io
import json
import os
import shutil
from contextlib import redirect_stderr, redirect_stdout

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import (markov_docs, tiny_config, tiny_deepseek_config, tiny_deepseek_v3_config, tiny_gpt_oss_config,
                      tiny_qwen3_5_config, write_run_file)
from pithtrain.cli import main
from pithtrain.config import MUON_EXCLUDE, UserError, load_run_config, run_dict
from pithtrain.train import checkpoint as ckpt
from pithtrain.train import loop
from pithtrain.train.data import TokenDataset, write_dataset
from pithtrain.train.loop import check_resume
from pithtrain.train.metrics import read_metrics

pytestmark = pytest.mark.fast  # the fast tier (make test-fast)


def cli(*args) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `pithtrain ARGS`."""
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err), pytest.raises(SystemExit) as exit_info:
        main([str(a) for a in args])
    return exit_info.value.code, out.getvalue(), err.getvalue()


def refused(code, err, *names):
    lines = err.strip().splitlines()
    return code == 2 and len(lines) == 1 and all(name in lines[0] for name in names) and "Traceback" not in err


@pytest.fixture(scope="module")
def run(tmp_path_factory, dataset_dir):
    """A run of the tiny config (train.steps=2, lr 3e-3 cosine) stopped after step 1."""
    tmp = tmp_path_factory.mktemp("resume")
    config = write_run_file(tmp / "tiny.py", dataset_dir)
    code, _, err = cli("train", config, "--out", tmp / "run", "--stop-after", "1")
    assert code == 0, err
    return tmp, config, tmp / "run"


def other_dataset(path):
    """A dataset of the tiny vocabulary with other documents than conftest's dataset_dir."""
    write_dataset(path, markov_docs(np.random.default_rng(8), 64, 400), vocab_size=64, eos_id=0)
    return path


def test_changed_model_data_order_or_batch_is_refused(run):
    tmp, config, out = run
    moved = other_dataset(tmp / "other_data")
    for sets, names in [
        (["model.moe_intermediate_size=32", "data.seed=7"], ["model.moe_intermediate_size 16 -> 32", "data.seed 1234 -> 7"]),
        (["train.global_batch_size=16"], ["train.global_batch_size 8 -> 16"]),
        (["data.seq_len=16"], ["data.seq_len 32 -> 16"]),
        ([f"data.path={moved}"], ["data.path", "other_data"]),
        (["data.eval_samples=8"], ["data.eval_samples held out of data.path 0 -> 8"]),  # the training order changes
    ]:
        args = [a for s in sets for a in ("--set", s)]
        code, _, err = cli("train", config, "--out", out, *args)
        assert refused(code, err, "cannot resume", *names, "new --out"), err
    assert [p.name for p in ckpt.list_checkpoints(out)] == ["step_00000001"]


def test_switching_the_optimizer_is_refused_unless_allowed(run, tmp_path, monkeypatch):
    """The checkpoint holds AdamW's moments: optim.name=muon is refused in one line naming the escape;
    with optim.allow_switch=true the run goes on (weights loaded, Muon's state fresh), with a warning."""
    _, config, out = run
    code, _, err = cli("train", config, "--out", out, "--set", "optim.name=muon")
    assert refused(code, err, "cannot resume", "adamw", "optim.name=muon", "optim.allow_switch=true"), err
    copy = shutil.copytree(out, tmp_path / "run")
    code, printed, err = cli("train", config, "--out", copy, "--set", "optim.name=muon", "--set", "optim.allow_switch=true")
    assert code == 0 and "optim.name 'adamw' -> 'muon'" in printed, err
    assert [m["step"] for m in read_metrics(copy / "metrics.jsonl")] == [1, 2]
    code, printed, err = cli("train", config, "--out", copy, "--steps", "3", "--set", "optim.name=muon")
    notes = [line for line in (printed + err).splitlines() if line.startswith(("warning:", "note:"))]
    assert code == 0 and not any("allow_switch" in line for line in notes), notes  # a permission, not a setting
    assert [m["step"] for m in read_metrics(copy / "metrics.jsonl")] == [1, 2, 3]
    loads, real = [], ckpt.load_training_state  # with_optim of each: a muon_exclude change moving no weight keeps the state
    monkeypatch.setattr(ckpt, "load_training_state", lambda *a, with_optim=True: loads.append(with_optim)
                        or real(*a, with_optim=with_optim))
    same = [p for p in MUON_EXCLUDE if p != "*bias"]  # 1-D: never Muon's
    code, printed, err = cli("train", config, "--out", copy, "--steps", "4", "--set", "optim.name=muon",
                             "--set", f"optim.muon_exclude={json.dumps(same)}")
    assert code == 0 and loads == [True] and "optim.muon_exclude" in printed, err
    exclude = ("--set", 'optim.muon_exclude=["*norm*"]')  # the head and embedding join Muon: its state has no moments for them
    code, _, err = cli("train", config, "--out", copy, "--steps", "5", "--set", "optim.name=muon", *exclude)
    assert refused(code, err, "cannot resume", "optim.muon_exclude", "optim.allow_switch=true"), err
    code, _, err = cli("train", config, "--out", copy, "--steps", "5", "--set", "optim.name=muon", *exclude,
                       "--set", "optim.allow_switch=true")
    assert code == 0 and [m["step"] for m in read_metrics(copy / "metrics.jsonl")] == [1, 2, 3, 4, 5], err
    assert loads == [True, False], loads


def test_lr_schedule_and_steps_change_with_a_warning_then_fewer_steps_are_refused(run):
    tmp, config, out = run
    code, printed, err = cli("train", config, "--out", out, "--steps", "3", "--set", "optim.lr=1e-3",
                             "--set", "optim.schedule=constant", "--set", "train.log_every=2")
    assert code == 0, err
    warning = next(line for line in printed.splitlines() if line.startswith("warning:"))
    for change in ("optim.lr 0.003 -> 0.001", "optim.schedule 'cosine' -> 'constant'", "train.steps 2 -> 3"):
        assert change in warning
    assert "train.log_every 1 -> 2" in next(line for line in printed.splitlines() if line.startswith("note:"))
    assert [(m["step"], m["lr"]) for m in read_metrics(out / "metrics.jsonl")][1:] == [(2, 1e-3), (3, 1e-3)]

    code, _, err = cli("train", config, "--out", out, "--steps", "2")
    assert refused(code, err, "already at step 3", "train.steps=2"), err
    code, _, err = cli("train", config, "--out", out, "--steps", "5", "--stop-after", "2")
    assert refused(code, err, "already at step 3", "--stop-after=2"), err
    code, printed, err = cli("train", config, "--out", out, "--steps", "3", "--set", "optim.lr=1e-3",
                             "--set", "optim.schedule=constant")
    assert code == 0 and "nothing to do" in printed, err


def test_a_moved_dataset_resumes_where_it_stopped(run, tmp_path, dataset_dir, capsys):
    """A blend whose first dataset moved (its tokenizer and content SHA-256, the weights and order as recorded): one
    note, and the run goes on with the losses it had where the data stayed (one dataset moved: the note too). Another
    dataset there, another order or weights, or a checkpoint without each dataset's identity (older runs): refused
    as a changed data.path."""
    a, other = shutil.copytree(dataset_dir, tmp_path / "a"), other_dataset(tmp_path / "other")
    config = write_run_file(tmp_path / "blend.py", a, f"CONFIG.data.path = {{{str(a)!r}: 1.0, {str(other)!r}: 1.0}}\n")
    out = tmp_path / "run"
    assert cli("train", config, "--out", out, "--set", "train.checkpoint_every=1")[0] == 0
    stayed = [(m["step"], m["loss"], m["grad_norm"]) for m in read_metrics(out / "metrics.jsonl")]
    shutil.rmtree(out / "checkpoints/step_00000002")  # resumed from step 1
    b = a.rename(tmp_path / "b")
    code, printed, err = cli("train", config, "--out", out, "--set", "train.checkpoint_every=1",
                             "--set", f"data.path={json.dumps({str(b): 1, str(other): 1})}")
    assert code == 0 and [line for line in printed.splitlines() if line.startswith(("note:", "warning:"))] == [
        f"note: data.path moved: {a} -> {b}; the same data as {out}/checkpoints/step_00000001 recorded (tokenizer "
        "and content SHA-256, weights, order): the run goes on with it"], err
    assert [(m["step"], m["loss"], m["grad_norm"]) for m in read_metrics(out / "metrics.jsonl")] == stayed

    def check(checkpoint, *parts, echo=False):
        cfg = load_run_config(config)
        cfg.data.path, cfg.train.steps = {str(p): w for p, w in parts} if len(parts) > 1 else str(parts[0][0]), 10
        check_resume(cfg, checkpoint, echo=echo, datasets=[TokenDataset(p) for p, _ in parts])

    step2, c = ckpt.list_checkpoints(out)[-1], shutil.copytree(b, tmp_path / "c")
    check(step2, (c, 1.0), (other, 1.0))
    meta = json.loads((step2 / "meta.json").read_text())
    (tmp_path / "old").mkdir()
    (tmp_path / "old/meta.json").write_text(json.dumps({k: v for k, v in meta.items() if k != "datasets"}))
    d = shutil.copytree(other, tmp_path / "d")
    for checkpoint, parts in [(step2, [(other, 1.0), (c, 1.0)]), (step2, [(c, 1.0), (other, 3.0)]),
                              (step2, [(d, 1.0), (other, 1.0)]), (tmp_path / "old", [(c, 1.0), (other, 1.0)])]:
        with pytest.raises(UserError, match="cannot resume from .*: data.path .* changed since it was written"):
            check(checkpoint, *parts)
    with pytest.raises(UserError) as e:
        check(step2, (d, 1.0))
    assert str(e.value) == (f"cannot resume from {step2}: data.path [[{str(b)!r}, 0.5], [{str(other)!r}, 0.5]] -> "
                            f"{str(d)!r} changed since it was written (a relative data.path resolves against the "
                            "working directory); undo the change (--set) or train into a new --out")
    e = shutil.copytree(c, tmp_path / "e")  # other tokens: meta.json and doc_offsets.npy alike
    TokenDataset(c).tokens[::-1].tofile(e / "tokens.bin")
    with pytest.raises(UserError, match="cannot resume from .*: data.path .* changed since it was written"):
        check(step2, (e, 1.0), (other, 1.0))
    (tmp_path / "older").mkdir()  # a checkpoint from before tokens.bin's sample was recorded: moves as before
    older = [{k: v for k, v in i.items() if k != "tokens_sample_sha256"} for i in meta["datasets"]]
    (tmp_path / "older/meta.json").write_text(json.dumps({**meta, "datasets": older}))
    check(tmp_path / "older", (c, 1.0), (other, 1.0))
    shutil.copy(e / "tokens.bin", b / "tokens.bin")
    with pytest.raises(UserError) as e:
        check(step2, (b, 1.0), (other, 1.0))
    assert f"the dataset at {b} changed since it was written (its tokenizer.json, meta.json, doc_offsets.npy or " \
           "tokens.bin differ)" in str(e.value)
    capsys.readouterr()
    check(ckpt.list_checkpoints(run[2])[-1], (c, 1.0), echo=True)  # one dataset: the run fixture's, copied
    assert capsys.readouterr().out.splitlines()[0].startswith(f"note: data.path moved: {dataset_dir} -> {c}; the same")


def test_a_bad_line_in_metrics_is_named_before_the_model_loads(run, tmp_path, monkeypatch):
    """metrics.jsonl is cut back to the checkpoint's step by its rows' "step": a line without one is named, with its
    number and the fix, before the model is built (and --dry-run says so too)."""
    _, config, out = run
    copy = shutil.copytree(out, tmp_path / "run")
    logged = (copy / "metrics.jsonl").read_text()
    monkeypatch.setattr(loop, "build_model", lambda *args: pytest.fail("the model was built"))
    for line, what in [('{"note": "mine"}', 'has no integer "step"'), ("[1, 2]", 'has no integer "step"'),
                       ("not json", "is not JSON (Expecting value)")]:
        (copy / "metrics.jsonl").write_text(logged + line + "\n")
        message = (f"error: {copy / 'metrics.jsonl'}: line {logged.count(chr(10)) + 1} {what}; remove that line "
                   "(or move it to another file), then resume")
        for dry in ([], ["--dry-run"]):
            code, _, err = cli("train", config, "--out", copy, "--steps", "10", *dry)
            assert refused(code, err, message), err


def test_mesh_compile_and_logging_may_change(run, tmp_path, capsys):
    _, config_file, out = run
    config = load_run_config(config_file)
    config.parallel.ep, config.parallel.pp, config.parallel.hsdp = 2, 2, True  # checkpoints reshard
    config.train.compile, config.train.checkpoint_every, config.train.micro_batch_size = True, 5, 2
    config.train.steps = 10
    config.train.eval_every, config.data.eval_path, config.data.eval_samples = 2, str(config.data.path), 8  # order kept
    checkpoint = ckpt.list_checkpoints(out)[-1]
    check_resume(config, checkpoint)  # lb_type=micro: the micro-batch is the balance loss's scope, a warning
    warning = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("warning: resuming"))
    assert "train.micro_batch_size" in warning and warning.endswith("(train.lb_type=micro: the load-balance loss is "
                                                                    "taken per micro-batch)"), warning
    config.train.lb_coef = 0.0  # no balance loss: a note (lb_coef's own change is the warning)
    check_resume(config, checkpoint)
    assert "train.micro_batch_size" in capsys.readouterr().out.split("note: also changed:")[1]
    config.train.lb_coef = 1e-3
    meta = json.loads((checkpoint / "meta.json").read_text())
    meta["config"]["train"]["fp8"] = True  # a field this version does not know (another branch, a newer run)
    (checkpoint / "meta.json").write_text(json.dumps(meta))
    check_resume(config, checkpoint, echo=False)
    config.train.profile_step = meta["config"]["train"]["profile_step"] = 1  # taken before the stop: the same resume command
    (checkpoint / "meta.json").write_text(json.dumps(meta))
    check_resume(config, checkpoint, echo=False)
    v3 = tiny_deepseek_v3_config(config.data.path)  # DeepSeek-V3 stops the routing-bias update for its last tokens
    (tmp_path / "meta.json").write_text(json.dumps({"step": 1, "config": run_dict(v3)}))
    v3.model.bias_update_speed = 0.0
    check_resume(v3, tmp_path, echo=False)
    hybrid = tiny_qwen3_5_config(config.data.path)  # layer_types None and the list it stands for: the same layers
    hybrid.model.layer_types, hybrid.model.full_attention_interval = ["linear_attention", "full_attention"] * 2, 2
    (tmp_path / "meta.json").write_text(json.dumps({"step": 1, "config": run_dict(hybrid)}))
    hybrid.model.layer_types = None
    check_resume(hybrid, tmp_path, echo=False)
    hybrid.model.full_attention_interval = 4  # other layers: refused
    with pytest.raises(UserError, match="model.full_attention_interval 2 -> 4"):
        check_resume(hybrid, tmp_path, echo=False)


def test_token_ids_outside_the_vocabulary_fail_before_step_one(tmp_path, dataset_dir):
    bad = shutil.copytree(dataset_dir, tmp_path / "bad")
    ids = np.memmap(bad / "tokens.bin", dtype=np.uint8, mode="r+")  # vocab 64: uint8 ids; meta.json unchanged
    ids[::16] = 64
    ids.flush()
    del ids
    config = write_run_file(tmp_path / "tiny.py", bad)
    code, _, err = cli("train", config, "--out", tmp_path / "r1")
    assert refused(code, err, "tokens.bin holds token id 64", "max_token_id is 63"), err
    config = write_run_file(tmp_path / "small.py", dataset_dir, "CONFIG.model.vocab_size = 32\n")
    code, _, err = cli("train", config, "--out", tmp_path / "r2")
    assert refused(code, err, "contains token id 63", "vocab_size is 32"), err

    # a tokenizer whose ids have gaps: the dataset's vocabulary is its largest id + 1, not its size
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({"<|endoftext|>": 0, "alpha": 1, "beta": 300}, unk_token="<|endoftext|>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "gaps.json"))
    (tmp_path / "corpus.txt").write_text("alpha beta " * 50)
    code, _, err = cli("tokenize", tmp_path / "corpus.txt", "--tokenizer", tmp_path / "gaps.json", "--out", tmp_path / "gaps")
    meta = json.loads((tmp_path / "gaps" / "meta.json").read_text())
    assert code == 0 and (meta["vocab_size"], meta["max_token_id"], meta["dtype"]) == (301, 300, "uint16"), err
    config = write_run_file(tmp_path / "gaps.py", tmp_path / "gaps", "CONFIG.data.seq_len = 8\n")
    code, _, err = cli("train", config, "--out", tmp_path / "r3")
    assert refused(code, err, "contains token id 300", "vocab_size is 64"), err


@pytest.mark.parametrize("family", [tiny_config, tiny_deepseek_config, tiny_gpt_oss_config])
def test_hf_weights_of_another_shape_are_named(tmp_path, family):
    from pithtrain.tools.hf import write_hf_dir

    model = family(tmp_path).model.build_model()
    model.init_weights(0)
    hf = write_hf_dir(model, tmp_path / "hf")
    state = load_file(str(hf / "model.safetensors"))
    np.save(tmp_path / "tokens.npy", np.zeros((1, 4), np.int64))
    expert = next(k for k in sorted(state) if ".experts." in k and "down_proj" in k and "bias" not in k)
    for key, bad in (("model.norm.weight", torch.ones(1)), (expert, state[expert].transpose(-1, -2).contiguous())):
        save_file(dict(state, **{key: bad}), str(hf / "model.safetensors"))
        code, _, err = cli("eval", hf, "--tokens", tmp_path / "tokens.npy")
        shapes = f"{key} has shape {tuple(bad.shape)}, the model expects {tuple(state[key].shape)}"
        assert refused(code, err, shapes), err


def test_a_damaged_newest_checkpoint_is_set_aside_and_the_good_ones_survive(tmp_path, dataset_dir):
    """Checkpoints at steps 2 and 4, step 4's file truncated: the rerun falls back to step 2, renames step 4
    STEP.damaged (kept, not counted), and pruning to one checkpoint keeps the step it just wrote, not the
    damaged one. A run ended by --stop-after says how to go on (without it); --dry-run verifies init_from."""
    config = write_run_file(tmp_path / "tiny.py", dataset_dir)
    out, every = tmp_path / "run", ("--set", "train.checkpoint_every=2")
    assert cli("train", config, "--out", out, "--steps", "4", *every)[0] == 0
    with open(next((out / "checkpoints/step_00000004").glob("*.distcp")), "r+b") as f:
        f.truncate(100)
    code, printed, err = cli("train", config, "--out", out, "--steps", "4", "--stop-after", "3", *every,
                             "--set", "train.keep_checkpoints=1")
    assert code == 0 and "falling back to step_00000002\nnote: moved it to step_00000004.damaged" in printed, err
    assert f"resume with: pithtrain train {config} --out {out} --steps 4 --set" in printed  # --stop-after dropped
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_00000003", "step_00000004.damaged"]
    assert ckpt.check_checkpoint(out / "checkpoints/step_00000003") is None
    code, printed, _ = cli("train", config, "--out", out, "--steps", "4", "--stop-after", "3", *every)
    assert code == 0 and "raise --stop-after" in printed
    code, _, err = cli("train", config, "--out", tmp_path / "new", "--dry-run",
                       "--set", f"train.init_from={out}/checkpoints/step_00000004.damaged")
    assert refused(code, err, "train.init_from=", "is damaged"), err
    assert cli("convert", out, tmp_path / "hf")[0] == 0  # an HF directory whose index names a shard that is not there
    (tmp_path / "hf/model.safetensors.index.json").write_text('{"weight_map": {"lm_head.weight": "model-2-of-2.safetensors"}}')
    code, _, err = cli("train", config, "--out", tmp_path / "new", "--dry-run", "--set", f"train.init_from={tmp_path / 'hf'}")
    assert refused(code, err, "model-2-of-2.safetensors, a shard its model.safetensors.index.json names, is missing"), err
    code, printed, err = cli("train", config, "--out", out, "--steps", "5", "--set", f"train.init_from={out}", *every)
    assert code == 0 and "train.init_from is not used: the run resumes from its own" in printed, err
    code, printed, err = cli("train", config, "--out", out, "--steps", "6", *every)  # init_from dropped: nothing to say
    assert code == 0 and not [line for line in printed.splitlines() if line.startswith("note:") and "init_from" in line]


def test_the_resume_line_under_another_launcher_asks_for_that_launcher(monkeypatch):
    """torchrun's ranks: `pithtrain train ... --ep 2` alone starts one process, which that mesh does not divide."""
    from pithtrain.cli import resume_line

    monkeypatch.delenv("PITHTRAIN_LAUNCHER", raising=False)
    monkeypatch.setenv("RANK", "0")
    assert resume_line(["train", "r.py", "--ep", "2"]) == \
        "\nresume with: the same launcher command (its ranks run: pithtrain train r.py --ep 2)"
    monkeypatch.setenv("PITHTRAIN_LAUNCHER", "1")  # our --nproc launcher's worker: its argv has --nproc
    assert resume_line(["train", "r.py", "--nproc", "2"]) == "\nresume with: pithtrain train r.py --nproc 2"


def test_an_earlier_run_without_a_checkpoint_is_not_overwritten(tmp_path, dataset_dir, monkeypatch):
    """Metrics of a run with checkpoints off: a rerun into its directory starts over, and moves them aside."""
    config = write_run_file(tmp_path / "tiny.py", dataset_dir)
    out = tmp_path / "run"
    code, printed, _ = cli("train", config, "--out", out, "--steps", "1", "--set", "train.checkpoint_every=-1")
    assert code == 0 and "no checkpoint (train.checkpoint_every=-1)" in printed.splitlines()[-1]
    assert "resume with" not in printed
    logged = (out / "metrics.jsonl").read_text()
    code, printed, _ = cli("train", config, "--out", out, "--steps", "2", "--dry-run")
    assert code == 0 and "would move that file to metrics_earlier.jsonl" in printed
    for name in ("metrics_earlier.jsonl", "metrics_earlier_2.jsonl"):
        code, printed, err = cli("train", config, "--out", out, "--steps", "1", "--set", "train.checkpoint_every=-1")
        assert code == 0 and f"moved that file to {name}" in printed, err
        assert (out / name).read_text().startswith('{"step": 1')
    assert (out / "metrics_earlier.jsonl").read_text() == logged
    monkeypatch.chdir(tmp_path)  # without --out a run goes to runs/MODEL_TYPE, named only after the config is valid
    code, _, err = cli("train", write_run_file(tmp_path / "none.py", dataset_dir, "CONFIG.model = None\n"), "--dry-run")
    assert refused(code, err, "model=None"), err


def test_eval_of_the_eval_dataset_gives_the_training_eval_loss(tmp_path, dataset_dir):
    """`pithtrain eval RUN --tokens DATA` reads DATA in training's windows (seq_len + 1 tokens, seq_len labels):
    its loss is the eval_loss the run logged for data.eval_path=DATA (8 windows: one whole global batch)."""
    from pithtrain.train.data import write_dataset

    held = tmp_path / "held"
    write_dataset(held, [np.random.default_rng(3).integers(1, 64, 8 * 32).tolist()], vocab_size=64, eos_id=0)  # 8*32+1
    config = write_run_file(tmp_path / "tiny.py", dataset_dir)
    out = tmp_path / "run"
    code, _, err = cli("train", config, "--out", out, "--steps", "1", "--set", f"data.eval_path={held}",
                       "--set", "train.eval_every=1")
    assert code == 0, err
    code, printed, err = cli("eval", out, "--tokens", held, "--json")
    logged = read_metrics(out / "metrics.jsonl")[-1]["eval_loss"]
    assert code == 0 and json.loads(printed)["tokens"] == 8 * 32, err
    assert json.loads(printed)["loss"] == pytest.approx(logged, rel=1e-6)


def test_dry_run_warns_when_the_estimate_exceeds_the_gpu(tmp_path, dataset_dir, monkeypatch):
    from types import SimpleNamespace

    config = write_run_file(tmp_path / "tiny.py", dataset_dir)
    code, printed, _ = cli("train", config, "--out", tmp_path / "run", "--dry-run", "--set", "train.device=cpu")
    assert code == 0 and "exceeds" not in printed  # no GPU here: nothing to compare with
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(total_memory=1024))
    code, printed, err = cli("train", config, "--out", tmp_path / "run", "--dry-run", "--set", "train.device=cpu")
    assert code == 0 and "warning: the estimate exceeds this machine's GPU (0.0 GiB)" in printed, err
    # on the CPU, the parameter state past the machine's memory is refused before anything is built
    monkeypatch.setattr(os, "sysconf", lambda name: {"SC_PAGE_SIZE": 4096, "SC_PHYS_PAGES": 16}[name])
    code, _, err = cli("train", config, "--out", tmp_path / "run", "--dry-run", "--set", "train.device=cpu",
                       "--set", "model.max_position_embeddings=8192")  # no size: not named as one to make smaller
    assert code == 2 and "GiB on the CPU (fp32 weights, gradients and AdamW moments, 16 bytes each), more than this " \
                         "machine's 0.0 GiB; train it on GPUs" in err and "max_position_embeddings" not in err, err
    assert "memory per GPU without one: .agents/skills/estimate-memory/estimate_memory.py" in err, err
