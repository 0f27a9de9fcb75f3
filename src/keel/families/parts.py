"""Markers of checkpoint layouts (keel.weights.parts reads them), here so that family files can name them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Transposed:
    """A part of a 2-D tensor stored transposed (GPT-2's Conv1D weights, [in, out]): `rows` of its transpose (the
    stored columns), None for all of it."""

    rows: list[tuple[int, int]] | None = None


@dataclass(frozen=True)
class RowsTransposed:
    """A part made of stored `rows`, read transposed (DBRX's fused experts `w2` [E * I, H]: expert e's down
    projection [H, I] is the transpose of its I rows), where `Transposed` takes columns of a whole transposed
    tensor."""

    rows: list[tuple[int, int]]
