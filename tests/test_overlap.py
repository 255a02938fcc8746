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
    """The schedule with, on each rank, the first two forwards (backwards) of its two chunks that
    follow each other (W work in between moves after them) and can run together merged into an
    FF (BB) op."""
    lists = [list(ops) for ops in lists]
    for ops in lists:
        for kind in "FB":
            for i, a in enumerate(ops):
                j = next((j for j in range(i + 1, len(ops)) if ops[j].kind != "W"), None)
                if j is None or not (a.kind == ops[j].kind == kind and a.phase != ops[j].phase):
                    continue
                saved = list(ops)
                ops[i] = Op(kind * 2, a.phase, a.mb, ops.pop(j).mb)
                try:
                    simulate(lists, pp, micro, defer_w)
                    break
                except AssertionError:  # the second needs the first: not a pair
                    ops[:] = saved
    return lists


def _train_worker(rank, world, jobs):
    """Train each (config, out_dir, overlap, trace_path, defer_w) job; rank 0 writes its runner's
    trace, and every rank its pipeline rank and trace to trace_path.rankN."""
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
        if trace_path is not None:
            if rank == 0:
                trace_path.write_text(json.dumps(runners[0].trace))
            trace_path.with_suffix(f".rank{rank}").write_text(json.dumps([runners[0].mesh.pp_rank, runners[0].trace]))


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


def test_ff_bb_and_bw_interleave_their_all_to_alls(runs):
    """FF, BB and BW ops: one part's all-to-all is in flight while the other part computes (a
    forward notes each all-to-all it issues and waits on; a backward and a W each compute block).
    ("ds" has no MoE layer in chunk 0; its runs check FF/BB numerics without W passes.)"""
    traces = dict(json.loads(path.read_text()) for path in runs.glob("qwen_trace.rank*"))  # pp rank -> trace
    micro = len({mb for _, _, mb, _ in traces[0]})
    lists = with_edge_pairs(dualpipev_schedule(2, micro), 2, micro)
    window = {"F": ("dispatch-issue", "dispatch-wait"), "B": ("a2a-issue", "a2a-wait")}
    for kind in ("FF", "BB", "BW"):
        rank, op = next((r, op) for r in (0, 1) for op in lists[r] if op.kind == kind)
        trace = [tuple(e) for e in traces[rank]]
        parts = [(kind[0], op.phase, op.mb), (kind[1], 1 - op.phase, op.mb_b)]
        for part, partner in (parts, parts[::-1])[: 1 if kind == "BW" else 2]:
            start = trace.index((*part, window[part[0]][0]))
            end = trace.index((*part, window[part[0]][1]), start)
            assert any(e[:3] == partner for e in trace[start + 1 : end]), (rank, op, part, trace)
