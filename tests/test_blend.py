"""Weighted data blends (data.path as {path: weight} or [weight, path, ...]) and tokenize's parquet and
`datasets` save_to_disk inputs: the documented sampling rule against an independent reconstruction,
token shares, a bit-exact resume, ep2 equal to one process, and one-line refusals."""

import json
import shutil
import sys
from unittest import mock

import numpy as np
import pytest

from cli_util import cli, one_line_error, write_config
from conftest import markov_docs, tiny_config
from dist_util import run_world
from pithtrain.config import data_parts
from pithtrain.train.data import BlendLoader, TokenDataset, write_dataset
from pithtrain.train.loop import train
from pithtrain.train.metrics import read_metrics


@pytest.fixture(scope="module")
def second_dataset(tmp_path_factory):
    """Another Markov corpus with the tests' vocabulary (and, as the first, no tokenizer file)."""
    path = tmp_path_factory.mktemp("blend") / "other"
    write_dataset(path, markov_docs(np.random.default_rng(11), 64, 150), vocab_size=64, eos_id=0)
    return path


def blend_config(dataset_dir, second, **train_kw):
    config = tiny_config(dataset_dir, **{"steps": 6, "micro_batch_size": 2, **train_kw})
    config.data.path = [0.7, str(dataset_dir), 0.3, str(second)]  # Megatron's form
    return config


@pytest.mark.fast
def test_blend_follows_its_rule_and_shares(dataset_dir, second_dataset):
    """Over 200 steps each dataset gives its weight's share of the tokens (within 1%), every row is the
    window its dataset's own seeded order puts next (each dataset read as a whole epoch before any
    repeat), and the two forms of data.path are the same blend."""
    assert data_parts({str(dataset_dir): 7, str(second_dataset): 3}) == data_parts([0.7, str(dataset_dir), 0.3, str(second_dataset)])
    datasets = [TokenDataset(dataset_dir), TokenDataset(second_dataset)]
    seq, batch, seed, steps = 32, 8, 1234, 200
    loader = BlendLoader(datasets, [0.7, 0.3], seq, batch, seed)
    tokens = np.sum([loader.dataset_tokens(s) for s in range(steps)], axis=0)
    assert tokens.sum() == steps * batch * seq
    assert tokens / tokens.sum() == pytest.approx([0.7, 0.3], abs=0.01)
    # independent reconstruction: dataset d's k-th sample is window perm_e[k % n] of its epoch e = k // n
    windows = [ds.tokens[: (ds.num_tokens - 1) // seq * seq + 1] for ds in datasets]
    taken = [0, 0]
    for step in (0, 1, 2, 57, 58):  # steps in order from 57 on: sample counts before it come from dataset_tokens
        if step == 57:
            taken = list(np.sum([loader.dataset_tokens(s) for s in range(57)], axis=0) // seq)
        rows = loader.global_batch(step)
        for row in np.concatenate([rows["input_ids"], rows["labels"][:, -1:]], 1):
            d = next(d for d in (0, 1) if _is_window(row, windows[d], seq))
            n = (datasets[d].num_tokens - 1) // seq
            epoch, k = divmod(taken[d], n)
            expected = np.random.default_rng([seed, epoch, d]).permutation(n)[k]
            assert np.array_equal(row, np.asarray(windows[d][expected * seq: expected * seq + seq + 1], dtype=np.int64))
            taken[d] += 1


def _is_window(row, tokens, seq):
    starts = np.flatnonzero(np.asarray(tokens[:-seq:seq]) == row[0]) * seq
    return any(np.array_equal(row, tokens[s: s + seq + 1]) for s in starts)


def test_blend_resumes_bit_exactly_and_ep2_equals_one_process(tmp_path, dataset_dir, second_dataset):
    """6 steps of a 0.7/0.3 blend: stopped after 3 and resumed equals the uninterrupted run exactly,
    and ep2 (two gloo processes) equals one process; metrics.jsonl logs each dataset's tokens."""
    whole = train(blend_config(dataset_dir, second_dataset), tmp_path / "whole", echo=False)
    train(blend_config(dataset_dir, second_dataset, checkpoint_every=3), tmp_path / "resumed", echo=False, stop_after=3)
    train(blend_config(dataset_dir, second_dataset), tmp_path / "resumed", echo=False)
    resumed = read_metrics(tmp_path / "resumed" / "metrics.jsonl")
    assert [(m["loss"], m["grad_norm"]) for m in resumed] == [(m["loss"], m["grad_norm"]) for m in whole]
    loader = BlendLoader([TokenDataset(dataset_dir), TokenDataset(second_dataset)], [0.7, 0.3], 32, 8, 1234)
    assert [m["dataset_tokens"] for m in resumed] == [loader.dataset_tokens(s) for s in range(6)]

    ep2 = blend_config(dataset_dir, second_dataset)
    ep2.parallel.ep = 2
    run_world(2, [(ep2, tmp_path / "ep2", {})])
    for a, b in zip(whole, read_metrics(tmp_path / "ep2" / "metrics.jsonl"), strict=True):
        for key in ("loss", "lb_loss", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-5), (a["step"], key)


def _tokenizer(path, words):
    from pithtrain.tools.tokenize import train_bpe

    return train_bpe([" ".join(words * 50)], 260, str(path))


@pytest.mark.fast
@pytest.mark.parametrize("case", ["two-tokenizers", "odd-list", "weight-zero", "twice", "copy", "eval-samples", "missing"])
def test_bad_blends_are_refused_in_one_line(case, tmp_path, dataset_dir, second_dataset, capsys):
    config = write_config(tmp_path / "tiny.py", dataset_dir)
    a, b = str(dataset_dir), str(second_dataset)
    blend, extra, names = {
        "two-tokenizers": (None, [], "different tokenizers"),
        "odd-list": ([0.7, a, 0.3], [], "data.path"),
        "weight-zero": ({a: 1, b: 0}, [], "weights > 0"),
        "twice": ({a: 1, a + "/": 2}, [], "named twice"),
        "copy": ({a: 1, str(tmp_path / "copy"): 2}, [], f"{tmp_path / 'copy'} holds the same tokens as {a} (a copy?)"),
        "eval-samples": ({a: 1, b: 1}, ["--set", "data.eval_samples=8"], "data.eval_path"),
        "missing": ({a: 1, str(tmp_path / "nowhere"): 1}, [], "nowhere"),
    }[case]
    if case == "copy":
        shutil.copytree(a, tmp_path / "copy")
    if blend is None:  # the same Markov tokens, with two different tokenizer.json files
        tokens = markov_docs(np.random.default_rng(3), 64, 60)
        for name, words in (("x", ["alpha", "beta"]), ("y", ["gamma", "delta"])):
            write_dataset(tmp_path / name, tokens, 300, 0, tokenizer_file=_tokenizer(tmp_path / f"{name}.json", words))
        blend = {str(tmp_path / "x"): 1, str(tmp_path / "y"): 1}
    for dry_run in ([], ["--dry-run"]):
        _, err = cli(["train", config, "--out", tmp_path / "run", "--set", f"data.path={json.dumps(blend)}", *extra, *dry_run],
                     capsys, code=2)
        one_line_error(err, names)
        if case == "missing":  # memory alone needs no data: a dry run says where to get it
            assert ("estimate_memory.py" in err) == bool(dry_run)
    assert not (tmp_path / "run").exists()


@pytest.mark.fast
def test_tokenize_reads_parquet_and_saved_datasets(tmp_path, capsys):
    """The same texts as JSON Lines, as parquet plus a save_to_disk directory: the same token dataset;
    a DatasetDict, a missing column and a missing reader library are refused in one line."""
    pytest.importorskip("pyarrow")
    datasets = pytest.importorskip("datasets")  # in the test extra: CI has both
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = [f"document {i}: " + " ".join(["alpha beta gamma delta"] * (i % 7 + 1)) for i in range(40)]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    pq.write_table(pa.table({"id": list(range(25)), "text": texts[:25]}), tmp_path / "docs.parquet")
    datasets.Dataset.from_dict({"text": texts[25:]}).save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": texts})}).save_to_disk(str(tmp_path / "splits"))
    cli(["tokenize", tmp_path / "docs.jsonl", "--train-tokenizer", "--vocab-size", "300", "--out", tmp_path / "from_jsonl"], capsys)
    tokenizer = tmp_path / "from_jsonl" / "tokenizer.json"
    cli(["tokenize", tmp_path / "docs.parquet", tmp_path / "saved", "--tokenizer", tokenizer, "--out", tmp_path / "from_tables"], capsys)
    for name in ("tokens.bin", "doc_offsets.npy"):
        assert (tmp_path / "from_jsonl" / name).read_bytes() == (tmp_path / "from_tables" / name).read_bytes()
    assert TokenDataset(tmp_path / "from_tables").num_docs == 40
    for args, names in (([tmp_path / "splits"], "splits/train"), ([tmp_path / "docs.parquet", "--text-field", "body"], "'body'")):
        _, err = cli(["tokenize", *args, "--tokenizer", tokenizer, "--out", tmp_path / "t"], capsys, code=2)
        one_line_error(err, names)
    for module, path in (("pyarrow", "docs.parquet"), ("datasets", "saved")):
        with mock.patch.dict(sys.modules, {module: None, f"{module}.parquet": None}):
            _, err = cli(["tokenize", tmp_path / path, "--tokenizer", tokenizer, "--out", tmp_path / "t"], capsys, code=2)
        one_line_error(err, path, f"pip install {module}")
    assert not (tmp_path / "t").exists()
