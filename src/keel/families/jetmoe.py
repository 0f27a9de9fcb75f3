"""JetMoE (`JetMoeForCausalLM`: jetmoe/jetmoe-8b): Llama's pre-norm block whose attention is a mixture of attention
heads (keel's `mixture_of_attention`, keel.model.moa) and whose MLP is a mixture of experts, both routed by routers of
their own with the same experts and top-k (`num_local_experts`, `num_experts_per_tok`): the top k of the router's
logits, then their softmax (keel's `router_scoring` topk_softmax). Each attention expert projects the queries of
`num_key_value_heads` heads of `kv_channels` channels and projects their output back; keys and values (`kv_proj`,
keys first) are shared, so num_attention_heads is num_key_value_heads x num_experts_per_tok. The attention's and the
MLP's summed expert outputs each get one bias (keel's `o_bias` and `moe_output_bias`). The experts' activation is
`activation_function`, gated (the first half of `input_linear`'s rows).

Checkpoint names (under model.layers.N): `self_attention.kv_proj` (split into keel's k_proj / v_proj),
`self_attention.experts.input_linear` [E, kv, H] / `output_linear` [E, H, kv] / `router.layer` / `bias`,
`mlp.input_linear` [E, 2I, H] / `output_linear` [E, H, I] / `router.layer` / `bias`; read as keel's and written back.

transformers' JetMoE norms every layer at 1e-6 whatever the file says and the final norm alone at `rms_norm_eps`:
keel reads the file's eps as `final_norm_eps`, the layers' as 1e-6.
"""

from __future__ import annotations

from typing import Any

from keel.errors import ConfigError

FAMILY = "jetmoe"
HF_ARCHITECTURE = "JetMoeForCausalLM"
# JetMoeConfig's attribute_map
ATTRIBUTE_MAP = {"kv_channels": "head_dim"}
# transformers' JetMoeConfig defaults.
DEFAULTS: dict[str, Any] = {
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 4096,
    "bos_token_id": 1,
    "eos_token_id": [2],
    "vocab_size": 32000,
    "num_key_value_heads": 16,
}
_EXPERTS, _TOP_K, _WIDTH, _KV_HEADS, _KV_CHANNELS = 8, 2, 5632, 16, 128
_LAYER_NORM_EPS = 1e-6  # JetMoeRMSNorm's default, which its decoder layers keep


def upgrade_config(hf: dict[str, Any]) -> dict[str, Any]:
    """The keys JetMoeConfig derives, under the names keel reads: the head width, the query heads
    (num_key_value_heads x top-k, as its __post_init__ sets them whatever a file says), the experts' activation,
    the tied head by default."""
    kv_heads = int(hf.get("num_key_value_heads", _KV_HEADS))
    return {
        **hf,
        "num_key_value_heads": kv_heads,
        "head_dim": int(hf.get("head_dim", _KV_CHANNELS)),  # kv_channels (ATTRIBUTE_MAP), its default 128
        "num_attention_heads": kv_heads * int(hf.get("num_experts_per_tok", _TOP_K)),
        "hidden_act": hf.get("activation_function", "silu"),
        "tie_word_embeddings": hf.get("tie_word_embeddings", True),
    }


def config_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    eps = float(hf.get("rms_norm_eps", DEFAULTS["rms_norm_eps"]))
    width = int(hf.get("intermediate_size", _WIDTH))
    return {
        "num_experts": int(hf.get("num_local_experts", _EXPERTS)),
        "num_experts_per_tok": int(hf.get("num_experts_per_tok", _TOP_K)),
        "moe_intermediate_size": width,
        "intermediate_size": width,
        "router_scoring": "topk_softmax",
        "norm_topk_prob": True,
        "mixture_of_attention": True,
        "o_bias": True,
        "qkv_bias": False,
        "moe_output_bias": True,
        "rms_norm_eps": _LAYER_NORM_EPS,
        "final_norm_eps": None if eps == _LAYER_NORM_EPS else eps,
    }


def hf_fields(config: Any, hf: dict[str, Any]) -> dict[str, Any]:
    held = (
        config.mixture_of_attention
        and config.o_bias
        and config.moe_output_bias
        and config.router_scoring == "topk_softmax"
        and config.rms_norm_eps == _LAYER_NORM_EPS
        and config.num_experts > 0
        and all(config.is_moe_layer(i) for i in range(config.num_layers))
    )
    if not held:
        raise ConfigError(
            f"{config.architecture}: JetMoE's config holds attention experts and experts in every layer, both with "
            "an output bias, the top-k softmax router and its layers' norms at eps 1e-6"
        )
    return {
        "kv_channels": config.head_dim,
        "num_local_experts": config.num_experts,
        "num_experts_per_tok": config.num_experts_per_tok,
        "intermediate_size": config.moe_intermediate_size,
        "activation_function": hf["hidden_act"],
        # the final norm's (the layers' are 1e-6 whatever the file says)
        "rms_norm_eps": _LAYER_NORM_EPS if config.final_norm_eps is None else config.final_norm_eps,
    }


def checkpoint_layout(config: Any) -> dict[str, dict[str, list[tuple[int, int]] | None]]:
    """Stored tensor -> {the HF-style name keel reads: its rows of it}, every layer (keel.weights.parts)."""
    kv = config.kv_size
    layout: dict[str, dict[str, list[tuple[int, int]] | None]] = {}
    for layer in range(config.num_layers):
        stored, attn, mlp = f"model.layers.{layer}", f"model.layers.{layer}.self_attn", f"model.layers.{layer}.mlp"
        layout[f"{stored}.self_attention.kv_proj.weight"] = {
            f"{attn}.k_proj.weight": [(0, kv)],
            f"{attn}.v_proj.weight": [(kv, 2 * kv)],
        }
        experts = f"{stored}.self_attention.experts"
        layout[f"{experts}.input_linear.weight"] = {f"{attn}.q_experts": None}
        layout[f"{experts}.output_linear.weight"] = {f"{attn}.o_experts": None}
        layout[f"{experts}.router.layer.weight"] = {f"{attn}.router.weight": None}
        layout[f"{experts}.bias"] = {f"{attn}.output_bias": None}
        layout[f"{stored}.mlp.input_linear.weight"] = {f"{mlp}.experts.gate_up_proj": None}
        layout[f"{stored}.mlp.output_linear.weight"] = {f"{mlp}.experts.down_proj": None}
        layout[f"{stored}.mlp.router.layer.weight"] = {f"{mlp}.gate.weight": None}
        layout[f"{stored}.mlp.bias"] = {f"{mlp}.output_bias": None}
    return layout
