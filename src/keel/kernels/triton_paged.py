"""Paged attention as a Triton kernel: the CUDA decode backend (keel.serve.attention_backends).

The same contract as keel's CPU operator `keel::paged_attention`: every query token (a decode row or a
row of a chunk) walks its sequence's block table and reads the keys and values where they lie in the
paged stores, with an online softmax, causal by position and within a sliding window when one is set.
One program per (token, KV head, 16 of the group's query heads): those heads share each block's K/V
load and go through `tl.dot` together (a group under 16 is padded to 16, the smallest tile `tl.dot`
takes; an MLA group of 64-128 heads in one tile would not fit in shared memory). A store without
values (multi-head latent attention) reads each row's first `v_dim` channels as its value.

Rows of any float dtype are multiplied in float32 at IEEE precision (no TF32; bf16 and fp16 rows are
converted as they are loaded), as keel's CPU kernel does: decode attention is bound by reading the
cache, not by the products, and a float32 model's greedy tokens match the reference.

Under `TRITON_INTERPRET=1` the kernel runs on CPU tensors through Triton's interpreter: that is how
`make test` checks it on machines without a GPU (tests/test_attention_backends.py).

Triton is imported on first use (torch's CUDA wheels bring it; on CPU it is a test dependency).
"""

from __future__ import annotations

import functools

from torch import Tensor


def available() -> bool:
    """Whether Triton can be imported here."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _kernel():  # noqa: ANN202 - a triton.JITFunction, typed only once triton is imported
    import triton
    import triton.language as tl

    @triton.jit
    def paged_attention_kernel(
        q_ptr,  # [T, H, D]
        k_ptr,  # [H_kv, slots, D]
        v_ptr,  # [H_kv, slots, Dv] (the key store itself where there are no values)
        out_ptr,  # [T, H, Dv]
        tables_ptr,  # [R, W] int32
        table_of_ptr,  # [T] int64: each token's row of `tables`
        positions_ptr,  # [T] int64
        stride_qt,
        stride_qh,
        stride_kh,
        stride_ks,
        stride_vh,
        stride_vs,
        stride_ot,
        stride_oh,
        stride_table,
        scale,
        window,
        group: tl.constexpr,  # query heads per KV head
        head_dim: tl.constexpr,
        v_dim: tl.constexpr,
        block_size: tl.constexpr,
        heads_pad: tl.constexpr,
        dim_pad: tl.constexpr,
        v_pad: tl.constexpr,
    ):
        token = tl.program_id(0).to(tl.int64)  # int64: offsets past 2^31 elements in large stores
        kv_head = tl.program_id(1).to(tl.int64)
        tile = tl.program_id(2)  # which 16 of the group's query heads
        row = tl.load(table_of_ptr + token)
        position = tl.load(positions_ptr + token)

        heads = tile * heads_pad + tl.arange(0, heads_pad)
        dims = tl.arange(0, dim_pad)
        vdims = tl.arange(0, v_pad)
        offsets = tl.arange(0, block_size)
        head_ok = heads < group
        dim_ok = dims < head_dim
        vdim_ok = vdims < v_dim

        q_rows = q_ptr + token * stride_qt + (kv_head * group + heads)[:, None] * stride_qh + dims[None, :]
        q = tl.load(q_rows, mask=head_ok[:, None] & dim_ok[None, :], other=0.0).to(tl.float32)

        maximum = tl.full([heads_pad], float("-inf"), tl.float32)
        total = tl.zeros([heads_pad], tl.float32)
        acc = tl.zeros([heads_pad, v_pad], tl.float32)

        # window: the host passes a span longer than any sequence when there is none (no branch here)
        first = tl.maximum(position - window + 1, 0) // block_size
        last = position // block_size
        for b in range(first, last + 1):
            block = tl.load(tables_ptr + row * stride_table + b).to(tl.int64)
            slots = block * block_size + offsets
            key_positions = b * block_size + offsets
            visible = (key_positions <= position) & (key_positions > position - window)
            k = tl.load(
                k_ptr + kv_head * stride_kh + slots[:, None] * stride_ks + dims[None, :],
                mask=visible[:, None] & dim_ok[None, :],
                other=0.0,
            ).to(tl.float32)
            scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
            scores = tl.where(visible[None, :], scores, float("-inf"))
            new_maximum = tl.maximum(maximum, tl.max(scores, 1))
            correction = tl.exp(maximum - new_maximum)
            p = tl.exp(scores - new_maximum[:, None])
            total = total * correction + tl.sum(p, 1)
            v = tl.load(
                v_ptr + kv_head * stride_vh + slots[:, None] * stride_vs + vdims[None, :],
                mask=visible[:, None] & vdim_ok[None, :],
                other=0.0,
            ).to(tl.float32)
            acc = acc * correction[:, None] + tl.dot(p, v, input_precision="ieee")
            maximum = new_maximum

        out = acc / total[:, None]
        out_rows = out_ptr + token * stride_ot + (kv_head * group + heads)[:, None] * stride_oh + vdims[None, :]
        tl.store(out_rows, out.to(out_ptr.dtype.element_ty), mask=head_ok[:, None] & vdim_ok[None, :])

    return paged_attention_kernel


_NO_WINDOW = 1 << 40  # a window no sequence reaches: every earlier position visible


_HEAD_TILE = 16  # query heads a program takes (tl.dot's smallest tile; padded where the group is smaller)


def block_size_refusal(block_size: int) -> str | None:
    """Why the kernel cannot tile blocks of `block_size` tokens (None: it can): `tl.dot` takes power-of-two
    sizes of at least 16."""
    if block_size < 16 or block_size & (block_size - 1):
        return f"the Triton paged attention needs a power-of-two block size of at least 16, not {block_size}"
    return None


def _pad(n: int, least: int) -> int:
    return max(least, 1 << (n - 1).bit_length())


def paged_attention(
    queries: Tensor,
    k_store: Tensor,
    v_store: Tensor | None,
    tables: Tensor,
    table_of: Tensor,
    positions: Tensor,
    block_size: int,
    window: int,
    scale: float,
    v_dim: int,
) -> Tensor:
    """queries [T, H, D] over the paged stores ([H_kv, slots, D], values [H_kv, slots, Dv] or None: the
    keys' first `v_dim` channels) -> [T, H, Dv] in the queries' dtype. tables [R, W] int32, table_of [T]
    (each token's row), positions [T] (each token's position: it sees keys at positions <= its own and,
    with window > 0, within `window` tokens). block_size must be a power of two of at least 16."""
    refusal = block_size_refusal(block_size)
    if refusal is not None:
        raise ValueError(refusal)
    tokens, heads, head_dim = queries.shape
    kv_heads = k_store.shape[0]
    values = k_store if v_store is None else v_store
    queries = queries.contiguous()
    out = queries.new_empty(tokens, heads, v_dim)
    if tokens == 0:
        return out
    group = heads // kv_heads
    _kernel()[(tokens, kv_heads, -(-group // _HEAD_TILE))](
        queries, k_store, values, out,
        tables, table_of, positions,
        queries.stride(0), queries.stride(1),
        k_store.stride(0), k_store.stride(1),
        values.stride(0), values.stride(1),
        out.stride(0), out.stride(1),
        tables.stride(0),
        scale, window if window > 0 else _NO_WINDOW,
        group=group, head_dim=head_dim, v_dim=v_dim, block_size=block_size,
        heads_pad=_HEAD_TILE, dim_pad=_pad(head_dim, 16), v_pad=_pad(v_dim, 16),
    )  # fmt: skip
    return out
