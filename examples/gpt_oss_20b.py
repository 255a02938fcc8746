"""gpt-oss-20b at its real architecture (24 layers, 32 experts, top-4, hidden 2880, sinks, alternating
128-token sliding-window and full attention, YaRN x32 over a 4096-token original context).

Continued pretraining from the released weights (the hub's MXFP4 experts are dequantized on import):
    pithtrain train examples/gpt_oss_20b.py --out runs/gpt_oss_20b --nproc 8 --ep 8 \
        --set data.path=/data/my_corpus --set train.init_from=/models/gpt-oss-20b
Drop `train.init_from` to pretrain from scratch. The full model needs several GPUs (8 H200s at ep8: 106.2 GiB per
GPU estimated by estimate-memory).
"""

from pithtrain.config import DataConfig, OptimConfig, RunConfig, TrainConfig
from pithtrain.models.gpt_oss import GptOssConfig

CONFIG = RunConfig(
    model=GptOssConfig(
        vocab_size=201088,
        hidden_size=2880,
        intermediate_size=2880,
        num_hidden_layers=24,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=64,
        num_local_experts=32,
        num_experts_per_tok=4,
        sliding_window=128,
        layer_types=["sliding_attention", "full_attention"] * 12,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
        },
        swiglu_alpha=1.702,
        swiglu_limit=7.0,
        rms_norm_eps=1e-5,
        max_position_embeddings=131072,
        attention_bias=True,
        tie_word_embeddings=False,
        eos_token_id=200002,
        pad_token_id=199999,
    ),
    data=DataConfig(path="data/corpus", seq_len=4096),
    optim=OptimConfig(lr=3e-5, min_lr_ratio=0.1, schedule="cosine", warmup_steps=200, weight_decay=0.1, grad_clip=1.0),
    train=TrainConfig(steps=10_000, global_batch_size=256, micro_batch_size=1, lb_coef=1e-3, lb_type="global",
                      checkpoint_every=500),
)
