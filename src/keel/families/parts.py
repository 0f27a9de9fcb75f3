"""Markers of checkpoint layouts (keel.weights.parts reads them), here so that family files can name them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Transposed:
    """A part of a 2-D tensor stored transposed (GPT-2's Conv1D weights, [in, out]): `rows` of its transpose (the
    stored columns), None for all of it."""

    rows: list[tuple[int, int]] | None = None


@dataclass(frozen=True)
class Stacked:
    """A stored tensor that is one row, `index`, of a tensor keel reads whole (StableLM's LayerNorm per head,
    `q_layernorm.norms.{i}.weight`, stacked into keel's [heads, head_dim] q norm weight); several stored names map
    to the same name of keel's, one per row, and export splits it again."""

    index: int


@dataclass(frozen=True)
class Block:
    """A stored tensor that is the `index`-th of the blocks of rows that make a tensor keel reads whole, one after
    another (OLMo Hybrid's separate q_proj, k_proj and v_proj of its Gated DeltaNet layers, keel's one
    in_proj_qkv); several stored names map to the same name of keel's. Reads take each block's rows from its stored
    shape (transformers saves OLMo Hybrid's q/k/v convolutions cut into equal thirds, whatever their widths); export
    splits keel's tensor into blocks of `rows` rows."""

    index: int
    rows: int


@dataclass(frozen=True)
class Columns:
    """A 2-D stored tensor whose columns keel reads in another order: keel's column j is the stored column
    `order[j]` (Cohere's per-head q/k norm weights [heads, head_dim], each head's channels regrouped as its q/k
    rows are for keel's rotary, keel.families.rope.interleaved_rotary_rows)."""

    order: tuple[int, ...]


@dataclass(frozen=True)
class RowsTransposed:
    """A part made of stored `rows`, read transposed (DBRX's fused experts `w2` [E * I, H]: expert e's down
    projection [H, I] is the transpose of its I rows), where `Transposed` takes columns of a whole transposed
    tensor."""

    rows: list[tuple[int, int]]


@dataclass(frozen=True)
class Copy:
    """A stored tensor that several of keel's tensors each hold whole (Zamba 2's shared transformer blocks, a copy in
    each hybrid layer that runs one): every read gives the stored tensor; export writes it once, and refuses copies
    that differ (trained apart)."""
