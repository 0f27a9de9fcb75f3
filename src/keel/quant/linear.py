"""Weight-only quantized linear layers: int8 per output channel, int4 group-wise asymmetric.

Decode streams every weight once per token, so bytes per weight set its speed: int8 halves bf16's,
int4 quarters it. Activations stay in the model's float dtype; the kernels dequantize on the fly:
- int8: `torch.ops.aten._weight_int8pack_mm(x, w_int8 [N, K], scales [N])` (symmetric, one scale per
  output channel: w = q * s, q in -127..127);
- int4: `_weight_int4pack_mm_for_cpu(x, packed, group, scales_and_zeros [K/g, N, 2])` on CPU and
  `_weight_int4pack_mm` on CUDA (asymmetric per group of `group` input channels:
  w = (q - 8) * s + z with q in 0..15, i.e. min + q * s) - the layout gpt-fast and torchao use.

Both kernels require the scales in the activations' dtype (torch 2.13 refuses anything else), so a
bfloat16 model keeps bfloat16 scales. On CPU they are fast only for bfloat16 activations: float32
and float16 take a reference path, slower than a dense float32 matmul (docs/BENCHMARKS.md, issue 7).

Where keel's C++ kernels run (keel.kernels: CPUs, unless KEEL_KERNELS=0) a layer keeps its codes in
their block layout instead (keel.quant.block_layout) and runs `torch.ops.keel.block_linear`: int8
activations, integer dot products, any activation dtype; GGUF's Q4_0/Q4_1/Q8_0/Q4_K/Q5_K/Q6_K/MXFP4 blocks
run as their integer codes (`from_blocks`), scales included. `layout` says which ("blocks" or "aten").

A layer is built from float weights (`QuantizedLinear(linear, ...)`, `from_float`) or straight from
integer components (`from_int8`, `from_int4`, `from_blocks`: GGUF blocks, a saved quantized
checkpoint) without ever holding a float weight.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from keel import kernels
from keel.platform import int8_dequantize_rows
from keel.quant.block_layout import (
    BLOCK,
    PANEL_ROWS,
    apply_keeping_scales,
    blocks_fit,
    nibble_blocks,
    values_of_nibble_blocks,
)
from keel.weights.quant_format import INT4_GROUP_SIZES, SCHEMES  # the stored formats are the kernels' formats

# The bfloat16 int8 CPU kernel reads K in steps of 16 (other widths crash it, torch 2.13 AVX-512);
# the CPU int4 packing needs N in multiples of 16 (CUDA's: 8).
INT8_K_MULTIPLE = 16
INT4_N_MULTIPLE = 16
# From this many rows a block-layout product dequantizes its weights to float32 and runs BLAS (measured
# crossover against keel's integer kernel with refined activations on an AVX2 CPU: docs/BENCHMARKS.md),
# except where keel's 4-bit panel kernel runs one pass of int8 activations: it beats BLAS at every size.
BLOCK_DEQUANTIZE_ROWS = 128
# 8-bit codes cost the integer kernel twice the 4-bit instructions (maddubs takes one unsigned operand,
# so each product needs a sign step and an int32 sum): dequantizing wins sooner, and sooner still with
# refined activations (by activation passes; measured as above). At the VNNI level neither threshold
# applies: its panel kernel beats BLAS at every size, both widths, one pass or two (keel.kernels.vnni_panels_here).
EIGHT_BIT_DEQUANTIZE_ROWS = {1: 32, 2: 16}
# Weights stored in panels at the AVX2 level (keel.quant.panels): the stored-panel kernel has no per-call
# packing and one broadcast per 16 rows, so dequantizing for BLAS pays only with refined activations, and
# later (by bits and activation passes; None: never; measured on SmolLM2's shapes and its 49152 x 576 head).
STORED_DEQUANTIZE_ROWS = {(4, 1): None, (4, 2): 128, (8, 1): None, (8, 2): 64}
DEQUANTIZE_SLICE_ELEMENTS = 1 << 20  # float32 weights per slice: 4 MiB


def quantize_int8(weight: Tensor) -> tuple[Tensor, Tensor]:
    """[N, K] float -> (int8 [N, K], float32 scales [N]); symmetric per output channel."""
    w = weight.float()
    scales = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scales


def dequantize_int8(q: Tensor, scales: Tensor) -> Tensor:
    return q.float() * scales[:, None]


def quantize_int4(weight: Tensor, group_size: int) -> tuple[Tensor, Tensor, Tensor]:
    """[N, K] float -> (int32 values 0..15 [N, K], float32 scales [N, K/g], float32 mins [N, K/g])."""
    n, k = weight.shape
    if k % group_size:
        raise ValueError(f"in_features {k} is not a multiple of the int4 group size {group_size}")
    w = weight.float().reshape(n, k // group_size, group_size)
    low, high = w.amin(dim=-1), w.amax(dim=-1)
    scales = ((high - low) / 15.0).clamp(min=1e-12)
    q = torch.round((w - low[..., None]) / scales[..., None]).clamp(0, 15).to(torch.int32)
    return q.reshape(n, k), scales, low


def dequantize_int4(q: Tensor, scales: Tensor, mins: Tensor) -> Tensor:
    n, k = q.shape
    groups = scales.shape[1]
    return (q.reshape(n, groups, -1).float() * scales[..., None] + mins[..., None]).reshape(n, k)


def int8_from_blocks(codes: Tensor, block_scales: Tensor, block: int = 32) -> tuple[Tensor, Tensor]:
    """Blocks of int8 codes with one scale each (GGUF Q8_0: w = q * d per block of 32) -> per-channel
    int8 (q' [N, K], float32 scales [N]), without holding the float weights of the whole matrix.

    The result is bit for bit `quantize_int8` of the dequantized weights (each q * d is exact in
    float32: an fp16 scale times an integer below 2^8), so the error is that of per-channel int8:
    |w' - w| <= scale_n / 2 = max_k |w_nk| / 254 per element; blocks whose own scale is the row's
    largest keep their values, blocks with smaller scales lose the low bits.
    """
    n, k = codes.shape
    blocks = codes.reshape(n, k // block, block)
    d = block_scales.float().reshape(n, k // block)
    largest = blocks.to(torch.int16).abs().amax(dim=-1).float()  # int16: |-128| overflows int8
    scales = ((largest * d.abs()).amax(dim=1) / 127.0).clamp(min=1e-12)
    q = torch.empty(n, k, dtype=torch.int8, device=codes.device)
    rows = max(1, (1 << 22) // k)  # ~16 MiB of float32 at a time
    for start in range(0, n, rows):
        end = min(n, start + rows)
        w = blocks[start:end].float() * d[start:end, :, None]
        q[start:end] = torch.round(w.reshape(end - start, k) / scales[start:end, None]).clamp(-127, 127).to(torch.int8)
    return q, scales


def pack_nibbles(q: Tensor) -> Tensor:
    """Portable int4: values 0..15 [..., K] -> uint8 [..., K/2], column 2j in the low nibble of byte j
    and 2j+1 in the high one (the on-disk form; kernels get their own layout from `_pack_int4`)."""
    q = q.to(torch.uint8)
    return q[..., 0::2] | (q[..., 1::2] << 4)


def unpack_nibbles(packed: Tensor) -> Tensor:
    """uint8 [..., K/2] -> uint8 values 0..15 [..., K] (inverse of `pack_nibbles`)."""
    return torch.stack([packed & 15, packed >> 4], dim=-1).reshape(*packed.shape[:-1], -1)


def int4_fits(in_features: int, out_features: int, group_size: int) -> bool:
    return in_features % group_size == 0 and out_features % INT4_N_MULTIPLE == 0


def int8_fits(in_features: int) -> bool:
    return in_features % INT8_K_MULTIPLE == 0


def runs_blocks(device: torch.device | str, in_features: int) -> bool:
    """Whether a layer on `device` takes keel's block kernels (else torch's aten kernels)."""
    return kernels.enabled(torch.device(device).type) and blocks_fit(in_features)


class QuantizedLinear(nn.Module):
    """Drop-in for nn.Linear holding int8 or packed int4 weights (buffers: they are not trained)."""

    def __init__(self, linear: nn.Linear | None = None, scheme: str = "int8", group_size: int = 128) -> None:
        super().__init__()
        self.bias: Tensor | None
        if linear is None:  # an empty shell: from_int8 / from_int4 / from_float fill it
            return
        bias = linear.bias.detach().clone() if linear.bias is not None else None
        self._quantize(linear.weight.detach(), scheme, group_size, bias)

    @classmethod
    def from_float(
        cls, weight: Tensor, scheme: str, group_size: int = 128, bias: Tensor | None = None
    ) -> QuantizedLinear:
        """Quantize a float [N, K] weight; the compute dtype is the weight's."""
        layer = cls()
        layer._quantize(weight.detach(), scheme, group_size, bias)
        return layer

    @classmethod
    def from_int8(
        cls, q: Tensor, scales: Tensor, bias: Tensor | None = None, dtype: torch.dtype = torch.bfloat16
    ) -> QuantizedLinear:
        """int8 [N, K] codes and per-output-channel scales [N] (w = q * s), on q's device."""
        layer = cls()
        layer._set_int8(q, scales, bias, dtype)
        return layer

    @classmethod
    def from_int4(
        cls,
        q: Tensor,
        scales: Tensor,
        mins: Tensor,
        group_size: int,
        bias: Tensor | None = None,
        dtype: torch.dtype = torch.bfloat16,
    ) -> QuantizedLinear:
        """Values 0..15 [N, K] with per-group scales and mins [N, K/g] (w = q * s + min), packed for
        q's device."""
        layer = cls()
        layer._set_int4(q, scales, mins, group_size, bias, dtype)
        return layer

    @classmethod
    def from_blocks(
        cls,
        bits: int,
        codes: Tensor,
        scales: Tensor,
        mins: Tensor | None,
        bias: Tensor | None = None,
        dtype: torch.dtype = torch.bfloat16,
    ) -> QuantizedLinear:
        """GGUF's blocks (keel.weights.gguf_blocks) as integer values [N, K] (4 bits: 0..15; 8 bits: int8)
        with their scales (and mins) [N, G], w = q * scale (+ min) per group of K/G: G = K/32, or K/16
        for 8-bit codes without mins (Q6_K). keel's kernels run them as they are; torch's kernels get
        int4 groups of 32 and, for 8-bit blocks of 32 without mins, per-channel int8
        (`int8_from_blocks`); other forms have no torch kernel (ValueError)."""
        layer = cls()
        n, k = codes.shape
        group = k // scales.shape[1]
        if runs_blocks(codes.device, k):
            packed = nibble_blocks(codes) if bits == 4 else codes.to(torch.int8)
            layer._set_blocks("int4" if bits == 4 else "int8", bits, packed, scales, mins, group, bias, dtype)
        elif bits == 4:
            layer._set_int4(codes, scales, mins, group, bias, dtype)
        elif group == BLOCK and mins is None:
            q, row_scales = int8_from_blocks(codes, scales, BLOCK)
            layer._set_int8(q, row_scales, bias, dtype)
        else:
            with_mins = "with" if mins is not None else "without"
            raise ValueError(f"8-bit blocks of {group} {with_mins} mins run on keel's kernels only")
        return layer

    def _quantize(self, weight: Tensor, scheme: str, group_size: int, bias: Tensor | None) -> None:
        if scheme not in SCHEMES:
            raise ValueError(f"unknown quantization {scheme!r}; choose from {', '.join(SCHEMES)}")
        if scheme == "int8":
            q, scales = quantize_int8(weight)
            self._set_int8(q, scales, bias, weight.dtype)
        else:
            if group_size not in INT4_GROUP_SIZES:
                raise ValueError(f"int4 group size must be one of {INT4_GROUP_SIZES}, got {group_size}")
            q, scales, mins = quantize_int4(weight, group_size)
            self._set_int4(q, scales, mins, group_size, bias, weight.dtype)

    def _set_common(
        self, scheme: str, n: int, k: int, group_size: int, bias: Tensor | None, dtype: torch.dtype
    ) -> None:
        self.scheme = scheme
        self.in_features, self.out_features = k, n
        self.group_size = group_size
        self.compute_dtype = dtype
        if bias is not None:
            if tuple(bias.shape) != (n,):
                raise ValueError(f"bias of shape {list(bias.shape)} for {n} output features")
            self.register_buffer("bias", bias.to(dtype))
        else:
            self.bias = None

    def _set_int8(self, q: Tensor, scales: Tensor, bias: Tensor | None, dtype: torch.dtype) -> None:
        if q.dim() != 2 or q.dtype != torch.int8:
            raise ValueError(f"int8 weights must be an int8 [N, K] tensor, got {q.dtype} {list(q.shape)}")
        n, k = q.shape
        if tuple(scales.shape) != (n,):
            raise ValueError(f"int8 scales must have shape [{n}], got {list(scales.shape)}")
        if runs_blocks(q.device, k):
            self._set_blocks("int8", 8, q.contiguous(), scales.float().reshape(n, 1), None, k, bias, dtype)
            return
        if not int8_fits(k):
            raise ValueError(f"the int8 kernel needs in_features in multiples of {INT8_K_MULTIPLE}, got {k}")
        self.layout = "aten"
        self._set_common("int8", n, k, 0, bias, dtype)
        self.register_buffer("qweight", q.contiguous())
        self.register_buffer("scales", scales.to(device=q.device, dtype=dtype))

    def _set_int4(
        self, q: Tensor, scales: Tensor, mins: Tensor, group_size: int, bias: Tensor | None, dtype: torch.dtype
    ) -> None:
        if q.dim() != 2:
            raise ValueError(f"int4 values must be a [N, K] tensor, got {list(q.shape)}")
        n, k = q.shape
        if group_size not in INT4_GROUP_SIZES:
            raise ValueError(f"int4 group size must be one of {INT4_GROUP_SIZES}, got {group_size}")
        if not int4_fits(k, n, group_size):
            raise ValueError(
                f"int4 needs in_features divisible by the group ({k} by {group_size}) and out_features by "
                f"{INT4_N_MULTIPLE} ({n})"
            )
        groups = k // group_size
        if tuple(scales.shape) != (n, groups) or tuple(mins.shape) != (n, groups):
            raise ValueError(
                f"int4 scales/mins must have shape [{n}, {groups}], got {list(scales.shape)}/{list(mins.shape)}"
            )
        if runs_blocks(q.device, k):
            self._set_blocks("int4", 4, nibble_blocks(q), scales.float(), mins.float(), group_size, bias, dtype)
            return
        self.layout = "aten"
        self._set_common("int4", n, k, group_size, bias, dtype)
        # The kernels' zero point: w = (q - 8) * s + z, so z = min + 8 s (in float32, then one rounding
        # to the compute dtype, which the kernels require for scales and zeros alike).
        scales, mins = scales.float(), mins.float()
        zeros = mins + 8.0 * scales
        self.register_buffer("qweight", _pack_int4(q.to(torch.int32), q.device))
        sz = torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous().to(device=q.device, dtype=dtype)
        self.register_buffer("scales_and_zeros", sz)

    def _set_blocks(
        self,
        scheme: str,
        bits: int,
        codes: Tensor,
        scales: Tensor,
        mins: Tensor | None,
        group_size: int,
        bias: Tensor | None,
        dtype: torch.dtype,
    ) -> None:
        """Codes already in the block layout (keel.quant.block_layout), scales and mins [N, G]."""
        n = codes.shape[0]
        k = codes.shape[1] * (2 if bits == 4 else 1)
        self.layout = "blocks"
        self.bits = bits
        # 2: the activations' int8 residual too (~15 bits; keel.quant.apply.set_activations "refined"):
        # twice the integer products, the same weight bytes.
        self.activation_passes = 1
        # 0: codes and scales in rows, as above; PANEL_ROWS: in kernels.h's panel layout (`store_in_panels`).
        self.panel_rows = 0
        self._set_common(scheme, n, k, group_size, bias, dtype)
        self.register_buffer("qweight", codes.contiguous())
        self.register_buffer("scales", scales.to(device=codes.device).contiguous())
        self.register_buffer("mins", None if mins is None else mins.to(device=codes.device).contiguous())

    def store_in_panels(self) -> bool:
        """Re-store the codes, scales and mins in the panel layout the stored-panel kernels read
        (keel.quant.panels); whether they were re-stored (block layout, on the CPU, not yet)."""
        if self.layout != "blocks" or self.panel_rows or self.qweight.device.type != "cpu":
            return False
        b = self._buffers
        stored = torch.ops.keel.block_panels(b["qweight"], b["scales"], b["mins"], self.bits)
        b["qweight"], b["scales"] = stored[0], stored[1]
        b["mins"] = stored[2] if len(stored) > 2 else None
        self.panel_rows = PANEL_ROWS
        return True

    def _row_blocks(self) -> tuple[Tensor, Tensor, Tensor | None]:
        """(codes, scales, mins) in the row layout, whichever layout they are stored in."""
        b = self._buffers
        if not self.panel_rows:
            return b["qweight"], b["scales"], b["mins"]
        rows = torch.ops.keel.block_rows(b["qweight"], b["scales"], b["mins"], self.bits)
        return rows[0], rows[1], rows[2] if len(rows) > 2 else None

    def fused_with(self, others: list[nn.Module]) -> QuantizedLinear | None:
        """One block-layout layer whose output rows are this layer's, then each of `others`' (the fused
        q/k/v and gate/up projections of keel.model.fuse), or None when they do not share a layout:
        the same bits, scale dtype, group size, compute dtype and device, all or no mins and biases."""
        parts = [self, *others]

        def key(p: nn.Module) -> tuple | None:
            if not isinstance(p, QuantizedLinear) or p.layout != "blocks" or p.panel_rows:
                return None
            return (
                p.bits,
                p.scales.dtype,
                p.scales.shape[1],
                p.mins is None,
                p.bias is None,
                p.compute_dtype,
                p.qweight.device,
                p.in_features,
            )

        first = key(self)
        if first is None or any(key(p) != first for p in others):
            return None
        fused = QuantizedLinear()
        fused._set_blocks(
            self.scheme,
            self.bits,
            torch.cat([p.qweight for p in parts]),
            torch.cat([p.scales for p in parts]),
            None if self.mins is None else torch.cat([p.mins for p in parts]),
            self.group_size,
            None if self.bias is None else torch.cat([p.bias for p in parts]),
            self.compute_dtype,
        )
        fused.activation_passes = max(p.activation_passes for p in parts)
        return fused

    def values(self) -> tuple[Tensor, Tensor, Tensor | None]:
        """The layer's integer values [N, K] and float32 scales and mins [N, G] (w = q * s + min per
        group of K/G inputs; int8 has no mins), whatever its layout."""
        if self.layout == "blocks":
            codes, scales, mins = self._row_blocks()
            q = values_of_nibble_blocks(codes) if self.bits == 4 else codes
            return q, scales.float(), None if mins is None else mins.float()
        if self.scheme == "int8":
            return self.qweight, self.scales.float()[:, None], None
        q = _unpack_int4(self.qweight, self.out_features, self.in_features)
        sz = self.scales_and_zeros.float().transpose(0, 1)  # [N, G, 2]
        scales = sz[..., 0]
        return q, scales, sz[..., 1] - 8.0 * scales

    def dequantized(self) -> Tensor:
        """The float32 weight [N, K] the layer multiplies by."""
        q, scales, mins = self.values()
        groups = scales.shape[1]
        w = q.float().reshape(self.out_features, groups, -1) * scales[..., None]
        if mins is not None:
            w = w + mins[..., None]
        return w.reshape(self.out_features, self.in_features)

    @property
    def backend(self) -> str:
        """The kernel this layer runs and the activations it is fed, for the start-up log."""
        if self.layout == "blocks":
            scale = "float16" if self.scales.dtype == torch.float16 else "float32"
            acts = "int8 activations" if self.activation_passes == 1 else "int8 activations + residual"
            stored = f", stored in panels of {self.panel_rows} rows" if self.panel_rows else ""
            return f"keel block_linear ({kernels.status()}), {acts}, {scale} scales{stored}"
        device = self.qweight.device.type
        if self.scheme == "int8":
            kernel = "aten _weight_int8pack_mm"
        else:
            kernel = "aten _weight_int4pack_mm" + ("_for_cpu" if device == "cpu" else "")
        activations = str(self.compute_dtype).removeprefix("torch.")
        slow = device == "cpu" and self.compute_dtype != torch.bfloat16
        label = f"{kernel}, {activations} activations" + (" (torch's slow reference path)" if slow else "")
        rows = int8_dequantize_rows(device) if self.scheme == "int8" else None
        return label + (f"; from {rows} rows dequantized to float32 (BLAS)" if rows is not None else "")

    @property
    def weight_bytes(self) -> int:
        total = self.qweight.numel() * self.qweight.element_size()
        for name in ("scales", "mins", "scales_and_zeros"):
            t = getattr(self, name, None)
            if t is not None:
                total += t.numel() * t.element_size()
        return total

    def kernel_args(self, rows: int) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None, int, int, int] | None:
        """(codes, scales, mins, bias, bits, activation passes, panel rows) as keel::block_linear takes them, for an
        operator that runs this layer on `rows` rows inside a larger call (keel.model.fused_layer); None
        where this layer would not run keel::block_linear on them (off the block layout, or from
        BLOCK_DEQUANTIZE_ROWS rows)."""
        if self.layout != "blocks" or self._dequantizes(rows):
            return None
        # The buffers dict directly: nn.Module's attribute lookup costs ~1 us a read, on every layer of
        # every step (a missing bias is a plain None attribute, not a buffer).
        b = self._buffers
        return b["qweight"], b["scales"], b["mins"], b.get("bias"), self.bits, self.activation_passes, self.panel_rows

    def forward(self, x: Tensor) -> Tensor:
        if self.layout == "blocks":
            if not torch.compiler.is_compiling() and self._dequantizes(x.shape[:-1].numel()):
                return self._dequantized_product(x)
            b = self._buffers
            return torch.ops.keel.block_linear(
                x,
                b["qweight"],
                b["scales"],
                b["mins"],
                self.bits,
                b.get("bias"),
                self.activation_passes,
                self.panel_rows,
            )
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if x2.dtype != self.compute_dtype:
            x2 = x2.to(self.compute_dtype)
        if self.scheme == "int8" and self._dequantized_rows(x2):
            # Prefill chunks where bf16 is emulated: the float32 weights (exact: an int8 times a bf16
            # scale fits float32's mantissa) through MKL beat the int8 kernel (keel.platform).
            weight = self.qweight.float() * self.scales.float()[:, None]
            out = torch.nn.functional.linear(x2.float(), weight).to(x2.dtype)
        elif self.scheme == "int8":
            out = torch.ops.aten._weight_int8pack_mm(x2.contiguous(), self.qweight, self.scales)
        elif x2.device.type == "cpu":
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(
                x2.contiguous(), self.qweight, self.group_size, self.scales_and_zeros
            )
        else:
            out = torch.ops.aten._weight_int4pack_mm(
                x2.contiguous(), self.qweight, self.group_size, self.scales_and_zeros
            )
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*shape[:-1], self.out_features)

    def _dequantizes(self, rows: int) -> bool:
        """Whether a product over `rows` rows takes `_dequantized_product` (block layout)."""
        if kernels.vnni_panels_here():
            return False
        if self.panel_rows and kernels.stored_panels_here():
            threshold = STORED_DEQUANTIZE_ROWS[self.bits, self.activation_passes]
            return threshold is not None and rows >= threshold
        if self.bits == 8:
            return rows >= EIGHT_BIT_DEQUANTIZE_ROWS[self.activation_passes]
        if rows < BLOCK_DEQUANTIZE_ROWS:
            return False
        return not (self.activation_passes == 1 and kernels.panels_here())

    def _dequantized_product(self, x: Tensor) -> Tensor:
        """Prefill-sized products on the block layout: the weights dequantized to float32 a slice of
        output rows at a time (each slice stays in cache) times float32 rows through BLAS, the exact
        float product of the stored weights (faster than the integer kernel from BLOCK_DEQUANTIZE_ROWS
        rows: docs/BENCHMARKS.md, "keel's kernels")."""
        x2 = x.reshape(-1, self.in_features).float()
        out = x2.new_empty(x2.shape[0], self.out_features)
        # Whole panels a slice (in the panel layout a run of whole panels is that layout of its rows).
        step = -(-max(1, DEQUANTIZE_SLICE_ELEMENTS // self.in_features) // PANEL_ROWS) * PANEL_ROWS
        for n0 in range(0, self.out_features, step):
            n1 = min(self.out_features, n0 + step)
            mins = None if self.mins is None else self.mins[n0:n1]
            weight = torch.ops.keel.block_dequantize(
                self.qweight[n0:n1], self.scales[n0:n1], mins, self.bits, self.panel_rows
            )
            out[:, n0:n1] = x2 @ weight.t()
        if self.bias is not None:
            out += self.bias.float()
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def _dequantized_rows(self, x2: Tensor) -> bool:
        if torch.compiler.is_compiling():  # one graph for every batch size: no shape-dependent branch
            return False
        rows = int8_dequantize_rows(x2.device.type)
        return rows is not None and x2.shape[0] >= rows

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> QuantizedLinear:  # type: ignore[override]
        """`.to(device)` / `.to(dtype)`: packed int4 is device-specific, so a move to another device
        type unpacks it and packs it again there; a dtype change moves the compute dtype with the scales.
        Block-layout layers keep their codes and scales as they are (the kernels read float16 and float32
        scales whatever the activations); a move off the CPU repacks them for torch's kernels there."""
        if getattr(self, "layout", None) == "blocks":
            return self._apply_blocks(fn, recurse)
        values = None
        if getattr(self, "scheme", None) == "int4":
            here = self.qweight.device
            there = fn(torch.empty(0, device=here)).device  # where this call sends tensors
            if there.type != here.type and there.type != "meta":
                values = _unpack_int4(self.qweight, self.out_features, self.in_features)
        super()._apply(fn, recurse)
        if values is not None:
            self.qweight = _pack_int4(values.to(self.scales_and_zeros.device), self.scales_and_zeros.device)
        if hasattr(self, "scheme"):
            self.compute_dtype = (self.scales if self.scheme == "int8" else self.scales_and_zeros).dtype
        return self

    def _apply_blocks(self, fn: Callable[[Tensor], Tensor], recurse: bool) -> QuantizedLinear:
        probe = fn(torch.empty(0, dtype=self.compute_dtype, device=self.qweight.device))
        if probe.device.type not in ("cpu", "meta"):
            q, scales, mins = self.values()
            bias = self.bias
            del self.qweight, self.scales, self.mins
            if self.scheme == "int8":
                if mins is not None:  # 8-bit codes with mins (Q5_K): per-channel int8 of the weights
                    q, scales = quantize_int8(self.dequantized())
                else:  # per channel (one group), blocks of 32 or half blocks (Q6_K)
                    groups = max(scales.shape[1], self.in_features // BLOCK)
                    block = self.in_features // groups
                    q, scales = int8_from_blocks(q, scales.expand(-1, groups).contiguous(), block)
                self._set_int8(q.to(probe.device), scales, bias, self.compute_dtype)
            else:
                group = self.in_features // scales.shape[1]
                self._set_int4(q.to(probe.device), scales, mins, group, bias, self.compute_dtype)
            return self._apply(fn, recurse)
        apply_keeping_scales(self, fn, recurse, probe.device)
        self.compute_dtype = probe.dtype
        return self

    def extra_repr(self) -> str:
        group = f", group_size={self.group_size}" if self.scheme == "int4" else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.scheme}{group}"


def _inner_k_tiles(k: int) -> int:
    # CUDA tiles K by innerKTiles * 16 (2, 4 or 8): the largest that divides K.
    return next(t for t in (8, 4, 2) if k % (t * 16) == 0)


def _pack_int4(q: Tensor, device: torch.device | str) -> Tensor:
    """int32 values 0..15 [N, K] -> the int4 kernel's packed layout for `device`."""
    device = torch.device(device)
    if device.type == "cpu":
        return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.cpu(), 1)
    # CUDA's layout packs two values per byte first (uint8 [N, K/2]), then tiles them.
    packed = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8)
    return torch.ops.aten._convert_weight_to_int4pack(packed.to(device), _inner_k_tiles(q.shape[1]))


def _unpack_int4(packed: Tensor, n: int, k: int) -> Tensor:
    """The kernel layout of `packed` back to int32 values [N, K] on the same device.

    The layouts (CPU: 64/32/16-row blocks, CUDA: tiles) are torch internals, so they are not
    hard-coded: every layout is a permutation of nibbles, which packing the base-16 digits of each
    element's index reveals. Only device moves need this (packing at load is direct).
    """
    device = packed.device
    total = n * k
    index = torch.arange(total, dtype=torch.int64, device=device)
    source = torch.zeros(total, dtype=torch.int64, device=device)
    shift = 0
    while (1 << shift) < total:
        probe = ((index >> shift) & 15).to(torch.int32).reshape(n, k)
        source |= _nibbles(_pack_int4(probe, device)).to(torch.int64) << shift
        shift += 4
    values = torch.empty(total, dtype=torch.int32, device=device)
    values[source] = _nibbles(packed).to(torch.int32)
    return values.reshape(n, k)


def _nibbles(packed: Tensor) -> Tensor:
    """Every nibble of a packed tensor's bytes in memory order: low nibble first."""
    raw = packed.contiguous().view(torch.uint8).reshape(-1)
    return torch.stack([raw & 15, raw >> 4], dim=-1).reshape(-1)
