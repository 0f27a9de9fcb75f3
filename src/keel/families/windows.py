"""Which layers of a family attend within a sliding window: config.json's `layer_types` where it has them, else the
family's rule of one global layer in every `every` (the last of each group), as transformers' config classes build
them (Gemma 3, OLMo 3, EXAONE 4, Cohere 2)."""

from __future__ import annotations

from typing import Any


def sliding_layer_types(hf: dict[str, Any], every: int) -> list[str]:
    """Per layer, "sliding_attention" or "full_attention"."""
    layers = int(hf["num_hidden_layers"])
    given = hf.get("layer_types")
    if given:
        return list(given)
    return ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(layers)]
