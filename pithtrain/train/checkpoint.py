"""Checkpoints with torch.distributed.checkpoint (DCP), written atomically, found and resumed automatically.

Layout of a run directory:  OUT/checkpoints/step_00000100/{DCP files, meta.json, config.json}
A checkpoint is written into `step_N.tmp` and renamed when complete, so a crash mid-save leaves
the previous checkpoint as the latest usable one. `config.json` is the HF model config, so a
checkpoint can be converted or evaluated on its own.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor, distribute_tensor

_STEP_DIR = re.compile(r"^step_(\d+)$")


def _is_main() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and (p / "meta.json").is_file()]
    return [p for _, p in sorted(found)]


def is_checkpoint(path: str | Path) -> bool:
    return (Path(path) / "meta.json").is_file() and (Path(path) / ".metadata").is_file()


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
    _barrier()
    if _is_main():
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2))
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
        for f in tmp.iterdir():  # make the data durable before the rename publishes it
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
    _barrier()
    return final


def save_checkpoint(run_dir, step: int, state: dict, meta: dict, hf_config: dict, keep: int) -> Path:
    """Save `state` (a DCP state dict) after `step` optimizer steps; prune to the newest `keep`."""
    final = write_checkpoint(Path(run_dir) / "checkpoints" / f"step_{step:08d}", state, dict(meta, step=step), hf_config)
    if _is_main():
        for old in list_checkpoints(run_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def read_meta(ckpt: str | Path) -> dict:
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


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory, or the latest checkpoint of a run directory."""
    path = Path(path)
    if is_checkpoint(path):
        return path
    found = list_checkpoints(path)
    if not found:
        raise FileNotFoundError(f"{path} is neither a checkpoint nor a run directory with checkpoints")
    return found[-1]


def canonical_model_state(model: torch.nn.Module) -> dict:
    """A whole model's weights in the checkpoint layout (for writing a weights-only checkpoint)."""
    return _split_experts(model.state_dict(), None)


def read_model_state(ckpt: str | Path, model: torch.nn.Module) -> dict:
    """Load only the model weights of a checkpoint into a whole (unsharded) model."""
    live = model.state_dict()
    state = {"model": _split_experts(live, None)}
    meta = load_checkpoint(ckpt, state)
    model.load_state_dict(_join_experts(state["model"], live, None))
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
        for i in range(full.shape[0]):
            out[f"{name}.{base + i}"] = full[i]
    return out


def _join_experts(canonical: dict, template: dict, mesh) -> dict:
    """Inverse of _split_experts against `template` (the live state dict's tensors and placements)."""
    out = {}
    for name, value in template.items():
        if ".experts." not in name:
            out[name] = canonical[name]
            continue
        local = value.shape[0]  # a DTensor's shape is the whole (unsharded) local-expert block
        base = _expert_offset(mesh, local)
        full = torch.stack([canonical[f"{name}.{base + i}"] for i in range(local)])
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
        for key, value in entry.items():
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
        local = entry["exp_avg"].shape[0]
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


def load_training_state(ckpt: str | Path, model: torch.nn.Module, optimizer, mesh=None) -> dict:
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = _canonical(model_sd, optim_sd, mesh)
    meta = load_checkpoint(ckpt, state)
    set_state_dict(
        model, optimizer,
        model_state_dict=_join_experts(state["model"], model_sd, mesh),
        optim_state_dict={"state": _join_optim(state["optim"]["state"], optim_sd["state"], mesh),
                          "param_groups": optim_sd["param_groups"]},
    )
    return meta
