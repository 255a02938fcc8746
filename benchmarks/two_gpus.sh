#!/usr/bin/env bash
# One vs two H200s at equal per-GPU work (the GPU-speed issue's scaling target): each pair runs the
# same micro-batch and the same number of micro-batches per GPU per step; two GPUs use ep2 with the
# DualPipeV pp = 1 overlap. Per-GPU tokens/s = the two-GPU run's tok/s / 2; compare medians of
# steps 2 and later; then FP8 and Muon at ep2 (issues 14, 17). From the repository root on a 2-GPU machine: bash benchmarks/two_gpus.sh
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1
python -c "import numpy as np; from pithtrain.train.data import write_dataset as w; r = np.random.default_rng(0); \
w('/tmp/rand', [r.integers(0, 151936, 2_000_000)], 151936, None); \
w('/tmp/rand_ds', [r.integers(0, 102400, 2_000_000)], 102400, None); \
w('/tmp/rand_oss', [r.integers(0, 201088, 2_000_000)], 201088, None)"
W="--set train.compile=true --set train.log_every=1"
# Qwen3-30B-A3B width, 4 layers, micro-batch 4: 8 and 4 micro-batches per GPU per step
for per_gpu in 8 4; do
    python -m pithtrain train benchmarks/qwen3_width.py --nproc 2 --ep 2 --out /tmp/q2_$per_gpu --steps 7 \
        --set train.global_batch_size=$((8 * per_gpu)) --set train.micro_batch_size=4 $W | grep "^step"
    python -m pithtrain train benchmarks/qwen3_width.py --nproc 1 --out /tmp/q1_$per_gpu --steps 7 \
        --set train.global_batch_size=$((4 * per_gpu)) --set train.micro_batch_size=4 $W | grep "^step"
done
# DeepSeek-V2-Lite and GPT-OSS-20B widths, 4 layers, micro-batch 2: 8 and 4 micro-batches per GPU per step
S="--set model.num_hidden_layers=4 --set train.micro_batch_size=2 --set train.lb_type=micro --set train.lb_coef=1e-3 \
   --set optim.lr=1e-4 --set optim.schedule=constant --set optim.warmup_steps=0 --set train.checkpoint_every=-1 \
   --set train.tensorboard=false $W"
for per_gpu in 8 4; do
    for n in 2 1; do
        python -m pithtrain train examples/deepseek_v2_lite.py --nproc $n --ep $n --out /tmp/ds${n}_$per_gpu --steps 7 $S \
            --set train.global_batch_size=$((2 * per_gpu * n)) --set data.path=/tmp/rand_ds | grep "^step"
        python -m pithtrain train examples/gpt_oss_20b.py --nproc $n --ep $n --out /tmp/oss${n}_$per_gpu --steps 7 $S \
            --set train.global_batch_size=$((2 * per_gpu * n)) --set data.path=/tmp/rand_oss --set model.layer_types=None | grep "^step"
    done
done
# FP8 (issue 14) and Muon (issue 17) at ep2: Qwen3 width, 4 layers, micro-batch 4, 8 micro-batches per GPU, against
# the bf16 AdamW ep2 run above (/tmp/q2_8); the profiled step's table gives the optimizer's share of GPU time
for what in train.fp8=rowwise_bf16_wgrad train.fp8=rowwise optim.name=muon; do
    out=/tmp/q2_${what//[.=]/_}
    python -m pithtrain train benchmarks/qwen3_width.py --nproc 2 --ep 2 --out $out --steps 7 --set $what \
        --set train.global_batch_size=64 --set train.micro_batch_size=4 --set train.profile_step=7 $W | grep "^step"
    python .agents/skills/capture-profile/profile_step.py --trace $out/profile/rank0.json | grep -E "^  (stage|optimizer|other)"
done
