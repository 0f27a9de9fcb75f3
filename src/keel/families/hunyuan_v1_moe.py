"""Hunyuan MoE (`HunYuanMoEV1ForCausalLM`: Hunyuan-A13B): Hunyuan dense's attention (keel.families.hunyuan_v1_dense:
biases where `attention_bias`, per-head q/k RMSNorms after the rotary embedding, NTK scaling by a fixed alpha) and a
mixture of experts in every layer: a float32 softmax router (keel's `router_float32`; the checkpoints' `gate.wg`)
over `num_experts`, the top `moe_topk` renormalised, experts `intermediate_size` wide, and one ungated shared MLP of
that width added as it is (`shared_mlp`, keel's `shared_expert`).

The original configs give `num_experts`, `moe_topk`, `moe_intermediate_size` and `num_shared_expert` per layer as
lists: read where every layer has the same value (as Hunyuan-A13B's do), refused by name otherwise. transformers'
model has one shared MLP and experts `intermediate_size` wide whatever those keys say, so a config whose expert
width or shared count differs, or that asks for cross-layer attention (`use_cla`) or no experts
(`use_mixed_mlp_moe` false), is refused by name rather than run as something else.
"""

from __future__ import annotations

from typing import Any

from keel.errors import ConfigError
from keel.families import hunyuan_v1_dense

FAMILY = "hunyuan_v1_moe"
HF_ARCHITECTURE = "HunYuanMoEV1ForCausalLM"
# transformers' HunYuanMoEV1Config defaults.
DEFAULTS: dict[str, Any] = {**hunyuan_v1_dense.DEFAULTS, "num_experts": 1, "moe_topk": 1}


def _uniform(hf: dict[str, Any], key: str, default: Any, source: str) -> int:
    """A per-model value that the original configs may list per layer: the one value of all layers."""
    value = hf.get(key)
    if value is None:
        return int(default)
    if not isinstance(value, list):
        return int(value)
    if len(set(value)) != 1:
        raise ConfigError(f"{source}: {key} varies by layer ({value}); keel runs one value for every layer")
    return int(value[0])


def _key(hf: dict[str, Any], key: str, alias: str) -> str:
    """`key`, or the name transformers' attribute_map also reads it under where only that one is in the file."""
    return alias if key not in hf and alias in hf else key


def config_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    width = int(hf.get("intermediate_size", 11008))
    if _uniform(hf, "moe_intermediate_size", width, source) != width:
        raise ConfigError(
            f"{source}: moe_intermediate_size {hf['moe_intermediate_size']} differs from "
            f"intermediate_size {width} (transformers' experts are intermediate_size wide)"
        )
    if _uniform(hf, "num_shared_expert", 1, source) != 1:
        raise ConfigError(f"{source}: num_shared_expert {hf['num_shared_expert']} is not supported (one shared MLP)")
    if hf.get("use_cla"):
        raise ConfigError(f"{source}: use_cla {hf['use_cla']!r} (cross-layer attention) is not supported")
    if hf.get("use_mixed_mlp_moe") is False:
        raise ConfigError(f"{source}: use_mixed_mlp_moe false is not supported (experts and a shared MLP)")
    layers = int(hf["num_hidden_layers"])
    return {
        **hunyuan_v1_dense.config_fields(hf, source),
        # transformers' model has no sliding window, whatever the file says
        "sliding_window": None,
        "layer_types": ["full_attention"] * layers,
        "num_experts": _uniform(hf, _key(hf, "num_experts", "num_local_experts"), DEFAULTS["num_experts"], source),
        "num_experts_per_tok": _uniform(hf, _key(hf, "moe_topk", "num_experts_per_tok"), DEFAULTS["moe_topk"], source),
        "moe_intermediate_size": width,
        "intermediate_size": width,
        "norm_topk_prob": True,
        "router_float32": True,
        "shared_expert_intermediate_size": width,
        "shared_expert_gated": False,
    }


def hf_fields(config: Any, hf: dict[str, Any]) -> dict[str, Any]:
    width = config.moe_intermediate_size
    if config.shared_expert_intermediate_size != width or config.mlp_only_layers:
        raise ConfigError(f"{HF_ARCHITECTURE}: every layer has experts and one shared MLP, all {width} wide")
    return {
        **hunyuan_v1_dense.hf_fields(config, hf),
        "num_experts": config.num_experts,
        "moe_topk": config.num_experts_per_tok,
        "intermediate_size": width,
    }


def checkpoint_layout(config: Any) -> dict[str, dict[str, list[tuple[int, int]] | None]]:
    """Hunyuan dense's q/k norm names, and the router (`gate.wg`) and shared MLP (`shared_mlp`) under keel's
    (keel.weights.names: `gate`, `shared_expert`)."""
    layout = hunyuan_v1_dense.checkpoint_layout(config)
    for layer in range(config.num_layers):
        mlp = f"model.layers.{layer}.mlp"
        layout[f"{mlp}.gate.wg.weight"] = {f"{mlp}.gate.weight": None}
        for proj in ("gate_proj", "up_proj", "down_proj"):
            layout[f"{mlp}.shared_mlp.{proj}.weight"] = {f"{mlp}.shared_expert.{proj}.weight": None}
    return layout
