"""An int8 paged KV cache: keys and values stored as int8 with one float16 scale per (head, token).

`Int8PagedKVCache` is the engine's `kv_cache_dtype="int8"` option: about half the bytes of a
bfloat16 cache per token (a quarter of a float32 one), so twice the tokens in the same
`--kv-cache-memory`. It keeps `PagedKVCache`'s layout, blocks and plans; only what is written
and how it is read back differ:

- write: each new token's K (and V) of each KV head is quantized symmetrically by its own absmax
  over the head dimension (scale = absmax / 127), when the token is written;
- read, single-token decodes: the int8 rows are converted as they are (small integers are exact in
  bfloat16 and float32) and the scales are folded into the attention: the key scale into the
  scores, the value scale into the probabilities. One multiply over L per query instead of one
  over L x D per key and value, faster than dequantizing the gathered rows (docs/BENCHMARKS.md
  "int8 KV cache"), and no bfloat16 rounding of the products;
- read, prefill chunks: the gathered rows are dequantized into the compute dtype (SDPA has no
  per-key multiplier to fold a scale into).

Why a dynamic scale per token and head rather than one static scale per head: a token's scale
depends on that token only, so nothing needs calibrating, a block's contents never change after
it is written (prefix-cached blocks stay valid for every later request), and a token with
unusually large keys or values (attention-sink tokens, the first token) costs precision for
itself only instead of for every token of its head. A static per-head scale must cover the
largest value the head will ever see: even calibrated on the very text it quantizes, it has a
larger reconstruction error on SmolLM2-135M (bench/kv_int8.py; figures in docs/BENCHMARKS.md).

Multi-head latent attention (config.is_mla) is supported: each row (latent, then rope key) has
two scales, one per part, because the normalized latent and the unnormalized rope key differ in
magnitude; those rows are dequantized on gather for decodes too (a scale folded into the scores
must be one per key).
"""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

import torch
from torch import Tensor

from keel.config import RECURRENT_LAYERS, ModelConfig
from keel.errors import KeelError
from keel.model.attention import AttentionMetadata, alibi_bias, sink_softmax, softcap_scores
from keel.model.kv_size import SCALE_DTYPE, check_kv_cache_dtype, kv_store_dtype
from keel.serve.kv_cache import DecodeGroup, InPlaceLayer, PagedKVCache, PrefillChunk, StepPlan, kernel_attends

QMAX = 127  # symmetric: -127..127, so that -absmax and +absmax both map exactly


class QuantStore(NamedTuple):
    """One layer's int8 rows [H_kv, slots, D] and their scales [H_kv, slots, S] (S parts per row, their widths)."""

    data: Tensor
    scales: Tensor
    parts: tuple[int, ...]


def quantize_kv(x: Tensor, parts: tuple[int, ...] | None = None) -> tuple[Tensor, Tensor]:
    """Rows x [..., D] -> (int8 [..., D], float16 scales [..., S]): symmetric absmax per row, or per
    part of a row when `parts` splits D (sizes summing to D). |dequantize(q) - x| <= half a step."""
    xf = x.float()
    multi = parts is not None and len(parts) > 1
    chunks = xf.split(parts, dim=-1) if multi else (xf,)
    amax = torch.stack([c.abs().amax(dim=-1) for c in chunks], -1) if multi else xf.abs().amax(-1, keepdim=True)
    # Kept within float16's positive range: an all-zero row gets the smallest subnormal (it stores
    # zeros, no 0/0), and an absmax past ~8e6 saturates instead of storing an infinite scale.
    scales = amax.div_(QMAX).clamp_(2.0**-24, torch.finfo(SCALE_DTYPE).max).to(SCALE_DTYPE)
    # Divide by the stored (rounded) scale, so that what is read back is what was rounded to; its
    # rounding can put the absmax at 127.03 steps, hence the clamp.
    inv = scales.float().reciprocal_()
    q = torch.cat([c * inv[..., i : i + 1] for i, c in enumerate(chunks)], -1) if multi else xf * inv
    return q.round_().clamp_(-QMAX, QMAX).to(torch.int8), scales


def dequantize_kv(q: Tensor, scales: Tensor, dtype: torch.dtype, parts: tuple[int, ...] | None = None) -> Tensor:
    """(int8 [..., D], scales [..., S]) -> [..., D] in `dtype`."""
    s = scales.to(dtype)
    if parts is None or len(parts) == 1:
        return q.to(dtype).mul_(s)  # s is [..., 1]: broadcasts over D
    return torch.cat([c.to(dtype) * s[..., i : i + 1] for i, c in enumerate(q.split(parts, dim=-1))], dim=-1)


def make_paged_kv_cache(
    config: ModelConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    kv_cache_dtype: str = "auto",
    layers: range | None = None,
    sequences: int = 1,
) -> PagedKVCache:
    """The engine's paged cache: `PagedKVCache` in the model's dtype ("auto") or in bfloat16 ("bfloat16"),
    or `Int8PagedKVCache` ("int8").
    layers: a pipeline stage's layers (default: all). sequences: the recurrent layers' state slots."""
    check_kv_cache_dtype(kv_cache_dtype)
    if kv_cache_dtype == "int8":
        if config.is_dsa:
            raise KeelError("--kv-cache-dtype int8 does not run with DeepSeek Sparse Attention (index_topk)")
        if config.has_recurrent_layers:
            raise KeelError(f"--kv-cache-dtype int8 does not run with {RECURRENT_LAYERS}")
        if not config.is_mla and any(
            config.layer_v_head_dim(i) != config.layer_head_dim(i) for i in config.kv_layers()
        ):
            raise KeelError("--kv-cache-dtype int8 does not run with values narrower than keys (v_head_dim)")
        return Int8PagedKVCache(config, num_blocks, block_size, dtype, device, layers)
    store = kv_store_dtype(dtype, kv_cache_dtype)
    return PagedKVCache(config, num_blocks, block_size, store, device, layers, sequences)


class Int8PagedKVCache(PagedKVCache):
    """`PagedKVCache` with int8 rows and a float16 scale per (KV head, token slot) (see the module doc).

    `dtype` is the compute dtype: what attention reads the rows back as (the model's dtype).
    `keys` / `values` hold the int8 rows, `key_scales` / `value_scales` their scales [H_kv, slots, S].
    """

    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: str | torch.device = "cpu",
        layers: range | None = None,
    ) -> None:
        if not dtype.is_floating_point:
            raise KeelError(f"Int8PagedKVCache: the compute dtype must be a float dtype, got {dtype}")
        super().__init__(config, num_blocks, block_size, torch.int8, device, layers)
        self.dtype = dtype
        # Parts of a row with a scale each: the whole head dimension, or MLA's latent and rope key.
        self.parts = [(config.kv_lora_rank, config.qk_rope_head_dim) if config.is_mla else (d,) for d in self.head_dims]
        self.key_scales = [
            torch.zeros(self.kv_heads[i], self.slots_of(i), len(self.parts[i]), dtype=SCALE_DTYPE, device=device)
            for i in range(len(self.keys))
        ]
        self.value_scales = [torch.zeros_like(s) for s in self.key_scales] if self.values else []

    def nbytes(self) -> int:
        scales = sum(s.numel() * s.element_size() for s in (*self.key_scales, *self.value_scales))
        return super().nbytes() + scales

    # ---------------------------------------------------------------- write
    def _write(self, store: Tensor, rows: Tensor, scales: Tensor, layer: int) -> QuantStore:  # type: ignore[override]
        """Quantize the step's rows [1, T, H_kv, D] into their slots of one layer's store."""
        q, s = quantize_kv(rows[0].transpose(0, 1), self.parts[layer])  # [H_kv, T, D], [H_kv, T, S]
        store.index_copy_(1, self.plan.slot_mapping, q)
        scales.index_copy_(1, self.plan.slot_mapping, s)
        return QuantStore(store, scales, self.parts[layer])

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
        keys = self._write(self.keys[layer], k, self.key_scales[layer], layer)
        values = self._write(self.values[layer], v, self.value_scales[layer], layer)
        return self._attend(q, keys, values, window, None, sinks, alibi)

    def attend_stored(
        self, layer: int, q: Tensor, meta: AttentionMetadata, window: int | None, sinks: Tensor | None = None
    ) -> Tensor:
        keys = QuantStore(self.keys[layer], self.key_scales[layer], self.parts[layer])
        values = QuantStore(self.values[layer], self.value_scales[layer], self.parts[layer])
        return self._attend(q, keys, values, window, None, sinks)

    def attend_latent(self, layer: int, q: Tensor, kv: Tensor, meta: AttentionMetadata, scale: float) -> Tensor:
        return self._attend(q, self._write(self.keys[layer], kv, self.key_scales[layer], layer), None, None, scale)

    def attends_in_place(self, layer: int) -> bool:
        """The base class's, for rows of one scale (keel::decoder_layers quantizes each row as `quantize_kv`
        does; not MLA's two-part rows, which have no values anyway)."""
        return len(self.parts[layer]) == 1 and super().attends_in_place(layer)

    def in_place(self, layer: int, num_tokens: int) -> InPlaceLayer | None:
        """The base class's, with the layer's scales."""
        found = super().in_place(layer, num_tokens)  # None unless `attends_in_place`
        if found is None:
            return None
        return replace(found, key_scales=self.key_scales[layer], value_scales=self.value_scales[layer])

    # ----------------------------------------------------------------- read
    def _gather_int8(self, store: QuantStore, tables: Tensor) -> tuple[Tensor, Tensor]:
        """Block ids [B, nb] -> int8 rows [H_kv, B, L, D] and their scales [H_kv, B, L, S]."""
        flat, heads, batch = tables.flatten(), store.data.shape[0], tables.shape[0]
        rows = store.data.view(heads, self.num_blocks, -1).index_select(1, flat)
        scales = store.scales.view(heads, self.num_blocks, -1).index_select(1, flat)
        return rows.view(heads, batch, -1, store.data.shape[-1]), scales.view(heads, batch, -1, len(store.parts))

    def _gather(self, store: QuantStore, tables: Tensor) -> Tensor:  # type: ignore[override]
        """The base class's gather, dequantized into the compute dtype (prefill chunks, MLA)."""
        rows, scales = self._gather_int8(store, tables)
        return dequantize_kv(rows, scales, self.dtype, store.parts)

    def _attend(  # type: ignore[override]
        self,
        q: Tensor,
        k_store: QuantStore,
        v_store: QuantStore | None,
        window: int | None,
        scale: float | None,
        sinks: Tensor | None = None,
        alibi: Tensor | None = None,
    ) -> Tensor:
        plan = self.plan
        if v_store is not None and kernel_attends(k_store.data, k_store.data.shape[-1], self.block_size):
            data = (k_store.data, v_store.data, k_store.scales, v_store.scales)
            return self._attend_in_place(q, *data, window, scale, sinks, alibi)
        if not plan.decodes or v_store is None:  # MLA: two scales per row, no single one to fold
            return super()._attend(q, k_store, v_store, window, scale, sinks, alibi)
        # Prefill chunks: the base class, with the decodes taken out of its plan (its masks memo is
        # shared, so they are still built once per step). Then the decode rows of its output.
        self.plan = replace(plan, decodes=[])
        try:
            out = super()._attend(q, k_store, v_store, window, scale, sinks, alibi)
        finally:
            self.plan = plan
        for g, dec in enumerate(plan.decodes):
            self._attend_decode(out[0], q[0], g, dec, k_store, v_store, window, scale, sinks, alibi)
        return out

    def _attend_decode(
        self,
        out: Tensor,
        queries: Tensor,
        g: int,
        dec: DecodeGroup,
        k_store: QuantStore,
        v_store: QuantStore,
        window: int | None,
        scale: float | None,
        sinks: Tensor | None = None,
        alibi: Tensor | None = None,
    ) -> None:
        """One decode group as in `PagedKVCache._attend`, with the scales folded: q.(s_k k) = s_k (q.k),
        and sum p (s_v v) = sum (p s_v) v. int8 values convert exactly to bfloat16 / float32."""
        plan: StepPlan = self.plan
        kv_heads, dim = k_store.data.shape[0], k_store.data.shape[-1]
        heads, group = queries.shape[0], queries.shape[0] // kv_heads
        keys, k_scales = self._gather_int8(k_store, dec.tables)
        values, v_scales = self._gather_int8(v_store, dec.tables)
        qd = queries.index_select(1, dec.index).view(kv_heads, group, -1, dim).transpose(1, 2)
        scores = torch.matmul(qd, keys.to(queries.dtype).transpose(-1, -2)).float()  # [Hkv, B, G, L]
        # [Hkv, B, L, 1] -> [Hkv, B, 1, L]: one scale per key, the same for the group's G queries.
        scores.mul_(k_scales.float().transpose(-1, -2) * (scale if scale is not None else dim**-0.5))
        if self.softcap:  # Gemma 2's attention-score soft-capping, on the scaled scores
            scores = softcap_scores(scores, self.softcap)
        if alibi is not None:  # ALiBi: each head's slope times the distance (gathered key slot l is position l)
            keys_at = torch.arange(keys.shape[2], device=scores.device).view(1, 1, 1, -1)
            scores = scores + alibi_bias(alibi.view(kv_heads, 1, group, 1), dec.positions.view(1, -1, 1, 1), keys_at)
        mask = plan.mask(("decode", g), dec.positions, keys.shape[2], window)  # [B, L]
        scores.masked_fill_(~mask[None, :, None, :], float("-inf"))
        column = None if sinks is None else sinks.view(kv_heads, 1, group, 1)  # GPT-OSS's sinks
        probs = sink_softmax(scores, column).mul_(v_scales.float().transpose(-1, -2))
        od = torch.matmul(probs.to(queries.dtype), values.to(queries.dtype))  # [Hkv, B, G, D]
        out.index_copy_(1, dec.index, od.transpose(1, 2).reshape(heads, -1, dim))


def sequence_plan(table: list[int], start: int, num_tokens: int, block_size: int, device: str = "cpu") -> StepPlan:
    """The plan of one step of a single sequence: `num_tokens` tokens from position `start`, with the
    sequence's block table `table` (long enough to hold them). One token is a decode, more a prefill
    chunk over everything before it. Drives a paged cache without the scheduler (tests, bench/kv_int8.py)."""
    span = range(start, start + num_tokens)
    slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in span], device=device)
    blocks = torch.tensor(table[: -(-(start + num_tokens) // block_size)], device=device)
    positions = torch.tensor(list(span), device=device)
    if num_tokens == 1:
        return StepPlan(slots, [DecodeGroup(torch.tensor([0], device=device), blocks[None], positions)], [])
    return StepPlan(slots, [], [PrefillChunk(0, num_tokens, blocks, positions, start + num_tokens)])
