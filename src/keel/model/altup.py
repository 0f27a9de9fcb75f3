"""Gemma 3n's AltUp and LAuReL (ModelConfig.altup_num_inputs, laurel_rank), as transformers' Gemma3nTextAltUp and
Gemma3nTextLaurelBlock compute them.

AltUp holds the residual stream as n copies [n, B, S, H]: the model makes them from the embedding and merges them
after the last layer (`spread`, `merge`); each layer predicts every copy from all of them, runs its sublayers on the
active copy alone and corrects every copy by what the sublayers changed in it (`AltUp`).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from keel.config import ModelConfig
from keel.model.layers import block_norm

_MIN_SQUARE = 1e-5  # transformers' floor on a projected copy's mean square before its renormalisation


def _renormalised(x: Tensor, target: Tensor) -> Tensor:
    """x scaled to root mean square `target` over its channels."""
    return x * target / torch.sqrt(torch.mean(x**2, dim=-1, keepdim=True).clamp(min=_MIN_SQUARE))


def spread(h: Tensor, projections: nn.ModuleList) -> Tensor:
    """[B, S, H] -> [n, B, S, H]: the embedding, then each projection of it at the embedding's magnitude."""
    target = torch.mean(h**2, dim=-1, keepdim=True) ** 0.5
    return torch.stack([h, *(_renormalised(proj(h), target) for proj in projections)])


def merge(x: Tensor, projections: nn.ModuleList) -> Tensor:
    """[n, B, S, H] -> [B, S, H]: the mean of the first copy and the others' projections at its magnitude."""
    target = torch.mean(x[0] ** 2, dim=-1, keepdim=True) ** 0.5
    copies = [x[0], *(_renormalised(proj(x[i + 1]), target) for i, proj in enumerate(projections))]
    return torch.mean(torch.stack(copies), dim=0)


class AltUp(nn.Module):
    """One layer's prediction and correction of the copies (transformers' names: `altup.*`)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        n, h = config.altup_num_inputs, config.hidden_size
        self.n, self.active, self.scales_output = n, config.altup_active_idx, config.altup_correct_scale
        self.correct_output_scale = nn.Parameter(torch.zeros(h))
        self.correction_coefs = nn.Linear(n, n, bias=False)
        self.prediction_coefs = nn.Linear(n, n * n, bias=False)
        self.modality_router = nn.Linear(h, n, bias=False)
        self.router_norm = block_norm(config, h)
        self.router_input_scale = 1.0 / h

    def _modalities(self, x: Tensor) -> Tensor:
        """[B, S, n]: the router's tanh (in float32) of the normed copy."""
        routed = self.modality_router(self.router_norm(x) * self.router_input_scale)
        return torch.tanh(routed.float()).type_as(x)

    def predict(self, x: Tensor) -> Tensor:
        """[n, B, S, H]: each copy plus a mix of all of them, its coefficients per token from the active copy."""
        modalities = self._modalities(x[self.active])
        coefs = self.prediction_coefs(modalities).reshape(*modalities.shape[:-1], self.n, self.n).permute(0, 1, 3, 2)
        predictions = torch.matmul(x.permute(1, 2, 3, 0), coefs).permute(3, 0, 1, 2)
        return (predictions + x).contiguous().type_as(x)

    def correct(self, predictions: Tensor, activated: Tensor) -> Tensor:
        """[n, B, S, H]: each prediction plus the active copy's innovation (`activated` less its prediction) times
        a coefficient per copy and token."""
        innovation = activated - predictions[self.active]
        coefs = (self.correction_coefs(self._modalities(activated)) + 1.0).permute(2, 0, 1).unsqueeze(-1)
        return (innovation.unsqueeze(0) * coefs + predictions).contiguous().type_as(activated)

    def scale_output(self, x: Tensor) -> Tensor:
        """The corrected active copy as the per-layer input branch reads it."""
        if not self.scales_output:
            return x
        return (x.type_as(self.correct_output_scale) * self.correct_output_scale).type_as(x)


class Laurel(nn.Module):
    """LAuReL: the attention's normed input plus its low-rank projection, normed (transformers' `laurel.*`)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h = config.hidden_size
        self.linear_left = nn.Linear(h, config.laurel_rank, bias=False)
        self.linear_right = nn.Linear(config.laurel_rank, h, bias=False)
        self.post_laurel_norm = block_norm(config, h)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.post_laurel_norm(self.linear_right(self.linear_left(x)))


SQRT2 = math.sqrt(2)  # the attention's residual sum and LAuReL's branch, averaged in magnitude
