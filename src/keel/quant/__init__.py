"""Weight-only quantization of keel models (int8 per channel, int4 per group, GGUF blocks as they are).

The names below load on first use: keel.quant.config (the options, read by the CLI before torch is imported)
sits in this package too, and importing it must not import the kernels' modules."""

from __future__ import annotations

from typing import TYPE_CHECKING

from keel.lazy import lazy_exports

if TYPE_CHECKING:
    from keel.quant.apply import LOAD_SCHEMES, quantize_model
    from keel.quant.experts import QuantizedGroupedExperts
    from keel.quant.linear import SCHEMES, QuantizedLinear

__all__ = ["LOAD_SCHEMES", "SCHEMES", "QuantizedGroupedExperts", "QuantizedLinear", "quantize_model"]
_HOMES = {
    "LOAD_SCHEMES": "keel.quant.apply",
    "quantize_model": "keel.quant.apply",
    "QuantizedGroupedExperts": "keel.quant.experts",
    "SCHEMES": "keel.quant.linear",
    "QuantizedLinear": "keel.quant.linear",
}

__getattr__ = lazy_exports(__name__, _HOMES)
