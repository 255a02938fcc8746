"""The profiling skills (capture-nsys-profile, analyze-nsys-profile, profile-kernel) and the NVTX
ranges and capture window they rely on."""

import contextlib
import subprocess
import sys

import pytest

from conftest import tiny_config
from dist_util import run_fn


def _nvtx_names_of_runs(rank, world, jobs):
    """Each job trained with NVTX requested and a CUDA build pretended (the NVTX range recorded,
    not called): the range names it opened, and the ranges still open at the end."""
    import torch

    from pithtrain import protocol
    from pithtrain.parallel.mesh import init_mesh
    from pithtrain.train.loop import train

    opened, depth = [], [0]

    @contextlib.contextmanager
    def record(name):
        opened[-1].add(name)
        depth[0] += 1
        yield
        depth[0] -= 1

    protocol.NVTX = True
    torch.cuda.is_available = lambda: True
    torch.cuda.nvtx.range = record
    out = []
    for config, out_dir in jobs:
        opened.append(set())
        p = config.parallel
        train(config, out_dir, echo=False, mesh=init_mesh(p.pp, p.cp, p.ep, "cpu", p.timeout_s, p.hsdp))
        out.append((sorted(opened[-1]), depth[0]))
    return out


def test_nvtx_ranges_name_the_stages_collectives_and_optimizer(tmp_path, dataset_dir):
    """Under PITHTRAIN_NVTX=1, a two-rank expert-parallel run opens the ranges the analysis reads:
    the five stages, dispatch and combine (forward and backward), the optimizer; the overlapped
    (DualPipeV) schedule as well, with its deferred expert weight gradients; every range closed."""
    plain = tiny_config(dataset_dir, steps=1, device="cpu", checkpoint_every=-1)  # saving asks CUDA
    plain.parallel.ep, plain.parallel.overlap_ep = 2, False
    overlapped = tiny_config(dataset_dir, steps=1, device="cpu", checkpoint_every=-1, micro_batch_size=2)
    overlapped.parallel.ep = 2
    ranks = run_fn(2, _nvtx_names_of_runs, [(plain, tmp_path / "plain"), (overlapped, tmp_path / "overlapped")])
    stages = [f"pithtrain::stage{n}" for n in range(1, 6)]
    comms = ["pithtrain::combine", "pithtrain::combine.backward", "pithtrain::dispatch", "pithtrain::dispatch.backward"]
    for (plain_names, plain_open), (over_names, over_open) in ranks:
        assert plain_names == sorted(comms + ["pithtrain::optimizer"] + stages), plain_names
        assert over_names == sorted(comms + ["pithtrain::optimizer"] + stages + ["pithtrain::stage3.wgrad"]), over_names
        assert plain_open == over_open == 0


def test_nvtx_is_off_by_default_and_on_a_cpu_build():
    from pithtrain import protocol

    assert not protocol.NVTX  # the test process has no PITHTRAIN_NVTX
    assert isinstance(protocol.stage_range(1), contextlib.nullcontext)


def test_profile_steps_window_is_checked_before_training(tmp_path, dataset_dir, monkeypatch):
    from pithtrain.config import UserError
    from pithtrain.train.loop import cuda_profiler_steps, train

    monkeypatch.setenv("PITHTRAIN_PROFILE_STEPS", "3:4")
    assert cuda_profiler_steps() == (3, 4)
    for bad in ("4:3", "0:2", "3", "a:b"):
        monkeypatch.setenv("PITHTRAIN_PROFILE_STEPS", bad)
        with pytest.raises(UserError, match="PITHTRAIN_PROFILE_STEPS"):
            train(tiny_config(dataset_dir, steps=1), tmp_path / bad.replace(":", "_"), echo=False)
        assert not (tmp_path / bad.replace(":", "_")).exists()
