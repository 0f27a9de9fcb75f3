"""Per-layer kinds that families' config.json files list: which layers rotate (`no_rope_layers`: SmolLM3, Llama 4)
and which MLPs are dense (`mlp_layer_types`: GLM-4.7-Flash, K-EXAONE), read as keel's fields and written back; what
recurrent layers' families cannot run (`refuse_other_conv_activation`)."""

from __future__ import annotations

from typing import Any

from keel.errors import ConfigError


def rotating_layers(hf: dict[str, Any], source: str, interval: int) -> list[bool]:
    """Whether each layer rotates q and k: `no_rope_layers` (1 = rotates), else every `no_rope_layer_interval`-th
    layer (by default `interval`) without position encoding."""
    layers = int(hf["num_hidden_layers"])
    every = int(hf.get("no_rope_layer_interval") or interval)
    rotates = hf.get("no_rope_layers") or [int((i + 1) % every != 0) for i in range(layers)]
    if len(rotates) != layers:
        raise ConfigError(f"{source}: no_rope_layers has {len(rotates)} entries for {layers} layers")
    return [bool(r) for r in rotates]


def dense_layers(hf: dict[str, Any], source: str, first_dense: int) -> list[int]:
    """The layers whose MLP is dense: `mlp_layer_types` ("dense" or "sparse" each), else the first `first_dense`."""
    layers = int(hf["num_hidden_layers"])
    kinds = hf.get("mlp_layer_types") or ["dense" if i < first_dense else "sparse" for i in range(layers)]
    if len(kinds) != layers or not set(kinds) <= {"dense", "sparse"}:
        raise ConfigError(f"{source}: mlp_layer_types must give dense or sparse for each of the {layers} layers")
    return [i for i, kind in enumerate(kinds) if kind == "dense"]


def mlp_layer_types(config: Any) -> list[str]:
    """`mlp_layer_types` as the config's dense layers give them."""
    dense = set(config.mlp_only_layers)
    return ["dense" if i in dense else "sparse" for i in range(config.num_layers)]


def refuse_other_conv_activation(hf: dict[str, Any], source: str) -> None:
    """Gated DeltaNet and Mamba 2 layers apply `hidden_act` to their convolution too; keel's run SiLU there (every
    release's): another activation is refused by name."""
    act = hf.get("hidden_act") or "silu"
    if act not in ("silu", "swish"):
        raise ConfigError(f"{source}: hidden_act {act!r} with recurrent layers is not supported (silu)")
