"""bf16 linear layers prepared for the host's CPU path, for serving: pre-packed for oneDNN where it has
a bf16 path, upcast to float32 for large products where it has none (`prepare_bf16_linears`).

Why: torch's bf16 `F.linear` on CPU already runs oneDNN, but it reorders the plain [out, in] weight
into oneDNN's blocked layout on every call. Packed once at load, a decode step's matrix-vector
products skip that work (timings in docs/BENCHMARKS.md, "The decode fast path"). The result is
bit-identical to `F.linear` in bf16 (the same oneDNN kernel after the reorder; checked at every batch
size in tests/test_prepack.py). Float32 stays as it is: aten's float32 linear is a BLAS sgemm whose sums
differ from oneDNN's in the last bit.

Under compilation the packed product is a `torch.library` op, so `torch.compile` treats it as one opaque call
(inductor cannot lower the oneDNN op outside its own weight-freezing pass, which changes results).
A tied LM head gets its own packed copy (the embedding keeps the plain table for lookups).

Without a oneDNN bf16 path (AVX2 alone), aten converts bf16 to float32 inside its product, several
times slower than float32's sgemm at prefill sizes (docs/BENCHMARKS.md, the AVX2 path): `UpcastLinear`
keeps the bf16 weight (decode's matrix-vector products read half the bytes) and, from
`keel.platform.bf16_upcast_rows` rows, runs the product as float32 weights upcast per call through
BLAS, rounding the output to bf16.
"""

from __future__ import annotations

from fnmatch import fnmatchcase

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from keel.model.mla import WEIGHT_READ_LINEARS
from keel.platform import bf16_upcast_rows, host


def prepack_available(device: torch.device | str = "cpu") -> bool:
    """Whether bf16 weights can be pre-packed here: a CPU whose oneDNN has a bf16 path (keel.platform:
    AVX-512 BW/VL/DQ or AVX-NE-CONVERT; not AVX2 alone, where oneDNN refuses the reorder)."""
    return (
        torch.device(device).type == "cpu"
        and host().onednn_bf16
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


# Registered through torch.library's low-level API: an op made with `torch.library.custom_op` pays
# for its Python wrappers on every call, a cost a step's products add up (docs/BENCHMARKS.md).
_lib = torch.library.Library("keel", "FRAGMENT")
_lib.define("packed_linear(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor")


def _packed_linear(x: Tensor, packed: Tensor, bias: Tensor | None, out_features: int) -> Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


_lib.impl("packed_linear", _packed_linear, "CompositeExplicitAutograd")  # packed weights are MkldnnCPU tensors


@torch.library.register_fake("keel::packed_linear")
def _(x: Tensor, packed: Tensor, bias: Tensor | None, out_features: int) -> Tensor:
    return x.new_empty(*x.shape[:-1], out_features)


class PackedLinear(nn.Module):
    """A bf16 `nn.Linear` whose weight lives in oneDNN's packed layout (inference only)."""

    backend = "oneDNN pre-packed"

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(weight, 1))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach())

    @property
    def weight_bytes(self) -> int:
        """Bytes a product reads (keel.profile.roofline counts layers by this)."""
        tensors = [self.packed] + ([self.bias] if self.bias is not None else [])
        return sum(t.numel() * t.element_size() for t in tensors)

    def forward(self, x: Tensor) -> Tensor:
        if torch.compiler.is_compiling():  # one opaque call in the graph
            return torch.ops.keel.packed_linear(x, self.packed, self.bias, self.out_features)
        return _packed_linear(x, self.packed, self.bias, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, packed"


@torch.no_grad()
def prepack_linears(model: nn.Module) -> int:
    """Replace every plain bf16 CPU `nn.Linear` in `model` by a `PackedLinear`; the number replaced."""
    if not prepack_available():
        return 0
    return _replace_bf16_linears(model, PackedLinear)


UPCAST_BLOCK = 512  # output rows upcast at once: 1.1 MB of float32 at 576 inputs


class UpcastLinear(nn.Module):
    """A bf16 `nn.Linear` for CPUs whose bf16 product is emulated: small products in bf16, large ones
    (prefill chunks, wide batches) on the weights upcast to float32 (inference only; the weight and
    bias are the wrapped layer's own, so a tied head stays tied)."""

    def __init__(self, linear: nn.Linear, rows: int) -> None:
        super().__init__()
        self.in_features, self.out_features, self.rows = linear.in_features, linear.out_features, rows
        self.weight, self.bias = linear.weight, linear.bias

    @property
    def backend(self) -> str:
        """The start-up line's name for this layer's path (keel.serve.backends)."""
        return f"bfloat16 aten (emulated); from {self.rows} rows upcast to float32 (BLAS)"

    def forward(self, x: Tensor) -> Tensor:
        # Under compilation one graph serves every batch size: no shape-dependent branch.
        if torch.compiler.is_compiling() or x.numel() < self.rows * self.in_features:
            return F.linear(x, self.weight, self.bias)
        x32 = x.reshape(-1, self.in_features).float()
        out = x.new_empty(x32.shape[0], self.out_features)
        # A block of output rows at a time: its float32 copy stays in cache for the product (the whole
        # copy of a large head would be written to memory and read back).
        for start in range(0, self.out_features, UPCAST_BLOCK):
            rows = slice(start, start + UPCAST_BLOCK)
            bias = None if self.bias is None else self.bias[rows].float()
            out[:, rows] = F.linear(x32, self.weight[rows].float(), bias)
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, upcast"


def _replace_bf16_linears(model: nn.Module, make) -> int:
    """Replace the plain bf16 CPU linears by `make(linear)`, but those whose weight is read as a matrix
    (keel.model.mla.WEIGHT_READ_LINEARS: a packed layer has no `weight`)."""
    replaced = 0
    for prefix, module in list(model.named_modules()):
        for name, child in list(module.named_children()):
            qualified = f"{prefix}.{name}" if prefix else name
            if any(fnmatchcase(qualified, pattern) for pattern in WEIGHT_READ_LINEARS):
                continue
            if type(child) is nn.Linear and child.weight.dtype == torch.bfloat16 and child.weight.device.type == "cpu":
                setattr(module, name, make(child))
                replaced += 1
    return replaced


@torch.no_grad()
def prepare_bf16_linears(model: nn.Module) -> int:
    """The serving engine's step: every plain bf16 CPU `nn.Linear` pre-packed for oneDNN where it has a
    bf16 path, else wrapped as an `UpcastLinear`; the number replaced."""
    if prepack_available():
        return prepack_linears(model)
    rows = bf16_upcast_rows("cpu")
    return 0 if rows is None else _replace_bf16_linears(model, lambda linear: UpcastLinear(linear, rows))
