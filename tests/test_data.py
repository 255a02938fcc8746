"""Token dataset format, batch order, document packing and the tokenize tool, against plain-Python references."""

import argparse
import json
import math
import os
import random
import subprocess
import sys
import time
import warnings
from collections import Counter
from pathlib import Path
from unittest import mock

import numpy as np
import pytest

from pithtrain.config import UserError
from pithtrain.tools.tokenize import (
    Progress,
    add_tokenize_args,
    iter_documents,
    run_tokenize,
    stdlib_corpus_files,
    tokenize_to_dataset,
    train_bpe,
    unigram_entropy,
)
from pithtrain.train.data import BatchLoader, TokenDataset, dtype_for_vocab, write_dataset
from pithtrain.train.rundir import start_time

pytestmark = pytest.mark.fast  # the fast tier (make test-fast)


def random_docs(rng, n_docs, vocab_size, max_len=40, allow_empty=False):
    low = 0 if allow_empty else 1
    return [rng.integers(0, vocab_size, size=int(rng.integers(low, max_len))).tolist() for _ in range(n_docs)]


def flat_reference(docs, eos_id):
    """Concatenated tokens and per-token document index, built the slow obvious way."""
    tokens, owner = [], []
    for d, doc in enumerate(docs):
        for t in list(doc) + ([] if eos_id is None else [eos_id]):
            tokens.append(t)
            owner.append(d)
    return tokens, owner


def make_dataset(tmp_path, docs, vocab_size=1000, eos_id=0, name="ds"):
    write_dataset(tmp_path / name, docs, vocab_size, eos_id)
    return TokenDataset(tmp_path / name)


def test_dtype_for_vocab():
    assert dtype_for_vocab(2) == np.uint8
    assert dtype_for_vocab(256) == np.uint8
    assert dtype_for_vocab(257) == np.uint16
    assert dtype_for_vocab(65536) == np.uint16
    assert dtype_for_vocab(65537) == np.uint32
    with pytest.raises(ValueError):
        dtype_for_vocab(0)


@pytest.mark.parametrize("vocab_size,eos_id", [(200, 199), (50_000, None), (100_000, 99_999)])
def test_round_trip(tmp_path, vocab_size, eos_id):
    rng = np.random.default_rng(1)
    docs = random_docs(rng, 50, vocab_size, allow_empty=eos_id is not None)
    as_arrays = (np.array(d, dtype=np.int64) for d in docs)  # a generator: write_dataset must stream
    meta = write_dataset(tmp_path / "ds", as_arrays, vocab_size, eos_id)
    ds = TokenDataset(tmp_path / "ds")
    tokens, _ = flat_reference(docs, eos_id)
    assert ds.tokens.dtype == dtype_for_vocab(vocab_size) and meta["dtype"] == ds.tokens.dtype.name
    assert ds.tokens.tolist() == tokens
    assert ds.num_tokens == len(tokens) == meta["num_tokens"]
    assert ds.num_docs == len(docs) and ds.vocab_size == vocab_size and ds.eos_id == eos_id
    assert ds.max_token_id == max(tokens)
    for i, doc in enumerate(docs):
        span = ds.tokens[ds.doc_offsets[i] : ds.doc_offsets[i + 1]].tolist()
        assert span == list(doc) + ([] if eos_id is None else [eos_id])
    assert ds.tokenizer_file is None
    assert (tmp_path / "ds" / "tokens.bin").stat().st_size == len(tokens) * ds.tokens.dtype.itemsize
    meta_file = tmp_path / "ds" / "meta.json"  # emptied by hand: said in words, not numpy's about mmap
    meta_file.write_text(json.dumps(dict(json.loads(meta_file.read_text()), num_tokens=0)))
    (tmp_path / "ds" / "tokens.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="ds holds no tokens"):
        TokenDataset(tmp_path / "ds")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds"]  # no temp dir left behind


def test_windows_and_labels_match_reference(tmp_path):
    rng = np.random.default_rng(2)
    docs = random_docs(rng, 60, 1000)
    ds = make_dataset(tmp_path, docs, eos_id=999)
    tokens, _ = flat_reference(docs, 999)
    S, G, seed = 16, 5, 7
    loader = BatchLoader(ds, S, G, seed)
    n = (len(tokens) - 1) // S
    assert loader.num_samples == n
    for step in range(3 * n // G):
        batch = loader.global_batch(step)
        assert set(batch) == {"input_ids", "labels", "position_ids"}
        for name in batch:
            assert batch[name].shape == (G, S) and str(batch[name].dtype) == "torch.int64"
        for row in range(G):
            k = step * G + row
            index = np.random.default_rng([seed, k // n]).permutation(n)[k % n]
            assert loader.sample_index(k) == index
            window = tokens[index * S : index * S + S + 1]
            assert batch["input_ids"][row].tolist() == window[:-1]
            assert batch["labels"][row].tolist() == window[1:]
            assert batch["position_ids"][row].tolist() == list(range(S))


def test_determinism_and_resumability(tmp_path):
    ds = make_dataset(tmp_path, random_docs(np.random.default_rng(3), 80, 500), vocab_size=500)
    a, b, other = BatchLoader(ds, 8, 4, seed=11), BatchLoader(ds, 8, 4, seed=11), BatchLoader(ds, 8, 4, seed=12)
    in_order = [a.global_batch(step)["input_ids"] for step in range(40)]
    for step in [37, 3, 0, 25, 39, 3]:  # any call history gives the same batch for a step
        assert b.global_batch(step)["input_ids"].equal(in_order[step])
    assert not all(other.global_batch(step)["input_ids"].equal(in_order[step]) for step in range(5))


def test_epoch_wrap(tmp_path):
    ds = make_dataset(tmp_path, random_docs(np.random.default_rng(4), 10, 300), vocab_size=300)
    loader = BatchLoader(ds, 4, 3, seed=5)
    n = loader.num_samples
    assert n % 3 != 0  # so some batch straddles an epoch boundary
    steps = 2 * n // 3 + 2
    by_stream = [loader.sample_index(k) for k in range(steps * 3)]
    assert sorted(by_stream[:n]) == list(range(n)) and sorted(by_stream[n : 2 * n]) == list(range(n))
    assert by_stream[:n] != by_stream[n : 2 * n]  # each epoch reshuffles
    fresh = BatchLoader(ds, 4, 3, seed=5)
    for step in range(steps):
        starts = fresh.global_batch(step)["input_ids"][:, 0].tolist()
        assert starts == [int(ds.tokens[i * 4]) for i in by_stream[step * 3 : step * 3 + 3]]
    assert loader.epoch_of_step(0) == 0 and loader.epoch_of_step(n) == pytest.approx(3.0)


@pytest.mark.parametrize("eos_id", [0, None])
def test_packing_matches_slow_reference(tmp_path, eos_id):
    rng = np.random.default_rng(6)
    docs = random_docs(rng, 120, 700, max_len=30, allow_empty=True)  # empty docs (no EOS) must leave no gap in doc_ids
    ds = make_dataset(tmp_path, docs, vocab_size=700, eos_id=eos_id)
    tokens, owner = flat_reference(docs, eos_id)
    S, G = 24, 6
    packed, plain = BatchLoader(ds, S, G, seed=1, pack_documents=True), BatchLoader(ds, S, G, seed=1)
    masked_total = 0
    for step in range(packed.num_samples // G):
        batch, unpacked = packed.global_batch(step), plain.global_batch(step)
        assert "doc_ids" not in unpacked and (unpacked["labels"] >= 0).all()
        assert batch["input_ids"].equal(unpacked["input_ids"])
        for row in range(G):
            start = packed.sample_index(step * G + row) * S
            positions, doc_ids, labels = [], [], []
            position, segment = 0, 0
            for t in range(start, start + S):
                if t > start and owner[t] != owner[t - 1]:
                    position, segment = 0, segment + 1
                positions.append(position)
                doc_ids.append(segment)
                labels.append(tokens[t + 1] if owner[t + 1] == owner[t] else -100)
                position += 1
            assert batch["position_ids"][row].tolist() == positions
            assert batch["doc_ids"][row].tolist() == doc_ids
            assert batch["labels"][row].tolist() == labels
            masked_total += labels.count(-100)
    assert masked_total > 0


def test_write_errors(tmp_path):
    with pytest.raises(ValueError, match="no tokens"):
        write_dataset(tmp_path / "a", [], 100, eos_id=None)
    with pytest.raises(ValueError, match="no tokens"):
        write_dataset(tmp_path / "a", [[], []], 100, eos_id=None)
    with pytest.raises(ValueError, match="document 2: token id 100"):
        write_dataset(tmp_path / "a", [[1, 2], [3], [5, 100, 7]], 100, eos_id=None)
    with pytest.raises(ValueError, match="document 0: token id -1"):
        write_dataset(tmp_path / "a", [[-1, 2]], 100, eos_id=None)
    with pytest.raises(ValueError, match="eos_id"):
        write_dataset(tmp_path / "a", [[1]], 100, eos_id=100)
    assert list(tmp_path.iterdir()) == []  # failures leave neither dataset nor temp dir

    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="notes.txt"):
        write_dataset(tmp_path / "busy", [[1]], 100, eos_id=None)


def test_crash_mid_write_keeps_previous_dataset(tmp_path):
    write_dataset(tmp_path / "ds", [[1, 2, 3]], 10, eos_id=None)

    def exploding():
        yield [4, 5]
        raise RuntimeError("disk on fire")

    with pytest.raises(RuntimeError):
        write_dataset(tmp_path / "ds", exploding(), 10, eos_id=None)
    assert TokenDataset(tmp_path / "ds").tokens.tolist() == [1, 2, 3]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds"]
    # a killed writer's temporary directory (its pid gone) goes at the next write; a live writer's stays
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    for pid in (gone.pid, os.getppid()):
        (tmp_path / f".ds.tmp-{pid}").mkdir()
    write_dataset(tmp_path / "ds", [[6, 7]], 10, eos_id=None)  # replacing a dataset is allowed
    assert TokenDataset(tmp_path / "ds").tokens.tolist() == [6, 7]
    assert sorted(p.name for p in tmp_path.iterdir()) == [f".ds.tmp-{os.getppid()}", "ds"]


def test_read_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="pithtrain tokenize"):
        TokenDataset(tmp_path / "nowhere")
    ds = make_dataset(tmp_path, random_docs(np.random.default_rng(8), 5, 300), vocab_size=300)

    with pytest.raises(ValueError, match="vocab_size is 200"):
        ds.check_vocab(200)
    ds.check_vocab(300)

    with pytest.raises(ValueError, match="fewer than one global batch of 1000"):
        BatchLoader(ds, 8, 1000, seed=0)
    with pytest.raises(ValueError, match="not one sample: in a blend .* leave it out of the blend"):
        BatchLoader(ds, 10**6, 1, seed=0, stream=(1,))  # a blend's dataset: no global batch of its own to shrink

    tokens_file = ds.path / "tokens.bin"
    tokens_file.write_bytes(tokens_file.read_bytes()[:-2])
    with pytest.raises(ValueError, match=r"tokens\.bin is truncated.*pithtrain tokenize"):
        TokenDataset(ds.path)

    meta_file = ds.path / "meta.json"
    meta = json.loads(meta_file.read_text())
    meta_file.write_text(json.dumps({**meta, "format": "something-else"}))
    with pytest.raises(ValueError, match="meta.json: format"):
        TokenDataset(ds.path)
    meta_file.unlink()
    with pytest.raises(FileNotFoundError, match="meta.json"):
        TokenDataset(ds.path)


def test_iter_documents(tmp_path):
    root = tmp_path / "corpus"
    (root / "sub").mkdir(parents=True)
    (root / ".hidden").mkdir()
    (root / "b.txt").write_text("bravo")
    (root / "a.txt").write_bytes(b"\xef\xbb\xbfalpha")  # a byte order mark, as Windows editors write
    (root / "sub" / "c.md").write_text("charlie ünïcode")
    (root / "sub" / "empty.txt").write_text("")
    (root / ".secret.txt").write_text("hidden file")
    (root / ".hidden" / "x.txt").write_text("hidden dir")
    (root / "blob.bin").write_bytes(bytes([0xFF, 0xFE, 0x80, 0x00]))
    rows = [{"text": "first"}, {"text": "second", "id": 2}]
    (root / "sub" / "d.jsonl").write_bytes(b"\xef\xbb\xbf" + ("\r\n".join(json.dumps(r) for r in rows) + "\r\n\r\n").encode())
    with pytest.warns(UserWarning, match="skipped 1 file"):
        assert list(iter_documents([str(root)])) == ["alpha", "bravo", "charlie ünïcode", "first", "second"]

    # a .jsonl file is read line by line (many GB in bounded memory), never whole; one that is not UTF-8 is an error
    with mock.patch.object(Path, "read_bytes", side_effect=AssertionError("read whole")):
        assert list(iter_documents([str(root / "sub" / "d.jsonl")])) == ["first", "second"]
    (tmp_path / "latin.jsonl").write_bytes(b'{"text": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=r"latin\.jsonl: not UTF-8 text"):
        list(iter_documents([str(tmp_path / "latin.jsonl")]))

    single = tmp_path / "one.jsonl"
    single.write_text(json.dumps({"body": "x"}) + "\n")
    assert list(iter_documents([str(single)], text_field="body")) == ["x"]
    with pytest.raises(ValueError, match=r"one\.jsonl:1: no field 'text'"):
        list(iter_documents([str(single)]))
    single.write_text(json.dumps({"text": "ok"}) + "\n{not json\n")
    with pytest.raises(ValueError, match=r"one\.jsonl:2: not valid JSON"):
        list(iter_documents([str(single)]))
    with pytest.raises(UserError, match="missing.txt"):
        list(iter_documents([str(root), str(tmp_path / "missing.txt")]))
    assert list(iter_documents(random.choice([str(root / "b.txt"), root / "b.txt"]))) == ["bravo"]  # one path, not a list
    tokenizer = train_bpe(["alpha bravo"], 260, str(tmp_path / "tok.json"))  # a missing input is named as one, not a failed write
    with pytest.raises(UserError, match=f"^input {tmp_path / 'missing.txt'} not found; check the path$"):
        tokenize_to_dataset([str(tmp_path / "missing.txt")], tokenizer, str(tmp_path / "ds"), progress=False)
    # .json: one JSON document (an array of records, or one record), else JSON Lines (datasets' to_json writes those)
    array = tmp_path / "array.json"
    for content, docs in ((json.dumps([{"text": "one"}, {"text": ""}, {"text": None}, {"text": "two"}], indent=2), ["one", "two"]),
                          ('{\n  "text": "pretty"\n}', ["pretty"]), ('{"text": "a"}\n{"text": "b"}\n', ["a", "b"])):
        array.write_text(content)
        assert list(iter_documents([str(array)])) == docs, content
    array.write_text(json.dumps(["one", "two"]))
    with pytest.raises(ValueError, match=r"array\.json: item 0: a JSON string, expected an object with field 'text'; write each "
                       r'text as \{"text": \.\.\.\}$'):
        list(iter_documents([str(array)]))
    array.write_text('[{"text": "one"},\n{"text": 2}]')
    with pytest.raises(ValueError, match=r"array\.json: item 1: field 'text' is int, expected a string$"):
        list(iter_documents([str(array)]))
    array.write_text('{"text": "a"}\n{oops\n')
    with pytest.raises(ValueError, match=r"array\.json:2: not valid JSON .*per line or one JSON array of objects$"):
        list(iter_documents([str(array)]))


def test_iter_documents_follows_links_and_skips_fifos_and_datasets(tmp_path):
    """Linked directories are read (a loop of links once), FIFOs and broken links are skipped with a warning and
    never opened (a read would block), an earlier pithtrain dataset in the tree is skipped, and a JSON Lines text
    may hold U+2028 or U+0085 (lines split at "\\n" only)."""
    import os
    import signal

    other, root = tmp_path / "other", tmp_path / "corpus"
    other.mkdir()
    (other / "b.txt").write_text("bravo")
    root.mkdir()
    (root / "a.txt").write_text("alpha")
    (root / "linked").symlink_to(other)
    (root / "loop").symlink_to(root)
    (root / "gone.txt").symlink_to(tmp_path / "nowhere")
    os.mkfifo(root / "pipe")
    (root / "c.jsonl").write_text(json.dumps({"text": "x\u2028y\u0085z"}, ensure_ascii=False) + "\n")
    write_dataset(root / "old_dataset", [[1, 2]], 10, eos_id=0, tokenizer_file=None)
    (root / "old_dataset" / "tokenizer.json").write_text('{\n  "pretty": "printed"\n}')  # read as JSON Lines it would fail

    def timeout(*_):
        raise TimeoutError("a read blocked")

    previous = signal.signal(signal.SIGALRM, timeout)
    signal.alarm(20)
    try:
        with pytest.warns(UserWarning, match=r"skipped 2 file\(s\) that are not regular files.*gone.txt"):
            docs = list(iter_documents([str(root)]))
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert docs == ["alpha", "x\u2028y\u0085z", "bravo"]


def test_bpe_tokenize_round_trip(tmp_path, capsys):
    import re

    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    from pithtrain.tools import tokenize

    files = stdlib_corpus_files(max_bytes=300_000)
    assert files and all(f.endswith(".py") and "site-packages" not in f for f in files)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        texts = list(iter_documents(files))
        tokenizer_file = train_bpe(iter_documents(files), 512, str(tmp_path / "tok" / "tokenizer.json"))
        capsys.readouterr()
        meta = tokenize_to_dataset(files, tokenizer_file, str(tmp_path / "ds"), progress=True)
    progress = capsys.readouterr().err.strip().splitlines()[-1]  # the tokens it counts are those written, EOS included
    assert f"{len(texts):,} docs" in progress and f" {meta['num_tokens']:,} tokens " in progress, (progress, meta)
    tokenizer = Tokenizer.from_file(tokenizer_file)
    assert tokenizer.get_vocab_size() == 512 and tokenizer.token_to_id("<|endoftext|>") == 0
    ds = TokenDataset(tmp_path / "ds")
    assert meta["eos_id"] == ds.eos_id == 0 and ds.vocab_size == 512 and ds.tokens.dtype == np.uint16
    assert ds.num_docs == len(texts)
    assert ds.tokenizer_file == str((tmp_path / "ds" / "tokenizer.json").resolve())
    for i, text in enumerate(texts):
        ids = ds.tokens[ds.doc_offsets[i] : ds.doc_offsets[i + 1]].tolist()
        assert ids[-1] == 0 and 0 not in ids[:-1]
        assert tokenizer.decode(ids[:-1]) == text
    assert ds.num_tokens < sum(len(t.encode()) for t in texts) / 2  # merges actually compress
    # one long document (a huge line) is encoded in pieces cut before a space: its ids are the whole text's
    (tmp_path / "long.txt").write_text(" ".join(texts))
    with mock.patch("pithtrain.tools.tokenize.PIECE_CHARS", 1000):
        tokenize_to_dataset([str(tmp_path / "long.txt")], tokenizer_file, str(tmp_path / "long"), progress=False)
    assert TokenDataset(tmp_path / "long").tokens[:-1].tolist() == tokenizer.encode(" ".join(texts)).ids
    # a tokenizer whose normalizer prepends "▁" to every text (Llama 2's) would give each piece one; one whose tokens
    # join words across a "▁" (merges over the cut): encoded whole, as said
    llama = Tokenizer(models.BPE())
    llama.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    # trained on lines: without a pre-tokenizer a whole file is one word to BPE's trainer (quadratic: 14 s)
    lines = [line for text in texts for line in text.splitlines()]
    llama.train_from_iterator(lines, trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"]))
    llama.save(str(tmp_path / "llama.json"))
    assert any(re.search("[^\u2581]\u2581", token) for token in llama.get_vocab())
    with mock.patch("pithtrain.tools.tokenize.PIECE_CHARS", 1000), pytest.warns(UserWarning, match="characters is encoded whole"):
        tokenize_to_dataset([str(tmp_path / "long.txt")], str(tmp_path / "llama.json"), str(tmp_path / "llama"), progress=False)
    assert TokenDataset(tmp_path / "llama").tokens[:-1].tolist() == llama.encode(" ".join(texts)).ids
    # one trained on words as SentencePiece is (Llama 2's: no token joins a character to the "▁" after it): cut at spaces,
    # each left out (the next piece's prepended "▁" stands for it), none touching an added token; the whole text's ids
    words = Tokenizer(models.BPE(byte_fallback=True))
    words.normalizer, words.pre_tokenizer = llama.normalizer, pre_tokenizers.Split("\u2581", behavior="merged_with_next")
    words.train_from_iterator(lines, trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<s>"]))
    words.pre_tokenizer = None  # as Llama 2's tokenizer.json: BPE over the whole text
    words.save(str(tmp_path / "words.json"))
    (tmp_path / "tagged.txt").write_text(" <s> ".join(texts[:40]) + " ".join(texts[40:]))
    pieces, cut = [], tokenize._pieces
    with mock.patch("pithtrain.tools.tokenize.PIECE_CHARS", 1000), \
            mock.patch("pithtrain.tools.tokenize._pieces", lambda *a: (pieces.append(p) or p for p in cut(*a))):
        tokenize_to_dataset([str(tmp_path / "tagged.txt")], str(tmp_path / "words.json"), str(tmp_path / "words"), progress=False)
    assert len(pieces) > 100  # was: one, the text whole (about 70 bytes of memory a character)
    assert TokenDataset(tmp_path / "words").tokens[:-1].tolist() == words.encode((tmp_path / "tagged.txt").read_text()).ids
    cut = Tokenizer.from_file(tokenizer_file)  # a hub tokenizer.json's truncation and padding: not applied to documents
    cut.enable_truncation(8)
    cut.enable_padding(length=16)
    cut.save(str(tmp_path / "cut.json"))
    tokenize_to_dataset([str(tmp_path / "long.txt")], str(tmp_path / "cut.json"), str(tmp_path / "cut"), progress=False)
    assert TokenDataset(tmp_path / "cut").tokens[:-1].tolist() == tokenizer.encode(" ".join(texts)).ids
    (tmp_path / "eos.txt").write_text("a text about <|endoftext|>, the token")  # the EOS text in a document: text
    tokenize_to_dataset([str(tmp_path / "eos.txt")], tokenizer_file, str(tmp_path / "eos"), progress=False)
    ids = TokenDataset(tmp_path / "eos").tokens.tolist()
    assert ids.count(0) == 1 and tokenizer.decode(ids[:-1]) == (tmp_path / "eos.txt").read_text()
    # a huge line without a space, one word to BPE's trainer, which is quadratic in a word's length: trained in pieces
    started = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "x" alone fills few tokens
        train_bpe(["x" * 200_000], 300, str(tmp_path / "x.json"))
    assert time.perf_counter() - started < 5  # whole: 17 s (20 MB: hours)


def test_eos_named_by_tokenizer_config(tmp_path):
    """An EOS of another name (DeepSeek's) is the eos_token of the tokenizer_config.json beside tokenizer.json; with
    neither, the dataset has no separator between documents, and tokenize says so."""
    eos = "<\uff5cend\u2581of\u2581sentence\uff5c>"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tokenizer = train_bpe(["alpha beta gamma"] * 20, 300, str(tmp_path / "hf" / "tokenizer.json"), eos_token=eos)
    (tmp_path / "hf" / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": eos}}))
    (tmp_path / "doc.txt").write_text("gamma beta alpha")
    text = str(tmp_path / "doc.txt")
    assert tokenize_to_dataset([text], tokenizer, str(tmp_path / "a"), progress=False)["eos_id"] == 0
    (tmp_path / "hf" / "tokenizer_config.json").unlink()
    with pytest.warns(UserWarning, match="no end-of-document token"):
        assert tokenize_to_dataset([text], tokenizer, str(tmp_path / "b"), progress=False)["eos_id"] is None


def test_unigram_entropy(tmp_path):
    rng = np.random.default_rng(9)
    docs = [rng.zipf(1.5, size=int(rng.integers(1, 200))) % 300 for _ in range(50)]
    ds = make_dataset(tmp_path, docs, vocab_size=300, eos_id=None)
    counts = Counter(int(t) for doc in docs for t in doc)
    n = sum(counts.values())
    expected = -sum(c / n * math.log(c / n) for c in counts.values())
    assert unigram_entropy(ds) == pytest.approx(expected, rel=1e-12)


def test_cli(tmp_path, capsys, monkeypatch):
    parser = argparse.ArgumentParser()
    add_tokenize_args(parser)
    out = str(tmp_path / "out")
    with pytest.raises(UserError, match="INPUT"):
        run_tokenize(parser.parse_args(["--out", out, "--train-tokenizer"]))
    with pytest.raises(UserError, match="--tokenizer"):
        run_tokenize(parser.parse_args(["x.txt", "--out", out]))
    with pytest.raises(UserError, match="nope.txt"):
        run_tokenize(parser.parse_args([str(tmp_path / "nope.txt"), "--out", out, "--train-tokenizer"]))

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    rng = np.random.default_rng(10)
    words = ["alpha", "beta", "gamma", "delta", "mixture", "expert", "router"]
    for i in range(20):
        (corpus / f"{i:02d}.txt").write_text(" ".join(rng.choice(words, size=200)))
    args = parser.parse_args([str(corpus), "--out", out, "--train-tokenizer", "--vocab-size", "300"])
    lengths = []  # of the texts BPE trains on: a document longer than PIECE_CHARS comes in pieces, as it is encoded
    # (7 words cannot fill 300 tokens; a log's progress lines every LOG_INTERVAL s, here at once)

    def train_on_pieces(texts, *args, **kwargs):
        texts = list(texts)
        lengths.extend(map(len, texts))
        return train_bpe(texts, *args, **kwargs)

    with pytest.warns(UserWarning, match="of the 300 requested"), mock.patch("pithtrain.tools.tokenize.PIECE_CHARS", 100), \
            mock.patch("pithtrain.tools.tokenize.train_bpe", train_on_pieces), mock.patch.object(Progress, "LOG_INTERVAL", 0):
        assert run_tokenize(args) == 0
    assert len(lengths) > 20 and max(lengths) < 120
    printed, said = capsys.readouterr()
    assert "20 docs" in printed and "unigram entropy" in printed
    assert "BPE reads: 20 docs" in said and "BPE: computing the merges ...\n" in said, said  # in a log too
    ds = TokenDataset(out)
    assert ds.num_docs == 20 and 257 < ds.vocab_size < 300 and ds.tokenizer_file is not None
    # an existing dataset is replaced only with --overwrite; other files never
    (tmp_path / "corpus2.txt").write_text("just one document, different from the others")
    again = [str(tmp_path / "corpus2.txt"), "--out", out, "--tokenizer", ds.tokenizer_file]
    with pytest.raises(UserError, match="already holds a dataset.*--overwrite"):
        run_tokenize(parser.parse_args(again))
    assert TokenDataset(out).num_docs == 20
    assert run_tokenize(parser.parse_args([*again, "--overwrite"])) == 0 and TokenDataset(out).num_docs == 1
    # a tokenize into an --out another one is writing is refused before any work (the lock beside --out names the
    # writer) and leaves the lock; one whose writer is gone is taken over, and removed at the end
    busy = tmp_path / f"busy{rng.integers(1000)}"
    lock = tmp_path / f".{busy.name}.lock"
    with subprocess.Popen(["sleep", "60"]) as other:
        lock.write_text(held := f"{other.pid} {start_time(other.pid)}")
        with pytest.raises(UserError, match=rf"{busy.name} is being written by pid {other.pid} .*wait for it"):
            run_tokenize(parser.parse_args([*again[:1], "--out", str(busy), *again[3:]]))
        other.kill()
    assert not busy.exists() and lock.read_text() == held
    assert run_tokenize(parser.parse_args([*again[:1], "--out", str(busy), *again[3:]])) == 0
    assert TokenDataset(busy).num_docs == 1 and not lock.exists()
    lock.write_text("")  # a writer killed between making the lock and writing its pid: refused while fresh, then taken over
    with pytest.raises(UserError, match=r"being written by pid \?"):
        run_tokenize(parser.parse_args([*again[:1], "--out", str(busy), *again[3:], "--overwrite"]))
    os.utime(lock, (time.time() - 61 - rng.integers(1000),) * 2)
    assert run_tokenize(parser.parse_args([*again[:1], "--out", str(busy), *again[3:], "--overwrite"])) == 0 and not lock.exists()
    (Path(out) / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="notes.txt"):
        run_tokenize(parser.parse_args([*again, "--overwrite"]))
    here = tmp_path / "here"  # --out . in an empty directory: filled, not replaced (the shell stands in it)
    here.mkdir()
    monkeypatch.chdir(here)
    assert run_tokenize(parser.parse_args([*again[:1], "--out", ".", *again[3:]])) == 0
    assert TokenDataset(".").num_docs == 1 and "wrote ." in capsys.readouterr().out
    # --out . --overwrite of the dataset the shell stands in: refused before any work, the directory itself kept
    inode, names = os.stat(".").st_ino, sorted(os.listdir("."))
    for out_here in (".", str(here), "./"):
        with pytest.raises(UserError, match=r"--out .*current directory.*cd \.\."):
            run_tokenize(parser.parse_args([*again[:1], "--out", out_here, *again[3:], "--overwrite"]))
        assert os.stat(".").st_ino == inode and os.getcwd() == str(here) and sorted(os.listdir(".")) == names
