"""Checkpoints with torch.distributed.checkpoint (DCP), written atomically, found and resumed automatically.

Layout of a run directory:  OUT/checkpoints/step_00000100/{DCP files, meta.json, config.json}
A checkpoint is written into `step_N.tmp` and renamed when complete, so a crash mid-save leaves the previous checkpoint
as the latest usable one. `config.json` is the HF model config, so a checkpoint can be converted or evaluated on its
own. `meta.json`, written last, marks it complete and lists the size and CRC32 of every other file (each rank hashes the
files it wrote); resume takes the newest checkpoint that matches them."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import sys
import warnings
import zlib
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_model_state_dict, set_state_dict
from torch.distributed.tensor import DTensor, distribute_tensor

from pithtrain.config import UserError, check_types, read_json
from pithtrain.models import config_from_hf

_STEP_DIR = re.compile(r"^step_(\d{8,})$")  # what save_checkpoint names, not a user's step_2


def _is_main() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _step_dirs(run_dir) -> list[tuple[int, Path]]:
    root = Path(run_dir) / "checkpoints"
    return sorted((int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name))) if root.is_dir() else []


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints of a run (their marker, meta.json, is present), oldest first."""
    return [p for _, p in _step_dirs(run_dir) if (p / "meta.json").is_file()]


def is_checkpoint(path: str | Path) -> bool:
    return (Path(path) / "meta.json").is_file() and (Path(path) / ".metadata").is_file()


def _crc32(path: Path) -> int:
    crc, buf = 0, bytearray(16 << 20)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            crc = zlib.crc32(memoryview(buf)[:n], crc)
    return crc


def _digests(folder: Path, names) -> dict:
    return {name: [(folder / name).stat().st_size, _crc32(folder / name)] for name in names}


def _json_crc(obj: dict) -> int:
    return zlib.crc32(json.dumps(obj, sort_keys=True).encode())


def _all_ranks(value) -> list:
    if not dist.is_initialized():
        return [value]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def write_checkpoint(final: str | Path, state: dict, meta: dict, hf_config: dict) -> Path:
    """Write a DCP checkpoint to `final` atomically: into `final.tmp`, then one rename."""
    final = Path(final)
    tmp = final.with_name(final.name + ".tmp")
    if _is_main():
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    with warnings.catch_warnings():  # single-process saves are intended; DCP warns about them
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, checkpoint_id=str(tmp))
    # each rank hashes the data files it wrote (DCP names them __<rank>_<n>.distcp), still in the page cache
    rank = dist.get_rank() if dist.is_initialized() else 0
    digests = _all_ranks(_digests(tmp, [p.name for p in tmp.glob(f"__{rank}_*.distcp")]))
    files = {name: entry for part in digests for name, entry in part.items()}
    if _is_main():
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2))
        files.update(_digests(tmp, [".metadata", "config.json"]))
        meta = dict(meta, files=files)
        # last: it marks completion; its own CRC32 (of its other keys) catches an edit of its step
        (tmp / "meta.json").write_text(json.dumps(dict(meta, meta_crc32=_json_crc(meta)), indent=2))
        for f in tmp.iterdir():  # make the data durable before the rename publishes it
            _fsync(f)
        replace_dir(tmp, final)
        _fsync(final.parent)
    _barrier()
    return final


def replace_dir(tmp: Path, final: Path) -> None:
    """Rename the finished directory `tmp` to `final`; one there moves aside, back if that fails, else it is deleted.
    An empty `final` stays and takes tmp's files, the marker (meta.json) last: a shell may stand in it (`--out .`)."""
    if final.is_dir() and not final.is_symlink() and not any(final.iterdir()):
        for entry in sorted(tmp.iterdir(), key=lambda p: (p.name == "meta.json", p.name == "config.json")):
            os.rename(entry, final / entry.name)
        tmp.rmdir()
        return
    old, moved = final.with_name(f".{final.name}.old-{os.getpid()}"), final.exists()
    if moved and Path.cwd().is_relative_to(final.resolve()):  # moved away and deleted, the shell would stand in nothing
        raise UserError(f"cannot replace {final}: it is the current directory (or holds it), left as it was; cd .. and "
                        f"name it from there")
    try:
        if moved:
            os.rename(final, old)
    except OSError as e:  # a mount point (EBUSY), or a directory we may not move
        raise UserError(f"cannot replace {final}: moving it aside failed ({e.strerror}); it is left as it was; write elsewhere") from None
    try:
        os.rename(tmp, final)
    except BaseException:
        if moved:
            os.rename(old, final)
        raise
    shutil.rmtree(old, ignore_errors=True)


def _fsync(path: Path) -> None:  # a file or a directory
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(run_dir, step: int, state: dict, meta: dict, hf_config: dict, keep: int) -> Path:
    """Save `state` (a DCP state dict) after `step` optimizer steps; prune to the newest `keep`
    (and remove step directories without a marker: what an interrupted deletion left)."""
    final = write_checkpoint(Path(run_dir) / "checkpoints" / f"step_{step:08d}", state, dict(meta, step=step), hf_config)
    if _is_main():
        for old in list_checkpoints(run_dir)[:-keep]:  # its marker first: a half-deleted one never counts
            if old.is_symlink():  # a user's link to another run's checkpoint: the link alone
                old.unlink()
                continue
            (old / "meta.json").unlink(missing_ok=True)
            _fsync(old)
            shutil.rmtree(old, ignore_errors=True)
        for _, left in _step_dirs(run_dir):
            if not (left / "meta.json").exists():
                shutil.rmtree(left, ignore_errors=True)
    return final


def check_checkpoint(ckpt: str | Path, rank: int = 0, world: int = 1) -> str | None:
    """What is wrong with a checkpoint directory, or None if it is intact: its marker, and its files
    against the sizes and CRC32s that meta.json lists (this rank's share of them: rank::world)."""
    ckpt = Path(ckpt)
    try:
        meta = json.loads((ckpt / "meta.json").read_text())
    except FileNotFoundError:
        return "no meta.json (never finished, or partly deleted)"
    except ValueError:
        return "meta.json is not valid JSON"
    if not isinstance(meta, dict):
        return "meta.json is not a JSON object"
    crc = meta.pop("meta_crc32", None)  # absent in checkpoints written before it
    if crc is not None and crc != _json_crc(meta):
        return "meta.json was edited or corrupted (its CRC32 does not match its content)"
    files = meta.get("files", {".metadata": None})
    if not (isinstance(meta.get("step"), int) and isinstance(meta.get("config", {}), dict) and isinstance(files, dict)
            and all(v is None or isinstance(v, list) and len(v) == 2 for v in files.values())):
        return "meta.json lacks the integer step, files or config that pithtrain writes (edited by hand?)"
    for name in sorted(files)[rank::world]:
        path = ckpt / name
        if not path.is_file():
            return f"{name} is missing"
        if files[name] is None:
            continue  # written before checksums: presence is all we can check
        size, crc = files[name]
        if path.stat().st_size != size:
            return f"{name} has {path.stat().st_size} bytes, not {size} (truncated or overwritten)"
        if _crc32(path) != crc:
            return f"{name} is corrupted (CRC32 mismatch)"
    return None


def newest_intact(run_dir, report=print, fix: str = "move or delete that directory to start over, or choose another --out",
                  set_aside: bool = False) -> Path | None:
    """The newest checkpoint of a run that passes check_checkpoint (all ranks verify, each a share of
    the files); damaged ones are reported by name and skipped. Raises when checkpoints exist but none
    is intact, rather than let a run start over them. `set_aside` (a run resuming): the damaged complete
    ones are renamed STEP.damaged, kept for the user but no longer counted when old checkpoints are pruned."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    bad = []
    for _, path in reversed(_step_dirs(run_dir)):
        if (problem := next((p for p in _all_ranks(check_checkpoint(path, rank, world)) if p), None)) is None:
            for damaged, why in bad if rank == 0 else ():  # said only when there is one to fall back to
                report(f"warning: checkpoint {damaged} is damaged ({why}); falling back to {path.name}")
                if set_aside and (damaged / "meta.json").exists():  # without it: a deletion cut short, pruned anyway
                    moved = damaged.with_name(f"{damaged.name}.damaged")
                    while moved.exists():
                        moved = moved.with_name(moved.name + "_")
                    damaged.rename(moved)
                    report(f"note: moved it to {moved.name}, kept for you and no longer counted as a checkpoint")
            return path
        bad.append((path, problem))
    if bad:
        listed = "; ".join(f"{path.name}: {why}" for path, why in bad)
        raise ValueError(f"{Path(run_dir) / 'checkpoints'}: no intact checkpoint ({listed}); {fix}")
    return None


def read_meta(ckpt: str | Path) -> dict:
    if not (Path(ckpt) / "meta.json").is_file():  # a bare FileNotFoundError would not say what to pass
        raise UserError(f"{ckpt} is not a PithTrain checkpoint (no meta.json); pass a directory under RUN/checkpoints/")
    return json.loads((Path(ckpt) / "meta.json").read_text())


def load_checkpoint(ckpt: str | Path, state: dict) -> dict:
    """Load in place into `state` (only the keys it holds); returns meta.json."""
    if not is_checkpoint(ckpt):
        raise FileNotFoundError(f"{ckpt} is not a PithTrain checkpoint (no meta.json/.metadata); "
                                f"pass a directory under RUN/checkpoints/ or a run directory")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(ckpt))
    return read_meta(ckpt)


def run_of(path: str | Path) -> Path:
    """What readers (eval, convert, init_from) take a run's `checkpoints/` folder for: its run directory."""
    path = Path(path)
    return path.parent if path.name == "checkpoints" and path.is_dir() and not is_checkpoint(path) else path


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory (verified), or the newest intact checkpoint of a run directory."""
    path = run_of(path)
    if is_checkpoint(path):
        if problem := check_checkpoint(path):
            raise ValueError(f"checkpoint {path} is damaged: {problem}; use another checkpoint of its run")
        return path
    found = newest_intact(path, lambda line: print(line, file=sys.stderr), "pass a checkpoint or run directory with an intact one")
    if found is None:  # say what the path is instead
        missing = [name for name in ("config.json", "*.safetensors") if not any(path.glob(name))]
        what = ("does not exist" if not path.exists() else "is a file" if not path.is_dir() else "is a run directory without checkpoints"
                if (path / "checkpoints").is_dir() else "is a token dataset of `pithtrain tokenize`, not a model" if (path / "tokens.bin").is_file()
                else f"lacks the {missing[0]} of an HF directory" if len(missing) == 1 else
                "is neither an HF directory (config.json + *.safetensors) nor a checkpoint or run directory with checkpoints")
        raise UserError(f"{path} {what}; pass an HF directory, a checkpoint or a run directory")
    return found


def canonical_model_state(model: torch.nn.Module) -> dict:
    """A whole model's weights in the checkpoint layout (for writing a weights-only checkpoint)."""
    return _split_experts(model.state_dict(), None)


def read_model_state(ckpt: str | Path, model: torch.nn.Module) -> dict:
    """Load only the model weights of a checkpoint into a whole (unsharded) model."""
    live = model.state_dict()
    state = {"model": _split_experts(live, None)}
    read_meta(ckpt)  # no checkpoint at all: said as that, not as a failed read
    try:
        meta = load_checkpoint(ckpt, state)
        model.load_state_dict(_join_experts(state["model"], live, None))
    except (Exception, CheckpointException) as e:  # DCP wraps every rank's error in a BaseException
        cause = dcp_cause(e)
        raise UserError(f"checkpoint {ckpt} could not be read ({type(cause).__name__}: {cause}); it may be damaged, or "
                        "of another architecture than the model given (load_model builds the checkpoint's own)") from e
    return meta


def _expert_offset(mesh, local_experts: int) -> int:
    return (mesh.ep_rank if mesh is not None else 0) * local_experts


def _split_experts(sd: dict, mesh) -> dict:
    """Canonical layout: each expert parameter (dim 0 = local expert) becomes one entry per
    GLOBAL expert id, `<name>.<e>`; dense entries stay (DTensors under FSDP reshard by DCP)."""
    out = {}
    for name, value in sd.items():
        if ".experts." not in name:
            out[name] = value
            continue
        full = value.full_tensor() if isinstance(value, DTensor) else value
        base = _expert_offset(mesh, full.shape[0])
        out.update((f"{name}.{base + i}", row) for i, row in enumerate(full))
    return out


def _join_experts(canonical: dict, template: dict, mesh) -> dict:
    """Inverse of _split_experts against `template` (the live state dict's tensors and placements)."""
    out = {}
    for name, value in template.items():
        if ".experts." not in name:
            out[name] = canonical[name]
            continue
        local = value.shape[0]  # a DTensor's shape is the whole (unsharded) local-expert block
        full = torch.stack([canonical[f"{name}.{_expert_offset(mesh, local) + i}"] for i in range(local)])
        if isinstance(value, DTensor):  # back to this rank's FSDP shard, by local slicing
            full = distribute_tensor(full.to(value.device), value.device_mesh, value.placements, src_data_rank=None)
        out[name] = full
    return out


def _split_optim(state: dict, mesh) -> dict:
    """The optimizer state ({param name: {"step", "exp_avg", ...}}) in the canonical layout."""
    out = {}
    for name, entry in state.items():
        if ".experts." not in name:
            out[name] = entry
            continue
        for key, value in entry.items():  # AdamW: step, exp_avg, exp_avg_sq; Muon: momentum_buffer
            if key != "step":
                for expert_name, row in _split_experts({name: value}, mesh).items():
                    out.setdefault(expert_name, {"step": entry["step"].clone()})[key] = row
    return out


def _join_optim(canonical: dict, template: dict, mesh) -> dict:
    """Inverse of _split_optim against the live optimizer state `template`."""
    out = {}
    for name, entry in template.items():
        if ".experts." not in name:
            out[name] = canonical[name]
            continue
        local = next(v for k, v in entry.items() if k != "step").shape[0]
        rows = [f"{name}.{_expert_offset(mesh, local) + i}" for i in range(local)]
        out[name] = {"step": canonical[rows[0]]["step"]}
        for key, value in entry.items():
            if key != "step":
                out[name][key] = _join_experts({r: canonical[r][key] for r in rows}, {name: value}, mesh)[name]
    return out


def training_state(model: torch.nn.Module, optimizer, mesh=None) -> dict:
    """Model and optimizer state in the canonical, parallelism-independent layout: parameter
    names with global layer ids, one entry per global expert. (Optimizer moments are created
    first if no step has run yet, so that loading fills them.)"""
    return _canonical(*get_state_dict(model, optimizer), mesh)


def _canonical(model_sd: dict, optim_sd: dict, mesh) -> dict:
    return {"model": _split_experts(model_sd, mesh), "optim": {"state": _split_optim(optim_sd["state"], mesh)}}


def load_training_state(ckpt: str | Path, model: torch.nn.Module, optimizer, mesh=None, with_optim: bool = True) -> dict:
    """Load model and optimizer state; `with_optim=False` loads the weights only (the optimizer starts
    fresh: resuming with another optim.name)."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = _canonical(model_sd, optim_sd, mesh) if with_optim else {"model": _split_experts(model_sd, mesh)}
    meta, model_sd = load_checkpoint(ckpt, state), _join_experts(state["model"], model_sd, mesh)
    if with_optim:
        set_state_dict(model, optimizer, model_state_dict=model_sd,
                       optim_state_dict={"state": _join_optim(state["optim"]["state"], optim_sd["state"], mesh),
                                         "param_groups": optim_sd["param_groups"]})
    else:
        set_model_state_dict(model, model_sd)
        optimizer.state.clear()  # get_state_dict made the state with a zero step: start truly fresh
    return meta


def dcp_cause(error: BaseException) -> BaseException:
    """The error itself, or the first rank's error of DCP's CheckpointException (a BaseException
    that holds each rank's error and prints their tracebacks)."""
    failures = getattr(error, "failures", None)
    return next(iter(failures.values()))[0] if failures else error


# A model with its weights, from an HF directory or a checkpoint (tools/hf.py, train.init_from).
def is_hf_dir(path: str | Path) -> bool:
    path = Path(path)
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


BIG_READ = 2**30  # bytes of weights from which reading them is said (a read of minutes is not silence)


def read_hf_state(path: str | Path, names_only: bool = False) -> dict[str, torch.Tensor]:
    """An HF directory's tensors by name (names_only: the names alone, from the files' headers)."""
    path, state = Path(path), {}
    index = path / "model.safetensors.index.json"
    files = (sorted({path / f for f in read_json(index, "re-download or re-export it")["weight_map"].values()})
             if index.is_file() else sorted(path.glob("*.safetensors")))
    total = 0 if names_only else sum(f.stat().st_size for f in files if f.is_file())
    for i, f in enumerate(files, 1):
        if total > BIG_READ:  # minutes of reading: said file by file
            print(f"reading {f} ({i}/{len(files)} of {total / 1e9:.1f} GB)", file=sys.stderr, flush=True)
        try:
            if names_only:
                with safe_open(str(f), "pt") as held:
                    state.update(dict.fromkeys(held.keys()))
            else:
                state.update(load_file(str(f)))
        except (SafetensorError, OSError) as e:
            raise UserError(f"{f}: cannot read its weights ({e}); re-download or re-export the HF directory") from None
    return state


def model_config(path: str | Path):
    """The family config of the HF `config.json` in directory `path`, type-checked and validated."""
    path = Path(path)
    if not isinstance(hf := read_json(path / "config.json", "re-download or re-export it"), dict):
        raise UserError(f"{path / 'config.json'} holds a JSON {type(hf).__name__}, not an object; re-download or re-export it")
    said = path in _NOTED or _NOTED.add(path)
    try:  # a directory's notes (a multimodal layout's) once: eval reads its config.json for sizes, then for the model
        with contextlib.redirect_stderr(io.StringIO()) if said else contextlib.nullcontext():
            cfg = config_from_hf(hf)
        check_types(cfg, "model.", "fix config.json")
        cfg.validate()
    except (TypeError, ValueError) as e:  # a field of the wrong type or value (ConfigError is a ValueError)
        raise UserError(f"{path / 'config.json'}: {e}") from None
    # read as written (PithTrain's export of such a run has them; convert warned then), but said: transformers ignores them
    if cfg.model_type == "deepseek_v2" and is_hf_dir(path) and (unread := cfg.transformers_ignores()):
        warnings.warn(f"{path / 'config.json'}: transformers' deepseek_v2 does not read {', '.join(unread)}; PithTrain "
                      "applies them, transformers computes another model (to match it, set scoring_func='softmax', "
                      "norm_topk_prob=false, moe_layer_freq=1, topk_method 'greedy' or 'group_limited_greedy' there)")
    text = hf["text_config"] if isinstance(hf.get("text_config"), dict) else hf  # kimi_k25's model: its text_config
    # a config.json that names no depth (transformers reads 1): the MTP layers its weights hold
    named = cfg.model_type != "deepseek_v3" or "num_nextn_predict_layers" in text or "num_mtp_layers" in text
    depth, first = cfg.num_nextn_predict_layers if named else 8, cfg.num_hidden_layers
    if depth and is_hf_dir(path):  # multi-token prediction layers sit past the last layer, when saved at all
        names = read_hf_state(path, names_only=True)
        held = next((k for k in range(depth) if not any(n.startswith(f"model.layers.{first + k}.") for n in names)), depth)
        if held < depth and named and not said:
            print(f"note: {path}: config.json names {depth} multi-token prediction layer(s), its weights hold {held} "
                  f"(transformers' save_pretrained leaves them out): read as model.num_nextn_predict_layers={held}",
                  file=sys.stderr)
        cfg.num_nextn_predict_layers = held
    return cfg


_NOTED: set = set()  # the directories whose config.json model_config read (and said its notes of)


def load_model(path: str | Path):
    """A model with weights from an HF directory, a PithTrain checkpoint, or a run directory (latest)."""
    path = Path(path)
    if is_hf_dir(path):
        model = model_config(path).build_model()
        try:
            model.load_hf_state_dict(read_hf_state(path))
        except UserError as e:  # a missing, extra or misshapen tensor: which directory
            raise UserError(f"{path}: {e}") from None
        return model
    ck = resolve_checkpoint(path)
    model = model_config(ck).build_model()
    if (size := sum(f.stat().st_size for f in ck.glob("*.distcp"))) > BIG_READ:
        print(f"reading {ck} ({size / 1e9:.1f} GB) ...", file=sys.stderr, flush=True)
    read_model_state(ck, model)  # a failed read: a UserError naming ck
    return model
