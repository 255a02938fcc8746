"""Run config for multi-GPU throughput: Qwen3-30B-A3B width, 4 layers, sequence 4096.

    PYTHONPATH=. python -c "import numpy as np; from pithtrain.train.data import write_dataset; \
        write_dataset('/tmp/rand', [np.random.default_rng(0).integers(0, 151936, 2_000_000)], 151936, None)"
    PYTHONPATH=. python -m pithtrain train benchmarks/qwen3_width.py --nproc 2 --ep 2 --out /tmp/bench2 \
        --set data.path=/tmp/rand
tokens/s per step are in OUT/metrics.jsonl (divide by the number of GPUs for per-GPU figures).
"""

from pithtrain.config import DataConfig, OptimConfig, RunConfig, TrainConfig
from pithtrain.models.qwen3_moe import Qwen3MoeConfig

CONFIG = RunConfig(
    model=Qwen3MoeConfig(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                         num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                         num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, max_position_embeddings=40960),
    data=DataConfig(path="/tmp/rand", seq_len=4096),
    optim=OptimConfig(lr=1e-4, schedule="constant"),
    train=TrainConfig(steps=6, global_batch_size=4, micro_batch_size=1, lb_coef=1e-3, tensorboard=False,
                      checkpoint_every=-1),
)
