"""keel.families: a family's config translation and fused checkpoint tensors (Phi-3), below the model."""

from __future__ import annotations

import json

import pytest
import torch

from keel.config import ModelConfig
from keel.errors import ConfigError
from keel.families import FAMILIES
from keel.weights.safetensors import SafetensorsReader
from keel.weights.shard import Shard, narrow
from tiny_models import save_hf_model


@pytest.fixture(scope="module")
def phi3(tmp_path_factory):
    path = tmp_path_factory.mktemp("phi3")
    save_hf_model("phi3", path)
    return path


def test_fused_tensors_read_as_their_parts(phi3):
    config = ModelConfig.from_json_file(phi3 / "config.json")
    fused = SafetensorsReader(phi3)
    whole = {name: fused.get(name) for name in fused.names()}
    reader = SafetensorsReader(phi3)
    reader.split_rows(FAMILIES["phi3"].fused_rows(config))
    names = reader.names()
    assert not any("qkv_proj" in n or "gate_up_proj" in n for n in names)
    q, kv, inter = config.q_size, config.kv_size, config.intermediate_size
    for layer in range(config.num_layers):
        attn, mlp = f"model.layers.{layer}.self_attn", f"model.layers.{layer}.mlp"
        qkv, gate_up = whole[f"{attn}.qkv_proj.weight"], whole[f"{mlp}.gate_up_proj.weight"]
        parts = {
            f"{attn}.q_proj.weight": qkv[:q],
            f"{attn}.k_proj.weight": qkv[q : q + kv],
            f"{attn}.v_proj.weight": qkv[q + kv :],
            f"{mlp}.gate_proj.weight": gate_up[:inter],
            f"{mlp}.up_proj.weight": gate_up[inter:],
        }
        for name, want in parts.items():
            assert reader.shape(name) == tuple(want.shape) and reader.dtype(name) == "F32"
            assert torch.equal(reader.get(name), want)
            assert torch.equal(reader.get_row(name, 3), want[3])
            assert torch.equal(reader.get_box(name, (2, 5), (3, 7)), want[2:5, 5:12])
            # A tensor-parallel rank's rows or columns, and gate/up's two-part shard.
            for shard in (Shard(0, 4, 12), Shard(1, 16, 48), Shard(0, 2, 6, parts=2)):
                assert torch.equal(reader.get_shard(name, shard), narrow(want, shard)), (name, shard)
    # Tensors that are not fused read as before.
    assert torch.equal(reader.get("model.embed_tokens.weight"), whole["model.embed_tokens.weight"])


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}}, "longrope"),
        ({"rope_scaling": {"type": "su"}}, "'su'"),
        ({"partial_rotary_factor": 0.75}, "partial_rotary_factor 0.75"),
    ],
)
def test_what_phi3_cannot_run_is_refused_by_name(phi3, tmp_path, change, named):
    data = json.loads((phi3 / "config.json").read_text())
    data.pop("rope_parameters", None)
    data.update(change)
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_hf(data, source="phi3/config.json")
    assert named in str(e.value) and "phi3/config.json" in str(e.value) and "\n" not in str(e.value)


def test_the_exported_config_is_phi3s(phi3):
    config = ModelConfig.from_json_file(phi3 / "config.json")
    hf = config.to_hf()
    assert hf["architectures"] == ["Phi3ForCausalLM"] and hf["sliding_window"] == 8
    assert ModelConfig.from_hf(hf) == config
