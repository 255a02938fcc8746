#!/usr/bin/env bash
# The runs of the 4- and 8-GPU issue, ready for a machine with 4 or 8 H200s (run from the repository
# root: bash benchmarks/four_and_eight_gpus.sh 4|8). Depths come from the estimate-memory skill:
#   estimate_memory.py examples/qwen3_30b_a3b.py --nproc 8 --pp 2 --ep 4 --set train.global_batch_size=16 --max-layers -> 58 (all 48 fit: 112.6 GiB)
#   estimate_memory.py examples/deepseek_v2_lite.py --nproc 8 --ep 8 --set train.global_batch_size=16 -> 86.0 GiB, PASS
set -euo pipefail
export PYTHONPATH=.
gpus=${1:?give 4 or 8}
if [ ! -d data/stdlib ]; then python examples/quickstart.py > /tmp/quickstart.log 2>&1; fi
python -c "import numpy as np; from pithtrain.train.data import write_dataset; \
    write_dataset('/tmp/rand', [np.random.default_rng(0).integers(0, 151936, 20_000_000)], 151936, None); \
    write_dataset('/tmp/rand_ds', [np.random.default_rng(1).integers(0, 102400, 20_000_000)], 102400, None)"
CMP=".agents/skills/validate-correctness/compare_runs.py"
if [ "$gpus" = 4 ]; then
    # 1. mesh invariance against one GPU in bf16 (tolerances as on 2 GPUs: 2e-2 loss, 5e-2 lb_loss/grad_norm)
    python $CMP examples/qwen3_tiny.py --steps 20 --a "--nproc 1" --b "--nproc 4 --pp 2 --ep 2" \
        --rtol 2e-2 --rtol-aux 5e-2 --set train.micro_batch_size=2
    python $CMP examples/qwen3_tiny.py --steps 20 --a "--nproc 1" --b "--nproc 4 --cp 2 --ep 2" \
        --rtol 2e-2 --rtol-aux 5e-2 --set train.micro_batch_size=4
    python .agents/skills/launch-multi-node/preflight.py examples/qwen3_tiny.py --nproc 4 --pp 2 --ep 2
    exit 0
fi
# 2. eight GPUs: Qwen3-30B-A3B in full (48 layers), and DeepSeek-V2-Lite in full at ep8
common="--set data.path=/tmp/rand --set train.checkpoint_every=-1 --set train.tensorboard=false --set train.log_every=1"
python -m pithtrain train examples/qwen3_30b_a3b.py --nproc 8 --pp 2 --ep 4 --out /tmp/q30_pp2ep4 --steps 8 $common \
    --set train.global_batch_size=16 --set train.profile_step=6
python benchmarks/mfu_from_metrics.py /tmp/q30_pp2ep4 examples/qwen3_30b_a3b.py --nproc 8 \
    --set train.profile_step=6
python .agents/skills/capture-profile/profile_step.py --trace /tmp/q30_pp2ep4/profile/rank0.json --kind all-to-all/p2p
python -m pithtrain train examples/qwen3_30b_a3b.py --nproc 8 --ep 8 --out /tmp/q30_ep8 --steps 8 $common \
    --set train.global_batch_size=8
python benchmarks/mfu_from_metrics.py /tmp/q30_ep8 examples/qwen3_30b_a3b.py --nproc 8
python -m pithtrain train examples/deepseek_v2_lite.py --nproc 8 --ep 8 --out /tmp/dsl_ep8 --steps 8 $common \
    --set data.path=/tmp/rand_ds --set train.global_batch_size=16
python benchmarks/mfu_from_metrics.py /tmp/dsl_ep8 examples/deepseek_v2_lite.py --nproc 8
