"""A tiny Qwen3-MoE that trains on 2 CPU cores in well under a second per step.

Data: data/stdlib, which `make data` builds (the Python standard library's sources,
byte-level BPE of 4096 tokens, with held-out eval tokens; `make train` builds it too).
Run: pithtrain train examples/qwen3_tiny.py --out runs/tiny
"""

from pithtrain.config import DataConfig, OptimConfig, RunConfig, TrainConfig
from pithtrain.models.qwen3_moe import Qwen3MoeConfig

CONFIG = RunConfig(
    model=Qwen3MoeConfig(
        vocab_size=4096,
        hidden_size=128,
        intermediate_size=384,
        moe_intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        mlp_only_layers=[0],
        rope_theta=10000.0,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    ),
    data=DataConfig(path="data/stdlib", seq_len=128, seed=1234),
    optim=OptimConfig(lr=3e-3, min_lr_ratio=0.1, schedule="cosine", warmup_steps=20, weight_decay=0.1, grad_clip=1.0),
    train=TrainConfig(steps=300, global_batch_size=16, micro_batch_size=8, lb_coef=1e-2, log_every=25, checkpoint_every=100),
)
