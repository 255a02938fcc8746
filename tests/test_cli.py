"""The command line end to end: tokenize -> train -> convert (both ways) -> eval, checked against transformers."""

import json
import logging
import os
import re
import subprocess
import sys
import types
import warnings

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from pithtrain.cli import main


def run_cli(args, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    out = capsys.readouterr().out
    assert exit_info.value.code == 0, out
    return out


@pytest.mark.fast
def test_tokenize_train_convert_eval(tmp_path, capsys, monkeypatch):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    rng = np.random.default_rng(3)
    words = ["alpha", "beta", "gamma", "delta", "mixture", "expert", "router", "token", "layer", "train"]
    for i in range(30):
        (corpus / f"doc{i}.txt").write_text(" ".join(rng.choice(words, size=200)) + "\n")
    (tmp_path / "more.jsonl").write_text("".join(json.dumps({"text": " ".join(rng.choice(words, 50))}) + "\n" for _ in range(20)))
    data = tmp_path / "data"
    run_cli(["tokenize", str(corpus), str(tmp_path / "more.jsonl"), "--train-tokenizer", "--vocab-size", "300",
             "--out", str(data)], capsys)
    meta = json.loads((data / "meta.json").read_text())
    assert meta["num_docs"] == 50 and meta["dtype"] == "uint16"

    run = tmp_path / "run"
    out = run_cli(["train", "examples/qwen3_tiny.py", "--out", str(run), "--steps", "3", "--set", f"data.path={data}",
                   "--set", f"model.vocab_size={meta['vocab_size']}", "--set", "data.seq_len=32",
                   "--set", "train.global_batch_size=4", "--set", "train.micro_batch_size=2",
                   "--set", "train.tensorboard=false", "--set", "train.log_every=1", "--set", "data.eval_samples=4",
                   "--set", "train.eval_every=3"], capsys)
    assert "step 3/3 | loss" in out and "tok/s" in out
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2, 3]

    hf_dir = tmp_path / "hf"
    run_cli(["convert", str(run), str(hf_dir)], capsys)
    check_hf_export(hf_dir, meta["eos_id"])
    tokens = rng.integers(0, meta["vocab_size"], size=(3, 20))
    np.save(tmp_path / "tokens.npy", tokens)
    results = {}
    for name, path in (("run", run), ("hf", hf_dir), ("its checkpoints folder", run / "checkpoints")):
        results[name] = json.loads(run_cli(["eval", str(path), "--tokens", str(tmp_path / "tokens.npy"), "--json"], capsys))
    assert results["run"]["tokens"] == 3 * 19 and results["its checkpoints folder"] == results["run"]
    from pithtrain.train import checkpoint

    with monkeypatch.context() as patch:  # a large model's read (minutes) is said on stderr
        patch.setattr(checkpoint, "BIG_READ", 0)
        for path in (run, hf_dir):
            checkpoint.load_model(path)
    said = capsys.readouterr().err.splitlines()
    assert said[0].startswith(f"reading {checkpoint.resolve_checkpoint(run)} (") and said[0].endswith(" GB) ..."), said
    assert said[1].startswith(f"reading {hf_dir / 'model.safetensors'} (1/1 of "), said
    assert results["run"]["loss"] == pytest.approx(results["hf"]["loss"], rel=1e-6)

    # HF -> PithTrain checkpoint -> eval again, and transformers' own loss on the export
    said = run_cli(["convert", str(hf_dir), str(tmp_path / "ckpt")], capsys)  # names what it copied (a directory may lack some)
    assert f"with tokenizer.json, tokenizer_config.json, special_tokens_map.json, generation_config.json of {hf_dir}" in said
    back = json.loads(run_cli(["eval", str(tmp_path / "ckpt"), "--tokens", str(tmp_path / "tokens.npy"), "--json"], capsys))
    assert back["loss"] == pytest.approx(results["hf"]["loss"], rel=1e-6)
    run_cli(["convert", str(tmp_path / "ckpt"), str(tmp_path / "hf_back")], capsys)  # and back: the tokenizer files kept
    files = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")
    assert all((tmp_path / "hf_back" / f).read_bytes() == (hf_dir / f).read_bytes() for f in files)
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir)).eval()
    ids = torch.from_numpy(tokens)
    with torch.no_grad():
        logits = model(ids[:, :-1]).logits
    ref = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()).item()
    assert results["hf"]["loss"] == pytest.approx(ref, rel=1e-5)

    # eval on a dataset directory: training's last samples within --max-tokens, windows of --seq-len + 1 tokens from
    # token 0 (data.eval_samples' held-out ones: the in-training eval_loss), the same loss as those windows as a .npy
    every = np.fromfile(data / "tokens.bin", dtype=np.uint16).astype(np.int64)
    last = (len(every) - 1) // 20 * 20  # training's last sample is every[last - 20:last + 1]
    assert (len(every) - 1) % 20, "a token count that does not fill the last window: the tail is not the grid"
    np.save(tmp_path / "tail.npy", np.stack([every[last - 40:last - 19], every[last - 20:last + 1]]))
    tail = json.loads(run_cli(["eval", str(hf_dir), "--tokens", str(tmp_path / "tail.npy"), "--json"], capsys))
    from_dir = json.loads(run_cli(["eval", str(hf_dir), "--tokens", str(data), "--max-tokens", "60", "--seq-len", "20",
                                   "--json"], capsys))
    assert from_dir == tail and from_dir["tokens"] == 40 and from_dir["seq_len"] == 20
    held_out = json.loads(run_cli(["eval", str(run), "--tokens", str(data), "--max-tokens", str(4 * 32 + 1), "--json"], capsys))
    assert held_out["loss"] == pytest.approx(lines[-1]["eval_loss"], rel=1e-5) and held_out["tokens"] == 4 * 32

    # the run's dataset gone: the model is exported anyway, with one line saying why there is no tokenizer
    data.rename(tmp_path / "moved")
    with pytest.raises(SystemExit):
        main(["convert", str(run), str(tmp_path / "hf2")])
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no tokenizer written" in err and str(data) in err
    assert sorted(p.name for p in (tmp_path / "hf2").iterdir()) == ["config.json", "model.safetensors"]


def check_hf_export(hf_dir, eos_id):
    """A complete HF directory: files of the umask's mode (0644 under 022, not safetensors' 0600), bos/eos/pad ids, and a tokenizer and model
    that AutoTokenizer and generate() use as they are."""
    from transformers import AutoTokenizer

    mask = os.umask(0)
    os.umask(mask)
    for f in hf_dir.iterdir():
        assert f.stat().st_mode & 0o777 == 0o666 & ~mask, f
    config = json.loads((hf_dir / "config.json").read_text())
    assert config["bos_token_id"] == config["eos_token_id"] == config["pad_token_id"] == eos_id
    tok = AutoTokenizer.from_pretrained(str(hf_dir))
    assert tok.eos_token_id == tok.pad_token_id == eos_id
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir)).eval()
    assert model.generation_config.eos_token_id == eos_id
    prompt = tok("alpha beta", return_tensors="pt")
    ids = model.generate(**prompt, max_new_tokens=8, do_sample=False)
    assert ids.shape[1] > prompt["input_ids"].shape[1]
    assert tok.decode(ids[0, : prompt["input_ids"].shape[1]]) == "alpha beta"


@pytest.mark.fast
def test_bad_inputs_give_clear_errors(tmp_path, capsys):
    formatwarning, filters = warnings.formatwarning, list(logging.getLogger().filters)  # main() from Python leaves them
    np.save(tmp_path / "bad.npy", np.arange(5))
    np.save(tmp_path / "good.npy", np.arange(10).reshape(2, 5))
    with pytest.raises(SystemExit) as exit_info:
        main(["eval", str(tmp_path / "nowhere"), "--tokens", str(tmp_path / "good.npy")])
    assert exit_info.value.code == 2 and "does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:  # the model's files first: they are cheap to read (tokens: test_errors.py)
        main(["eval", str(tmp_path / "nowhere"), "--tokens", str(tmp_path / "bad.npy")])
    assert exit_info.value.code == 2 and "nowhere does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["tokenize", "--out", str(tmp_path / "d")])
    assert exit_info.value.code == 2 and "--stdlib" in capsys.readouterr().err
    assert warnings.formatwarning is formatwarning and logging.getLogger().filters == filters


@pytest.mark.fast
def test_a_long_eval_reports_its_progress(monkeypatch, capsys, tmp_path):
    """eval of many rows says on stderr how far it is (a CPU eval of a large dataset ran for minutes in silence), and its
    loss stays the plain cross-entropy of the model's logits."""
    from pithtrain.tools import hf

    class Bigram(torch.nn.Module):
        cfg = types.SimpleNamespace(vocab_size=16)

        def __init__(self):
            super().__init__()
            self.table = torch.nn.Embedding(16, 16)

        def forward(self, ids, pos, engine, doc_ids=None):  # as the models' forward (doc_ids: packed documents)
            return self.table(ids)

    model, tokens = Bigram(), torch.randint(0, 16, (40, 9), generator=torch.Generator().manual_seed(0))
    clock = iter(range(0, 10**6, 7))  # each reading 7 s after the last
    monkeypatch.setattr(hf.time, "perf_counter", lambda: next(clock))
    loss, count = hf.evaluate(model, tokens, batch_size=4)
    with torch.no_grad():
        ref = torch.nn.functional.cross_entropy(model.table(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    assert count == 40 * 8 and loss == pytest.approx(ref.item(), rel=1e-6)
    lines = capsys.readouterr().err.splitlines()
    assert lines == [f"eval: {done} of 40 rows, {left}s left" for done, left in ((8, 56), (16, 42), (24, 28), (32, 14))]
    rows = int(torch.randint(1, 5, ()))  # the Python API's bad inputs: one ValueError naming them, not torch's
    for bad, size, got in ((tokens[:rows].tolist(), 4, "got list"), (tokens[:rows].float(), 4, f"got torch.float32 ({rows}, 9)"),
                           (tokens[0], 4, "got torch.int64 (9,)"), (tokens[:rows, :1], 4, f"({rows}, 1)"),
                           (tokens[:0], 4, "(0, 9)"), (tokens[:rows], 0, "batch_size >= 1, got 0")):
        with pytest.raises(ValueError, match=re.escape(got)):
            hf.evaluate(model, bad, batch_size=size)
    assert hf.evaluate(model, tokens.int(), batch_size=4) == (loss, count)  # int32 ids as int64
    from pithtrain.train.data import write_dataset

    write_dataset(tmp_path / "d", [tokens[i].tolist() for i in range(rows)], vocab_size=16, eos_id=None)
    for bad in (0, 1, float(torch.randint(2, 9, ()))):  # rows of seq_len + 1 tokens: at least 2, as eval's --seq-len
        with pytest.raises(ValueError, match=re.escape(f"seq_len {bad!r}: must be an int of at least 2")):
            hf.load_tokens(tmp_path / "d", seq_len=bad)
    assert hf.load_tokens(tmp_path / "d", seq_len=2).shape == ((rows * 9 - 1) // 2, 3)


@pytest.mark.fast
def test_python_dash_m_entry_point():
    out = subprocess.run([sys.executable, "-m", "pithtrain", "--help"], capture_output=True, text=True, check=True).stdout
    for command in ("train", "tokenize", "convert", "eval"):
        assert command in out


def test_a_warning_is_one_line_said_once(tmp_path):
    """A skipped binary file is read by both passes over the inputs (BPE, then tokenizing): one warning
    line for it, without Python's category and source line."""
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.txt").write_text("some text to train a tokenizer on " * 20)
    (tmp_path / "in" / "b.bin").write_bytes(bytes([0xFF, 0xFE, 0x00]) * 10)
    done = subprocess.run([sys.executable, "-m", "pithtrain", "tokenize", tmp_path / "in", "--train-tokenizer",
                           "--vocab-size", "300", "--out", tmp_path / "out"], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(__file__))))
    warned = [line for line in done.stderr.splitlines() if "skipped 1 file" in line]
    assert done.returncode == 0 and warned == [f"warning: skipped 1 file(s) that are not UTF-8 text, e.g. "
                                               f"{tmp_path / 'in' / 'b.bin'}"], done.stderr
    assert "UserWarning" not in done.stderr
