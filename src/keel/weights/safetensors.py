"""Lazy reading of HF safetensors checkpoints (single file or sharded with an index)."""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path

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

    def names(self) -> set[str]:
        return set(self._where)

    def file_of(self, name: str) -> Path:
        return self.directory / self._where[name]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._files[self._where[name]].get_slice(name).get_shape())

    def dtype(self, name: str) -> str:
        return self._files[self._where[name]].get_slice(name).get_dtype()

    def get(self, name: str) -> Tensor:
        if name not in self._where:
            raise WeightsError(f"{self.directory}: tensor {name!r} not found in the checkpoint")
        try:
            return self._files[self._where[name]].get_tensor(name)
        except SafetensorError as e:
            raise WeightsError(f"{self.file_of(name)}: cannot read tensor {name!r} ({e})") from None

    def get_row(self, name: str, index: int) -> Tensor:
        """Row `index` of the first dimension, read alone (one expert of a stacked expert tensor)."""
        if name not in self._where:
            raise WeightsError(f"{self.directory}: tensor {name!r} not found in the checkpoint")
        try:
            return self._files[self._where[name]].get_slice(name)[index]
        except SafetensorError as e:
            raise WeightsError(f"{self.file_of(name)}: cannot read row {index} of tensor {name!r} ({e})") from None

    def get_shard(self, name: str, shard: Shard | None) -> Tensor:
        """A tensor-parallel rank's slice (keel.weights.shard.Shard, None: all), reading only
        those bytes from the file."""
        if name not in self._where:
            raise WeightsError(f"{self.directory}: tensor {name!r} not found in the checkpoint")
        try:
            return read_shard(self._files[self._where[name]], name, shard)
        except SafetensorError as e:
            raise WeightsError(f"{self.file_of(name)}: cannot read a slice of tensor {name!r} ({e})") from None

    def get_box(self, name: str, offset: tuple[int, ...], shape: tuple[int, ...]) -> Tensor:
        """The block [offset, offset + shape) of tensor `name` in every dimension, reading only those bytes
        (a rank's shard under FSDP, TP or both)."""
        if name not in self._where:
            raise WeightsError(f"{self.directory}: tensor {name!r} not found in the checkpoint")
        box = tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))
        try:
            return self._files[self._where[name]].get_slice(name)[box]
        except SafetensorError as e:
            raise WeightsError(f"{self.file_of(name)}: cannot read a block of tensor {name!r} ({e})") from None

    def close(self) -> None:
        self._stack.close()
