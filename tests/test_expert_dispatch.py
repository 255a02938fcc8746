"""All-to-all expert dispatch/combine against the one-rank permutation, on gloo processes, with
adversarial routings: every token on one expert, experts and whole ranks that receive nothing,
tokens whose k experts all live on one rank (deduplicated to one row), and no tokens at all."""

import pytest
import torch
import torch.distributed as dist

from dist_util import run_fn
from pithtrain.protocol import RoutingInfo
import pithtrain.parallel.expert as expert_module
from pithtrain.ops.kernels import unpermute_reference
from pithtrain.parallel.expert import AllToAllDispatch, LocalDispatch

pytestmark = pytest.mark.fast  # the fast tier (make test-fast)

E, K, H = 8, 3, 5


def routings(rank: int):
    gen = torch.Generator().manual_seed(100 + rank)
    t = 11 + rank  # ranks hold different numbers of tokens
    cases = {
        "random": torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(t)]),
        "all_on_expert_0": torch.tensor([[0, 1, 2]] * t),  # every token on rank 0's experts only
        "last_rank_only": torch.tensor([[E - 1, E - 2, E - 3]] * t),
        "no_tokens": torch.zeros(0, K, dtype=torch.long),
    }
    return {name: (ids, torch.randn(t if name != "no_tokens" else 0, H, generator=gen, dtype=torch.float64)) for name, ids in cases.items()}


def placed(combined, num_tokens):
    """Stage 4's rows at their (token, slot) places [T, K, H] (stage 5 weights them there)."""
    return unpermute_reference(combined.rows, combined.index, num_tokens * K).view(num_tokens, K, H)


def expert_fn(tokens, counts, offset):
    """A per-expert function of each row (expert e scales by e+1 and adds e): wrong grouping shows."""
    experts = torch.repeat_interleave(torch.arange(len(counts)), counts) + offset
    return tokens * (experts[:, None] + 1) + experts[:, None]


def check(rank, world):
    wire_rows = []  # rows each all-to-all sends: dispatch's first call shows the deduplication
    original = expert_module.all_to_all
    expert_module.all_to_all = lambda x, out_splits, in_splits, group, *name: wire_rows.append(x.shape[0]) or original(
        x, out_splits, in_splits, group, *name)
    dispatcher = AllToAllDispatch(dist.group.WORLD, E)
    local_experts = E // world
    for name, (ids, x) in routings(rank).items():
        wire_rows.clear()
        x = x.requires_grad_()
        routing = RoutingInfo(ids, torch.rand(len(ids), K, dtype=torch.float64), torch.rand(len(ids), E), E)
        tokens, counts, handle = dispatcher.dispatch(x, routing)
        assert counts.shape == (local_experts,) and int(counts.sum()) == tokens.shape[0], name
        out = placed(dispatcher.combine(expert_fn(tokens, counts, rank * local_experts), handle), len(ids))
        # the same computation on this rank alone, through the one-rank permutation
        x_ref = x.detach().clone().requires_grad_()
        t_ref, c_ref, h_ref = LocalDispatch().dispatch(x_ref, routing)
        ref = placed(LocalDispatch().combine(expert_fn(t_ref, c_ref, 0), h_ref), len(ids))
        assert torch.allclose(out, ref), name
        grad = torch.randn_like(ref)
        if ref.numel():
            (g,) = torch.autograd.grad(out, x, grad)
            (g_ref,) = torch.autograd.grad(ref, x_ref, grad)
            assert torch.allclose(g, g_ref), name
        else:  # still take part in the backward all-to-alls
            torch.autograd.grad(out.sum() + x.sum(), x)
        # deduplication: a token is sent once per destination rank, not once per chosen expert
        dest = ids // local_experts
        assert wire_rows[0] == sum(len(set(row.tolist())) for row in dest), name
        if name == "all_on_expert_0" and world == 2:  # its 3 experts share rank 0: one row each
            assert wire_rows[0] == len(ids)
    return len(routings(rank))


def test_all_to_all_dispatch_matches_local_permutation():
    for world in (2, 4):  # each rank asserts its comparisons and returns how many routings it checked
        assert run_fn(world, check) == [len(routings(0))] * world
