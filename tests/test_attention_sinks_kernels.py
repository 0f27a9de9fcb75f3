"""Attention sinks (GPT-OSS: a learned logit per query head that joins the head's softmax, unscaled, uncapped and
never masked, and weighs no value) in keel's two paged-attention kernels: the C++ operator `keel::paged_attention`
at every ISA level this machine runs (its decode rows, its prefill tiles, windows, float32, bfloat16, int8 and
latent stores, GQA groups sharing each K/V read) and the Triton kernel (interpreted on CPU), with its context
whole and split across programs. The reference is float64: the explicit scores, the sink appended as one more
column, the softmax, the column dropped."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from keel import kernels
from keel.kernels import triton_paged
from test_kernels import random_store

pytestmark = pytest.mark.isa  # the C++ kernel's bodies differ by ISA: `make test` runs these again under avx2

LEVELS = kernels.levels_here() if kernels.enabled() else ()
needs_kernels = pytest.mark.skipif(not kernels.enabled(), reason=f"keel kernels: {kernels.status()}")
needs_triton = pytest.mark.skipif(not triton_paged.available(), reason="triton is not installed")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# Mixed signs, cycled over the heads so that the heads of one group differ: +5 and +12 take most of a head's
# probability, -20 next to none.
SINK_VALUES = (5.0, -20.0, 0.7, -1.3, 2.5, -0.2, 12.0)
BLOCK = 16
BLOCKS = 24
# Rows as (table of each row, position of each row) over tables of 4 blocks: one decode row; decodes at a
# sequence's first position, past a block boundary and at a table's last slot; prefill chunks (40 rows from
# position 9: tiles straddling blocks, the first mid-block; 23 rows from 0) beside lone rows.
LAYOUTS = {
    "one row": ([0], [37]),
    "decode rows": ([0, 1, 2], [0, 37, 63]),
    "chunks": ([1] + [0] * 40 + [2] * 23 + [2, 1], [30, *range(9, 49), *range(0, 23), 40, 31]),
}


def sinks_for(heads: int) -> torch.Tensor:
    return torch.tensor([SINK_VALUES[h % len(SINK_VALUES)] for h in range(heads)], dtype=torch.float32)


def reference(q, keys, values, tables, table_of, positions, window, scale, v_dim, sinks=None, softcap=0.0):
    """q [R, H, D] over dense keys/values [H_kv, slots, D] (values None: the keys' first v_dim channels) ->
    [R, H, v_dim] float64."""
    heads, kv_heads = q.shape[1], keys.shape[0]
    group = heads // kv_heads
    out = torch.empty(q.shape[0], heads, v_dim, dtype=torch.float64)
    for r in range(q.shape[0]):
        pos = int(positions[r])
        first = max(0, pos - window + 1) if window else 0
        table = tables[int(table_of[r])]
        slots = [int(table[p // BLOCK]) * BLOCK + p % BLOCK for p in range(first, pos + 1)]
        k = keys[:, slots].double()
        v = (keys[:, slots, :v_dim] if values is None else values[:, slots]).double()
        qq = q[r].double().view(kv_heads, group, -1)
        scores = (torch.einsum("kgd,kld->kgl", qq, k) * scale).reshape(heads, len(slots))
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        if sinks is not None:
            scores = torch.cat([scores, sinks.double()[:, None]], 1)
        weights = scores.softmax(-1)[:, : len(slots)].view(kv_heads, group, -1)
        out[r] = torch.einsum("kgl,kld->kgd", weights, v).reshape(heads, v_dim)
    return out


def case(layout: str, heads: int, dim: int, g: torch.Generator) -> tuple:
    """(q, tables, table_of, positions) for one of LAYOUTS."""
    rows_table, rows_position = LAYOUTS[layout]
    tables = torch.stack([torch.randperm(BLOCKS, generator=g)[:4] for _ in range(3)]).int()
    table_of, positions = torch.tensor(rows_table), torch.tensor(rows_position)
    return torch.randn(len(positions), heads, dim, generator=g), tables, table_of, positions


# ----------------------------------------------------------------------------- keel::paged_attention
@needs_kernels
@pytest.mark.parametrize("store", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("group", [1, 2, 4, 20])
@pytest.mark.parametrize("dim", [64, 24, 20])
@pytest.mark.parametrize("window", [0, 21])
def test_cpp_sinks_match_the_reference(store, layout, group, dim, window):
    """At every level this machine runs (one reference for all): three KV heads (odd head counts at group 1),
    groups sharing each K/V read (20: cut in 16s, the second slice's sinks offset), head dims of whole 16-lane
    vectors (every body), of 8-lane ones only (the AVX2 body at every vector level) and neither (the portable
    loops)."""
    g = torch.Generator().manual_seed(group * 100 + dim)
    kv_heads = 3
    heads = kv_heads * group
    stored, dense_k, dense_v = random_store(store, kv_heads, BLOCKS * BLOCK, dim, g)
    q, tables, table_of, positions = case(layout, heads, dim, g)
    sinks = sinks_for(heads)
    want = reference(q, dense_k, dense_v, tables, table_of, positions, window, 0.125, dim, sinks)
    for level in LEVELS:
        with kernels.using_level(level):
            got = torch.ops.keel.paged_attention(
                q, *stored, tables, table_of, positions, BLOCK, window, 0.125, dim, sinks=sinks
            )
        assert got.shape == (len(positions), heads, dim) and got.dtype == torch.float32
        assert (got.double() - want).abs().max().item() < 1e-5, level
    # The sinks took mass: the output is not the sinkless softmax's.
    plain = reference(q, dense_k, dense_v, tables, table_of, positions, window, 0.125, dim)
    assert (plain - want).abs().max().item() > 1e-2


@needs_kernels
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("layout", ["decode rows", "chunks"])
@pytest.mark.parametrize("softcap", [0.0, 0.5])
def test_cpp_sinks_of_a_latent_store_and_soft_capped_scores(level, layout, softcap):
    """Multi-head latent attention's store (the keys' first channels are the values) and soft-capped scores: the
    sink joins the softmax uncapped (a cap of 0.5 would bring +5 down to under 0.5)."""
    g = torch.Generator().manual_seed(5)
    kv_heads, group, dim, v_dim = 1, 8, 80, 64
    stored, dense_k, _ = random_store("latent", kv_heads, BLOCKS * BLOCK, dim, g)
    q, tables, table_of, positions = case(layout, kv_heads * group, dim, g)
    sinks = sinks_for(kv_heads * group)
    want = reference(q, dense_k, None, tables, table_of, positions, 0, 0.125, v_dim, sinks, softcap)
    with kernels.using_level(level):
        got = torch.ops.keel.paged_attention(
            q, *stored, tables, table_of, positions, BLOCK, 0, 0.125, v_dim, softcap, sinks
        )
    assert (got.double() - want).abs().max().item() < 1e-5


@needs_kernels
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("store", ["float32", "bfloat16"])
def test_cpp_tiles_with_sinks_are_bit_for_bit_their_rows(level, store):
    """A chunk attended in tiles gives exactly what its rows give attended one call each, sinks and all."""
    g = torch.Generator().manual_seed(3)
    stored, _, _ = random_store(store, 3, BLOCKS * BLOCK, 64, g)
    tables = torch.randperm(BLOCKS, generator=g)[:6][None].int()
    positions = torch.arange(7, 90)
    table_of = torch.zeros(len(positions), dtype=torch.long)
    q = torch.randn(len(positions), 9, 64, generator=g)
    sinks = sinks_for(9)
    with kernels.using_level(level):
        whole = torch.ops.keel.paged_attention(q, *stored, tables, table_of, positions, 16, 0, 0.125, 64, 0.0, sinks)
        alone = [
            torch.ops.keel.paged_attention(
                q[r : r + 1], *stored, tables, table_of[:1], positions[r : r + 1], 16, 0, 0.125, 64, 0.0, sinks
            )
            for r in range(len(positions))
        ]
    assert torch.equal(whole, torch.cat(alone))


@needs_kernels
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("store", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("dim", [64, 24, 20])
@pytest.mark.parametrize("softcap", [0.0, 0.5])
def test_cpp_without_sinks_is_unchanged(level, store, dim, softcap):
    """sinks=None is the call without them, the plain softmax; and a sink of -inf (it weighs nothing) gives the
    same bits: the sinks' start changes no rounding of the keys' sums."""
    g = torch.Generator().manual_seed(11)
    stored, dense_k, dense_v = random_store(store, 2, BLOCKS * BLOCK, dim, g)
    q, tables, table_of, positions = case("chunks", 6, dim, g)
    args = (q, *stored, tables, table_of, positions, BLOCK, 21, 0.125, dim, softcap)
    with kernels.using_level(level):
        before = torch.ops.keel.paged_attention(*args)
        none = torch.ops.keel.paged_attention(*args, None)
        nothing = torch.ops.keel.paged_attention(*args, torch.full((6,), float("-inf")))
    assert torch.equal(before, none) and torch.equal(before, nothing)
    want = reference(q, dense_k, dense_v, tables, table_of, positions, 21, 0.125, dim, softcap=softcap)
    assert (before.double() - want).abs().max().item() < 1e-5


@needs_kernels
def test_cpp_refuses_bad_sinks():
    g = torch.Generator().manual_seed(0)
    stored, _, _ = random_store("float32", 2, BLOCKS * BLOCK, 32, g)
    q, tables, table_of, positions = case("decode rows", 4, 32, g)
    args = (q, *stored, tables, table_of, positions, BLOCK, 0, 1.0, 32, 0.0)
    with pytest.raises(RuntimeError, match="sinks must be float32"):
        torch.ops.keel.paged_attention(*args, sinks_for(4).double())
    with pytest.raises(RuntimeError, match=r"sinks must be \[H\] = \[4\]"):
        torch.ops.keel.paged_attention(*args, sinks_for(2))
    with pytest.raises(RuntimeError, match=r"sinks must be \[H\] = \[4\]"):
        torch.ops.keel.paged_attention(*args, sinks_for(4)[None])
    with pytest.raises(RuntimeError, match="sinks must be contiguous"):
        torch.ops.keel.paged_attention(*args, sinks_for(8)[::2])


@needs_kernels
def test_the_fake_op_takes_sinks():
    """torch.compile traces the operator with fake tensors: its registered shape takes the sinks."""
    with FakeTensorMode():
        out = torch.ops.keel.paged_attention(
            torch.empty(3, 4, 32), torch.empty(2, 64, 32), torch.empty(2, 64, 32), None, None,
            torch.zeros(3, 4, dtype=torch.int32), None, torch.zeros(3, dtype=torch.long), 16, 0, 1.0, 24, 0.0,
            torch.empty(4),
        )  # fmt: skip
    assert out.shape == (3, 4, 24)


# ----------------------------------------------------------------------------- Triton
def triton_call(q, keys, values, tables, table_of, positions, window, scale, v_dim, **kwargs) -> torch.Tensor:
    on = [t.to(DEVICE) if torch.is_tensor(t) else t for t in (q, keys, values, tables, table_of, positions)]
    if kwargs.get("sinks") is not None:
        kwargs["sinks"] = kwargs["sinks"].to(DEVICE)
    return triton_paged.paged_attention(*on, BLOCK, window, scale, v_dim, **kwargs).cpu()


@needs_triton
@pytest.mark.parametrize(
    "layout, kv_heads, group, dim, dtype, window",
    [
        ("one row", 1, 1, 64, torch.float32, 0),
        ("decode rows", 3, 1, 24, torch.float32, 21),  # three heads, a head dim not a multiple of 16
        ("decode rows", 2, 2, 64, torch.bfloat16, 0),
        ("chunks", 3, 2, 24, torch.float32, 0),
        ("chunks", 1, 4, 64, torch.float32, 21),
        ("chunks", 2, 4, 64, torch.bfloat16, 21),
        ("decode rows", 1, 20, 24, torch.float32, 0),  # a group past one tile of 16 heads
    ],
)
@pytest.mark.parametrize("splits", [1, 4])
def test_triton_sinks_match_the_reference(layout, kv_heads, group, dim, dtype, window, splits):
    """With the context whole (the sink starts the online softmax) and split across 4 programs (some empty: a
    context of one to four blocks; the combining kernel counts the sink once)."""
    g = torch.Generator().manual_seed(kv_heads * 10 + group)
    heads = kv_heads * group
    (keys, values, _, _), dense_k, dense_v = random_store("float32", kv_heads, BLOCKS * BLOCK, dim, g)
    keys, values = keys.to(dtype), values.to(dtype)
    q, tables, table_of, positions = case(layout, heads, dim, g)
    q = q.to(dtype)
    sinks = sinks_for(heads)
    got = triton_call(q, keys, values, tables, table_of, positions, window, 0.125, dim, sinks=sinks, splits=splits)
    assert got.dtype == dtype and got.shape == (len(positions), heads, dim)
    want = reference(q.float(), keys.float(), values.float(), tables, table_of, positions, window, 0.125, dim, sinks)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.double(), want, atol=tolerance, rtol=tolerance)
    if kernels.enabled() and dtype == torch.float32:  # the CPU operator reads the same stores the same way
        cpu = torch.ops.keel.paged_attention(
            q, keys, values, None, None, tables, table_of, positions, BLOCK, window, 0.125, dim, sinks=sinks
        )
        torch.testing.assert_close(got, cpu, atol=tolerance, rtol=tolerance)


@needs_triton
@pytest.mark.parametrize("splits", [1, 3])
def test_triton_sinks_of_a_latent_store_and_soft_capped_scores(splits):
    g = torch.Generator().manual_seed(6)
    (keys, _, _, _), _, _ = random_store("latent", 1, BLOCKS * BLOCK, 40, g)
    q, tables, table_of, positions = case("chunks", 4, 40, g)
    sinks = sinks_for(4)
    got = triton_call(q, keys, None, tables, table_of, positions, 0, 0.2, 32, softcap=0.5, sinks=sinks, splits=splits)
    want = reference(q, keys, None, tables, table_of, positions, 0, 0.2, 32, sinks, softcap=0.5)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


@needs_triton
@pytest.mark.parametrize("splits", [1, 3])
def test_triton_without_sinks_is_unchanged(splits):
    """sinks=None is the call without them; a sink of -inf gives the same bits, whole or split."""
    g = torch.Generator().manual_seed(12)
    (keys, values, _, _), _, _ = random_store("float32", 2, BLOCKS * BLOCK, 32, g)
    q, tables, table_of, positions = case("decode rows", 6, 32, g)
    args = (q, keys, values, tables, table_of, positions, 21, 0.2, 32)
    before = triton_call(*args, splits=splits)
    assert torch.equal(before, triton_call(*args, splits=splits, sinks=None))
    assert torch.equal(before, triton_call(*args, splits=splits, sinks=torch.full((6,), float("-inf"))))
    want = reference(q, keys, values, tables, table_of, positions, 21, 0.2, 32)
    torch.testing.assert_close(before.double(), want, atol=1e-5, rtol=1e-5)


@needs_triton
def test_triton_refuses_bad_sinks():
    g = torch.Generator().manual_seed(0)
    (keys, values, _, _), _, _ = random_store("float32", 2, BLOCKS * BLOCK, 32, g)
    q, tables, table_of, positions = case("decode rows", 4, 32, g)
    args = (q, keys, values, tables, table_of, positions, 0, 1.0, 32)
    with pytest.raises(ValueError, match=r"sinks must be float32 \[4\]"):
        triton_call(*args, sinks=sinks_for(4).double())
    with pytest.raises(ValueError, match=r"sinks must be float32 \[4\]"):
        triton_call(*args, sinks=sinks_for(5))
    with pytest.raises(ValueError, match=r"sinks must be float32 \[4\]"):
        triton_call(*args, sinks=sinks_for(4)[None])
