"""The training loop: data -> micro-batches -> forward/backward -> clip -> AdamW step -> metrics -> checkpoints.

Loss semantics (independent of how the global batch is cut into micro-batches):
    loss    = sum of next-token cross-entropy over the global batch / number of label tokens
    lb_loss = mean over micro-batches of the per-micro-batch load-balance loss
    total   = loss + train.lb_coef * lb_loss
Each micro-batch's backward uses its share of `total`, so accumulated gradients are the gradients
of `total` itself.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict
from pathlib import Path

import torch

from pithtrain.config import RunConfig, validate
from pithtrain.ops.core import cross_entropy_sum
from pithtrain.parallel.expert import ExpertEngine, LocalDispatch
from pithtrain.train import checkpoint as ckpt
from pithtrain.train.balance import LoadBalance
from pithtrain.train.data import BatchLoader, TokenDataset
from pithtrain.train.metrics import MetricsLog, peak_memory_bytes, read_metrics
from pithtrain.train.optim import build_optimizer, lr_at


def pick_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("train.device=cuda but no CUDA device is visible; use train.device=auto or cpu")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def compute_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return torch.bfloat16 if name == "bf16" else torch.float32


def forward_loss(model, micro: dict, engine: ExpertEngine, device, dtype):
    """Forward one micro-batch; returns (sum of token cross-entropy, load-balance loss or None)."""
    ids = micro["input_ids"].to(device)
    pos = micro["position_ids"].to(device)
    doc = micro["doc_ids"].to(device) if "doc_ids" in micro else None
    with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
        logits = model(ids, pos, engine, doc_ids=doc)
    return cross_entropy_sum(logits, micro["labels"].to(device)), engine.lb_loss()


def split_micro(batch: dict, size: int) -> list[dict]:
    n = batch["input_ids"].shape[0]
    return [{k: v[i : i + size] for k, v in batch.items()} for i in range(0, n, size)]


def train(
    config: RunConfig, out_dir: str | Path, steps: int | None = None, echo: bool = True, stop_after: int | None = None
) -> list[dict]:
    """Train (resuming from the latest checkpoint in out_dir); returns this run's per-step metrics.
    `stop_after` ends the run early (with a checkpoint) without changing the schedule of `train.steps`."""
    if steps is not None:
        config.train.steps = steps
    validate(config, world_size=1)
    t, o = config.train, config.optim
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    device, dtype = pick_device(t.device), None
    dtype = compute_dtype(t.dtype, device)

    dataset = TokenDataset(config.data.path)
    dataset.check_vocab(config.model.vocab_size)
    loader = BatchLoader(dataset, config.data.seq_len, t.global_batch_size, config.data.seed, config.data.pack_documents)

    model = config.model.build_model()
    model.init_weights(t.seed)
    found = ckpt.list_checkpoints(out_dir)
    if t.init_from and not found:
        _init_from(model, t.init_from)
    model.to(device)  # fp32 master weights; bf16 compute comes from autocast
    optimizer = build_optimizer(list(model.named_parameters()), o, device.type)
    balance = LoadBalance(t.lb_type) if t.lb_coef > 0 else None

    start = 0
    if found:
        meta = ckpt.load_training_state(found[-1], model, optimizer)
        start = meta["step"]
        if echo:
            print(f"resumed from {found[-1]} (step {start})", flush=True)
    metrics_path = out_dir / "metrics.jsonl"
    if metrics_path.exists():  # drop steps after the checkpoint we resume from
        kept = [m for m in read_metrics(metrics_path) if m["step"] <= start]
        metrics_path.write_text("".join(json.dumps(m) + "\n" for m in kept))
    (out_dir / "config.json").write_text(json.dumps(config.model.to_hf(), indent=2))
    log = MetricsLog(out_dir, t.tensorboard)
    if echo and start == 0:
        n_params = sum(p.numel() for p in model.parameters())
        print(
            f"model {config.model.model_type}: {n_params / 1e6:.2f}M parameters | device {device} | compute {dtype} | "
            f"{loader.num_samples} samples of {config.data.seq_len} tokens | {t.steps} steps of "
            f"{t.global_batch_size} samples",
            flush=True,
        )

    def save(step):
        state = ckpt.training_state(model, optimizer)
        meta = {"samples_consumed": step * t.global_batch_size, "config": _plain(config)}
        ckpt.save_checkpoint(out_dir, step, state, meta, config.model.to_hf(), t.keep_checkpoints)

    history = []
    model.train()
    end = t.steps if stop_after is None else min(t.steps, stop_after)
    for step in range(start, end):
        t0 = time.perf_counter()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        lr = lr_at(step, o, t.steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        batch = loader.global_batch(step)
        n_label = int((batch["labels"] != -100).sum())
        micros = split_micro(batch, t.micro_batch_size)
        loss_sum = torch.zeros((), dtype=torch.float64)
        lb_sum = torch.zeros((), dtype=torch.float64)
        for micro in micros:
            b, s = micro["input_ids"].shape
            engine = ExpertEngine(LocalDispatch(), balance, b, s)
            ce, lb = forward_loss(model, micro, engine, device, dtype)
            total = ce / max(n_label, 1)
            if lb is not None:
                total = total + t.lb_coef * lb / len(micros)
                lb_sum += lb.detach().double().cpu()
            total.backward()
            loss_sum += ce.detach().double().cpu()
        loss = loss_sum.item() / max(n_label, 1)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip if o.grad_clip > 0 else math.inf)
        grad_norm = float(grad_norm)
        if not math.isfinite(loss) or not math.isfinite(grad_norm):
            raise FloatingPointError(
                f"non-finite loss ({loss}) or grad norm ({grad_norm}) at step {step + 1}; the last good checkpoint "
                f"is kept. Lower optim.lr, raise optim.warmup_steps or check the data, then resume."
            )
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dt = time.perf_counter() - t0
        m = {
            "step": step + 1,
            "loss": loss,
            "lb_loss": lb_sum.item() / len(micros),
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens_per_s": batch["input_ids"].numel() / dt,
            "step_time_s": dt,
            "peak_mem_bytes": peak_memory_bytes(device),
            "tokens": n_label,
        }
        history.append(m)
        log.log(m, t.steps, echo=echo and ((step + 1) % t.log_every == 0 or step + 1 == t.steps))
        if t.checkpoint_every and (step + 1) % t.checkpoint_every == 0 and step + 1 < end:
            save(step + 1)
    if start < end or not found:
        save(end)
    log.close()
    return history


def _plain(config: RunConfig) -> dict:
    out = asdict(config)
    out["model"] = asdict(config.model)
    return out


def _init_from(model, path: str) -> None:
    """Copy weights from an HF directory or a PithTrain checkpoint (continued pretraining)."""
    from pithtrain.tools.hf import load_model

    source = load_model(path)
    if source.cfg != model.cfg:
        raise ValueError(f"train.init_from={path}: its model config differs from the run's model config; "
                         f"build the run's model from that checkpoint's config.json")
    model.load_state_dict(source.state_dict())
