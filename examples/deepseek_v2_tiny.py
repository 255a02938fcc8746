"""A tiny DeepSeek-V2 that trains on 2 CPU cores in well under a second per step.

Exercises what makes the family different from Qwen3-MoE: MLA with q-LoRA and a shared rope key,
shared experts next to the routed ones, and a dense first layer.

Data: data/stdlib, which `make data` builds (the Python standard library's sources,
byte-level BPE of 4096 tokens, with held-out eval tokens; `make train` builds it too).
Run: pithtrain train examples/deepseek_v2_tiny.py --out runs/dsv2_tiny
"""

from pithtrain.config import DataConfig, OptimConfig, RunConfig, TrainConfig
from pithtrain.models.deepseek_v2 import DeepseekV2Config

CONFIG = RunConfig(
    model=DeepseekV2Config(
        vocab_size=4096,
        hidden_size=128,
        intermediate_size=384,
        moe_intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        q_lora_rank=64,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        topk_method="greedy",
        norm_topk_prob=False,  # as DeepSeek-V2-Lite; transformers' deepseek_v2 does not read it
        rope_theta=10000.0,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    ),
    data=DataConfig(path="data/stdlib", seq_len=128, seed=1234),
    optim=OptimConfig(lr=3e-3, min_lr_ratio=0.1, schedule="cosine", warmup_steps=20, weight_decay=0.1, grad_clip=1.0),
    train=TrainConfig(steps=300, global_batch_size=16, micro_batch_size=8, lb_coef=1e-2, log_every=25, checkpoint_every=100),
)
