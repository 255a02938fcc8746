"""A tiny DeepSeek-V3 with multi-token prediction that trains on 2 CPU cores.

What V3 adds to V2: sigmoid routing scores with the aux-loss-free correction bias (noaux_tc),
group-limited top-k, and one multi-token prediction depth (its loss logged as `mtp_loss`,
weighted by train.mtp_coef). Turn MTP off with --set model.num_nextn_predict_layers=0.

Data: data/stdlib, which `make data` builds (the Python standard library's sources,
byte-level BPE of 4096 tokens, with held-out eval tokens; `make train` builds it too).
Run: pithtrain train examples/deepseek_v3_tiny.py --out runs/dsv3_tiny
"""

from pithtrain.config import DataConfig, OptimConfig, RunConfig, TrainConfig
from pithtrain.models.deepseek_v2 import DeepseekV3Config

CONFIG = RunConfig(
    model=DeepseekV3Config(
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
        n_group=2,
        topk_group=1,
        routed_scaling_factor=2.5,
        bias_update_speed=1e-3,
        rope_theta=10000.0,
        max_position_embeddings=1024,
        num_nextn_predict_layers=1,
        bos_token_id=None,
        eos_token_id=None,
    ),
    data=DataConfig(path="data/stdlib", seq_len=128, seed=1234),
    optim=OptimConfig(lr=3e-3, min_lr_ratio=0.1, schedule="cosine", warmup_steps=20, weight_decay=0.1, grad_clip=1.0),
    train=TrainConfig(steps=300, global_batch_size=16, micro_batch_size=8, lb_coef=0.0, mtp_coef=0.3, log_every=25,
                      checkpoint_every=100),
)
