"""GPU checks (skipped without CUDA): grouped GEMM on Hopper in bf16, and one training step on the
GPU against the CPU fp32 step."""

import pytest
import torch

from pithtrain.ops.grouped_gemm import _grouped_mm_applies, grouped_mm

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_grouped_mm_bf16_matches_loop_with_gradients():
    torch.manual_seed(0)
    counts = torch.tensor([0, 300, 17, 0, 1024, 5, 77, 1], device="cuda")
    x = torch.randn(int(counts.sum()), 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(8, 256, 384, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    assert _grouped_mm_applies(x, w)
    out = grouped_mm(x, w, counts)
    grad = torch.randn_like(out)
    gx, gw = torch.autograd.grad(out, (x, w), grad)
    xd, wd = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = torch.cat([c @ wd[e] for e, c in enumerate(xd.split(counts.tolist()))])
    rx, rw = torch.autograd.grad(ref, (xd, wd), grad.double())
    for a, b in ((out, ref), (gx, rx), (gw, rw)):
        assert ((a.double() - b).norm() / b.norm()).item() < 1e-2
    assert gw[0].abs().max() == 0 and gw[3].abs().max() == 0


def test_one_training_step_matches_cpu(tmp_path, dataset_dir):
    from conftest import tiny_config
    from pithtrain.train.loop import train

    cpu = train(tiny_config(dataset_dir, steps=3, device="cpu"), tmp_path / "cpu", echo=False)
    gpu = train(tiny_config(dataset_dir, steps=3, device="cuda", dtype="bf16"), tmp_path / "gpu", echo=False)
    fp32 = train(tiny_config(dataset_dir, steps=3, device="cuda", dtype="fp32"), tmp_path / "gpu32", echo=False)
    for a, b, c in zip(cpu, gpu, fp32):
        assert b["loss"] == pytest.approx(a["loss"], rel=2e-2)
        assert c["loss"] == pytest.approx(a["loss"], rel=1e-4)
        assert c["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-3)
    assert gpu[0]["peak_mem_bytes"] > 0


def test_embedding_rows_into_grad_match_nn_embedding_and_repeat():
    """grouped_gemm.Embedding on CUDA at a Qwen3-sized table under bf16 autocast: two micro-batches' gradients
    added into .grad by index_put_ (sorted) equal nn.Embedding's dense gradient to fp32 rounding, and bit for
    bit run to run."""
    from pithtrain.ops.grouped_gemm import Embedding

    torch.manual_seed(0)
    ids = [torch.randint(0, 151936, (4, 4096), device="cuda") for _ in range(2)]
    ids[1][:, ::2] = 7  # a token repeated 8192 times
    dys = [torch.randn(4, 4096, 2048, device="cuda") for _ in range(2)]

    def grad(module):
        module.weight.grad = None
        for i, dy in zip(ids, dys):
            with torch.autocast("cuda", torch.bfloat16):  # the training's case: an fp32 master, bf16 compute
                out = module(i)
            (out * dy).sum().backward()
        return module.weight.grad

    ours = Embedding(151936, 2048).cuda()
    plain = torch.nn.Embedding(151936, 2048).cuda()
    plain.weight.data.copy_(ours.weight.data)
    first, again, ref = grad(ours).clone(), grad(ours), grad(plain)
    with torch.autocast("cuda", torch.bfloat16):
        assert ours(ids[0]).grad_fn.name().startswith("_EmbeddingRows")
    assert ours(ids[0]).grad_fn.name() == "EmbeddingBackward0"  # outside autocast: nn.Embedding's path
    assert torch.equal(first, again)
    torch.testing.assert_close(first, ref, rtol=1e-5, atol=1e-3)


def test_weight_gradients_on_a_side_stream_equal_the_plain_ones():
    """grouped_gemm.WGRAD_STREAM: the experts' weight gradients issued on a second stream (joined before .grad is
    read, as the loop does) are the same kernels in the same order: over three micro-batches, with the activations
    freed and their blocks reused meanwhile (kept for the stream), every gradient equals the plain path's bit for
    bit where the plain path repeats itself run to run, and within twice its run-to-run difference elsewhere."""
    from pithtrain.models.qwen3_moe import Qwen3MoeConfig
    from pithtrain.ops import grouped_gemm
    from pithtrain.parallel.expert import ExpertEngine, LocalDispatch

    cfg = Qwen3MoeConfig(vocab_size=512, hidden_size=256, moe_intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=64, num_experts=16, num_experts_per_tok=4)
    model = cfg.build_model().cuda()
    model.init_weights(0)
    gen = torch.Generator().manual_seed(2)
    batches = [torch.randint(0, cfg.vocab_size, (2, 513), generator=gen).cuda() for _ in range(3)]
    pos = torch.arange(512, device="cuda").expand(2, 512)

    def grads(side_stream):
        grouped_gemm.WGRAD_STREAM = side_stream
        try:
            model.zero_grad(set_to_none=True)
            for ids in batches:
                with torch.autocast("cuda", torch.bfloat16):
                    logits = model(ids[:, :-1], pos, ExpertEngine(LocalDispatch()))
                torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten()).backward()
                torch.empty(64 << 20, device="cuda").fill_(1.0)  # reuse of freed blocks must wait for the stream
            grouped_gemm.join_weight_stream()
            return {n: p.grad.clone() for n, p in model.named_parameters()}
        finally:
            grouped_gemm.WGRAD_STREAM = False

    plain, again, side = grads(False), grads(False), grads(True)
    assert grouped_gemm._weight_streams  # the side stream was used
    assert all(not pending for _, pending in grouped_gemm._weight_streams.values())  # joined: nothing left to wait for
    lag, grouped_gemm.WGRAD_STREAM_LAG = grouped_gemm.WGRAD_STREAM_LAG, 0
    try:  # the main stream waiting after every pass: the same gradients
        assert all(torch.equal(g, side[n]) for n, g in grads(True).items())
    finally:
        grouped_gemm.WGRAD_STREAM_LAG = lag
    assert any(".experts." in n for n in plain)
    for name, g in plain.items():  # bit for bit where the plain path repeats itself (attention's backward may not)
        if torch.equal(g, again[name]):
            assert torch.equal(g, side[name]), name
        else:
            assert (side[name] - g).norm() <= 2 * (again[name] - g).norm() + 1e-6 * g.norm(), name
    assert torch.equal(plain["layers.1.mlp.experts.gate_up"], side["layers.1.mlp.experts.gate_up"])  # the last layer's
