"""Lazy reading of HF safetensors checkpoints (single file or sharded with an index)."""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor

from keel.errors import WeightsError
from keel.weights.shard import Shard, read_shard

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class SafetensorsReader:
    """Tensors by HF name across one or more .safetensors files, read on demand via safe_open."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self._stack = ExitStack()
        self._files: dict[str, object] = {}  # file name -> open safe_open handle
        self._where: dict[str, str] = {}  # tensor name -> file name
        self._parts: dict[str, tuple[str, int, int]] = {}  # split_rows: part -> (fused name, start, stop)
        index = self.directory / INDEX_FILE
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise WeightsError(f"{index}: not a valid safetensors index ({e})") from None
            for file_name in sorted(set(weight_map.values())):
                self._open(file_name)
            for name, file_name in weight_map.items():
                self._where[name] = file_name
        else:
            files = sorted(p.name for p in self.directory.glob("*.safetensors"))
            if not files:
                raise WeightsError(f"{self.directory}: no {SINGLE_FILE} (or {INDEX_FILE}) found")
            for file_name in files:
                handle = self._open(file_name)
                for name in handle.keys():
                    self._where[name] = file_name

    def _open(self, file_name: str):
        path = self.directory / file_name
        if not path.exists():
            raise WeightsError(f"{path}: file not found (listed in {INDEX_FILE})")
        try:
            handle = self._stack.enter_context(safe_open(str(path), framework="pt"))
        except (SafetensorError, OSError) as e:
            raise WeightsError(f"{path}: not a readable safetensors file ({e})") from None
        self._files[file_name] = handle
        return handle

    def split_rows(self, layout: dict[str, dict[str, tuple[int, int]]]) -> None:
        """Read fused tensors as their parts: for each fused name present, every part name maps to its
        [start, stop) rows of it (keel.families: Phi-3's qkv_proj and gate_up_proj), and the fused name
        is no longer listed. Every read below serves a part from the fused tensor's bytes alone."""
        for fused, parts in layout.items():
            if fused in self._where:
                for part, rows in parts.items():
                    self._parts[part] = (fused, *rows)
                    self._where[part] = self._where[fused]
                del self._where[fused]

    def _stored(self, name: str) -> tuple[str, int]:
        """(the stored tensor holding `name`, the row where `name` starts in it)."""
        if name not in self._where:
            raise WeightsError(f"{self.directory}: tensor {name!r} not found in the checkpoint")
        fused, start, _ = self._parts.get(name, (name, 0, 0))
        return fused, start

    def _view(self, name: str):
        return self._files[self._where[name]].get_slice(self._stored(name)[0])

    def names(self) -> set[str]:
        return set(self._where)

    def file_of(self, name: str) -> Path:
        return self.directory / self._where[name]

    def shape(self, name: str) -> tuple[int, ...]:
        shape = tuple(self._view(name).get_shape())
        if name in self._parts:
            _, start, stop = self._parts[name]
            shape = (stop - start, *shape[1:])
        return shape

    def dtype(self, name: str) -> str:
        return self._view(name).get_dtype()

    def get(self, name: str) -> Tensor:
        if name in self._parts:
            return self.get_box(name, (0,) * len(self.shape(name)), self.shape(name))
        self._stored(name)
        try:
            return self._files[self._where[name]].get_tensor(name)
        except SafetensorError as e:
            raise WeightsError(f"{self.file_of(name)}: cannot read tensor {name!r} ({e})") from None

    def get_row(self, name: str, index: int) -> Tensor:
        """Row `index` of the first dimension, read alone (one expert of a stacked expert tensor)."""
        _, start = self._stored(name)
        try:
            return self._view(name)[start + index]
        except SafetensorError as e:
            raise WeightsError(f"{self.file_of(name)}: cannot read row {index} of tensor {name!r} ({e})") from None

    def get_shard(self, name: str, shard: Shard | None) -> Tensor:
        """A tensor-parallel rank's slice (keel.weights.shard.Shard, None: all), reading only
        those bytes from the file."""
        if name in self._parts:
            shape = self.shape(name)
            if shard is None:
                return self.get(name)
            pieces = []
            for a, b in shard.ranges(shape[shard.dim]):
                offset = tuple(a if i == shard.dim else 0 for i in range(len(shape)))
                size = tuple(b - a if i == shard.dim else n for i, n in enumerate(shape))
                pieces.append(self.get_box(name, offset, size))
            return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=shard.dim)
        self._stored(name)
        try:
            return read_shard(self._files[self._where[name]], name, shard)
        except SafetensorError as e:
            raise WeightsError(f"{self.file_of(name)}: cannot read a slice of tensor {name!r} ({e})") from None

    def get_box(self, name: str, offset: tuple[int, ...], shape: tuple[int, ...]) -> Tensor:
        """The block [offset, offset + shape) of tensor `name` in every dimension, reading only those bytes
        (a rank's shard under FSDP, TP or both)."""
        stored, start = self._stored(name)
        offset = (offset[0] + start, *offset[1:]) if offset else offset
        box = tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))
        try:
            return self._files[self._where[name]].get_slice(stored)[box]
        except SafetensorError as e:
            raise WeightsError(f"{self.file_of(name)}: cannot read a block of tensor {name!r} ({e})") from None

    def close(self) -> None:
        self._stack.close()
