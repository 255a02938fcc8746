"""AdamW with decay/no-decay parameter groups, Muon for weight matrices (optim.name=muon), and the
learning-rate schedules (warmup + cosine, WSD, constant)."""

from __future__ import annotations

import math
from fnmatch import fnmatchcase

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from pithtrain.config import OptimConfig
from pithtrain.ops import fp8, kernels
from pithtrain.parallel.fsdp import clip_coefficient, clip_grads


def build_optimizer(params: list[tuple[str, torch.nn.Parameter]], cfg: OptimConfig, device_type: str):
    """Weight decay skips norms, biases and embeddings (1-D tensors and the embedding table).
    FSDP-sharded (DTensor) and plain local parameters (experts that FSDP leaves alone) go to
    separate groups: one fused kernel call cannot mix the two. With optim.name=muon the matrices
    (`takes_muon`) form one more group, `muon=True`, with the same learning rate and weight decay."""
    muon, groups = cfg.name == "muon", {}
    for name, p in params:
        decay = not (p.ndim < 2 or "embed" in name or "norm" in name)
        key = "muon" if muon and takes_muon(name, p, cfg.muon_exclude) else (decay, isinstance(p, DTensor))
        groups.setdefault(key, []).append((name, p))
    groups = [{"params": [p for _, p in ps], "weight_decay": cfg.weight_decay if key == "muon" or key[0] else 0.0}
              | ({"muon": key == "muon", "momentum": cfg.momentum, "experts": [".experts." in n for n, _ in ps],
                  "halves": [2 if n.endswith(".experts.gate_up") else 1 for n, _ in ps]}
                 if muon else {})
              for key, ps in groups.items()]
    fused = device_type == "cuda"  # the fused kernel is the fastest on GPUs; foreach on the CPU
    return (Muon if muon else torch.optim.AdamW)(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                                                 fused=fused or None, foreach=None if fused else True)


def takes_muon(name: str, p: torch.Tensor, exclude) -> bool:
    """Muon takes a 2-D weight matrix, or a stack of them under `experts` ([E, in, out]: E matrices),
    unless its name matches an optim.muon_exclude pattern (embeddings, head, norms, biases, router)."""
    return p.ndim - (".experts." in name) == 2 and not any(fnmatchcase(name, pattern) for pattern in exclude)


# Keller Jordan's quintic Newton-Schulz coefficients ("Muon: An optimizer for hidden layers in neural
# networks", 2024, kellerjordan.github.io/posts/muon): chosen to push every singular value of the
# Frobenius-normalised matrix quickly into a band around 1 rather than to converge to exactly 1.
NS_COEFFS = (3.4445, -4.7750, 2.0315)


# Newton-Schulz runs on batches of same-shape matrices (gathered across parameters and layers: one
# batched GEMM per iteration, not one per parameter). A batch holds at most this many bytes of matrices
# in the NS dtype (at least one parameter's); its iteration keeps about 2.5x that alive (the batch, the
# next X, the Gram matrices), so the optimizer's transient memory does not grow with the model.
NS_BATCH_BYTES = 2 << 30


def newton_schulz(g: torch.Tensor, steps: int = 5, dtype: torch.dtype | None = None) -> torch.Tensor:
    """An approximate U V^T of g = U S V^T (each matrix of a batch [..., m, n]): singular values end in
    about [0.7, 1.2], not at 1 (tests/test_muon.py). X <- a X + (b A + c A^2) X with A = X X^T for a wide
    X (m <= n), X <- a X + X (b A + c A^2) with A = X^T X for a tall one: A is the smaller Gram matrix and
    the result keeps g's layout (no transposed copies). bf16 on GPUs, fp32 on the CPU unless `dtype`."""
    a, b, c = NS_COEFFS
    x = g.to(dtype or (torch.bfloat16 if g.is_cuda else torch.float32))
    tall = x.size(-2) > x.size(-1)
    x = x / (torch.linalg.matrix_norm(x, keepdim=True) + 1e-7)  # Frobenius norm >= the spectral norm: sigma <= 1
    for _ in range(steps):
        gram = x.mT @ x if tall else x @ x.mT
        # P = a I + b A + c A^2 = A (c A + b I) + a I, made on the small Gram matrices, then one plain product
        # with X: cuBLAS's beta-epilogue (baddbmm) ran 1.5x slower than a plain bmm on the H200
        # (docs/performance.md), and the identity terms are adds to a diagonal
        poly = gram * c
        poly.diagonal(dim1=-2, dim2=-1).add_(b)
        poly = gram @ poly
        poly.diagonal(dim1=-2, dim2=-1).add_(a)
        x = x @ poly if tall else poly @ x
    return x.to(g.dtype)


class Muon(torch.optim.AdamW):
    """AdamW for the groups with `muon=False`; Muon for the `muon=True` group (state: step, momentum_buffer).
    Per matrix (an expert's gate and up are two), as Moonlight (Liu et al. 2025, "Muon is Scalable for LLM Training", arXiv:2502.16982):
      B <- mu B + G;  U <- G + mu B (Nesterov);  W <- W (1 - lr wd) - lr 0.2 sqrt(max(m, n)) NS(U).
    The factor 0.2 sqrt(max(m, n)) brings the update's RMS (that of an m x n semi-orthogonal matrix is
    1/sqrt(max(m, n))) to 0.2, about AdamW's, so one learning rate and weight decay serve both.
    The matrices of one shape go through Newton-Schulz together (batches of NS_BATCH_BYTES): the momentum
    pass writes U straight into its batch (ops/kernels.muon_momentum: one pass, gate and up apart), and
    one more pass applies decay and update (muon_apply). FSDP shards dim 0: a dense matrix's U is gathered
    whole, orthogonalised by every rank of its group and sliced back (exact, redundant); an expert
    stack's shard is whole expert matrices, orthogonalised where it is."""

    def step(self, closure=None):
        groups = self.param_groups
        self.param_groups = [g for g in groups if not g["muon"]]  # AdamW.step sees only its own groups
        try:
            super().step(closure)
        finally:
            self.param_groups = groups
        with torch.no_grad():
            for group in (g for g in groups if g["muon"]):
                self._muon_step(group)

    def _muon_step(self, group):
        lr, mu, wd = group["lr"], group["momentum"], group["weight_decay"]
        by_shape = {}  # (rows, cols) of one matrix -> [(param, halves, whole (a gathered dense DTensor), count)]
        for p, expert, halves in zip(group["params"], group["experts"], group["halves"]):
            if p.grad is None:
                continue
            state = self.state[p]
            if not state:  # a step count beside the momentum, as AdamW keeps (its code reads every state's)
                state.update(step=torch.tensor(0.0), momentum_buffer=torch.zeros_like(p))
            state["step"] += 1
            whole = isinstance(p, DTensor) and not expert
            shape = (p.shape[-2], p.shape[-1] // halves)
            count = 1 if whole else local(p).numel() // (shape[0] * shape[1])
            by_shape.setdefault(shape, []).append((p, halves, whole, count))
        dtype = torch.bfloat16 if any(p.is_cuda for p in group["params"]) else torch.float32  # newton_schulz's
        for (rows, cols), items in by_shape.items():
            limit, chunk = NS_BATCH_BYTES // (rows * cols * dtype.itemsize), []
            for i, item in enumerate(items):
                chunk.append(item)
                if i + 1 == len(items) or sum(n for *_, n in chunk) + items[i + 1][3] > limit:
                    self._orthogonalize(chunk, (rows, cols), dtype, lr, mu, wd)
                    chunk = []

    def _orthogonalize(self, chunk, shape, dtype, lr, mu, wd):
        """Momentum into one batch, Newton-Schulz on it, then each parameter's decay and update."""
        counts = [n for *_, n in chunk]
        batch = torch.empty(sum(counts), *shape, dtype=dtype, device=chunk[0][0].device)
        for (p, halves, whole, count), slot in zip(chunk, batch.split(counts)):
            buf = self.state[p]["momentum_buffer"]
            if whole:  # on the DTensor shards, then gathered: every rank of the group holds all of U
                buf.mul_(mu).add_(p.grad)
                slot.copy_(p.grad.add(buf, alpha=mu).full_tensor().view_as(slot))
            elif count:
                kernels.muon_momentum(local(p.grad), local(buf), mu, slot, halves)
        update = newton_schulz(batch) if batch.numel() else batch
        step_size = lr * 0.2 * math.sqrt(max(shape))
        for (p, halves, whole, count), slot in zip(chunk, update.split(counts)):
            if whole:
                slot = distribute_tensor(slot[0], p.device_mesh, p.placements, src_data_rank=None).to_local()
            if slot.numel():
                kernels.muon_apply(local(p), slot, 1 - lr * wd, step_size, halves)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a (possibly DTensor) tensor."""
    return t.to_local() if isinstance(t, DTensor) else t


# AdamW as one Triton pass a parameter on CUDA (ops/kernels.adamw): the clip coefficient applied as each gradient is
# read (no pass of its own over the gradients) and an expert's compute copy (grouped_gemm.compute_weight) written with
# the new weight (not cast from it at the next step's first micro-batch): about 70 GB a Qwen3 9-layer step less
# traffic when clipping, 22 GB when not. On since its A/B (2026-12-05, Qwen3 9 layers: +0.6% bf16, +0.7% FP8;
# docs/performance.md); `benchmarks/train_throughput.py --triton-adamw off` is torch's fused AdamW.
TRITON_ADAMW = True


def optimizer_step(optimizer: torch.optim.Optimizer, params, max_norm: float = 0.0, grad_norm: float = 0.0) -> None:
    """Clip the gradients to max_norm (grad_norm: their global norm; max_norm 0: no clipping), optimizer.step(),
    then mark every parameter as modified: the fused AdamW kernel updates the weights in place without bumping
    their version counters, and the per-update cache of expert weights cast to bf16
    (ops/grouped_gemm.compute_weight) is keyed by those counters."""
    if (TRITON_ADAMW and type(optimizer) is torch.optim.AdamW and params and kernels.use_triton(params[0])
            and not any(g["amsgrad"] or g["maximize"] for g in optimizer.param_groups)):
        copies, amaxes = _triton_adamw_step(optimizer, clip_coefficient(max_norm, grad_norm))
    else:
        clip_grads(params, max_norm, grad_norm)
        optimizer.step()
        copies, amaxes = [], []
    torch.autograd.graph.increment_version(params)
    fp8.UPDATES[0] += 1
    for p, cache, key in copies:  # written in the step: current for the new version
        cache[key] = (p._version, cache[key][1])
    for p, made in amaxes:
        made[0] = p._version


@torch.no_grad()
def _triton_adamw_step(optimizer: torch.optim.AdamW, scale: float) -> list:
    """torch's AdamW step (its state, as its fused path makes it: checkpoints stay interchangeable) on the gradients
    times `scale`, one kernels.adamw pass a parameter; returns the compute copies it wrote (param, cache, key) and the
    FP8 weights' maxima it took (param, ops/fp8's [version, buffer])."""
    host_steps = optimizer.__dict__.setdefault("_host_steps", {})  # param -> (its step tensor, that step on the host)
    steps, copies, amaxes = [], [], []
    for group in optimizer.param_groups:
        beta1, beta2 = group["betas"]
        for p in group["params"]:
            if p.grad is None:
                continue
            state = optimizer.state[p]
            if not state:
                state.update(step=torch.zeros((), dtype=torch.float32, device=p.device),
                             exp_avg=torch.zeros_like(p, memory_format=torch.preserve_format),
                             exp_avg_sq=torch.zeros_like(p, memory_format=torch.preserve_format))
                host_steps[p] = (state["step"], 0)
            if host_steps.get(p, (None,))[0] is not state["step"]:  # loaded from a checkpoint: one read
                host_steps[p] = (state["step"], int(state["step"]))
            step = host_steps[p][1] + 1
            host_steps[p] = (state["step"], step)
            cache = p.__dict__.get("_cast_cache", {})
            key = next((k for k, (version, _) in cache.items() if k[1] and version == p._version), None)
            amax = p.__dict__.get("_fp8_amax")  # left by ops/fp8 on a plain parameter: the next quantization's maxima
            kernels.adamw(local(p), local(p.grad), local(state["exp_avg"]), local(state["exp_avg_sq"]),
                          None if key is None else cache[key][1], group["lr"], beta1, beta2, group["eps"],
                          group["weight_decay"], step, scale, None if amax is None else amax[1])
            steps.append(state["step"])
            if key is not None:
                copies.append((p, cache, key))
            if amax is not None:
                amaxes.append((p, amax))
    if steps:
        torch._foreach_add_(steps, 1.0)
    return copies, amaxes


def lr_at(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """Learning rate for optimizer step `step` (0-based)."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    min_lr = cfg.lr * cfg.min_lr_ratio
    if cfg.schedule == "constant":
        return cfg.lr
    if cfg.schedule == "cosine":
        peak = max(cfg.warmup_steps - 1, 0)  # warmup's last step reaches lr; the decay starts right after it
        progress = min(1.0, (step - peak) / max(1, total_steps - 1 - peak))
        return min_lr + (cfg.lr - min_lr) * 0.5 * (1 + math.cos(math.pi * progress))
    # wsd: warmup, stable at lr, then a linear decay to min_lr over the last decay_fraction of the steps
    decay_steps = max(1, round(cfg.decay_fraction * total_steps))
    if step < (decay_start := total_steps - decay_steps):
        return cfg.lr
    return cfg.lr + (min_lr - cfg.lr) * min(1.0, (step - decay_start + 1) / decay_steps)
