"""`pithtrain tokenize`: turn text files into a token dataset (see pithtrain/train/data.py).

Reads plain-text files, directories, JSON Lines (or a .json array of records), parquet and `datasets`' save_to_disk
directories, optionally trains a byte-level BPE tokenizer on them first, tokenizes with Hugging Face `tokenizers` and
writes the dataset. `--stdlib` uses Python's own standard library sources as a ready-made corpus that needs no download."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import math
import os
import re
import sys
import sysconfig
import tempfile
import time
import warnings
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from pithtrain.config import UserError, disk_error
from pithtrain.train.data import TokenDataset, check_output_dir, dtype_for_vocab, is_dataset, write_dataset, writer_lock

EOS_TOKEN = "<|endoftext|>"
_EOS_CANDIDATES = (EOS_TOKEN, "<|end_of_text|>", "</s>", "<eos>")  # common names of an end-of-document token
PIECE_CHARS = 1 << 22  # characters encoded at once: a batch of documents, or a piece of a longer one (bounded memory)


def _walk_files(root: Path) -> Iterator[Path]:
    """Files under `root`, recursively, sorted, linked directories once each, skipping hidden ones and pithtrain datasets;
    a directory of `datasets`' save_to_disk (a Dataset) comes as itself, and a DatasetDict's is refused."""
    seen = set()
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        if os.path.realpath(dirpath) in seen or is_dataset(dirpath):  # a loop of links, or an earlier output
            dirnames[:] = []
            continue
        seen.add(os.path.realpath(dirpath))
        if "dataset_dict.json" in filenames:
            raise UserError(f"input {dirpath} is a Hugging Face DatasetDict (splits {', '.join(sorted(dirnames))}); "
                            f"pass one split's directory, e.g. {Path(dirpath) / 'train'}")
        if {"state.json", "dataset_info.json"} <= set(filenames):
            dirnames[:] = []
            yield Path(dirpath)
            continue
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))  # in place: prunes the walk
        yield from (Path(dirpath) / name for name in sorted(filenames) if not name.startswith("."))


def _input_files(paths: list[Path]) -> Iterator[Path]:
    for path in paths:
        yield from _walk_files(path) if path.is_dir() else [path]


def _table_batches(file: Path, text_field: str) -> Iterator[list]:
    """The text column of a parquet file (pyarrow) or a save_to_disk directory (`datasets`), batch by
    batch: bounded memory. A missing reader library or column is an error naming the file."""
    module = "datasets" if file.is_dir() else "pyarrow"
    try:
        reader = importlib.import_module("datasets" if file.is_dir() else "pyarrow.parquet")
    except ImportError:
        raise UserError(f"input {file} is {'a Hugging Face dataset (save_to_disk)' if file.is_dir() else 'parquet'}: reading it "
                        f"needs the {module} package; pip install {module} (or pip install -e '.[data]')") from None
    try:
        table = reader.load_from_disk(str(file)) if file.is_dir() else reader.ParquetFile(file)
    except Exception as e:  # the libraries' errors name no file
        raise ValueError(f"{file}: not a readable {module} dataset ({e})") from None
    if text_field not in (columns := table.column_names if file.is_dir() else table.schema_arrow.names):
        raise ValueError(f"{file}: no column {text_field!r} (it has {', '.join(columns)}); pass --text-field")
    feature = table.features[text_field] if file.is_dir() else table.schema_arrow.field(text_field).type
    kind = str(getattr(feature, "dtype", type(feature).__name__) if file.is_dir() else feature)
    if kind not in ("string", "large_string", "string_view"):  # checked once: its batches then hold strings or None
        raise ValueError(f"{file}: column {text_field!r} holds {kind}, expected strings; pass --text-field with the column that holds the text")
    return ((batch[text_field] for batch in table.iter(1024)) if file.is_dir()
            else (batch.column(0).to_pylist() for batch in table.iter_batches(1024, columns=[text_field])))


def iter_documents(inputs: list[str], text_field: str = "text") -> Iterator[str]:
    """Documents from files and directories: obj[text_field] of each line of a JSON Lines file (.jsonl/.json) or item of a
    .json array, the column text_field of parquet files and `datasets`' save_to_disk directories, any other file's whole
    text. Empty documents (a null text too) and non-UTF-8 files (an error for a .jsonl) are skipped, the files counted in
    a warning, as are FIFOs, devices and broken links (never read)."""
    paths = [Path(p) for p in ([inputs] if isinstance(inputs, (str, os.PathLike)) else inputs)]  # one path given alone
    if missing := next((path for path in paths if not path.exists()), None):  # all up front: a typo fails before hours of work
        raise UserError(f"input {missing} not found; check the path")  # a UserError: no write failed (disk_error)
    skipped, special = [], []
    for file in _input_files(paths):
        if file.is_dir() or file.suffix.lower() == ".parquet":
            for batch in _table_batches(file, text_field):  # a column batch by batch (of strings): bounded memory
                yield from (text for text in batch if text)
            continue
        if not file.is_file():  # reading a FIFO or a device would block or never end
            special.append(file)
            continue
        if file.suffix.lower() == ".jsonl":  # line by line: a file of many GB in bounded memory
            try:
                with open(file, encoding="utf-8-sig", newline="\n") as lines:
                    yield from _json_lines(file, lines, text_field)
            except UnicodeDecodeError:
                raise ValueError(f"{file}: not UTF-8 text; re-encode it as UTF-8, or leave it out") from None
            continue
        try:
            text = file.read_bytes().decode("utf-8-sig")  # a byte order mark (Windows editors write one) is no text
        except UnicodeDecodeError:
            skipped.append(file)
            continue
        if file.suffix.lower() == ".json":
            yield from _json_texts(file, text, text_field)
        elif text:
            yield text
    for files, what in ((skipped, "that are not UTF-8 text"), (special, "that are not regular files (FIFOs, devices, broken links)")):
        if files:
            warnings.warn(f"skipped {len(files)} file(s) {what}, e.g. {files[0]}")  # here: said once for both passes


def _record_text(where: str, obj, text_field: str) -> str:
    """obj[text_field] of one JSON record, or a one-line error naming where it is."""
    if not isinstance(obj, dict):
        kind = {str: "string", list: "array", bool: "boolean", type(None): "null"}.get(type(obj), "number")
        raise ValueError(f"{where}: a JSON {kind}, expected an object with field {text_field!r}; "
                         f'write each text as {{"{text_field}": ...}}')
    if text_field not in obj:
        raise ValueError(f"{where}: no field {text_field!r}; pass --text-field with the field that holds the text")
    if (value := obj[text_field]) is None:  # no text, as a parquet column's null: skipped like an empty one
        return ""
    if not isinstance(value, str):
        raise ValueError(f"{where}: field {text_field!r} is {type(value).__name__}, expected a string")
    return value


def _json_texts(file: Path, text: str, text_field: str) -> Iterator[str]:
    """A .json file that is one JSON document: its array of records (or its one record). Otherwise JSON Lines, one
    record a line (`datasets`' to_json writes these to .json files too)."""
    doc = None
    with contextlib.suppress(json.JSONDecodeError):  # JSON Lines fail at the first line's end: cheap
        doc = json.loads(text)
    if doc is not None:
        for i, obj in enumerate(doc if isinstance(doc, list) else [doc]):
            if value := _record_text(f"{file}: item {i}" if isinstance(doc, list) else str(file), obj, text_field):
                yield value
        return
    yield from _json_lines(file, text.split("\n"), text_field)  # not splitlines: U+2028 and others may be inside a text


def _json_lines(file: Path, lines: Iterable[str], text_field: str) -> Iterator[str]:
    """obj[text_field] of each line of a JSON Lines file (`lines` split at "\n" only)."""
    for line_no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{file}:{line_no}: not valid JSON ({e.msg}); expected one JSON object per line"
                             + (" or one JSON array of objects" if file.suffix.lower() == ".json" else "")) from None
        if value := _record_text(f"{file}:{line_no}", obj, text_field):
            yield value


def stdlib_corpus_files(max_bytes: int = 20_000_000) -> list[str]:
    """The standard library's .py files (sorted, site-packages excluded), up to `max_bytes` in total."""
    # Inside a venv sys.prefix points at the venv; the stdlib sources live under the base prefix.
    base = sys.base_prefix
    stdlib = Path(sysconfig.get_paths(vars={"base": base, "installed_base": base, "platbase": base})["stdlib"])
    files, total = [], 0
    for dirpath, dirnames, filenames in os.walk(stdlib):  # nothing if it is missing
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__") and not d.startswith("."))
        for name in sorted(name for name in filenames if name.endswith(".py")):
            if total >= max_bytes:
                return files
            files.append(os.path.join(dirpath, name))
            total += os.path.getsize(files[-1])
    if not files:
        raise FileNotFoundError(f"no .py files found in the standard library directory {stdlib}; pass text files as INPUT instead of --stdlib")
    return files


def train_bpe(texts: Iterable[str], vocab_size: int, out_file: str, eos_token: str = EOS_TOKEN) -> str:
    """Train a byte-level BPE tokenizer on `texts` and save it as `out_file` (tokenizer.json): every string round-trips
    exactly through encode/decode. `eos_token` is the only special token and gets id 0; the 256 byte symbols follow, then
    the learned merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + 1:
        raise ValueError(f"vocab_size {vocab_size} is too small for byte-level BPE: need at least {len(alphabet) + 1} (256 bytes + EOS)")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[eos_token], initial_alphabet=alphabet, show_progress=sys.stderr.isatty())
    # its time grows with the square of a word's length (20 MB without a space took hours): runs of 4096 non-spaces cut
    tokenizer.train_from_iterator((piece for text in texts for piece in re.split(r"(\S{4096})", text) if piece), trainer=trainer)
    if tokenizer.get_vocab_size() < vocab_size:  # BPE stops when no pair occurs twice: a tiny corpus
        warnings.warn(f"the corpus only supported {tokenizer.get_vocab_size()} of the {vocab_size} requested tokens; use more text", stacklevel=2)
    try:
        Path(out_file).parent.mkdir(parents=True, exist_ok=True)
        tokenizer.save(str(out_file))
    except Exception as e:  # tokenizers raises plain Exceptions naming the OS error
        Path(out_file).unlink(missing_ok=True)
        raise disk_error(e, out_file) or e
    return str(out_file)


class Progress:
    """One status line on stderr, redrawn at most ~10x/s on a terminal (every LOG_INTERVAL s otherwise)."""

    LOG_INTERVAL = 30.0

    def __init__(self, enabled: bool = True, stream=None, label: str = "tokenize"):
        self.stream, self.enabled, self.label = stream or sys.stderr, enabled, label
        self.tty = getattr(self.stream, "isatty", lambda: False)()
        self.interval = 0.1 if self.tty else self.LOG_INTERVAL
        self.docs = self.bytes = self.tokens = 0  # done so far
        self.start = self.last = time.perf_counter()
        self.width = 0  # of the last line drawn, so a shorter redraw can blank its tail

    def update(self, docs: int, nbytes: int, tokens: int) -> None:
        self.docs, self.bytes, self.tokens = self.docs + docs, self.bytes + nbytes, self.tokens + tokens
        if self.enabled and time.perf_counter() - self.last >= self.interval:
            self._draw(end="\r" if self.tty else "\n")

    def close(self) -> None:
        if self.enabled:
            self._draw(end="\n")

    def _draw(self, end: str) -> None:
        self.last = time.perf_counter()
        elapsed = max(self.last - self.start, 1e-9)
        line = (f"{self.label}: {self.docs:,} docs ({self.docs / elapsed:,.0f}/s)  {self.bytes / 1e6:,.1f} MB "
                f"({self.bytes / 1e6 / elapsed:,.1f} MB/s)  {f'{self.tokens:,} tokens  ' if self.tokens else ''}{elapsed:.1f}s")
        print(line.ljust(self.width), end=end, file=self.stream, flush=True)
        self.width = len(line)


def _batched(texts: Iterable[str], size: int) -> Iterator[list[str]]:
    """Lists of up to `size` texts and about PIECE_CHARS characters, a longer text alone: bounded memory with huge files."""
    batch, chars = [], 0
    for text in texts:
        if len(text) > PIECE_CHARS:
            yield from [batch, [text]] if batch else [[text]]
            batch, chars = [], 0
            continue
        batch.append(text)
        chars += len(text)
        if len(batch) == size or chars >= PIECE_CHARS:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


SPACE = re.compile(r"(?<=\S) ")  # where _pieces cuts: before a space that follows a non-space


def _pieces(text: str, size: int, cut: re.Pattern | None = SPACE) -> Iterator[str]:
    """`text` in pieces of at least `size` characters, each cut before a space that follows a non-space: there the
    pre-tokenizers of byte-level BPE (GPT-2's, Llama 3's, Qwen's, DeepSeek's, o200k's) start a new word anyway, so the
    pieces' ids are the whole text's (encoding 40 MB at once took 4.4 GB); a text without such a space stays whole.
    Another `cut` (_prepend_cut's) leaves the space there out; None: the text whole."""
    start = 0
    while cut is not None and (found := cut.search(text, start + size)) is not None:
        yield text[start:found.start()]
        start = found.start() + (cut is not SPACE)
    yield text[start:]


def _prepend_cut(tokenizer, ids) -> re.Pattern | None:
    """Where a BPE whose normalizer prepends "▁" to every text and turns spaces into "▁" (Llama 2's) may cut a text with
    the whole text's ids, the space there left out (the next piece gets its "▁" prepended): where no token joins the
    character before to that "▁" (so no merge crosses it) and no added token (they split the text, each part gets a "▁")
    touches the space; None where that cannot be said."""
    added = tokenizer.get_added_tokens_decoder().values()
    if (type(tokenizer.model).__name__ != "BPE" or tokenizer.normalizer is None or ids("a b") != ids("a") + ids("b")
            or tokenizer.normalizer.normalize_str("a b") != "\u2581a\u2581b"
            or any(re.search("[^\u2581]\u2581", t) for t in tokenizer.get_vocab())
            or any(a.lstrip or a.rstrip or re.search("[\\s\u2581]", a.content) for a in added)):
        return None
    last, first = (re.escape("".join({a.content[i] for a in added if a.content})) for i in (-1, 0))
    return re.compile(f"(?<=[^\\s\u2581{last}]) (?=[^\\s\u2581{first}])")


def tokenize_to_dataset(inputs: list[str], tokenizer_file: str, out_dir: str, text_field: str = "text", batch_size: int = 1000,
                        progress: bool = True) -> dict:
    """Tokenize every document of `inputs` with `tokenizer_file` into a dataset at `out_dir`; returns its meta. Special
    tokens (BOS etc.) are not added; the EOS token alone ends each document (`<|endoftext|>` or another common EOS name of
    the vocabulary, else the eos_token of a tokenizer_config.json beside the tokenizer; none, with a warning, if absent)."""
    from tokenizers import Tokenizer

    try:
        tokenizer = Tokenizer.from_file(str(tokenizer_file))
    except Exception as e:  # tokenizers raises plain Exceptions (a missing file too)
        raise UserError(f"{tokenizer_file} is not a tokenizer ({e}); pass a tokenizer.json of Hugging Face tokenizers") from None
    tokenizer.no_truncation(), tokenizer.no_padding()  # a hub tokenizer.json's: every document whole, nothing added
    # ids may have gaps: the dataset's vocabulary must hold the largest, not just count them
    vocab_size = max(tokenizer.get_vocab_size(), 1 + max(tokenizer.get_vocab().values(), default=-1))
    dtype, status = dtype_for_vocab(vocab_size), Progress(enabled=progress)
    # encode_batch_fast (tokenizers >= 0.21) skips computing character offsets we do not need.
    encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
    ids = lambda text: encode([text], add_special_tokens=False)[0].ids  # noqa: E731
    # pieces cut before a space have the whole text's ids, unless its normalizer prepends to every text (Llama 2's "▁")
    cut = SPACE if ids("a b") == ids("a") + ids(" b") else _prepend_cut(tokenizer, ids)

    def encoded(texts: list[str]) -> list[np.ndarray]:
        arrays = [np.array(e.ids, dtype=dtype) for e in encode(texts, add_special_tokens=False)]  # parallel in Rust
        for i in [i for i, a in enumerate(arrays) if eos_id is not None and (a == eos_id).any()]:  # the EOS text in a text:
            tokenizer.encode_special_tokens = True  # its special tokens encoded as text, so that EOS alone ends documents
            arrays[i] = np.array(encode([texts[i]], add_special_tokens=False)[0].ids, dtype=dtype)
            tokenizer.encode_special_tokens = False
        return arrays

    def token_arrays() -> Iterator[np.ndarray]:
        for texts in _batched(iter_documents(inputs, text_field), batch_size):
            if len(texts[0]) > PIECE_CHARS:  # one long document (a single huge line): its pieces in turn, with progress
                parts = []
                if cut is None:
                    warnings.warn(f"{tokenizer_file}: a document of {len(texts[0]):,} characters is encoded whole (its "
                                  "tokenizer's pieces of text may not be cut): about 70 bytes of memory a character")
                for piece in _pieces(texts[0], PIECE_CHARS, cut):
                    parts.append(encoded([piece])[0])
                    status.update(0, len(piece.encode("utf-8")), parts[-1].size)
                status.update(1, 0, eos_id is not None)  # as write_dataset counts: a document's EOS too
                yield np.concatenate(parts)
                continue
            arrays = encoded(texts)
            status.update(len(texts), sum(len(t.encode("utf-8")) for t in texts),
                          sum(a.size for a in arrays) + len(texts) * (eos_id is not None))
            yield from arrays

    try:
        eos_id = next((i for token in _EOS_CANDIDATES if (i := tokenizer.token_to_id(token)) is not None), None)
        if eos_id is None:  # another name (DeepSeek's <｜end▁of▁sentence｜>): the eos_token of an HF tokenizer_config.json beside it
            eos = None
            with contextlib.suppress(OSError, ValueError, AttributeError):  # none, not JSON, not an object
                eos = json.loads(Path(tokenizer_file).with_name("tokenizer_config.json").read_text()).get("eos_token")
            eos_id = tokenizer.token_to_id(eos.get("content", "") if isinstance(eos, dict) else str(eos or ""))
        if eos_id is None:
            warnings.warn(f"{tokenizer_file} has no end-of-document token ({', '.join(_EOS_CANDIDATES)}, or the eos_token of a "
                          "tokenizer_config.json beside it): documents are written back to back, with nothing between them")
        return write_dataset(out_dir, token_arrays(), vocab_size, eos_id, tokenizer_file=str(tokenizer_file))
    finally:
        status.close()


def unigram_entropy(dataset: TokenDataset) -> float:
    """Entropy (nats/token) of the dataset's token frequencies: the loss of the best model that
    ignores context, so a trained model's loss must go below it."""
    counts = np.zeros(dataset.vocab_size, dtype=np.int64)
    chunk = 1 << 23  # bincount widens to int64: 8M tokens = 64 MB at a time
    for start in range(0, dataset.num_tokens, chunk):
        counts += np.bincount(dataset.tokens[start : start + chunk], minlength=dataset.vocab_size)[: dataset.vocab_size]
    p = counts[counts > 0] / dataset.num_tokens
    return float(-(p * np.log(p)).sum())


def add_tokenize_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("inputs", nargs="*", metavar="INPUT", help="text files, directories (recursive), .jsonl, .json or "
                        ".parquet files, or directories of datasets' save_to_disk")
    parser.add_argument("--out", required=True, metavar="DIR", help="dataset directory to write (new or empty)")
    parser.add_argument("--overwrite", action="store_true", help="replace the dataset at --out (never other files)")
    parser.add_argument("--tokenizer", metavar="FILE", help="an existing tokenizer.json")
    parser.add_argument("--train-tokenizer", action="store_true", help="train a byte-level BPE on the inputs first (saved as OUT/tokenizer.json)")
    parser.add_argument("--vocab-size", type=int, metavar="N", help="vocabulary size for --train-tokenizer (default 4096)")
    parser.add_argument("--stdlib", action="store_true", help="add Python's standard library sources as inputs")
    parser.add_argument("--max-bytes", type=int, help="with --stdlib: whole files up to about this many bytes (default 20 MB)")
    parser.add_argument("--text-field", default="text", help="JSON Lines field or parquet/dataset column holding the text (default: text)")


def _argument_error(args) -> str | None:
    """What is wrong with the arguments, checked before any expensive work; None if all is fine."""
    if not args.inputs and not args.stdlib:
        return "give INPUT files/directories or --stdlib"
    if bool(args.tokenizer) == bool(args.train_tokenizer):
        return "give exactly one of --tokenizer FILE or --train-tokenizer"
    if args.vocab_size is not None and not args.train_tokenizer:
        return "--vocab-size only applies with --train-tokenizer (an existing tokenizer fixes its own vocabulary)"
    if args.vocab_size is not None and not 257 <= args.vocab_size <= 2**24:  # tokenizers' trainer reserves memory for each
        return (f"--vocab-size {args.vocab_size}: byte-level BPE needs at least 257 (256 bytes + EOS), and at most 2**24 "
                "(16,777,216): the trainer reserves about 70 bytes a token up front (a billion aborted after 70 GB)")
    if args.max_bytes is not None and not args.stdlib:
        return "--max-bytes only applies with --stdlib (your INPUT files are read whole)"
    if args.max_bytes is not None and args.max_bytes < 1:
        return f"--max-bytes {args.max_bytes}: must be at least 1"
    if args.tokenizer and not Path(args.tokenizer).is_file():
        what = ("is a directory: pass its tokenizer.json" if Path(args.tokenizer).is_dir() else
                "is not a regular file: pass a tokenizer.json" if Path(args.tokenizer).exists() else "not found")
        return f"--tokenizer {args.tokenizer} {what}"
    if missing := next((p for p in args.inputs if not Path(p).exists()), None):
        return f"input {missing} not found"
    try:
        check_output_dir(args.out)
    except FileExistsError as e:
        return f"--out: {e}"
    if Path(args.out).is_dir() and any(Path(args.out).iterdir()) and not args.overwrite:
        return f"--out {args.out} already holds a dataset; choose a new directory, or pass --overwrite to replace it"
    if Path(args.out).is_dir() and any(Path(args.out).iterdir()) and Path.cwd().is_relative_to(Path(args.out).resolve()):
        # replacing renames the directory away: the shell would stand in a deleted one
        return (f"--out {args.out} is the current directory (or holds it), and --overwrite would swap it out from under "
                f"the shell; cd .. and pass --out {Path(args.out).resolve().name} --overwrite")
    above = next(p for p in Path(os.path.abspath(args.out)).parents if p.exists())  # where the dataset is made, then renamed
    if not above.is_dir() or not os.access(above, os.W_OK):
        return f"--out {args.out}: {above} is not a writable directory; choose another --out"
    for file in _input_files([Path(p) for p in args.inputs]):  # every parquet file and save_to_disk directory opens,
        if file.is_dir() or file.suffix.lower() == ".parquet":  # with a text column of strings
            _table_batches(file, args.text_field)
    if not args.stdlib and next(iter_documents(args.inputs, args.text_field), None) is None:
        return f"no text in {', '.join(args.inputs)}: no files there, or only empty, hidden or non-UTF-8 ones or pithtrain datasets"
    return None


def run_tokenize(args) -> int:
    """Run `pithtrain tokenize`; bad arguments raise a UserError before any work."""
    if error := _argument_error(args):
        raise UserError(f"pithtrain tokenize: {error}")
    started, out = time.perf_counter(), os.path.abspath(args.out)
    inputs = list(args.inputs) + (stdlib_corpus_files(args.max_bytes or 20_000_000) if args.stdlib else [])
    with writer_lock(out), tempfile.TemporaryDirectory() as scratch:  # a second tokenize into --out refused before any work
        tokenizer_file = args.tokenizer
        if args.train_tokenizer:
            vocab_size = args.vocab_size or 4096
            print(f"training byte-level BPE (vocab {vocab_size}) on {len(inputs)} input(s) ...", flush=True)
            # Trained into scratch space; write_dataset copies it to OUT/tokenizer.json with the data.
            # its texts in the pieces they are encoded in; a long reading said every 30 s in a log (tokenizers' bar: a terminal's)
            reading = Progress(enabled=not sys.stderr.isatty(), label="BPE reads")

            def texts() -> Iterator[str]:
                for text in iter_documents(inputs, args.text_field):
                    for piece in _pieces(text, PIECE_CHARS):
                        reading.update(0, len(piece.encode("utf-8")), 0)
                        yield piece
                    reading.update(1, 0, 0)
                if reading.enabled and reading.last > reading.start:  # said: a long read, then long merges
                    reading.close()
                    print("BPE: computing the merges ...", file=sys.stderr, flush=True)

            tokenizer_file = train_bpe(texts(), vocab_size, os.path.join(scratch, "tokenizer.json"))
        meta = tokenize_to_dataset(inputs, tokenizer_file, args.out, text_field=args.text_field)
    entropy = unigram_entropy(TokenDataset(out))
    print(f"wrote {args.out}: {meta['num_docs']:,} docs, {meta['num_tokens']:,} tokens ({meta['dtype']}), "
          f"vocab {meta['vocab_size']}, eos_id {meta['eos_id']}\n"
          f"unigram entropy {entropy:.4f} nats/token ({entropy / math.log(2):.3f} bits): a trained model's loss should go below this\n"
          f"elapsed {time.perf_counter() - started:.1f}s")
    return 0
