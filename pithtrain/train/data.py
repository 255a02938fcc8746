"""Token datasets on disk and the batches the trainer reads from them.

A dataset is a directory written by `write_dataset` (usually via `pithtrain tokenize`):
  tokens.bin       every document's tokens back to back (each followed by EOS if the dataset
                   has one), raw, in the smallest unsigned dtype that holds the vocabulary
  doc_offsets.npy  int64 [num_docs + 1]; doc i is tokens[doc_offsets[i]:doc_offsets[i + 1]]
  meta.json        {"format": "pithtrain-tokens-v1", "dtype", "vocab_size", "num_tokens",
                    "num_docs", "eos_id", "max_token_id", "tokenizer"}
  tokenizer.json   optional copy of the tokenizer ("tokenizer" in meta names it)

`BatchLoader` cuts the token stream into fixed windows of seq_len + 1 tokens and serves them in a seeded, per-epoch
shuffled order that is a pure function of the step: any step can be re-created after a restart without replaying
history. `BlendLoader` interleaves several datasets by weight (data.path as a blend), with the same property."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import shutil
import time
from array import array
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
import torch

from pithtrain.config import UserError, data_parts, disk_error
from pithtrain.train.rundir import alive, start_time

FORMAT = "pithtrain-tokens-v1"
TOKENS_FILE, OFFSETS_FILE, META_FILE, TOKENIZER_FILE = "tokens.bin", "doc_offsets.npy", "meta.json", "tokenizer.json"
DATASET_FILES = {TOKENS_FILE, OFFSETS_FILE, META_FILE, TOKENIZER_FILE}
_FLUSH_TOKENS = 1 << 20  # buffer about a million tokens between writes: few syscalls, bounded memory
_SCAN_TOKENS = 1 << 24  # check_vocab reads tokens.bin in chunks of this many tokens: bounded memory
_RETOKENIZE = "re-run `pithtrain tokenize` to rebuild the dataset"
BLEND_PERIOD = 1 << 16  # stream positions after which a blend's interleave repeats: weights exact to 1/65536


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """Smallest unsigned dtype that can store every id in [0, vocab_size)."""
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    for dtype in (np.uint8, np.uint16, np.uint32):
        if vocab_size <= np.iinfo(dtype).max + 1:
            return np.dtype(dtype)
    raise ValueError(f"vocab_size {vocab_size} does not fit in uint32 token ids")


def is_dataset(path) -> bool:
    """Whether directory `path` holds a pithtrain dataset: its meta.json says so (format)."""
    try:
        return json.loads((Path(path) / META_FILE).read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):  # no meta.json, not JSON, not a JSON object
        return False


def check_output_dir(path) -> None:
    """Refuse to overwrite a directory that holds anything besides a previous dataset (its meta.json marks one)."""
    path = Path(path)
    if not path.exists():
        return
    if not path.is_dir():
        raise FileExistsError(f"{path} exists and is not a directory; choose another output path")
    if foreign := sorted(p.name for p in path.iterdir() if p.name not in DATASET_FILES or not is_dataset(path)):
        raise FileExistsError(f"{path} already holds files that are not part of a pithtrain dataset "
                              f"({', '.join(foreign[:5])}); choose an empty or new output directory")


@contextlib.contextmanager
def writer_lock(path):
    """One writer for dataset directory `path`: `.NAME.lock` beside it, made with O_EXCL and removed at the end, so a
    second writer is refused instead of replacing the first's output; one left by a process gone is taken over."""
    path = Path(os.path.abspath(path))
    lock, me, made, held = path.parent / f".{path.name}.lock", f"{os.getpid()} {start_time(os.getpid())}", False, []
    with contextlib.suppress(OSError):
        held = lock.read_text().split()  # empty: its writer is just starting
    if " ".join(held) == me:  # ours: a nested call (tokenize, then write_dataset)
        yield
        return
    with contextlib.suppress(OSError):  # its writer gone, or (empty for a minute) gone between making and writing it
        if len(held) == 2 and held[0].isdigit() and not alive(int(held[0]), held[1]) or \
                not held and time.time() - lock.stat().st_mtime > 60:
            lock.unlink()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(os.open(lock, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644), "w") as f:  # closed on a failed write too
            made = True
            f.write(me)
    except FileExistsError:
        raise UserError(f"{path} is being written by pid {held[0] if held else '?'} (lock {lock}); wait for it to end "
                        "(or delete the lock if it is gone), or choose another output directory") from None
    except OSError as e:
        if made:
            lock.unlink(missing_ok=True)
        raise disk_error(e, path, removed=lock if made else None, then="run again or choose another output") or e
    try:
        yield
    finally:
        lock.unlink(missing_ok=True)


def write_dataset(path, docs: Iterable[Sequence[int] | np.ndarray], vocab_size: int, eos_id: int | None,
                  tokenizer_file: str | None = None) -> dict:
    """Stream `docs` (lists/arrays of token ids) into a dataset directory at `path`, EOS (if not None) after each
    document; returns its meta. It is built in a hidden temporary directory beside `path`, then renamed over it (a crash
    never leaves a half dataset; an existing dataset at `path` is replaced)."""
    path = Path(os.path.abspath(path))  # absolute, so "." or "out/" still has a name and a parent to rename in
    dtype = dtype_for_vocab(vocab_size)
    if eos_id is not None and not 0 <= eos_id < vocab_size:
        raise ValueError(f"eos_id {eos_id} is outside the vocabulary [0, {vocab_size})")
    if tokenizer_file is not None and not Path(tokenizer_file).is_file():
        raise FileNotFoundError(f"tokenizer file {tokenizer_file} not found")
    with writer_lock(path):  # before the stale staging directories: a live writer's is not ours to remove
        check_output_dir(path)
        tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
        for stale in path.parent.glob(f".{path.name}.tmp-*"):  # this pid's, and those of writers since killed
            if stale == tmp or ((pid := stale.name.rsplit("-", 1)[1]).isdigit() and not alive(int(pid))):
                shutil.rmtree(stale, ignore_errors=True)
        try:
            tmp.mkdir(parents=True)
            eos = None if eos_id is None else np.array([eos_id], dtype=dtype)
            offsets = array("q", [0])
            num_tokens, max_token_id = 0, -1 if eos_id is None else eos_id
            buffer, buffered = [], 0
            with open(tmp / TOKENS_FILE, "wb") as out:
                for index, doc in enumerate(docs):
                    if (ids := np.asarray(doc)).ndim != 1:
                        raise ValueError(f"document {index}: expected a 1-D sequence of token ids, got shape {ids.shape}")
                    if ids.size:
                        if ids.dtype.kind not in "iu":
                            raise ValueError(f"document {index}: token ids must be integers, got dtype {ids.dtype}")
                        low, high = int(ids.min()), int(ids.max())
                        if low < 0 or high >= vocab_size:
                            raise ValueError(f"document {index}: token id {low if low < 0 else high} is outside the vocabulary "
                                             f"[0, {vocab_size}); check that vocab_size matches the tokenizer")
                        max_token_id = max(max_token_id, high)
                        buffer.append(ids.astype(dtype, copy=False))
                    if eos is not None:
                        buffer.append(eos)
                    length = ids.size + (eos is not None)
                    num_tokens, buffered = num_tokens + length, buffered + length
                    offsets.append(num_tokens)
                    if buffered >= _FLUSH_TOKENS:
                        out.write(np.concatenate(buffer).tobytes())
                        buffer, buffered = [], 0
                if buffer:
                    out.write(np.concatenate(buffer).tobytes())
            if num_tokens == 0:
                raise ValueError(f"no tokens to write to {path}: the corpus is empty (no documents, or all empty without EOS)")
            np.save(tmp / OFFSETS_FILE, np.frombuffer(offsets, dtype=np.int64))
            if tokenizer_file is not None:
                shutil.copyfile(tokenizer_file, tmp / TOKENIZER_FILE)
            meta = {"format": FORMAT, "dtype": dtype.name, "vocab_size": int(vocab_size), "num_tokens": num_tokens,
                    "num_docs": len(offsets) - 1, "eos_id": eos_id, "max_token_id": max_token_id,
                    "tokenizer": None if tokenizer_file is None else TOKENIZER_FILE}
            (tmp / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
            from pithtrain.train.checkpoint import replace_dir  # only now: its import resets the warnings said once

            check_output_dir(path)  # re-check: something may have appeared while we were writing
            replace_dir(tmp, path)
        except BaseException as e:
            shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(e, Exception) and (failure := disk_error(e, path, removed=tmp, within=tmp)) is not None:
                raise failure from e
            raise
        return meta


def _sha256(path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


class TokenDataset:
    """A dataset directory opened read-only; `tokens` is memory-mapped, so opening is cheap."""

    def __init__(self, path):
        self.path = Path(path)
        if not self.path.is_dir():
            if self.path.exists() and is_dataset(self.path.parent) and self.path.suffix != ".npy":  # not quickstart's eval.npy
                raise FileNotFoundError(f"dataset directory {self.path} is a file of the dataset {self.path.parent}; "
                                        f"name the directory, {self.path.parent}")
            what = ("is a .npy array (those are for `pithtrain eval --tokens`)" if self.path.suffix == ".npy" else "is a file"
                    ) if self.path.exists() else "not found"
            raise FileNotFoundError(f"dataset directory {self.path} {what}; create one with `pithtrain tokenize`"
                                    + (" (the examples' data/stdlib: `make data`)" if self.path.name == "stdlib" else ""))
        if not (meta_path := self.path / META_FILE).is_file():
            fix = _RETOKENIZE if (self.path / TOKENS_FILE).exists() else f"make one of its texts: pithtrain tokenize {self.path} ..."
            raise FileNotFoundError(f"{meta_path} not found: {self.path} is not a pithtrain dataset; {fix}")
        try:
            meta = json.loads(meta_path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{meta_path} is not valid JSON ({e}); {_RETOKENIZE}") from None
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            found = meta.get("format") if isinstance(meta, dict) else None
            raise ValueError(f"{meta_path}: format is {found!r}, expected {FORMAT!r}; {_RETOKENIZE}")
        if missing := [k for k in ("dtype", "vocab_size", "num_tokens", "num_docs", "eos_id", "max_token_id")
                       if k not in meta]:
            raise ValueError(f"{meta_path} lacks {', '.join(missing)}; {_RETOKENIZE}")
        if meta["dtype"] not in ("uint8", "uint16", "uint32"):
            raise ValueError(f"{meta_path}: dtype {meta['dtype']!r} is not uint8/uint16/uint32; {_RETOKENIZE}")
        if bad := [k for k in ("vocab_size", "num_tokens", "num_docs", "max_token_id") if type(meta[k]) is not int]:
            raise ValueError(f"{meta_path}: {bad[0]}={meta[bad[0]]!r} is not an integer; {_RETOKENIZE}")
        self.vocab_size, self.num_tokens = meta["vocab_size"], meta["num_tokens"]
        self.eos_id, self.num_docs, self.max_token_id = meta["eos_id"], meta["num_docs"], meta["max_token_id"]
        dtype = np.dtype(meta["dtype"])

        if not (tokens_path := self.path / TOKENS_FILE).is_file():
            raise FileNotFoundError(f"{tokens_path} not found; {_RETOKENIZE}")
        size, expected = tokens_path.stat().st_size, self.num_tokens * dtype.itemsize
        if size != expected:
            kind = "truncated" if size < expected else "larger than expected"
            raise ValueError(f"{tokens_path} is {kind} (size mismatch: {size} bytes, meta.json says {self.num_tokens} "
                             f"{dtype.name} tokens = {expected} bytes); {_RETOKENIZE}")
        if not self.num_tokens:  # np.memmap refuses an empty file with words about mmap
            raise ValueError(f"{self.path} holds no tokens (meta.json says 0); {_RETOKENIZE} from some text")
        self.tokens = np.memmap(tokens_path, dtype=dtype, mode="r", shape=(self.num_tokens,))

        if not (offsets_path := self.path / OFFSETS_FILE).is_file():
            raise FileNotFoundError(f"{offsets_path} not found; {_RETOKENIZE}")
        try:
            offsets = np.load(offsets_path)  # allow_pickle stays off: a file of objects is damaged, not to be trusted
        except (ValueError, OSError, EOFError) as e:
            raise ValueError(f"{offsets_path} is damaged: not an .npy array ({type(e).__name__}); {_RETOKENIZE}") from None
        if (offsets.ndim != 1 or offsets.dtype != np.int64 or len(offsets) != self.num_docs + 1
                or offsets[0] != 0 or offsets[-1] != self.num_tokens or np.any(np.diff(offsets) < 0)):
            raise ValueError(f"{offsets_path} is inconsistent (need int64 of length num_docs+1 = {self.num_docs + 1}, "
                             f"non-decreasing from 0 to num_tokens = {self.num_tokens}); {_RETOKENIZE}")
        self.doc_offsets = offsets

        self.tokenizer_file = str((self.path / meta["tokenizer"]).resolve()) if meta.get("tokenizer") else None
        if self.tokenizer_file and not os.path.isfile(self.tokenizer_file):
            raise FileNotFoundError(f"{self.tokenizer_file} (named by {meta_path}) not found; {_RETOKENIZE}")

    @functools.cached_property
    def identity(self) -> dict:
        """What this dataset is, as a run records it (when first asked): its real path, the SHA-256 of its
        tokenizer.json (None without one), of its meta.json + doc_offsets.npy (re-tokenizing changes them), and of
        64 blocks of tokens.bin evenly spaced (4 MiB at most read: other texts cut into documents of equal lengths
        leave the other two alike)."""
        content = hashlib.sha256(b"".join(_sha256(self.path / name).encode() for name in (META_FILE, OFFSETS_FILE)))
        tokens, block = self.tokens.view(np.uint8), 1 << 16
        sample = hashlib.sha256(b"".join(tokens[i:i + block].tobytes() for i in
                                         np.linspace(0, max(len(tokens) - block, 0), 64, dtype=np.int64)))
        return {"path": os.path.realpath(self.path), "tokenizer_sha256": self.tokenizer_file and _sha256(self.tokenizer_file),
                "content_sha256": content.hexdigest(), "tokens_sample_sha256": sample.hexdigest()}

    def check_vocab(self, model_vocab_size: int) -> None:
        """Fail early if the data holds ids the model's embedding table cannot look up (step 1 would
        end in an IndexError). Reads all of tokens.bin, since meta.json may not describe the file: a
        chunked max runs at memory speed (measured 20 GB/s from the page cache on one core: about a
        second for 10B uint16 tokens), at disk speed when the file is not cached."""
        chunks = range(0, self.num_tokens, _SCAN_TOKENS)
        high = max((int(self.tokens[i : i + _SCAN_TOKENS].max()) for i in chunks), default=-1)
        if high != self.max_token_id:
            raise UserError(f"{self.path / TOKENS_FILE} holds token id {high} but {META_FILE} says max_token_id is "
                            f"{self.max_token_id}: the files do not belong together; {_RETOKENIZE}")
        if self.max_token_id >= model_vocab_size:
            raise UserError(f"dataset {self.path} contains token id {self.max_token_id} but the model's vocab_size is "
                            f"{model_vocab_size}; set model.vocab_size >= {self.max_token_id + 1} (the tokenizer's "
                            f"vocab_size is {self.vocab_size}) or re-tokenize with a smaller tokenizer")

    def __repr__(self) -> str:
        return f"TokenDataset({str(self.path)!r}, num_tokens={self.num_tokens}, num_docs={self.num_docs}, vocab_size={self.vocab_size})"


class BatchLoader:
    """Global batches of fixed windows, shuffled per epoch; batch `step` depends only on (seed, step). Sample i is the
    window tokens[i*seq_len : i*seq_len + seq_len + 1] (inputs and shifted labels share it). The stream of samples is
    epoch after epoch, each a fresh permutation seeded by (seed, epoch); global batch `step` is stream positions
    [step*G, (step+1)*G)."""

    def __init__(self, dataset: TokenDataset, seq_len: int, global_batch_size: int, seed: int, pack_documents: bool = False,
                 held_out: int = 0, stream: tuple = ()):
        """`held_out`: the last windows of the dataset are left out of the order (eval's; see `windows`).
        `stream`: more seed words (a blend's dataset index), so that blended datasets get independent orders."""
        if seq_len < 1 or global_batch_size < 1:
            raise ValueError(f"data.seq_len ({seq_len}) and train.global_batch_size ({global_batch_size}) must be >= 1")
        self.dataset, self.seq_len, self.global_batch_size = dataset, seq_len, global_batch_size
        self.datasets = [dataset]  # as a blend's (BlendLoader): what a run hashes and records
        self.seed, self.pack_documents, self.stream = seed, pack_documents, stream
        self.num_samples = (dataset.num_tokens - 1) // seq_len - held_out
        if self.num_samples < global_batch_size:
            raise ValueError(
                f"{dataset.path}: its {dataset.num_tokens} tokens give {self.num_samples + held_out} samples of seq_len {seq_len}"
                + (f", {held_out} of them held out for eval (data.eval_samples)," if held_out else ",")
                + (f" fewer than one global batch of {global_batch_size} left to train on; use more data or a smaller "
                   "data.seq_len / train.global_batch_size" + (" / data.eval_samples" if held_out else "") if not stream else
                   " not one sample: in a blend (data.path) it needs one; use more data or a smaller data.seq_len, or "
                   "leave it out of the blend")
            )
        self._perms: dict[int, np.ndarray] = {}  # at most two epochs: a batch can straddle a boundary

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            if len(self._perms) >= 2:
                self._perms.pop(max(self._perms, key=lambda e: abs(e - epoch)))  # drop the farthest epoch
            self._perms[epoch] = np.random.default_rng([self.seed, epoch, *self.stream]).permutation(self.num_samples)
        return self._perms[epoch]

    def sample_index(self, k: int) -> int:
        """Window index of the k-th sample of the stream."""
        epoch, position = divmod(int(k), self.num_samples)
        return int(self._permutation(epoch)[position])

    def _sample_indices(self, stream_positions: np.ndarray) -> np.ndarray:
        epochs, positions = np.divmod(stream_positions, self.num_samples)
        indices = np.empty_like(stream_positions)
        for epoch in np.unique(epochs):
            mask = epochs == epoch
            indices[mask] = self._permutation(int(epoch))[positions[mask]]
        return indices

    def global_batch(self, step: int) -> dict[str, torch.Tensor]:
        """CPU int64 tensors [G, S]: input_ids, labels, position_ids (+ doc_ids when packing)."""
        G = self.global_batch_size
        return self.windows(self._sample_indices(np.arange(step * G, (step + 1) * G, dtype=np.int64)))

    def windows(self, indices: np.ndarray) -> dict[str, torch.Tensor]:
        """The batch of these window indices, in this order (global_batch's layout)."""
        G, S = len(indices), self.seq_len
        token_positions = indices[:, None] * S + np.arange(S + 1, dtype=np.int64)  # [G, S+1] absolute positions
        windows = self.dataset.tokens[token_positions].astype(np.int64)
        batch = {"input_ids": windows[:, :-1], "labels": windows[:, 1:].copy(),
                 "position_ids": np.broadcast_to(np.arange(S, dtype=np.int64), (G, S)).copy()}
        batch = {name: torch.from_numpy(np.ascontiguousarray(value)) for name, value in batch.items()}
        if self.pack_documents:
            docs = np.searchsorted(self.dataset.doc_offsets, token_positions, side="right") - 1  # document of each token
            batch["position_ids"], batch["doc_ids"], crossing = packed_documents(torch.from_numpy(docs))
            batch["labels"][crossing] = -100  # a document's last token must not predict the next doc
        return batch

    def epoch_of_step(self, step) -> float:
        """Epochs completed after `step` global batches (samples consumed / num_samples)."""
        return step * self.global_batch_size / self.num_samples


def packed_documents(docs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For windows of packed documents, from each token's document [G, S+1] (non-decreasing along a row): the inputs'
    position_ids (from 0 at each document's first token in the window) and doc_ids (0, 1, 2, ... along the row, without
    gaps), [G, S] each, and where a label lies in another document than its input (to be -100)."""
    inputs = docs[:, :-1]
    first = torch.cat([torch.ones_like(inputs[:, :1], dtype=torch.bool), inputs[:, 1:] != inputs[:, :-1]], 1)
    index = torch.arange(inputs.shape[1], device=docs.device).expand_as(inputs)
    return index - torch.where(first, index, 0).cummax(1).values, first.cumsum(1) - 1, docs[:, 1:] != inputs


def mtp_targets(batch: dict[str, torch.Tensor], depths: int) -> dict[str, torch.Tensor]:
    """Multi-token prediction's inputs and targets for a batch of windows, [G, S, depths] each:
    `mtp_ids[:, t, k-1]` is token t+k (what depth k embeds at t; 0 past the window), `mtp_labels[:, t, k-1]`
    token t+k+1 (what it predicts), -100 past the window or where a label between t and t+k+1 is -100 (a
    document boundary: the prediction would cross it). Token t+k is input_ids[t+k], or labels[S-1] at S."""
    ids, labels = batch["input_ids"], batch["labels"]
    g, s = ids.shape
    tokens = torch.cat([ids, labels[:, -1:].clamp(min=0), ids.new_zeros(g, depths)], 1)  # 0..S, then padding
    valid = torch.cat([labels != -100, labels.new_zeros(g, depths, dtype=torch.bool)], 1)
    padded = torch.cat([labels, labels.new_full((g, depths), -100)], 1)
    mtp_ids, mtp_labels, chain = [], [], valid[:, :s]
    for k in range(1, depths + 1):
        mtp_ids.append(tokens[:, k : k + s])
        chain = chain & valid[:, k : k + s]  # labels t .. t+k all kept: tokens t .. t+k+1 in one document
        mtp_labels.append(torch.where(chain, padded[:, k : k + s], -100))
    return {"mtp_ids": torch.stack(mtp_ids, 2), "mtp_labels": torch.stack(mtp_labels, 2)}


def blend_pattern(weights: Sequence[float], period: int = BLEND_PERIOD) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One period of a blend: (the dataset of each position, its rank among that dataset's positions
    in the period, positions per dataset). Dataset d gets q_d = weight_d x period positions (rounded
    down, the rest to the largest remainders); its j-th sits at the ideal time (j + 1/2) / q_d, and
    the period lists every dataset's positions in order of those times (ties: the earlier dataset),
    so that any run of n positions holds each dataset n x weight times, within a sample or two."""
    exact = np.asarray(weights, dtype=np.float64) * period
    counts = np.floor(exact).astype(np.int64)
    counts[np.argsort(counts - exact, kind="stable")[: period - counts.sum()]] += 1
    which, rank = np.repeat(np.arange(len(counts)), counts), np.concatenate([np.arange(q) for q in counts])
    order = np.lexsort((which, (rank + 0.5) / counts[which]))
    return which[order], rank[order], counts


class BlendLoader:
    """Global batches from several datasets by weight (data.path as a blend). Stream position k of
    the blend is dataset d = which[k % P]'s sample (k // P) x q_d + rank[k % P] of its own order
    (blend_pattern; P = BLEND_PERIOD), and each dataset's order is a BatchLoader's, seeded by
    (data.seed, d): a pure function of k, the same on every rank and after a restart."""

    def __init__(self, datasets: list[TokenDataset], weights: list[float], seq_len: int, global_batch_size: int,
                 seed: int, pack_documents: bool = False):
        self.parts = [BatchLoader(ds, seq_len, 1, seed, pack_documents, stream=(d,)) for d, ds in enumerate(datasets)]
        self.which, self.rank, self.counts = blend_pattern(weights)
        self.global_batch_size, self.seq_len = global_batch_size, seq_len
        self.num_samples = sum(part.num_samples for part in self.parts)
        self.dataset = datasets[0]  # the blend's tokenizer is this one's (checked): its identity is what a run records
        self.datasets = datasets

    def sources(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """The dataset of each sample of global batch `step`, and its position in that dataset's order."""
        G = self.global_batch_size
        period, offset = np.divmod(np.arange(step * G, (step + 1) * G, dtype=np.int64), len(self.which))
        which = self.which[offset]
        return which, period * self.counts[which] + self.rank[offset]

    def global_batch(self, step: int) -> dict[str, torch.Tensor]:
        which, position = self.sources(step)
        order = np.argsort(which, kind="stable")  # grouped by dataset, each group in batch order
        batches = [part.windows(part._sample_indices(position[which == d]))
                   for d, part in enumerate(self.parts) if (which == d).any()]
        back = torch.from_numpy(np.argsort(order))
        return {k: torch.cat([b[k] for b in batches])[back] for k in batches[0]}

    def dataset_tokens(self, step: int) -> list[int]:
        """Input tokens of global batch `step` from each dataset, in data.path's order (metrics.jsonl)."""
        return [int(n) * self.seq_len for n in np.bincount(self.sources(step)[0], minlength=len(self.parts))]

    def steps_per_epoch(self) -> list[float]:
        """Steps until each dataset has been read once."""
        return [part.num_samples * len(self.which) / (q * self.global_batch_size) for part, q in zip(self.parts, self.counts)]


def open_training_data(path, seq_len: int, global_batch_size: int, seed: int, pack_documents: bool, held_out: int,
                       model_vocab_size: int) -> BatchLoader | BlendLoader:
    """The loader of data.path (one dataset, or a blend whose datasets share one tokenizer); each
    dataset opened and its ids checked against the model's vocabulary, a failure named by its path."""
    parts, datasets = data_parts(path), []
    for name, _ in parts:
        try:
            datasets.append(TokenDataset(name))
        except (OSError, ValueError) as e:
            raise UserError(f"data.path={name!r}: {e}") from None
        datasets[-1].check_vocab(model_vocab_size)
    if len(parts) == 1:
        return BatchLoader(datasets[0], seq_len, global_batch_size, seed, pack_documents, held_out)
    first = datasets[0]
    tokenizers = [(Path(ds.tokenizer_file).read_bytes() if ds.tokenizer_file else None, ds.vocab_size, ds.eos_id)
                  for ds in datasets]
    for ds, tokenizer in zip(datasets[1:], tokenizers[1:]):
        if tokenizer != tokenizers[0]:
            raise UserError(f"data.path: {ds.path} and {first.path} were tokenized with different tokenizers (tokenizer.json, "
                            f"vocab_size or eos_id differ); a blend needs one: re-tokenize {ds.path} with "
                            f"`pithtrain tokenize ... --tokenizer {first.path / TOKENIZER_FILE}`")
    try:
        return BlendLoader(datasets, [w for _, w in parts], seq_len, global_batch_size, seed, pack_documents)
    except ValueError as e:
        raise UserError(f"data.path: {e}") from None
