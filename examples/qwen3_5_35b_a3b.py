"""Qwen3.5-35B-A3B's language model at its real architecture: 40 layers (every 4th full attention,
the rest Gated DeltaNet), 256 experts top-8 plus a shared expert, hidden 2048, as the released
config.json's text_config (`pithtrain convert` of the released checkpoint gives the same model).

Run on GPUs (the full model needs several; estimate-memory: 100.4 GiB per GPU on 16 H200s at pp2 x ep8, 157.3 at
ep8 alone, which does not fit):
    pithtrain train examples/qwen3_5_35b_a3b.py --out runs/qwen35 --set data.path=/data/my_corpus --nproc 16 --pp 2 --ep 8
"""

from pithtrain.config import DataConfig, OptimConfig, RunConfig, TrainConfig
from pithtrain.models.qwen3_5_moe import Qwen3_5MoeConfig

CONFIG = RunConfig(
    model=Qwen3_5MoeConfig(
        vocab_size=248320,
        hidden_size=2048,
        num_hidden_layers=40,
        layer_types=None,  # every 4th layer full attention, the rest linear
        full_attention_interval=4,
        num_attention_heads=16,
        num_key_value_heads=2,
        head_dim=256,
        partial_rotary_factor=0.25,
        rope_theta=10_000_000.0,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        num_experts=256,
        num_experts_per_tok=8,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
        rms_norm_eps=1e-6,
        max_position_embeddings=262144,
        tie_word_embeddings=False,
    ),
    data=DataConfig(path="data/corpus", seq_len=4096),
    optim=OptimConfig(lr=3e-4, min_lr_ratio=0.1, schedule="cosine", warmup_steps=2000, weight_decay=0.1, grad_clip=1.0),
    train=TrainConfig(steps=100_000, global_batch_size=512, micro_batch_size=1, lb_coef=1e-3, lb_type="global",
                      checkpoint_every=1000),
)
