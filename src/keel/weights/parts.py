"""A checkpoint's tensors under the names keel reads, where a family stores them otherwise (keel.families:
renamed tensors, and fused tensors whose rows hold several of keel's, in one block each or interleaved).

`PartsReader(reader, layout)` wraps a safetensors reader. `layout` maps a stored tensor name to the
names it serves: each with the stored rows it takes, in order ([(start, stop), ...]), or None for the
whole tensor under another name. Every read (whole, one row, a tensor-parallel shard, an FSDP box)
takes only the rows it needs from the stored tensor's bytes; the stored names are no longer listed.
`fused_stream` puts the stored tensors together again from keel's, for writing HF checkpoints.

A 2-D tensor stored transposed (GPT-2's Conv1D weights, [in, out] where keel's Linear holds [out, in]) names its
parts `Transposed(rows)`: the rows are the transpose's (the stored columns), every read takes the stored box of
those columns and transposes it (so a tensor-parallel shard still reads only its bytes), and `fused_stream` writes
the tensor back transposed. A part `RowsTransposed(rows)` is the transpose of the stored rows it takes (DBRX's
experts `w2`, one expert's rows each): reads take those rows' box and transpose it, `fused_stream` writes each part
back transposed into its rows.

`Stacked(index)`: the stored tensor is one row of keel's (several stored names serve one name of keel's, StableLM's
LayerNorm per head); `Block(index, rows)`: the stored tensor is the index-th block of rows of keel's, read at its
stored width (several stored names, one block each: OLMo Hybrid's q/k/v projections of keel's in_proj_qkv);
`Columns(order)`: keel reads a 2-D stored tensor's columns in another order (Cohere's per-head q/k norm weights,
regrouped as its q/k rows are). `fused_stream` splits and reorders them back.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from torch import Tensor

from keel.errors import WeightsError
from keel.families.parts import Block, Columns, Copy, RowsTransposed, Stacked, Transposed
from keel.weights.shard import Shard

Rows = list[tuple[int, int]] | Transposed | RowsTransposed | Stacked | Block | Columns | Copy | None
Layout = dict[str, dict[str, Rows]]


def _rows(part: Rows) -> tuple[list[tuple[int, int]] | None, bool]:
    """(the part's row ranges or None, whether the stored tensor is transposed)."""
    if isinstance(part, Stacked | Block | Columns | Copy):  # whole stored tensors (PartsReader reads them apart)
        return None, False
    return (part.rows, True) if isinstance(part, Transposed) else (_ranges(part), False)


def _ranges(part: Rows) -> list[tuple[int, int]] | None:
    return part.rows if isinstance(part, RowsTransposed) else part


def _pieces(rows: list[tuple[int, int]], start: int, stop: int) -> list[tuple[int, int]]:
    """The stored row ranges that hold rows [start, stop) of the part made of `rows`."""
    out, offset = [], 0
    for a, b in rows:
        lo, hi = max(start, offset), min(stop, offset + b - a)
        if lo < hi:
            out.append((a + lo - offset, a + hi - offset))
        offset += b - a
    return out


class DerivedReader:
    """A tensor reader over `inner` (keel.weights.checkpoint.TensorReader) that serves some names derived from
    stored tensors: whole reads, rows and tensor-parallel shards of those are made of `get_box`, every other name
    is read from `inner` as it is. Subclasses set `inner`, `_names` and `_derived` (the derived names) and define
    `shape`, `dtype`, `file_of` and `get_box`."""

    inner: object
    _names: set[str]
    _derived: dict

    def _known(self, name: str) -> None:
        if name not in self._names:
            raise WeightsError(f"{getattr(self.inner, 'directory', '')}: tensor {name!r} not found in the checkpoint")

    def names(self) -> set[str]:
        return set(self._names)

    def get(self, name: str) -> Tensor:
        self._known(name)
        if name not in self._derived:
            return self.inner.get(name)
        shape = self.shape(name)
        return self.get_box(name, (0,) * len(shape), shape)

    def get_row(self, name: str, index: int) -> Tensor:
        shape = self.shape(name)
        return self.get_box(name, (index, *[0] * (len(shape) - 1)), (1, *shape[1:]))[0]

    def get_shard(self, name: str, shard: Shard | None) -> Tensor:
        self._known(name)
        if name not in self._derived:
            return self.inner.get_shard(name, shard)
        if shard is None:
            return self.get(name)
        shape = self.shape(name)
        pieces = []
        for a, b in shard.ranges(shape[shard.dim]):
            offset = tuple(a if i == shard.dim else 0 for i in range(len(shape)))
            size = tuple(b - a if i == shard.dim else n for i, n in enumerate(shape))
            pieces.append(self.get_box(name, offset, size))
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=shard.dim)

    def close(self) -> None:
        self.inner.close()


class PartsReader(DerivedReader):
    """A tensor reader serving `layout`'s names (the module docstring)."""

    def __init__(self, reader, layout: Layout) -> None:  # noqa: ANN001
        self.inner = reader
        present = reader.names()
        # name -> (stored name, its rows or None, whether stored transposed); a stacked name: its row 0's
        self._derived: dict[str, tuple[str, list[tuple[int, int]] | None, bool]] = {}
        self._columns: dict[str, tuple[int, ...]] = {}  # name -> the stored columns in keel's order
        stacks: dict[str, dict[int, str]] = {}  # name -> {row: the stored tensor holding it}
        # name -> [(start, stop, the stored tensor holding those rows)], in row order
        self._blocks: dict[str, list[tuple[int, int, str]]] = {}
        indexed: dict[str, dict[int, str]] = {}  # name -> {block index: the stored tensor}
        for stored, parts in layout.items():
            if stored not in present:
                continue
            for name, part in parts.items():
                if isinstance(part, Stacked):
                    stacks.setdefault(name, {})[part.index] = stored
                    continue
                if isinstance(part, Block):
                    indexed.setdefault(name, {})[part.index] = stored
                    continue
                if isinstance(part, Columns):
                    self._columns[name] = part.order
                self._derived[name] = (stored, *_rows(part))
        self._stacks: dict[str, list[str]] = {}
        for name, rows in stacks.items():
            if sorted(rows) != list(range(len(rows))):
                raise WeightsError(f"{name}: its stacked rows {sorted(rows)} are not all in the checkpoint")
            self._stacks[name] = [rows[i] for i in range(len(rows))]
            self._derived[name] = (self._stacks[name][0], None, False)
        for name, parts_of in indexed.items():
            if sorted(parts_of) != list(range(len(parts_of))):
                raise WeightsError(f"{name}: its blocks of rows {sorted(parts_of)} are not all in the checkpoint")
            start, blocks = 0, []
            for i in range(len(parts_of)):  # each block as wide as its stored tensor
                stop = start + reader.shape(parts_of[i])[0]
                blocks.append((start, stop, parts_of[i]))
                start = stop
            self._blocks[name] = blocks
            self._derived[name] = (blocks[0][2], None, False)
        used = (
            {stored for stored, *_ in self._derived.values()}
            | {s for rows in stacks.values() for s in rows.values()}
            | {s for blocks in self._blocks.values() for _, _, s in blocks}
        )
        # the parts read as the transpose of their stored rows
        self._part_flipped = {
            name
            for stored, parts in layout.items()
            if stored in present
            for name, part in parts.items()
            if isinstance(part, RowsTransposed)
        }
        self._names = (present - used) | set(self._derived)

    def _part(self, name: str) -> tuple[str, list[tuple[int, int]] | None, bool]:
        self._known(name)
        return self._derived.get(name, (name, None, False))

    def file_of(self, name: str) -> Path:
        return self.inner.file_of(self._derived.get(name, (name,))[0])

    def dtype(self, name: str) -> str:
        return self.inner.dtype(self._part(name)[0])

    def shape(self, name: str) -> tuple[int, ...]:
        stored, rows, flipped = self._part(name)
        shape = tuple(self.inner.shape(stored))
        if name in self._stacks:
            return (len(self._stacks[name]), *shape)
        if name in self._blocks:
            return (self._blocks[name][-1][1], *shape[1:])
        shape = shape[::-1] if flipped else shape
        shape = shape if rows is None else (sum(b - a for a, b in rows), *shape[1:])
        return shape[::-1] if name in self._part_flipped else shape

    def get_box(self, name: str, offset: tuple[int, ...], shape: tuple[int, ...]) -> Tensor:
        stored, rows, flipped = self._part(name)
        if name in self._stacks:  # one stored tensor per row
            rows_read = self._stacks[name][offset[0] : offset[0] + shape[0]]
            return torch.stack([self.inner.get_box(row, offset[1:], shape[1:]) for row in rows_read])
        if name in self._blocks:  # the stored tensors that hold the rows asked for, each its share
            lo, hi = offset[0], offset[0] + shape[0]
            pieces = [
                self.inner.get_box(part, (max(lo, a) - a, *offset[1:]), (min(hi, b) - max(lo, a), *shape[1:]))
                for a, b, part in self._blocks[name]
                if max(lo, a) < min(hi, b)
            ]
            return pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        if name in self._columns:  # the rows' every stored column, then keel's in its order
            order = list(self._columns[name][offset[1] : offset[1] + shape[1]])
            width = self.inner.shape(stored)[1]
            return self.inner.get_box(stored, (offset[0], 0), (shape[0], width))[:, order].contiguous()
        if name in self._part_flipped:  # the box of the stored rows' part, transposed
            return self._rows_box(stored, rows, offset[::-1], shape[::-1], False).T.contiguous()
        return self._rows_box(stored, rows, offset, shape, flipped)

    def _rows_box(
        self,
        stored: str,
        rows: list[tuple[int, int]] | None,
        offset: tuple[int, ...],
        shape: tuple[int, ...],
        flipped: bool,
    ) -> Tensor:

        def box(offset: tuple[int, ...], shape: tuple[int, ...]) -> Tensor:  # of the stored tensor, as keel reads it
            if not flipped:
                return self.inner.get_box(stored, offset, shape)
            return self.inner.get_box(stored, offset[::-1], shape[::-1]).T.contiguous()

        if rows is None:
            return box(offset, shape)
        pieces = [box((a, *offset[1:]), (b - a, *shape[1:])) for a, b in _pieces(rows, offset[0], offset[0] + shape[0])]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def fused_stream(layout: Layout, tensors: Iterable[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
    """HF-named tensors with `layout`'s stored tensors made again from keel's, each as soon as its last
    part arrives; every other tensor passes as it comes."""
    stacks: dict[str, dict[int, str]] = {}  # keel's name -> {row: the stored tensor}
    columns: dict[str, tuple[str, tuple[int, ...]]] = {}  # keel's name -> (the stored tensor, its column order)
    blocks: dict[str, list[tuple[str, Block]]] = {}  # keel's name -> the stored tensors of its blocks of rows
    for stored, parts in layout.items():
        for name, part in parts.items():
            if isinstance(part, Stacked):
                stacks.setdefault(name, {})[part.index] = stored
            elif isinstance(part, Block):
                blocks.setdefault(name, []).append((stored, part))
            elif isinstance(part, Columns):
                columns[name] = stored, part.order
    owner = {name: stored for stored, parts in layout.items() for name in parts}
    held: dict[str, dict[str, Tensor]] = {}
    for name, tensor in tensors:
        stored = owner.get(name)
        if stored is not None and isinstance(layout[stored][name], Copy):  # written once all copies agree
            copies = held.setdefault(stored, {})
            copies[name] = tensor
            if len(copies) == len(layout[stored]):
                first = next(iter(held.pop(stored).values()))
                if any(not torch.equal(first, copy) for copy in copies.values()):
                    raise WeightsError(
                        f"{stored}: keel's copies of this shared tensor ({', '.join(sorted(copies))}) differ; "
                        "a checkpoint stores it once"
                    )
                yield stored, first
            continue
        if name in stacks:  # split into its rows, one stored tensor each
            for index, stored in sorted(stacks[name].items()):
                yield stored, tensor[index].clone()
            continue
        if name in blocks:  # split into its blocks of rows, one stored tensor each
            start = 0
            for stored, part in sorted(blocks[name], key=lambda block: block[1].index):
                yield stored, tensor[start : start + part.rows].clone()
                start += part.rows
            continue
        if name in columns:
            stored, order = columns[name]
            out = torch.empty_like(tensor)
            out[:, list(order)] = tensor
            yield stored, out
            continue
        stored = owner.get(name)
        if stored is None:
            yield name, tensor
            continue
        held.setdefault(stored, {})[name] = tensor
        if len(held[stored]) < len(layout[stored]):
            continue
        parts = held.pop(stored)
        ranges_of = {part: _rows(rows) for part, rows in layout[stored].items()}
        flipped = ranges_of[name][1]
        for part, rows in layout[stored].items():  # back to the stored rows' orientation
            if isinstance(rows, RowsTransposed):
                parts[part] = parts[part].T
        if len(parts) == 1 and ranges_of[name][0] is None:  # renamed
            yield stored, tensor.T.contiguous() if flipped else tensor
            continue
        rows = max(b for ranges, _ in ranges_of.values() for _, b in ranges)
        out = tensor.new_empty((rows, *parts[name].shape[1:]))
        for part, (ranges, _) in ranges_of.items():
            offset = 0
            for a, b in ranges:
                out[a:b] = parts[part][offset : offset + b - a]
                offset += b - a
        yield stored, out.T.contiguous() if flipped else out
    for parts in held.values():  # a stored tensor whose parts did not all come (a pipeline stage's share)
        yield from parts.items()
