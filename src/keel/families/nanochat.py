"""NanoChat (`NanoChatForCausalLM`: Karpathy's nanochat): Llama's pre-norm block where every norm is an RMSNorm
without a weight (keel's `norm_affine` False): the block norms, the final norm, and that same norm applied to the
embedding's output before the first layer (`embedding_norm`); q and k rotated the other way (its rotate_half is
cat(x2, -x1): `rope_reversed`), then divided by their root mean square per head with no weight (Llama 4's
`qk_l2_norm`); an ungated MLP, fc2(relu(fc1(x))^2) (`mlp_gated` False, `hidden_act` relu2; fc1 / fc2 read as keel's
up / down projections); the logits soft-capped at `final_logit_softcapping` (Gemma 2's). Biases on q/k/v/o where
`attention_bias`.
"""

from __future__ import annotations

from typing import Any

FAMILY = "nanochat"
HF_ARCHITECTURE = "NanoChatForCausalLM"
# transformers' NanoChatConfig defaults.
DEFAULTS: dict[str, Any] = {
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 2048,
    "bos_token_id": 0,
    "eos_token_id": [1],
    "hidden_act": "relu2",
}
FINAL_LOGIT_SOFTCAPPING = 15.0


def config_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    bias = bool(hf.get("attention_bias", False))
    cap = hf.get("final_logit_softcapping", FINAL_LOGIT_SOFTCAPPING)  # null: no cap
    return {
        "norm_affine": False,
        "embedding_norm": True,
        "rope_reversed": True,
        "qk_l2_norm": True,
        "mlp_gated": False,
        "final_logit_softcapping": None if cap is None else float(cap),
        "qkv_bias": bias,
        "o_bias": bias,
        "mlp_bias": False,
    }


def hf_fields(config: Any, hf: dict[str, Any]) -> dict[str, Any]:
    return {"attention_bias": config.qkv_bias, "final_logit_softcapping": config.final_logit_softcapping}


def checkpoint_layout(config: Any) -> dict[str, dict[str, list[tuple[int, int]] | None]]:
    """The MLP's fc1 / fc2 under keel's names (up / down: the ungated MLP has no gate)."""
    layout: dict[str, dict[str, list[tuple[int, int]] | None]] = {}
    for layer in range(config.num_layers):
        mlp = f"model.layers.{layer}.mlp"
        layout[f"{mlp}.fc1.weight"] = {f"{mlp}.up_proj.weight": None}
        layout[f"{mlp}.fc2.weight"] = {f"{mlp}.down_proj.weight": None}
    return layout
