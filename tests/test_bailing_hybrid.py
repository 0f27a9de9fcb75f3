"""Bailing Hybrid (Ling 3): the release's config.json form, the unbounded KDA gate (kda_safe_gate false), the
multi-token-prediction layers its checkpoints carry, and the options refused by name."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from keel.config import ModelConfig
from keel.errors import ConfigError
from keel.model.kda import KimiDeltaAttention
from keel.quant.loading import load_model
from tiny_models import save_hf_model


def _max_rel(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).abs().max() / ref.abs().max()).item()


def test_the_unbounded_gate_and_the_mtp_layers_read_as_transformers_reads_them(tmp_path):
    """kda_safe_gate false: the decay -exp(A_log) softplus(f + dt_bias), logits as transformers'; a multi-token-
    prediction layer stored after the last (as the releases store one) is not read."""
    hf = save_hf_model("bailing_hybrid", tmp_path, kda_safe_gate=False)
    weights = load_file(tmp_path / "model.safetensors")
    mtp = {k.replace("layers.3.", "layers.4."): v.clone() for k, v in weights.items() if "layers.3." in k}
    save_file({**weights, **mtp}, tmp_path / "model.safetensors", metadata={"format": "pt"})
    model = load_model(tmp_path, "float32").model
    assert model.config.kda_gate_lower_bound is None and model.config.num_layers == 4
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref, ours = hf(tokens).logits, model(tokens)
    assert _max_rel(ours, ref) <= 1e-4
    # the bound changes the model: the same weights with the bounded gate are another
    bounded = load_model(tmp_path, "float32").model
    kda = [m for m in bounded.modules() if isinstance(m, KimiDeltaAttention)]
    assert len(kda) == 2 and all(m.full_rank for m in kda)
    for module in kda:
        module.lower_bound = -5.0
    with torch.no_grad():
        assert _max_rel(bounded(tokens), ref) > 1e-3


def test_the_release_config_reads_its_kda_geometry_and_layer_groups(tmp_path):
    """The releases' config.json: the KDA heads the attention's (`head_dim` their width, no linear_* keys), the kinds
    by layer_group_size, the dense layers by first_k_dense_replace."""
    save_hf_model("bailing_hybrid", tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    for key in ("layer_types", "mlp_layer_types", "linear_head_dim", "linear_num_heads", "linear_conv_kernel_dim"):
        del data[key]
    data.update(head_dim=8, layer_group_size=4, first_k_dense_replace=2, short_conv_kernel_size=2)
    config = ModelConfig.from_hf(data)
    assert config.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert (config.linear_num_value_heads, config.linear_value_head_dim, config.linear_conv_kernel_dim) == (4, 8, 2)
    assert config.head_dim == 24 and config.rope_interleave  # the latent attention's: nope + rope
    assert config.mlp_only_layers == [0, 1] and config.kda_full_rank_gates and config.kda_gate_lower_bound == -3.0
    with pytest.raises(ConfigError, match="hidden_act 'gelu'"):
        ModelConfig.from_hf({**data, "hidden_act": "gelu"})


def test_options_that_do_not_compose_are_refused_by_name(tmp_path):
    save_hf_model("bailing_hybrid", tmp_path)
    config = ModelConfig.from_hf(json.loads((tmp_path / "config.json").read_text()))
    with pytest.raises(ConfigError, match="kda_gate_lower_bound must be negative"):
        dataclasses.replace(config, **{"kda_gate_lower_bound": 0.5}).validate()
    with pytest.raises(ConfigError, match="need linear_variant 'kda'"):
        dataclasses.replace(config, **{"linear_variant": "gated_deltanet"}).validate()
    with pytest.raises(ConfigError, match="attention_output_gate with multi-head latent attention"):
        dataclasses.replace(config, **{"attention_gate_per_head": False}).validate()
    with pytest.raises(ConfigError, match="full-rank gates"):
        dataclasses.replace(config, **{"kda_full_rank_gates": False}).to_hf()
