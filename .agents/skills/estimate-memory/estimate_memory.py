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
forwards). Multi-GPU runs add a calibrated 12% for communication buffers and the pipeline's
bookkeeping. The fit is within 1.5% of the six one-GPU peaks last measured (three families);
two-GPU estimates run 4-15% above the measured peaks.

`--max-layers` searches the deepest `model.num_hidden_layers` that fits (the "as many layers as
fit" of a benchmark). PASS when the estimate is within 95% of --gpu-mem.
"""

from __future__ import annotations

import argparse
import sys

from pithtrain.train.memory import (  # noqa: F401 (the skills and tests read them here)
    ACTIVATION_FACTOR, GIB, HEAD_BYTES_PER_LOGIT, MULTI_GPU_OVERHEAD, estimate, layer_activation_bytes, param_counts)


def load_config(path: str, sets, nproc: int, mesh: dict):
    """The run config of `path` with the --set overrides and the mesh sizes (`mesh`: pp/cp/ep -> int
    or None), validated for `nproc` ranks; raises ConfigError (the debug-memory skill uses it too)."""
    from pithtrain.config import apply_override, load_run_config, validate

    config = load_run_config(path)
    for assignment in sets:
        apply_override(config, assignment)
    for name, size in mesh.items():
        if size is not None:
            setattr(config.parallel, name, size)
    validate(config, world_size=nproc)
    return config


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("--nproc", type=int, default=1, help="world size (GPUs)")
    for name in ("pp", "cp", "ep"):
        parser.add_argument(f"--{name}", type=int)
    parser.add_argument("--set", action="append", default=[])
    parser.add_argument("--gpu-mem", type=float, default=139.0, help="GiB per GPU (H200: about 139 usable)")
    parser.add_argument("--max-layers", action="store_true", help="find the deepest model that fits")
    args = parser.parse_args()
    from pithtrain.config import ConfigError

    try:
        config = load_config(args.config, args.set, args.nproc, {n: getattr(args, n) for n in ("pp", "cp", "ep")})
    except ConfigError as err:
        print(f"FAIL: {err}")
        return 1
    budget = 0.95 * args.gpu_mem
    if args.max_layers:
        best = None
        for layers in range(2 * config.parallel.pp, 4 * config.model.num_hidden_layers + 1):
            config.model.num_hidden_layers = layers
            if getattr(config.model, "layer_types", None) is not None:
                config.model.layer_types = None  # re-derived for the new depth
            if max(r["total"] for r in estimate(config, args.nproc)) > budget:
                break
            best = layers
        if best is None:
            print(f"FAIL: not even {2 * config.parallel.pp} layers fit in {budget:.0f} GiB")
            return 1
        config.model.num_hidden_layers = best
        print(f"deepest model that fits: {best} layers")
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
