"""Mixture-of-experts block: routers against reference formulas, grouped compute, capacity, auxiliary losses."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from keel.config import ModelConfig
from keel.model.grouped import grouped_matmul, segmented_matmul, use_grouped_mm
from keel.model.moe import (
    MoE,
    Router,
    _within_capacity,
    counts_by_comparison,
    expert_counts,
    update_routing_bias,
)


def moe_config(**overrides) -> ModelConfig:
    fields = dict(
        architecture="qwen3_moe",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=24,
    )
    fields.update(overrides)
    return ModelConfig(**fields)


def deepseek_reference(x, weight, bias, top_k, n_group, topk_group, renorm, scaling):
    """transformers' DeepseekV3TopkRouter.forward, step by step."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    cfg = DeepseekV3Config(
        hidden_size=x.shape[1],
        n_routed_experts=weight.shape[0],
        num_experts_per_tok=top_k,
        n_group=n_group,
        topk_group=topk_group,
        norm_topk_prob=renorm,
        routed_scaling_factor=scaling,
    )
    ref = DeepseekV3TopkRouter(cfg)
    with torch.no_grad():
        ref.weight.copy_(weight)
        ref.e_score_correction_bias.copy_(bias)
    return ref(x)


@pytest.mark.parametrize(
    "n_group,topk_group,renorm,scaling", [(1, 1, True, 1.0), (4, 2, True, 2.5), (4, 1, False, 1.0)]
)
def test_sigmoid_group_limited_router_matches_deepseek_v3(n_group, topk_group, renorm, scaling):
    cfg = moe_config(
        router_scoring="sigmoid",
        router_bias=True,
        n_group=n_group,
        topk_group=topk_group,
        norm_topk_prob=renorm,
        routed_scaling_factor=scaling,
        num_experts_per_tok=2,
    )
    router = Router(cfg)
    torch.manual_seed(0)
    with torch.no_grad():
        router.weight.normal_()
        router.e_score_correction_bias.normal_(std=0.3)
    x = torch.randn(50, 32)
    got = router(x)
    logits, weights, ids = deepseek_reference(
        x, router.weight, router.e_score_correction_bias, 2, n_group, topk_group, renorm, scaling
    )
    torch.testing.assert_close(got.logits, logits)
    # Same experts (as sets: top-k order is not part of the contract) and the same weights per expert.
    mine = torch.zeros(50, 8).scatter_(1, got.ids, got.weights)
    theirs = torch.zeros(50, 8).scatter_(1, ids, weights)
    torch.testing.assert_close(mine, theirs)
    if n_group > 1:  # every token's experts lie in at most topk_group groups
        groups = got.ids // (8 // n_group)
        assert all(len(set(row.tolist())) <= topk_group for row in groups)


def test_the_bias_steers_selection_but_not_the_weights():
    cfg = moe_config(router_scoring="sigmoid", router_bias=True, norm_topk_prob=False, num_experts_per_tok=1)
    router = Router(cfg)
    with torch.no_grad():
        router.weight.normal_()
    x = torch.randn(20, 32)
    before = router(x)
    with torch.no_grad():
        router.e_score_correction_bias[3] = 10.0  # expert 3 wins every selection
    after = router(x)
    assert torch.all(after.ids == 3)
    torch.testing.assert_close(after.weights[:, 0], torch.sigmoid(before.logits[:, 3]))  # unbiased score


@pytest.mark.parametrize("renorm", [True, False])
def test_softmax_router_matches_the_mixtral_formula(renorm):
    router = Router(moe_config(norm_topk_prob=renorm))
    with torch.no_grad():
        router.weight.normal_()
    x = torch.randn(30, 32)
    got = router(x)
    probs = torch.softmax(x @ router.weight.T, dim=-1)
    weights, ids = torch.topk(probs, 2, dim=-1)
    if renorm:
        weights = weights / weights.sum(-1, keepdim=True)
    torch.testing.assert_close(got.ids, ids)
    torch.testing.assert_close(got.weights, weights)


@pytest.mark.parametrize("eps,dtype", [(0.01, torch.float32), (0.3, torch.float32), (0.1, torch.bfloat16)])
def test_sparsemixer_router_matches_phimoe_in_eval(eps, dtype):
    """transformers' PhimoeTopKRouter in eval mode: the same two experts and weights (in the model's dtype), over
    logits spread so that each round's softmax keeps one expert for some tokens and several for others."""
    from transformers import PhimoeConfig
    from transformers.models.phimoe.modeling_phimoe import PhimoeTopKRouter

    router = Router(moe_config(router_scoring="sparsemixer", router_jitter_eps=eps)).to(dtype)
    ref = PhimoeTopKRouter(PhimoeConfig(hidden_size=32, num_local_experts=8, router_jitter_noise=eps)).eval()
    torch.manual_seed(0)
    with torch.no_grad():
        router.weight.normal_(std=0.3)
        ref.to(dtype).weight.copy_(router.weight)
    x = torch.randn(200, 32, dtype=dtype)
    got = router(x)
    logits, weights, ids = ref(x)
    torch.testing.assert_close(got.ids, ids)
    torch.testing.assert_close(got.weights, weights.float(), rtol=0, atol=0)
    assert (got.weights == 1).any() and (got.weights < 0.9).any()  # lone experts and shared softmaxes both occur


def test_grouped_matmul_equals_per_expert_matmuls_with_gradients():
    torch.manual_seed(0)
    counts = torch.tensor([3, 0, 5, 1])  # an empty expert included
    offsets = counts.cumsum(0).to(torch.int32)
    x = torch.randn(9, 8, requires_grad=True)
    w = torch.randn(4, 8, 12, requires_grad=True)
    assert use_grouped_mm(x, w)  # the one-call kernel, not the fallback loop
    assert not use_grouped_mm(x[:, :5], w[:, :5])  # rows not 16-byte aligned: the loop
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    out, ref = grouped_matmul(x, w, offsets), segmented_matmul(x2, w2, offsets)
    torch.testing.assert_close(out, ref)
    out.sum().backward()  # a zero-stride gradient: the hook makes it dense for _grouped_mm's backward
    ref.sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)
    torch.testing.assert_close(w.grad, w2.grad)
    assert torch.all(w.grad[1] == 0)


def test_expert_counts_without_a_host_sync_equal_bincount():
    """The comparison count (what CUDA runs, so that no MoE layer reads back to the host) equals bincount,
    with experts no row chose."""
    ids = torch.tensor([3, 0, 3, 7, 3, 0, 5], dtype=torch.int64)
    want = torch.bincount(ids, minlength=9)
    assert torch.equal(counts_by_comparison(ids, 9), want) and torch.equal(expert_counts(ids, 9), want)
    assert counts_by_comparison(torch.empty(0, dtype=torch.int64), 4).tolist() == [0, 0, 0, 0]


def test_moe_block_equals_a_per_token_loop():
    """The definition: each token's output is the weighted sum of its k experts' SwiGLU outputs."""
    torch.manual_seed(0)
    moe = MoE(moe_config(shared_expert_intermediate_size=16, shared_expert_gated=False))
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.2)
    x = torch.randn(2, 7, 32)
    out = moe(x)
    flat = x.reshape(-1, 32)
    routing = moe.router(flat)
    e = moe.experts
    want = []
    for t in range(flat.shape[0]):
        acc = moe.shared_expert(flat[t])
        for j in range(2):
            k = routing.ids[t, j]
            gate, up = (e.gate_up_proj[k] @ flat[t]).chunk(2)
            acc = acc + routing.weights[t, j] * (e.down_proj[k] @ (F.silu(gate) * up))
        want.append(acc)
    torch.testing.assert_close(out.reshape(-1, 32), torch.stack(want), rtol=1e-5, atol=1e-5)


def test_capacity_drops_overflow_in_token_order():
    ids = torch.tensor([0, 1, 0, 0, 2, 0, 1])  # expert 0 gets slots 0, 2, 3, 5
    counts = torch.bincount(ids, minlength=3)
    kept = _within_capacity(ids, counts, limit=2)
    assert kept.tolist() == [True, True, True, False, True, False, True]


def test_capacity_factor_in_the_block_counts_drops_by_the_policy():
    torch.manual_seed(0)
    moe = MoE(moe_config(num_experts=4, num_experts_per_tok=1))
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.2)
    with torch.no_grad():
        moe.router.weight[0] += 3.0 * torch.randn(32).sign()  # a skewed router
    moe.train()
    moe.capacity_factor = 1.0
    moe.track_stats = True
    x = torch.randn(64, 32)
    out = moe(x)
    limit = math.ceil(1.0 * 64 * 1 / 4)
    assert moe.capacity(64) == limit
    routed = moe.routed
    expected_dropped = sum(max(0, int(c) - limit) for c in routed)
    assert moe.dropped.item() == expected_dropped > 0
    # A dropped token (its only expert is full) gets zero from the routed experts.
    ids = moe.router(x).ids[:, 0]
    rank = torch.zeros(64, dtype=torch.long)
    seen = {}
    for t, e in enumerate(ids.tolist()):
        rank[t] = seen.get(e, 0)
        seen[e] = rank[t] + 1
    dropped = rank >= limit
    assert torch.all(out[dropped] == 0) and torch.all(out[~dropped].abs().sum(-1) > 0)
    moe.eval()  # serving is dropless
    assert moe.capacity(64) is None


def test_auxiliary_losses_have_their_formulas_and_their_gradient():
    torch.manual_seed(0)
    moe = MoE(moe_config())
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.2)
    moe.train()
    x = torch.randn(40, 32)
    base = {n: torch.autograd.grad(moe(x).pow(2).sum(), p)[0] for n, p in [("router", moe.router.weight)]}
    moe.aux_loss_coef, moe.z_loss_coef, moe.aux_grad_scale = 0.1, 0.01, 0.5
    out = moe(x)
    routing = moe.router(x)
    f = torch.bincount(routing.ids.reshape(-1), minlength=8).float() / (40 * 2)
    balance = 8 * (f * torch.softmax(routing.logits, -1).mean(0)).sum()
    z = torch.logsumexp(routing.logits, -1).pow(2).mean()
    torch.testing.assert_close(moe.aux_losses["load_balance"], balance.detach())
    torch.testing.assert_close(moe.aux_losses["router_z"], z.detach())
    # The injected gradient is that of main + aux_grad_scale * (coefs * losses).
    got = torch.autograd.grad(out.pow(2).sum(), moe.router.weight)[0]
    aux_grad = torch.autograd.grad(0.5 * (0.1 * balance + 0.01 * z), moe.router.weight)[0]
    # atol relative to the gradient's scale: an element that is a difference of large float32 terms
    # keeps only their rounding, which differs between ATen's AVX2 and AVX-512 reductions.
    expected = base["router"] + aux_grad
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5 * expected.abs().max().item())


def test_uniform_routing_has_load_balance_one():
    moe = MoE(moe_config(num_experts=4, num_experts_per_tok=1))
    torch.nn.init.zeros_(moe.router.weight)  # every expert equally likely ...
    for p in moe.experts.parameters():
        torch.nn.init.normal_(p, std=0.1)
    moe.train()
    moe.aux_loss_coef = 1.0
    x = torch.randn(8, 32)
    moe(x)
    # ... but top-1 of ties picks expert 0 for all: f = (1, 0, 0, 0), P = 1/4 each -> 4 * 1/4 = 1.
    assert moe.aux_losses["load_balance"].item() == pytest.approx(1.0)


def test_bias_update_moves_load_toward_balance():
    """Aux-loss-free balancing on a skewed synthetic router: max/mean load falls as the bias moves."""
    torch.manual_seed(0)
    cfg = moe_config(router_scoring="sigmoid", router_bias=True, num_experts=8, num_experts_per_tok=2)
    router = Router(cfg)
    with torch.no_grad():
        router.weight.normal_(std=0.1)
        router.weight[0] += 0.3  # experts 0 and 1 attract every token
        router.weight[1] += 0.15
    x = torch.randn(512, 32).abs()  # positive features: the shifted rows dominate

    def imbalance() -> float:
        load = torch.bincount(router(x).ids.reshape(-1), minlength=8).float()
        return (load.max() / load.mean()).item()

    start = imbalance()
    for _ in range(300):
        load = torch.bincount(router(x).ids.reshape(-1), minlength=8).float()
        update_routing_bias(router, load, rate=0.01)
    end = imbalance()
    assert start == 4.0 and end < 1.4, (start, end)  # 4.0: all slots on 2 of 8 experts
    bias = router.e_score_correction_bias
    assert bias[0] < 0 and bias[1] < 0 and bool(torch.all(bias[2:] > 0))  # favourites down, the rest up
