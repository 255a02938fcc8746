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
    bit run to run. Its rows leave in bf16 (core.ACTIVATIONS_IN_COMPUTE_DTYPE), so the gradient reaching them is
    dy rounded to bf16: nn.Embedding (fp32 rows) gets that rounded dy as the reference."""
    from pithtrain.ops.grouped_gemm import Embedding

    torch.manual_seed(0)
    ids = [torch.randint(0, 151936, (4, 4096), device="cuda") for _ in range(2)]
    ids[1][:, ::2] = 7  # a token repeated 8192 times
    dys = [torch.randn(4, 4096, 2048, device="cuda") for _ in range(2)]

    def grad(module, dys):
        module.weight.grad = None
        for i, dy in zip(ids, dys):
            with torch.autocast("cuda", torch.bfloat16):  # the training's case: an fp32 master, bf16 compute
                out = module(i)
            (out * dy).sum().backward()
        return module.weight.grad

    ours = Embedding(151936, 2048).cuda()
    plain = torch.nn.Embedding(151936, 2048).cuda()
    plain.weight.data.copy_(ours.weight.data)
    first, again, ref = grad(ours, dys).clone(), grad(ours, dys), grad(plain, [dy.bfloat16().float() for dy in dys])
    with torch.autocast("cuda", torch.bfloat16):
        assert ours(ids[0]).grad_fn.name().startswith("_EmbeddingRows")
    assert ours(ids[0]).grad_fn.name() == "EmbeddingBackward0"  # outside autocast: nn.Embedding's path
    assert torch.equal(first, again)
    torch.testing.assert_close(first, ref, rtol=1e-5, atol=1e-3)
