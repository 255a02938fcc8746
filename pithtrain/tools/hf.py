"""Hugging Face directories <-> PithTrain checkpoints, loading a model from either, and evaluation.

An HF directory is `config.json` plus `model.safetensors` or sharded `*.safetensors` with `model.safetensors.index.json`.
A PithTrain checkpoint is a DCP directory with `config.json` (see train/checkpoint.py). Conversion goes through the model
file's own `hf_state_dict` / `load_hf_state_dict`, which raise on any missing or unexpected key."""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from pithtrain.config import UserError, data_parts, disk_error, read_json
from pithtrain.ops.core import cross_entropy_sum
from pithtrain.parallel.expert import ExpertEngine, LocalDispatch
from pithtrain.train import checkpoint as ckpt
from pithtrain.train import rundir
from pithtrain.train.checkpoint import is_hf_dir, load_model, model_config, read_hf_state  # noqa: F401 (hf.load_model)
from pithtrain.train.data import TokenDataset, _sha256, is_dataset, packed_documents

SHARD_BYTES = 4 * 2**30
CARRIED = ("seq_length", "pad_token_id")  # config.json keys beyond the model's that convert keeps, both ways
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")  # kept too
EXPORT_NAMES = (r"(config|generation_config|tokenizer|tokenizer_config|special_tokens_map|model\.safetensors\.index|meta)"
                r"\.json|model(-\d+-of-\d+)?\.safetensors|\.metadata|__\d+_\d+\.distcp")  # what convert writes
TOKEN_FORMS = ("a .npy file of token ids [batch, seq] or a dataset directory of `pithtrain tokenize` "
               "(e.g. held-out texts tokenized with --tokenizer RUN_DATA/tokenizer.json)")


def _kept(path: Path) -> list[str]:
    """What keeps convert --overwrite from replacing directory `path`: the files an export does not write (a model
    card, notes: never deleted), or all it holds when it is neither an HF export nor a checkpoint."""
    held = sorted(p.name for p in path.iterdir())
    foreign = [name for name in held if not re.fullmatch(EXPORT_NAMES, name)]
    return foreign or ([] if is_hf_dir(path) or ckpt.is_checkpoint(path) else held)


def write_hf_dir(model, out: str | Path, dataset: TokenDataset | None = None, extra: dict | None = None,
                 files_of: Path | None = None) -> Path:
    """config.json + safetensors (sharded at 4 GiB with an index), written to a temp dir then renamed.
    With the `dataset` the model trained on: its EOS as the bos/eos/pad ids of config.json and
    generation_config.json, and its tokenizer as files `AutoTokenizer.from_pretrained` reads.
    `extra`: more keys of config.json (`seq_length`: the training sequence length, eval's default rows). `files_of`: a
    directory whose TOKENIZER_FILES are copied (a checkpoint convert made of an HF directory). An existing `out` is
    replaced only when empty, an HF export or a checkpoint convert wrote, with no other files (as convert --overwrite)."""
    out = Path(out)
    tmp = out.with_name(out.name + ".tmp")
    # convert checks its DST so before calling this; from Python too, never delete what an export did not write
    held = (_kept(out) if out.is_dir() else []) + [  # and out.tmp, deleted below: only what an export writes
        n for n in (os.listdir(tmp) if tmp.is_dir() else []) if not re.fullmatch(EXPORT_NAMES, n)]
    if held or ckpt.is_checkpoint(out) and "source" not in read_json(out / "meta.json", "move it away"):
        raise UserError(f"write_hf_dir: {out} or {tmp.name} holds {', '.join(held[:4]) or 'a training checkpoint'}, not only an HF "
                        "export or a checkpoint convert wrote (all it replaces); move that out, or choose another out")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    state = {k: v.detach().cpu().contiguous() for k, v in model.hf_state_dict().items()}
    shards, size = [{}], 0
    for k in sorted(state):
        nbytes = state[k].numel() * state[k].element_size()
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][k], size = state[k], size + nbytes
    names = [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)] if shards[1:] else ["model.safetensors"]
    for name, shard in zip(names, shards):
        save_file(shard, str(tmp / name), metadata={"format": "pt"})
    if shards[1:]:
        total = sum(v.numel() * v.element_size() for v in state.values())
        _write_json(tmp / "model.safetensors.index.json", {"metadata": {"total_size": total},
                                                           "weight_map": {k: n for n, shard in zip(names, shards) for k in shard}})
    hf = dict(model.cfg.to_hf(), **(extra or {}))
    if dataset is not None and dataset.eos_id is not None:  # documents end with EOS; BOS and padding reuse it (as GPT-2)
        ids = {f"{k}_token_id": dataset.eos_id for k in ("bos", "eos", "pad")}
        hf.update(ids)
        _write_json(tmp / "generation_config.json", ids)
    _write_json(tmp / "config.json", hf)
    if dataset is not None and dataset.tokenizer_file:
        write_tokenizer(dataset, tmp, hf.get("max_position_embeddings"))
    for name in TOKENIZER_FILES if files_of else ():
        if (files_of / name).is_file():
            shutil.copyfile(files_of / name, tmp / name)
    mask = os.umask(0)
    os.umask(mask)
    for f in tmp.iterdir():  # safetensors writes 0600 (a private temp file, renamed): give the mode open() gives
        f.chmod(0o666 & ~mask)
    ckpt.replace_dir(tmp, out)
    return out


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


def write_tokenizer(dataset: TokenDataset, folder: Path, max_length: int | None) -> None:
    """tokenizer.json plus the tokenizer_config.json / special_tokens_map.json by which transformers'
    AutoTokenizer loads it as a PreTrainedTokenizerFast with the dataset's EOS as bos/eos/pad."""
    from tokenizers import Tokenizer

    shutil.copyfile(dataset.tokenizer_file, folder / "tokenizer.json")
    eos = None if dataset.eos_id is None else Tokenizer.from_file(dataset.tokenizer_file).id_to_token(dataset.eos_id)
    special = {} if eos is None else {f"{k}_token": eos for k in ("bos", "eos", "pad")}
    _write_json(folder / "special_tokens_map.json", special)
    _write_json(folder / "tokenizer_config.json", dict(special, tokenizer_class="PreTrainedTokenizerFast",
                                                        model_max_length=max_length, clean_up_tokenization_spaces=False))


def trained_on(ck: Path, echo=print) -> TokenDataset | None:
    """The dataset whose tokenizer an export of checkpoint `ck` carries: the one its run recorded (real path and
    identity, meta.json's "dataset"; a blend's first, whose tokenizer they share), found unchanged. None, said through
    `echo`, when the run had no tokenizer, its dataset is gone, or it recorded no identity and its data.path cannot be
    placed; a tokenizer that differs from the recorded one is a UserError (--no-tokenizer exports the model alone)."""
    meta = ckpt.read_meta(ck)
    recorded = meta.get("dataset")
    path = recorded["path"] if recorded else meta.get("config", {}).get("data", {}).get("path")
    if path and not recorded:
        path = data_parts(path)[0][0]
    no_tokenizer = "note: no tokenizer written: "
    if "source" in meta:  # a checkpoint convert made of an HF directory: its tokenizer files go along, if it has them
        return None if (ck / "tokenizer.json").is_file() else echo(
            f"{no_tokenizer}{ck} was converted from {meta['source']}; copy its tokenizer files from there")
    if not recorded and not (path and os.path.isabs(path)):  # a run from before datasets were recorded
        return echo(f"{no_tokenizer}{ck / 'meta.json'} records no dataset and data.path={path!r} is relative (to a "
                    "working directory it does not name); copy the run's tokenizer.json by hand")
    try:
        dataset = TokenDataset(path)
    except (OSError, ValueError) as e:  # gone: the export is visibly without a tokenizer, never with a wrong one
        return echo(f"{no_tokenizer}the run's dataset data.path={path!r} does not open ({e})")
    if recorded and dataset.identity["tokenizer_sha256"] != recorded["tokenizer_sha256"]:
        raise UserError(f"convert: {dataset.tokenizer_file or path} is not the tokenizer the run trained with (its "
                        f"SHA-256 differs from the one {ck / 'meta.json'} records); restore it, or pass --no-tokenizer "
                        "to export the model alone")
    if not dataset.tokenizer_file:
        echo(f"{no_tokenizer}the run's dataset {path} has no tokenizer.json")
        return dataset
    from tokenizers import Tokenizer

    try:  # before the weights are read: training never opens it
        Tokenizer.from_file(dataset.tokenizer_file)
    except Exception as e:  # tokenizers raises a bare Exception
        raise UserError(f"convert: {dataset.tokenizer_file} is not a tokenizer ({str(e)[:60]}); restore it, or pass "
                        "--no-tokenizer to export the model alone") from None
    return dataset


def convert(src: str | Path, dst: str | Path, overwrite: bool = False, echo=print, tokenizer: bool = True) -> tuple[Path, str]:
    """HF directory -> PithTrain checkpoint, or PithTrain checkpoint/run directory -> HF directory (with the tokenizer
    and token ids of the dataset the run recorded, checked by `trained_on`; `tokenizer` False: the model alone). Returns
    the output and what it holds (the step exported). An existing non-empty `dst` is replaced only with `overwrite`, and
    never when it is, holds or lies in `src` (replacing it would delete the source)."""
    for name, flag in (("overwrite", overwrite), ("tokenizer", tokenizer)):
        if not isinstance(flag, bool):  # a string such as "no" is true: it must not replace DST or pass for False
            raise UserError(f"convert: {name}={flag!r}; pass True or False")
    src, dst = Path(src), Path(os.path.abspath(dst))  # absolute: "." has a name, and a parent to write in
    a, b = src.resolve(), dst.resolve()
    if dst.is_symlink():
        raise UserError(f"convert: DST {dst} is a symbolic link; pass the directory itself, or another DST")
    for path, name in ((b, f"DST {dst}"), (b.with_name(b.name + ".tmp"), f"{dst}.tmp, where DST is written first,")):
        if a == path or a in path.parents or path in a.parents:
            raise ValueError(f"convert: {name} is SRC {src}, or one holds the other; writing it would delete the "
                             f"source. Choose a DST outside {src}")
        if not (path if path.exists() else next(p for p in path.parents if p.exists())).is_dir():
            raise FileExistsError(f"convert: {name} is a file, or lies under one; choose another DST")
        held = sorted(os.listdir(path)) if path.is_dir() else []
        if path != b and (foreign := [n for n in held if not re.fullmatch(EXPORT_NAMES, n)]):  # DST.tmp is deleted first
            raise UserError(f"convert: {name} holds files convert does not write ({', '.join(foreign[:4])}); move them "
                            "out, or choose another DST")
        if held and not overwrite:
            raise FileExistsError(f"convert: {name} exists and is not empty; choose a new DST" + (
                ", or remove it or pass --overwrite (an interrupted convert left it, or one runs now)" if path != b else
                " (--overwrite replaces only an HF export or a checkpoint)" if _kept(path) else ", or pass --overwrite to replace it"))
    if not tokenizer and is_hf_dir(src):
        raise UserError(f"convert --no-tokenizer: SRC {src} is an HF directory, and the checkpoint made of it holds no tokenizer "
                        "anyway; drop --no-tokenizer (it is for exports to HF)")
    if overwrite and (dst / rundir.LOCK).exists():
        rundir.RunLock(dst).release()  # raises while a run is writing there
    if overwrite and b.is_dir() and (kept := _kept(b)):
        raise UserError(f"convert --overwrite: DST {dst} is not only an HF export or a checkpoint (it holds "
                        f"{', '.join(kept[:4])}); --overwrite replaces only those: move the rest out, or choose another DST")
    if overwrite and ckpt.is_checkpoint(b) and "source" not in read_json(b / "meta.json", "move it away"):
        raise UserError(f"convert --overwrite: DST {dst} is a training checkpoint (with its optimizer state), not one "
                        "convert wrote; a run resumes from it: choose another DST")
    tmp = dst.with_name(dst.name + ".tmp")  # where both directions write first
    try:
        if is_hf_dir(src):
            model = load_model(src)
            hf = dict(model.cfg.to_hf(), **{k: v for k, v in read_json(src / "config.json", "").items() if k in CARRIED})
            out = ckpt.write_checkpoint(dst, {"model": ckpt.canonical_model_state(model)}, {"step": 0, "source": str(a)}, hf)
            kept = [name for name in TOKENIZER_FILES if (src / name).is_file()]  # for eval's check and the way back
            for name in kept:
                shutil.copyfile(src / name, out / name)
            return out, "a weights-only checkpoint (step 0)" + (f", with {', '.join(kept)} of {src}" if kept else "")
        ck = ckpt.resolve_checkpoint(src)
        dataset = (trained_on(ck, echo) if tokenizer else
                   echo(f"note: --no-tokenizer: {dst} holds the model alone (no tokenizer files, no token ids in config.json)"))
        model, meta = load_model(ck), ckpt.read_meta(ck)  # the model first: it checks config.json
        if unread := getattr(model.cfg, "transformers_ignores", list)():  # the families with fields transformers skips
            echo(f"warning: transformers' {model.cfg.model_type} does not read {', '.join(unread)}: it computes another "
                 f"model from this export than PithTrain does, or none (`eval` and `convert` of the checkpoint are exact)")
        extra = {k: v for k, v in read_json(ck / "config.json", "").items() if k in CARRIED}
        if seq_len := meta.get("config", {}).get("data", {}).get("seq_len"):
            extra["seq_length"] = seq_len
        out = write_hf_dir(model, dst, dataset, extra, ck if "source" in meta else None)
        qwen = model.cfg.model_type.startswith("qwen3_5") and (out / "tokenizer.json").is_file()
        tok = read_json(out / "tokenizer.json", "") if qwen else {}
        if tok and not ("NFC" in str(tok.get("normalizer")) and "Split" in str(tok.get("pre_tokenizer"))):  # not Qwen's
            echo(f"warning: transformers' AutoTokenizer loads a {model.cfg.model_type} export as Qwen3_5Tokenizer, with Qwen's "
                 f"normalizer and pre-tokenizer instead of those of {out / 'tokenizer.json'}: other token ids than training "
                 f"read; load it as it is with PreTrainedTokenizerFast.from_pretrained('{out}')")
        return out, f"the weights of step {meta.get('step')} ({ck})"
    except BaseException as e:  # no partial DST.tmp left (Ctrl-C and DCP's CheckpointException too); a failed write on the disk says so
        failure = disk_error(ckpt.dcp_cause(e), dst, removed=tmp if tmp.exists() else None, within=tmp)
        shutil.rmtree(tmp, ignore_errors=True)
        if failure is None:
            raise
        raise failure from e


def eval_setup(path: str | Path, seq_len: int | None = None) -> tuple[int, str, int, tuple[str, str] | None, int, bool]:
    """What eval of the model at `path` takes from its config files alone, before any tokens are read: the row length and
    its source (`seq_len`, else the data.seq_len its run trained at, else config.json's seq_length, else max_position_embeddings,
    the most it takes), the vocabulary size, the tokenizer it trained with as (SHA-256, file), None when unknown, and
    max_position_embeddings, and whether its run packed documents (data.pack_documents)."""
    path = ckpt.run_of(path)
    found = path if is_hf_dir(path) or ckpt.is_checkpoint(path) else next(reversed(ckpt.list_checkpoints(path)), None)
    found = found or ckpt.resolve_checkpoint(path)  # which raises, saying what the path is instead
    cfg, config, hf = model_config(found), found / "config.json", read_json(found / "config.json", "")  # an object: checked
    meta = read_json(found / "meta.json", "move it away, or evaluate another checkpoint") if ckpt.is_checkpoint(found) else {}
    trained, limit = meta.get("config", {}).get("data", {}).get("seq_len"), cfg.max_position_embeddings
    seq_len, why = ((seq_len, "--seq-len") if seq_len else (trained, f"data.seq_len of the run, {found / 'meta.json'}") if trained
                    else (hf["seq_length"], f"seq_length of {config}") if "seq_length" in hf else (limit, f"max_position_embeddings of {config}"))
    if type(seq_len) is not int or not 2 <= seq_len <= limit:
        raise UserError(f"rows of {seq_len!r} tokens ({why}): eval takes from 2 to {limit} (max_position_embeddings of {config}); "
                        "pass --seq-len N within that")
    recorded, own = meta.get("dataset") or {}, found / "tokenizer.json"
    tokenizer = ((recorded["tokenizer_sha256"], str(Path(recorded["path"]) / "tokenizer.json")) if recorded.get("tokenizer_sha256")
                 else (_sha256(own), str(own)) if own.is_file() else None)
    return seq_len, why, cfg.vocab_size, tokenizer, limit, meta.get("config", {}).get("data", {}).get("pack_documents") is True


def load_tokens(path: str | Path, max_tokens: int | None = None, seq_len: int = 128, vocab=None, tokenizer=None) -> torch.Tensor:
    """Token ids [batch, seq], each below `vocab`, from a .npy array (its first rows, up to `max_tokens` tokens)
    or a token dataset directory (training's samples of `seq_len` + 1 tokens: all, or the last within `max_tokens`), refused
    when its tokenizer.json is not the model's (`tokenizer`: SHA-256 and file, as eval_setup gives)."""
    if not (isinstance(seq_len, int) and seq_len >= 2):  # as eval's --seq-len (a 0 would divide by zero below)
        raise UserError(f"seq_len {seq_len!r}: must be an int of at least 2")
    path = Path(path)
    if path.is_dir():
        try:
            dataset = TokenDataset(path)
        except (OSError, ValueError) as e:
            raise UserError(f"--tokens {path}: {e}; --tokens takes {TOKEN_FORMS}") from None
        if tokenizer and dataset.tokenizer_file and dataset.identity["tokenizer_sha256"] != tokenizer[0]:
            if os.path.realpath(dataset.tokenizer_file) == os.path.realpath(tokenizer[1]):  # re-tokenized in place
                raise UserError(f"{tokenizer[1]} is no longer the tokenizer the model trained with (its SHA-256 differs "
                                "from the one its run recorded): the dataset was re-tokenized since; restore that dataset, or "
                                "evaluate with --tokens of texts tokenized by the old tokenizer.json")
            raise UserError(f"--tokens {path} was tokenized with {dataset.tokenizer_file}, not with the model's {tokenizer[1]} "
                            f"(their SHA-256 differ); tokenize its texts with --tokenizer {tokenizer[1]}")
        # training's samples: windows of seq_len + 1 tokens, each seq_len after the last from token 0 (data.BatchLoader);
        # --max-tokens takes the last of them, as data.eval_samples holds them out (N = eval_samples x seq_len + 1)
        samples = (len(dataset.tokens) - 1) // seq_len
        rows = min(samples, (max_tokens - 1) // seq_len) if max_tokens else samples
        stream = dataset.tokens[(samples - rows) * seq_len:samples * seq_len + 1] if rows else (
            dataset.tokens[-max_tokens:] if max_tokens else dataset.tokens)  # under one sample: one row of the last
        stream = np.asarray(stream, dtype=np.int64)
        arr = np.lib.stride_tricks.sliding_window_view(stream, seq_len + 1)[::seq_len] if len(stream) > seq_len else stream[None]
    elif not path.is_file():
        raise FileNotFoundError(f"--tokens {path} does not exist; it takes {TOKEN_FORMS}")
    else:
        try:
            if not isinstance(arr := np.load(path), np.ndarray):  # np.load reads an .npz archive as its arrays by name
                raise ValueError(f"an .npz archive of {', '.join(arr.files[:4]) or 'nothing'}; save one array with np.save")
        except (ValueError, OSError, EOFError) as e:  # not an .npy file (numpy refuses pickles)
            why = ("an array of Python objects" if "Object arrays" in str(e) else "not a .npy file" if "pickled" in str(e)
                   else str(e).split(". ")[0])
            why += f": pass its dataset directory, {path.parent}" if is_dataset(path.parent) else ""  # its tokens.bin
            raise UserError(f"--tokens {path} is not a .npy array of token ids ({why}); it takes {TOKEN_FORMS}") from None
        if max_tokens and arr.ndim == 2:
            if max_tokens < arr.shape[1]:
                raise UserError(f"--max-tokens {max_tokens}: fewer than one row of {path} ({arr.shape[1]} tokens); give at "
                                f"least {arr.shape[1]}")
            arr = arr[: max_tokens // arr.shape[1]]
    ids = np.issubdtype(arr.dtype, np.integer)
    if arr.ndim != 2 or arr.shape[0] < 1 or arr.shape[1] < 2 or not ids or arr.min() < 0:
        negative = " with negative ids" if ids and arr.size and arr.min() < 0 else ""
        raise UserError(f"{path}: expected non-negative integer token ids of shape [batch, seq] with batch >= 1 and "
                        f"seq >= 2, got {arr.dtype} {arr.shape}{negative}; --tokens takes {TOKEN_FORMS}")
    if vocab and int(arr.max()) >= vocab:  # before the int64 cast: a uint64 id past 2**63 keeps its value
        raise UserError(f"--tokens {path}: token id {int(arr.max())} is outside the model's vocabulary [0, {vocab}); "
                        "tokenize with the model's tokenizer")
    return torch.from_numpy(arr.astype(np.int64))


@torch.no_grad()
def evaluate(model, tokens: torch.Tensor, batch_size: int = 8, device: str | torch.device = "cpu",
             eos: int | None = None) -> tuple[float, int]:
    """Mean next-token cross-entropy over tokens [B, S] (predicting tokens[:, 1:]); returns (loss, count). With `eos`,
    documents packed as data.pack_documents trains them: each ends with an eos that predicts nothing, attends to itself
    alone and has positions from 0."""
    vocab = model.cfg.vocab_size
    if not (isinstance(tokens, torch.Tensor) and tokens.ndim == 2 and tokens.shape[0] >= 1 and tokens.shape[1] >= 2
            and not tokens.is_floating_point() and tokens.dtype != torch.bool) or not (isinstance(batch_size, int) and batch_size >= 1):
        got = f"{tokens.dtype} {tuple(tokens.shape)}" if isinstance(tokens, torch.Tensor) else type(tokens).__name__
        raise ValueError(f"tokens: expected integer ids as a torch.Tensor [batch >= 1, seq >= 2], got {got}, and batch_size "
                         f">= 1, got {batch_size}; e.g. from tools.hf.load_tokens (a dataset or .npy)")
    if int(tokens.max()) >= vocab or int(tokens.min()) < 0:
        raise ValueError(f"token ids must lie in [0, {vocab}); found {int(tokens.min())}..{int(tokens.max())}")
    model.eval().to(device)
    total, count, rows = 0.0, 0, tokens.shape[0]
    started = shown = time.perf_counter()
    for i in range(0, rows, batch_size):
        chunk = tokens[i : i + batch_size].to(device, torch.int64)
        b, s = chunk.shape
        pos, labels, docs = torch.arange(s - 1, device=device).expand(b, s - 1), chunk[:, 1:].clone(), None
        if eos is not None:  # a token's document: the eos tokens before it
            pos, docs, crossing = packed_documents((ends := chunk == eos).cumsum(1) - ends.long())
            labels[crossing] = -100
        logits = model(chunk[:, :-1], pos, ExpertEngine(LocalDispatch()), doc_ids=docs)
        total += cross_entropy_sum(logits, labels).double().item()
        count += int((labels != -100).sum())
        if (now := time.perf_counter()) - shown >= 10 and i + b < rows:  # a long eval says how far it is
            shown, done = now, i + b
            print(f"eval: {done:,} of {rows:,} rows, {(now - started) * (rows - done) / done:.0f}s left", file=sys.stderr, flush=True)
    return total / count, count
