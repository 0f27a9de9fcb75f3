"""A.X-K2 (keel.families.axk2): what tests/test_architectures.py (logits, greedy, align, counts) and
tests/test_convert.py do not reach with the tiny config: routing without expert groups (A.X-K2-Light) and the grouped
router's 0-filled mask, the config read and written as AXK2Config defines it, the releases' names, training, and the
new options refused where they do not compose."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import transformers

from keel.config import ModelConfig
from keel.errors import ConfigError
from keel.quant.loading import load_model
from tiny_models import save_hf_model


def _max_rel(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).abs().max() / ref.abs().max()).item()


def _tokens() -> torch.Tensor:
    return torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(3))  # longer than index_topk 4


def test_config_is_read_and_written_as_its_config_class_defines_it(tmp_path):
    save_hf_model("axk2", tmp_path)
    config = ModelConfig.from_json_file(tmp_path / "config.json")
    assert config.mla_query_gate and config.gated_norm_rank == 8 and config.router_group_mask_zero
    assert config.q_lora_rank == 32 and config.index_topk == 4 and config.mlp_only_layers == [0, 1, 3]
    assert (config.n_group, config.topk_group) == (2, 1)
    hf = config.to_hf()
    assert (hf["gated_norm_rank"], hf["n_group"], hf["topk_group"]) == (8, 2, 1)
    assert hf["mlp_layer_types"] == ["dense", "dense", "sparse", "dense"]
    ungrouped = ModelConfig.from_hf({**hf, "n_group": None, "topk_group": None})
    assert (ungrouped.n_group, ungrouped.topk_group) == (1, 1)
    assert (ungrouped.to_hf()["n_group"], ungrouped.to_hf()["topk_group"]) == (None, None)
    transformers.AXK2Config(**{k: v for k, v in ungrouped.to_hf().items() if k != "architectures"})
    with pytest.raises(ConfigError, match="n_group and topk_group"):
        ModelConfig.from_hf({**hf, "topk_group": None})
    with pytest.raises(ConfigError, match="gated_norm_rank"):
        ModelConfig.from_hf({**hf, "gated_norm_rank": 0})
    with pytest.raises(ConfigError, match="q_lora_rank"):
        ModelConfig.from_hf({**hf, "q_lora_rank": None})


def test_light_routes_over_all_experts_without_groups(tmp_path):
    """A.X-K2-Light: n_group / topk_group null, the top k of all experts (keel: one group)."""
    hf = save_hf_model("axk2", tmp_path, n_group=None, topk_group=None).eval()
    assert hf.model.layers[2].mlp.gate.num_group is None
    loaded = load_model(tmp_path, "float32")
    assert loaded.model.config.n_group == 1
    with torch.no_grad():
        assert _max_rel(loaded.model(_tokens()), hf(_tokens()).logits) <= 1e-4


def test_grouped_routing_scores_the_other_groups_experts_zero(tmp_path):
    """With a selection bias that takes every expert's biased score below 0, transformers' A.X-K2 router (whose
    mask fills 0.0) picks experts outside the chosen group; keel does too, and with DeepSeek's -inf it would not."""
    from safetensors.torch import load_file, save_file

    save_hf_model("axk2", tmp_path)
    path = tmp_path / "model.safetensors"
    tensors = load_file(path)
    tensors["model.layers.2.mlp.gate.e_score_correction_bias"] = torch.full((8,), -1.0)
    save_file(tensors, path, metadata={"format": "pt"})
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    loaded = load_model(tmp_path, "float32")
    with torch.no_grad():
        ref = hf(_tokens()).logits
        assert _max_rel(loaded.model(_tokens()), ref) <= 1e-4
        for module in loaded.model.modules():
            if hasattr(module, "group_fill"):
                module.group_fill = float("-inf")
        assert _max_rel(loaded.model(_tokens()), ref) > 1e-3  # 10x the tolerance above


def test_the_releases_names_are_read_and_written(tmp_path):
    """The releases store the gated query's projection as q_b_proj and the norms' gate pair as W_down / W_up."""
    from safetensors import safe_open

    save_hf_model("axk2", tmp_path)
    model = load_model(tmp_path, "float32").model
    attention = model.layers["0"].self_attn
    assert attention.q_b_proj is None and attention.q_gate_proj.weight.shape == (4 * (24 + 12), 64)
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        stored = f.get_tensor("model.layers.2.post_attention_layernorm.W_up.weight")
        assert "model.layers.1.post_attention_layernorm.W_up.weight" not in f.keys()  # a dense layer's norm: plain
    assert model.layers["2"].post_attention_layernorm.mlp.fc2.weight.equal(stored)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (dict(kv_lora_rank=0, qk_nope_head_dim=0, qk_rope_head_dim=0, v_head_dim=0), "mla_query_gate"),
        (dict(q_lora_rank=None, index_topk=0, index_n_heads=0, index_head_dim=0), "mla_query_gate"),
        (dict(norm_type="layer"), "gated_norm_rank"),
        (dict(norm_placement="sandwich"), "gated_norm_rank"),
        (dict(gated_norm_rank=-1), "gated_norm_rank"),
        (dict(router_scoring="softmax", router_bias=False), "router_group_mask_zero"),
    ],
)
def test_the_new_options_refuse_what_they_do_not_compose_with_by_name(tmp_path, change, field):
    save_hf_model("axk2", tmp_path)
    config = ModelConfig.from_json_file(tmp_path / "config.json")
    if "kv_lora_rank" in change:  # plain attention: the MLA geometry off
        change = {**change, "head_dim": 16, "index_topk": 0, "index_n_heads": 0, "index_head_dim": 0}
    with pytest.raises(ConfigError, match=field):
        dataclasses.replace(config, **change).validate()


def test_gated_norms_are_counted(tmp_path):
    save_hf_model("axk2", tmp_path)
    config = ModelConfig.from_json_file(tmp_path / "config.json")
    plain = dataclasses.replace(config, gated_norm_rank=0)
    # fc1 and fc2 (64 x 8 each) in the four input norms and the sparse layer's norm before the experts
    assert config.param_counts()["total"] - plain.param_counts()["total"] == 5 * 2 * 64 * 8
    assert json.loads((tmp_path / "config.json").read_text())["gated_norm_rank"] == 8


def test_training_reaches_the_gated_query_and_norms_and_leaves_the_indexer(tmp_path):
    """A backward pass through the sparse attention: gradients on q_gate_proj and the norms' gate pairs (both
    layers' kinds), none on the indexer, which keel trains frozen as DeepSeek-V3.2's."""
    save_hf_model("axk2", tmp_path)
    model = load_model(tmp_path, "float32").model.train()
    tokens = _tokens()
    logits = model(tokens)
    torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten()).backward()
    for layer in ("0", "2"):
        block = model.layers[layer]
        assert block.self_attn.q_gate_proj.weight.grad.abs().sum() > 0
        assert block.input_layernorm.mlp.fc1.weight.grad.abs().sum() > 0
        assert block.self_attn.indexer.wq_b.weight.grad is None
    assert model.layers["2"].post_attention_layernorm.mlp.fc2.weight.grad.abs().sum() > 0


def test_training_tensor_parallelism_refuses_sequence_parallel_gated_norms(tmp_path):
    """Without the indexer (which tp > 1 refuses), the gated query is cut by heads (tests/test_train_parallel.py's
    axk2_dense layout); the gated norms' fc1/fc2 cannot be replicated by SequenceParallel: refused by name."""
    from types import SimpleNamespace

    from keel.train import config as train_config

    save_hf_model("axk2", tmp_path)
    dense = ModelConfig.from_json_file(tmp_path / "config.json")
    dense = dataclasses.replace(dense, index_topk=0, index_n_heads=0, index_head_dim=0)

    def check(**parallel) -> None:
        cfg = SimpleNamespace(parallel=train_config.ParallelSection(**parallel), moe=train_config.MoESection())
        train_config._check_model_fits(cfg, dense, 1, lambda message: ConfigError(message))

    with pytest.raises(ConfigError, match="sequence_parallel is not supported for A.X-K2's gated norms"):
        check(tp=2)
    check(tp=2, sequence_parallel=False)
