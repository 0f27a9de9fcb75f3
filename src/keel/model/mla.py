"""Multi-head latent attention (DeepSeek-V2/V3): keys and values from one small latent per token.

Each token is compressed into a latent c (kv_lora_rank = R channels: kv_a_proj_with_mqa, then
kv_a_layernorm) and one rotary key k_r shared by all heads (qk_rope_head_dim = P channels, the only
rotated ones). Per head, kv_b_proj expands c into a key part k_nope and a value v; the query is
[q_nope, q_rope], and a score is q_nope.k_nope + q_rope.k_r.

The same attention is computed in one of two ways:
- expanded, without a cache (training, `keel align`, a plain forward): k = [k_nope, k_r] and v per
  head, one SDPA over the heads, as transformers does it (so alignment compares like with like);
- absorbed, with a cache (`keel generate`, serving): q_nope.(W_uk c) = (W_uk^T q_nope).c, so each
  query head is mapped into latent space once ([W_uk^T q_nope, q_rope], R + P wide) and attends
  over the cached rows [c, k_r] themselves; the output, a mix of latents, goes through W_uv and
  then o_proj. Why absorb: the cache keeps only [c, k_r] (R + P values per token and layer), and
  expanding it would run kv_b_proj over every cached token at every decode step (for DeepSeek-V3,
  L x 512 x 128 x 256 multiply-adds per layer: 69 G for a 4k context, against 0.6 G absorbed)
  and rebuild the full K/V the latent cache exists to avoid. Absorbed, a step reads each cached
  row once for all heads (multi-query attention with one shared key/value row). Prefill chunks
  take the same path, so there is one cache code path; their score width grows from
  qk_nope + qk_rope to R + P (vLLM expands for prefill instead; an option if prefill is ever
  compute-bound here).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from keel.config import ModelConfig
from keel.model.attention import AttentionMetadata, sdpa
from keel.model.dsa import Indexer, IndexQuery, select_keys
from keel.model.layers import RMSNorm, apply_rotary, yarn_get_mscale

# transformers and DeepSeek's own code build q_a_layernorm and kv_a_layernorm with the RMSNorm
# default eps, not the config's rms_norm_eps.
LATENT_NORM_EPS = 1e-6
# Linear layers whose weight is read as a matrix (`_absorbed` folds kv_b_proj.weight into the query and the
# output when attending over the cache), as shell patterns of module names: they stay plain float nn.Linear
# layers, never quantized (keel.quant.apply) nor pre-packed (keel.model.prepack).
WEIGHT_READ_LINEARS = ("*kv_b_proj",)


def mla_softmax_scale(config: ModelConfig) -> float:
    """1/sqrt(qk_nope + qk_rope), times DeepSeek's YaRN correction mscale(factor, mscale_all_dim)**2
    (which transformers applies in DeepseekV3Attention, on top of the cos/sin attention factor)."""
    scale = config.head_dim**-0.5
    rope = config.rope_scaling
    if rope.type == "yarn" and rope.mscale_all_dim:
        scale = scale * yarn_get_mscale(rope.factor, rope.mscale_all_dim) ** 2
    return scale


class MLAttention(nn.Module):
    """Drop-in for keel.model.attention.Attention (same forward contract); HF parameter names."""

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.qk_nope = config.qk_nope_head_dim
        self.qk_rope = config.qk_rope_head_dim
        self.qk_head_dim = config.head_dim
        # False (`rope_layers`): the rope part of q and k left unrotated, no position encoding (Kimi Linear's NoPE)
        self.rotates = config.layer_rotates(layer)
        self.v_head_dim = config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        self.interleaved = config.rope_interleave
        self.scale = mla_softmax_scale(config)
        h, q_width = config.hidden_size, config.q_size
        self.q_proj: nn.Linear | None = None
        self.q_a_proj: nn.Linear | None = None
        self.q_a_layernorm: RMSNorm | None = None
        self.q_b_proj: nn.Linear | None = None
        # A.X-K2 (mla_query_gate): instead of q_b_proj, each head's query and output gate from the latent normed and
        # raw side by side, [q (qk_head_dim), gate (v_head_dim)] per head
        self.q_gate_proj: nn.Linear | None = None
        if config.q_lora_rank is None:
            self.q_proj = nn.Linear(h, q_width, bias=False)
        else:  # low-rank query: down, norm, up
            self.q_a_proj = nn.Linear(h, config.q_lora_rank, bias=config.qkv_bias)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, LATENT_NORM_EPS)
            if config.mla_query_gate:
                width = config.num_heads * (self.qk_head_dim + self.v_head_dim)
                self.q_gate_proj = nn.Linear(2 * config.q_lora_rank, width, bias=False)
            else:
                self.q_b_proj = nn.Linear(config.q_lora_rank, q_width, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, self.kv_lora_rank + self.qk_rope, bias=config.qkv_bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, config.num_heads * (self.qk_nope + self.v_head_dim), bias=False)
        self.o_proj = nn.Linear(config.num_heads * self.v_head_dim, h, bias=config.o_bias)
        # Bailing Hybrid (attention_output_gate, per head): each head's output times sigmoid of its unit
        self.output_gate = nn.Linear(h, config.num_heads, bias=False) if config.attention_output_gate else None
        # DeepSeek Sparse Attention (keel.model.dsa): the keys each query attends to picked by this layer's indexer,
        # or by the one of `index_source` (GLM-5's shared layers have none)
        self.index_topk = config.index_topk
        self.index_source = config.index_source(layer) if config.is_dsa else layer
        self.indexer = Indexer(config) if config.is_dsa and self.index_source == layer else None

    def forward(self, x: Tensor, meta: AttentionMetadata) -> Tensor:
        b, s, _ = x.shape
        q_latent, gate = None, None
        if self.q_proj is not None:
            q = self.q_proj(x)
        elif self.q_gate_proj is not None:
            compressed = self.q_a_proj(x)
            q_latent = self.q_a_layernorm(compressed)
            q_gate = self.q_gate_proj(torch.cat((q_latent, compressed), dim=-1))
            q, gate = q_gate.view(b, s, -1, self.qk_head_dim + self.v_head_dim).split(
                [self.qk_head_dim, self.v_head_dim], dim=-1
            )
        else:
            q_latent = self.q_a_layernorm(self.q_a_proj(x))
            q = self.q_b_proj(q_latent)
        # -1 heads: under tensor parallelism the projections may hold a subset of the heads.
        q_nope, q_rope = q.reshape(b, s, -1, self.qk_head_dim).split([self.qk_nope, self.qk_rope], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.qk_rope], dim=-1)
        latent = self.kv_a_layernorm(latent)  # [B, S, R]
        k_rope = k_rope.unsqueeze(2)  # [B, S, 1, P]: one rope key for all heads
        if self.rotates:
            cos, sin = meta.rope
            q_rope = self._rotate(q_rope, cos, sin)  # [B, S, H, P]
            k_rope = self._rotate(k_rope, cos, sin)
        if meta.query_scale is not None:  # Llama 4's temperature by position (Mistral 4): the whole query
            q_nope, q_rope = q_nope * meta.query_scale, q_rope * meta.query_scale
        # DSA: without a cache, no longer than index_topk, every key is selected: dense, the indexer not run
        sparse = self.index_topk and (meta.cache is not None or s > self.index_topk)
        index = self._index_query(x, q_latent, meta) if sparse else None
        if meta.cache is None:
            out = self._expanded(q_nope, q_rope, latent, k_rope, meta, index)
        else:
            out = self._absorbed(q_nope, q_rope, latent, k_rope, meta, index)
        if gate is not None:  # [B, S, H, V]: in float32, rounded once, as transformers gates it
            out = (out * torch.sigmoid(gate.float())).to(out.dtype)
        if self.output_gate is not None:  # rounded to the activations' dtype before the product, as transformers
            out = out * torch.sigmoid(self.output_gate(x).float()).to(out.dtype).unsqueeze(-1)
        return self.o_proj(out.reshape(b, s, -1))

    def _rotate(self, x: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor:
        if self.interleaved:
            # DeepSeek's weights produce rotary pairs side by side, (x0, x1), (x2, x3), ...: gather
            # evens then odds into the rotate-half layout (as transformers does). q and k get the same
            # permutation, so q.k is unchanged; the cache stores k_rope in this layout.
            x = torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
        return apply_rotary(x, cos, signed_sin)

    def _index_query(self, x: Tensor, q_latent: Tensor, meta: AttentionMetadata) -> IndexQuery:
        """The indexer's queries, weights and keys for this step (computed without gradients, as transformers
        does: keel trains the attention with the indexer frozen); nothing of its own on a shared layer."""
        if self.indexer is None:
            return IndexQuery(None, None, None, self.index_source, self.index_topk)
        with torch.no_grad():
            q, k, w = self.indexer(x, q_latent, meta.rope)
        return IndexQuery(q, w, k, self.layer, self.index_topk)

    def _selection(self, index: IndexQuery, meta: AttentionMetadata) -> Tensor:
        """Without a cache: the keys [B, 1, S, S] each query attends to, this layer's indexer's choice among the
        causal ones, or (a shared layer) its source layer's, which that layer left in `meta.index_masks`."""
        if index.q is None:
            return meta.index_masks[index.source]
        allowed = meta.mask(meta.positions, None)[:, 0]  # [B, S, S]: causal
        keep = select_keys(index, index.k[:, :, 0], allowed).unsqueeze(1)
        meta.index_masks[self.layer] = keep
        return keep

    def _expanded(
        self,
        q_nope: Tensor,
        q_rope: Tensor,
        latent: Tensor,
        k_rope: Tensor,
        meta: AttentionMetadata,
        index: IndexQuery | None = None,
    ) -> Tensor:
        """Full keys and values per head, then SDPA -> [B, S, H, V]."""
        b, s = latent.shape[:2]
        k_nope, v = (
            self.kv_b_proj(latent)
            .view(b, s, -1, self.qk_nope + self.v_head_dim)
            .split([self.qk_nope, self.v_head_dim], dim=-1)
        )
        q = torch.cat((q_nope, q_rope), dim=-1).transpose(1, 2)  # [B, H, S, nope + P]
        k = torch.cat((k_nope, k_rope.expand(-1, -1, k_nope.shape[2], -1)), dim=-1).transpose(1, 2)
        v = v.transpose(1, 2)
        if index is not None:
            out = sdpa(q, k, v, self._selection(index, meta), scale=self.scale)
        elif meta.plain_causal:
            out = sdpa(q, k, v, causal=True, scale=self.scale)
        else:
            out = sdpa(q, k, v, meta.mask(meta.positions, None), scale=self.scale)
        return out.transpose(1, 2)

    def _absorbed(
        self,
        q_nope: Tensor,
        q_rope: Tensor,
        latent: Tensor,
        k_rope: Tensor,
        meta: AttentionMetadata,
        index: IndexQuery | None = None,
    ) -> Tensor:
        """kv_b_proj folded into the query and the output; the cache attends over latents -> [B, S, H, V]."""
        w = self.kv_b_proj.weight.view(-1, self.qk_nope + self.v_head_dim, self.kv_lora_rank)
        w_uk, w_uv = w.split([self.qk_nope, self.v_head_dim], dim=1)  # [H, nope, R], [H, V, R]
        q_latent = torch.einsum("bshn,hnr->bhsr", q_nope, w_uk)
        q = torch.cat((q_latent, q_rope.transpose(1, 2)), dim=-1)  # [B, H, S, R + P]
        kv = torch.cat((latent.unsqueeze(2), k_rope), dim=-1)  # [B, S, 1, R + P]: what the cache keeps
        if index is None:
            out = meta.cache.attend_latent(self.layer, q, kv, meta, self.scale)  # [B, H, S, R]
        else:
            out = meta.cache.attend_latent(self.layer, q, kv, meta, self.scale, index)
        return torch.einsum("bhsr,hvr->bshv", out, w_uv)
