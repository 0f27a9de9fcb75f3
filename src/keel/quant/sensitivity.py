"""Sensitive-layer analysis: quantize one linear layer at a time and measure what it costs.

The float model runs once over the tokens; then, for every linear layer alone, its quantized version
is swapped in and the logits' relative error, cosine similarity and perplexity change against the
float logits are measured. `keel quantize analyze` (keel.cli.quantize) prints the ranking and
writes a mixed-precision plan from it (keel.quant.plan).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from keel.model.perplexity import perplexity_of_logits
from keel.quant.linear import QuantizedLinear


@dataclass
class LayerSensitivity:
    name: str
    ppl_change: float  # quantized perplexity / float perplexity - 1
    rel_error: float  # ||logits_q - logits|| / ||logits||
    cosine: float  # cosine similarity of the flattened logits


@torch.no_grad()
def analyze(model: nn.Module, ids: list[int], scheme: str, group_size: int = 128) -> list[LayerSensitivity]:
    """Every quantizable linear layer of `model`, most sensitive first."""
    tokens = torch.tensor([ids])
    base = model(tokens).float()
    base_ppl = perplexity_of_logits(base, tokens)
    results = []
    for name, linear in [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]:
        if scheme == "int4" and linear.in_features % group_size:
            continue  # stays in float anyway
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, QuantizedLinear(linear, scheme, group_size))
        try:
            logits = model(tokens).float()
        finally:
            setattr(parent, child, linear)
        results.append(
            LayerSensitivity(
                name=name,
                ppl_change=perplexity_of_logits(logits, tokens) / base_ppl - 1,
                rel_error=((logits - base).norm() / base.norm()).item(),
                # float64: millions of logits summed in float32 drift past 1.0
                cosine=F.cosine_similarity(logits.flatten().double(), base.flatten().double(), dim=0).item(),
            )
        )
    results.sort(key=lambda r: (r.ppl_change, r.rel_error), reverse=True)
    return results
