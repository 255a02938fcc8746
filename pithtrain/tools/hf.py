"""Hugging Face directories <-> PithTrain checkpoints, loading a model from either, and evaluation.

An HF directory is `config.json` plus `model.safetensors` or sharded `*.safetensors` with
`model.safetensors.index.json`. A PithTrain checkpoint is a DCP directory with `config.json`
(see train/checkpoint.py). Conversion goes through the model file's own
`hf_state_dict` / `load_hf_state_dict`, which raise on any missing or unexpected key.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file
from torch.distributed.checkpoint import CheckpointException

from pithtrain.config import UserError, data_parts, disk_error, read_json
from pithtrain.ops.core import cross_entropy_sum
from pithtrain.parallel.expert import ExpertEngine, LocalDispatch
from pithtrain.train import checkpoint as ckpt
from pithtrain.train import rundir
from pithtrain.train.checkpoint import is_hf_dir, load_model, model_config, read_hf_state  # noqa: F401 (hf.load_model)
from pithtrain.train.data import TokenDataset

SHARD_BYTES = 4 * 2**30


def write_hf_dir(model, out: str | Path, dataset: TokenDataset | None = None, seq_len: int | None = None) -> Path:
    """config.json + safetensors (sharded at 4 GiB with an index), written to a temp dir then renamed.
    With the `dataset` the model trained on: its EOS as the bos/eos/pad ids of config.json and
    generation_config.json, and its tokenizer as files `AutoTokenizer.from_pretrained` reads.
    `seq_len`: the training sequence length, as config.json's `seq_length` (eval's default rows)."""
    out = Path(out)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    state = {k: v.detach().cpu().contiguous() for k, v in model.hf_state_dict().items()}
    shards, current, size = [], {}, 0
    for k in sorted(state):
        nbytes = state[k].numel() * state[k].element_size()
        if current and size + nbytes > SHARD_BYTES:
            shards.append(current)
            current, size = {}, 0
        current[k], size = state[k], size + nbytes
    shards.append(current)
    if len(shards) == 1:
        save_file(shards[0], str(tmp / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(tmp / name), metadata={"format": "pt"})
            weight_map.update({k: name for k in shard})
        total = sum(v.numel() * v.element_size() for v in state.values())
        _write_json(tmp / "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map})
    hf = model.cfg.to_hf()
    if seq_len:
        hf["seq_length"] = seq_len
    if dataset is not None and dataset.eos_id is not None:  # documents end with EOS; BOS and padding reuse it (as GPT-2)
        ids = {f"{k}_token_id": dataset.eos_id for k in ("bos", "eos", "pad")}
        hf.update(ids)
        _write_json(tmp / "generation_config.json", ids)
    _write_json(tmp / "config.json", hf)
    if dataset is not None and dataset.tokenizer_file:
        write_tokenizer(dataset, tmp, hf.get("max_position_embeddings"))
    mask = os.umask(0)
    os.umask(mask)
    for f in tmp.iterdir():  # safetensors writes 0600 (a private temp file, renamed): give the mode open() gives
        f.chmod(0o666 & ~mask)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


def write_tokenizer(dataset: TokenDataset, folder: Path, max_length: int | None) -> None:
    """tokenizer.json plus the tokenizer_config.json / special_tokens_map.json by which transformers'
    AutoTokenizer loads it as a PreTrainedTokenizerFast with the dataset's EOS as bos/eos/pad."""
    from tokenizers import Tokenizer

    shutil.copyfile(dataset.tokenizer_file, folder / "tokenizer.json")
    special = {}
    if dataset.eos_id is not None:
        eos = Tokenizer.from_file(dataset.tokenizer_file).id_to_token(dataset.eos_id)
        special = {"bos_token": eos, "eos_token": eos, "pad_token": eos}
    _write_json(folder / "special_tokens_map.json", special)
    _write_json(folder / "tokenizer_config.json", dict(special, tokenizer_class="PreTrainedTokenizerFast",
                                                        model_max_length=max_length, clean_up_tokenization_spaces=False))


def trained_on(ck: Path, echo=print) -> TokenDataset | None:
    """The dataset whose tokenizer an export of checkpoint `ck` carries: the one its run recorded (real
    path and identity, meta.json's "dataset"; a blend's first, whose tokenizer they share), found
    unchanged. None, said through `echo`, when the run had no tokenizer, its dataset is gone, or it
    recorded no identity and its data.path cannot be placed; a tokenizer that differs from the recorded
    one is a UserError (--no-tokenizer exports the model alone)."""
    meta = ckpt.read_meta(ck)
    recorded = meta.get("dataset")
    path = recorded["path"] if recorded else meta.get("config", {}).get("data", {}).get("path")
    if path and not recorded:
        path = data_parts(path)[0][0]
    no_tokenizer = "note: no tokenizer written: "
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


def convert(src: str | Path, dst: str | Path, overwrite: bool = False, echo=print, tokenizer: bool = True) -> tuple[Path, str]:
    """HF directory -> PithTrain checkpoint, or PithTrain checkpoint/run directory -> HF directory (with
    the tokenizer and token ids of the dataset the run recorded, checked by `trained_on`; `tokenizer`
    False: the model alone). Returns the output and what it holds (the step exported). An existing
    non-empty `dst` is replaced only with `overwrite`, and never when it is, holds or lies in `src`
    (replacing it would delete the source)."""
    src, dst = Path(src), Path(dst)
    a, b = src.resolve(), dst.resolve()
    for path, name in ((b, f"DST {dst}"), (b.with_name(b.name + ".tmp"), f"{dst}.tmp, where DST is written first,")):
        if a == path or a in path.parents or path in a.parents:
            raise ValueError(f"convert: {name} is SRC {src}, or one holds the other; writing it would delete the "
                             f"source. Choose a DST outside {src}")
        if path.exists() and not path.is_dir():
            raise FileExistsError(f"convert: {name} is a file; choose another DST")
        if path.is_dir() and any(path.iterdir()) and not overwrite:
            raise FileExistsError(f"convert: {name} exists and is not empty; choose a new DST, "
                                  f"or pass --overwrite to replace it")
    if overwrite and (dst / rundir.LOCK).exists():
        rundir.RunLock(dst).release()  # raises while a run is writing there
    tmp = dst.with_name(dst.name + ".tmp")  # where both directions write first
    try:
        if is_hf_dir(src):
            model = load_model(src)
            return (ckpt.write_checkpoint(dst, {"model": ckpt.canonical_model_state(model)}, {"step": 0, "source": str(src)},
                                          model.cfg.to_hf()), "a weights-only checkpoint (step 0)")
        ck = ckpt.resolve_checkpoint(src)
        dataset = trained_on(ck, echo) if tokenizer else None
        if not tokenizer:
            echo(f"note: --no-tokenizer: {dst} holds the model alone (no tokenizer files, no token ids in config.json)")
        meta = ckpt.read_meta(ck)
        seq_len = meta.get("config", {}).get("data", {}).get("seq_len")
        return write_hf_dir(load_model(ck), dst, dataset, seq_len), f"the weights of step {meta.get('step')} ({ck})"
    except (Exception, CheckpointException) as e:  # a write that failed on the disk: no partial DST.tmp left
        failure = disk_error(ckpt.dcp_cause(e), dst, removed=tmp if tmp.exists() else None, within=tmp)
        if failure is None:
            raise
        shutil.rmtree(tmp, ignore_errors=True)
        raise failure from e


def trained_seq_len(path: str | Path) -> tuple[int, str]:
    """eval's default row length for a model: the data.seq_len its run trained at (a checkpoint's or run
    directory's newest meta.json), else config.json's seq_length (an export of ours), else its
    max_position_embeddings; and where it came from."""
    path = Path(path)
    found = path if is_hf_dir(path) or ckpt.is_checkpoint(path) else next(reversed(ckpt.list_checkpoints(path)), None)
    if found is None:
        return 128, "no model found to read it from"  # load_model names what is wrong with the path
    fix = "move the checkpoint away or pass --seq-len"
    meta = read_json(found / "meta.json", fix) if ckpt.is_checkpoint(found) else {}
    seq_len = meta.get("config", {}).get("data", {}).get("seq_len")
    if seq_len:
        return seq_len, f"data.seq_len of the run, {found / 'meta.json'}"
    hf = read_json(found / "config.json", "re-download or re-export it")
    key = next((k for k in ("seq_length", "max_position_embeddings") if isinstance(hf.get(k), int)), None)
    return (hf[key], f"{key} of {found / 'config.json'}; --seq-len to choose") if key else (128, "a default")


TOKEN_FORMS = ("a .npy file of token ids [batch, seq] or a dataset directory of `pithtrain tokenize` "
               "(e.g. held-out texts tokenized with --tokenizer RUN_DATA/tokenizer.json)")


def load_tokens(path: str | Path, max_tokens: int | None = None, seq_len: int = 128) -> torch.Tensor:
    """Token ids [batch, seq] from a .npy array (its first rows, up to `max_tokens` tokens) or a token
    dataset directory (its last `max_tokens` tokens, all by default, in rows of `seq_len`)."""
    path = Path(path)
    if path.is_dir():
        try:
            stream = TokenDataset(path).tokens
        except (OSError, ValueError) as e:
            raise UserError(f"--tokens {path}: {e}; --tokens takes {TOKEN_FORMS}") from None
        stream = np.asarray(stream[-max_tokens:] if max_tokens else stream, dtype=np.int64)
        rows = max(1, len(stream) // seq_len)
        arr = stream[: rows * seq_len].reshape(rows, -1) if len(stream) >= seq_len else stream[None]
    elif not path.is_file():
        raise FileNotFoundError(f"--tokens {path} does not exist; it takes {TOKEN_FORMS}")
    else:
        try:
            arr = np.load(path)
        except (ValueError, OSError, EOFError) as e:  # not an .npy file (numpy refuses pickles)
            raise UserError(f"--tokens {path} is not a .npy array ({e}); it takes {TOKEN_FORMS}") from None
        if max_tokens and arr.ndim == 2:
            arr = arr[: max(1, max_tokens // max(arr.shape[1], 1))]
    integer = np.issubdtype(arr.dtype, np.integer)
    if arr.ndim != 2 or arr.shape[0] < 1 or arr.shape[1] < 2 or not integer or arr.min() < 0:
        raise UserError(f"{path}: expected non-negative integer token ids of shape [batch, seq] with batch >= 1 and "
                        f"seq >= 2, got {arr.dtype} {arr.shape}; --tokens takes {TOKEN_FORMS}")
    return torch.from_numpy(arr.astype(np.int64))


@torch.no_grad()
def evaluate(model, tokens: torch.Tensor, batch_size: int = 8, device: str | torch.device = "cpu") -> tuple[float, int]:
    """Mean next-token cross-entropy over tokens [B, S] (predicting tokens[:, 1:]); returns (loss, count)."""
    vocab = model.cfg.vocab_size
    if int(tokens.max()) >= vocab or int(tokens.min()) < 0:
        raise ValueError(f"token ids must lie in [0, {vocab}); found {int(tokens.min())}..{int(tokens.max())}")
    model.eval().to(device)
    total, count = 0.0, 0
    for i in range(0, tokens.shape[0], batch_size):
        chunk = tokens[i : i + batch_size].to(device)
        b, s = chunk.shape
        pos = torch.arange(s - 1, device=device).expand(b, s - 1)
        logits = model(chunk[:, :-1], pos, ExpertEngine(LocalDispatch()))
        total += cross_entropy_sum(logits, chunk[:, 1:]).double().item()
        count += b * (s - 1)
    return total / count, count
