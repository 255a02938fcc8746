"""DeepSeek-V2-Lite at its real architecture (27 layers, hidden 2048, MLA with kv_lora_rank 512 and no
q-LoRA, 64 routed experts top-6 plus 2 shared, first layer dense, YaRN factor 40), as in its
published config.json.

Run on GPUs (about 16B parameters in all, 2.4B active per token; 8 H200s at ep8: 91.9 GiB per GPU estimated):
    pithtrain train examples/deepseek_v2_lite.py --out runs/dsv2_lite --set data.path=/data/my_corpus --nproc 8 --ep 8
To continue pretraining the released weights, point train.init_from at the HF directory.
"""

from pithtrain.config import DataConfig, OptimConfig, RunConfig, TrainConfig
from pithtrain.models.deepseek_v2 import DeepseekV2Config

CONFIG = RunConfig(
    model=DeepseekV2Config(
        vocab_size=102400,
        hidden_size=2048,
        intermediate_size=10944,
        moe_intermediate_size=1408,
        num_hidden_layers=27,
        num_attention_heads=16,
        num_key_value_heads=16,
        q_lora_rank=None,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        n_routed_experts=64,
        n_shared_experts=2,
        num_experts_per_tok=6,
        first_k_dense_replace=1,
        moe_layer_freq=1,
        topk_method="greedy",
        n_group=1,
        topk_group=1,
        scoring_func="softmax",
        norm_topk_prob=False,
        routed_scaling_factor=1.0,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        rope_scaling={
            "type": "yarn",
            "factor": 40,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 0.707,
            "mscale_all_dim": 0.707,
        },
        max_position_embeddings=163840,
        tie_word_embeddings=False,
        bos_token_id=100000,
        eos_token_id=100001,
    ),
    data=DataConfig(path="data/corpus", seq_len=4096),
    optim=OptimConfig(lr=3e-4, min_lr_ratio=0.1, schedule="cosine", warmup_steps=2000, weight_decay=0.1, grad_clip=1.0),
    train=TrainConfig(steps=100_000, global_batch_size=512, micro_batch_size=1, lb_coef=1e-3, lb_type="seq",
                      checkpoint_every=1000),
)
