"""Model families. `config_from_hf` is the one place that maps an HF `model_type` to a model file;
`families()` lists their config classes (`pithtrain train --help`). They sit here, above the family
files, because config.py is below them (the families import its errors and checks)."""

from __future__ import annotations


def families() -> tuple[type, ...]:
    """The config class of every model family, in the order `train --help` lists them."""
    from pithtrain.models.deepseek_v2 import DeepseekV2Config, DeepseekV3Config
    from pithtrain.models.gpt_oss import GptOssConfig
    from pithtrain.models.qwen3_5_moe import Qwen3_5MoeConfig
    from pithtrain.models.qwen3_moe import Qwen3MoeConfig

    return (Qwen3MoeConfig, DeepseekV2Config, DeepseekV3Config, GptOssConfig, Qwen3_5MoeConfig)


def config_from_hf(hf: dict):
    """The family config for an HF `config.json` dict: one branch a family."""
    from pithtrain.config import ConfigError

    if not isinstance(hf, dict):  # a list, or a path not yet read: .get below would end in an AttributeError
        raise ConfigError("config_from_hf: expected the dict of an HF config.json (json.loads of its text; "
                          f"checkpoint.model_config(DIR) reads a directory's), got {type(hf).__name__}")
    Qwen3MoeConfig, DeepseekV2Config, DeepseekV3Config, GptOssConfig, Qwen3_5MoeConfig = families()
    model_type = hf.get("model_type")
    text = hf.get("text_config") if isinstance(hf.get("text_config"), dict) else {}
    dropout = hf.get("attention_dropout") or text.get("attention_dropout")
    for d in (hf, text):  # transformers 5 reads rope_scaling over rope_parameters; the families read rope_parameters
        if d.get("rope_scaling") and d.get("rope_parameters") and d["rope_scaling"] != d["rope_parameters"]:
            raise ValueError(f"model.rope_scaling={d['rope_scaling']} and model.rope_parameters={d['rope_parameters']} "
                             "differ (transformers uses rope_scaling); keep one of them in config.json")
    # GPT-OSS's MXFP4 experts are dequantized as they load; no other's are
    if (quant := hf.get("quantization_config") or text.get("quantization_config")) and model_type != "gpt_oss":
        raise ConfigError(f"{model_type}: quantization_config {quant.get('quant_method') if isinstance(quant, dict) else quant!r}"
                          ": quantized checkpoints are not read; dequantize to bf16 first and drop quantization_config")
    if dropout:  # transformers drops attention weights in training; PithTrain has no dropout
        raise ValueError(f"model.attention_dropout={dropout!r} is not supported by PithTrain's {model_type} (no attention "
                         "dropout: training would differ from transformers'); set it to 0.0 in config.json")
    if model_type == "qwen3_moe":
        return Qwen3MoeConfig.from_hf(hf)
    if model_type == "deepseek_v2":
        return DeepseekV2Config.from_hf(hf)
    if model_type in ("deepseek_v3", "kimi_k2", "kimi_k25"):  # kimi_k25: its text_config
        return DeepseekV3Config.from_hf(hf)
    if model_type == "gpt_oss":
        return GptOssConfig.from_hf(hf)
    if model_type in ("qwen3_5_moe_text", "qwen3_5_moe"):
        return Qwen3_5MoeConfig.from_hf(hf)
    raise ValueError(f"model_type {model_type!r} is not supported; supported: qwen3_moe, deepseek_v2, deepseek_v3, "
                     "kimi_k2, kimi_k25, gpt_oss, qwen3_5_moe_text, qwen3_5_moe")
