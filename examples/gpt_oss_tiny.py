"""A tiny GPT-OSS that trains on 2 CPU cores in well under a second per step.

Every GPT-OSS feature is live: attention sinks, sliding-window layers (window 32 < seq_len 128)
alternating with full-attention layers, YaRN RoPE, a biased router, clamped-SwiGLU experts with biases.
Data: data/stdlib, which `make data` builds (the Python standard library's sources,
byte-level BPE of 4096 tokens, with held-out eval tokens; `make train` builds it too).
Run: pithtrain train examples/gpt_oss_tiny.py --out runs/gpt_oss_tiny
"""

from pithtrain.config import DataConfig, OptimConfig, RunConfig, TrainConfig
from pithtrain.models.gpt_oss import GptOssConfig

CONFIG = RunConfig(
    model=GptOssConfig(
        vocab_size=4096,
        hidden_size=128,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_local_experts=8,
        num_experts_per_tok=2,
        sliding_window=32,
        layer_types=None,  # sliding, full, sliding, full
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 256,
        },
        swiglu_limit=7.0,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    ),
    data=DataConfig(path="data/stdlib", seq_len=128, seed=1234),
    optim=OptimConfig(lr=3e-3, min_lr_ratio=0.1, schedule="cosine", warmup_steps=20, weight_decay=0.1, grad_clip=1.0),
    train=TrainConfig(steps=300, global_batch_size=16, micro_batch_size=8, lb_coef=1e-2, log_every=25, checkpoint_every=100),
)
