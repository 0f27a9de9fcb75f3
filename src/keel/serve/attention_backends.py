"""Attention backends of the paged KV cache: which code attends a step's queries over the paged stores.

The model never changes: its attention layers call the cache (`KVCache.attend`), and the cache asks
`attention_backend` which backend reads its stores, from what keel.platform and the store report:

- `kernels`: keel's C++ paged-attention operator (keel.kernels) on CPU stores of float32, bfloat16 or
  int8 rows: every query, decodes and prefill chunks alike, reads K/V where they lie, the scores
  soft-capped where the model caps them (Gemma 2's `attn_logit_softcapping`), with each head's softmax sink
  where the model has them (GPT-OSS), biased by each head's ALiBi slope times the distance where the model
  has ALiBi (Bloom, MPT, Falcon-RW: its `alibi`).
- `triton`: on CUDA, one-token decodes through a Triton kernel that walks each row's block table
  (keel.kernels.triton_paged); prefill chunks through `scaled_dot_product_attention` with a causal
  mask aligned to the chunk's end (`causal_lower_right`: torch's fused flash / memory-efficient
  kernels, no mask tensor), where no sliding window applies. With score soft-capping or softmax sinks
  (GPT-OSS) or ALiBi the decode kernel caps the scores (its `softcap`), counts the sinks (its `sinks`) or adds the
  biases (its `alibi`), and chunks take `attend_chunk`'s explicit scores.
- `torch`: the portable path everywhere else (and the reference): each group of decodes gathers its
  blocks once per layer and attends with batched matmuls; chunks as under `triton`.

`KEEL_ATTENTION_BACKEND=kernels|triton|torch` forces one (where it cannot read the store: an error
naming why). The Triton kernel also runs on CPU tensors under `TRITON_INTERPRET=1`, which is how the
test suite checks it on machines without a GPU.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from keel import kernels
from keel.errors import KeelError
from keel.kernels import triton_paged
from keel.model.attention import alibi_bias, explicit_attention, sdpa_kv_heads

ENV = "KEEL_ATTENTION_BACKEND"
BACKENDS = ("kernels", "triton", "torch")
_FLOAT_ROWS = (torch.float32, torch.bfloat16, torch.float16)
_CHUNK_BACKENDS_CUDA = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def _kernels_refusal(store: Tensor, head_dim: int, block_size: int) -> str | None:
    if store.device.type != "cpu":
        return f"keel's C++ kernels read CPU stores, not {store.device.type}"
    if not kernels.active():
        return "keel's C++ kernels are off (KEEL_KERNELS=0, or the library was not built)"
    if store.dtype not in (torch.float32, torch.bfloat16, torch.int8):
        return f"keel's paged-attention kernel reads float32, bfloat16 or int8 rows, not {store.dtype}"
    if head_dim > 576 or block_size > 64:
        return "keel's paged-attention kernel takes head dims up to 576 and blocks up to 64 tokens"
    return None


def _triton_refusal(store: Tensor, head_dim: int, block_size: int) -> str | None:
    if store.dtype not in _FLOAT_ROWS:
        return f"the Triton paged attention reads float rows, not {store.dtype}"
    refusal = triton_paged.block_size_refusal(block_size)
    if refusal is not None:
        return refusal
    if not triton_paged.available():
        return "Triton is not installed"
    if store.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return "Triton runs on CUDA stores (on CPU only under TRITON_INTERPRET=1)"
    return None


_REFUSALS = {"kernels": _kernels_refusal, "triton": _triton_refusal, "torch": lambda *_: None}


def attention_backend(store: Tensor, head_dim: int, block_size: int) -> str:
    """The backend that attends over `store` (one layer's key rows, [H_kv, slots, D]): the forced one
    (KEEL_ATTENTION_BACKEND) or the fastest that reads it (every backend soft-caps scores where the model
    caps them, so the cap does not choose). Inside a torch.compile trace the C++
    kernels are left to the op that wraps them (keel.serve.compiled_decode)."""
    forced = os.environ.get(ENV)
    if forced:
        if forced not in BACKENDS:
            raise KeelError(f"{ENV}={forced!r}: expected one of {', '.join(BACKENDS)}")
        reason = _REFUSALS[forced](store, head_dim, block_size)
        if reason is not None:
            raise KeelError(f"{ENV}={forced}: {reason}")
        return forced
    if store.device.type == "cpu":
        if _kernels_refusal(store, head_dim, block_size) is None and not torch.compiler.is_compiling():
            return "kernels"
        return "torch"
    if store.device.type == "cuda" and _triton_refusal(store, head_dim, block_size) is None:
        return "triton"
    return "torch"


def attend_causal(queries: Tensor, keys: Tensor, values: Tensor, scale: float | None) -> Tensor:
    """A batch of sequences' queries [N, H, L, D] over their own keys [N, H_kv, L, D] and values, causal from
    the start (the queries are the keys' positions) -> [N, H, L, Dv]: one fused SDPA call with no mask tensor
    (on CUDA flash or memory-efficient, not cuDNN: see `attend_chunk`)."""
    keys, values = keys.to(queries.dtype), values.to(queries.dtype)
    return _fused_attention(queries, keys, values, None, scale)


def attend_chunk(
    queries: Tensor,
    keys: Tensor,
    values: Tensor,
    mask: Tensor | None,
    scale: float | None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
    alibi: Tensor | None = None,
    positions: Tensor | None = None,
) -> Tensor:
    """One prefill chunk's queries [1, H, C, D] over its sequence's gathered keys [1, H_kv, L, D] (the last C
    of which are the chunk's own) -> [1, H, C, Dv]. Without a mask (no sliding window) the causal mask is
    aligned to the chunk's end and passed as torch's `causal_lower_right` bias, which SDPA runs in its
    fused kernels without building an [C, L] tensor; with one, the mask as given. With `softcap` (Gemma 2's
    score soft-capping), `sinks` (GPT-OSS's softmax sinks, [H]) or `alibi` (ALiBi's slopes [H], with the queries'
    `positions` [C]; key l is position l), which SDPA cannot do, the scores are computed explicitly
    (`explicit_attention`)."""
    from torch.nn.attention.bias import causal_lower_right

    keys, values = keys.to(queries.dtype), values.to(queries.dtype)  # a bfloat16 cache of a float32 model
    if softcap or sinks is not None or alibi is not None:
        bias = None
        if alibi is not None:
            keys_at = torch.arange(keys.shape[2], device=queries.device)
            bias = alibi_bias(alibi.view(1, -1, 1, 1), positions.view(1, 1, -1, 1), keys_at.view(1, 1, 1, -1))
        if mask is None:  # causal, aligned to the chunk's end: query i sees keys up to L - C + i
            chunk, length = queries.shape[2], keys.shape[2]
            mask = torch.ones(chunk, length, dtype=torch.bool, device=queries.device).tril(length - chunk)
        return explicit_attention(queries, keys, values, mask, softcap, scale, sinks, bias)
    bias = causal_lower_right(queries.shape[2], keys.shape[2]) if mask is None else mask
    return _fused_attention(queries, keys, values, bias, scale)


def _fused_attention(queries: Tensor, keys: Tensor, values: Tensor, bias: object, scale: float | None) -> Tensor:
    """SDPA of [N, H, Q, D] queries over [N, H_kv, L, D] keys (grouped heads as they are), causal from the start
    where `bias` is None, else under the mask or bias given."""
    keys, values = sdpa_kv_heads(queries, keys, values)
    options = dict(attn_mask=bias, is_causal=bias is None, enable_gqa=queries.shape[1] != keys.shape[1], scale=scale)
    if not queries.is_cuda:
        return torch.nn.functional.scaled_dot_product_attention(queries, keys, values, **options)
    # Not cuDNN's kernel, which SDPA prefers on Hopper: it builds a plan per new shape, and every chunk
    # length is new (the host time of a prefill-heavy step on an H200: docs/BENCHMARKS.md, issue 23).
    with sdpa_kernel(_CHUNK_BACKENDS_CUDA):
        return torch.nn.functional.scaled_dot_product_attention(queries, keys, values, **options)
