"""Config validation and `--set` overrides: each bad input names the field and the fix."""

import random
import re

import pytest

from conftest import tiny_config
from pithtrain.cli import main
from pithtrain.config import ConfigError, apply_override, load_run_config, validate

pytestmark = pytest.mark.fast  # the fast tier (make test-fast)


def test_overrides_are_type_checked(tmp_path):
    cfg = tiny_config(tmp_path)
    apply_override(cfg, "train.steps=17")
    apply_override(cfg, "optim.lr=0.01")
    apply_override(cfg, "data.pack_documents=true")
    apply_override(cfg, "model.mlp_only_layers=[0,1]")
    apply_override(cfg, "model.head_dim=none")
    assert (cfg.train.steps, cfg.optim.lr, cfg.data.pack_documents) == (17, 0.01, True)
    assert cfg.model.mlp_only_layers == [0, 1] and cfg.model.head_dim is None
    with pytest.raises(ConfigError, match="expected int"):
        apply_override(cfg, "train.steps=ten")
    with pytest.raises(ConfigError, match="expected a bool"):
        apply_override(cfg, "data.pack_documents=maybe")
    with pytest.raises(ConfigError, match=r"expected a JSON list such as \[0,3\]"):
        apply_override(cfg, "model.mlp_only_layers=0")
    with pytest.raises(ConfigError, match=r"expected a JSON list such as \[\"a\",\"b\"\] \(double-quoted strings\)"):
        apply_override(cfg, "optim.muon_exclude=embed*")
    with pytest.raises(ConfigError, match=r"neither valid JSON \(a blend.* nor an existing directory"):
        apply_override(cfg, 'data.path={"/data/a": 1')
    with pytest.raises(ConfigError, match="unknown field 'stpes'.*steps"):
        apply_override(cfg, "train.stpes=3")
    with pytest.raises(ConfigError, match="unknown field 'trian'"):
        apply_override(cfg, "trian.steps=3")
    with pytest.raises(ConfigError, match="section.field=value"):
        apply_override(cfg, "train.steps")
    field = random.choice(["data.path", "data.eval_path", "train.init_from"])  # a pathlib.Path set from Python
    section, name = field.split(".")
    setattr(getattr(cfg, section), name, tmp_path / "x")
    with pytest.raises(ConfigError, match=re.escape(f"{field}=PosixPath('{tmp_path / 'x'}') (PosixPath): expected ")
                       + ".*; write it as a string, " + re.escape(repr(str(tmp_path / "x"))) + "$"):
        validate(cfg)


@pytest.mark.parametrize(
    "override, world, message",
    [
        ("model.num_key_value_heads=3", 1, "num_attention_heads=4 is not divisible by model.num_key_value_heads=3"),
        ("train.global_batch_size=6", 1, "global_batch_size=6 is not divisible by train.micro_batch_size"),
        ("train.global_batch_size=12", 2, r"data-parallel ranks \(2"),
        ("data.seq_len=512", 1, "longer than the model supports.*max_position_embeddings=128"),
        ("data.seq_len=0", 1, r"^data.seq_len=0: must be at least 2$"),  # before the checks that divide by it
        ("train.lb_type=tokens", 1, "train.lb_type='tokens'"),
        ("optim.schedule=linear", 1, "optim.schedule='linear'"),
        ("parallel.ep=3", 3, "parallel.ep=3 does not divide the 4 experts"),
        ("parallel.pp=2", 3, "does not divide the 3 processes"),
        ("model.num_experts_per_tok=5", 1, "num_experts_per_tok=5"),
        ("train.init_from=/nonexistent/ckpt", 1, "train.init_from"),
    ],
)
def test_invalid_configs_are_refused(tmp_path, override, world, message):
    cfg = tiny_config(tmp_path)
    validate(cfg, 1)
    apply_override(cfg, override)
    with pytest.raises(ConfigError, match=message):
        validate(cfg, world)


def test_pipeline_error_names_a_batch_that_fits(tmp_path):
    """DualPipeV needs 2*pp micro-batches per data rank: the error names a micro-batch size (or, when even 1 is too
    large, a global batch) with which the same mesh validates."""
    for batch, micro, world, ep in ((8, 4, 2, 1), (16, 8, 4, 2), (24, 8, 2, 1), (2, 1, 2, 1)):
        cfg = tiny_config(tmp_path, global_batch_size=batch, micro_batch_size=micro)
        cfg.parallel.pp, cfg.parallel.ep = 2, ep
        with pytest.raises(ConfigError, match="needs at least 2\\*pp = 4 micro-batches") as refused:
            validate(cfg, world)
        apply_override(cfg, re.search(r"train\.\w+=\d+", str(refused.value)).group())
        validate(cfg, world)


def test_run_file_and_cli_errors(tmp_path, capsys):
    bad = tmp_path / "bad.py"
    bad.write_text("X = 1\n")
    with pytest.raises(ConfigError, match=r"must define CONFIG = RunConfig\(...\) \(it defines none: a script\? run it with python"):
        load_run_config(bad)  # a script such as examples/quickstart.py: said, and its main() not run
    bad.write_text("CONFIG = 1\n")
    with pytest.raises(ConfigError, match=r"must define CONFIG = RunConfig\(...\) \(found int\)"):
        load_run_config(bad)
    name = f"base_{random.randrange(10**6)}"  # a module beside the run file: named with the line that imports it
    (tmp_path / f"{name}.py").write_text("CONFIG = None\n")
    bad.write_text(f"from {name} import CONFIG\n")
    with pytest.raises(ConfigError, match=rf"bad.py:1: ModuleNotFoundError: .*; {name}.py beside it is not on sys.path: put "
                       r"`import os, sys; sys.path.insert\(0, os.path.dirname\(__file__\)\)` before that import$"):
        load_run_config(bad)
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "examples/qwen3_tiny.py", "--set", "train.micro_batch_size=3"])
    assert exit_info.value.code == 2
    assert "train.global_batch_size=16 is not divisible by train.micro_batch_size (3)" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["train", str(tmp_path / "missing.py")])
    assert exit_info.value.code == 2


def test_example_configs_validate():
    expected = {"examples/qwen3_tiny.py": "qwen3_moe", "examples/qwen3_30b_a3b.py": "qwen3_moe",
                "examples/deepseek_v2_tiny.py": "deepseek_v2", "examples/deepseek_v2_lite.py": "deepseek_v2",
                "examples/moonlight_16b_a3b.py": "deepseek_v3", "examples/deepseek_v3_671b.py": "deepseek_v3",
                "examples/gpt_oss_tiny.py": "gpt_oss", "examples/gpt_oss_20b.py": "gpt_oss"}
    for path, model_type in expected.items():
        config = load_run_config(path)
        validate(config, 1)  # raises ConfigError naming the field on any problem
        assert config.model.model_type == model_type, path
        if "tiny" in path:  # a model built from a config edited after validation: its field named, not torch's error
            k = config.model.num_routed_experts() + random.randint(1, 3)
            config.model.num_experts_per_tok = k
            with pytest.raises(ConfigError, match=f"model.num_experts_per_tok={k} must be in"):
                config.model.build_model()


def test_moe_options_on_a_model_without_moe_layers_are_warned_about():
    """train.lb_coef, train.lb_type and train.recompute=selective act on MoE layers only: a model whose layers
    are all dense (no experts, or every layer in mlp_only_layers) gets one warning for each; a model with an
    MoE layer none (a DeepSeek-V3 whose only MoE layer is its multi-token prediction layer)."""
    import dataclasses

    from conftest import tiny_deepseek_v3_config
    from pithtrain.config import ignored_options

    config = tiny_config("data")  # lb_coef=0.01, away from its default
    config.train.lb_type, config.train.recompute = "seq", "selective"
    assert ignored_options(config) == []
    said = ["warning: train.lb_coef has no effect: the model has no MoE layer (no router to balance)",
            "warning: train.lb_type has no effect: the model has no MoE layer (no router to balance)",
            "warning: train.recompute=selective recomputes the experts' activations, and the model has no MoE layer "
            "(train.recompute=full recomputes every layer)"]
    for fields in ({"num_experts": 0}, {"mlp_only_layers": [0, 1]}, {"decoder_sparse_step": 3}):
        dense = dataclasses.replace(config, model=dataclasses.replace(config.model, **fields))
        validate(dense)
        assert ignored_options(dense) == said, fields  # was: none
    dense.train.lb_coef, dense.train.recompute = 0.0, "full"  # the load-balance loss off: that is said instead
    assert ignored_options(dense) == ["warning: train.lb_type has no effect with train.lb_coef=0 (no load-balance loss)"]
    mtp = tiny_deepseek_v3_config("data", lb_type="seq", recompute="selective")
    mtp.model.first_k_dense_replace = mtp.model.num_hidden_layers
    validate(mtp)
    assert ignored_options(mtp) == []
    mtp.model.bias_update_speed = 0.01  # it moves noaux_tc's correction bias; V2's other routings have none
    assert ignored_options(mtp) == []
    from pithtrain.models.deepseek_v2 import DeepseekV2Config
    v2 = dataclasses.replace(mtp, model=DeepseekV2Config(topk_method="group_limited_greedy", bias_update_speed=0.01))
    assert ignored_options(v2) == ["warning: model.bias_update_speed moves noaux_tc's routing correction bias; "
                                   "topk_method='group_limited_greedy' has none"]
