"""Weight-only quantization of keel models (int8 per channel, int4 per group, GGUF blocks as they are)."""

from keel.quant.apply import LOAD_SCHEMES, quantize_model
from keel.quant.experts import QuantizedGroupedExperts
from keel.quant.linear import SCHEMES, QuantizedLinear

__all__ = ["LOAD_SCHEMES", "SCHEMES", "QuantizedGroupedExperts", "QuantizedLinear", "quantize_model"]
