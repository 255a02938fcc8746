"""The single-process training loop: loss, accumulation invariance, bit-exact resume, atomic checkpoints,
non-finite stop, schedules, load-balance losses, and no host sync inside a layer."""

import dataclasses
import json
import math
import os
import re
import shutil
import time
import traceback

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

from conftest import markov_docs, tiny_config
from pithtrain.config import OptimConfig, UserError
from pithtrain.protocol import RoutingInfo
from pithtrain.train import checkpoint as ckpt
from pithtrain.train import loop
from pithtrain.train.balance import LoadBalance
from pithtrain.train.data import BatchLoader, TokenDataset, write_dataset
from pithtrain.train.metrics import MetricsLog, duration, format_line, read_metrics
from pithtrain.train.optim import lr_at


def test_loss_falls_and_metrics_are_logged(tmp_path, dataset_dir):
    history = loop.train(tiny_config(dataset_dir, steps=25), tmp_path, echo=False)
    assert history[-1]["loss"] < history[0]["loss"] - 0.5
    logged = read_metrics(tmp_path / "metrics.jsonl")
    assert logged == history  # full-precision floats survive the JSON round trip
    for key in ("step", "loss", "lb_loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "peak_mem_bytes"):
        assert key in logged[0]
    # TFLOP/s a GPU, counted by hand: a layer's q, k, v, o 1024 + 512 + 512 + 1024, q/k norms 16, two norms 64,
    # router 128, experts 4 x 1536 at 2/4 active; final norm 32, head 2048; attention 3 x 2 x 16 keys x 4 heads x 16
    flops = 6 * (2 * (3072 + 16 + 64 + 128 + 3072) + 32 + 2048) + 2 * 3 * 2 * 16 * 4 * 16
    assert logged[3]["tflops_per_gpu"] == pytest.approx(logged[3]["tokens_per_s"] * flops / 1e12, rel=1e-9)
    assert [m["step"] for m in logged] == list(range(1, 26))
    assert 0.9 < logged[0]["lb_loss"] < 4  # E * sum f P is 1 when balanced, at most E


@pytest.mark.fast
def test_accumulation_does_not_change_the_step(tmp_path, dataset_dir):
    # seq-wise balance loss is independent of how the batch is cut; micro-batch size must not matter
    runs = []
    for micro in (8, 2):
        cfg = tiny_config(dataset_dir, steps=3, micro_batch_size=micro, lb_type="seq")
        cfg.data.pack_documents = True
        runs.append(loop.train(cfg, tmp_path / f"m{micro}", echo=False))
    for a, b in zip(*runs):
        for key in ("loss", "lb_loss", "grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-5), key


@pytest.mark.fast
def test_resume_after_crash_is_bit_exact(tmp_path, dataset_dir):
    full = loop.train(tiny_config(dataset_dir, steps=6, checkpoint_every=2), tmp_path / "a", echo=False)
    run = tmp_path / "b"
    loop.train(tiny_config(dataset_dir, steps=6, checkpoint_every=2), run, echo=False, stop_after=4)
    # simulate a crash after step 4 that lost the step-4 checkpoint, and a half-written save
    shutil.rmtree(ckpt.list_checkpoints(run)[-1])
    (run / "checkpoints" / "step_00000006.tmp").mkdir()
    assert ckpt.read_meta(ckpt.list_checkpoints(run)[-1])["step"] == 2
    loop.train(tiny_config(dataset_dir, steps=6, checkpoint_every=2), run, echo=False)
    resumed = read_metrics(run / "metrics.jsonl")
    assert [m["step"] for m in resumed] == list(range(1, 7))
    for a, b in zip(full, resumed):
        assert (a["loss"], a["lb_loss"], a["grad_norm"]) == (b["loss"], b["lb_loss"], b["grad_norm"])
    model_a = tiny_config(dataset_dir).model.build_model()
    model_b = tiny_config(dataset_dir).model.build_model()
    ckpt.read_model_state(ckpt.resolve_checkpoint(tmp_path / "a"), model_a)
    ckpt.read_model_state(ckpt.resolve_checkpoint(run), model_b)
    for (n, x), (_, y) in zip(model_a.state_dict().items(), model_b.state_dict().items()):
        assert torch.equal(x, y), n
    # the Python API's bad inputs: one UserError naming the path, not DCP's traceback text or a bare OSError/TypeError
    ck_a = ckpt.resolve_checkpoint(tmp_path / "a")
    assert ckpt.model_config(str(ck_a)) == ckpt.model_config(ck_a)
    change = [dict(hidden_size=48), dict(num_hidden_layers=3), dict(num_experts=8)][int(np.random.randint(3))]
    with pytest.raises(UserError, match=f"checkpoint {re.escape(str(ck_a))} could not be read") as refused:
        ckpt.read_model_state(ck_a, dataclasses.replace(tiny_config(dataset_dir).model, **change).build_model())
    assert "of another architecture than the model given" in str(refused.value) and "\n" not in str(refused.value), change
    with pytest.raises(UserError, match="nowhere is not a PithTrain checkpoint .*pass a directory under RUN/checkpoints/"):
        ckpt.read_meta(tmp_path / "nowhere")
    with pytest.raises(UserError, match="^[^(]*nowhere is not a PithTrain checkpoint"):  # said as that, not as a failed read
        ckpt.read_model_state(tmp_path / "nowhere", model_a)
    # the newest checkpoint damaged: through the API too (echo off) it is set aside, so pruning to one keeps the new one
    with open(run / "checkpoints/step_00000006/__0_0.distcp", "r+b") as f:
        f.truncate(100)
    loop.train(tiny_config(dataset_dir, steps=6, checkpoint_every=1, keep_checkpoints=1), run, echo=False, stop_after=5)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000005", "step_00000006.damaged"]


@pytest.mark.fast
def test_crash_during_save_keeps_the_previous_checkpoint(tmp_path, dataset_dir, monkeypatch):
    loop.train(tiny_config(dataset_dir, steps=4, checkpoint_every=2), tmp_path, echo=False, stop_after=2)
    good = ckpt.list_checkpoints(tmp_path)
    assert len(good) == 1

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(dcp, "save", crash)
    with pytest.raises(UserError, match="disk full.*the last good checkpoint is .*step_00000002"):
        loop.train(tiny_config(dataset_dir, steps=4, checkpoint_every=2), tmp_path, echo=False)
    assert ckpt.list_checkpoints(tmp_path) == good
    monkeypatch.undo()
    history = loop.train(tiny_config(dataset_dir, steps=4, checkpoint_every=2), tmp_path, echo=False)
    assert [m["step"] for m in history] == [3, 4]


@pytest.mark.fast
def test_a_signal_during_a_save_stops_once_it_is_written(tmp_path, dataset_dir, monkeypatch):
    """SIGTERM while step 2's checkpoint is written: the run ends there, not after one more step and save."""
    stop, write = type("Stop", (), {"signum": 0, "stopped_at": None})(), ckpt.write_checkpoint
    monkeypatch.setattr(ckpt, "write_checkpoint", lambda *a: (setattr(stop, "signum", 15), write(*a))[1])
    history = loop.train(tiny_config(dataset_dir, steps=6, checkpoint_every=2), tmp_path, echo=False, stop=stop)
    assert len(history) == stop.stopped_at == 2 and [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step_00000002"]


@pytest.mark.fast
def test_non_finite_loss_stops_with_a_clear_error(tmp_path, dataset_dir, monkeypatch):
    calls = []  # NaN from the second step on (two micro-batches a step)
    monkeypatch.setattr(loop, "cross_entropy_sum", lambda logits, labels, **_: calls.append(1) or logits.sum() * (
                        1 if len(calls) <= 2 else float("nan")))
    with pytest.raises(FloatingPointError, match=f"non-finite loss .* at step 2; the last checkpoint, {tmp_path}/checkpoints/"
                                                 "step_00000001, is kept.*then resume"):
        loop.train(tiny_config(dataset_dir, steps=2, checkpoint_every=1), tmp_path, echo=False)
    with pytest.raises(FloatingPointError, match="non-finite loss .* at step 1; no checkpoint yet.*then run again"):
        loop.train(tiny_config(dataset_dir, steps=2), tmp_path / "new", echo=False)
    assert ckpt.list_checkpoints(tmp_path / "new") == []


@pytest.mark.fast
def test_lr_schedules():
    cos = OptimConfig(lr=1.0, min_lr_ratio=0.1, schedule="cosine", warmup_steps=4)
    assert [lr_at(s, cos, 20) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_at(19, cos, 20) == pytest.approx(0.1)
    for s in (4, 11):  # the decay starts from warmup's last step (3): lr once, then lower at once
        assert lr_at(s, cos, 20) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (s - 3) / 16)))
    flat = OptimConfig(lr=1.0, min_lr_ratio=0.1, schedule="cosine", warmup_steps=0)
    assert lr_at(0, flat, 20) == 1.0 and lr_at(1, flat, 20) < 1.0 and lr_at(19, flat, 20) == pytest.approx(0.1)
    wsd = OptimConfig(lr=1.0, min_lr_ratio=0.0, schedule="wsd", warmup_steps=2, decay_fraction=0.25)
    values = [lr_at(s, wsd, 20) for s in range(20)]
    assert values[2:15] == [1.0] * 13 and values[-1] == 0.0
    assert all(a > b for a, b in zip(values[15:], values[16:]))
    assert lr_at(10, OptimConfig(lr=0.5, schedule="constant"), 20) == 0.5


@pytest.mark.fast
def test_load_balance_losses_match_formulas():
    torch.manual_seed(0)
    b, s, e, k = 3, 10, 6, 2
    logits = torch.randn(b * s, e, dtype=torch.float64, requires_grad=True)
    probs = logits.softmax(-1)
    ids = probs.topk(k, -1).indices
    routing = RoutingInfo(ids, probs.gather(1, ids), probs, e)
    # micro: E * sum_e f_e P_e over all tokens
    counts = torch.stack([(ids == i).sum() for i in range(e)]).double()
    expect_micro = e * ((counts / (b * s * k)) * probs.mean(0)).sum()
    got = LoadBalance("micro").layer_loss(routing, b, s)
    assert got.item() == pytest.approx(expect_micro.item(), rel=1e-6)
    g1 = torch.autograd.grad(got, logits, retain_graph=True)[0]
    g2 = torch.autograd.grad(expect_micro, logits, retain_graph=True)[0]
    assert torch.allclose(g1, g2.float() if g1.dtype == torch.float32 else g2, rtol=1e-5, atol=1e-7)
    # seq: the same per sequence, averaged over sequences
    per_seq = []
    for r in range(b):
        rows = slice(r * s, (r + 1) * s)
        c = torch.stack([(ids[rows] == i).sum() for i in range(e)]).double()
        per_seq.append(e * ((c / (s * k)) * probs[rows].mean(0)).sum())
    expect_seq = torch.stack(per_seq).mean()
    got_seq = LoadBalance("seq").layer_loss(routing, b, s)
    assert got_seq.item() == pytest.approx(expect_seq.item(), rel=1e-6)
    assert got_seq.item() != pytest.approx(got.item(), rel=1e-6)
    # global on one process equals micro
    assert LoadBalance("global").layer_loss(routing, b, s).item() == pytest.approx(got.item(), rel=1e-12)


@pytest.mark.fast
def test_lb_coef_zero_disables_the_loss(tmp_path, dataset_dir):
    history = loop.train(tiny_config(dataset_dir, steps=1, lb_coef=0.0), tmp_path, echo=False)
    assert history[0]["lb_loss"] == 0.0


@pytest.mark.fast
def test_checkpoint_every_minus_one_writes_none(tmp_path, dataset_dir):
    history = loop.train(tiny_config(dataset_dir, steps=2, checkpoint_every=-1), tmp_path, echo=False)
    assert len(history) == 2 and ckpt.list_checkpoints(tmp_path) == []
    logged = (tmp_path / "metrics.jsonl").read_text()  # a rerun starts over and moves them aside, echo off too
    loop.train(tiny_config(dataset_dir, steps=1, checkpoint_every=-1), tmp_path, echo=False)
    assert (tmp_path / "metrics_earlier.jsonl").read_text() == logged


@pytest.mark.fast
def test_grad_norm_and_clipping_against_float64():
    from pithtrain.parallel.fsdp import clip_grads, global_grad_norm
    from pithtrain.parallel.mesh import Mesh

    torch.manual_seed(11)
    params = [torch.nn.Parameter(torch.empty(shape)) for shape in ((300, 7), (5,), (2, 3, 4), (1,))]
    for p in params[:-1]:  # the last has no gradient
        p.grad = torch.randn_like(p) * 3
    ref = torch.cat([p.grad.double().flatten() for p in params[:-1]]).norm().item()
    norm = global_grad_norm(params, Mesh())
    assert norm == pytest.approx(ref, rel=1e-6)
    before = [p.grad.clone() for p in params[:-1]]
    clip_grads(params, 1.0, norm)
    clipped = torch.cat([p.grad.double().flatten() for p in params[:-1]]).norm().item()
    assert clipped == pytest.approx(1.0, rel=1e-5)
    for p, b in zip(params, before):
        torch.testing.assert_close(p.grad, b * (1.0 / (norm + 1e-6)))


@pytest.mark.fast
def test_rank_balance_of_expert_loads():
    loads = torch.randint(0, 50, (3, 8))  # 3 layers, 8 experts on ep = 4 ranks of 2
    busiest = sum(max(int(loads[l, 2 * r : 2 * r + 2].sum()) for r in range(4)) for l in range(3))
    assert loop.rank_balance(loads, 4) == pytest.approx(int(loads.sum()) / 4 / busiest, rel=1e-12)
    assert loop.rank_balance(torch.ones(2, 8, dtype=torch.long), 2) == 1.0


def _startup_line(rank, world, config, out):
    import contextlib
    import io

    from pithtrain.parallel.mesh import init_mesh

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        loop.train(config, out, mesh=init_mesh(1, 1, config.parallel.ep, "cpu", 30) if world > 1 else None)
    return [line for line in printed.getvalue().splitlines() if line.startswith("model ")]


@pytest.mark.fast
def test_startup_line_counts_the_whole_model_and_what_a_rank_holds(dataset_dir, tmp_path):
    from dist_util import run_fn

    config = tiny_config(dataset_dir, steps=1, checkpoint_every=-1)
    total = sum(p.numel() for p in config.model.build_model().parameters())
    assert _startup_line(0, 1, config, tmp_path / "one")[0].startswith(f"model qwen3_moe: {total:,} parameters |")
    config.parallel.ep = 2  # dp1 x ep2: half the experts, half of every dense weight (FSDP over the two ranks)
    lines = run_fn(2, _startup_line, config, tmp_path / "ep2")
    assert lines[0][0].startswith(f"model qwen3_moe: {total:,} parameters ({total // 2:,} held by this rank) |")
    assert lines[1] == []


def direct_loss(cfg, run_dir, batch) -> float:
    """The final checkpoint's model (its independent reference_forward) on a batch: mean over label tokens."""
    model = cfg.model.build_model()
    ckpt.read_model_state(ckpt.resolve_checkpoint(run_dir), model)
    with torch.no_grad():
        logits = model.reference_forward(batch["input_ids"], batch["position_ids"]).double()
    labels = batch["labels"]
    ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
    return ce.item() / int((labels != -100).sum())


@pytest.mark.fast
def test_eval_on_held_out_samples_and_progress_lines(tmp_path, dataset_dir, capsys):
    cfg = tiny_config(dataset_dir, steps=5, eval_every=3, log_every=50)
    cfg.data.eval_samples = 8  # the last 8 windows of the dataset
    began = time.time()
    history = loop.train(cfg, tmp_path, echo=True)
    ended = time.time()
    assert [m["step"] for m in history if "eval_loss" in m] == [3, 5]  # every 3 steps and the final one
    total = (TokenDataset(dataset_dir).num_tokens - 1) // cfg.data.seq_len
    loader = BatchLoader(TokenDataset(dataset_dir), cfg.data.seq_len, 8, cfg.data.seed, held_out=8)
    assert loader.num_samples == total - 8 and max(loader.sample_index(k) for k in range(total)) < total - 8
    held_out = loader.windows(np.arange(total - 8, total))
    assert history[-1]["eval_loss"] == pytest.approx(direct_loss(cfg, tmp_path, held_out), rel=1e-5)
    assert history[2]["eval_loss"] != pytest.approx(history[-1]["eval_loss"], rel=1e-4)
    # progress: the first 3 steps, then every log_every and the last (and eval steps), with elapsed and ETA
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in lines] == ["1/5", "2/5", "3/5", "5/5"]
    assert all(re.search(r"\| [\dhms]+ elapsed, ETA [\dhms]+$", line) for line in lines) and "| eval " in lines[2]
    stamps = [m["time"] for m in read_metrics(tmp_path / "metrics.jsonl")]
    assert began <= stamps[0] and stamps == sorted(stamps) and stamps[-1] <= ended


@pytest.mark.fast
def test_eval_on_an_eval_dataset_equals_the_direct_loss(tmp_path, dataset_dir, capsys):
    write_dataset(tmp_path / "eval", markov_docs(np.random.default_rng(3), 64, 12), vocab_size=64, eos_id=0)
    cfg = tiny_config(dataset_dir, steps=1, eval_every=1)
    cfg.data.eval_path, cfg.data.pack_documents = str(tmp_path / "eval"), True
    history = loop.train(cfg, tmp_path / "run", echo=False)
    eval_set = BatchLoader(TokenDataset(tmp_path / "eval"), cfg.data.seq_len, 1, 0, pack_documents=True)
    n = eval_set.num_samples // 8 * 8  # eval_samples=0: every whole global batch of the eval set
    assert n >= 16
    model = cfg.model.build_model()
    ckpt.read_model_state(ckpt.resolve_checkpoint(tmp_path / "run"), model)

    def direct_loss(windows):
        batch = eval_set.windows(windows)
        with torch.no_grad():  # packed documents: the model's own forward (reference_forward takes doc_ids too)
            logits = model.reference_forward(batch["input_ids"], batch["position_ids"], batch["doc_ids"]).double()
        ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100, reduction="sum")
        return ce.item() / int((batch["labels"] != -100).sum())

    assert history[0]["eval_loss"] == pytest.approx(direct_loss(np.arange(n)), rel=1e-5)
    # pithtrain eval of the run on a dataset: its documents packed as the run trained (the last n windows within --max-tokens)
    from cli_util import cli

    out, _ = cli(["eval", tmp_path / "run", "--tokens", tmp_path / "eval", "--max-tokens", n * 32 + 1, "--json"], capsys)
    last = np.arange(eval_set.num_samples - n, eval_set.num_samples)
    assert json.loads(out)["loss"] == pytest.approx(direct_loss(last), rel=1e-5)
    # with eval off, the training order is that of a run without the eval fields
    assert BatchLoader(TokenDataset(dataset_dir), 32, 8, 5, held_out=0).global_batch(3)["input_ids"].equal(
        BatchLoader(TokenDataset(dataset_dir), 32, 8, 5).global_batch(3)["input_ids"])


@pytest.mark.fast
def test_cpu_threads_share_the_cores(monkeypatch):
    before, cpu = torch.get_num_threads(), torch.device("cpu")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    try:
        for local, threads in (("4", 2), ("16", 1), ("1", 8)):
            torch.set_num_threads(8)
            monkeypatch.setenv("LOCAL_WORLD_SIZE", local)
            assert loop.cpu_threads(cpu) == f" (torch threads: {threads}, at most 8 cores // {local} processes on this host)"
            assert torch.get_num_threads() == threads
        for local in ("0", ""):  # a hand-made launcher environment: all cores, not ZeroDivisionError
            monkeypatch.setenv("LOCAL_WORLD_SIZE", local)
            assert loop.cpu_threads(cpu).startswith(" (torch threads: 8, at most 8 cores // 1 processes")
        torch.set_num_threads(3)  # a lower explicit setting is kept
        assert loop.cpu_threads(cpu).startswith(" (torch threads: 3,") and torch.get_num_threads() == 3
        monkeypatch.setenv("OMP_NUM_THREADS", "5")
        torch.set_num_threads(5)
        assert loop.cpu_threads(cpu) == " (torch threads: 5, from OMP_NUM_THREADS)" and torch.get_num_threads() == 5
        assert loop.cpu_threads(torch.device("cuda")) == ""
    finally:
        torch.set_num_threads(before)


@pytest.mark.fast
def test_progress_line_durations_and_tensorboard_tags(tmp_path):
    m = {"step": 7, "loss": 2.0, "eval_loss": 2.5, "lb_loss": 1.0, "lr": 1e-3, "grad_norm": 0.5, "tokens_per_s": 2e3,
         "step_time_s": 0.1, "peak_mem_bytes": 2**30}
    line = format_line(m, 100, elapsed=75, eta=7384)
    assert "| 2.0k tok/s | 0.100 s/step |" in line
    line = format_line(dict(m, tflops_per_gpu=412.34), 100, elapsed=75, eta=7384)
    assert "| 2.0k tok/s | 412.3 TFLOP/s/GPU | 0.100 s/step |" in line
    assert "| 0.001234 TFLOP/s/GPU |" in format_line(dict(m, tflops_per_gpu=0.0012341), 100)  # a CPU run's, not 0.0
    assert format_line(m, 100, elapsed=75).endswith("| 1m15s elapsed")  # no ETA from a step that compiled
    assert line.startswith("step 7/100 | loss 2.0000 | eval 2.5000 |") and line.endswith("| 1m15s elapsed, ETA 2h03m")
    assert [duration(s) for s in (0.2, 59.6, 3599, 36000, 86399, 1.1e6)] == ["0s", "1m00s", "59m59s", "10h00m", "23h59m", "12d17h"]
    assert "| 2.50M tok/s |" in format_line(dict(m, tokens_per_s=2.5e6), 100)  # not 2500.0k
    log, scalars = MetricsLog(tmp_path, tensorboard=False), []
    log.writer = type("Writer", (), {"add_scalar": lambda self, *a: scalars.append(a), "close": lambda self: None})()
    log.log(dict(m, time=1.7e9), 100, echo=False)
    tags = {tag: value for tag, value, step in scalars}
    assert tags["eval/loss"] == 2.5 and tags["train/loss"] == 2.0 and "train/time" not in tags
    assert read_metrics(tmp_path / "metrics.jsonl")[0]["time"] == 1.7e9


@pytest.mark.fast
def test_cpu_peak_memory_is_the_steps_not_the_processes():
    from pithtrain.train.metrics import peak_memory_bytes, reset_peak_memory

    cpu = torch.device("cpu")
    big = torch.ones(2**26)  # 256 MiB, touched
    high = peak_memory_bytes(cpu)
    del big
    reset_peak_memory(cpu)
    if not os.access("/proc/self/clear_refs", os.W_OK):  # a kernel that refuses the reset: the lifetime peak, as said
        assert peak_memory_bytes(cpu) >= high - 50 * 2**20
        return
    assert peak_memory_bytes(cpu) < high - 200 * 2**20
    again = torch.ones(2**26)
    assert peak_memory_bytes(cpu) > high - 50 * 2**20 and again.sum() > 0


class _HostSyncs(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the ops that make a CUDA host wait for the GPU (.item(), nonzero, masked_select, ...), by the innermost
    pithtrain function that called them. Each one stalls the GPU's queue on a GPU run."""

    SYNCS = ("_local_scalar_dense", "nonzero", "masked_select", "unique", "is_nonzero", "aten.equal")

    def __init__(self):
        super().__init__()
        self.sites = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(s in str(func) for s in self.SYNCS):
            site = [f"{f.filename.rsplit('/', 1)[-1]}:{f.name}" for f in traceback.extract_stack() if "/pithtrain/" in f.filename]
            self.sites[site[-1]] = self.sites.get(site[-1], 0) + 1
        return func(*args, **(kwargs or {}))


@pytest.mark.fast
def test_forward_and_backward_never_wait_for_the_device(tmp_path, dataset_dir):
    """A training step's host syncs are its scalars (the label count on the host batch, the summed losses, the
    gradient norm) and the CPU optimizer's step counters; none in a layer's forward or backward, in bf16 autocast
    as on a GPU: a sync there would idle the GPU at every layer of every micro-batch."""
    from conftest import tiny_deepseek_v3_config

    plain = loop.train_step
    for make in (tiny_config, tiny_deepseek_v3_config):
        syncs = _HostSyncs()

        def second_step_watched(run, step, stop):
            if step == 0:
                return plain(run, step, stop)
            with syncs:
                return plain(run, step, stop)

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(loop, "train_step", second_step_watched)
            loop.train(make(dataset_dir, steps=2, dtype="bf16", checkpoint_every=-1), tmp_path / make.__name__, echo=False)
        assert set(syncs.sites) == {"loop.py:train_step", "fsdp.py:global_grad_norm", "optim.py:optimizer_step"}, syncs.sites
