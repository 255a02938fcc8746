"""Same-run peer benchmark against torchtitan (issue 32, point 1): torchtitan's own Qwen3-MoE and DeepSeek-V3
models and one-GPU recipe, then PithTrain at exactly the same shape, in one call; one results.jsonl line with both.

    bash benchmarks/peers/get_torchtitan.sh   # once, on the CPU machine: .peers/ (torchtitan + pure-Python deps)
    PYTHONPATH=.:.peers/torchtitan:.peers/site python benchmarks/peers/torchtitan.py --family qwen3 \\
        --layers 4 --seq 4096 --batch 2 --accum 4 --steps 6
    (--family deepseek_v3: torchtitan's DeepSeek-V3 at our Moonlight-16B-A3B width, against ours `--family moonlight`;
     --tiny: a 2-layer CPU check of the torchtitan side alone, nothing recorded; --ac full|selective; --no-compile;
     --trace DIR: one more step on each side, profiled, Chrome traces in DIR for capture-profile's profile_step.py)

torchtitan is pinned at TORCHTITAN_COMMIT (below; .peers/torchtitan/COMMIT says which one get_torchtitan.sh extracted):
the newest commit of its main whose Qwen3, DeepSeek-V3, parallelize, compile, FSDP, loss and optimizer modules import
and run on torch 2.11 (the GPU image). The next commit (d92336fee) imports torch.distributed.fsdp.DataParallelMeshDims,
which torch 2.11 lacks, in distributed/fsdp.py; at this commit only torchtitan.trainer reaches it (through
distributed/full_dtensor.py), so the Trainer is not used (below).

What is torchtitan's (called, not copied):
  - the model: `torchtitan.models.qwen3` flavor "30B-A3B" (its own config: hidden 2048, 32 q / 4 kv heads of 128,
    qk-norm, 128 experts top-8 of width 768, softmax routing with renormalised top-k, vocab 151936, RoPE theta 1e6),
    cut to --layers; DeepSeek-V3 built by its `_build_dsv3_layers` / `DeepSeekV3Model.Config` with Moonlight-16B-A3B's
    numbers (hidden 2048, 16 heads, MLA kv_lora 512 without q-LoRA, nope/rope/v 128/64/128, 64 experts top-6 + 2
    shared of width 1408, first layer dense of width 11264, sigmoid routing, route_norm, route_scale 2.446, RoPE theta
    5e4 without scaling, vocab 163840; its RMSNorm eps, not Moonlight's 1e-5); its modules: attention through SDPA
    (its default `attn_backend`; cuDNN, flash, math in that order), the MoE with its local token dispatcher and
    `torch._grouped_mm` experts in bf16 (its only expert path at this commit), its auxiliary-loss-free expert bias
    (the DeepSeek-V3 registry's optimizer pre-hook; Qwen3's registry registers none at this commit);
  - its one-GPU recipe, through its model registry's `parallelize_fn` (parallelize_qwen3 / parallelize_deepseekv3):
    activation checkpointing (`--ac`, default none, as ours runs), per-TransformerBlock torch.compile (apply_compile,
    fullgraph), FSDP2 fully_shard on a 1-rank mesh with its default mixed precision (bf16 params, fp32 reduce; its
    ParallelDims keeps the fsdp mesh at degree 1 for exactly that); fp32 master weights (TrainingConfig.dtype);
    meta-device build, to_empty and its init_weights;
  - its loss: CrossEntropyLoss (full logits, fp32; compiled when compile is on). Its recipes (qwen3_30b_a3b,
    deepseek_v3_16b) use ChunkedCELoss (`--loss chunked`), which fails in backward on torch 2.11 ("The tensor has a
    non-zero number of elements, but its data is not allocated yet"): it calls `lm_head.reshard()` on the FSDP group
    [norm, lm_head] before the decoder's backward, and torch 2.11's FSDP2 does not unshard the final norm's weight
    again for that backward (reproduced with plain fully_shard on torch 2.11; torch 2.13 runs it);
  - its optimizer: `default_adamw` (lr 8e-4 / 2.2e-4 as those recipes, betas 0.9/0.95, wd 0.1, its default fused
    implementation) built by its OptimizersContainer, and its LRSchedulersContainer with those recipes' settings;
  - its distributed init (dist_utils.init_distributed: NCCL, flight recorder, autograd multithreading off),
    ParallelDims, utils.GarbageCollection (gc every 50 steps) and dist_utils.clip_grad_norm_ (max_norm 1.0).
What is ours: random tokens, the timing loop, `titan_update_from_config` (what the model config's update_from_config
does at one rank, by its own functions: that method imports the Trainer) and `titan_train_step`, a copy of
Trainer.train_step's non-pipeline path at this commit (micro-batches, loss over the global count of valid tokens,
clip, optimizer and lr steps; no logging). On a CPU (--tiny) torchtitan's device detection is pointed at "cpu" (it
falls back to "cuda"), so the process group is gloo. --tiny passes on torch 2.13 (CPU); on torch 2.11's CPU build
torch._grouped_mm's backward itself fails ("Invalid strides/sizes"; its CUDA kernel is another), so there the check
needs that op's backward replaced (done only outside the repository, to check everything else on torch 2.11).

FP8 against FP8 is not possible on one GPU at this commit. torchao 0.17.0 (the release for torch 2.11) imports and
runs torchtitan's converters there (Float8LinearConverter, with lm_head and router.gate left in bf16 as ours leaves
them, and Float8GroupedExpertsConverter), but the FP8 grouped experts swap in its TorchAOTokenDispatcher, which
raises "TorchAOTokenDispatcher requires expert parallelism (ep_mesh must be set)": its padded token groups need EP > 1
(tried at 475acf1, which had a --fp8 flag for it; results.jsonl records the error). Two GPUs with EP 2 would run it.

At 4 layers both models have exactly ours' parameter count (Qwen3 3,114,814,464; Moonlight 2,508,607,488; counted
on the meta device); torchtitan keeps gate and up projections apart where ours fuses them.

Each side runs in its own subprocess (an OOM or compile failure on one side is recorded, the other still runs;
--timeout bounds the two together, torchtitan's first, ours with at least --ours-reserve seconds);
ours is `benchmarks/train_throughput.py ... --compile --skip-transformers --profile-step 0` (its own line goes to a
temporary file; this script writes the one line). Both report the median step time over steps 3..N (the first two
are warm-up, compile included), tokens/s = batch x accum x seq / that, peak GiB = the largest per-step
torch.cuda.max_memory_allocated; torchtitan's MFU uses ours' model FLOPs per token and matmul peak from the same run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# this file is named torchtitan.py: drop its folder (sys.path[0] when run as a script), so that
# `import torchtitan` finds the package
if sys.path and Path(sys.path[0] or ".").resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)

TORCHTITAN_COMMIT = "43e52fd017ce8689cb0b34c62a35daac9910c6c1"  # 2026-06-08, get_torchtitan.sh extracts this one
ROOT = Path(__file__).resolve().parents[2]
OURS_FAMILY = {"qwen3": "qwen3", "deepseek_v3": "moonlight"}
# torchtitan's recipes for these models (models/qwen3/config_registry.py qwen3_30b_a3b,
# models/deepseek_v3/config_registry.py deepseek_v3_16b): optimizer lr, lr schedule, the schedule's steps
RECIPE = {"qwen3": dict(lr=8e-4, scheduler=dict(warmup_steps=600), steps=3000),
          "deepseek_v3": dict(lr=2.2e-4, scheduler=dict(decay_ratio=0.8, decay_type="cosine", min_lr_factor=0.1),
                              steps=1000)}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--family", default="qwen3", choices=["qwen3", "deepseek_v3", "moonlight"],
                   help="moonlight: the same as deepseek_v3 (ours' name for that width)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--batch", type=int, default=1, help="micro-batch (torchtitan's training.local_batch_size)")
    p.add_argument("--accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--steps", type=int, default=6, help="optimizer steps, the first two untimed (at least 3)")
    p.add_argument("--no-compile", dest="compile", action="store_false",
                   help="torchtitan without apply_compile (and loss compile), ours without --compile")
    p.add_argument("--ac", default="none", choices=["none", "selective", "full"],
                   help="torchtitan's activation checkpointing (its recipes use full / selective; ours runs "
                        "train.recompute off | selective | full to match)")
    p.add_argument("--loss", default="plain", choices=["plain", "chunked"],
                   help="torchtitan's loss: CrossEntropyLoss (cross-entropy over the full logits, in fp32) or "
                        "ChunkedCELoss (its recipes' choice; fails on torch 2.11: see the docstring)")
    p.add_argument("--attn-backend", default="sdpa", choices=["sdpa", "flex"],
                   help="torchtitan's attention (sdpa: causal; flex: its block-causal mask over one document a row)")
    p.add_argument("--tiny", action="store_true", help="CPU check of the torchtitan side: 2 layers, seq 64 (Qwen3: "
                   "its debugmodel_moe flavor, hidden 256, 64 experts top-8, vocab 2048; DeepSeek-V3: Moonlight's "
                   "structure at hidden 256, 4 heads, 8 experts top-2, vocab 2048); compile off unless "
                   "--compile-tiny; ours not run, nothing recorded")
    p.add_argument("--compile-tiny", action="store_true", help="with --tiny: compile as on the GPU")
    p.add_argument("--trace", help="a folder: each side profiles one more step after the timed ones (left out of the "
                   "medians) and writes its Chrome trace there, torchtitan.json and pithtrain.json, for "
                   ".agents/skills/capture-profile/profile_step.py --trace (kernel time by category, both sides)")
    p.add_argument("--skip-ours", action="store_true")
    p.add_argument("--skip-torchtitan", action="store_true")
    p.add_argument("--timeout", type=int, default=570, help="seconds for both sides together (default: within a "
                   "10-minute device call); torchtitan's side gets all but --ours-reserve of it, ours the rest")
    p.add_argument("--ours-reserve", type=int, default=240, help="seconds kept for ours' side")
    p.add_argument("--side", choices=["torchtitan"], help=argparse.SUPPRESS)  # internal: the torchtitan subprocess
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.family == "moonlight":
        args.family = "deepseek_v3"
    if args.tiny:
        args.layers, args.seq, args.compile = 2, 64, args.compile_tiny
        args.skip_ours = True
    if args.steps < 3:
        p.error("--steps must be at least 3 (two warm-up steps, then the timed ones)")
    return args


# ---------------------------------------------------------------------------------------------- torchtitan side


def titan_model_config(family: str, layers: int, tiny: bool, attn_backend: str):
    """torchtitan's model config at our width, cut to `layers` layers."""
    if family == "qwen3":
        from torchtitan.models.qwen3 import qwen3_configs

        cfg = qwen3_configs["debugmodel_moe" if tiny else "30B-A3B"](attn_backend=attn_backend)
        cfg.layers = cfg.layers[:layers]
        return cfg
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.deepseek_v3 import DeepSeekV3Model, _build_dsv3_layers
    import torchtitan.models.deepseek_v3 as dsv3

    # Moonlight-16B-A3B (examples/moonlight_16b_a3b.py), in the form of torchtitan's own `_16b` flavor
    dim, vocab, experts, moe_inter, dense_inter = (256, 2048, 8, 128, 512) if tiny else (2048, 163840, 64, 1408, 11264)
    rope_dim = 64
    return DeepSeekV3Model.Config(
        vocab_size=vocab,
        dim=dim,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=dsv3._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=dsv3._NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=dsv3._output_linear_init(dim)),
        layers=_build_dsv3_layers(
            n_layers=layers, n_dense_layers=1, dim=dim, n_heads=4 if tiny else 16,
            q_lora_rank=0, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=rope_dim, v_head_dim=128,
            mscale=1.0, dense_hidden_dim=dense_inter, moe_hidden_dim=moe_inter, num_experts=experts,
            num_shared_experts=2, router_top_k=2 if tiny else 6, router_score_func="sigmoid",
            router_route_norm=True, router_route_scale=2.446, score_before_experts=False,
            attn_backend=attn_backend, moe_comm_backend="standard", non_blocking_capacity_factor=None,
            rope=ComplexRoPE.Config(dim=rope_dim, max_seq_len=8192, theta=50000.0, scaling="none"),
        ),
    )


def sdpa_probe(family: str, seq: int) -> dict:
    """Which of torchtitan's SDPA backends (cuDNN, then flash, then math) take this family's attention shape on this
    GPU: DeepSeek-V3's MLA has q/k head 192 and v head 128; a silent fall to MATH would explain a slow run."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    heads, kv, dqk, dv = (32, 4, 128, 128) if family == "qwen3" else (16, 16, 192, 128)
    s = min(seq, 1024)
    q = torch.randn(1, heads, s, dqk, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, kv, s, dqk, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(1, kv, s, dv, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    ok = {}
    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION):
        try:
            with sdpa_kernel([backend]):
                F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=kv != heads).sum().backward()
            ok[backend.name] = True
        except RuntimeError as e:
            ok[backend.name] = str(e).splitlines()[0][:160]
    return ok


def titan_update_from_config(family: str, model_cfg, parallelism, seq: int) -> None:
    """What the model config's update_from_config does at one rank (no TP, CP, PP or EP), done by its own pieces:
    that method imports torchtitan.trainer, which torch 2.11 cannot import at this commit (DataParallelMeshDims).
    Its checks are all about TP/CP/PP/EP; left: the family's sharding config (used only by Module.parallelize under
    TP or EP, set as it sets it) and, as for a Trainer.Config, each layer's RoPE cache cut to training.seq_len."""
    import dataclasses

    loss_parallel, enable_sp = not parallelism.disable_loss_parallel, parallelism.enable_sequence_parallel
    if family == "qwen3":
        from torchtitan.models.qwen3.sharding import set_qwen3_sharding_config as set_sharding
    else:
        from torchtitan.models.deepseek_v3.sharding import set_deepseek_v3_sharding_config as set_sharding
    set_sharding(model_cfg, loss_parallel=loss_parallel, enable_sp=enable_sp, enable_ep=False)
    if seq > model_cfg.max_seq_len:
        raise ValueError(f"Training sequence length {seq} exceeds attention RoPE maximum supported sequence "
                         f"length {model_cfg.max_seq_len}.")
    for layer_cfg in model_cfg.layers:
        if getattr(getattr(layer_cfg, "attention", None), "rope", None) is not None:
            layer_cfg.attention.rope = dataclasses.replace(layer_cfg.attention.rope, max_seq_len=seq)


def titan_train_step(model, loss_fn, optimizers, lr_schedulers, microbatches, device, max_norm, need_masks):
    """torchtitan Trainer.train_step + forward_backward_step + post_dataloading_process at TORCHTITAN_COMMIT, for one
    rank without pipeline or context parallelism (no dp: global_valid_tokens is the local count), logging left out."""
    import torch
    from torchtitan.components.loss import IGNORE_INDEX
    from torchtitan.distributed import utils as dist_utils

    optimizers.zero_grad()
    local_valid_tokens = torch.tensor(0, dtype=torch.int64)
    for _, labels in microbatches:
        local_valid_tokens += (labels != IGNORE_INDEX).sum()
    global_valid_tokens = local_valid_tokens.to(device).float()
    losses = []
    for inputs, labels in microbatches:
        inputs, labels = inputs.to(device), labels.to(device)
        positions = torch.arange(inputs.shape[1], dtype=torch.int32, device=inputs.device).repeat(inputs.shape[0], 1)
        extra = {"positions": positions}
        if need_masks:
            extra["attention_masks"] = model.get_attention_masks(positions=positions)
        pred = model(inputs, **extra)
        loss = loss_fn(pred, labels, global_valid_tokens)
        del pred
        loss.backward()
        losses.append(loss.detach())
    grad_norm = dist_utils.clip_grad_norm_([p for p in model.parameters()], max_norm, foreach=True,
                                           pp_mesh=None, ep_enabled=False)
    optimizers.step()
    lr_schedulers.step()
    return torch.sum(torch.stack(losses)), grad_norm


def titan_side(args) -> dict:
    for path in (ROOT / ".peers" / "site", ROOT / ".peers" / "torchtitan"):  # get_torchtitan.sh's layout
        if path.is_dir() and str(path) not in sys.path:
            sys.path.insert(0, str(path))
    import torch

    cuda = torch.cuda.is_available()
    import torchtitan.tools.utils as tt_utils

    if not cuda:  # CPU check: torchtitan's device detection falls back to "cuda"; point it (and its imports) at cpu
        tt_utils.device_type, tt_utils.device_module = "cpu", torch.cpu
    from torchtitan.components.loss import ChunkedCELoss, CrossEntropyLoss
    from torchtitan.components.lr_scheduler import LRSchedulersContainer
    from torchtitan.components.optimizer import default_adamw
    from torchtitan.config import (TORCH_DTYPE_MAP, ActivationCheckpointConfig, CommConfig, CompileConfig,
                                   ParallelismConfig, TrainingConfig)
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.models.common.attention import FlexAttention

    if args.family == "qwen3":
        from torchtitan.models.qwen3 import model_registry

        spec = model_registry("30B-A3B", attn_backend=args.attn_backend)
    else:
        from torchtitan.models.deepseek_v3 import model_registry

        spec = model_registry("16B", attn_backend=args.attn_backend)
    model_cfg = titan_model_config(args.family, args.layers, args.tiny, args.attn_backend)
    recipe = RECIPE[args.family]
    training = TrainingConfig(local_batch_size=args.batch, global_batch_size=args.batch * args.accum,
                              seq_len=args.seq, steps=recipe["steps"])
    parallelism = ParallelismConfig()
    compile_config = CompileConfig(enable=args.compile, components=["model", "loss"])
    ac_config = ActivationCheckpointConfig(mode=args.ac)
    device_type = "cuda" if cuda else "cpu"
    device = torch.device(device_type, 0) if cuda else torch.device("cpu")
    out = {"torchtitan_commit": TORCHTITAN_COMMIT, "torch": torch.__version__, "device": device_type,
           "flavor": spec.flavor if not args.tiny else "tiny", "attn_backend": args.attn_backend, "ac": args.ac,
           "compile": args.compile, "optimizer": {"name": "AdamW", "lr": recipe["lr"], "implementation": "fused"},
           "loss": "ChunkedCELoss" if args.loss == "chunked" else "CrossEntropyLoss",
           "mixed_precision": "fully_shard bf16 params / fp32 reduce (1-rank mesh)"}
    if cuda:
        torch.cuda.set_device(0)
        try:
            out["sdpa_backends_ok"] = sdpa_probe(args.family, args.seq)
        except Exception as e:  # a probe, never a reason to stop
            out["sdpa_backends_ok"] = f"probe failed: {e}"[:200]

    with tempfile.TemporaryDirectory() as dump:
        for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                     "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(29500 + os.getpid() % 1000)}.items():
            os.environ.setdefault(k, v)
        world_size = dist_utils.init_distributed(CommConfig(), base_folder=dump)
        parallel_dims = ParallelDims.from_config(parallelism, world_size)
        titan_update_from_config(args.family, model_cfg, parallelism, args.seq)
        with torch.device("meta"), tt_utils.set_default_dtype(TORCH_DTYPE_MAP[training.dtype]):
            model = model_cfg.build()
        model.verify_module_protocol()
        out["params"] = sum(p.numel() for p in model.parameters())
        loss_config = ChunkedCELoss.Config() if args.loss == "chunked" else CrossEntropyLoss.Config()
        loss_fn = loss_config.build(compile_config=compile_config)
        model = spec.parallelize_fn(model, parallel_dims=parallel_dims, training=training, parallelism=parallelism,
                                    compile_config=compile_config, ac_config=ac_config, dump_folder=dump)
        model.to_empty(device=device_type)
        with torch.no_grad():
            model.init_weights(buffer_device=None)
        model.train()
        if isinstance(loss_fn, ChunkedCELoss):  # as Trainer.__init__ does: lm_head applied per chunk in the loss
            loss_fn.set_lm_head(model.lm_head)
            model._skip_lm_head = True
        optimizers = default_adamw(lr=recipe["lr"]).build(model_parts=[model])
        if spec.post_optimizer_build_fn is not None:
            spec.post_optimizer_build_fn(optimizers, [model], parallel_dims)
        lr_schedulers = LRSchedulersContainer.Config(**recipe["scheduler"]).build(
            optimizers=optimizers, training_steps=training.steps)
        gc_handler = tt_utils.GarbageCollection(gc_freq=training.gc_freq)
        need_masks = isinstance(model_cfg.layers[0].attention.inner_attention, FlexAttention.Config)

        gen = torch.Generator().manual_seed(0)
        vocab = model_cfg.vocab_size
        times, peaks, losses = [], [], []
        for step in range(1, args.steps + 1 + bool(args.trace)):  # with --trace one more step, profiled
            profiled = step > args.steps
            microbatches = []
            for _ in range(args.accum):
                tokens = torch.randint(0, vocab, (args.batch, args.seq + 1), generator=gen)
                microbatches.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
            gc_handler.run(step)
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            profiler = torch.profiler.profile() if profiled else contextlib.nullcontext()
            t0 = time.perf_counter()
            with profiler:
                loss, grad_norm = titan_train_step(model, loss_fn, optimizers, lr_schedulers, microbatches, device,
                                                   training.max_norm, need_masks)
                if cuda:
                    torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            if profiled:
                profiler.export_chrome_trace(str(Path(args.trace) / "torchtitan.json"))
                print(f"torchtitan step {step} profiled: {Path(args.trace) / 'torchtitan.json'}", flush=True)
                continue
            times.append(dt)
            peaks.append(torch.cuda.max_memory_allocated() if cuda else 0)
            losses.append(float(loss))
            print(f"torchtitan step {step}: {dt:.3f} s, {args.batch * args.accum * args.seq / dt:.0f} tok/s, "
                  f"loss {losses[-1]:.4f}, grad norm {float(grad_norm):.3f}, peak {peaks[-1] / 2**30:.2f} GiB",
                  flush=True)
        torch.distributed.destroy_process_group()
    step_s = statistics.median(times[2:])
    out.update(step_time_s=step_s, tokens_per_s=args.batch * args.accum * args.seq / step_s,
               peak_mem_gib=max(peaks) / 2**30 if cuda else None, first_loss=losses[0], last_loss=losses[-1],
               step_times_s=[round(t, 4) for t in times])
    return out


# ------------------------------------------------------------------------------------------------------- parent


def run_child(cmd: list[str], env: dict, timeout: int, tag: str) -> tuple[int, list[str]]:
    """Run a side, echoing its output with a tag; its exit code and its last lines. Killed after `timeout` s."""
    import threading

    tail: list[str] = []
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    timer = threading.Timer(timeout, proc.kill)  # also while the side prints nothing (compiling)
    timer.start()
    try:
        for line in proc.stdout:
            print(f"[{tag}] {line}", end="", flush=True)
            tail = (tail + [line.rstrip()])[-30:]
        rc = proc.wait()
    finally:
        timed_out = not timer.is_alive()
        timer.cancel()
    if timed_out and rc != 0:
        tail.append(f"timed out after {timeout} s (--timeout)")
    return rc, tail


def error_text(tail: list[str], rc: int) -> str:
    """The line that says what failed (an OOM first), else the last lines."""
    if tail and tail[-1].startswith("timed out"):
        return tail[-1]
    for line in reversed(tail):
        if "OutOfMemoryError" in line or "out of memory" in line.lower():
            return line[:500]
    errors = [line for line in tail if "Error" in line or "error" in line]
    return (errors[-1] if errors else " | ".join(tail[-3:]) or f"exit code {rc}")[:500]


def ours_command(args, json_path: str) -> list[str]:
    # with --trace one more step, profiled (train_throughput leaves it out of its medians)
    steps, profile = (args.steps + 1, ["--profile-step", str(args.steps + 1), "--trace",
                                       str(Path(args.trace) / "pithtrain.json")]) if args.trace else (args.steps, ["--profile-step", "0"])
    cmd = [sys.executable, "benchmarks/train_throughput.py", "--family", OURS_FAMILY[args.family],
           "--layers", str(args.layers), "--seq", str(args.seq), "--batch", str(args.batch), "--accum", str(args.accum),
           "--steps", str(steps), "--skip-transformers", *profile, "--json", json_path,
           "--recompute", {"none": "off", "selective": "selective", "full": "full"}[args.ac]]
    if args.compile:
        cmd.append("--compile")
    return cmd


def main(argv=None):
    args = parse_args(argv)
    if args.side == "torchtitan":
        try:
            result = titan_side(args)
        except Exception as e:  # an OOM or a compile failure: the parent records it and still runs ours
            import traceback

            traceback.print_exc()
            result = {"torchtitan_commit": TORCHTITAN_COMMIT, "error": f"{type(e).__name__}: {e}"[:1000]}
        Path(args.out).write_text(json.dumps(result, indent=2))
        print("torchtitan:", json.dumps(result), flush=True)
        return

    if not args.skip_torchtitan:  # before any run: the pinned source must be importable
        import importlib.util

        if importlib.util.find_spec("torchtitan") is None and not (ROOT / ".peers" / "torchtitan" / "torchtitan").is_dir():
            sys.exit("error: torchtitan is not importable and .peers/torchtitan is missing; run `bash "
                     "benchmarks/peers/get_torchtitan.sh` once (carry .peers to the GPU machine), or pass --skip-torchtitan")
    if args.trace:
        try:
            Path(args.trace).mkdir(parents=True, exist_ok=True)
        except OSError as e:
            sys.exit(f"error: --trace {args.trace}: {e.strerror}; name a folder this process can write")
        args.trace = str(Path(args.trace).resolve())  # the sides run with other working directories' PYTHONPATHs
    shape = {"family": args.family, "ours_family": OURS_FAMILY[args.family], "layers": args.layers, "seq": args.seq,
             "batch": args.batch, "accum": args.accum, "steps": args.steps, "compile": args.compile, "ac": args.ac,
             "attn_backend": args.attn_backend, "loss": args.loss, "tiny": args.tiny}
    line = {"benchmark": "peer_torchtitan", "torchtitan_commit": TORCHTITAN_COMMIT, **shape}
    began = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        if not args.skip_torchtitan:
            titan_json = f"{tmp}/torchtitan.json"
            cmd = [sys.executable, __file__, "--side", "torchtitan", "--out", titan_json, "--family", args.family,
                   "--layers", str(args.layers), "--seq", str(args.seq), "--batch", str(args.batch),
                   "--accum", str(args.accum), "--steps", str(args.steps), "--ac", args.ac,
                   "--attn-backend", args.attn_backend, "--loss", args.loss] + (["--trace", args.trace] if args.trace else [])
            if args.tiny:
                cmd += ["--tiny"] + (["--compile-tiny"] if args.compile else [])
            elif not args.compile:
                cmd.append("--no-compile")
            budget = args.timeout - (0 if args.skip_ours else args.ours_reserve)
            rc, tail = run_child(cmd, dict(os.environ), max(budget, 60), "torchtitan")
            titan = json.loads(Path(titan_json).read_text()) if Path(titan_json).exists() else {
                "error": error_text(tail, rc)}
            line["torchtitan"] = titan
        if not args.skip_ours:
            ours_json = f"{tmp}/ours.json"
            # ours needs only the repository on the path; its own results line goes to a scratch file
            env = dict(os.environ, PYTHONPATH=str(ROOT), PITHTRAIN_RESULTS=f"{tmp}/ours_results.jsonl")
            budget = int(args.timeout - (time.time() - began))
            rc, tail = run_child(ours_command(args, ours_json), env, max(budget, 60), "pithtrain")
            ours = json.loads(Path(ours_json).read_text()) if Path(ours_json).exists() else {
                "error": error_text(tail, rc)}
            line["pithtrain"] = ours
    titan, ours = line.get("torchtitan", {}), line.get("pithtrain", {})
    if "tokens_per_s" in titan:
        line["torchtitan_tokens_per_s"] = titan["tokens_per_s"]
        line["torchtitan_peak_mem_gib"] = titan["peak_mem_gib"]
    if "pithtrain_tokens_per_s" in ours:
        line["pithtrain_tokens_per_s"] = ours["pithtrain_tokens_per_s"]
        line["pithtrain_peak_mem_gib"] = ours["pithtrain_peak_mem_gib"]
        if "tokens_per_s" in titan:
            line["ratio_ours_over_torchtitan"] = ours["pithtrain_tokens_per_s"] / titan["tokens_per_s"]
            # same model FLOPs per token (ours' count for this shape) and matmul peak measured in ours' run
            line["torchtitan_mfu"] = titan["tokens_per_s"] * ours["flops_per_token"] / 1e12 / ours["peak_tflops"]
            line["pithtrain_mfu"] = ours["pithtrain_mfu"]
    print(json.dumps(line, indent=2))
    summary = {k: line.get(k) for k in ("family", "layers", "seq", "batch", "accum", "torchtitan_tokens_per_s",
                                         "pithtrain_tokens_per_s", "ratio_ours_over_torchtitan",
                                         "torchtitan_peak_mem_gib", "pithtrain_peak_mem_gib")}
    for side in ("torchtitan", "pithtrain"):
        if "error" in line.get(side, {}):
            summary[f"{side}_error"] = line[side]["error"]
    print("peer_torchtitan:", json.dumps(summary), flush=True)
    if args.tiny:
        print("--tiny: a check run, not recorded in results.jsonl")
        return
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from results import record

    record(line)


if __name__ == "__main__":
    main()
