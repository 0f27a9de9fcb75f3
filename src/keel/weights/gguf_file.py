"""A GGUF file's key/values and tensor directory, read in one pass over the header.

Why not `gguf.GGUFReader`: it builds a memory-mapped numpy view for every part of every value, so a
vocabulary of 49k tokens and 49k merges costs ~150k views, whose bookkeeping every process that opens
the file pays. Read here, values are decoded straight into Python objects (numeric arrays by one
`np.frombuffer` each), and the file opens many times faster (docs/BENCHMARKS.md, "Opening a GGUF
file"). The tensors are views of one read-only memory map, as gguf's are, and
carry the fields keel uses of gguf's `ReaderTensor` (name, type, GGUF-order dims, sizes, data). The
value and tensor types and the alignment key are gguf's own constants (`GGUFValueType`,
`GGMLQuantizationType`, `GGML_QUANT_SIZES`, `Keys`), not retyped.
"""

from __future__ import annotations

import mmap
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGMLQuantizationType, GGUFValueType, Keys
from gguf.quants import quant_shape_to_byte_shape

SUPPORTED_VERSIONS = (2, 3)
_SCALARS = {
    GGUFValueType.UINT8: np.dtype("<u1"),
    GGUFValueType.INT8: np.dtype("<i1"),
    GGUFValueType.UINT16: np.dtype("<u2"),
    GGUFValueType.INT16: np.dtype("<i2"),
    GGUFValueType.UINT32: np.dtype("<u4"),
    GGUFValueType.INT32: np.dtype("<i4"),
    GGUFValueType.FLOAT32: np.dtype("<f4"),
    GGUFValueType.BOOL: np.dtype("?"),
    GGUFValueType.UINT64: np.dtype("<u8"),
    GGUFValueType.INT64: np.dtype("<i8"),
    GGUFValueType.FLOAT64: np.dtype("<f8"),
}
# Tensor types stored as plain numbers (others are blocks of bytes).
_PLAIN = {
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}
# Tensor type ids that other forks of ggml give types gguf-py does not define, refused by name (else an id is only
# "not a valid GGMLQuantizationType"): bitnet.cpp's I2_S (2-bit ternary codes with one scale per tensor).
FOREIGN_TYPES = {36: "I2_S (bitnet.cpp's ternary type, not llama.cpp's; requantize to TQ1_0 / TQ2_0 or F16)"}


class ForeignTypeError(ValueError):
    """A tensor of a type id another ggml fork defines (FOREIGN_TYPES)."""


class GGUFTensor(NamedTuple):
    name: str
    tensor_type: GGMLQuantizationType
    shape: np.ndarray  # dims in GGUF order (innermost first), as gguf's ReaderTensor.shape
    n_elements: int
    n_bytes: int
    data_offset: int
    data: np.ndarray  # numbers shaped as numpy sees them (outermost first), or block bytes per row


class GGUFFile:
    """`fields`: key -> decoded value (int, float, bool, str, or a list of them); `tensors`: the directory."""

    def __init__(self, path: str | Path) -> None:
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self.data = np.frombuffer(self._map, dtype=np.uint8)
        self._pos = 0
        if self._scalar(GGUFValueType.UINT32) != GGUF_MAGIC:
            raise ValueError("GGUF magic invalid")
        self.version = self._scalar(GGUFValueType.UINT32)
        if self.version not in SUPPORTED_VERSIONS:
            raise ValueError(f"GGUF version {self.version} is not supported (little-endian 2 or 3)")
        tensor_count = self._scalar(GGUFValueType.UINT64)
        kv_count = self._scalar(GGUFValueType.UINT64)
        self.fields: dict[str, Any] = {}
        for _ in range(kv_count):
            key = self._string()
            if key in self.fields:
                raise ValueError(f"duplicate key {key!r}")
            self.fields[key] = self._value(GGUFValueType(self._scalar(GGUFValueType.UINT32)))
        infos = [self._tensor_info() for _ in range(tensor_count)]
        alignment = self.fields.get(Keys.General.ALIGNMENT, GGUF_DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"invalid {Keys.General.ALIGNMENT} {alignment!r}")
        start = -(-self._pos // alignment) * alignment
        self.tensors = [self._tensor(start, *info) for info in infos]
        if len({t.name for t in self.tensors}) != len(self.tensors):
            raise ValueError("duplicate tensor names")

    # ------------------------------------------------------------------------------ header values
    def _take(self, n: int) -> np.ndarray:
        end = self._pos + n
        if n < 0 or end > len(self.data):
            raise ValueError(f"truncated at byte {self._pos} (wanted {n} more)")
        chunk = self.data[self._pos : end]
        self._pos = end
        return chunk

    def _scalar(self, kind: GGUFValueType) -> Any:
        dtype = _SCALARS[kind]
        return self._take(dtype.itemsize).view(dtype)[0].item()

    def _string(self) -> str:
        return self._take(self._scalar(GGUFValueType.UINT64)).tobytes().decode("utf-8")

    def _value(self, kind: GGUFValueType) -> Any:
        if kind == GGUFValueType.STRING:
            return self._string()
        if kind != GGUFValueType.ARRAY:
            return self._scalar(kind)
        item = GGUFValueType(self._scalar(GGUFValueType.UINT32))
        count = self._scalar(GGUFValueType.UINT64)
        if item in _SCALARS:
            dtype = _SCALARS[item]
            return self._take(count * dtype.itemsize).view(dtype).tolist()
        if item == GGUFValueType.STRING:
            return self._strings(count)
        return [self._value(item) for _ in range(count)]

    def _strings(self, count: int) -> list[str]:
        """`count` length-prefixed strings: one pass over the raw bytes (the vocabulary's 49k, in ms)."""
        raw, pos, out = self._map, self._pos, []
        for _ in range(count):
            if pos + 8 > len(raw):
                raise ValueError(f"truncated at byte {pos}")
            end = pos + 8 + int.from_bytes(raw[pos : pos + 8], "little")
            if end > len(raw):
                raise ValueError(f"truncated at byte {pos}")
            out.append(raw[pos + 8 : end].decode("utf-8"))
            pos = end
        self._pos = pos
        return out

    # ------------------------------------------------------------------------------------ tensors
    def _tensor_info(self) -> tuple[str, np.ndarray, GGMLQuantizationType, int]:
        name = self._string()
        n_dims = self._scalar(GGUFValueType.UINT32)
        dims = self._take(8 * n_dims).view("<u8").copy()
        type_id = self._scalar(GGUFValueType.UINT32)
        if type_id in FOREIGN_TYPES and type_id not in GGMLQuantizationType._value2member_map_:
            raise ForeignTypeError(f"tensor {name!r} has type {FOREIGN_TYPES[type_id]}")
        kind = GGMLQuantizationType(type_id)
        return name, dims, kind, self._scalar(GGUFValueType.UINT64)

    def _tensor(self, start: int, name: str, dims: np.ndarray, kind: GGMLQuantizationType, offset: int) -> GGUFTensor:
        n_elements = int(np.prod(dims))
        block, block_bytes = GGML_QUANT_SIZES[kind]
        n_bytes = n_elements * block_bytes // block
        begin = start + offset
        if begin + n_bytes > len(self.data):
            raise ValueError(f"tensor {name!r} runs past the end of the file (truncated)")
        shape = tuple(reversed(dims.tolist()))
        raw = self.data[begin : begin + n_bytes]
        if kind in _PLAIN:
            data = raw.view(_PLAIN[kind]).reshape(shape)
        else:
            data = raw.reshape(quant_shape_to_byte_shape(shape, kind))
        return GGUFTensor(name, kind, dims, n_elements, n_bytes, begin, data)
