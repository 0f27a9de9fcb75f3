"""Granite 4.0-H (`GraniteMoeHybridForCausalLM`: granite-4.0-h-micro, -h-tiny, -h-small): Mamba 2 mixers (`layer_types`
"mamba", transformers' "linear_attention": keel.model.mamba) and attention layers in Granite's block (its four
scalars), with position encoding only where `position_embedding_type` is "rope" (the releases use none). After
each mixer: a mixture of experts (Granite MoE's, keel.families.granitemoe) plus an ungated shared SwiGLU MLP
(`shared_mlp`, as keel.families.granitemoeshared reads it) where `num_local_experts` > 0; else that shared MLP alone,
read as keel's dense MLP. A mamba layer's `mamba.*` are keel's `self_attn.*`.
"""

from __future__ import annotations

from typing import Any

from keel.errors import ConfigError
from keel.families import granitemoe, granitemoeshared
from keel.families.layer_kinds import refuse_other_conv_activation

FAMILY = "granitemoehybrid"
HF_ARCHITECTURE = "GraniteMoeHybridForCausalLM"
# transformers' GraniteMoeHybridConfig defaults.
DEFAULTS: dict[str, Any] = {
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 2048,
    "bos_token_id": 1,
    "eos_token_id": [2],
}
MAMBA_DEFAULTS = {"mamba_n_heads": 128, "mamba_n_groups": 1, "mamba_d_state": 256, "mamba_d_conv": 4, "mamba_expand": 2}
KINDS = {
    "mamba": "mamba",
    "linear_attention": "mamba",
    "attention": "full_attention",
    "full_attention": "full_attention",
}
MAMBA_TENSORS = ("in_proj", "conv1d", "out_proj")


def _layer_types(hf: dict[str, Any], source: str) -> list[str]:
    layers = int(hf["num_hidden_layers"])
    kinds = hf.get("layer_types") or hf.get("layers_block_type") or ["mamba"] * layers
    if len(kinds) != layers or not set(kinds) <= set(KINDS):
        raise ConfigError(f"{source}: layer_types must list mamba or attention layers, one for each of {layers}")
    return [KINDS[kind] for kind in kinds]


def _json_float(value: Any) -> float:
    """A float as transformers writes it in config.json: infinities as {"__float__": "Infinity"}."""
    return float(value["__float__"]) if isinstance(value, dict) else float(value)


def float_json(value: float) -> Any:
    return {"__float__": "Infinity" if value > 0 else "-Infinity"} if value in (float("inf"), float("-inf")) else value


def mamba_fields(hf: dict[str, Any], source: str, inner: int | None = None) -> dict[str, Any]:
    """The Mamba 2 mixers' fields; `inner` (Falcon-H1's mamba_d_ssm) in place of mamba_expand x hidden_size."""
    get = {key: int(hf.get(key) or default) for key, default in MAMBA_DEFAULTS.items()}
    widths = "mamba_expand x hidden_size" if inner is None else "mamba_d_ssm"
    inner = get["mamba_expand"] * int(hf["hidden_size"]) if inner is None else inner
    head = hf.get("mamba_d_head", "auto")
    head = inner // get["mamba_n_heads"] if head in (None, "auto") else int(head)
    if head * get["mamba_n_heads"] != inner:
        raise ConfigError(
            f"{source}: mamba_n_heads x mamba_d_head ({get['mamba_n_heads']} x {head}) must be {widths} ({inner})"
        )
    return {
        "mamba_n_heads": get["mamba_n_heads"],
        "mamba_d_head": head,
        "mamba_n_groups": get["mamba_n_groups"],
        "mamba_d_state": get["mamba_d_state"],
        "mamba_d_conv": get["mamba_d_conv"],
        "mamba_conv_bias": bool(hf.get("mamba_conv_bias", True)),
        "mamba_proj_bias": bool(hf.get("mamba_proj_bias", False)),
        "mamba_out_bias": bool(hf.get("mamba_proj_bias", False)),
        "mamba_dt_limit": mamba_time_step_limit(hf),
    }


def mamba_time_step_limit(hf: dict[str, Any]) -> tuple[float, float]:
    """`time_step_limit`: the (min, max) a step is clamped to after softplus."""
    low, high = (_json_float(x) for x in hf.get("time_step_limit") or (0.0, float("inf")))
    return low, high


def config_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    refuse_other_conv_activation(hf, source)
    kinds = _layer_types(hf, source)
    shared = int(hf.get("shared_intermediate_size") or 1024)
    experts = int(hf.get("num_local_experts", 8) or 0)
    mlp = (
        {**granitemoeshared.config_fields(hf, source), "shared_expert_intermediate_size": shared}
        if experts
        else {**granitemoe.granite_block(hf), "intermediate_size": shared, "num_experts": 0}
    )
    return {
        **mlp,
        **mamba_fields(hf, source),
        "layer_types": kinds,
        "rope_layers": [hf.get("position_embedding_type") == "rope"] * len(kinds),
        "mlp_bias": False,
    }


def mamba_hf_fields(config: Any) -> dict[str, Any]:
    """The Mamba 2 keys of Granite 4.0-H's and Bamba's configs."""
    return {
        "mamba_n_heads": config.mamba_n_heads,
        "mamba_d_head": config.mamba_d_head,
        "mamba_n_groups": config.mamba_n_groups,
        "mamba_d_state": config.mamba_d_state,
        "mamba_d_conv": config.mamba_d_conv,
        "mamba_expand": config.mamba_n_heads * config.mamba_d_head // config.hidden_size,
        "mamba_conv_bias": config.mamba_conv_bias,
        "mamba_proj_bias": config.mamba_proj_bias,
        "time_step_limit": [float_json(x) for x in config.mamba_dt_limit],
    }


def mamba2_tensors(config: Any) -> list[str]:
    """A Mamba 2 mixer's tensor names (Mamba 2's own models' too: keel.families.mamba2)."""
    names = ["dt_bias", "A_log", "D", "norm.weight", *(f"{m}.weight" for m in MAMBA_TENSORS)]
    if config.mamba_conv_bias:
        names.append("conv1d.bias")
    if config.mamba_proj_bias:
        names.append("in_proj.bias")
    if config.mamba_out_bias:
        names.append("out_proj.bias")
    return names


def mamba_layout(config: Any, layer: int) -> dict[str, dict[str, list[tuple[int, int]] | None]]:
    """A mamba layer's `mamba.*` tensors under keel's `self_attn.*`."""
    p = f"model.layers.{layer}"
    return {f"{p}.mamba.{name}": {f"{p}.self_attn.{name}": None} for name in mamba2_tensors(config)}


def hf_fields(config: Any, hf: dict[str, Any]) -> dict[str, Any]:
    moe = (
        granitemoeshared.hf_fields(config, hf)
        if config.is_moe
        else {**granitemoe.granite_block_to_hf(config), "num_local_experts": 0}
    )
    shared = config.shared_expert_intermediate_size if config.is_moe else config.intermediate_size
    return {
        **moe,
        "shared_intermediate_size": shared,
        "layer_types": ["mamba" if kind == "mamba" else "attention" for kind in config.layer_types],
        "position_embedding_type": "rope" if all(config.rope_layers) else None,
        **mamba_hf_fields(config),
    }


def checkpoint_layout(config: Any) -> dict[str, dict[str, list[tuple[int, int]] | None]]:
    """The mamba mixers under keel's self_attn.; the experts and shared MLP as Granite MoE shared's, or the shared
    MLP as keel's dense one."""
    layout = granitemoeshared.checkpoint_layout(config) if config.is_moe else {}
    width = config.intermediate_size
    for layer in range(config.num_layers):
        p = f"model.layers.{layer}"
        if not config.is_moe:
            layout[f"{p}.shared_mlp.input_linear.weight"] = {
                f"{p}.mlp.gate_proj.weight": [(0, width)],
                f"{p}.mlp.up_proj.weight": [(width, 2 * width)],
            }
            layout[f"{p}.shared_mlp.output_linear.weight"] = {f"{p}.mlp.down_proj.weight": None}
        if config.layer_types[layer] == "mamba":
            layout.update(mamba_layout(config, layer))
    return layout
