"""The training loop: data -> micro-batches -> forward/backward -> clip -> optimizer step -> metrics -> checkpoints.

The loss (cross-entropy over the global batch's label tokens, plus multi-token prediction's and the auxiliary
terms) is composed in one place, `protocol.LossTerms`, whatever the micro-batch cut or pipeline schedule."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import shutil
import tempfile
import time
from fnmatch import fnmatchcase
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
import torch.utils.checkpoint
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.fsdp import FSDPModule

from pithtrain.config import (MUON_EXCLUDE, ConfigError, RunConfig, UserError, check, data_parts, disk_error,
                               data_rank_count, ignored_options, read_json, run_dict, runs_dualpipev, validate)
from pithtrain.models.routing import update_correction_bias
from pithtrain.ops.fp8 import enable_fp8
from pithtrain.ops.kernels import cross_entropy_sum  # race-free Triton kernel on GPUs
from pithtrain.parallel.context import shard_micro_batch
from pithtrain.parallel.expert import AllToAllDispatch, ExpertEngine, LocalDispatch
from pithtrain.parallel.fsdp import expert_modules, global_grad_norm, keep_local_experts, shard_model
from pithtrain.parallel.mesh import Mesh
from pithtrain.parallel.pipeline import ChunkPair, PipelineRunner, build_chunks, dualpipev_schedule, ranks_without_layers
from pithtrain.protocol import LossTerms, StepSums, all_layers, named_range
from pithtrain.train import checkpoint as ckpt
from pithtrain.train.balance import LoadBalance
from pithtrain.train.data import BatchLoader, BlendLoader, TokenDataset, _sha256 as data_sha256, mtp_targets, open_training_data
from pithtrain.train.debug import MemoryRecorder, NormLog, chosen_steps
from pithtrain.train.metrics import (MetricsLog, flops_per_token, model_sizes, peak_memory_bytes, read_metrics,
                                     reset_peak_memory)
from pithtrain.train.optim import build_optimizer, lr_at, optimizer_step, takes_muon
from pithtrain.train.rundir import owned


def pick_device(name: str, field: str = "train.device") -> torch.device:
    check(name in ("auto", "cpu", "cuda"), f"{field}={name!r}: use auto, cpu or cuda")  # before validate (set_up): not torch's
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"{field}=cuda but no CUDA device is visible; use {field}=auto or cpu")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def forward_loss(model, micro: dict, engine: ExpertEngine, device, dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Forward one (device-resident, CP-split) micro-batch; returns its sums of token cross-entropy, the
    main one and multi-token prediction's (None without "mtp_ids" in the micro-batch; the auxiliary
    loss values are in engine.aux)."""
    mtp = {"mtp_ids": micro["mtp_ids"]} if "mtp_ids" in micro else {}  # DeepSeek-V3 with MTP layers only
    with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
        out = model(micro["input_ids"], micro["position_ids"], engine, doc_ids=micro.get("doc_ids"), cp=micro.get("cp"), **mtp)
    return head_losses(out, micro)


def head_losses(out, micro: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(main cross-entropy sum, MTP cross-entropy sum or None) of a head's output: logits, or
    (logits, MTP logits [B, S, D, V]) with MTP."""
    logits, mtp_logits = out if isinstance(out, tuple) else (out, None)
    ce = cross_entropy_sum(logits, micro["labels"], grad_in_place=True)  # in place: the logits are not read again
    return ce, None if mtp_logits is None else cross_entropy_sum(mtp_logits, micro["mtp_labels"], grad_in_place=True)


def prepare_micro(micro: dict, mesh: Mesh) -> dict:
    """Move a micro-batch to the device and keep this CP rank's zigzag share of its sequences
    (with the ContextParallel under key "cp")."""
    pin = mesh.device.type == "cuda"  # pinned and non-blocking: a plain copy would wait for the GPU to drain
    micro = {k: (v.pin_memory() if pin else v).to(mesh.device, non_blocking=pin) for k, v in micro.items()}
    if mesh.cp == 1:
        return micro
    local, cp = shard_micro_batch(micro, mesh.cp_group)
    return dict(local, cp=cp)


def rank_micro_batches(batch: dict, size: int, data_rank: int, data_ranks: int) -> list[dict]:
    """This data rank's micro-batches: micro-batch j of the global batch goes to rank j % data_ranks, so the union over
    ranks of micro-step i is one contiguous block of samples (the `global` load-balance scope on R ranks equals the
    `micro` scope of one process with R-times larger micro-batches)."""
    starts = range(data_rank * size, batch["input_ids"].shape[0], size * data_ranks)
    return [{k: v[i : i + size] for k, v in batch.items()} for i in starts]


@dataclasses.dataclass
class Run:
    """What `set_up` builds for the loop: the model (or this rank's two DualPipeV chunks), its
    optimizer, the data, and what every step uses. `engines`: this step's expert engines, one per
    (chunk) forward; their expert loads feed the routing-bias update."""
    config: RunConfig
    mesh: Mesh
    out_dir: Path
    dtype: torch.dtype
    echo: bool
    loader: BatchLoader
    evaluation: tuple | None
    found: Path | None
    model: torch.nn.Module
    chunks: tuple | None
    optimizer: torch.optim.Optimizer
    dispatcher: object
    balance: LoadBalance | None
    log: MetricsLog
    start: int
    end: int
    n_moe: int
    norms: NormLog | None
    memory_step: int
    capture: tuple[int, int] | None
    runner: PipelineRunner | None = None
    engines: list = dataclasses.field(default_factory=list)

    def __enter__(self) -> Run:
        return self

    def __exit__(self, failed, *_) -> None:  # the log's writer thread and W&B run end with a failed call too (a notebook's)
        with contextlib.suppress(Exception) if failed else contextlib.nullcontext():
            self.log.close(failed is not None)

    def new_engine(self, batch: int, seq: int) -> ExpertEngine:
        self.engines.append(ExpertEngine(self.dispatcher, self.balance, batch, seq))
        return self.engines[-1]

    def save(self, step: int) -> None:
        t, state = self.config.train, ckpt.training_state(self.model, self.optimizer, self.mesh)
        meta = {"samples_consumed": step * t.global_batch_size, "config": run_dict(self.config),
                "dataset": self.loader.dataset.identity,  # what convert's tokenizer and a resume are checked against
                "datasets": [dataset.identity for dataset in self.loader.datasets],  # each of a blend's
                "data_path": _flat({"data": {"path": self.config.data.path}})["data.path"]}  # real paths (a blend's too)
        try:
            ckpt.save_checkpoint(self.out_dir, step, state, meta, self.config.model.to_hf(), t.keep_checkpoints)
        except (Exception, CheckpointException) as e:
            if (failure := save_failed(e, self.out_dir, step, self.mesh.is_main)) is e:
                raise
            raise failure from e


class Stepped(NamedTuple):
    """What one optimizer step measured (train_step), before the loop adds its timing."""
    loss: float  # the global mean token cross-entropy
    aux: dict  # each auxiliary term's metric (lb_loss)
    lr: float
    grad_norm: float
    n_label: int  # label tokens of the global batch
    n_tokens: int  # input tokens of the global batch
    ep_balance: float | None
    halt: bool  # a stop was requested on some rank: end after this step


def train(config: RunConfig, out_dir: str | Path, steps: int | None = None, echo: bool = True,
          stop_after: int | None = None, mesh: Mesh | None = None, stop=None) -> list[dict]:
    """Train (resuming from the newest intact checkpoint in out_dir); returns this run's per-step metrics. `stop_after`
    ends the run early (with a checkpoint) without changing the schedule of `train.steps`. `mesh` is None for one
    process; launched runs pass the mesh built by `init_mesh`. `stop` (see launch.GracefulStop): once its `signum` is
    set on any rank, every rank ends after the same step, with a checkpoint, and `stop.stopped_at` is that step.
    `steps` overrides train.steps in a copy: the caller's config is left as it was."""
    check(isinstance(config, RunConfig), f"config: expected a RunConfig, got {type(config).__name__}; read a run file "
          "with pithtrain.config.load_run_config(path)")
    config = config if steps is None else dataclasses.replace(config, train=dataclasses.replace(config.train, steps=steps))
    out_dir, began = Path(out_dir), time.time()
    # one process of its own (a notebook; the CLI holds the lock already): one writer per run directory here too
    with owned(out_dir, print if echo else lambda line: None) if mesh is None else contextlib.nullcontext(), \
            set_up(config, out_dir, echo, stop_after, mesh) as run:
        t, device = config.train, run.mesh.device
        history, profiler, memory = [], None, None
        first_done = None  # (time, step) at the end of this run's first step: the ETA's rate excludes its warm-up
        tflop_per_gpu = flops_per_token(config.model, config.data.seq_len) / run.mesh.world / 1e12  # a global token's share
        for step in range(run.start, run.end):
            if t.profile_step and step + 1 == t.profile_step:
                drain(device)  # the last step's optimizer may still run (train_step): keep it out of this step's trace
                profiler = start_profiler(device)
            if run.capture and step + 1 == run.capture[0] and device.type == "cuda":
                drain(device)
                torch.cuda.profiler.start()
            if step + 1 == run.memory_step:
                memory = MemoryRecorder(device)
            t0 = time.perf_counter()
            out = train_step(run, step, stop)
            dt = time.perf_counter() - t0
            m = {"step": step + 1, "loss": out.loss, **out.aux, "lr": out.lr, "grad_norm": out.grad_norm,
                 "tokens_per_s": out.n_tokens / dt, "tflops_per_gpu": out.n_tokens / dt * tflop_per_gpu, "step_time_s": dt,
                 "peak_mem_bytes": peak_memory_bytes(device), "tokens": out.n_label}
            if out.ep_balance is not None:
                m["ep_load_balance"] = out.ep_balance
            if isinstance(run.loader, BlendLoader):  # each dataset's share, in data.path's order
                m["dataset_tokens"] = run.loader.dataset_tokens(step)
            if t.eval_every and ((step + 1) % t.eval_every == 0 or step + 1 == t.steps):
                m["eval_loss"] = evaluate(run.chunks or (run.model,), run.runner, run.evaluation, config, run.mesh,
                                          run.dispatcher, run.dtype)
            m["time"] = now = time.time()
            first_done = first_done or (now, step + 1)
            rate = (now - first_done[0]) / (step + 1 - first_done[1]) if step + 1 > first_done[1] else time.perf_counter() - t0
            history.append(m)
            write_instruments(run, step, memory, profiler)
            memory = profiler = None
            shown = step - run.start < 3 or (step + 1) % t.log_every == 0 or step + 1 in (t.steps, run.end) or "eval_loss" in m
            warming = t.compile and step + 1 == first_done[1] and step + 1 < run.end  # compiling: its time says nothing of the rest
            run.log.log(m, t.steps, echo=run.echo and shown, elapsed=now - began, eta=None if warming else rate * (run.end - step - 1))
            halt = out.halt
            if t.checkpoint_every > 0 and (step + 1) % t.checkpoint_every == 0 and step + 1 < run.end or halt and t.checkpoint_every >= 0:
                run.save(step + 1)
                halt = halt or stop is not None and signalled(stop, run.mesh)  # one came during the save: no step and save more
            if halt:
                stop.stopped_at = step + 1
                break
        else:
            end_of_run(run)
        return history


def signalled(stop, mesh: Mesh) -> bool:
    """Whether a stop was requested on any rank (one collective, outside the steps)."""
    flag = torch.tensor(float(bool(stop.signum)), device=mesh.device)
    if mesh.world > 1:
        torch.distributed.all_reduce(flag)
    return bool(flag)


def set_up(config: RunConfig, out_dir: Path, echo: bool, stop_after: int | None, mesh: Mesh | None) -> Run:
    """Everything before the first step: debug settings, mesh, checks (check_run), model or pipeline chunks
    (build_model), optimizer, resume, the startup line."""
    t, o = config.train, config.optim
    device, capture = pick_device(t.device), cuda_profiler_steps()
    memory_step = os.environ.get("PITHTRAIN_DEBUG_MEMORY") or "0"  # the debug-memory skill's step
    if not memory_step.isdigit():
        raise UserError(f"PITHTRAIN_DEBUG_MEMORY={memory_step!r}: expected a step number (1-based), e.g. 3")
    norm_spec = os.environ.get("PITHTRAIN_DEBUG_NORMS")  # the debug-divergence skill's steps
    chosen_steps(norm_spec or "")  # a bad value fails here, before any work
    mesh = mesh or Mesh(device=device)
    validate(config, world_size=mesh.world)
    for line in ignored_options(config, mesh.world) if echo and mesh.is_main else ():
        print(line, flush=True)
    device = mesh.device
    dtype = torch.bfloat16 if t.dtype == "bf16" or (t.dtype == "auto" and device.type == "cuda") else torch.float32
    echo, threads = echo and mesh.is_main, cpu_threads(device)
    loader, evaluation, found = check_run(config, out_dir, stop_after, echo, create=mesh.is_main, world_size=mesh.world)

    model, chunks = build_model(config, mesh, dtype, found)
    counts = model_sizes(config.model)
    sizes, n_total = size_text(config, loader, counts), counts[0]
    # after slicing the experts and sharding: what this rank holds (a DTensor's numel is the whole tensor's)
    n_held = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in model.parameters())
    norms = NormLog(norm_spec, out_dir, mesh.rank).watch(model) if norm_spec else None  # the debug-divergence skill's
    optimizer = build_optimizer(list(model.named_parameters()), o, device.type)
    count_group = mesh.data_group if t.lb_type == "global" else None
    balance = LoadBalance(t.lb_type, count_group, cp_group=mesh.cp_group) if t.lb_coef > 0 else None
    dispatcher = AllToAllDispatch(mesh.ep_group, config.model.num_routed_experts()) if mesh.ep > 1 else LocalDispatch()

    start = resume(config, model, optimizer, mesh, found, out_dir, echo)
    log = MetricsLog(out_dir, t.tensorboard, enabled=mesh.is_main, wandb_project=t.wandb_project, config=run_dict(config),
                     start=start)
    if echo and start == 0:
        print(f"model {config.model.model_type}: {count_text(n_total)} parameters"
              f"{f' ({count_text(n_held)} held by this rank)' if n_held != n_total else ''} | "
              f"mesh pp={mesh.pp} dp={mesh.dp} cp={mesh.cp} ep={mesh.ep} | device {device}{threads} | "
              f"compute {dtype}{fp8_text(t)} | {loader.num_samples} samples of {config.data.seq_len} tokens"
              f"{f' (+{len(evaluation[1])} for eval)' if evaluation else ''} | "
              f"{t.steps} steps of {t.global_batch_size} samples | {sizes}", flush=True)
    if echo and t.compile and start < t.steps:
        print("note: train.compile: the first step compiles the stages and takes longer (seconds to minutes)", flush=True)
    n_moe = sum(config.model.is_moe_layer(i) for i in range(config.model.num_hidden_layers + config.model.num_nextn_predict_layers))
    end = t.steps if stop_after is None else min(t.steps, stop_after)
    run = Run(config, mesh, out_dir, dtype, echo, loader, evaluation, found, model, chunks, optimizer, dispatcher,
              balance, log, start, end, n_moe, norms, int(memory_step), capture)
    if chunks is not None:
        run.runner = PipelineRunner(*chunks, mesh, run.new_engine,
                                    lambda micro: (micro["position_ids"], micro.get("doc_ids"), micro.get("cp")),
                                    act_dtype=dtype)
        for part in chunks:
            part.train()
    model.train()
    if echo and start == end:
        limit = "--stop-after" if stop_after is not None and stop_after < t.steps else "--steps"
        print(f"nothing to do: {out_dir} is already at step {start}; raise {limit} to train further", flush=True)
    return run


def build_model(config: RunConfig, mesh: Mesh, dtype: torch.dtype, found: Path | None):
    """The model on this rank, ready to train, and its DualPipeV chunks (None without a pipeline)."""
    t = config.train
    if runs_dualpipev(config, mesh.world):  # this rank's two DualPipeV chunks, seen as one module for state and optimizer
        chunks = build_chunks(config.model, mesh.pp, mesh.pp_rank, t.seed)
        model = ChunkPair(*chunks)
    else:
        chunks = None
        try:
            model = config.model.build_model()
            model.init_weights(t.seed)
        except (RuntimeError, MemoryError) as e:  # the allocator's own message names the bytes it wanted
            raise UserError(f"model: building its weights failed ({str(e).splitlines()[0][:160]}); use a smaller model, "
                            "or spread it over more processes (parallel.pp, parallel.ep)") from None
    if t.init_from and not found:  # continued pretraining (check_init_from compared the architectures)
        source, own = ckpt.load_model(t.init_from).state_dict(), model.state_dict()
        model.load_state_dict({name: source[name] for name in own})  # a pipeline rank's chunks: its layers alone
    if t.compile:  # before FSDP, so that its hooks stay outside the compiled graphs
        compile_stages(model)
    if t.fp8 != "off":  # before FSDP too: its all-gather runs before the FP8 weight refresh
        for part in chunks or (model,):  # each chunk itself: a ChunkPair does not hold its chunks as modules
            enable_fp8(part, compiled=t.compile, recipe=t.fp8, head=t.fp8_head)
    recompute_stages(model, t.recompute)  # around the compiled stages, inside FSDP's hooks
    keep_local_experts(model, mesh.ep_rank, mesh.ep)
    model.to(mesh.device)  # fp32 master weights; bf16 compute from autocast (one process) or FSDP's policy
    if mesh.world > 1:
        for part in chunks or (model,):
            shard_model(part, mesh, bf16_params=dtype == torch.bfloat16, reshard_after_forward=chunks is None)
    return model, chunks


def resume(config: RunConfig, model, optimizer, mesh: Mesh, found: Path | None, out_dir: Path, echo: bool) -> int:
    """Load the checkpoint `found` (if any) into the model and optimizer (weights alone after an
    optim.name or Muon optim.muon_exclude switch); on the main rank cut metrics.jsonl back to its step and write the run's
    config.json and run_config.json. Returns the step to start from."""
    start = 0
    if found:
        try:
            old, o = _flat(ckpt.read_meta(found).get("config", {})), config.optim  # optim.allow_switch: state starts fresh
            switched = old["optim.name"] != o.name or o.name == "muon" and muon_moves(config, old.get("optim.muon_exclude"))
            meta = ckpt.load_training_state(found, model, optimizer, mesh, with_optim=not switched)
        except (Exception, CheckpointException) as e:  # DCP wraps every rank's error in a BaseException
            cause = ckpt.dcp_cause(e)
            raise UserError(f"checkpoint {found} could not be loaded ({type(cause).__name__}: {cause}); move it "
                            f"out of {out_dir / 'checkpoints'} to resume from the one before") from e
        start = meta["step"]
        if echo:
            print(f"resumed from {found} (step {start})", flush=True)
    metrics_path = out_dir / "metrics.jsonl"
    if mesh.is_main:
        try:
            if metrics_path.exists():  # drop steps after the checkpoint we resume from
                kept = [m for m in read_metrics(metrics_path) if m["step"] <= start]
                metrics_path.with_suffix(".tmp").write_text("".join(json.dumps(m) + "\n" for m in kept))
                metrics_path.with_suffix(".tmp").replace(metrics_path)  # a kill mid-write keeps the old file
            (out_dir / "config.json").write_text(json.dumps(config.model.to_hf(), indent=2))
            (out_dir / "run_config.json").write_text(json.dumps(run_dict(config), indent=2))  # the effective run config
        except OSError as e:
            metrics_path.with_suffix(".tmp").unlink(missing_ok=True)
            raise disk_error(e, out_dir) or e
    return start


def train_step(run: Run, step: int, stop) -> Stepped:
    """One optimizer step, plain loop or pipeline. Returns with the optimizer's kernels queued: the host readies
    the next step while they run (the GPU does not wait between steps); that step's time holds them."""
    config, mesh = run.config, run.mesh
    t, o, device, model = config.train, config.optim, mesh.device, run.model
    if run.norms:
        run.norms.step = step + 1
    reset_peak_memory(device)
    lr = lr_at(step, o, t.steps)
    for group in run.optimizer.param_groups:
        group["lr"] = lr
    batch = run.loader.global_batch(step)
    n_label = int((batch["labels"] != -100).sum())  # over the whole global batch
    if depths := config.model.num_nextn_predict_layers:  # multi-token prediction: each depth's input tokens and labels
        batch.update(mtp_targets(batch, depths))
    n_mtp_label = int((batch["mtp_labels"] != -100).sum()) if depths else 0
    micros = [prepare_micro(m, mesh) for m in rank_micro_batches(batch, t.micro_batch_size, mesh.data_rank, mesh.data_ranks)]
    n_micro_global = len(micros) * mesh.data_ranks
    terms = LossTerms(t, n_label, n_micro_global, run.n_moe, n_mtp_label)  # how the loss is composed (protocol.py)
    sums = StepSums(device)
    run.engines.clear()
    if run.chunks is not None:
        ce, mtp_ce, aux = pipeline_step(run.runner, micros, terms, device, run.dtype)
        sums.ce += ce
        sums.mtp += mtp_ce
        for name, value in aux.items():
            sums.aux[name] += value
    else:
        for i, micro in enumerate(micros):
            if mesh.world > 1:  # accumulate unsharded gradients; reduce-scatter after the last micro-batch
                model.set_requires_gradient_sync(i == len(micros) - 1)
            engine = run.new_engine(*micro["input_ids"].shape)
            ce, mtp_ce = forward_loss(model, micro, engine, device, run.dtype)
            for name, value in terms.layer_sums(engine.aux, mean=True).items():
                sums.aux[name] += value
            terms.micro_loss(ce, engine.aux, mtp_ce).backward()
            sums.ce += ce.detach().double()
            if mtp_ce is not None:
                sums.mtp += mtp_ce.detach().double()
    if stop is not None and stop.signum:  # summed with the losses, so every rank stops after the same step
        sums.request_stop()
    # cross-entropy: pipeline rank 0 of every dp x cp x ep rank holds a share; aux terms: every rank
    group = None if mesh.pp > 1 or mesh.world == 1 else mesh.dense_mesh.get_group()
    ce_sum, mtp_sum, aux_sums, stops = sums.reduce(group, mesh.world, mesh.cp)  # the step's one host sync for its scalars
    loss, halt = ce_sum / max(n_label, 1), stops and step + 1 < run.end
    params = list(model.parameters())
    if run.norms:
        run.norms.grads(model.named_parameters())
    grad_norm = global_grad_norm(params, mesh)
    if not math.isfinite(loss) or not math.isfinite(grad_norm):
        kept = f"the last checkpoint, {good[-1]}, is kept" if (good := ckpt.list_checkpoints(run.out_dir)) else "no checkpoint yet"
        raise FloatingPointError(f"non-finite loss ({loss}) or grad norm ({grad_norm}) at step {step + 1}; {kept}. Lower "
                                 f"optim.lr, raise optim.warmup_steps or check the data, then {'resume' if good else 'run again'}.")
    with named_range("pithtrain::optimizer"):
        optimizer_step(run.optimizer, params, o.grad_clip, grad_norm)  # clips first
    run.optimizer.zero_grad(set_to_none=True)
    biases = model.correction_biases()
    step_loads = step_expert_loads(run.engines) if biases or mesh.ep > 1 else {}  # summed once, for both
    update_routing_biases(biases, step_loads, mesh, config.model)
    balance_ep = ep_load_balance(step_loads, mesh) if mesh.ep > 1 else None
    if run.capture and step + 1 == run.capture[1] and device.type == "cuda":
        drain(device)  # the capture holds the whole step
        torch.cuda.profiler.stop()
    metrics = StepSums.metrics(aux_sums, n_micro_global)
    if depths:  # the mean token cross-entropy over every depth's labels
        metrics["mtp_loss"] = mtp_sum / max(n_mtp_label, 1)
    return Stepped(loss, metrics, lr, grad_norm, n_label, batch["input_ids"].numel(), balance_ep, halt)


def write_instruments(run: Run, step: int, memory, profiler) -> None:
    """After a step: the debug-memory recording and the profiler trace, if they ran this step."""
    if memory is not None:
        path = memory.save(run.out_dir, run.mesh.rank)
        if run.echo:
            print(f"memory of step {step + 1} written to {path}", flush=True)
    if profiler is not None:
        drain(run.mesh.device)  # the step's queued kernels (its optimizer) into the trace
        profiler.stop()
        path = run.out_dir / "profile" / f"rank{run.mesh.rank}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        profiler.export_chrome_trace(str(path))
        if run.echo:
            print(f"profile of step {step + 1} written to {path.parent}/rank*.json", flush=True)


def end_of_run(run: Run) -> None:
    """The run reached its last step (train.steps or --stop-after): the final checkpoint, unless
    checkpoints are off or nothing ran and there was a checkpoint already."""
    if (run.start < run.end or not run.found) and run.config.train.checkpoint_every >= 0:
        run.save(run.end)


def check_run(config: RunConfig, out_dir: Path, stop_after: int | None = None, echo: bool = False,
              create: bool = True, world_size: int = 1) -> tuple[BatchLoader, tuple | None, Path | None]:
    """What can fail before a model is built, checked first (and by `pithtrain train` before it starts
    workers): the run directory takes files (`create`: make it, on one rank), data.path is a dataset
    whose ids fit the model's vocabulary (and so is data.eval_path), the hold-out leaves a batch to
    train on, and a checkpoint to resume agrees with this config (check_resume), its metrics.jsonl too. Returns
    the batch loader, the eval samples (eval_windows) and the checkpoint to resume from (None: start afresh)."""
    check(stop_after is None or stop_after >= 1, f"--stop-after {stop_after}: must be at least 1")
    if echo and stop_after is not None and stop_after < config.train.steps and config.train.checkpoint_every == -1:
        print(f"warning: --stop-after {stop_after} with train.checkpoint_every=-1 writes no checkpoint: the run cannot be "
              "resumed; leave train.checkpoint_every at its default", flush=True)
    if create:
        try:
            (out_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
            tempfile.TemporaryFile(dir=out_dir / "checkpoints").close()
        except OSError as e:
            raise UserError(f"--out {out_dir}: cannot write the run directory ({e}); choose another --out") from None
    d = config.data
    if not d.path:
        raise UserError("data.path is empty; set it to a dataset directory of `pithtrain tokenize` (--set data.path=DIR)")
    loader = open_training_data(d.path, d.seq_len, config.train.global_batch_size, d.seed, d.pack_documents,
                                0 if d.eval_path else d.eval_samples, config.model.vocab_size)
    seen = {}
    for ds in loader.datasets:  # hashed now: checkpoints record the data the run started on
        if (twin := seen.setdefault((ds.identity["content_sha256"], ds.identity["tokens_sample_sha256"]), ds.path)) != ds.path:
            raise UserError(f"data.path: {ds.path} holds the same tokens as {twin} (a copy?); a blend names each dataset once: "
                            "give the one its combined weight")
    vocab = config.model.vocab_size
    if echo and (short := next((ds for ds in loader.datasets if ds.tokenizer_file and ds.vocab_size > vocab), None)):
        print(f"warning: model.vocab_size={vocab} is below the {short.vocab_size} tokens of {short.tokenizer_file}: ids from "
              f"{vocab} on (none in this data) have no row, so the model and its export fail on texts that use them; set "
              f"model.vocab_size={short.vocab_size} or more", flush=True)
    check_model_size(config.model, pick_device(config.train.device).type == "cpu")
    check_pipeline_layers(config)
    check_muon_takes_some(config, echo)
    # the run's writing process moves what it must (the --nproc launcher's check, before any worker, leaves that to rank 0)
    act = create and (echo or world_size == 1 or torch.distributed.is_initialized())
    found = ckpt.newest_intact(out_dir, report=lambda line: print(line, flush=True) if echo else None, set_aside=act)
    logged, n = out_dir / "metrics.jsonl", 1
    if found is None and logged.is_file() and logged.stat().st_size:  # an earlier run's steps, nothing to resume
        while (kept := out_dir / f"metrics_earlier{f'_{n}' if n > 1 else ''}.jsonl").exists():
            n += 1
        if act:  # a dry run only says so
            logged.rename(kept)
        if echo:
            print(f"note: {logged} holds an earlier run's steps, with no checkpoint to resume from: this run starts at "
                  f"step 0; {'moved' if create else 'would move'} that file to {kept.name}", flush=True)
    if found is not None:  # the newest checkpoint whose files pass their checksums
        if logged.is_file():  # resume cuts it back by "step": a row without an integer one is named, early
            read_metrics(logged, fix="remove that line (or move it to another file), then resume")
        check_resume(config, found, stop_after, echo, loader.datasets)
    elif config.train.init_from:
        check_init_from(config, echo, verify=not create, dataset=loader.dataset)  # a run verifies the checkpoint as it loads it
    if found is None and config.optim.allow_switch and echo:  # a permission for a resume, meaningless here
        print(f"warning: optim.allow_switch has no effect: {out_dir} holds no checkpoint to resume, the run starts fresh",
              flush=True)
    return loader, eval_windows(config, loader, world_size), found


# HF config fields that do not change what the weights compute: token ids, the initialisation's scale,
# the longest sequence meant (plain or YaRN RoPE reads its own fields), training's routing-bias step
NOT_ARCHITECTURE = ("bos_token_id", "eos_token_id", "pad_token_id", "initializer_range", "max_position_embeddings",
                    "bias_update_speed", "architectures", "dtype")


def check_init_from(config: RunConfig, echo: bool, verify: bool = False, dataset: TokenDataset | None = None) -> None:
    """train.init_from's model has the run's architecture (every HF config field but NOT_ARCHITECTURE's;
    those keep the run's values), read from its config.json alone, and its tokenizer (an HF directory's tokenizer.json,
    the one a checkpoint's run recorded, when there) gives its tokens the ids `dataset`'s does; says where the weights
    come from. `verify` (--dry-run): a checkpoint's files against their checksums too, as loading it would."""
    path = ckpt.run_of(config.train.init_from)
    source = path if ckpt.is_hf_dir(path) or ckpt.is_checkpoint(path) else next(reversed(ckpt.list_checkpoints(path)), None)
    if verify and source is not None and not ckpt.is_hf_dir(source):
        try:
            source = ckpt.resolve_checkpoint(path)
        except (OSError, ValueError) as e:
            raise UserError(f"train.init_from={path}: {e}") from None
    elif verify and source is not None and (index := source / "model.safetensors.index.json").is_file():
        shards = set(read_json(index, "re-download or re-export it").get("weight_map", {}).values())
        if missing := sorted(f for f in shards if not (source / f).is_file()):
            raise UserError(f"train.init_from={path}: {missing[0]}, a shard its {index.name} names, is missing; "
                            "re-download or re-export it")
    if source is None:
        raise UserError(f"train.init_from={path}: neither an HF directory (config.json and *.safetensors) nor a checkpoint "
                        "or a run directory with one; fix the path or set it to ''")
    theirs, ours = ckpt.model_config(source).to_hf(), config.model.to_hf()
    for d in (theirs, ours):  # Qwen3.5 nests its fields rope_theta and partial_rotary_factor there: name those
        d.update(d.pop("rope_parameters", None) if isinstance(d.get("rope_parameters"), dict) else {})
    differ = [k for k in sorted(theirs.keys() | ours.keys()) if theirs.get(k) != ours.get(k)]
    wrong = ["model_type"] if "model_type" in differ else [k for k in differ if k not in NOT_ARCHITECTURE]
    if ours.get("num_nextn_predict_layers") == 0:  # the source's multi-token prediction layers are left out on load
        wrong = [k for k in wrong if k != "num_nextn_predict_layers"]
    if wrong:
        raise UserError(f"train.init_from={path}: its model differs from the run's in " + ", ".join(
            f"model.{k} ({theirs.get(k)!r} there, {ours.get(k)!r} in the run)" for k in wrong) +
            "; set the run's model fields to the source's (its config.json) or choose another train.init_from")
    if dataset is not None and dataset.tokenizer_file and (tokenizer := _tokenizer_of_model(source, dataset)):
        from tokenizers import Tokenizer

        theirs = ours = {}
        with contextlib.suppress(Exception):  # tokenizers' bare Exception: a file it does not read is not compared (training never reads it)
            theirs, ours = (Tokenizer.from_file(str(f)).get_vocab() for f in (tokenizer, dataset.tokenizer_file))
        if moved := [t for t, i in theirs.items() if ours.get(t) != i]:  # more tokens of ours (an extension) are fine
            raise UserError(f"train.init_from={path}: its tokenizer {tokenizer} gives {len(moved)} of its tokens other ids "
                            f"than the data's {dataset.tokenizer_file} (e.g. {moved[0]!r}: {theirs[moved[0]]} there, "
                            f"{ours.get(moved[0])} here), so its weights would read other tokens; tokenize the data with "
                            f"--tokenizer {tokenizer}")
    if echo:
        kept = [k for k in differ if k not in ("architectures", "dtype")]
        print(f"init_from: the weights of {source}" + (f" (the run keeps its own {', '.join(kept)})" if kept else ""),
              flush=True)


def _tokenizer_of_model(source: Path, dataset: TokenDataset) -> Path | None:
    """The tokenizer.json of init_from's model other than the dataset's: an HF directory's (or of a checkpoint convert made of
    one), or the one a checkpoint's run recorded if it is still there unchanged; None when there is none to compare."""
    own = dataset.identity["tokenizer_sha256"]
    if ckpt.is_hf_dir(source) or (source / "tokenizer.json").is_file():  # an HF directory's, or a checkpoint's convert made of one
        file = source / "tokenizer.json"
        return file if file.is_file() and data_sha256(file) != own else None
    recorded = ckpt.read_meta(source).get("dataset") or {}
    file, sha = Path(recorded.get("path") or "/nonexistent", "tokenizer.json"), recorded.get("tokenizer_sha256")
    return file if sha not in (None, own) and file.is_file() and data_sha256(file) == sha else None


MAX_PARAMETERS = 10**13  # ten times the largest released MoE: past it, a size field is a typo


def check_model_size(model_cfg, on_cpu: bool = False) -> None:
    """The model's weights can be laid out (counted on the meta device) and are not absurdly many: a
    size field off by orders of magnitude fails here in one line, not in an allocation traceback. `on_cpu`: their
    fp32 weights, gradients and AdamW moments fit this machine's memory, else the kernel kills the run unannounced."""
    sizes = ", ".join(f"{f.name}={getattr(model_cfg, f.name)}" for f in dataclasses.fields(model_cfg)
                      if isinstance(getattr(model_cfg, f.name), int) and getattr(model_cfg, f.name) > 4096
                      and f.name not in NOT_ARCHITECTURE)  # token ids, max_position_embeddings: no size
    try:
        total = model_sizes(model_cfg)[0]
    except (RuntimeError, ValueError, OverflowError, MemoryError) as e:
        raise UserError(f"model: its weights cannot be laid out ({str(e).splitlines()[0][:120]}); a size field is too "
                        f"large ({sizes or 'see the model fields'}); fix it") from None
    if total > MAX_PARAMETERS:
        raise UserError(f"model: {total:.3g} parameters, more than {MAX_PARAMETERS:.0e}: a size field is too large "
                        f"({sizes}); fix it")
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if on_cpu and hasattr(os, "sysconf") else math.inf
    if 16 * total > ram:
        raise UserError(f"model: {total:.3g} parameters need {16 * total / 2**30:.1f} GiB on the CPU (fp32 weights, "
                        f"gradients and AdamW moments, 16 bytes each), more than this machine's {ram / 2**30:.1f} GiB; "
                        f"train it on GPUs (memory per GPU without one: .agents/skills/estimate-memory/estimate_memory.py), or "
                        f"make it smaller ({sizes or 'the model fields'})")


def check_muon_takes_some(config: RunConfig, echo: bool = False) -> None:
    """optim.name=muon with every matrix excluded by optim.muon_exclude would be an AdamW run; a pattern that
    matches no parameter (a typo) is said."""
    if config.optim.name != "muon":
        return
    with torch.device("meta"):  # names and shapes, without memory
        params = list(config.model.build_model().named_parameters())
    unused = [pat for pat in config.optim.muon_exclude if pat not in MUON_EXCLUDE  # the defaults cover every family
              and not any(fnmatchcase(name, pat) for name, _ in params)]
    if echo and unused:
        print(f"warning: optim.muon_exclude {unused} match no parameter (names are like {params[-1][0]}): a typo?", flush=True)
    if not any(takes_muon(name, p, config.optim.muon_exclude) for name, p in params):
        raise ConfigError(f"optim.name=muon, but optim.muon_exclude={config.optim.muon_exclude} excludes every weight "
                          "matrix: the run would be AdamW; narrow optim.muon_exclude or set optim.name=adamw")


def muon_moves(config: RunConfig, was) -> bool:
    """Whether optim.muon_exclude `was` (a resumed checkpoint's) -> config's moves a weight between Muon and AdamW,
    whose optimizer states differ (a pattern for what Muon never takes, a 1-D norm or bias, moves none)."""
    if was is None or list(was) == list(config.optim.muon_exclude):
        return False
    with torch.device("meta"):
        params = list(config.model.build_model().named_parameters())
    return any(takes_muon(name, p, was) != takes_muon(name, p, config.optim.muon_exclude) for name, p in params)


def eval_windows(config: RunConfig, loader: BatchLoader, world_size: int = 1) -> tuple[BatchLoader, np.ndarray] | None:
    """The eval samples: (a loader whose `windows` reads them, their window indices), or None.
    data.eval_path: its first data.eval_samples windows (0: as many whole global batches as it
    holds); otherwise the last data.eval_samples windows of data.path, which `loader` holds out."""
    d, batch = config.data, config.train.global_batch_size
    if not d.eval_path:
        return (loader, np.arange(loader.num_samples, loader.num_samples + d.eval_samples)) if d.eval_samples else None
    try:
        dataset = TokenDataset(d.eval_path)
        dataset.check_vocab(config.model.vocab_size)
    except (OSError, ValueError) as e:
        raise UserError(f"data.eval_path={d.eval_path!r}: {e}") from None
    ours, theirs = loader.dataset.identity, dataset.identity  # a blend's: the first dataset's (one tokenizer)
    trained = [dataset.identity for dataset in loader.datasets]  # each dataset of a blend
    if not d.eval_on_train and any(theirs["path"] == t["path"] or theirs["content_sha256"] == t["content_sha256"]
                                   for t in trained):
        raise UserError(f"data.eval_path={d.eval_path!r} is a training dataset (data.path={d.path!r}): its loss "
                        "would be a training loss; use a held-out dataset, data.eval_samples=N without data.eval_path, "
                        "or set data.eval_on_train=true to evaluate on the training data")
    if None not in (theirs["tokenizer_sha256"], ours["tokenizer_sha256"]) and theirs["tokenizer_sha256"] != ours["tokenizer_sha256"]:
        raise UserError(f"data.eval_path={d.eval_path!r} was tokenized with another tokenizer than data.path={d.path!r} "
                        f"(their tokenizer.json differ); tokenize it with --tokenizer {ours['path']}/tokenizer.json")
    if not config.train.eval_every:  # never read (validate warns): its size is no reason to refuse the run
        return None
    total = (dataset.num_tokens - 1) // d.seq_len
    step = config.train.micro_batch_size * data_rank_count(config.parallel, world_size)  # validate's rule
    n, fit = d.eval_samples or total // batch * batch, total // step * step
    if not 0 < n <= total:  # 0 samples would mean all of them: not a fix to offer
        raise UserError(f"data.eval_path={d.eval_path!r}: {total} sample{'s' * (total != 1)} of {d.seq_len} tokens, fewer than "
                        f"{f'data.eval_samples={n}' if d.eval_samples else f'one global batch ({batch})'}; use a larger eval "
                        f"set" + (f", or data.eval_samples of at most {fit} (a multiple of the micro-batch x data ranks)" if fit else ""))
    return BatchLoader(dataset, d.seq_len, 1, 0, d.pack_documents), np.arange(n)


@torch.no_grad()
def evaluate(parts, runner, evaluation, config: RunConfig, mesh: Mesh, dispatcher, dtype) -> float:
    """The held-out loss on the training mesh, in eval mode: the sum of token cross-entropies over
    the eval samples / their number of label tokens (the training loss's definition). Samples go
    in global batches, cut into micro-batches as in training; `parts`: the model or its chunks."""
    loader, indices = evaluation
    t, device = config.train, mesh.device
    ce, n_label = torch.zeros((), dtype=torch.float64, device=device), 0
    for part in parts:
        part.eval()
    for i in range(0, len(indices), t.global_batch_size):
        batch = loader.windows(indices[i : i + t.global_batch_size])
        n_label += int((batch["labels"] != -100).sum())
        micros = [prepare_micro(m, mesh) for m in rank_micro_batches(batch, t.micro_batch_size, mesh.data_rank, mesh.data_ranks)]
        if runner is None:
            for micro in micros:
                ce += forward_loss(parts[0], micro, ExpertEngine(dispatcher, None, *micro["input_ids"].shape), device, dtype)[0].double()
            continue
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            ce += runner.forward_only(micros, lambda logits, micro: cross_entropy_sum(logits, micro["labels"]),
                                      lambda b, s: ExpertEngine(dispatcher, None, b, s))
    for part in parts:
        part.train()
        if runner is not None and isinstance(part, FSDPModule):  # a pipeline chunk keeps its gathered weights
            part.reshard()
    if mesh.world > 1:  # as the training loss: pipeline rank 0 of every dp x cp x ep rank holds a share
        torch.distributed.all_reduce(ce, group=None if mesh.pp > 1 else mesh.dense_mesh.get_group())
    return ce.item() / max(n_label, 1)


def cpu_threads(device: torch.device) -> str:
    """On the CPU, at most (usable cores // processes on this host) torch threads per process, so
    that launched workers do not oversubscribe the cores; an explicit OMP_NUM_THREADS, or a lower
    torch.set_num_threads, is kept. Returns the choice for the startup line."""
    if device.type != "cpu":
        return ""
    if "OMP_NUM_THREADS" in os.environ:
        return f" (torch threads: {torch.get_num_threads()}, from OMP_NUM_THREADS)"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE") or 1))  # 0 or '' from a hand-made launcher environment
    torch.set_num_threads(min(torch.get_num_threads(), max(1, cores // local)))
    return f" (torch threads: {torch.get_num_threads()}, at most {cores} cores // {local} processes on this host)"


# Resuming with a change to these is refused: the checkpoint's weights or the data order would not
# fit (every model.* field is refused too; so is optim.name, unless optim.allow_switch: check_resume).
HELD_OUT = "data.eval_samples held out of data.path"
FIXED = ("data.path", "data.seed", "data.seq_len", "train.global_batch_size", HELD_OUT)
# Applied from the resumed step with a warning: they change the optimisation from there on. Any
# other field (logging, checkpointing, compile, dtype, the mesh: checkpoints reshard) changes freely.
WARNED = ("optim.", "train.steps", "train.lb_coef", "train.lb_type", "train.mtp_coef", "data.pack_documents",
          "model.bias_update_speed")  # DeepSeek-V3 sets it to 0 for its last 500B tokens


def check_pipeline_layers(config: RunConfig) -> None:
    """Every pipeline rank holds a layer (else nothing to train there: its optimizer would refuse an empty list);
    check_run's, and the skills' that size or launch a run."""
    layers, pp = config.model.num_hidden_layers, config.parallel.pp
    if idle := ranks_without_layers(layers, pp):
        least = next(n for n in range(layers, 4 * pp) if not ranks_without_layers(n, pp))
        raise UserError(f"parallel.pp={pp}: with model.num_hidden_layers={layers} pipeline rank(s) "
                        f"{', '.join(map(str, idle))} hold no layer; use at least {least} layers or fewer stages")


def check_resume(config: RunConfig, checkpoint: Path, stop_after: int | None = None, echo: bool = True,
                 datasets: list[TokenDataset] = ()) -> None:
    """Compare the run config stored in `checkpoint` (meta.json) with `config`, field by field, and
    the datasets it recorded (real paths and identities) with `datasets`, those of this run's data.path:
    a data.path whose datasets moved, their identities, weights and order alike, is taken with a note."""
    meta = read_json(checkpoint / "meta.json", f"move {checkpoint} away to resume from the checkpoint before it")
    old, new = _flat(meta.get("config", {})), _flat(json.loads(json.dumps(run_dict(config))))
    recorded = meta.get("dataset") or {}
    if "data_path" in meta:  # the path(s) as resolved when the run started, not in today's working directory
        old["data.path"] = meta["data_path"]
    elif "path" in recorded and not isinstance(old.get("data.path"), list):
        old["data.path"] = recorded["path"]
    ids = meta.get("datasets") or [recorded] * bool(recorded)  # each dataset's (older runs: the first's, or none)
    current = [dataset.identity for dataset in datasets]
    if bad := next((r.get("path") for r, i in zip(ids, current) if r.get("path") == i["path"] and not _alike(r, i)), None):
        raise UserError(f"cannot resume from {checkpoint}: the dataset at {bad} changed since it was written (its "
                        "tokenizer.json, meta.json, doc_offsets.npy or tokens.bin differ); restore that dataset, or "
                        "train into a new --out")
    changed = {k: (old[k], new[k]) for k in sorted(old.keys() & new.keys()) if old[k] != new[k]}
    was, named = meta.get("config", {}).get("model") or {}, {f.name for f in dataclasses.fields(config.model)}
    with contextlib.suppress(TypeError, ValueError):  # the same model written otherwise (layer_types None and its list)
        if was.get("model_type") == config.model.model_type and config.model.to_hf() == dataclasses.replace(
                config.model, **{k: v for k, v in was.items() if k in named}).to_hf():
            changed = {k: v for k, v in changed.items() if not k.startswith("model.")}
    if moves := "data.path" in changed and _moved(*changed["data.path"], ids, current):
        del changed["data.path"]

    def show(keys):
        return ", ".join(f"{k} {changed[k][0]!r} -> {changed[k][1]!r}" for k in keys)

    if fixed := [k for k in changed if (k.startswith("model.") or k in FIXED) and not k.startswith(WARNED)]:
        where = " (a relative data.path resolves against the working directory)" if "data.path" in fixed else ""
        raise UserError(f"cannot resume from {checkpoint}: {show(fixed)} changed since it was written{where}; "
                        f"undo the change (--set) or train into a new --out")
    if "optim.name" in changed and not config.optim.allow_switch:
        was, now = changed["optim.name"]
        raise UserError(f"cannot resume from {checkpoint}: it holds {was} optimizer state and optim.name={now}; set "
                        f"optim.name={was}, or --set optim.allow_switch=true to go on with {now} from fresh optimizer "
                        f"state, or train into a new --out")
    if ("optim.muon_exclude" in changed and config.optim.name == "muon" and not config.optim.allow_switch
            and muon_moves(config, changed["optim.muon_exclude"][0])):
        raise UserError(f"cannot resume from {checkpoint}: {show(['optim.muon_exclude'])} moves weights between Muon and AdamW, "
                        "whose optimizer states differ; undo the change, or --set optim.allow_switch=true to go on from fresh "
                        "optimizer state, or train into a new --out")
    step = meta["step"]
    for name, value in (("train.steps", config.train.steps), ("--stop-after", stop_after)):
        if value is not None and value < step:
            raise UserError(f"the run is already at step {step} ({checkpoint}), past {name}={value}; give "
                            f"{name} >= {step} or train into a new --out")
    # else silently never taken; the run's own profile_step, already taken, resumes as it is
    if 0 < config.train.profile_step <= step and "train.profile_step" in changed:
        raise UserError(f"train.profile_step={config.train.profile_step}: the run resumes after step {step} ({checkpoint}); "
                        f"give a later step")
    if moves and echo:
        print(f"note: data.path moved: {moves}; the same data as {checkpoint} recorded (tokenizer and content SHA-256, "
              "weights, order): the run goes on with it", flush=True)
    if (change := changed.pop("train.init_from", None)) and change[1] and echo:  # a resume loads its own checkpoint, never init_from's
        print(f"note: train.init_from is not used: the run resumes from its own {checkpoint}; train into a new --out "
              "to start from it", flush=True)
    changed.pop("optim.allow_switch", None)  # a permission for the one resume that switches, not a setting
    # lb_type=micro balances each micro-batch's routing: another micro-batch size changes the loss itself
    lb_micro = config.train.lb_coef > 0 and config.train.lb_type == "micro" and "train.micro_batch_size" in changed
    warned = [k for k in changed if k.startswith(WARNED) or lb_micro and k == "train.micro_batch_size"]
    if echo and warned:
        why = " (train.lb_type=micro: the load-balance loss is taken per micro-batch)" if lb_micro else ""
        print(f"warning: resuming at step {step} with {show(warned)}: applied from here on{why}", flush=True)
    if echo and len(warned) < len(changed):
        print(f"note: also changed: {show(k for k in changed if k not in warned)}", flush=True)


def _moved(was, now, recorded: list[dict], found: list[dict]) -> str | None:
    """'X -> Y, ...' when data.path `now` (flat: real paths) names the datasets `recorded` at `was`, some moved:
    each one's identity but its path, weight and place alike; else None."""
    was, now = ([[p, 1.0]] if isinstance(p, str) else p for p in (was, now))
    same = len(recorded) == len(found) == len(was) == len(now) and all(
        w == v and _alike(r, f) for (_, w), (_, v), r, f in zip(was, now, recorded, found))
    return ", ".join(f"{p} -> {q}" for (p, _), (q, _) in zip(was, now) if p != q) if same else None


def _alike(recorded: dict, found: dict) -> bool:
    """Two dataset identities alike but for the path, on the hashes both hold (older checkpoints lack some)."""
    return all(recorded[k] == found[k] for k in recorded.keys() & found.keys() - {"path"})


def _flat(config: dict) -> dict:
    """{"train.steps": 6, ...} from a stored run config (data.path as the real path it names)."""
    flat = {f"{section}.{k}": v for section, fields in config.items() if isinstance(fields, dict) for k, v in fields.items()}
    flat.setdefault("optim.name", "adamw")  # checkpoints from before Muon
    if "data.path" in flat:
        parts = data_parts(flat["data.path"])
        flat["data.path"] = os.path.realpath(parts[0][0]) if len(parts) == 1 else [[os.path.realpath(p), w] for p, w in parts]
        # the hold-out changes the training order (eval_samples alone does not, with an eval_path)
        flat[HELD_OUT] = 0 if flat.get("data.eval_path") else flat.get("data.eval_samples", 0)
    return flat


def save_failed(error: BaseException, out_dir: Path, step: int, is_main: bool) -> BaseException:
    """The error to raise for a failed checkpoint save. A disk error (full, read-only, gone) becomes one message naming
    it and the last good checkpoint, after removing the partial step_N.tmp; anything else is returned unchanged."""
    tmp = out_dir / "checkpoints" / f"step_{step:08d}.tmp"  # where checkpoint.write_checkpoint writes
    good = ckpt.list_checkpoints(out_dir)
    # DCP wraps a rank's error; PyTorch's writers raise a RuntimeError that names the OS error
    failure = disk_error(ckpt.dcp_cause(error), f"the checkpoint of step {step}", removed=tmp,
                         then=f"run again to resume: the last good checkpoint is {good[-1] if good else 'none'}")
    if failure is None:
        return error
    if is_main:
        shutil.rmtree(tmp, ignore_errors=True)
    return failure


def fp8_text(t) -> str:
    """The start line's FP8 part: the recipe, the head, the CPU's emulation."""
    return "" if t.fp8 == "off" else f", FP8 {t.fp8}{' + head' if t.fp8_head else ''}{' (emulated)' if t.fp8_emulate else ''}"


# Inductor makes a reduction over rows wider than 1,024 values a looped kernel that reads each row again after its
# reduction: stage 1's FP8 quantizations of 4,096- and 5,120-wide rows (the max, then the scaled copy), the norms before
# them. Up to this width a row stays in registers and is read once (benchmarks/fp8.py --rows); 0: Inductor's choice.
PERSISTENT_ROWS = 8192


def _persistent_rows():
    """Inductor's choices with PERSISTENT_ROWS: an inner reduction (along contiguous rows) of a width known at
    compile time and at most that is one persistent kernel. Set for this thread's compilations from now on;
    the returned context manager, if entered, puts the previous choices back as it exits."""
    from torch._inductor.choices import InductorChoices
    from torch._inductor.runtime.hints import ReductionHint
    from torch._inductor.virtualized import V

    class Choices(InductorChoices):
        @staticmethod
        def should_use_persistent_reduction(features, cooperative_reduction, *args, **kwargs) -> bool:
            if (PERSISTENT_ROWS and not cooperative_reduction and features.get_reduction_hint() == ReductionHint.INNER
                    and V.graph.sizevars.statically_known_leq(features.reduction_numel, PERSISTENT_ROWS)):
                return True
            return InductorChoices.should_use_persistent_reduction(features, cooperative_reduction, *args, **kwargs)

    return V.set_choices_handler(Choices())


def compile_stages(model) -> None:
    """torch.compile(fullgraph=True) the dense stages (1: norms, attention, router; 5: the
    weighted sum) of every layer. The expert stage and the dispatch planning stay eager (their
    shapes depend on the routing). Layers of one family share their graphs."""
    if torch.cuda.is_available():
        _persistent_rows()
    for layer in all_layers(model).values():
        layer.stage1 = torch.compile(layer.stage1, fullgraph=True)
        layer.stage5 = torch.compile(layer.stage5, fullgraph=True)


def recompute_stages(model, mode: str) -> None:
    """train.recompute. selective: each MoE layer's SwiGLU output is recomputed from the kept gate/up product
    (ops/grouped_gemm.activation_mm). full: stages 1 and 3 of every layer run under a non-reentrant checkpoint: only
    their inputs are kept and the whole stage runs again when the backward reaches it. Stage 1 and 3 hold no all-to-all
    and no generator yield, so a recomputation stays inside one segment of DualPipeV's backward."""
    for experts in expert_modules(model) if mode == "selective" else ():
        experts.recompute_act = True
    for layer in all_layers(model).values() if mode == "full" else ():
        layer.stage1, layer.stage3 = _checkpointed(layer.stage1), _checkpointed(layer.stage3)


def _checkpointed(stage):
    def run(*args):
        if not torch.is_grad_enabled():
            return stage(*args)
        # the stages draw no random numbers: no RNG state to save and restore
        return torch.utils.checkpoint.checkpoint(stage, *args, use_reentrant=False, preserve_rng_state=False)

    return run


def cuda_profiler_steps() -> tuple[int, int] | None:
    """PITHTRAIN_PROFILE_STEPS=FIRST:LAST (1-based, inclusive): on GPUs the loop calls
    torch.cuda.profiler.start() before step FIRST and stop() after step LAST, the capture range of
    `nsys profile --capture-range=cudaProfilerApi` and `ncu --profile-from-start off`."""
    if not (spec := os.environ.get("PITHTRAIN_PROFILE_STEPS")):
        return None
    first, _, last = spec.partition(":")
    if not (first.isdigit() and last.isdigit() and 1 <= int(first) <= int(last)):
        raise UserError(f"PITHTRAIN_PROFILE_STEPS={spec!r}: expected FIRST:LAST with 1 <= FIRST <= LAST, e.g. 3:4")
    return int(first), int(last)


def drain(device: torch.device) -> None:
    """Wait for the GPU's queued work (train_step leaves its optimizer running)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def start_profiler(device: torch.device):
    """torch.profiler over one step (CPU ops, and CUDA kernels on GPUs); see the capture-profile skill."""
    cpu, cuda = torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA
    profiler = torch.profiler.profile(activities=[cpu, cuda] if device.type == "cuda" else [cpu], record_shapes=False)
    profiler.start()
    return profiler


def pipeline_step(runner, micros, terms: LossTerms, device, dtype) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """One optimizer step's forward/backward through the pipeline (this rank's part); returns the
    cross-entropy sums (main, MTP) and, per auxiliary term, the sum over micro-batches of its layer mean."""
    ce_sums, mtp_sums = [], []

    def loss_fn(out, micro):
        ce, mtp_ce = head_losses(out, micro)
        ce_sums.append(ce.detach().double())
        if mtp_ce is not None:
            mtp_sums.append(mtp_ce.detach().double())
        return terms.ce_share(ce, mtp_ce)

    lists = dualpipev_schedule(runner.mesh.pp, len(micros), defer_w=True)  # expert weight grads in W passes
    with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
        aux_totals = runner.run(micros, loss_fn, lists, terms)
    ce, mtp_ce = (torch.stack(x).sum() if x else torch.zeros((), dtype=torch.float64, device=device) for x in (ce_sums, mtp_sums))
    return ce, mtp_ce, {name: total / max(terms.n_layers, 1) for name, total in aux_totals.items()}


def step_expert_loads(engines: list[ExpertEngine]) -> dict[int, torch.Tensor]:
    """layer id -> tokens per expert over this step's engines (one per (chunk) forward: all its
    micro-batches and chunks on this rank)."""
    loads = {}
    for engine in engines:
        for layer_id, load in engine.expert_loads.items():
            loads[layer_id] = loads[layer_id] + load if layer_id in loads else load
    return loads


@torch.no_grad()
def update_routing_biases(biases: dict, step_loads: dict, mesh: Mesh, model_cfg) -> None:
    """Aux-loss-free balancing: once per optimizer step, move each `e_score_correction_bias`
    (`biases`: layer id -> bias, the model's correction_biases()) from the expert loads of the
    WHOLE global batch (all micro-batches, all data ranks)."""
    if not biases:
        return
    layer_ids = sorted(biases)
    loads = torch.stack([step_loads[i].float() for i in layer_ids])
    if mesh.world > 1:  # every rank of this pipeline stage that holds other tokens: dp x cp x ep
        torch.distributed.all_reduce(loads, group=mesh.dense_mesh.get_group())
    for layer_id, load in zip(layer_ids, loads):
        update_correction_bias(biases[layer_id], load, model_cfg.bias_update_speed)


@torch.no_grad()
def ep_load_balance(step_loads: dict, mesh: Mesh) -> float:
    """How evenly routing spread this step's expert work over the EP ranks (`rank_balance` of the loads of the
    whole EP group), over every stage's MoE layers (a stage may hold none)."""
    sums = torch.zeros(2, dtype=torch.float64, device=mesh.device)
    if step_loads:
        loads = torch.stack([step_loads[i] for i in sorted(step_loads)])
        torch.distributed.all_reduce(loads, group=mesh.ep_group)
        sums = rank_balance(loads, mesh.ep, parts=True)
    if mesh.pp > 1:  # every rank's sums: each EP group's counted once a member, the same on both sides of the ratio
        torch.distributed.all_reduce(sums)
    return float(sums[0] / sums[1]) if sums[1] else 1.0


def rank_balance(loads: torch.Tensor, ep: int, parts: bool = False) -> float | torch.Tensor:
    """loads [layers, experts] -> sum over layers of the mean EP rank's load / sum over layers of
    the busiest rank's load (1.0 = even; `parts`: the two sums). Each layer's all-to-alls make every rank
    wait for the busiest, so this bounds how well the expert stage scales."""
    per_rank = loads.view(loads.shape[0], ep, -1).sum(-1).double()
    sums = torch.stack([per_rank.mean(1).sum(), per_rank.max(1).values.sum()])
    return sums if parts else float(sums[0] / sums[1].clamp(min=1))


def size_text(config: RunConfig, loader, counts: tuple[int, int]) -> str:
    """The end of the startup line, which --dry-run prints too: parameters active per token (`counts`:
    model_sizes), tokens per step, steps per epoch."""
    epochs = (": " + ", ".join(f"{n:.1f} of {part.dataset.path}" for n, part in zip(loader.steps_per_epoch(), loader.parts))
              if isinstance(loader, BlendLoader) else f" {loader.num_samples / loader.global_batch_size:.1f}")
    return (f"{count_text(counts[1])} parameters active per token, "
            f"{config.train.global_batch_size * config.data.seq_len:,} tokens per step, steps per epoch{epochs}")


def count_text(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n:,}"
