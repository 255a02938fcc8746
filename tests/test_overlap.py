"""Overlapped pair ops (pipeline.py): the forward of one micro-batch interleaved with the backward
of another (FB), or two forwards (FF) or two backwards (BB) of the rank's two chunks, at the
expert-parallel all-to-alls give the same training as running them one after the other, and the
interleaving really happens in that order. The runs use the DualPipeV schedule with an FF and a
BB op added on every rank (`with_edge_pairs`); the "ds" runs without deferred W passes."""

import json

import pytest
import torch

from conftest import tiny_deepseek_config
from dist_util import run_fn
from pithtrain.parallel import pipeline
from pithtrain.parallel.pipeline import Op, dualpipev_schedule, simulate
from pithtrain.train.metrics import read_metrics
from test_parallel import assert_same_curve, deep_config, final_weights, mesh_config


def with_edge_pairs(lists, pp, micro, defer_w=True):
    """The schedule with, on each rank, the first two adjacent forwards (backwards) of its two
    chunks that can run together merged into an FF (BB) op."""
    lists = [list(ops) for ops in lists]
    for ops in lists:
        for kind in "FB":
            for i in range(len(ops) - 1):
                a, b = ops[i], ops[i + 1]
                if a.kind == b.kind == kind and a.phase != b.phase:
                    ops[i : i + 2] = [Op(kind * 2, a.phase, a.mb, b.mb)]
                    try:
                        simulate(lists, pp, micro, defer_w)
                        break
                    except AssertionError:  # the second needs the first: not a pair
                        ops[i : i + 1] = [a, b]
    return lists


def _train_worker(rank, world, jobs):
    """Train each (config, out_dir, overlap, trace_path) job; rank 0 writes its runner's trace."""
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    from pithtrain.parallel.mesh import init_mesh
    from pithtrain.train import loop

    finalise = FSDPState._root_post_backward_final_callback
    calls = [0]

    def counted(self):  # FSDP's end-of-backward callback: once per chunk backward is expected
        calls[0] += 1
        return finalise(self)

    FSDPState._root_post_backward_final_callback = counted
    for config, out_dir, overlap, trace_path, defer_w in jobs:
        runners = []
        calls[0] = 0
        loop.dualpipev_schedule = lambda pp, n, defer_w=defer_w, **_: with_edge_pairs(  # noqa: E731
            dualpipev_schedule(pp, n, defer_w), pp, n, defer_w)

        class Runner(pipeline.PipelineRunner):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **{**kwargs, "overlap": overlap})
                self.trace = []
                runners.append(self)

        loop.PipelineRunner = Runner
        p = config.parallel
        mesh = init_mesh(p.pp, p.cp, p.ep, "cpu", p.timeout_s, p.hsdp)
        loop.train(config, out_dir, echo=False, mesh=mesh)
        if rank == 0:
            (out_dir / "fsdp_final_callbacks").write_text(str(calls[0]))
        if rank == 0 and trace_path is not None:
            trace_path.write_text(json.dumps(runners[0].trace))


@pytest.fixture(scope="module")
def runs(tmp_path_factory, dataset_dir):
    root = tmp_path_factory.mktemp("overlap")
    jobs = []
    for family, name in ((deep_config, "qwen"), (tiny_deepseek_config, "ds")):
        if family is tiny_deepseek_config:  # enough micro-batches for pp2 (DualPipeV: 2*pp)
            cfg = lambda: mesh_config(dataset_dir, pp=2, ep=2, steps=3, family=family, micro_batch_size=1)
        else:
            cfg = lambda: mesh_config(dataset_dir, pp=2, ep=2, steps=3, family=family)
        defer_w = name == "qwen"
        jobs.append((cfg(), root / f"{name}_plain", False, None, defer_w))
        jobs.append((cfg(), root / f"{name}_overlap", True, root / f"{name}_trace.json", defer_w))
    run_fn(4, _train_worker, jobs)
    return root


@pytest.mark.parametrize("name, family", [("qwen", deep_config), ("ds", tiny_deepseek_config)])
def test_overlapped_pipeline_matches_the_sequential_one(runs, dataset_dir, name, family):
    plain = read_metrics(runs / f"{name}_plain" / "metrics.jsonl")
    assert_same_curve(plain, read_metrics(runs / f"{name}_overlap" / "metrics.jsonl"), rel=1e-6)
    ref_w = final_weights(runs / f"{name}_plain", dataset_dir, family)
    got_w = final_weights(runs / f"{name}_overlap", dataset_dir, family)
    for key in ref_w:
        assert torch.allclose(got_w[key], ref_w[key], rtol=1e-6, atol=1e-6), key


@pytest.mark.parametrize("name", ["qwen", "ds"])
def test_fsdp_finalises_each_chunk_backward_once(runs, name):
    """The segmented backward makes one autograd call per segment; FSDP's end-of-backward work
    (post-backward of every layer, reduce-scatter on the last micro-batch) still runs once per
    chunk backward, as in the plain run: 3 steps x 2 chunks x 4 micro-batches on rank 0."""
    plain = int((runs / f"{name}_plain" / "fsdp_final_callbacks").read_text())
    overlap = int((runs / f"{name}_overlap" / "fsdp_final_callbacks").read_text())
    assert plain == overlap == 3 * 2 * 4


def test_fb_interleaves_communication_with_the_other_micro_batch(runs):
    trace = [tuple(e) for e in json.loads((runs / "qwen_trace.json").read_text())]  # (kind, phase, mb, event)
    found = 0
    for i, (kind, phase, mb, event) in enumerate(trace):
        if kind != "F" or event != "counts-issue":
            continue
        issue = trace.index(("F", phase, mb, "dispatch-issue"), i)
        wait = trace.index(("F", phase, mb, "dispatch-wait"), issue)
        other = lambda span: [(k, p != phase, e) for k, p, _, e in span if k == "B"]  # noqa: E731
        # the host reads the split sizes only after the other chunk's backward compute is queued
        # (so the read does not drain the GPU), and the token all-to-all is in flight during
        # another backward compute block, which issues its own all-to-all before the forward waits
        if ("B", True, "compute") in other(trace[i + 1 : issue]) and \
                other(trace[issue + 1 : wait])[-2:] == [("B", True, "compute"), ("B", True, "a2a-issue")]:
            found += 1
    assert found >= 2, trace
    # a backward all-to-all in flight while the forward computes, waited after it
    for i, (kind, phase, mb, event) in enumerate(trace):
        if kind == "B" and event == "a2a-issue" and trace[i + 1][0] == "F":
            assert trace.index(("B", phase, mb, "a2a-wait"), i) > i + 1
            break
    else:
        raise AssertionError("no backward all-to-all overlapped with a forward")


def test_ff_and_bb_interleave_their_all_to_alls(runs):
    """Rank 0's FF and BB ops: one chunk's all-to-all is in flight while the other chunk computes
    (a forward notes each all-to-all it issues and waits on; a backward each compute block).
    ("ds" has no MoE layer in chunk 0; its runs check FF/BB numerics without deferred W.)"""
    trace = [tuple(e) for e in json.loads((runs / "qwen_trace.json").read_text())]
    micro = len({mb for _, _, mb, _ in trace})
    rank0 = with_edge_pairs(dualpipev_schedule(2, micro), 2, micro)[0]
    (ff,), (bb,) = ([op for op in rank0 if op.kind == kind] for kind in ("FF", "BB"))
    for op, issue, wait in ((ff, "dispatch-issue", "dispatch-wait"), (bb, "a2a-issue", "a2a-wait")):
        kind, other = op.kind[0], (op.kind[0], 1 - op.phase, op.mb_b)
        overlapped = 0
        for phase, mb in ((op.phase, op.mb), (1 - op.phase, op.mb_b)):
            start = trace.index((kind, phase, mb, issue))
            end = trace.index((kind, phase, mb, wait), start)
            partner = other if (phase, mb) == (op.phase, op.mb) else (kind, op.phase, op.mb)
            overlapped += any(e[:3] == partner for e in trace[start + 1 : end])
        assert overlapped == 2, (op, trace)
