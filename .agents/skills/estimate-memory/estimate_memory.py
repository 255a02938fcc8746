"""Estimate the peak GPU memory per rank of a training run before launching it; PASS/FAIL.

    python .agents/skills/estimate-memory/estimate_memory.py CONFIG [--nproc N --pp P --cp C --ep E]
        [--set train.micro_batch_size=2 ...] [--gpu-mem 139] [--max-layers]

Static part (exact: counted from the model built on the meta device, split and sharded as the
run will be): fp32 master weights, fp32 gradients and the two AdamW moments of this rank's
shard; the bf16 copies (one process: the expert weights cast once per step; FSDP: the gathered
parameters, kept from forward to backward in the pipeline) and, with gradient accumulation under
FSDP, the unsharded fp32 gradients. Activation part (calibrated): bytes per token per layer from
the saved tensors of attention and the MoE path times a factor fitted to measured H200 peaks
(docs/performance.md), times the micro-batches a rank holds at once (1; DualPipeV: its in-flight
forwards). Multi-GPU runs add a calibrated 20% (MULTI_GPU_OVERHEAD) for communication buffers and the pipeline's
bookkeeping. The fit is within 1.7% of the five one-GPU peaks it was fitted to (Qwen3 and DeepSeek-V2-Lite
widths, 2026-12-05); two-GPU estimates are within -6% / +10% of the measured peaks.

`--max-layers` searches the deepest `model.num_hidden_layers` that fits (the "as many layers as
fit" of a benchmark): doubling the depth until it does not fit, then bisecting, up to the 1024
layers pithtrain allows. PASS when the estimate is within 95% of --gpu-mem.

The estimate is for the GPU whatever this machine has: FP8 is validated as on a GPU with FP8 tensor
cores (the estimate does not depend on the device).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "_common"))
import runs  # noqa: E402  (the helpers the skill scripts share: argument types)
from pithtrain.train.memory import (  # noqa: E402,F401 (the skills and tests read them here)
    ACTIVATION_FACTOR, GIB, HEAD_BYTES_PER_LOGIT, MULTI_GPU_OVERHEAD, estimate, layer_activation_bytes, param_counts)


MAX_LAYERS = 1024  # config.check_model_common's bound on model.num_hidden_layers


def load_config(path: str, sets, nproc: int, mesh: dict, gpu: bool = False):
    """The run config of `path` with the --set overrides and the mesh sizes (`mesh`: pp/cp/ep -> int
    or None), validated for `nproc` ranks; raises ConfigError (the debug-memory skill uses it too).
    gpu: validated as a run on a GPU with FP8 tensor cores, whatever this machine has (the checks of
    the device alone are skipped: train.fp8 is emulated on the CPU for the check only)."""
    from pithtrain.config import apply_override, load_run_config, validate

    config = load_run_config(path)
    for assignment in sets:
        apply_override(config, assignment)
    for name, size in mesh.items():
        if size is not None:
            setattr(config.parallel, name, size)
    t = config.train
    checked = dataclasses.replace(config, train=dataclasses.replace(t, device="cpu", fp8_emulate=t.fp8_emulate or t.fp8 != "off"))
    validate(checked if gpu else config, world_size=nproc)
    return config


def deepest(config, nproc: int, budget: float) -> int | None:
    """The most model.num_hidden_layers whose worst rank fits in `budget` GiB (None: not even 2 x pp);
    doubling from 2 x pp until it does not fit, then bisecting (the estimate grows with depth). A written
    model.layer_types (Qwen3.5, GPT-OSS) is repeated by its shortest period to each depth; `config` is left at the result."""
    pattern = getattr(config.model, "layer_types", None)
    if pattern:  # the user's mix of layer kinds, not the family's default one
        period = next(p for p in range(1, len(pattern) + 1) if all(t == pattern[i % p] for i, t in enumerate(pattern)))
        print(f"model.layer_types: {pattern[:period]} repeated to each depth")

    def fits(layers):
        config.model.num_hidden_layers = layers
        if pattern:
            config.model.layer_types = [pattern[i % period] for i in range(layers)]
        return max(r["total"] for r in estimate(config, nproc)) <= budget

    low = 2 * config.parallel.pp
    if not fits(low):
        return None
    high = low
    while high < MAX_LAYERS and fits(high := min(2 * high, MAX_LAYERS)):
        low = high
    while high - low > 1:  # low fits, high does not (or high is MAX_LAYERS, which fits: low == high then)
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    fits(low)
    return low


@runs.interruptible
def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("--nproc", type=runs.COUNT, default=1, help="world size (GPUs)")
    for name in ("pp", "cp", "ep"):
        parser.add_argument(f"--{name}", type=int)
    parser.add_argument("--set", action="append", default=[])
    parser.add_argument("--gpu-mem", type=runs.POSITIVE, default=139.0, help="GiB per GPU (H200: about 139 usable)")
    parser.add_argument("--max-layers", action="store_true", help="find the deepest model that fits")
    args = parser.parse_args()
    from pithtrain.config import ConfigError, UserError

    try:
        config = load_config(args.config, args.set, args.nproc, {n: getattr(args, n) for n in ("pp", "cp", "ep")}, gpu=True)
    except ConfigError as err:
        print(f"FAIL: {err}")
        return 1
    if config.parallel.pp > 1 and not args.max_layers:  # refused by `pithtrain train` at its start (loop.check_run)
        from pithtrain.train.loop import check_pipeline_layers

        try:
            check_pipeline_layers(config)
        except UserError as err:
            print(f"FAIL: {err} (--max-layers: the deepest that fits)")
            return 1
    budget = 0.95 * args.gpu_mem
    if args.max_layers:
        best = deepest(config, args.nproc, budget)
        if best is None:
            print(f"FAIL: not even {2 * config.parallel.pp} layers fit in {budget:.0f} GiB")
            return 1
        print(f"deepest model that fits: {best} layers"
              + (f" (at least: {MAX_LAYERS} is the most model.num_hidden_layers allows)" if best == MAX_LAYERS else ""))
    ranks = estimate(config, args.nproc)
    for r, gib in enumerate(ranks):
        print(f"pipeline rank {r}:" if len(ranks) > 1 else "per GPU:")
        for key, value in gib.items():
            print(f"  {value:8.1f} GiB  {key}")
    worst = max(r["total"] for r in ranks)
    if worst > budget:
        print(f"FAIL: {worst:.1f} GiB > {budget:.1f} GiB (95% of {args.gpu_mem:g}); add GPUs (ep, pp), "
              f"lower train.micro_batch_size or model depth")
        return 1
    print(f"PASS: {worst:.1f} GiB <= {budget:.1f} GiB (95% of {args.gpu_mem:g})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
