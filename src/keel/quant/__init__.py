"""Weight-only quantization of keel models (int8 per channel, int4 per group)."""

from keel.quant.apply import quantize_model
from keel.quant.linear import SCHEMES, QuantizedLinear

__all__ = ["SCHEMES", "QuantizedLinear", "quantize_model"]
