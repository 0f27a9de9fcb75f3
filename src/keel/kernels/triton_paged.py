"""Paged attention as Triton kernels: the CUDA decode backend (keel.serve.attention_backends).

The same contract as keel's CPU operator `keel::paged_attention`: every query token (a decode row or a
row of a chunk) walks its sequence's block table and reads the keys and values where they lie in the
paged stores, with an online softmax, causal by position and within a sliding window or chunk when one is set.
One program per (token, KV head, 16 of the group's query heads, split of the context): those heads share
each K/V load and go through `tl.dot` together (a group under 16 is padded to 16, the smallest tile
`tl.dot` takes; an MLA group of 64-128 heads in one tile would not fit in shared memory). A store without
values (multi-head latent attention) reads each row's first `v_dim` channels as its value.

Each iteration reads a tile of several blocks' keys (their slots looked up in the table together), so a
program keeps more loads in flight than one block's 16 rows give it. When a step has too few (token, KV
head) pairs to fill the device (decode at small batches), the context is split across programs as well
(flash-decoding): each split writes its unnormalised output with its running maximum and sum, and a second
kernel combines the splits. The split count depends only on the shapes (tokens, heads, the table's width),
so a CUDA graph captured for a batch bucket replays it unchanged.

Precision: on CUDA, bf16 (or fp16) queries over rows of the same dtype are multiplied on the tensor cores
with float32 sums, the probabilities rounded to that dtype before they weight the values, as flash
attention does. Any other mix (a float32 model, a bf16 cache under a float32 model) is multiplied in
float32 at IEEE precision (no TF32), so a float32 model's greedy tokens match the reference. Both paths
were timed side by side on an H200 (bench/triton_decode.py, docs/BENCHMARKS.md): at 64-256 decode rows
float32 products made the kernel 2-5x slower than the bytes it reads; bf16 ones brought it within about
2.5x of the copy roofline. Triton's CPU interpreter cannot multiply bf16 tiles, so there every dtype takes
the float32 path (tests/test_cuda.py checks the tensor-core path on a device). With `softcap` > 0
each score becomes softcap * tanh(score / softcap) before the mask (Gemma 2's attention soft-capping).
With `sinks`, each query head's sink logit joins its softmax's denominator (GPT-OSS): a split context
counts it in the combining kernel, an unsplit one starts its online softmax from it.
With `alibi` (ALiBi's slopes, Bloom, MPT, Falcon-RW), each score then gains its head's slope times the key's
distance back from the query.

Under `TRITON_INTERPRET=1` the kernels run on CPU tensors through Triton's interpreter: that is how
`make test` checks them on machines without a GPU (tests/test_attention_backends.py).

Triton is imported on first use (torch's CUDA wheels bring it; on CPU it is a test dependency).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor


def available() -> bool:
    """Whether Triton can be imported here."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _kernels():  # noqa: ANN202 - triton.JITFunctions, typed only once triton is imported
    import triton
    import triton.language as tl

    @triton.jit
    def paged_attention_kernel(
        q_ptr,  # [T, H, D]
        k_ptr,  # [H_kv, slots, D]
        v_ptr,  # [H_kv, slots, Dv] (the key store itself where there are no values)
        out_ptr,  # [T, H, Dv]; with splits: [T, H, splits, v_pad] float32, unnormalised
        max_ptr,  # [T, H, splits] float32 (used with splits only)
        sum_ptr,  # [T, H, splits] float32 (used with splits only)
        tables_ptr,  # [R, W] int32 or int64
        table_of_ptr,  # [T] int64: each token's row of `tables` (unless rows_are_tokens)
        positions_ptr,  # [T] int64
        sinks_ptr,  # [H] float32 (read with start_at_sinks only)
        alibi_ptr,  # [H] float32 ALiBi slopes (read with use_alibi only)
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
        chunk,
        softcap,
        splits,
        group: tl.constexpr,  # query heads per KV head
        head_dim: tl.constexpr,
        v_dim: tl.constexpr,
        block_size: tl.constexpr,
        tile_keys: tl.constexpr,  # keys an iteration reads: a multiple of block_size (both powers of two)
        heads_pad: tl.constexpr,
        dim_pad: tl.constexpr,
        v_pad: tl.constexpr,
        use_softcap: tl.constexpr,
        start_at_sinks: tl.constexpr,  # sinks and no splits (split parts leave them to the combining kernel)
        use_alibi: tl.constexpr,
        split_output: tl.constexpr,
        rows_are_tokens: tl.constexpr,  # token t reads table row t (table_of_ptr is not read)
        half_dot: tl.constexpr,  # queries and rows of one 16-bit dtype, multiplied as such
    ):
        token = tl.program_id(0).to(tl.int64)  # int64: offsets past 2^31 elements in large stores
        kv_head = tl.program_id(1).to(tl.int64)
        tile = tl.program_id(2) // splits  # which 16 of the group's query heads
        split = tl.program_id(2) % splits
        row = token if rows_are_tokens else tl.load(table_of_ptr + token)
        position = tl.load(positions_ptr + token)

        heads = tile * heads_pad + tl.arange(0, heads_pad)
        dims = tl.arange(0, dim_pad)
        vdims = tl.arange(0, v_pad)
        offsets = tl.arange(0, tile_keys)
        head_ok = heads < group
        dim_ok = dims < head_dim
        vdim_ok = vdims < v_dim

        q_rows = q_ptr + token * stride_qt + (kv_head * group + heads)[:, None] * stride_qh + dims[None, :]
        q = tl.load(q_rows, mask=head_ok[:, None] & dim_ok[None, :], other=0.0)
        if not half_dot:
            q = q.to(tl.float32)

        if start_at_sinks:  # the sink as a logit already summed (exp(s - s) = 1), rescaled like the keys
            maximum = tl.load(sinks_ptr + kv_head * group + heads, mask=head_ok, other=0.0)
            total = tl.full([heads_pad], 1.0, tl.float32)
        else:
            maximum = tl.full([heads_pad], float("-inf"), tl.float32)
            total = tl.zeros([heads_pad], tl.float32)
        acc = tl.zeros([heads_pad, v_pad], tl.float32)
        if use_alibi:
            slopes = tl.load(alibi_ptr + kv_head * group + heads, mask=head_ok, other=0.0)

        # window, chunk: the host passes a span longer than any sequence for the one not set (no branch here).
        # The visible keys' blocks [first, last] are shared out among the splits, a contiguous run each,
        # which a split reads `tile_keys` at a time (every tile starts on a block that holds a visible key).
        first_position = tl.maximum(tl.maximum(position - window + 1, position - position % chunk), 0)
        first = first_position // block_size
        last = position // block_size
        per_split = (last - first + splits) // splits
        start = (first + split * per_split) * block_size
        stop = tl.minimum(first + (split + 1) * per_split, last + 1) * block_size
        for tile_start in range(start, stop, tile_keys):
            key_positions = tile_start + offsets
            visible = (key_positions <= position) & (key_positions >= first_position) & (key_positions < stop)
            table_entries = tables_ptr + row * stride_table + key_positions // block_size
            blocks = tl.load(table_entries, mask=visible, other=0).to(tl.int64)
            slots = blocks * block_size + key_positions % block_size
            k = tl.load(
                k_ptr + kv_head * stride_kh + slots[:, None] * stride_ks + dims[None, :],
                mask=visible[:, None] & dim_ok[None, :],
                other=0.0,
            )
            v = tl.load(
                v_ptr + kv_head * stride_vh + slots[:, None] * stride_vs + vdims[None, :],
                mask=visible[:, None] & vdim_ok[None, :],
                other=0.0,
            )
            if half_dot:  # 16-bit operands on the tensor cores, float32 sums (as flash attention)
                scores = tl.dot(q, tl.trans(k)) * scale
            else:
                scores = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee") * scale
            if use_softcap:  # tanh(x) = 1 - 2 / (exp(2x) + 1), exact at both ends in float32
                scores = softcap * (1.0 - 2.0 / (tl.exp(2.0 * scores / softcap) + 1.0))
            if use_alibi:  # each head's slope times each key's distance back from the query
                scores = scores + slopes[:, None] * (key_positions - position).to(tl.float32)[None, :]
            scores = tl.where(visible[None, :], scores, float("-inf"))
            new_maximum = tl.maximum(maximum, tl.max(scores, 1))
            # a split's first tile starts from -inf: exp(-inf - finite) = 0 (every tile has a visible key)
            correction = tl.exp(maximum - new_maximum)
            p = tl.exp(scores - new_maximum[:, None])
            total = total * correction + tl.sum(p, 1)
            if half_dot:
                acc = acc * correction[:, None] + tl.dot(p.to(v.dtype), v)
            else:
                acc = acc * correction[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
            maximum = new_maximum

        if split_output:
            # [T, H, splits, v_pad]: the combining kernel reads each head's splits as one tile
            part = (token * stride_ot + (kv_head * group + heads) * stride_oh) + split * v_pad
            tl.store(out_ptr + part[:, None] + vdims[None, :], acc, mask=head_ok[:, None])
            stat = (token * stride_ot // v_pad + (kv_head * group + heads) * stride_oh // v_pad) + split
            tl.store(max_ptr + stat, maximum, mask=head_ok)
            tl.store(sum_ptr + stat, total, mask=head_ok)
        else:
            out = acc / total[:, None]
            out_rows = out_ptr + token * stride_ot + (kv_head * group + heads)[:, None] * stride_oh + vdims[None, :]
            tl.store(out_rows, out.to(out_ptr.dtype.element_ty), mask=head_ok[:, None] & vdim_ok[None, :])

    @triton.jit
    def combine_splits_kernel(
        part_ptr,  # [T, H, splits, v_pad] float32
        max_ptr,  # [T, H, splits] float32
        sum_ptr,  # [T, H, splits] float32
        out_ptr,  # [T, H, Dv]
        sinks_ptr,  # [H] float32 (read with use_sinks only)
        stride_ot,
        stride_oh,
        heads: tl.constexpr,
        splits: tl.constexpr,
        splits_pad: tl.constexpr,
        v_dim: tl.constexpr,
        v_pad: tl.constexpr,
        use_sinks: tl.constexpr,
    ):
        token = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1).to(tl.int64)
        index = tl.arange(0, splits_pad)
        vdims = tl.arange(0, v_pad)
        split_ok = index < splits
        stat = (token * heads + head) * splits + index
        maxima = tl.load(max_ptr + stat, mask=split_ok, other=float("-inf"))
        totals = tl.load(sum_ptr + stat, mask=split_ok, other=0.0)
        overall = tl.max(maxima, 0)
        if use_sinks:  # the head's sink joins the splits' sums here, once (it weighs no value)
            sink = tl.load(sinks_ptr + head)
            overall = tl.maximum(overall, sink)
            weights = tl.exp(maxima - overall)
            denominator = tl.sum(totals * weights, 0) + tl.exp(sink - overall)
        else:
            weights = tl.exp(maxima - overall)  # an empty split (-inf) weighs 0
            denominator = tl.sum(totals * weights, 0)
        part = tl.load(part_ptr + stat[:, None] * v_pad + vdims[None, :], mask=split_ok[:, None], other=0.0)
        out = tl.sum(part * weights[:, None], 0) / denominator
        tl.store(out_ptr + token * stride_ot + head * stride_oh + vdims, out.to(out_ptr.dtype.element_ty),
                 mask=vdims < v_dim)  # fmt: skip

    return paged_attention_kernel, combine_splits_kernel


_NO_WINDOW = 1 << 40  # a window no sequence reaches: every earlier position visible
_HEAD_TILE = 16  # query heads a program takes (tl.dot's smallest tile; padded where the group is smaller)
TILE_KEYS = 64  # keys an iteration reads (whole blocks: at least one); measured in bench/triton_decode.py
HALF_DOT = True  # on CUDA, bf16/fp16 products on the tensor cores (see the module docstring)
_PROGRAMS_PER_SM = 4  # enough resident programs per multiprocessor to cover the loads' latency
_MAX_SPLITS = 64


def block_size_refusal(block_size: int) -> str | None:
    """Why the kernel cannot tile blocks of `block_size` tokens (None: it can): `tl.dot` takes power-of-two
    sizes of at least 16."""
    if block_size < 16 or block_size & (block_size - 1):
        return f"the Triton paged attention needs a power-of-two block size of at least 16, not {block_size}"
    return None


def _pad(n: int, least: int) -> int:
    return max(least, 1 << (n - 1).bit_length())


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def context_splits(programs: int, blocks: int, device: torch.device) -> int:
    """How many parts each (token, KV head, head tile)'s context is split into: enough programs to give
    every multiprocessor a few, never more than the table's width in blocks. From shapes only (no
    positions), so a captured CUDA graph replays the same grid. One on CPU (the interpreter)."""
    if device.type != "cuda":
        return 1
    wanted = -(-_PROGRAMS_PER_SM * _multiprocessors(device) // programs)
    return max(1, min(wanted, blocks, _MAX_SPLITS))


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
    softcap: float = 0.0,
    splits: int | None = None,
    out: Tensor | None = None,
    tile_keys: int | None = None,
    half_dot: bool | None = None,
    sinks: Tensor | None = None,
    alibi: Tensor | None = None,
) -> Tensor:
    """queries [T, H, D] over the paged stores ([H_kv, slots, D], values [H_kv, slots, Dv] or None: the
    keys' first `v_dim` channels) -> [T, H, Dv] in the queries' dtype. tables [R, W] int32, table_of [T]
    (each token's row), positions [T] (each token's position: it sees keys at positions <= its own and,
    with window > 0, within `window` tokens; with window < 0, within its chunk of -window positions).
    block_size must be a power of two of at least 16. softcap > 0 caps each score at softcap * tanh(score /
    softcap). splits: how many programs share one context
    (default: `context_splits`; tests force it). out: where to write ([T, H, Dv], any strides but the
    last; e.g. a transposed view of the [H, T, Dv] layout the model wants, sparing a copy). tile_keys: keys
    an iteration reads (default `TILE_KEYS`); half_dot: multiply 16-bit queries and rows of one dtype on the
    tensor cores with float32 sums (default `HALF_DOT`; float32 at IEEE precision otherwise). The last two
    are for bench/triton_decode.py's comparison. sinks: None or float32 [H] on the queries' device, one
    logit per query head that joins its softmax (unscaled, uncapped, never masked) and weighs no value
    (GPT-OSS's attention sinks); as `keel::paged_attention`'s. alibi: None or float32 [H] on the queries' device,
    ALiBi's slope of each query head: each (capped) score gains slope * (key position - query position)."""
    refusal = block_size_refusal(block_size)
    if refusal is not None:
        raise ValueError(refusal)
    tokens, heads, head_dim = queries.shape
    sinks, alibi = _per_head(sinks, "sinks", queries), _per_head(alibi, "alibi", queries)
    kv_heads = k_store.shape[0]
    values = k_store if v_store is None else v_store
    if queries.stride(-1) != 1:
        queries = queries.contiguous()
    if out is None:
        out = queries.new_empty(tokens, heads, v_dim)
    if tokens == 0:
        return out
    group = heads // kv_heads
    head_tiles = -(-group // _HEAD_TILE)
    if splits is None:
        splits = context_splits(tokens * kv_heads * head_tiles, tables.shape[1], queries.device)
    v_pad = _pad(v_dim, 16)
    tile_keys = max(TILE_KEYS if tile_keys is None else tile_keys, block_size)
    same_half = queries.dtype in (torch.bfloat16, torch.float16) and queries.dtype == k_store.dtype == values.dtype
    half_dot = same_half and (HALF_DOT and queries.is_cuda if half_dot is None else half_dot)
    attend, combine = _kernels()
    if splits > 1:
        target = torch.empty(tokens, heads, splits, v_pad, dtype=torch.float32, device=queries.device)
        maxima = torch.empty(tokens, heads, splits, dtype=torch.float32, device=queries.device)
        totals = torch.empty_like(maxima)
    else:
        target, maxima, totals = out, out, out
    attend[(tokens, kv_heads, head_tiles * splits)](
        queries, k_store, values, target, maxima, totals,
        tables, positions if table_of is None else table_of, positions,
        queries if sinks is None else sinks,  # a pointer never read without sinks
        queries if alibi is None else alibi,  # nor this one without slopes
        queries.stride(0), queries.stride(1),
        k_store.stride(0), k_store.stride(1),
        values.stride(0), values.stride(1),
        target.stride(0), target.stride(1),
        tables.stride(0),
        scale, window if window > 0 else _NO_WINDOW, -window if window < 0 else _NO_WINDOW, softcap, splits,
        group=group, head_dim=head_dim, v_dim=v_dim, block_size=block_size, tile_keys=tile_keys, half_dot=half_dot,
        heads_pad=_HEAD_TILE, dim_pad=_pad(head_dim, 16), v_pad=v_pad,
        use_softcap=softcap > 0, start_at_sinks=sinks is not None and splits == 1, use_alibi=alibi is not None,
        split_output=splits > 1,
        rows_are_tokens=table_of is None,
    )  # fmt: skip
    if splits > 1:
        combine[(tokens, heads)](
            target, maxima, totals, out, queries if sinks is None else sinks, out.stride(0), out.stride(1),
            heads=heads, splits=splits, splits_pad=_pad(splits, 2), v_dim=v_dim, v_pad=v_pad,
            use_sinks=sinks is not None,
        )  # fmt: skip
    return out


def _per_head(values: Tensor | None, name: str, queries: Tensor) -> Tensor | None:
    """`values` (sinks, slopes) checked to be float32 [H] on the queries' device, contiguous; None stays None."""
    if values is None:
        return None
    heads = queries.shape[1]
    if values.dtype != torch.float32 or values.shape != (heads,) or values.device != queries.device:
        raise ValueError(
            f"{name} must be float32 [{heads}] (one per query head) on {queries.device}, "
            f"got {values.dtype} {list(values.shape)} on {values.device}"
        )
    return values.contiguous()
