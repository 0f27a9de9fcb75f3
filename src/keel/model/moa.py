"""Mixture of attention heads (MoA: JetMoE's `JetMoeMoA`).

A router (the MoE's: keel.model.moe.Router) picks each token's top-k attention experts. Each expert has its own
query projection [H -> kv_heads x D] and output projection [kv_heads x D -> H]; keys and values are one projection
shared by every expert. Query head h of the token's j-th chosen expert attends over shared KV head h.

Why this is grouped-query attention: order the k x kv_heads query heads kv-head-major (head h * k + j), and each
group of k consecutive query heads reads one KV head, as GQA's `repeat_interleave` does. So the cache keeps the
shared kv_heads only, and every backend (SDPA, the paged caches) runs MoA unchanged (transformers repeats the keys
expert-major instead: the same pairs). The outputs go back through each chosen expert's output projection, weighted
by the router, summed, plus one bias.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from keel.config import ModelConfig
from keel.model.attention import Attention, AttentionMetadata
from keel.model.grouped import grouped_matmul
from keel.model.layers import apply_partial_rotary
from keel.model.moe import Router, group_by_expert


class MixtureOfAttention(Attention):
    """Attention whose q_proj and o_proj are top-k of `num_experts` experts per token (ModelConfig
    .mixture_of_attention): `q_experts` [E, kv_heads x D, H], `o_experts` [E, H, kv_heads x D], `router`, and
    `output_bias` [H] where o_bias is set; k_proj and v_proj as Attention's."""

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__(config, layer)
        h, width = config.hidden_size, config.kv_size
        self.num_experts, self.top_k = config.num_experts, config.num_experts_per_tok
        # Attention's dense q_proj and o_proj are the experts' here (None: fuse_projections leaves the layer be)
        self.q_proj = None
        self.o_proj = None
        self.router = Router(config)
        self.q_experts = nn.Parameter(torch.empty(config.num_experts, width, h))
        self.o_experts = nn.Parameter(torch.empty(config.num_experts, h, width))
        self.output_bias = nn.Parameter(torch.empty(h)) if config.o_bias else None

    def forward(self, x: Tensor, meta: AttentionMetadata) -> Tensor:
        b, s, h = x.shape
        flat = x.reshape(-1, h)
        routing = self.router(flat)
        expert_ids = routing.ids.reshape(-1)  # [T * k], token-major: slot j of token t at t * k + j
        slot_tokens = torch.arange(flat.shape[0], device=x.device).repeat_interleave(self.top_k)
        order, offsets = group_by_expert(expert_ids, self.num_experts)
        rows = flat.index_select(0, slot_tokens.index_select(0, order))  # each slot's token, sorted by expert
        queries = self._by_slot(rows, self.q_experts, order, offsets)
        q = queries.view(b, s, self.top_k * self.num_kv_heads, self.head_dim)  # slot-major heads: j * kv_heads + h
        k = self.k_proj(x).view(b, s, -1, self.head_dim)
        v = self.v_proj(x).view(b, s, -1, self.head_dim)
        if self.rotates:
            cos, sin = meta.sliding_rope if self.sliding_rope else meta.rope
            q, k = apply_partial_rotary(q, cos, sin), apply_partial_rotary(k, cos, sin)
        # kv-head-major (h * k + j): GQA's grouping of k query heads per KV head
        q = q.view(b, s, self.top_k, self.num_kv_heads, self.head_dim).transpose(2, 3).flatten(2, 3)
        out = self._attend(q, k, v, meta).view(b, s, self.num_kv_heads, self.top_k, self.head_dim)
        out = out.transpose(2, 3).reshape(-1, self.num_kv_heads * self.head_dim)  # [T * k], slot order again
        outputs = self._by_slot(out.index_select(0, order), self.o_experts, order, offsets)
        weighted = (outputs * routing.weights.reshape(-1, 1)).to(x.dtype)
        merged = torch.zeros_like(flat).index_add_(0, slot_tokens, weighted)
        if self.output_bias is not None:
            merged = merged + self.output_bias
        return merged.view(b, s, h)

    @staticmethod
    def _by_slot(rows: Tensor, weight: Tensor, order: Tensor, offsets: Tensor) -> Tensor:
        """`rows` sorted by expert times each one's expert `weight` [E, out, in], returned in slot order."""
        sorted_out = grouped_matmul(rows, weight.transpose(1, 2), offsets)
        return torch.empty_like(sorted_out).index_copy_(0, order, sorted_out)
