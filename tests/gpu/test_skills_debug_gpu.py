"""The debug skills' GPU paths (skipped without CUDA): the allocator history of a step replays to
the step's max_memory_allocated; PITHTRAIN_TRITON=0 turns the Triton kernels off."""

import os
import pickle
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_memory_history_of_a_step_replays_to_its_peak(tmp_path, dataset_dir, monkeypatch):
    from conftest import tiny_config
    from pithtrain.train.loop import train

    sys.path.insert(0, ".agents/skills/_common")
    import runs

    tool = runs.skill_script("debug-memory/debug_memory.py")
    monkeypatch.setenv("PITHTRAIN_DEBUG_MEMORY", "2")
    history = train(tiny_config(dataset_dir, steps=2, device="cuda", dtype="bf16"), tmp_path, echo=False)
    peak, blocks = tool.cuda_peak(pickle.loads((tmp_path / "memory" / "rank0.pickle").read_bytes()))
    assert peak == pytest.approx(history[1]["peak_mem_bytes"], rel=1e-2)  # torch's own max_memory_allocated over the step
    stages = {tool.stage_of(frames) for _, frames, _ in blocks}
    assert "before the step (weights, optimizer state, caches)" in stages and len(stages) > 2, stages


def test_triton_switch():
    code = "import torch; from pithtrain.ops import kernels; print(kernels.use_triton(torch.zeros(1, device='cuda')))"
    on = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    off = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, "PITHTRAIN_TRITON": "0"})
    assert on.stdout.strip() == "True" and off.stdout.strip() == "False", on.stderr + off.stderr
