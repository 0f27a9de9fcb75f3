"""`keel upcycle SRC DST --experts E --top-k K`: a mixture-of-experts model made from a dense one.

Sparse upcycling (Komatsuzaki et al., 2022): every MLP becomes E copies of itself behind a fresh
router, as a Mixtral checkpoint (a Llama-family model whose MLPs are sparse). With renormalised
top-k weights (they sum to 1) and identical experts, the MoE computes exactly the dense MLP, so the
upcycled model must reproduce the dense model's logits: an end-to-end check of loading, routing and
dispatch on real weights. Training then lets the experts diverge. `--noise` perturbs each expert
copy (relative std) to break the symmetry for a benchmark or a fine-tune; 0 keeps them identical.
"""

from __future__ import annotations

import dataclasses

import torch

from keel.config import ModelConfig
from keel.errors import KeelError
from keel.model.transformer import Transformer

# Dense families with a sparse counterpart of the same attention and norms.
_SPARSE_FAMILY = {"llama": "mixtral", "mistral": "mixtral"}


def upcycled_config(dense: ModelConfig, num_experts: int, top_k: int) -> ModelConfig:
    family = _SPARSE_FAMILY.get(dense.architecture)
    if family is None:
        supported = ", ".join(_SPARSE_FAMILY)
        raise KeelError(f"upcycle: a {dense.architecture} model has no MoE counterpart here (supported: {supported})")
    if dense.mlp_bias:
        raise KeelError("upcycle: MLP biases have no place in Mixtral experts")
    if num_experts < 2:
        raise KeelError(f"upcycle: --experts must be at least 2, got {num_experts}")
    if not 1 <= top_k <= num_experts:
        raise KeelError(f"upcycle: --top-k must be in 1..{num_experts}, got {top_k}")
    return dataclasses.replace(
        dense,
        architecture=family,
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=dense.intermediate_size,
        norm_topk_prob=True,
        layer_types=list(dense.layer_types),
    )


@torch.no_grad()
def upcycle_model(dense: Transformer, num_experts: int, top_k: int, seed: int = 0, noise: float = 0.0) -> Transformer:
    config = upcycled_config(dense.config, num_experts, top_k)
    with torch.device("meta"):
        sparse = Transformer(config)
    sparse.to_empty(device="cpu")
    sparse.to(dense.dtype)
    state = dense.state_dict()
    generator = torch.Generator().manual_seed(seed)
    new_state = {}
    for name, tensor in sparse.state_dict().items():
        if ".mlp.router." in name:
            # Random routing: with identical experts any router gives the dense output; a spread-out
            # one makes every expert work (what offloading and load statistics need to see).
            new_state[name] = (torch.randn(tensor.shape, generator=generator) * 0.02).to(tensor.dtype)
        elif name.endswith(".mlp.experts.gate_up_proj"):
            prefix = name.removesuffix("experts.gate_up_proj")
            fused = torch.cat([state[prefix + "gate_proj.weight"], state[prefix + "up_proj.weight"]], dim=0)
            new_state[name] = _copies(fused, num_experts, noise, generator)
        elif name.endswith(".mlp.experts.down_proj"):
            prefix = name.removesuffix("experts.down_proj")
            new_state[name] = _copies(state[prefix + "down_proj.weight"], num_experts, noise, generator)
        else:
            new_state[name] = state[name]
    sparse.load_state_dict(new_state)
    sparse.reset_buffers("cpu")
    return sparse.eval()


def _copies(weight: torch.Tensor, n: int, noise: float, generator: torch.Generator) -> torch.Tensor:
    stacked = weight.unsqueeze(0).repeat(n, *([1] * weight.dim()))
    if noise:
        scale = weight.float().std() * noise
        stacked += (torch.randn(stacked.shape, generator=generator) * scale).to(stacked.dtype)
    return stacked
