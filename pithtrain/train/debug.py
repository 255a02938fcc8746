"""Debugging instruments, off unless their environment variable is set (loop.py reads them once).

PITHTRAIN_DEBUG_NORMS names steps ("7", "3-5", "1,4"), for the debug-divergence skill: every rank appends one JSON line
per tensor to OUT/norms_rank<r>.jsonl, in the order the tensors are made: forward outputs of the embedding, of stages 1,
3 and 5 of every layer and of the final norm; the gradient reaching each of them in backward; each parameter's gradient
(this rank's shard) before clipping.

PITHTRAIN_DEBUG_MEMORY names one step, for the debug-memory skill: on CUDA the caching allocator's history over that
step (`_record_memory_history`, Python stacks) and its snapshot at the end, in OUT/memory/rank<r>.pickle; on the CPU,
which keeps no history, torch.profiler's allocation events (sizes, addresses, the Python stack of each) in
OUT/memory/rank<r>.json."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import torch
import torch.utils._pytree as pytree

from pithtrain.config import UserError
from pithtrain.protocol import all_layers


def chosen_steps(spec: str) -> set[int]:
    """PITHTRAIN_DEBUG_NORMS's steps: `7`, `3-5`, `1,4` (1-based)."""
    steps = set()
    for part in filter(None, spec.replace(" ", "").split(",")):
        first, _, last = part.partition("-")
        if not (first.isdigit() and (last or first).isdigit() and 1 <= int(first) <= int(last or first)):
            raise UserError(f"PITHTRAIN_DEBUG_NORMS={spec!r}: expected steps like 7, 3-5 or 1,4 (1-based)")
        steps.update(range(int(first), int(last or first) + 1))
    return steps


class NormLog:
    def __init__(self, spec: str, out_dir: Path, rank: int):
        self.steps, self.step = chosen_steps(spec), 0
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        self.file = open(Path(out_dir) / f"norms_rank{rank}.jsonl", "a")

    def write(self, name: str, kind: str, t: torch.Tensor) -> None:
        if self.step in self.steps:
            norm = t.detach().double().norm().item()  # fp64: non-finite only if an element is; a host sync
            self.file.write(json.dumps({"step": self.step, "tensor": name, "kind": kind, "norm": norm}) + "\n")
            self.file.flush()  # a step that raises (non-finite loss) keeps its lines

    def output(self, name: str, out):
        """Record each floating tensor of a stage's output; its gradient when backward reaches it."""
        for path, t in pytree.tree_flatten_with_path(out)[0]:
            if isinstance(t, torch.Tensor) and t.is_floating_point() and self.step in self.steps:
                full = name + pytree.keystr(path)
                self.write(full, "forward", t)
                if t.requires_grad:
                    t.register_hook(lambda g, full=full: self.write(full, "backward", g))
        return out

    def watch(self, model) -> "NormLog":
        """Wrap stages 1, 3, 5 of every layer (after compile and FSDP: the outermost call) and hook
        the embedding and the final norm; returns self."""
        for layer in all_layers(model).values():
            for n in (1, 3, 5):
                stage = getattr(layer, f"stage{n}")
                setattr(layer, f"stage{n}", lambda *a, _f=stage, _n=f"layer{layer.layer_id}.stage{n}", **k:
                        self.output(_n, _f(*a, **k)))
        for name in ("embed_tokens", "norm"):
            if getattr(model, name, None) is not None:
                getattr(model, name).register_forward_hook(lambda m, a, out, name=name: self.output(name, out))
        return self

    def grads(self, named_params) -> None:
        for name, p in named_params:
            if p.grad is not None:
                self.write(f"{name}.grad", "param_grad", p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad)


class MemoryRecorder:
    """Started before the step's first allocation, saved after its optimizer step."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        if self.cuda:
            torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
        else:
            self.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                                   profile_memory=True, with_stack=True)
            self.profiler.start()

    def save(self, out_dir: Path, rank: int) -> Path:
        path = Path(out_dir) / "memory" / f"rank{rank}.{'pickle' if self.cuda else 'json'}"
        path.parent.mkdir(parents=True, exist_ok=True)
        if self.cuda:
            path.write_bytes(pickle.dumps(torch.cuda.memory._snapshot()))
            torch.cuda.memory._record_memory_history(enabled=None)
        else:
            self.profiler.stop()
            self.profiler.export_chrome_trace(str(path))
        return path
