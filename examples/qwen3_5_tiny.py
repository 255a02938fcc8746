"""A tiny Qwen3.5-MoE (hybrid: Gated DeltaNet + gated full attention) that trains on 2 CPU cores.

Three linear-attention layers and one full-attention layer, 8 experts + a shared expert.
Data: data/stdlib, which `make data` builds (`make train` too; the Python standard library's sources,
byte-level BPE of 4096 tokens). Run: pithtrain train examples/qwen3_5_tiny.py --out runs/tiny35
"""

from pithtrain.config import DataConfig, OptimConfig, RunConfig, TrainConfig
from pithtrain.models.qwen3_5_moe import Qwen3_5MoeConfig

CONFIG = RunConfig(
    model=Qwen3_5MoeConfig(
        vocab_size=4096,
        hidden_size=128,
        num_hidden_layers=4,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        partial_rotary_factor=0.25,
        rope_theta=10000.0,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        linear_conv_kernel_dim=4,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=96,
        shared_expert_intermediate_size=96,
        max_position_embeddings=1024,
    ),
    data=DataConfig(path="data/stdlib", seq_len=128, seed=1234),
    optim=OptimConfig(lr=3e-3, min_lr_ratio=0.1, schedule="cosine", warmup_steps=20, weight_decay=0.1, grad_clip=1.0),
    train=TrainConfig(steps=300, global_batch_size=16, micro_batch_size=8, lb_coef=1e-2, log_every=25, checkpoint_every=100),
)
