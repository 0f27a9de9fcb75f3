"""Grouped-query attention with optional sliding window or chunks, q/k norm, q/k/v bias, score soft-capping, sinks and
ALiBi.

The same module runs a full-sequence forward (training, prefill) and incremental decode: the
caller passes an `AttentionMetadata` with the query positions and, when decoding, a KV cache.
The cache decides where keys and values live (contiguous here, paged in the serving engine);
attention only asks it to store the new ones and hand back what the queries may see.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from keel.config import ModelConfig
from keel.model.layers import RMSNorm, apply_partial_rotary, l2_norm, qk_norm

if TYPE_CHECKING:
    from keel.model.dsa import IndexQuery
    from keel.model.recurrent import RecurrentSpans


class KVCache(Protocol):
    """Storage for keys and values across forward calls, and attention over that storage.

    Where keys live decides how attention reads them (a contiguous buffer, pages through block
    tables), so the cache computes the attention of the new queries: the model stays the same
    whatever the cache.
    """

    def attend(
        self,
        layer: int,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        meta: AttentionMetadata,
        window: int | None,
        sinks: Tensor | None = None,
        alibi: Tensor | None = None,
    ) -> Tensor:
        """Store `k`, `v` ([B, S, H_kv, D]) of the tokens at `meta.positions`, and return the
        attention output [B, H, S, D] of queries `q` ([B, H, S, D]) over every key they may see
        (causal by position, within `window` tokens when set). Where the model's config sets
        `attn_logit_softcapping` (Gemma 2), the cache, built from that config, caps every score at
        cap * tanh(score / cap) before the mask (`explicit_attention`'s arithmetic). `sinks` (float32 [H],
        GPT-OSS): each head's sink logit joins its softmax's denominator (`explicit_attention`). `alibi` (float32 [H],
        Bloom, MPT, Falcon-RW): each head's slope; its scores (after any cap) gain slope * (key position - query
        position) (`alibi_bias`)."""
        ...

    def attend_stored(
        self, layer: int, q: Tensor, meta: AttentionMetadata, window: int | None, sinks: Tensor | None = None
    ) -> Tensor:
        """`attend` over what `layer` has stored (this step's rows included: it ran earlier in the forward), storing
        nothing: a layer attending over another's keys and values (ModelConfig.kv_shared_layers)."""
        ...

    def recurrent_spans(self, layer: int, meta: AttentionMetadata) -> RecurrentSpans:
        """For a recurrent layer (keel.model.recurrent: Gated DeltaNet, short convolution, Mamba 2): which tokens of
        this forward belong to which sequence, and that layer's state stores with each sequence's slot (emptied where
        it starts at position 0)."""
        ...

    def attend_latent(
        self, layer: int, q: Tensor, kv: Tensor, meta: AttentionMetadata, scale: float, index: IndexQuery | None = None
    ) -> Tensor:
        """Multi-head latent attention (keel.model.mla), with kv_b_proj absorbed into q and o.

        Store `kv` ([B, S, 1, R + P]: each token's normed latent, then its rotated shared rope key;
        R = kv_lora_rank, P = qk_rope_head_dim) and return [B, H, S, R]: softmax(scale * q.k) over
        the visible tokens' rows, times their first R channels (the latent is both key and value).
        q is [B, H, S, R + P]. This is multi-query attention over one stored row per token. With `index` (DeepSeek
        Sparse Attention, keel.model.dsa) store its index keys too and let each query see only the keys its
        indexer selects (the source layer's selection on a shared layer)."""
        ...


def visible(q_positions: Tensor, k_positions: Tensor, window: int | None) -> Tensor:
    """Whether each key is visible to each query (broadcast over the two position tensors): causal, and within the
    layer's window (`ModelConfig.layer_window`): positive, the last `window` positions; negative, the query's own
    chunk of -window positions (Llama 4's chunked attention); None, every earlier position."""
    allowed = k_positions <= q_positions
    if window is not None and window > 0:
        allowed = allowed & (q_positions - k_positions < window)
    elif window is not None and window < 0:
        allowed = allowed & (k_positions >= q_positions - q_positions % -window)
    return allowed


def query_scale(positions: Tensor, beta: float, length: int, dtype: torch.dtype) -> Tensor:
    """Llama 4's attention temperature per query, [B, S, 1, 1]: 1 + beta * log(1 + floor(position / length)),
    as transformers computes it (float32, then the activations' dtype). Llama 4's own model passes position + 1."""
    scale = 1 + beta * torch.log1p(torch.floor(positions.float() / length))
    return scale.to(dtype)[..., None, None]


def sdpa(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, causal: bool = False, scale: float | None = None
) -> Tensor:
    """Scaled dot-product attention with grouped-query heads (q [B, H, S, D], k [B, H_kv, L, D],
    v [B, H_kv, L, Dv]); `scale` defaults to 1/sqrt(D)."""
    k, v = sdpa_kv_heads(q, k, v)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1], scale=scale
    )


def sdpa_kv_heads(q: Tensor, k: Tensor, v: Tensor, cuda: bool | None = None) -> tuple[Tensor, Tensor]:
    """Keys and values with as many heads as SDPA's fused kernels take for these queries: on CUDA in float32
    (or any dtype FlashAttention does not run) grouped heads are repeated to the query heads, because the
    memory-efficient kernel takes no grouped heads and SDPA would fall back to its math kernel, which
    materialises every [S, L] score matrix; elsewhere (CPU, and CUDA's half-precision kernels) as they are.
    `cuda` overrides the device test (a CPU test of the CUDA rule)."""
    cuda = q.is_cuda if cuda is None else cuda
    groups = q.shape[1] // k.shape[1]
    if not cuda or groups == 1 or q.dtype in (torch.float16, torch.bfloat16):
        return k, v
    return k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)


def softcap_scores(scores: Tensor, cap: float) -> Tensor:
    """Attention-score soft-capping (Gemma 2): scores -> cap * tanh(scores / cap)."""
    return torch.tanh(scores / cap) * cap


def alibi_slopes(num_heads: int, bias_max: float = 8.0) -> Tensor:
    """ALiBi's slope of each head, float32 [num_heads] on the CPU, as transformers' Bloom computes them
    (`_get_alibi_slopes`, whose bias_max is 8): for n the power of two at or below num_heads, 2^(-bias_max * i / n)
    for i = 1..n, then the odd ones of 2n's (2^(-bias_max * i / 2n), i = 1, 3, ..) for the heads beyond n. MPT's
    `gen_slopes` (any alibi_bias_max) and Falcon's `build_alibi_tensor` give the same slopes."""
    n = 2 ** math.floor(math.log2(num_heads))
    base = torch.full((), 2 ** (-bias_max / n), dtype=torch.float32, device="cpu")
    slopes = torch.pow(base, torch.arange(1, 1 + n, dtype=torch.int32, device="cpu"))
    if n != num_heads:
        extra = torch.full((), 2 ** (-bias_max / (2 * n)), dtype=torch.float32, device="cpu")
        odd = torch.arange(1, 1 + 2 * min(n, num_heads - n), 2, dtype=torch.int32, device="cpu")
        slopes = torch.cat([slopes, torch.pow(extra, odd)])
    return slopes


def alibi_bias(slopes: Tensor, q_positions: Tensor, k_positions: Tensor) -> Tensor:
    """ALiBi's float32 bias of each score: slopes * (key position - query position), all three broadcast against
    one another (slopes shaped to the scores' head dimension). Distances, not absolute key positions as
    transformers' Bloom adds: the softmax is the same, and the bias stays small however long the sequence."""
    return slopes.float() * (k_positions - q_positions).float()


def sink_softmax(scores: Tensor, sinks: Tensor | None) -> Tensor:
    """Softmax over the last dimension of float32 `scores`, where a sink logit (GPT-OSS) joins each row's
    denominator and takes no value: exp(s_j) / (sum_i exp(s_i) + exp(sink)), as transformers computes it (a sink
    column concatenated, softmaxed, dropped). `sinks` is shaped to broadcast against `scores[..., :1]` (each row
    its head's sink); None: the plain softmax. A row whose keys are all masked gives zeros."""
    if sinks is None:
        return scores.softmax(dim=-1)
    column = sinks.float().expand(*scores.shape[:-1], 1)
    return torch.cat([scores, column], dim=-1).softmax(dim=-1)[..., :-1]


def explicit_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    cap: float | None = None,
    scale: float | None = None,
    sinks: Tensor | None = None,
    bias: Tensor | None = None,
) -> Tensor:
    """Attention with what SDPA cannot do: scaled scores soft-capped before the mask (Gemma 2's
    `attn_logit_softcapping`), then biased (ALiBi, `alibi_bias`), and softmax sinks (GPT-OSS, `sink_softmax`). The
    scores are computed explicitly (float32, [B, H, S, L] of them) and softmaxed in float32. q [B, H, S, D],
    k [B, H_kv, L, D], v [B, H_kv, L, Dv], mask broadcastable to [B, H, S, L] (True = attend) or None; `scale`
    defaults to 1/sqrt(D); `sinks` [H] or None; `bias` float32 broadcastable to [B, H, S, L] or None."""
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    if cap:
        scores = softcap_scores(scores, cap)
    if bias is not None:
        scores = scores + bias
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    column = None if sinks is None else sinks.view(1, -1, 1, 1)
    return torch.matmul(sink_softmax(scores, column).to(v.dtype), v)


@dataclass
class AttentionMetadata:
    """Per-forward attention inputs, shared by every layer."""

    positions: Tensor  # [B, S] int64: absolute position of each query token
    cache: KVCache | None = None
    # True when positions are 0..S-1 in every row and there is no cache: plain causal attention.
    plain_causal: bool = False
    rope: tuple[Tensor, Tensor] | None = None  # (cos, sin), filled by the model once per forward
    sliding_rope: tuple[Tensor, Tensor] | None = None  # the sliding layers' own (cos, sin), where they have one
    query_scale: Tensor | None = None  # [B, S, 1, 1]: each query's temperature (config.query_scale_beta), or None
    per_layer_inputs: Tensor | None = None  # [B, S, layers, P]: Gemma 4's per-layer inputs (per_layer_input_size)
    embeddings: Tensor | None = None  # [B, S, H]: the token embeddings Zamba 2's hybrid layers read (hybrid_block)
    # Without a cache: the keys and values [B, S, H_kv, D] of the layers others attend over (kv_shared_layers)
    shared_kv: dict[int, tuple[Tensor, Tensor]] = field(default_factory=dict, repr=False)
    # Without a cache: each DSA indexer's choice of keys [B, 1, S, S], for the layers sharing it (keel.model.dsa)
    index_masks: dict[int, Tensor] = field(default_factory=dict, repr=False)
    # Whatever the cache works out once per forward (e.g. visible length, slot indices), reused by layers.
    cache_plan: object | None = None
    _masks: dict[int | None, Tensor | None] = field(default_factory=dict, repr=False)

    @classmethod
    def for_sequence(cls, batch: int, seq_len: int, device: torch.device | str = "cpu") -> AttentionMetadata:
        """Metadata of a plain forward over whole sequences starting at position 0."""
        positions = torch.arange(seq_len, device=device).expand(batch, seq_len)
        return cls(positions=positions, plain_causal=True)

    def mask(self, key_positions: Tensor, window: int | None) -> Tensor | None:
        """Boolean mask [B, 1, S, L] (True = attend), built once per window size and reused by layers."""
        if window not in self._masks:
            self._masks[window] = self._build_mask(key_positions, window)
        return self._masks[window]

    def _build_mask(self, key_positions: Tensor, window: int | None) -> Tensor | None:
        q = self.positions.unsqueeze(-1)  # [B, S, 1]
        k = key_positions.unsqueeze(-2) if key_positions.dim() == 2 else key_positions.view(1, 1, -1)
        if window is None and q.shape[0] == 1 and q.shape[1] == 1 and self.cache is not None:
            # One decode token: every key the cache returned is at or before it.
            return None
        return visible(q, k, window).unsqueeze(1)


def low_rank_pair(width_in: int, rank: int, width_out: int) -> nn.Sequential:
    """An adapter: two projections without biases through `rank` channels (Zamba 2's, transformers' layout)."""
    return nn.Sequential(nn.Linear(width_in, rank, bias=False), nn.Linear(rank, width_out, bias=False))


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads = config.num_heads
        # the layer's own geometry: Gemma 4's full-attention layers have wider heads and fewer KV heads
        self.num_kv_heads = config.layer_num_kv_heads(layer)
        self.head_dim = config.layer_head_dim(layer)
        self.v_head_dim = config.layer_v_head_dim(layer)  # MiMo-V2-Flash's values are narrower than q and k
        # MiMo-V2-Flash's attention_value_scale on the values as projected (before the cache keeps them)
        self.value_scale = config.attention_value_scale
        self.rotary_dim = config.layer_rotary_dim(layer)
        self.window = config.layer_window(layer)
        h, q_size, kv_size = config.hidden_size, config.layer_q_size(layer), config.layer_kv_size(layer)
        h_out, h = h, config.attention_input_size(layer)  # Zamba 2's hybrid layers read 2 x hidden_size
        self.q_proj = nn.Linear(h, q_size, bias=config.qkv_bias)
        # Gemma 4's KV sharing: a layer attending over an earlier layer's keys and values has no k/v projections
        # or k norm; the layers others attend over hand theirs on (AttentionMetadata.shared_kv, without a cache).
        self.kv_source = config.kv_source(layer)
        self.shares_kv = any(config.kv_source(i) == layer != i for i in range(config.num_layers))
        own_kv = self.kv_source == layer
        self.k_proj = nn.Linear(h, kv_size, bias=config.qkv_bias) if own_kv else None
        # Gemma 4's attention_k_eq_v: the keys' projection is the values' too (before k's norm and rotary)
        self.k_eq_v = config.layer_k_eq_v(layer)
        v_size = config.layer_v_size(layer)
        self.v_proj = None if self.k_eq_v or not own_kv else nn.Linear(h, v_size, bias=config.qkv_bias)
        self.o_proj = nn.Linear(config.num_heads * self.v_head_dim, h_out, bias=config.layer_o_bias(layer))
        # Zamba 2's adapters: a low-rank pair of the layer's own added to each of q, k and v as projected
        self.q_adapter: nn.Sequential | None = None
        self.k_adapter: nn.Sequential | None = None
        self.v_adapter: nn.Sequential | None = None
        if config.attention_adapters and config.shared_hybrid(layer):
            rank = config.adapter_rank
            self.q_adapter, self.k_adapter, self.v_adapter = (
                low_rank_pair(h, rank, width) for width in (q_size, kv_size, config.layer_v_size(layer))
            )
        # BitNet's RMSNorm over the attention's output before o_proj
        attn_out = config.num_heads * self.v_head_dim
        self.attn_sub_norm = RMSNorm(attn_out, config.rms_norm_eps) if config.attn_sub_norm else None
        # Qwen3.5: the output scaled by sigmoid of a gate per query channel, before o_proj; LFM3: one per query head
        self.gate_per_head = config.attention_gate_per_head
        self.gate_softplus = config.attention_gate_activation == "softplus"  # Laguna's
        gate_width, gate_bias = (config.num_heads, False) if self.gate_per_head else (q_size, config.qkv_bias)
        self.output_gate = nn.Linear(h, gate_width, bias=gate_bias) if config.attention_output_gate else None
        # q/k norms before the rotary embedding (after it: HunYuan's); over the whole projections: OLMo 2's
        self.qk_norm_whole = config.qk_norm_scope == "all"
        self.qk_norm_after_rope = config.qk_norm_after_rope
        self.clip_qkv = config.clip_qkv  # OLMo's clamp of q, k and v (elementwise: a tensor-parallel shard's too)
        # Gemma 4: each head's values divided by their root mean square (no weight)
        self.v_norm_eps = config.rms_norm_eps if config.v_norm else None
        # RMSNorms (or LayerNorms: `qk_norm_type`) over each head with one weight for all (Qwen3), over the whole
        # projections, or over each head with a weight per head (`qk_norm_scope` each_head: Cohere's Command R+)
        self.q_norm = qk_norm(config, self.num_heads, self.head_dim, q_size) if config.qk_norm else None
        kv_heads = self.num_kv_heads
        self.k_norm = qk_norm(config, kv_heads, self.head_dim, kv_size) if config.qk_norm and own_kv else None
        # the norm keel::decoder_layers (keel.model.fused_layer) runs: RMSNorm, one weight for all heads
        self.qk_norm_plain = config.qk_norm_type == "rms" and config.qk_norm_scope == "head"
        # Gemma 3: the sliding-window layers rotate by RoPE of their own (AttentionMetadata.sliding_rope).
        self.sliding_rope = config.sliding_rope_theta is not None and config.layer_types[layer] == "sliding_attention"
        self.rotates = config.layer_rotates(layer)  # False: no position encoding (SmolLM3's NoPE layers)
        # Llama 4's temperature (AttentionMetadata.query_scale): every layer's (Ministral 3) or the NoPE layers' only.
        self.scales_queries = config.query_scale_beta != 0 and not (config.query_scale_nope_only and self.rotates)
        # Llama 4's weightless q/k norm, in the rotating layers only.
        self.qk_l2_eps = config.rms_norm_eps if config.qk_l2_norm and self.rotates else None
        # Serving fuses q, k and v into one projection at load (keel.model.fuse); None otherwise.
        self.qkv_proj: nn.Linear | None = None
        # A softmax scale other than 1/sqrt(head_dim) (Granite's attention_multiplier) is folded into q, so
        # that every attention backend (SDPA, the paged caches' kernels) keeps its default scale.
        scale = config.attention_scale
        if config.attention_scale_by_layer:  # GPT-2's scale_attn_by_inverse_layer_idx
            scale = (self.head_dim**-0.5 if scale is None else scale) / (layer + 1)
        self.q_multiplier = None if scale is None else scale * math.sqrt(self.head_dim)
        # Gemma 2's attention-score soft-capping; with a cache, the cache applies it (KVCache.attend).
        self.softcap = config.attn_logit_softcapping
        # GPT-OSS's softmax sinks, one logit per query head (under tensor parallelism, this rank's heads'); MiMo-V2-
        # Flash's in its sliding-window layers only.
        self.sinks = nn.Parameter(torch.empty(config.num_heads)) if config.layer_has_sinks(layer) else None
        # ALiBi's slopes (position_embedding "alibi"), float32 [H] on the CPU (under tensor parallelism, this rank's
        # heads'): a plain attribute, not a buffer, so that building on the meta device and loading leave it be;
        # `alibi_on` keeps a copy on the queries' device.
        self.alibi: Tensor | None = None
        if config.position_embedding == "alibi":
            self.alibi = alibi_slopes(config.num_heads, config.alibi_bias_max) * config.alibi_scale
        self._alibi_device: Tensor | None = None

    def alibi_on(self, device: torch.device) -> Tensor | None:
        """The ALiBi slopes on `device` (None without ALiBi), copied there once."""
        if self.alibi is None:
            return None
        if (
            self._alibi_device is None
            or self._alibi_device.device != device
            or len(self._alibi_device) != len(self.alibi)
        ):
            self._alibi_device = self.alibi.to(device)
        return self._alibi_device

    def forward(self, x: Tensor, meta: AttentionMetadata) -> Tensor:
        if self.kv_source != self.layer:  # attends over an earlier layer's keys and values (kv_shared_layers)
            q, k, v = self._queries(x, meta), None, None
        else:
            q, k, v = self._projections(x, meta)
        out = self._attend(q, k, v, meta)
        if self.output_gate is not None:
            raw = self.output_gate(x)
            gate = F.softplus(raw.float()).to(raw.dtype) if self.gate_softplus else torch.sigmoid(raw)
            if self.gate_per_head:  # each head's channels times its one gate
                out = (out.unflatten(-1, (gate.shape[-1], -1)) * gate.unsqueeze(-1)).flatten(-2)
            else:
                out = out * gate
        if self.attn_sub_norm is not None:
            out = self.attn_sub_norm(out)
        return self.o_proj(out)

    def _attend(self, q: Tensor, k: Tensor | None, v: Tensor | None, meta: AttentionMetadata) -> Tensor:
        """The attention of q [B, S, H, D] over k, v [B, S, H_kv, D] (None: the source layer's, kv_shared_layers)
        and what the cache holds -> [B, S, H * Dv], before any output gate and o_proj (keel.model.moa reuses it)."""
        if self.scales_queries and meta.query_scale is not None:  # Llama 4's temperature by position
            q = (q * meta.query_scale).to(q.dtype)
        if self.q_multiplier is not None:
            q = q * self.q_multiplier
        q = q.transpose(1, 2)  # [B, H, S, D]
        if self.shares_kv and meta.cache is None:
            meta.shared_kv[self.layer] = k, v
        sinks = self.sinks
        if sinks is not None and hasattr(sinks, "to_local"):  # training's tensor parallelism: this rank's heads'
            sinks = sinks.to_local()
        alibi = self.alibi_on(q.device)
        if meta.cache is not None:
            cache_sinks = None if sinks is None else sinks.float()
            if k is None:  # the source's store holds this step's rows already: it ran earlier in the forward
                out = meta.cache.attend_stored(self.kv_source, q, meta, self.window, cache_sinks)
            elif alibi is not None:
                out = meta.cache.attend(self.layer, q, k, v, meta, self.window, cache_sinks, alibi)
            else:
                out = meta.cache.attend(self.layer, q, k, v, meta, self.window, cache_sinks)
        else:
            k, v = meta.shared_kv[self.kv_source] if k is None else (k, v)
            if self.softcap is not None or sinks is not None or alibi is not None:  # SDPA can't: explicit scores
                mask = meta.mask(meta.positions, self.window)
                bias = None
                if alibi is not None:  # [B, H, S, S] in float32, like the scores
                    positions = meta.positions[:, None]
                    bias = alibi_bias(alibi.view(1, -1, 1, 1), positions[..., None], positions[..., None, :])
                out = explicit_attention(
                    q, k.transpose(1, 2), v.transpose(1, 2), mask, self.softcap, sinks=sinks, bias=bias
                )
            elif meta.plain_causal and self.window is None:
                out = sdpa(q, k.transpose(1, 2), v.transpose(1, 2), causal=True)  # SDPA's fused causal kernel
            else:
                mask = meta.mask(meta.positions, self.window)
                out = sdpa(q, k.transpose(1, 2), v.transpose(1, 2), mask)
        return out.transpose(1, 2).flatten(2)

    def _projections(self, x: Tensor, meta: AttentionMetadata) -> tuple[Tensor, Tensor, Tensor]:
        """q, k, v [B, S, heads, D]: projected, clamped, normed and rotated as the config says."""
        b, s, _ = x.shape
        # -1 heads: under tensor parallelism q/k/v hold this rank's heads only, not num_heads.
        if self.qkv_proj is not None:  # q and k only where k = v
            q, k, *v = self.qkv_proj(x).split(self.qkv_sizes, dim=-1)
        else:
            q, k, *v = (p(x) for p in (self.q_proj, self.k_proj, self.v_proj) if p is not None)
        v = k if self.k_eq_v else v[0]
        if self.q_adapter is not None:
            q, k, v = q + self.q_adapter(x), k + self.k_adapter(x), v + self.v_adapter(x)
        if self.q_norm is not None and self.qk_norm_whole:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        q, k, v = q.view(b, s, -1, self.head_dim), k.view(b, s, -1, self.head_dim), v.view(b, s, -1, self.v_head_dim)
        if self.value_scale != 1.0:
            v = v * self.value_scale
        if self.v_norm_eps is not None:
            v = l2_norm(v, self.v_norm_eps)
        if self.q_norm is not None and not self.qk_norm_whole and not self.qk_norm_after_rope:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotates:
            cos, sin = meta.sliding_rope if self.sliding_rope else meta.rope
            q, k = apply_partial_rotary(q, cos, sin), apply_partial_rotary(k, cos, sin)
        if self.q_norm is not None and self.qk_norm_after_rope:  # HunYuan's order
            q, k = self.q_norm(q), self.k_norm(k)
        if self.qk_l2_eps is not None:
            q, k = l2_norm(q, self.qk_l2_eps), l2_norm(k, self.qk_l2_eps)
        return q, k, v

    def _queries(self, x: Tensor, meta: AttentionMetadata) -> Tensor:
        """q [B, S, heads, D] of a layer without keys and values of its own (kv_shared_layers): normed per head and
        rotated (ModelConfig refuses the other q/k treatments beside KV sharing)."""
        q = self.q_proj(x).view(*x.shape[:2], -1, self.head_dim)  # never fused (keel.model.fuse)
        if self.q_norm is not None:
            q = self.q_norm(q)
        if self.rotates:
            q = apply_partial_rotary(q, *(meta.sliding_rope if self.sliding_rope else meta.rope))
        return q
