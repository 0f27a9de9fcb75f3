"""Zamba 2 (`Zamba2ForCausalLM`: Zyphra's Zamba2-1.2B, -2.7B, -7B): Mamba 2 mixers (keel.model.mamba, as Bamba's) in
every layer, and in the "hybrid" layers (`layers_block_type`) before the mixer a transformer block shared between
hybrid layers: `num_mem_blocks` of them, the i-th hybrid layer running block i % num_mem_blocks. The block reads the
stream and the token embedding side by side (2 x hidden_size wide: its input norm, then attention whose heads are
2 x hidden_size / heads wide, softmax scale (head_dim / 2)^-1/2, rotary only with `use_mem_rope`), then its
pre_ff_layernorm and a GELU-gated MLP (`gate_up_proj` as stored), without residuals; its output, projected back
(`linear`, keel's `shared_linear`), is added to the mixer's input (not to the residual): x + mixer(norm(x + block)).
Each hybrid layer has its own low-rank adapters (`adapter_rank`) added to the shared gate/up projection's output,
and to q, k and v with `use_shared_attention_adapter`.

keel holds a copy of the shared block in each hybrid layer that runs it (keel's layers are modules of their own):
a shared block's stored tensors are read into every layer of its turn (keel.families.parts.Copy). Loaded in the
checkpoint's dtype the copies share the file's mapped bytes; cast to another, each takes memory of its own, so the
shared blocks' weights take (hybrid layers / num_mem_blocks) times what they are stored in (Zamba2-2.7B: 9 hybrid
layers over 2 blocks). The parameter count is the stored one (each block once), as transformers counts it. Export
writes each block once and refuses copies that differ. Training is refused (the copies would train apart;
keel.train.config), as are tensor and pipeline parallelism, speculative decoding and int8 KV caches (the recurrent
families' refusals).

As transformers builds them: the mixers' convolutions always have a bias (`use_conv_bias` is unread), the gated norm's
eps is 1e-5 whatever `rms_norm_eps` says (another value is refused), the step is clamped below at `time_step_min`,
`add_bias_linear` gives in_proj, out_proj and the MLP's projections biases. transformers (5.24) ties the shared
blocks only along with the embedding: with `tie_word_embeddings` false each hybrid layer loads a block of its own
(keel reads that as num_mem_blocks = the hybrid layers, and writes it so), and a file with fewer num_mem_blocks than
hybrid layers is refused (each block would store adapters of other layers' turns, which it never runs).
`use_long_context` sets the context to 16384 (transformers changes no rotary frequency).
"""

from __future__ import annotations

from typing import Any

from keel.errors import ConfigError
from keel.families.granitemoehybrid import mamba2_tensors, mamba_layout
from keel.families.parts import Copy

FAMILY = "zamba2"
HF_ARCHITECTURE = "Zamba2ForCausalLM"
# transformers' Zamba2Config defaults.
DEFAULTS: dict[str, Any] = {
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 4096,
    "bos_token_id": 1,
    "eos_token_id": [2],
    "hidden_act": "gelu",
}
ATTRIBUTE_MAP = {"layer_types": "layers_block_type"}
# Zamba2Config's own computations (__post_init__), not to be set
COMPUTED_KEYS = (
    "head_dim",
    "attention_head_dim",
    "attention_hidden_size",
    "mamba_headdim",
    "kv_channels",
    "num_query_groups",
    "hybrid_layer_ids",
)
KINDS = {"mamba": "mamba", "linear_attention": "mamba", "hybrid": "hybrid"}
# transformers' default layers: 54, a hybrid one every sixth or so
DEFAULT_LAYERS = (
    ["mamba"]
    + (["mamba"] * 5 + ["hybrid"]) * 7
    + ["mamba"] * 4
    + ["hybrid"]
    + ["mamba"] * 3
    + ["hybrid"]
    + ["mamba"] * 2
)
# A shared block's stored tensors (under `shared_transformer.`) and keel's names in each hybrid layer.
SHARED = {
    "input_layernorm.weight": "input_layernorm.weight",
    "pre_ff_layernorm.weight": "post_attention_layernorm.weight",
    **{f"self_attn.{p}_proj.weight": f"self_attn.{p}_proj.weight" for p in "qkvo"},
    "feed_forward.gate_up_proj.weight": "mlp.gate_up_proj.weight",
    "feed_forward.down_proj.weight": "mlp.down_proj.weight",
}
SHARED_BIASES = {
    "feed_forward.gate_up_proj.bias": "mlp.gate_up_proj.bias",
    "feed_forward.down_proj.bias": "mlp.down_proj.bias",
}


def _layer_types(hf: dict[str, Any], source: str) -> list[str]:
    layers = int(hf["num_hidden_layers"])
    kinds = hf.get("layers_block_type") or DEFAULT_LAYERS
    if len(kinds) != layers or not set(kinds) <= set(KINDS):
        raise ConfigError(f"{source}: layers_block_type must list mamba or hybrid layers, one for each of {layers}")
    return [KINDS[kind] for kind in kinds]


def config_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    hidden, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    kinds = _layer_types(hf, source)
    if float(hf.get("rms_norm_eps", DEFAULTS["rms_norm_eps"])) != 1e-5:
        raise ConfigError(f"{source}: rms_norm_eps other than 1e-5 (the mixers' gated norm's, fixed) is not supported")
    mamba_heads, expand = int(hf.get("n_mamba_heads", 8)), int(hf.get("mamba_expand", 2))
    if (expand * hidden) % mamba_heads:
        raise ConfigError(f"{source}: n_mamba_heads ({mamba_heads}) must divide mamba_expand x hidden_size")
    if (2 * hidden) % heads:
        raise ConfigError(f"{source}: num_attention_heads ({heads}) must divide 2 x hidden_size")
    head_dim = 2 * hidden // heads
    kv_heads = int(hf.get("num_key_value_heads") or heads)
    adapters = bool(hf.get("use_shared_attention_adapter", False))
    if adapters and kv_heads != heads:  # transformers adds 2 x hidden_size wide adapters to narrower keys and values
        raise ConfigError(f"{source}: use_shared_attention_adapter with num_key_value_heads != num_attention_heads")
    bias = bool(hf.get("add_bias_linear", False))
    tied = bool(hf.get("tie_word_embeddings", True))
    # transformers ties the shared blocks along with the embedding alone: untied, each hybrid layer loads a block of
    # its own (and its adapters from that block's lists), which is num_mem_blocks = the hybrid layers where each
    # block's lists hold its own layer's adapters alone
    blocks, hybrid = int(hf.get("num_mem_blocks", 1)), kinds.count("hybrid")
    if not tied and blocks < hybrid:
        raise ConfigError(
            f"{source}: tie_word_embeddings false with num_mem_blocks ({blocks}) below the hybrid layers ({hybrid}) is "
            "not supported (transformers then unties the shared blocks too, each storing adapters it never runs)"
        )
    blocks = blocks if tied else max(1, hybrid)
    fields: dict[str, Any] = {
        "layer_types": kinds,
        "mlp_layers": [kind == "hybrid" for kind in kinds],
        "rope_layers": [bool(hf.get("use_mem_rope", False))] * len(kinds),
        "head_dim": head_dim,
        "num_kv_heads": kv_heads,
        "attention_scale": (head_dim / 2) ** -0.5,
        "intermediate_size": int(hf.get("intermediate_size") or 4 * hidden),
        "tie_word_embeddings": tied,
        "mlp_bias": bias,
        "hybrid_block": "shared",
        "shared_blocks": blocks,
        "adapter_rank": int(hf.get("adapter_rank", 128)),
        "attention_adapters": adapters,
        "mamba_n_heads": mamba_heads,
        "mamba_d_head": expand * hidden // mamba_heads,
        "mamba_n_groups": int(hf.get("mamba_ngroups", 1)),
        "mamba_d_state": int(hf.get("mamba_d_state", 64)),
        "mamba_d_conv": int(hf.get("mamba_d_conv", 4)),
        "mamba_conv_bias": True,
        "mamba_proj_bias": bias,
        "mamba_out_bias": bias,
        "mamba_dt_limit": (float(hf.get("time_step_min", 0.001)), float("inf")),
    }
    if hf.get("use_long_context"):
        fields["max_position_embeddings"] = 16384
    return fields


def hf_fields(config: Any, hf: dict[str, Any]) -> dict[str, Any]:
    return {
        "layers_block_type": ["hybrid" if kind == "hybrid" else "linear_attention" for kind in config.layer_types],
        "use_mem_rope": any(config.layer_rotates(i) for i in range(config.num_layers)),
        "add_bias_linear": config.mlp_bias,
        "num_mem_blocks": config.shared_blocks,
        "adapter_rank": config.adapter_rank,
        "use_shared_attention_adapter": config.attention_adapters,
        "n_mamba_heads": config.mamba_n_heads,
        "mamba_expand": config.mamba_n_heads * config.mamba_d_head // config.hidden_size,
        "mamba_ngroups": config.mamba_n_groups,
        "mamba_d_state": config.mamba_d_state,
        "mamba_d_conv": config.mamba_d_conv,
        "time_step_min": config.mamba_dt_limit[0],
        "use_long_context": False,
    }


def checkpoint_layout(config: Any) -> dict[str, dict[str, Any]]:
    """The mixers of the mamba layers under keel's self_attn., of the hybrid layers under keel's mamba.; each shared
    block's tensors (stored under the first hybrid layer running it) copied into every hybrid layer of its turn; the
    adapters (stored in the block's lists by hybrid layer) into their layers."""
    layout: dict[str, dict[str, Any]] = {"model.final_layernorm.weight": {"model.norm.weight": None}}
    hybrid = [i for i in range(config.num_layers) if config.layer_types[i] == "hybrid"]
    for layer in range(config.num_layers):
        if config.layer_types[layer] == "mamba":
            layout.update(mamba_layout(config, layer))
    blocks = config.shared_block_layers()
    for index, layer in enumerate(hybrid):
        p, block = f"model.layers.{layer}", f"model.layers.{blocks[index % config.shared_blocks][0]}.shared_transformer"
        layout[f"{p}.linear.weight"] = {f"{p}.shared_linear.weight": None}
        layout[f"{p}.mamba_decoder.input_layernorm.weight"] = {f"{p}.mamba_layernorm.weight": None}
        for name in mamba2_tensors(config):
            layout[f"{p}.mamba_decoder.mamba.{name}"] = {f"{p}.mamba.{name}": None}
        for j in (0, 1):
            stored = f"{block}.feed_forward.gate_up_proj_adapter_list.{index}.{j}.weight"
            layout[stored] = {f"{p}.mlp.gate_up_adapter.{j}.weight": None}
            for x in "qkv" if config.attention_adapters else "":
                stored = f"{block}.self_attn.linear_{x}_adapter_list.{index}.{j}.weight"
                layout[stored] = {f"{p}.self_attn.{x}_adapter.{j}.weight": None}
    shared = {**SHARED, **(SHARED_BIASES if config.mlp_bias else {})}
    for layers in blocks:
        if not layers:  # a block no hybrid layer runs (fewer hybrid layers than blocks): not stored
            continue
        block = f"model.layers.{layers[0]}.shared_transformer"
        for stored, name in shared.items():
            layout[f"{block}.{stored}"] = {f"model.layers.{layer}.{name}": Copy() for layer in layers}
    return layout
