"""Training throughput on one GPU: PithTrain vs a plain Hugging Face `transformers` loop, same model,
data and batch. Prints tokens/s, TFLOP/s per GPU, MFU against a bf16 matmul peak measured in the
same run, peak memory, GPU time per layer stage (from a profiled step, by default the last; it is
left out of the medians; the line's `profile` keeps its largest kernels by stage, its GPU idle time by the
host call that ran then, and the host's waits for the GPU), the optimizer step's GPU time (CUDA events: no sync added to the step), the
caching allocator's retries, cudaMalloc and cudaFree calls a step, and the PithTrain/transformers ratio.

    PYTHONPATH=. python benchmarks/train_throughput.py --family qwen3 --layers 4 --seq 4096 --steps 8
    (--family deepseek_v2 | gpt_oss | qwen3_5 | moonlight: the DeepSeek-V2-Lite / GPT-OSS-20B / Qwen3.5-35B-A3B /
     Moonlight-16B-A3B (DeepSeek-V3) widths, --mtp 1: with one multi-token prediction depth; --compile;
     --attention sdpa: GPT-OSS's attention through SDPA with masks instead of ops/attention.py's kernel;
     --mla-v padded: the DeepSeek families' v head padded to q and k's width, as before 2026-12-04;
     --ab SWITCH[,SWITCH...]: arm A with the switches as set, then one arm per switch flipped, taking turns step
     by step; every arm's median and its ratio to A in one line)

Model FLOPs per token (pithtrain.train.metrics.flops_per_token, which the step line's TFLOP/s/GPU counts too):
    6 * (active non-embedding parameters) + 6 * hidden * vocab (LM head)
    + 6 * layers * seq * head_dim * q_heads (causal attention, fwd+bwd)
    + 3 * the chunked Gated DeltaNet's forward FLOPs per token (Qwen3.5's linear layers: ops/delta_rule.chunked_flops,
      the matmuls of the chunked algorithm at chunk 64)
    + per MTP depth (--mtp): its layer as above and 6 * hidden * vocab for its pass through the head.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import sys
from pathlib import Path

import numpy as np
import torch

sys.path.append(str(Path(__file__).resolve().parent))  # after site-packages: a test that loads this must not shadow `kernels`
from results import record  # noqa: E402  (benchmarks/results.py: one JSON line per run)

from pithtrain.train.metrics import flops_per_token  # noqa: E402  (re-exported for mfu_from_metrics.py)


def matmul_peak_tflops(n: int = 8192, repeats: int = 20) -> float:
    """The median of `repeats` single bf16 8192^3 GEMMs after 3 warm-ups: the reading every MFU in
    results.jsonl was computed against (742-803 TFLOP/s across runs, median 777.5). A sustained
    reading (0.2 s of warm-up, batches of 10 back to back) gave 670-684, below the 784-823 TFLOP/s
    the training's own LM-head GEMMs reach, so it is no peak (docs/performance.md, "Tried and dropped")."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * n**3 / statistics.median(times) / 1e12


def qwen3_config(layers: int):
    from pithtrain.models.qwen3_moe import Qwen3MoeConfig

    return Qwen3MoeConfig(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                          num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                          num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, max_position_embeddings=40960)


def family_config(family: str, layers: int):
    """The real-width config of a family (from examples/), cut to `layers` layers."""
    from pithtrain.config import load_run_config

    path = {"qwen3": None, "deepseek_v2": "examples/deepseek_v2_lite.py", "gpt_oss": "examples/gpt_oss_20b.py",
            "qwen3_5": "examples/qwen3_5_35b_a3b.py", "moonlight": "examples/moonlight_16b_a3b.py"}[family]
    if path is None:
        return qwen3_config(layers)
    cfg = load_run_config(path).model
    cfg.num_hidden_layers = layers
    if family in ("gpt_oss", "qwen3_5"):
        cfg.layer_types = None  # the family's pattern over the new depth (sliding/full; 3 linear : 1 full)
    return cfg


# The caching allocator's calls that stall the GPU queue, counted a step: a retry (a failed allocation) frees the
# cached blocks after a device-wide sync; cudaMalloc and cudaFree calls (cudaFree synchronizes). Near the memory
# limit they can be the steps' idle GPU time.
ALLOCATOR_COUNTS = ("num_alloc_retries", "num_device_alloc", "num_device_free")


def allocator_max(steps: list[dict]) -> dict:
    return {k.removeprefix("num_"): max(m["allocator"][k] for m in steps) for k in ALLOCATOR_COUNTS}


def pithtrain_run(cfg, seq: int, batch: int, steps: int, data_dir: str, compile: bool = False, accum: int = 1,
                  profile_step: int = 0, trace: str | None = None, fp8: str = "off",
                  optim: str = "adamw", recompute: str = "off", fp8_head: bool = False,
                  arms=None, drain_steps: bool = False) -> tuple[list[dict], tuple | None]:
    """`arms`: functions of the loop's Run, arm i's called before steps i + 1, i + 1 + n, ... (n arms, taking turns);
    without a profile_step, the last step of each arm is profiled (stages: {"A": stage ms, "B": ...}).
    `drain_steps`: each step waits for its optimizer (the loop leaves it running into the next step, whose time then
    holds it): for arms that change the optimizer, so each arm's time holds its own."""
    from pithtrain.config import DataConfig, OptimConfig, RunConfig, TrainConfig
    from pithtrain.train import loop

    optimizer_events, untimed = [], loop.optimizer_step  # GPU time of each step's optimizer step
    allocator_counts = [[torch.cuda.memory_stats().get(k, 0) for k in ALLOCATOR_COUNTS]]  # cumulative, after each step
    plain_step = loop.train_step

    arm_traces = {}  # arm -> Chrome trace events of its profiled step

    def step_in_arm(run, step, stop):  # step: 0-based
        arms[step % len(arms)](run)
        if profile_step or step + len(arms) < steps:
            out = plain_step(run, step, stop)
            if drain_steps:
                loop.drain(run.mesh.device)
            return out
        loop.drain(run.mesh.device)  # the profiled step holds its own kernels: none of the last step's optimizer
        profiler = loop.start_profiler(run.mesh.device)
        try:
            return plain_step(run, step, stop)
        finally:
            loop.drain(run.mesh.device)  # and all of its own (train_step returns with them queued)
            profiler.stop()
            with tempfile.NamedTemporaryFile(suffix=".json") as f:
                profiler.export_chrome_trace(f.name)
                arm_traces[ARMS[step % len(arms)]] = json.load(open(f.name))["traceEvents"]

    def timed_optimizer_step(*args):  # CUDA events: a sync after it would idle the GPU while the host readies the
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)  # next step
        start.record()
        untimed(*args)
        end.record()
        optimizer_events.append((start, end))
        stats = torch.cuda.memory_stats()
        allocator_counts.append([stats.get(k, 0) for k in ALLOCATOR_COUNTS])

    loop.optimizer_step = timed_optimizer_step
    if arms:
        loop.train_step = step_in_arm
    run = RunConfig(model=cfg, data=DataConfig(path=data_dir, seq_len=seq),
                    optim=OptimConfig(name=optim, lr=1e-4, warmup_steps=0, schedule="constant"),
                    train=TrainConfig(steps=steps, global_batch_size=batch * accum, micro_batch_size=batch, lb_coef=1e-3,
                                      tensorboard=False, checkpoint_every=-1, log_every=1, compile=compile,
                                      profile_step=profile_step, fp8=fp8, recompute=recompute,
                                      fp8_head=fp8_head))
    with tempfile.TemporaryDirectory() as out:
        try:
            history = loop.train(run, out, echo=True)
        finally:
            loop.optimizer_step, loop.train_step = untimed, plain_step
        torch.cuda.synchronize()
        for m, (start, end), before, after in zip(history, optimizer_events, allocator_counts, allocator_counts[1:]):
            m["optimizer_s"] = start.elapsed_time(end) / 1e3
            m["allocator"] = {k: b - a for k, a, b in zip(ALLOCATOR_COUNTS, before, after)}
        stages, digests = None, {}
        if arm_traces:
            profile, stages = _profile_tool(), {}
            for arm, events in sorted(arm_traces.items()):
                times = profile.stage_times(events)
                print(f"arm {arm}, its last step:", flush=True)
                profile.print_stages(*times)
                stages[arm] = {**times[0], "gpu idle": gpu_idle_us(profile, events)}
                digests[arm] = profile_digest(profile, events)
        if profile_step:
            profile = _profile_tool()
            events = json.loads(open(f"{out}/profile/rank0.json").read())["traceEvents"]
            stages = profile.stage_times(events)
            profile.print_stages(*stages)
            stages[0]["gpu idle"] = gpu_idle_us(profile, events)
            digests["step"] = profile_digest(profile, events)
            if trace:
                import shutil

                shutil.copy(f"{out}/profile/rank0.json", trace)
        return history, stages, digests


ARMS = "ABCDEFG"  # the arms' letters: A as the flags set the switches, then one a flipped switch
AB_SWITCHES = ("fp8", "fused-proj", "fused-wgrad", "mla-v", "wgrad-config", "triton-adamw", "bf16-activations", "qk-norm-rope",
               "wgrad-host", "ce-fp8-grad", "glu-fp8-grad", "expand-fp8", "combine-fp8-grad", "stage5-compiled",
               "gmm-persistent")
STAGE5 = argparse.Namespace(compiled=True)  # --ab stage5-compiled: its arm runs stage 5 eagerly (as FP8 experts do)


def wgrad_tiles(text: str) -> dict:
    """--wgrad-config's JSON: every tile field of kernels.WGRAD_INTO_CONFIG, positive integers."""
    keys = ("BK", "BM", "BN", "num_warps", "num_stages")
    try:
        tiles = json.loads(text)
    except ValueError:
        tiles = None
    if not isinstance(tiles, dict) or sorted(tiles) != sorted(keys) or not all(
            type(v) is int and v > 0 for v in tiles.values()):
        raise argparse.ArgumentTypeError(f"give a JSON object of positive integers with exactly {', '.join(keys)} "
                                         f"(got {text!r})")
    return tiles


def ab_arms(args, parser):
    """--ab: ({switch: what arm A runs}, [(switch, what its arm runs)], the arms' setters, each given the loop's Run).
    Arm A runs every switch as this run's flags set it; each further arm (B, C, ...) flips one switch, the others
    as in A. wgrad-config: its arm runs --wgrad-config's tiles, A the kernel's default; fp8 (alone): A bf16,
    B the --fp8 recipe (with --fp8-head as given)."""
    from pithtrain.models import deepseek_v2
    from pithtrain.ops import core, fp8, grouped_gemm, kernels
    from pithtrain.train import optim

    switches = args.ab.split(",")
    unknown = [s for s in switches if s not in AB_SWITCHES]
    if unknown or len(set(switches)) < len(switches):
        parser.error(f"--ab {args.ab}: give distinct switches of {', '.join(AB_SWITCHES)}, comma-separated"
                     + (" (no spaces)" if any(s != s.strip() for s in switches) else ""))
    if len(switches) >= len(ARMS):
        parser.error(f"--ab {args.ab}: at most {len(ARMS) - 1} switches a run (arms {ARMS}); split them over runs")
    if "fp8" in switches:
        if len(switches) > 1:
            parser.error("--ab fp8 runs alone: it changes the model's mode, not one switch (A/B the rest under --fp8)")
        if args.fp8 == "off":
            parser.error("--ab fp8: arm B runs the --fp8 recipe; give one (e.g. --fp8 rowwise_bf16_wgrad)")
        return {"fp8": "off"}, [("fp8", {"fp8": args.fp8, "fp8_head": args.fp8_head})], [
            lambda run: fp8_arm(run.model, False, False, args.compile),
            lambda run: fp8_arm(run.model, args.fp8, args.fp8_head, args.compile)]
    if "mla-v" in switches and args.family not in ("deepseek_v2", "moonlight"):
        parser.error("--ab mla-v: MLA is the DeepSeek families' (--family deepseek_v2 or moonlight)")
    fp8_only = [s for s in switches if s in ("ce-fp8-grad", "glu-fp8-grad", "expand-fp8", "combine-fp8-grad",
                                             "gmm-persistent")]
    if fp8_only and args.fp8 == "off" or "ce-fp8-grad" in switches and not args.fp8_head:
        parser.error(f"--ab {','.join(fp8_only)}: FP8 switches; give --fp8 rowwise_bf16_wgrad"
                     + (" --fp8-head (ce-fp8-grad is the FP8 head's)" if "ce-fp8-grad" in switches else ""))
    if "stage5-compiled" in switches and (not args.compile or args.fp8 != "off"):
        parser.error("--ab stage5-compiled: compiled against eager stage 5 in bf16; give --compile, not --fp8")
    if "wgrad-config" in switches and not args.wgrad_config:
        parser.error("--ab wgrad-config: its arm runs the tiles of --wgrad-config; give it as JSON")
    where = {"fused-proj": (fp8, "FUSED_PROJECTIONS"), "fused-wgrad": (grouped_gemm, "FUSED_WGRAD"),
             "mla-v": (deepseek_v2, "UNPADDED_V"), "wgrad-config": (kernels, "WGRAD_INTO_CONFIG"),
             "triton-adamw": (optim, "TRITON_ADAMW"), "bf16-activations": (core, "ACTIVATIONS_IN_COMPUTE_DTYPE"),
             "qk-norm-rope": (kernels, "FUSED_QK_NORM_ROPE"), "wgrad-host": (kernels, "WGRAD_HOST_DESCRIPTORS"),
             "ce-fp8-grad": (kernels, "CE_FP8_GRAD"),
             "glu-fp8-grad": (fp8, "GLU_FP8_GRAD"), "expand-fp8": (grouped_gemm, "EXPAND_FP8"),
             "combine-fp8-grad": (kernels, "COMBINE_FP8_GRAD"), "stage5-compiled": (STAGE5, "compiled"),
             "gmm-persistent": (fp8, "GMM_PERSISTENT")}
    a_values = {s: getattr(*where[s]) for s in switches}
    flipped = {s: args.wgrad_config if s == "wgrad-config" else not a_values[s] for s in switches}

    def setter(flip=None):
        def set_arm(run):
            for s in switches:
                setattr(*where[s], flipped[s] if s == flip else a_values[s])
            if "stage5-compiled" in switches and run is not None:  # None: after the run, the flags as arm A
                compiled_stage5(run.model, STAGE5.compiled)
        return set_arm

    return a_values, [(s, flipped[s]) for s in switches], [setter()] + [setter(s) for s in switches]


def fp8_arm(model, recipe, head: bool, compiled: bool) -> None:
    """Switch a model set up with train.fp8 (ops/fp8.enable_fp8) to bf16 (recipe False) or back, dropping the
    experts' and the head's cached casts (bf16 copies, FP8 layouts): the other arm's would hold some 11 GB at
    Qwen3's 9 layers, and each is remade after every update anyway. The dense Linears' FP8 layouts stay (a few
    hundred MB): compiled stages read them, and new tensors there would recompile them at every switch. The FP8
    weights' maxima buffers stay (ops/fp8.optimizer_amax): each step's optimizer takes them, and its kernels land in
    the next step's time, so an FP8 step holds the pass that readied its weights (a bf16 step holds one too, the
    atomics' few ms more than torch's AdamW alone: benchmarks/fp8.py --wquant). Stage 5
    as each mode runs it alone: compiled in bf16 (a wrapper of the same code: dynamo's graphs are reused), eager
    under FP8 experts (enable_fp8, kernels.COMBINE_FP8_GRAD)."""
    from pithtrain.ops import fp8, kernels

    fp8.enable_fp8(model, compiled=False, recipe=recipe, head=head)  # the flags; stage 1 keeps its set-up refresh wrapper
    if compiled:
        compiled_stage5(model, not (recipe and kernels.COMBINE_FP8_GRAD))
    for m in model.modules():
        if not isinstance(m, fp8.Linear):
            m.__dict__.pop("_fp8_cache", None)
    for p in model.parameters():
        for cache in ("_fp8_cache", "_head_cast", "_cast_cache"):
            p.__dict__.pop(cache, None)


def compiled_stage5(model, compiled: bool) -> None:
    """Every layer's stage 5 compiled (a new wrapper of the same code: dynamo's graphs are reused) or eager."""
    from pithtrain.protocol import all_layers

    for layer in all_layers(model).values():
        if not compiled:
            layer.__dict__.pop("stage5", None)
        elif "stage5" not in layer.__dict__:
            layer.stage5 = torch.compile(layer.stage5, fullgraph=True)


def gpu_idle_us(profile, events) -> float:
    """Time between a profiled step's first and last GPU kernel or copy in which none ran (host-bound gaps)."""
    busy = profile.merged(profile.intervals(events, lambda e: e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")))
    return (busy[-1][1] - busy[0][0] - sum(b - a for a, b in busy)) if busy else 0.0


def profile_digest(profile, events, top: int = 5, top_kernels: int = 10) -> dict:
    """What a profiled step's line keeps for the next change (capture-profile's analysis, ms): each stage's largest
    kernels, the GPU's idle gaps of 20 us or more by the host call running when each began, and the host's waits for
    the GPU by call stack."""
    threads = profile.host_threads(events)
    busy = profile.merged(profile.intervals(events, lambda e: e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")))
    idle = {}
    for us, stack in profile.idle_gaps(threads, busy):
        key = stack[-1] if stack else "(between host calls)"
        idle[key] = idle.get(key, 0.0) + us
    kernels = {}
    for key, us in profile.stage_times(events, threads, by_kernel=True)[0].items():
        if isinstance(key, tuple):  # (stage, kernel); a CPU trace has host ops by stage only
            kernels.setdefault(key[0], []).append([round(us / 1e3, 2), key[1][:80]])
    return {"stage_kernels": {stage: sorted(rows, reverse=True)[:top_kernels] for stage, rows in sorted(kernels.items())},
            "idle_by_host_call": [[round(us / 1e3, 2), name] for name, us in sorted(idle.items(), key=lambda kv: -kv[1])[:top]],
            "host_waits": [[round(us / 1e3, 2), n, stack[-120:]] for us, n, stack in profile.host_syncs(threads)[:top]]}


def _profile_tool():
    """The capture-profile skill's trace analysis (stage times), loaded from its script."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("profile_step", ".agents/skills/capture-profile/profile_step.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def transformers_run(cfg, seq: int, batch: int, steps: int, tokens: np.ndarray, accum: int = 1) -> list[dict]:
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_cfg = AutoConfig.for_model(**{k: v for k, v in cfg.to_hf().items() if k not in ("architectures", "dtype")})
    model = AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32).cuda().train()
    for module in model.modules():  # Qwen3.5: which gated delta rule transformers picked (FLA when installed)
        if hasattr(module, "chunk_gated_delta_rule"):
            print(f"transformers' gated delta rule: {module.chunk_gated_delta_rule.__module__}", flush=True)
            break
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    history = []
    for step in range(steps):
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        for micro in range(accum):
            start = (step * accum + micro) * batch * seq
            ids = torch.from_numpy(tokens[start: start + batch * seq].astype(np.int64)).view(batch, seq).cuda()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(input_ids=ids, labels=ids).loss / accum
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        tps = batch * accum * seq / dt
        history.append({"step": step + 1, "tokens_per_s": tps, "peak_mem_bytes": torch.cuda.max_memory_allocated()})
        print(f"transformers step {step + 1}: {tps:.0f} tok/s, loss {loss.item() * accum:.3f}", flush=True)
    del model, opt
    torch.cuda.empty_cache()
    return history


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="qwen3", choices=["qwen3", "deepseek_v2", "gpt_oss", "qwen3_5", "moonlight"])
    parser.add_argument("--mtp", type=int, default=0, help="multi-token prediction depths (moonlight: DeepSeek-V3's "
                        "MTP; its FLOPs counted; the transformers loop has none: compare it at --mtp 0)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--accum", type=int, default=1, help="micro-batches per optimizer step (gradient accumulation)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--profile-step", type=int, help="torch-profile this step of the PithTrain run for the time "
                        "per layer stage (default: the last step; 0: none); it is left out of the medians")
    parser.add_argument("--trace", help="copy that profile (Chrome trace) here")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--hf-batch", type=int, help="micro-batch of the transformers loop, when --batch does not fit "
                        "there (it accumulates more micro-batches: the same tokens per optimizer step)")
    parser.add_argument("--compile", action="store_true", help="torch.compile stages 1 and 5")
    parser.add_argument("--recompute", default="off", choices=["off", "selective", "full"], help="train.recompute")
    parser.add_argument("--fp8", default="off", choices=["off", "rowwise", "rowwise_bf16_wgrad"], help="train.fp8 (MFU stays model FLOPs "
                        "over the bf16 matmul peak, so FP8 and bf16 runs compare directly)")
    parser.add_argument("--fp8-head", action="store_true", help="train.fp8_head: the LM head's forward and input "
                        "gradient in FP8 too (with --fp8)")
    parser.add_argument("--optim", default="adamw", choices=["adamw", "muon"], help="optim.name; the optimizer step's "
                        "share of the step time is reported either way")
    parser.add_argument("--attention", default="flash", choices=["flash", "sdpa"], help="GPT-OSS attention: the "
                        "Triton kernel of ops/attention.py, or SDPA with the sink as an extra key and explicit masks")
    parser.add_argument("--fused-wgrad", default="on", choices=["on", "off"], help="grouped_gemm.FUSED_WGRAD: the "
                        "experts' weight gradient added into the fp32 .grad in the GEMM (on) or by a pass after it")
    parser.add_argument("--wgrad-config", type=wgrad_tiles, help="kernels.WGRAD_INTO_CONFIG for this run, as JSON "
                        "(the tiles of benchmarks/grouped_gemm.py --wgrad --sweep)")
    parser.add_argument("--glu-tiles", metavar="FWD,BWD", help="FP8 experts' activation kernels' tiles for this run, "
                        "each VALUES/WARPS (fp8.GLU_QUANT_TILE, kernels.GLU_BWD_QUANT_TILE; benchmarks/fp8.py --glu)")
    parser.add_argument("--wgrad-host", choices=["on", "off"], help="kernels.WGRAD_HOST_DESCRIPTORS for this run "
                        "(default: the module's): the fused weight gradient's tensor descriptors made on the host")
    parser.add_argument("--mla-v", default="unpadded", choices=["unpadded", "padded"], help="DeepSeek families: "
                        "MLA's v head (128) handed to SDPA as it is, or padded to q and k's 192 (deepseek_v2.UNPADDED_V)")
    parser.add_argument("--fused-proj", default="on", choices=["on", "off"], help="fp8.FUSED_PROJECTIONS: q, k and "
                        "v (and the like) from one GEMM over their stacked weights, or one GEMM each")
    parser.add_argument("--bf16-activations", default="on", choices=["on", "off"], help="ops/core."
                        "ACTIVATIONS_IN_COMPUTE_DTYPE: the residual stream and norm outputs in bf16 (as under FSDP) or fp32")
    parser.add_argument("--triton-adamw", default="on", choices=["on", "off"], help="train/optim.TRITON_ADAMW: AdamW "
                        "as one Triton pass a parameter (the clip coefficient and the experts' bf16 copy in the pass)")
    parser.add_argument("--persistent-rows", type=int, help="train/loop.PERSISTENT_ROWS for this run (default: the "
                        "module's): compiled row reductions up to this width one persistent kernel; 0: Inductor's rule")
    parser.add_argument("--ab", metavar="SWITCH[,SWITCH...]", help=f"A/B in one run ({', '.join(AB_SWITCHES)}): "
                        "arm A with the switches as the flags set them, then one arm per switch with it flipped "
                        "(wgrad-config: --wgrad-config's tiles against the default; fp8, alone: A bf16, B --fp8 "
                        "[--fp8-head]), taking turns step by step; each arm's median after its first two steps and "
                        "its ratio to A in one line. Same process, model and data: drift and call-to-call noise "
                        "cancel, and one compile serves every arm (with triton-adamw each step waits for its "
                        "optimizer; else a step's time holds the step before's). Without --profile-step the last "
                        "step of each arm is profiled (ab_stage_ms) and left out of the medians: 6 steps an arm give "
                        "each three")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    from pithtrain.models import deepseek_v2
    from pithtrain.ops import attention, core, fp8, grouped_gemm, kernels

    attention.ENABLED = args.attention == "flash"
    deepseek_v2.UNPADDED_V = args.mla_v == "unpadded"
    grouped_gemm.FUSED_WGRAD = args.fused_wgrad == "on"
    fp8.FUSED_PROJECTIONS = args.fused_proj == "on"
    from pithtrain.train import optim

    optim.TRITON_ADAMW = args.triton_adamw == "on"
    from pithtrain.train import loop as train_loop

    if args.persistent_rows is not None:
        if args.persistent_rows < 0:
            parser.error(f"--persistent-rows {args.persistent_rows}: give a row width >= 0 (0: Inductor's own rule)")
        train_loop.PERSISTENT_ROWS = args.persistent_rows
    core.ACTIVATIONS_IN_COMPUTE_DTYPE = args.bf16_activations == "on"
    if args.wgrad_host:  # arm A's (an --ab wgrad-host arm flips it)
        kernels.WGRAD_HOST_DESCRIPTORS = args.wgrad_host == "on"
    arms = None
    if args.ab is not None:  # an empty --ab is refused there, not taken for none
        arm_a, flips, arms = ab_arms(args, parser)
        if args.steps < 4 * len(arms):
            parser.error(f"--ab {args.ab} needs --steps >= {4 * len(arms)} (got {args.steps}): {len(arms)} arms, each "
                         "with two steps of warm-up, one to measure and one to profile (6 an arm give three measured)")
    if args.glu_tiles is not None:
        if args.fp8 == "off":
            parser.error("--glu-tiles: the tiles of FP8 experts' activation kernels; give --fp8 rowwise_bf16_wgrad")
        try:
            tiles = [dict(zip(("values", "num_warps"), map(int, t.split("/", 1)))) for t in args.glu_tiles.split(",")]
        except ValueError:
            tiles = []
        if len(tiles) != 2 or any(len(t) != 2 or t["values"] < 1 or t["values"] & (t["values"] - 1)
                                  or t["num_warps"] not in (1, 2, 4, 8, 16) for t in tiles):
            parser.error(f"--glu-tiles takes FWD,BWD, each VALUES/WARPS with both powers of two, WARPS <= 16 (got "
                         f"{args.glu_tiles!r})")
        fp8.GLU_QUANT_TILE.update(tiles[0]), kernels.GLU_BWD_QUANT_TILE.update(tiles[1])
    if args.wgrad_config and "wgrad-config" not in (args.ab or "").split(","):
        kernels.WGRAD_INTO_CONFIG = args.wgrad_config  # every arm's tiles
    if args.profile_step is None:
        args.profile_step = 0 if args.ab else args.steps  # --ab: the last step of each arm (pithtrain_run)
    for flag, value, least in (("--batch", args.batch, 1), ("--accum", args.accum, 1), ("--steps", args.steps, 1),
                               ("--layers", args.layers, 1), ("--seq", args.seq, 2), ("--hf-batch", args.hf_batch, 1),
                               ("--mtp", args.mtp, 0)):
        if value is not None and value < least:
            parser.error(f"{flag} must be at least {least} (got {value})")
    if args.fp8_head and args.fp8 == "off":
        parser.error("--fp8-head runs the LM head's GEMMs in FP8: give --fp8 rowwise_bf16_wgrad too")
    if args.profile_step is not None and not 0 <= args.profile_step <= args.steps:
        parser.error(f"--profile-step must be a step of the run, 1..{args.steps} (or 0: none; got {args.profile_step})")
    if args.mtp and args.family != "moonlight":
        parser.error("--mtp: multi-token prediction is DeepSeek-V3's; use --family moonlight")
    hf_batch = args.hf_batch or args.batch
    if (args.batch * args.accum) % hf_batch:
        parser.error(f"--hf-batch {hf_batch} must divide --batch x --accum = {args.batch * args.accum}")
    if not torch.cuda.is_available():  # after every argument check, so a CPU run checks a command line
        print("train_throughput.py: needs a CUDA GPU (it measures a bf16 GEMM peak and trains on the GPU); the "
              "arguments are valid", file=sys.stderr)
        sys.exit(2)
    from pithtrain.train.data import write_dataset

    cfg = family_config(args.family, args.layers)
    if args.mtp:
        cfg.num_nextn_predict_layers = args.mtp
    rng = np.random.default_rng(0)
    need = (args.steps + 2) * args.batch * args.accum * (args.seq + 1)
    tokens = rng.integers(0, cfg.vocab_size, size=need, dtype=np.int64)
    peak = matmul_peak_tflops()
    print(f"bf16 matmul peak measured now: {peak:.0f} TFLOP/s", flush=True)
    fpt = flops_per_token(cfg, args.seq)
    with tempfile.TemporaryDirectory() as data:
        write_dataset(data, [tokens], cfg.vocab_size, eos_id=None)
        ours, stages, digests = pithtrain_run(cfg, args.seq, args.batch, args.steps, data, args.compile, args.accum,
                                     args.profile_step, args.trace, args.fp8, args.optim, args.recompute,
                                     args.fp8_head, arms, drain_steps="triton-adamw" in (args.ab or "").split(","))
    if arms and args.ab != "fp8":
        arms[0](None)  # the switches as arm A (the line's other fields describe arm A)
    import gc

    gc.collect()
    torch.cuda.empty_cache()
    n_arms = len(arms) if arms else 1
    runs_a = ours[0::n_arms]  # with --ab: arm A's steps (1, 1 + n, ...); arm i's are ours[i::n]
    profiled = {args.profile_step} if args.profile_step or not args.ab else set(range(args.steps - n_arms + 1, args.steps + 1))

    def measured(steps):
        return [m for m in steps[2:] if m["step"] not in profiled] or steps

    warm = measured(runs_a)
    tps = statistics.median(m["tokens_per_s"] for m in warm)
    result = {"family": args.family, "mtp": args.mtp, "fp8": args.fp8, "fp8_head": args.fp8_head, "optim": args.optim, "recompute": args.recompute, "attention": args.attention, "mla_v": args.mla_v, "fused_wgrad": args.fused_wgrad, "fused_proj": args.fused_proj, "triton_adamw": args.triton_adamw, "persistent_rows": train_loop.PERSISTENT_ROWS, "bf16_activations": args.bf16_activations, "wgrad_config": kernels.WGRAD_INTO_CONFIG, "wgrad_host": kernels.WGRAD_HOST_DESCRIPTORS, "ce_fp8_grad": kernels.CE_FP8_GRAD, "combine_fp8_grad": kernels.COMBINE_FP8_GRAD, "glu_fp8_grad": fp8.GLU_FP8_GRAD, "glu_tiles": [fp8.GLU_QUANT_TILE, kernels.GLU_BWD_QUANT_TILE], "expand_fp8": grouped_gemm.EXPAND_FP8, "gmm_persistent": fp8.GMM_PERSISTENT, "adamw_amax_tile": kernels.ADAMW_AMAX_TILE, "compile": args.compile, "layers": args.layers, "seq": args.seq, "batch": args.batch, "accum": args.accum,
              "peak_tflops": peak, "flops_per_token": fpt,
              "pithtrain_tokens_per_s": tps, "pithtrain_tflops": tps * fpt / 1e12, "pithtrain_mfu": tps * fpt / 1e12 / peak,
              "pithtrain_peak_mem_gib": max(m["peak_mem_bytes"] for m in runs_a) / 2**30,
              "optimizer_s": statistics.median(m["optimizer_s"] for m in warm),
              "optimizer_share": statistics.median(m["optimizer_s"] / m["step_time_s"] for m in warm),
              "allocator_max_per_step": allocator_max(warm)}
    if args.family == "qwen3_5":  # which gated delta rule ran: FLA's kernels, or the PyTorch path without FLA importable
        from pithtrain.ops import delta_rule
        result["delta_rule"] = "fla" if delta_rule.USE_FLA and delta_rule._fla() is not None else "pytorch"
    if args.ab:  # each flipped arm against A; arm B's figures also under the two-arm lines' ab_b_* keys
        result.update(ab=args.ab, ab_a=arm_a, ab_steps=[[m["step"], ARMS[(m["step"] - 1) % n_arms], round(m["tokens_per_s"])]
                                                        for m in ours], ab_arms={})
        for i, (switch, value) in enumerate(flips, 1):
            warm_i = measured(ours[i::n_arms])
            tps_i = statistics.median(m["tokens_per_s"] for m in warm_i)
            result["ab_arms"][ARMS[i]] = {"switch": switch, "runs": value, "tokens_per_s": tps_i,
                                          "mfu": tps_i * fpt / 1e12 / peak, "ratio": tps_i / tps,
                                          "peak_mem_gib": max(m["peak_mem_bytes"] for m in ours[i::n_arms]) / 2**30,
                                          "allocator_max_per_step": allocator_max(warm_i)}
        b = result["ab_arms"]["B"]
        result.update(ab_b={b["switch"]: b["runs"]}, ab_b_tokens_per_s=b["tokens_per_s"],
                      ab_b_mfu=b["mfu"], ab_b_peak_mem_gib=b["peak_mem_gib"], ab_ratio=b["ratio"],
                      ab_b_allocator_max_per_step=b["allocator_max_per_step"])
    if isinstance(stages, dict):  # --ab: the last step of each arm profiled
        result["ab_stage_ms"] = {arm: {k: round(v / 1e3, 3) for k, v in sorted(times.items())} for arm, times in stages.items()}
    elif stages is not None:  # one profiled step, milliseconds of GPU kernel time per layer stage
        result["stage_ms"] = {k: round(v / 1e3, 3) for k, v in sorted(stages[0].items())}
    if digests:  # the profiled step's (or each arm's) largest kernels by stage, idle gaps and host waits
        result["profile"] = digests
    print("pithtrain:", json.dumps(result), flush=True)  # kept even if the transformers loop fails
    if not args.skip_transformers:
        result["transformers_batch"] = hf_batch
        theirs = transformers_run(cfg, args.seq, hf_batch, args.steps, tokens, args.batch * args.accum // hf_batch)
        hf_tps = statistics.median(m["tokens_per_s"] for m in (theirs[2:] or theirs))
        result.update(transformers_tokens_per_s=hf_tps, transformers_mfu=hf_tps * fpt / 1e12 / peak,
                      transformers_peak_mem_gib=max(m["peak_mem_bytes"] for m in theirs) / 2**30,
                      speedup_vs_transformers=tps / hf_tps)
    print(json.dumps(result, indent=2))
    record({"benchmark": "train_throughput", **result})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
