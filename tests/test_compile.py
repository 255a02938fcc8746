"""torch.compile(fullgraph=True) of stages 1 and 5: same numbers as eager, no graph break (fullgraph
raises on one), no recompilation after the first step. The first test runs inductor; the others Dynamo and
AOT autograd alone (conftest's capture_only_compile), where the family-specific graphs are captured."""

import pytest
import torch

from conftest import tiny_config
from pithtrain.train.loop import train


def test_compiled_stages_match_eager_without_recompiling(tmp_path, dataset_dir, capsys):
    from torch._dynamo.utils import counters

    eager = train(tiny_config(dataset_dir, steps=3, lb_coef=0.1), tmp_path / "eager", echo=False)
    torch._dynamo.reset()
    counters.clear()
    compiled = train(tiny_config(dataset_dir, steps=1, lb_coef=0.1, compile=True), tmp_path / "compiled", echo=False)
    graphs_after_first_step = counters["stats"]["unique_graphs"]
    assert graphs_after_first_step > 0  # something was compiled
    capsys.readouterr()
    compiled += train(tiny_config(dataset_dir, steps=3, lb_coef=0.1, compile=True), tmp_path / "compiled", echo=True)
    assert "note: train.compile: the first step compiles" in capsys.readouterr().out  # a slow first step, said
    assert counters["stats"]["unique_graphs"] == graphs_after_first_step  # no recompilation
    assert not counters["graph_break"]
    for a, b in zip(eager, compiled):
        for key in ("loss", "lb_loss", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-4), key


@pytest.mark.parametrize("family", ["deepseek_v2", "gpt_oss"])
def test_other_families_compile_without_graph_breaks(tmp_path, dataset_dir, family, capture_only_compile):
    """MLA (DeepSeek-V2) and sink attention through SDPA (GPT-OSS) trace in one graph per stage."""
    from torch._dynamo.utils import counters

    from conftest import tiny_deepseek_config, tiny_gpt_oss_config

    make = tiny_deepseek_config if family == "deepseek_v2" else tiny_gpt_oss_config
    eager = train(make(dataset_dir, steps=2, lb_coef=0.1), tmp_path / "eager", echo=False)
    torch._dynamo.reset()
    counters.clear()
    compiled = train(make(dataset_dir, steps=2, lb_coef=0.1, compile=True), tmp_path / "compiled", echo=False)
    assert counters["stats"]["unique_graphs"] > 0 and not counters["graph_break"]
    for a, b in zip(eager, compiled):
        for key in ("loss", "lb_loss", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-4), key


def test_fp8_compiles_reads_the_cache_and_matches_eager(tmp_path, dataset_dir, capture_only_compile):
    """FP8 (emulated) under compile: one graph per stage, no recompilation across optimizer steps (the
    cached FP8 layouts are refreshed in place), and the eager FP8 numbers, which proves the compiled
    graph reads fresh layouts each step (a stale cache would drift from step 2 on)."""
    from torch._dynamo.utils import counters

    def cfg(**kw):
        c = tiny_config(dataset_dir, lb_coef=0.1, **kw)
        c.train.fp8, c.train.fp8_emulate = "rowwise", True
        return c

    eager = train(cfg(steps=4), tmp_path / "eager", echo=False)
    torch._dynamo.reset()
    counters.clear()
    compiled = train(cfg(steps=1, compile=True), tmp_path / "compiled", echo=False)
    graphs = counters["stats"]["unique_graphs"]
    compiled += train(cfg(steps=4, compile=True), tmp_path / "compiled", echo=False)
    assert graphs > 0 and counters["stats"]["unique_graphs"] == graphs and not counters["graph_break"]
    for a, b in zip(eager, compiled):
        for key in ("loss", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-3), key


def test_persistent_rows_choice(monkeypatch):
    """train/loop.PERSISTENT_ROWS: Inductor's choices (set for this thread by compile_stages on GPUs) make an inner
    reduction of a known width up to that a persistent kernel (5,120: stage 1's q, k, v gradients), and leave wider
    rows, other reductions and PERSISTENT_ROWS = 0 to Inductor's own rule (1,024 a row)."""
    import types

    import sympy
    from torch._inductor.runtime.hints import ReductionHint
    from torch._inductor.sizevars import SizeVarAllocator
    from torch._inductor.virtualized import V

    from pithtrain.train import loop

    def persistent(width, hint=ReductionHint.INNER, cooperative=False):
        features = types.SimpleNamespace(reduction_numel=sympy.Integer(width), numel=sympy.Integer(16384),
                                         get_reduction_hint=lambda: hint)
        return V.choices.should_use_persistent_reduction(features, cooperative)

    with V.set_graph_handler(types.SimpleNamespace(sizevars=SizeVarAllocator())):
        assert not persistent(5120)  # Inductor's own rule
        with loop._persistent_rows():
            assert persistent(5120) and persistent(8192) and persistent(512)
            assert not persistent(16384) and not persistent(5120, cooperative=True)
            assert not persistent(5120, ReductionHint.OUTER)
            monkeypatch.setattr(loop, "PERSISTENT_ROWS", 0)
            assert not persistent(5120) and persistent(1024)
        monkeypatch.setattr(loop, "PERSISTENT_ROWS", 8192)
        assert not persistent(5120)  # the previous choices back
