"""GPT-OSS checkpoints' experts in keel's layout (keel.families.gpt_oss).

transformers' GptOssExperts keep each layer's experts stacked and transposed against keel's `GroupedExperts`:
`experts.gate_up_proj` [E, H, 2I] whose columns alternate gate and up (column 2j is gate j, 2j + 1 up j),
`gate_up_proj_bias` [E, 2I] alike, `down_proj` [E, I, H]. OpenAI's release stores the two weights in MXFP4
instead: `<weight>_blocks` [E, R, K / 32, 16] uint8 (two 4-bit E2M1 codes a byte, the low nibble first) and
`<weight>_scales` [E, R, K / 32] uint8 (E8M0: a power of two, biased by 127), R x K being the weight as the
matmul reads it (gate_up [2I, H] with rows alternating, down [H, I]).

`GptOssReader` wraps a tensor reader (keel.weights.checkpoint.TensorReader) so that those names read as keel's
[E, 2I, H] gate rows then up rows, [E, H, I], and [E, 2I] biases, dequantized (to bfloat16, which holds every
MXFP4 value exactly), or by `get_blocks` as integer blocks (int8 codes twice each FP4 value, power-of-two scales per
32: the same weights exactly) for `--quantize auto` / `gguf` to run as stored. Every read (whole, a row, a
tensor-parallel shard, an FSDP box) reads only the experts it needs from the stored tensor. `to_hf` turns keel's
tensors back into transformers' layout for `keel convert`.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from keel.errors import WeightsError
from keel.weights.gguf_blocks import QuantBlocks
from keel.weights.parts import DerivedReader

# The E2M1 code points, by their 4-bit code (sign in the high bit).
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_SCALE_BIAS = 127
# Twice each E2M1 value, by its code: integers, so int8 codes hold them exactly (scales halved to match).
_DOUBLED = torch.tensor([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=torch.int8)
_EXPERTS = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj|gate_up_proj_bias)$")


def dequantize_mxfp4(blocks: Tensor, scales: Tensor, dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """MXFP4 `blocks` [..., G, 16] uint8 and `scales` [..., G] uint8 -> [..., G * 32] of `dtype`."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise WeightsError(f"MXFP4 blocks {list(blocks.shape)} do not match scales {list(scales.shape)}")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2).long()  # [..., G, 32], low nibble first
    values = lut[codes] * torch.exp2(scales.to(torch.float32) - _SCALE_BIAS).unsqueeze(-1)
    return values.flatten(-2).to(dtype)


def quantize_mxfp4(weight: Tensor) -> tuple[Tensor, Tensor]:
    """The nearest MXFP4 of `weight` [..., K] (K a multiple of 32): (blocks [..., K/32, 16], scales [..., K/32]),
    with each group's scale the smallest power of two that keeps its largest value within 6. For tests and
    tools that write OpenAI's format; keel never quantizes to it when loading."""
    groups = weight.float().unflatten(-1, (-1, 32))
    top = groups.abs().amax(dim=-1).clamp(min=2.0**-126)
    exponent = torch.ceil(torch.log2(top / 6.0)).clamp(-_SCALE_BIAS, 127)
    scaled = groups / torch.exp2(exponent).unsqueeze(-1)
    lut = torch.tensor(FP4_VALUES[:8])
    magnitude = (scaled.abs().unsqueeze(-1) - lut).abs().argmin(dim=-1)
    codes = (magnitude | ((scaled < 0).long() << 3)).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (exponent + _SCALE_BIAS).to(torch.uint8)


def _deinterleave_rows(t: Tensor) -> Tensor:
    """[E, 2I, ...] with rows alternating gate and up -> gate rows, then up rows."""
    return torch.cat([t[:, 0::2], t[:, 1::2]], dim=1)


def _same(t: Tensor) -> Tensor:
    return t


def _interleave_rows(t: Tensor) -> Tensor:
    """The inverse of `_deinterleave_rows`."""
    gate, up = t.chunk(2, dim=1)
    return torch.stack([gate, up], dim=2).flatten(1, 2)


class GptOssReader(DerivedReader):
    """A tensor reader serving GPT-OSS's experts in keel's layout (the module docstring). interleaved=False: the
    same transposed layout with gate columns first, then up (Llama 4's `feed_forward.experts`, renamed by its
    family's layout), no MXFP4."""

    def __init__(self, reader, interleaved: bool = True, only: set[str] | None = None) -> None:  # noqa: ANN001
        """only: the stored names read so (the others as they are), where a checkpoint holds some in keel's layout."""
        self.inner = reader
        regroup = _deinterleave_rows if interleaved else _same
        present = reader.names()
        # keel name -> (stored names, [E, ...] experts read -> keel's tensor, keel's shape, keel's dtype)
        self._derived: dict[str, tuple[tuple[str, ...], Callable[[list[Tensor]], Tensor], tuple[int, ...], str]] = {}
        hidden = set()
        self._mxfp4: set[str] = set()  # keel names stored in MXFP4 (get_blocks)
        for stored in present:
            base = stored.removesuffix("_blocks")
            match = _EXPERTS.match(base)
            if match is None or (base != stored and f"{base}_scales" not in present) or (only and stored not in only):
                continue
            kind = match.group(2)
            if base != stored:  # MXFP4
                names = (stored, f"{base}_scales")
                blocks = reader.shape(stored)
                rows, cols = blocks[1], blocks[2] * 32
                convert = _mxfp4_gate_up if kind == "gate_up_proj" else _mxfp4_down
                self._derived[base] = (names, convert, (blocks[0], rows, cols), "BF16")
                self._mxfp4.add(base)
                hidden.update(names)
                continue
            if base in self._derived:  # the MXFP4 form of the same weight was seen first
                continue
            shape = reader.shape(stored)
            if kind == "gate_up_proj_bias":
                self._derived[base] = (
                    (stored,),
                    lambda ts: regroup(ts[0]),
                    tuple(shape),
                    reader.dtype(stored),
                )
            elif kind == "gate_up_proj":  # [E, H, 2I] -> [E, 2I, H]
                convert = lambda ts: regroup(ts[0].transpose(1, 2))  # noqa: E731
                self._derived[base] = ((stored,), convert, (shape[0], shape[2], shape[1]), reader.dtype(stored))
            else:  # down_proj [E, I, H] -> [E, H, I]
                convert = lambda ts: ts[0].transpose(1, 2)  # noqa: E731
                self._derived[base] = ((stored,), convert, (shape[0], shape[2], shape[1]), reader.dtype(stored))
            hidden.add(stored)
        self._names = (present - hidden) | set(self._derived)

    def stores_blocks(self) -> bool:
        """Whether any experts are stored in MXFP4 (`get_blocks` serves them)."""
        return bool(self._mxfp4)

    def get_blocks(self, name: str) -> QuantBlocks | None:
        """An MXFP4-stored experts tensor as integer blocks in keel's layout (int8 codes [E, R, K], float32 scales
        [E, R, K / 32]), or None for every other tensor (it loads as float)."""
        self._known(name)
        if name not in self._mxfp4:
            return None
        stored, convert, _, _ = self._derived[name]
        blocks, scales = (self.inner.get(n) for n in stored)
        codes = _DOUBLED[torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2).long()].flatten(-2)
        scales = torch.exp2(scales.to(torch.float32) - _SCALE_BIAS - 1)
        if convert is _mxfp4_gate_up:
            codes, scales = _deinterleave_rows(codes), _deinterleave_rows(scales)
        return QuantBlocks("int8", 32, ("MXFP4",), codes.contiguous(), scales.contiguous(), None)

    def file_of(self, name: str) -> Path:
        return self.inner.file_of(self._derived[name][0][0] if name in self._derived else name)

    def dtype(self, name: str) -> str:
        self._known(name)
        return self._derived[name][3] if name in self._derived else self.inner.dtype(name)

    def shape(self, name: str) -> tuple[int, ...]:
        self._known(name)
        return self._derived[name][2] if name in self._derived else tuple(self.inner.shape(name))

    def get_box(self, name: str, offset: tuple[int, ...], shape: tuple[int, ...]) -> Tensor:
        """The box of keel's tensor: the stored tensors of its experts (the first dimension) are read whole and
        converted, then cut; every expert outside the box stays unread."""
        self._known(name)
        if name not in self._derived:
            return self.inner.get_box(name, offset, shape)
        stored, convert, _, _ = self._derived[name]
        first, count = offset[0], shape[0]
        tensors = []
        for n in stored:
            full = self.inner.shape(n)
            tensors.append(self.inner.get_box(n, (first, *[0] * (len(full) - 1)), (count, *full[1:])))
        out = convert(tensors)
        for dim in range(1, len(shape)):
            out = out.narrow(dim, offset[dim], shape[dim])
        return out.contiguous()


def _mxfp4_gate_up(tensors: list[Tensor]) -> Tensor:
    return _deinterleave_rows(dequantize_mxfp4(tensors[0], tensors[1]))


def _mxfp4_down(tensors: list[Tensor]) -> Tensor:
    return dequantize_mxfp4(tensors[0], tensors[1])


def to_hf(name: str, tensor: Tensor, interleaved: bool = True) -> Tensor:
    """One of keel's tensors (keel's layout, under its HF name) in transformers' GPT-OSS layout (interleaved=False:
    Llama 4's, gate columns first)."""
    match = _EXPERTS.match(name)
    if match is None:
        return tensor
    kind = match.group(2)
    if kind == "gate_up_proj":
        return (_interleave_rows(tensor) if interleaved else tensor).transpose(1, 2).contiguous()
    if kind == "down_proj":
        return tensor.transpose(1, 2).contiguous()
    return _interleave_rows(tensor).contiguous()
