"""Name maps between HF checkpoints and keel's parameters (torchtitan's state_dict_adapter idea).

keel names are HF names without the `model.` prefix, except for MoE blocks, which keel always
calls `mlp` with a `router` and stacked `experts.gate_up_proj` / `experts.down_proj`. HF hub
checkpoints store experts one by one (Mixtral: `block_sparse_moe.experts.E.w1/w2/w3`; Qwen-MoE and
DeepSeek-V3: `mlp.experts.E.gate_proj/up_proj/down_proj`); transformers 5 in memory uses the
stacked form. Both are read; the per-expert hub form is written. GPT-OSS's hub checkpoints store experts
stacked under keel's names, in a layout of their own (keel.weights.gpt_oss). DeepSeek-V3 calls its router
`mlp.gate` (with the selection bias `mlp.gate.e_score_correction_bias`) and its shared experts
`mlp.shared_experts`; keel calls them `mlp.router` and `mlp.shared_expert` as for Qwen2-MoE.
Multi-head latent attention keeps the HF names (`self_attn.q_a_proj`, `kv_a_proj_with_mqa`, ...).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from keel.config import DEEPSEEK_MOE_FAMILIES, ModelConfig
from keel.families import checkpoint_layout, stored_tensor
from keel.weights.parts import fused_stream as parts_fused_stream

_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")


@dataclass(frozen=True)
class Source:
    """Where a keel parameter comes from: HF tensor names and how to combine them."""

    names: tuple[str, ...]
    combine: Callable[[list[Tensor]], Tensor]


# Families whose checkpoints call the shared experts `mlp.shared_experts` (keel: `mlp.shared_expert`).
_SHARED_EXPERTS = DEEPSEEK_MOE_FAMILIES | {"ernie4_5_moe", "cohere2_moe", "kolibri1"}
# Families whose checkpoints name their experts as Mixtral's (`block_sparse_moe.experts.E.w1/w3/w2`, its router `gate`).
MIXTRAL_NAMED = {"mixtral", "minimax", "minimax_m2", "phimoe", "kimi_linear"}
# Families whose checkpoints store each layer's experts stacked: under names their checkpoint_layout renames
# (Granite MoE), or as transformers 5 holds them where it has no per-expert form to save (Mistral 4).
STACKED_EXPERTS = {
    "granitemoe",
    "granitemoeshared",
    "granitemoe_swa",
    "granitemoehybrid",
    "mistral4",
    "gemma4",
    "jetmoe",
}
# Families whose checkpoints store each layer's experts stacked and transposed (keel.weights.gpt_oss), by whether
# their gate and up columns alternate.
TRANSPOSED_EXPERTS = {"gpt_oss": True, "llama4": False}


def _single(tensors: list[Tensor]) -> Tensor:
    return tensors[0]


def _moe_prefix(config: ModelConfig, layer: str) -> str:
    block = "block_sparse_moe" if config.architecture in MIXTRAL_NAMED else "mlp"
    return f"model.layers.{layer}.{block}"


def _expert_names(config: ModelConfig) -> tuple[str, str, str]:
    """(gate, up, down) per-expert weight names in the hub format."""
    if config.architecture in MIXTRAL_NAMED:
        return "w1", "w3", "w2"
    return "gate_proj", "up_proj", "down_proj"


def hf_source(config: ModelConfig, name: str, available: set[str]) -> Source:
    """The HF tensors that make keel parameter `name`."""
    if name in ("lm_head.weight", "lm_head.bias"):
        return Source((name,), _single)
    match = _LAYER.match(name)
    if match is None or not match.group(2).startswith("mlp.") or not config.is_moe_layer(int(match.group(1))):
        return Source((f"model.{name}",), _single)
    layer, rest = match.group(1), match.group(2)
    prefix = _moe_prefix(config, layer)
    if config.architecture in TRANSPOSED_EXPERTS:  # keel's names; keel.weights.gpt_oss reads them in keel's layout
        return Source((f"model.{name}",), _single)
    if rest.startswith("mlp.router."):  # weight; DeepSeek's e_score_correction_bias
        return Source((f"{prefix}.gate.{rest.removeprefix('mlp.router.')}",), _single)
    if rest in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"):
        stacked = f"{prefix}.{rest.removeprefix('mlp.')}"
        if stacked in available:  # transformers-5 in-memory layout saved as is
            return Source((stacked,), _single)
        gate, up, down = _expert_names(config)
        experts = range(config.num_experts)
        if rest.endswith("down_proj"):
            names = tuple(f"{prefix}.experts.{e}.{down}.weight" for e in experts)
            return Source(names, torch.stack)
        if not config.mlp_gated:  # ungated experts (Nemotron-H): their up rows alone
            return Source(tuple(f"{prefix}.experts.{e}.{up}.weight" for e in experts), torch.stack)
        names = tuple(
            n for e in experts for n in (f"{prefix}.experts.{e}.{gate}.weight", f"{prefix}.experts.{e}.{up}.weight")
        )
        return Source(names, lambda ts: torch.stack([torch.cat(ts[i : i + 2]) for i in range(0, len(ts), 2)]))
    if config.architecture in _SHARED_EXPERTS and rest.startswith("mlp.shared_expert."):
        return Source((f"{prefix}.shared_experts.{rest.removeprefix('mlp.shared_expert.')}",), _single)
    # Qwen2-MoE's shared expert and its gate keep their HF names.
    return Source((f"{prefix}.{rest.removeprefix('mlp.')}",), _single)


def keel_to_hf(config: ModelConfig, state: Iterable[tuple[str, Tensor]], fuse: bool = True) -> dict[str, Tensor]:
    """keel parameters -> HF hub-format tensors (per-expert weights; the family's fused tensors unless
    `fuse` is False: keel's own readers take the parts), for `keel convert`."""
    out: dict[str, Tensor] = {}
    gate_name, up_name, down_name = _expert_names(config)
    for name, tensor in state:
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if config.architecture in TRANSPOSED_EXPERTS:  # stacked experts in transformers' own layout
            from keel.weights.gpt_oss import to_hf

            hf_name = f"model.{name}" if name != "lm_head.weight" else name
            out[hf_name] = to_hf(hf_name, tensor, interleaved=TRANSPOSED_EXPERTS[config.architecture])
            continue
        match = _LAYER.match(name)
        if match and match.group(2).startswith("mlp.experts.") and config.is_moe_layer(int(match.group(1))):
            prefix = _moe_prefix(config, match.group(1))
            if config.architecture in STACKED_EXPERTS:  # stored stacked: the family's layout renames them
                out[f"{prefix}.{match.group(2).removeprefix('mlp.')}"] = tensor
                continue
            if match.group(2) == "mlp.experts.gate_up_proj" and not config.mlp_gated:
                for e, weight in enumerate(tensor):
                    out[f"{prefix}.experts.{e}.{up_name}.weight"] = weight.contiguous()
            elif match.group(2) == "mlp.experts.gate_up_proj":
                for e, weight in enumerate(tensor):
                    gate, up = weight.chunk(2, dim=0)
                    out[f"{prefix}.experts.{e}.{gate_name}.weight"] = gate.contiguous()
                    out[f"{prefix}.experts.{e}.{up_name}.weight"] = up.contiguous()
            else:
                for e, weight in enumerate(tensor):
                    out[f"{prefix}.experts.{e}.{down_name}.weight"] = weight.contiguous()
            continue
        source = hf_source(config, name, set())
        out[source.names[0]] = tensor
    return dict(fused_stream(config, out.items())) if fuse else out


def fused_stream(config: ModelConfig, tensors: Iterable[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
    """HF-named tensors as the family stores them (keel.families: renamed, fused, reshaped), made from keel's."""
    for name, tensor in parts_fused_stream(checkpoint_layout(config), tensors):
        yield name, stored_tensor(config, name, tensor)
