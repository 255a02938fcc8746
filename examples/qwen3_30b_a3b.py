"""Qwen3-30B-A3B at its real architecture (48 layers, 128 experts, top-8, hidden 2048).

Run on GPUs (the full model needs several; estimate-memory: 126.4 GiB per GPU on 16 H200s at ep8, 130.6 on 8 with
train.recompute=full, 160.6 on 8 without, which does not fit):
    pithtrain train examples/qwen3_30b_a3b.py --out runs/qwen3_30b --set data.path=/data/my_corpus --nproc 8 --ep 8 \
        --set train.recompute=full
"""

from pithtrain.config import DataConfig, OptimConfig, RunConfig, TrainConfig
from pithtrain.models.qwen3_moe import Qwen3MoeConfig

CONFIG = RunConfig(
    model=Qwen3MoeConfig(
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        rms_norm_eps=1e-6,
        rope_theta=1_000_000.0,
        max_position_embeddings=40960,
        tie_word_embeddings=False,
        bos_token_id=151643,
        eos_token_id=151645,
    ),
    data=DataConfig(path="data/corpus", seq_len=4096),
    optim=OptimConfig(lr=3e-4, min_lr_ratio=0.1, schedule="cosine", warmup_steps=2000, weight_decay=0.1, grad_clip=1.0),
    train=TrainConfig(steps=100_000, global_batch_size=512, micro_batch_size=1, lb_coef=1e-3, lb_type="global",
                      checkpoint_every=1000),
)
