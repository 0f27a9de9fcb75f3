"""keel.families: a family's config translation and fused checkpoint tensors (Phi-3), below the model."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch

from keel.config import ModelConfig
from keel.errors import ConfigError
from keel.families import FAMILIES
from keel.quant.loading import load_model
from keel.weights.parts import PartsReader
from keel.weights.safetensors import SafetensorsReader
from keel.weights.shard import Shard, narrow
from tiny_models import build_hf_model, save_hf_model


@pytest.fixture(scope="module")
def phi3(tmp_path_factory):
    path = tmp_path_factory.mktemp("phi3")
    save_hf_model("phi3", path)
    return path


def test_fused_tensors_read_as_their_parts(phi3):
    config = ModelConfig.from_json_file(phi3 / "config.json")
    fused = SafetensorsReader(phi3)
    whole = {name: fused.get(name) for name in fused.names()}
    reader = PartsReader(SafetensorsReader(phi3), FAMILIES["phi3"].checkpoint_layout(config))
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


def test_phi3_rotates_part_of_each_head_as_transformers_does(tmp_path):
    """Phi-4-mini's partial_rotary_factor (0.75) without its longrope: transformers' logits, and the factor
    written back on export (keel.families.rope reads it from rope_parameters or the top level)."""
    from keel.quant.loading import load_model

    hf = save_hf_model("phi3", tmp_path, partial_rotary_factor=0.75)
    loaded = load_model(tmp_path, "float32")
    assert loaded.model.config.partial_rotary_factor == 0.75
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref, ours = hf(tokens).logits, loaded.model(tokens)
    assert ((ours - ref).abs().max() / ref.abs().max()).item() <= 1e-4
    whole = build_hf_model("phi3")  # the same weights rotating whole heads: the factor is live
    with torch.no_grad():
        assert (whole(tokens).logits - ref).abs().max() > 1e-3
    exported = loaded.model.config.to_hf()
    assert ModelConfig.from_hf(exported).partial_rotary_factor == 0.75


def test_the_exported_config_is_phi3s(phi3):
    config = ModelConfig.from_json_file(phi3 / "config.json")
    hf = config.to_hf()
    assert hf["architectures"] == ["Phi3ForCausalLM"] and hf["sliding_window"] == 8
    assert ModelConfig.from_hf(hf) == config


def test_stablelm_reads_its_config_and_its_per_head_layernorms(tmp_path):
    save_hf_model("stablelm", tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    config = ModelConfig.from_hf(data)
    assert (config.norm_type, config.norm_bias, config.rotary_dim, config.head_dim) == ("layer", True, 8, 16)
    assert not config.qk_norm
    hf = config.to_hf()
    assert hf["rope_parameters"]["partial_rotary_factor"] == 0.5 and ModelConfig.from_hf(hf) == config
    # StableLM 2 12B's qk_layernorm: a bias-free LayerNorm per head, a weight of its own each
    per_head = ModelConfig.from_hf({**data, "qk_layernorm": True})
    assert (per_head.qk_norm, per_head.qk_norm_scope, per_head.qk_norm_type, per_head.qk_norm_bias) == (
        True,
        "each_head",
        "layer",
        False,
    )
    assert per_head.to_hf()["qk_layernorm"] is True and ModelConfig.from_hf(per_head.to_hf()) == per_head


@pytest.mark.parametrize("name", ["cohere-qk-norm", "stablelm-qk-norm", "phi-qk-norm"])
def test_qk_norms_read_as_the_families_store_them(tmp_path, name):
    """Cohere's [heads, head_dim] weights (regrouped with the rotary pairs), StableLM's list of LayerNorms stacked,
    Phi's one LayerNorm (with a bias) for all heads: keel's q/k norm parameters hold transformers' values."""
    hf = save_hf_model(name, tmp_path)
    model = load_model(tmp_path, dtype=torch.float32)
    config = model.config
    attn, ref = model.model.layers["1"].self_attn, hf.model.layers[1].self_attn
    if name == "phi-qk-norm":
        assert (config.qk_norm_scope, config.qk_norm_type, config.qk_norm_bias) == ("head", "layer", True)
        assert torch.equal(attn.k_norm.bias, ref.k_layernorm.bias)
        assert torch.equal(attn.q_norm.weight, ref.q_layernorm.weight)
        return
    assert (config.qk_norm_scope, config.qk_norm_type, config.qk_norm_bias) == ("each_head", "layer", False)
    assert attn.q_norm.weight.shape == (config.num_heads, config.head_dim)
    assert attn.k_norm.weight.shape == (config.num_kv_heads, config.head_dim)
    if name == "stablelm-qk-norm":
        stacked = torch.stack([norm.weight for norm in ref.k_layernorm.norms])
        assert torch.equal(attn.k_norm.weight, stacked)
    else:  # each head's channels in keel's rotary order: the even ones, then the odd ones
        order = [*range(0, config.head_dim, 2), *range(1, config.head_dim, 2)]
        assert torch.equal(attn.q_norm.weight, ref.q_norm.weight[:, order])


def test_qk_norm_fields_are_checked_by_name():
    base = dict(architecture="llama", vocab_size=64, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=2)
    base.update(head_dim=16)
    base.update(intermediate_size=64, qk_norm=True)
    with pytest.raises(ConfigError, match="qk_norm_scope"):
        ModelConfig(**base, qk_norm_scope="every")
    with pytest.raises(ConfigError, match="qk_norm_type"):
        ModelConfig(**base, qk_norm_type="group")
    with pytest.raises(ConfigError, match="qk_norm_bias"):
        ModelConfig(**base, qk_norm_bias=True)
    with pytest.raises(ConfigError, match="qk_norm_after_rope"):
        ModelConfig(**base, qk_norm_scope="each_head", qk_norm_after_rope=True)
    with pytest.raises(ConfigError, match="norm_weight_offset"):
        ModelConfig(**base, qk_norm_scope="each_head", norm_weight_offset=1.0)
    # a weight (and bias) per head of q and of k: 2 x (2 + 2) x 16
    plain = ModelConfig(**base).param_counts()["total"]
    each = ModelConfig(**base, qk_norm_scope="each_head", qk_norm_type="layer", qk_norm_bias=True)
    assert each.param_counts()["total"] - plain == 2 * (2 + 2) * 16 - 2 * 16


def test_gpt_neox_reads_interleaved_heads_and_its_own_names(tmp_path):
    """GPT-NeoX's query_key_value holds, per head, q then k then v: keel's q/k/v_proj (weights and biases)
    are read from those rows, a tensor-parallel rank's heads included, and the other tensors by rename."""
    save_hf_model("gpt_neox", tmp_path)
    config = ModelConfig.from_json_file(tmp_path / "config.json")
    stored = SafetensorsReader(tmp_path)
    reader = PartsReader(SafetensorsReader(tmp_path), FAMILIES["gpt_neox"].checkpoint_layout(config))
    assert not any(n.startswith("gpt_neox.") for n in reader.names())
    d, heads = config.head_dim, config.num_heads
    for kind in ("weight", "bias"):
        qkv = stored.get(f"gpt_neox.layers.1.attention.query_key_value.{kind}")
        per_head = qkv.reshape(heads, 3, d, *qkv.shape[1:])
        for i, name in enumerate(("q_proj", "k_proj", "v_proj")):
            want = per_head[:, i].reshape(heads * d, *qkv.shape[1:])
            assert torch.equal(reader.get(f"model.layers.1.self_attn.{name}.{kind}"), want)
            shard = Shard(0, d, 3 * d)  # heads 1 and 2 of 4
            assert torch.equal(reader.get_shard(f"model.layers.1.self_attn.{name}.{kind}", shard), want[d : 3 * d])
    assert torch.equal(reader.get("model.norm.bias"), stored.get("gpt_neox.final_layer_norm.bias"))
    assert torch.equal(
        reader.get_row("model.layers.0.mlp.up_proj.weight", 5),
        stored.get("gpt_neox.layers.0.mlp.dense_h_to_4h.weight")[5],
    )


def test_gpt2_conv1d_weights_are_read_through_their_transpose_shard_by_shard(tmp_path):
    """GPT-2's Conv1D weights are stored [in, out]: keel's q/k/v are c_attn's column thirds, transposed; a
    tensor-parallel rank's rows (column-parallel) or columns (row-parallel) come from that box of the stored tensor,
    and the bare names of GPT2Model's files read as the `transformer.` ones."""
    save_hf_model("gpt2", tmp_path)
    config = ModelConfig.from_json_file(tmp_path / "config.json")
    stored = SafetensorsReader(tmp_path)
    reader = PartsReader(SafetensorsReader(tmp_path), FAMILIES["gpt2"].checkpoint_layout(config))
    assert not any(n.startswith("transformer.") for n in reader.names())
    h = config.hidden_size
    c_attn = stored.get("transformer.h.1.attn.c_attn.weight")  # [h, 3h]
    for i, name in enumerate(("q_proj", "k_proj", "v_proj")):
        want = c_attn[:, i * h : (i + 1) * h].T
        assert torch.equal(reader.get(f"model.layers.1.self_attn.{name}.weight"), want)
        shard = reader.get_shard(f"model.layers.1.self_attn.{name}.weight", Shard(0, 16, 48))
        assert torch.equal(shard, want[16:48]) and shard.is_contiguous()
        bias = stored.get("transformer.h.1.attn.c_attn.bias")[i * h : (i + 1) * h]
        assert torch.equal(reader.get(f"model.layers.1.self_attn.{name}.bias"), bias)
    down = stored.get("transformer.h.0.mlp.c_proj.weight")  # [4h, h]: keel's down_proj is [h, 4h]
    assert torch.equal(reader.get_shard("model.layers.0.mlp.down_proj.weight", Shard(1, 32, 96)), down[32:96].T)
    assert reader.shape("model.layers.0.mlp.down_proj.weight") == tuple(down.T.shape)
    assert torch.equal(reader.get("model.embed_positions.weight"), stored.get("transformer.wpe.weight"))
    bare = tmp_path / "bare"
    bare.mkdir()
    from safetensors.torch import save_file

    save_file({n.removeprefix("transformer."): stored.get(n) for n in stored.names()}, str(bare / "model.safetensors"))
    unprefixed = PartsReader(SafetensorsReader(bare), FAMILIES["gpt2"].checkpoint_layout(config))
    assert torch.equal(unprefixed.get("model.layers.1.self_attn.k_proj.weight"), c_attn[:, h : 2 * h].T)


def test_dbrx_fused_experts_are_read_by_expert_shard_by_shard_and_written_back(tmp_path):
    """DBRX stores each layer's experts fused by rows ([E * I, H]: w1 gate, v1 up, w2 whose rows are each expert's
    down projection transposed): keel's per-expert weights are their rows (w2's transposed), a tensor-parallel rank's
    shard reads its box of them, and keel's weights fuse back into the stored tensors as they were."""
    from keel.weights.parts import fused_stream

    save_hf_model("dbrx", tmp_path)
    config = ModelConfig.from_json_file(tmp_path / "config.json")
    stored = SafetensorsReader(tmp_path)
    layout = FAMILIES["dbrx"].checkpoint_layout(config)
    reader = PartsReader(SafetensorsReader(tmp_path), layout)
    assert not any(n.startswith("transformer.") for n in reader.names())
    width, hidden = config.moe_intermediate_size, config.hidden_size
    experts = "transformer.blocks.1.ffn.experts.mlp"
    w1, v1, w2 = (stored.get(f"{experts}.{n}") for n in ("w1", "v1", "w2"))
    for e in range(config.num_experts):
        rows = slice(e * width, (e + 1) * width)
        keel = f"model.layers.1.mlp.experts.{e}"
        assert torch.equal(reader.get(f"{keel}.gate_proj.weight"), w1[rows])
        assert torch.equal(reader.get(f"{keel}.up_proj.weight"), v1[rows])
        assert reader.shape(f"{keel}.down_proj.weight") == (hidden, width)
        assert torch.equal(reader.get(f"{keel}.down_proj.weight"), w2[rows].T)
        shard = reader.get_shard(f"{keel}.down_proj.weight", Shard(1, 8, 40))  # row-parallel: columns 8..40
        assert torch.equal(shard, w2[rows].T[:, 8:40]) and shard.is_contiguous()
        assert torch.equal(reader.get_row(f"{keel}.down_proj.weight", 5), w2[rows][:, 5])
    q = config.num_heads * config.head_dim
    wqkv = stored.get("transformer.blocks.0.norm_attn_norm.attn.Wqkv.weight")
    assert torch.equal(reader.get("model.layers.0.self_attn.k_proj.weight"), wqkv[q : q + 2 * config.head_dim])
    assert torch.equal(
        reader.get("model.layers.2.mlp.gate.weight"), stored.get("transformer.blocks.2.ffn.router.layer.weight")
    )
    keel_named = ((n, reader.get(n)) for n in sorted(reader.names()))
    back = dict(fused_stream({k: v for k, v in layout.items() if k.startswith("transformer.")}, keel_named))
    assert sorted(back) == sorted(stored.names())
    assert all(torch.equal(back[n], stored.get(n)) for n in stored.names())


def test_dbrx_config_reads_its_nested_keys_and_refuses_what_it_cannot_run():
    """attn_config / ffn_config hold DBRX's own options; its RoPE base is attn_config's (the released files' key)
    over transformers 5's default top-level one; a p-norm other than the sum (p = 1) is refused by name."""
    from tiny_models import COMMON, TINY_CONFIGS

    _, arch, extra = TINY_CONFIGS["dbrx"]
    hf = {**COMMON, **extra, "architectures": [arch]}
    hf["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    hf["attn_config"] = {"kv_n_heads": 1, "clip_qkv": 8, "rope_theta": 500000.0}
    config = ModelConfig.from_hf(hf)
    assert (config.rope_theta, config.num_kv_heads, config.clip_qkv) == (500000.0, 1, 8.0)
    assert config.to_hf()["attn_config"]["rope_theta"] == 500000.0
    ffn = {"ffn_hidden_size": 32, "moe_num_experts": 4, "moe_top_k": 2, "moe_normalize_expert_weights": None}
    config = ModelConfig.from_hf({**hf, "ffn_config": ffn})
    assert not config.norm_topk_prob and config.intermediate_size == config.moe_intermediate_size == 32
    assert config.to_hf()["ffn_config"]["moe_normalize_expert_weights"] is None
    for bad, field in [
        ({"ffn_config": {**ffn, "moe_normalize_expert_weights": 2.0}}, "moe_normalize_expert_weights"),
        ({"ffn_config": {**ffn, "ffn_act_fn": {"name": "silu", "inplace": True}}}, "ffn_act_fn"),
        ({"tie_word_embeddings": True}, "tie_word_embeddings"),
    ]:
        with pytest.raises(ConfigError, match=field):
            ModelConfig.from_hf({**hf, **bad})


def test_opt_350m_projections_go_with_the_embedding_and_the_head(tmp_path):
    """OPT-350m's project_in goes with the embedding (a pipeline's first stage), project_out with the head (its last);
    the two stages give the whole model's logits, and its norms sit after the residual adds with no final norm."""
    import copy

    from keel.model.stages import split_stage
    from keel.quant.loading import load_model

    save_hf_model("opt-350m", tmp_path)
    full = load_model(tmp_path, "float32").model
    assert (full.config.norm_placement, full.config.final_norm, full.config.embedding_size) == (
        "post_residual",
        False,
        32,
    )
    assert full.embed_tokens.weight.shape == (256, 32) and full.lm_head.weight is full.embed_tokens.weight
    first, last = split_stage(copy.deepcopy(full), 0, 2), split_stage(copy.deepcopy(full), 1, 2)
    assert first.project_in is not None and first.project_out is None and first.norm is None
    assert last.project_in is None and last.project_out is not None and last.embed_tokens is None
    tokens = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(last(first(tokens)), full(tokens))


def test_opt_350m_refuses_sequence_parallel_training_by_name(tmp_path):
    """OPT-350m's projections and post-residual norms are plain modules between a sequence-sharded residual and the
    parallel styles: a training config with tp > 1 and sequence parallelism is refused at config time, naming the
    setting to change; without sequence parallelism it passes."""
    from types import SimpleNamespace

    from keel.train import config as train_config

    config = ModelConfig.from_hf(json.loads(save_hf_model("opt-350m", tmp_path).config.to_json_string()))
    fail = ConfigError
    for sp in (True, False):
        cfg = SimpleNamespace(
            parallel=train_config.ParallelSection(tp=2, sequence_parallel=sp), moe=train_config.MoESection()
        )
        if sp:
            with pytest.raises(ConfigError, match="sequence_parallel = false"):
                train_config._check_model_fits(cfg, config, 1, fail)
        else:
            train_config._check_model_fits(cfg, config, 1, fail)


@pytest.mark.parametrize(
    "name, options, field",
    [
        ("opt-350m", dict(laurel_rank=4), "laurel_rank"),
        ("gemma4-moe", dict(norm_placement="post_residual"), "moe_branch_norms"),
    ],
)
def test_post_residual_norms_refuse_what_their_block_does_not_run(tmp_path, name, options, field):
    """The post_residual block adds no LAuReL branch and norms the MLP's input with the layer's own norm (which the
    MoE block's branch norms take the place of): refused by name, not dropped (LAuReL) or failing in forward."""
    save_hf_model(name, tmp_path)
    config = ModelConfig.from_json_file(tmp_path / "config.json")
    with pytest.raises(ConfigError, match=field):
        dataclasses.replace(config, **options)


def test_learned_positions_go_with_the_embedding_and_bound_the_served_length():
    """A pipeline's first stage holds the position table; serving past its rows is refused whatever the
    environment allows (there is no row to read)."""
    from keel.errors import KeelError
    from keel.model.stages import split_stage
    from keel.model.transformer import build_model
    from keel.serve.model_len import check_model_len
    from tiny_models import COMMON, TINY_CONFIGS

    _, arch, extra = TINY_CONFIGS["gpt_bigcode"]
    config = ModelConfig.from_hf({**COMMON, **extra, "architectures": [arch]})
    assert config.learned_positions == 256 and not any(config.layer_rotates(i) for i in range(config.num_layers))
    first, last = split_stage(build_model(config), 0, 2), split_stage(build_model(config), 1, 2)
    assert first.embed_positions is not None and last.embed_positions is None
    check_model_len(256, config)
    with pytest.raises(KeelError, match="256 learned positions"):
        check_model_len(257, config)


@pytest.mark.parametrize(
    ("arch", "fields", "named"),
    [
        ("BloomForCausalLM", {"apply_residual_connection_post_layernorm": True}, "apply_residual_connection"),
        ("MptForCausalLM", {"attn_config": {"alibi": False}}, "attn_config.alibi"),
        ("MptForCausalLM", {"attn_config": {"qk_ln": True}}, "qk_ln"),
        ("MptForCausalLM", {"attn_config": {"prefix_lm": True}}, "prefix_lm"),
        ("MptForCausalLM", {"attn_config": {"attn_uses_sequence_id": True}}, "attn_uses_sequence_id"),
        ("MptForCausalLM", {"attn_config": {"attn_type": "multiquery_attention"}}, "attn_type"),
        ("MptForCausalLM", {"no_bias": False}, "no_bias"),
        ("MptForCausalLM", {"logit_scale": 0.5}, "logit_scale"),
        ("FalconForCausalLM", {"new_decoder_architecture": True, "parallel_attn": False}, "parallel_attn"),
        ("FalconForCausalLM", {"num_ln_in_parallel_attn": 2}, "num_ln_in_parallel_attn"),
        ("GPT2LMHeadModel", {"add_cross_attention": True}, "add_cross_attention"),
        ("GPTBigCodeForCausalLM", {"activation_function": "tanh"}, "hidden_act"),
        ("GPTJForCausalLM", {"rotary_dim": 32}, "rotary_dim"),
        ("GPTNeoForCausalLM", {"attention_types": [[["global", "sparse"], 1]]}, "attention_types"),
        ("XGLMForCausalLM", {"add_cross_attention": True}, "add_cross_attention"),
    ],
)
def test_classic_families_refuse_what_keel_cannot_run_by_name(arch, fields, named):
    hf = {"architectures": [arch], "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2}
    with pytest.raises(ConfigError, match=named):
        ModelConfig.from_hf({**hf, "vocab_size": 256, **fields}, source="config.json")


@pytest.mark.parametrize(("width", "padding_idx"), [(64, 1), (54, 5), (64, None)])
def test_sinusoidal_positions_are_transformers_xglm_table_bit_for_bit(width, padding_idx):
    """keel computes XGLM's table from the positions each forward: the same float32 values as transformers' stored
    table, its padding row zeros, and positions far past max_position_embeddings (no table to run out of)."""
    from transformers.models.xglm.modeling_xglm import XGLMSinusoidalPositionalEmbedding

    from keel.model.layers import SinusoidalPositions

    rows = torch.arange(3000).reshape(3, 1000)
    table = XGLMSinusoidalPositionalEmbedding.get_embedding(3000, width, padding_idx)
    assert torch.equal(SinusoidalPositions(width, padding_idx)(rows), table[rows])
    hf = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 256}
    config = ModelConfig.from_hf({**hf, "architectures": ["XGLMForCausalLM"], "pad_token_id": padding_idx})
    assert (config.position_offset, config.position_padding_idx, config.learned_positions) == (2, padding_idx, 0)
    assert ModelConfig.from_hf(config.to_hf()) == config
    if padding_idx is not None:  # a padding row belongs to the sinusoidal table alone
        with pytest.raises(ConfigError, match="position_padding_idx"):
            dataclasses.replace(config, position_embedding="learned")


def test_alibi_families_read_their_slopes_and_the_embedding_norm_goes_with_the_first_stage():
    """Bloom: ALiBi at Bloom's slopes, its embedding's own biased LayerNorm (counted, held by a pipeline's first
    stage); Falcon-RW: the slopes over sqrt(head_dim); MPT: its alibi_bias_max and expansion_ratio read."""
    from keel.model.stages import split_stage
    from keel.model.transformer import build_model

    hf = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 256}
    bloom = ModelConfig.from_hf({**hf, "architectures": ["BloomForCausalLM"]})
    assert bloom.position_embedding == "alibi" and bloom.embedding_norm and bloom.norm_affine
    assert not any(bloom.layer_rotates(i) for i in range(2)) and bloom.to_hf()["n_head"] == 4
    first, last = split_stage(build_model(bloom), 0, 2), split_stage(build_model(bloom), 1, 2)
    assert first.embedding_norm.bias is not None and last.embedding_norm is None
    assert torch.equal(first.layers["0"].self_attn.alibi, torch.tensor([2.0**-2, 2.0**-4, 2.0**-6, 2.0**-8]))
    falcon = ModelConfig.from_hf({**hf, "architectures": ["FalconForCausalLM"], "alibi": True})
    assert falcon.position_embedding == "alibi" and falcon.alibi_scale == 16**-0.5 and falcon.to_hf()["alibi"]
    mpt = {**hf, "architectures": ["MptForCausalLM"], "expansion_ratio": 3, "attn_config": {"alibi_bias_max": 16}}
    config = ModelConfig.from_hf(mpt)
    assert (config.alibi_bias_max, config.intermediate_size) == (16.0, 192)
    assert ModelConfig.from_hf(config.to_hf()) == config


def test_a_checkpoint_whose_tensors_the_inferred_block_cannot_place_is_refused(tmp_path):
    """Without config.json, StableLM's tensors look like Qwen2's but for the LayerNorms' biases: keel refuses
    to infer the structure rather than serve a Qwen2 without them."""
    from keel.weights import open_checkpoint

    save_hf_model("stablelm", tmp_path)
    (tmp_path / "config.json").unlink()
    with pytest.raises(ConfigError) as e:
        open_checkpoint(str(tmp_path), head_dim=16)
    message = str(e.value)
    assert "input_layernorm.bias" in message and "config.json" in message and "\n" not in message


def test_whole_projection_qk_norms_refuse_tensor_parallelism(tmp_path):
    """OLMo 2's q/k norms span every head: a tensor-parallel rank holds some heads only, so serving and
    training both refuse tp > 1 by name (one process runs it)."""
    from keel.errors import KeelError
    from keel.serve.parallel.load import check_parallel_model
    from keel.train import config as train_config

    save_hf_model("olmo2", tmp_path)
    config = ModelConfig.from_json_file(tmp_path / "config.json")
    assert (config.qk_norm_scope, config.norm_placement) == ("all", "post")
    with pytest.raises(KeelError, match="whole projection"):
        check_parallel_model(config, tmp_path, 2, 1)
    check_parallel_model(config, tmp_path, 1, 2)  # pipeline stages cut whole layers
    cfg = SimpleNamespace(parallel=train_config.ParallelSection(tp=2), moe=train_config.MoESection())
    with pytest.raises(ConfigError, match="whole projection"):
        train_config._check_model_fits(cfg, config, 1, lambda message: ConfigError(message))


def test_per_head_qk_norm_weights_refuse_tensor_parallelism(tmp_path):
    """Command R+'s q/k norm weights, one per head: a rank's heads would need their rows of them, which neither
    serving nor training slices yet, so both refuse tp > 1 by name."""
    from keel.errors import KeelError
    from keel.serve.parallel.load import check_parallel_model
    from keel.train import config as train_config

    save_hf_model("cohere-qk-norm", tmp_path)
    config = ModelConfig.from_json_file(tmp_path / "config.json")
    with pytest.raises(KeelError, match="a weight per head"):
        check_parallel_model(config, tmp_path, 2, 1)
    check_parallel_model(config, tmp_path, 1, 2)  # pipeline stages cut whole layers
    cfg = SimpleNamespace(parallel=train_config.ParallelSection(tp=2), moe=train_config.MoESection())
    with pytest.raises(ConfigError, match="each_head"):
        train_config._check_model_fits(cfg, config, 1, lambda message: ConfigError(message))


def test_gemma3_reads_both_rope_forms_and_attention_softcapping(tmp_path):
    """Gemma 3's per-kind RoPE as transformers 5 writes it (rope_parameters by layer kind) and as older
    configs do (rope_theta, rope_local_base_freq, rope_scaling) give the same model; attention-score
    soft-capping (Gemma 2's, None in Gemma 3) is read where a config sets it."""
    save_hf_model("gemma3", tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    config = ModelConfig.from_hf(data)
    assert (config.rope_theta, config.rope_scaling.type, config.rope_scaling.factor) == (100000.0, "linear", 2.0)
    assert (config.sliding_rope_theta, config.sliding_rope_scaling.type) == (5000.0, "default")
    legacy = {k: v for k, v in data.items() if k != "rope_parameters"}
    legacy.update(rope_theta=100000.0, rope_local_base_freq=5000.0, rope_scaling={"rope_type": "linear", "factor": 2.0})
    assert ModelConfig.from_hf(legacy) == config
    assert ModelConfig.from_hf(config.to_hf()) == config
    assert config.attn_logit_softcapping is None
    capped = ModelConfig.from_hf({**data, "attn_logit_softcapping": 50.0})
    assert capped.attn_logit_softcapping == 50.0 and ModelConfig.from_hf(capped.to_hf()) == capped
    with pytest.raises(ConfigError, match="use_bidirectional_attention"):
        ModelConfig.from_hf({**data, "use_bidirectional_attention": True}, source="gemma/config.json")


def test_gemma2_reads_transformers_defaults_and_writes_its_config(tmp_path):
    """Gemma 2's config.json: without layer_types the layers alternate as transformers' Gemma2Config sets them
    (even layers slide); absent soft-caps take transformers' defaults (final 30, attention 50), null ones are
    off; the exported config reads back the same; bidirectional attention and a cap <= 0 are refused."""
    save_hf_model("gemma2", tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    config = ModelConfig.from_hf(data)
    assert (config.architecture, config.norm_placement, config.norm_weight_offset) == ("gemma2", "sandwich", 1.0)
    assert (config.attn_logit_softcapping, config.final_logit_softcapping, config.qk_norm) == (5.0, 30.0, False)
    assert config.attention_scale == 24**-0.5 and config.sliding_rope_theta is None
    assert ModelConfig.from_hf(config.to_hf()) == config
    bare = {
        k: v for k, v in data.items() if k not in ("layer_types", "attn_logit_softcapping", "final_logit_softcapping")
    }
    bare["num_hidden_layers"] = 4
    read = ModelConfig.from_hf(bare)
    assert read.layer_types == ["sliding_attention", "full_attention"] * 2
    assert (read.attn_logit_softcapping, read.final_logit_softcapping) == (50.0, 30.0)
    off = ModelConfig.from_hf({**data, "attn_logit_softcapping": None, "final_logit_softcapping": None})
    assert (off.attn_logit_softcapping, off.final_logit_softcapping) == (None, None)
    with pytest.raises(ConfigError, match="use_bidirectional_attention"):
        ModelConfig.from_hf({**data, "use_bidirectional_attention": True}, source="gemma/config.json")
    with pytest.raises(ConfigError, match="attn_logit_softcapping must be > 0"):
        ModelConfig.from_hf({**data, "attn_logit_softcapping": -1.0})


@pytest.mark.parametrize("cap", [None, 1.0])
def test_gemma2_attention_softcapping_is_exercised(tmp_path, cap):
    """The attention soft-cap changes the logits (the tiny model's 5.0 against none, and against 1.0), and keel
    matches transformers' Gemma2ForCausalLM with each (float32, the model's own attention without a cache)."""
    from keel.quant.loading import load_model

    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    logits = {}
    for name, overrides in (("tiny", {}), ("cap", {"attn_logit_softcapping": cap})):
        hf = save_hf_model("gemma2", tmp_path / name, **overrides)
        keel = load_model(tmp_path / name, "float32").model
        assert keel.layers["0"].self_attn.softcap == hf.config.attn_logit_softcapping
        with torch.no_grad():
            ref, logits[name] = hf(tokens).logits, keel(tokens)
        assert ((logits[name] - ref).abs().max() / ref.abs().max()).item() <= 1e-4
    assert ((logits["cap"] - logits["tiny"]).abs().max() / logits["tiny"].abs().max()).item() > 0.1


@pytest.mark.parametrize(("max_model_len", "prompt_len", "new_tokens"), [(64, 20, 16), (16, 8, 8)])
def test_longrope_served_with_one_set_of_frequencies(tmp_path, max_model_len, prompt_len, new_tokens):
    """Phi-3.5 / Phi-4-mini's LongRoPE through the engine: one set of frequencies for the whole cache, chosen by
    max_model_len (the long set beyond the pre-training context of 16, as llama.cpp chooses by its context size).
    Where transformers would choose the same set for every step (a prompt already past 16 positions, or a whole
    sequence within them), its greedy tokens."""
    from keel.serve.engine import EngineConfig
    from keel.serve.llm import LLM
    from keel.serve.sampling import SamplingParams
    from tiny_models import save_byte_tokenizer

    hf = save_hf_model("phi3-longrope", tmp_path)
    save_byte_tokenizer(tmp_path)
    hf.generation_config.eos_token_id = None
    prompt = list(range(40, 40 + prompt_len))
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    config = EngineConfig.of(dtype="float32", compile=False, num_blocks=32, max_model_len=max_model_len, block_size=8)
    llm = LLM(str(tmp_path), config)
    assert llm.engine.model.rotary.long_context == (max_model_len > 16)
    greedy = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    assert llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids == out[0, prompt_len:].tolist()


def test_longrope_needs_a_factor_per_frequency():
    data = {
        "architectures": ["Phi3ForCausalLM"],
        "vocab_size": 256,
        "hidden_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "intermediate_size": 128,
        "rope_scaling": {"type": "su", "short_factor": [1.0] * 3, "long_factor": [1.0] * 8},
    }
    with pytest.raises(ConfigError, match="one short and one long factor per rotary frequency"):
        ModelConfig.from_hf(data, source="config.json")
    data["rope_scaling"] = {"type": "longrope"}
    with pytest.raises(ConfigError, match="short_factor and long_factor"):
        ModelConfig.from_hf(data, source="config.json")


@pytest.mark.parametrize("family", ["cwm", "apertus"])
def test_a_family_default_rope_is_its_config_class_one(family):
    """Where a file names no rope parameters, the family's config class sets whole ones (CWM: Llama 3.1's scaling
    over theta 1e6), and a top-level rope_theta goes unread, as transformers reads it."""
    import transformers

    hf = {"architectures": [FAMILIES[family].HF_ARCHITECTURE], "hidden_size": 64, "num_attention_heads": 4}
    hf.update(num_hidden_layers=2, num_key_value_heads=2, head_dim=16, vocab_size=256, rope_theta=5000.0)
    config = ModelConfig.from_hf(hf)
    reference = transformers.AutoConfig.for_model(family, **{k: v for k, v in hf.items() if k != "architectures"})
    rope = reference.rope_parameters
    assert config.rope_theta == rope["rope_theta"] and config.rope_scaling.type == rope["rope_type"] == "llama3"
    assert config.rope_scaling.factor == rope["factor"]
    scaled = ModelConfig.from_hf({**hf, "rope_scaling": {"rope_type": "linear", "factor": 2.0}})
    assert scaled.rope_scaling.type == "linear"


def test_hunyuan_moe_reads_uniform_per_layer_lists_and_refuses_what_it_cannot_run(tmp_path):
    """Hunyuan-A13B's configs list the expert keys per layer: one value for every layer is read, a varying one (or
    a width, shared count or attention transformers' model does not have) is refused by name."""
    save_hf_model("hunyuan_v1_moe", tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    listed = {"num_experts": [8] * 3, "moe_topk": [2] * 3, "moe_intermediate_size": [32] * 3, "num_shared_expert": [1]}
    config = ModelConfig.from_hf({**data, **listed, "use_mixed_mlp_moe": True, "use_cla": False})
    assert (config.num_experts, config.num_experts_per_tok, config.shared_expert_intermediate_size) == (8, 2, 32)
    assert config.router_float32 and config.norm_topk_prob and not config.shared_expert_gated
    for key, value in [
        ("moe_topk", [2, 1, 2]),
        ("num_experts", [8, 8, 4]),
        ("moe_intermediate_size", 48),
        ("num_shared_expert", [2, 2, 2]),
        ("use_cla", True),
        ("use_mixed_mlp_moe", False),
    ]:
        with pytest.raises(ConfigError, match=key):
            ModelConfig.from_hf({**data, key: value}, source="hunyuan/config.json")
    assert ModelConfig.from_hf(config.to_hf()) == config


def test_phimoe_reads_its_router_and_mscale_and_refuses_what_it_cannot_run(tmp_path):
    save_hf_model("phimoe", tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    config = ModelConfig.from_hf(data)
    assert (config.router_scoring, config.router_jitter_eps, config.rope_scaling.attention_factor) == (
        "sparsemixer",
        0.1,
        1.2,
    )
    assert ModelConfig.from_hf(config.to_hf()) == config
    with pytest.raises(ConfigError, match="num_experts_per_tok"):
        ModelConfig.from_hf({**data, "num_experts_per_tok": 4})
    rope = data["rope_parameters"]
    with pytest.raises(ConfigError, match="long_mscale"):
        ModelConfig.from_hf({**data, "rope_parameters": {**rope, "long_mscale": 1.5}})
    with pytest.raises(ConfigError, match="short_mscale"):
        ModelConfig.from_hf({**data, "rope_parameters": {k: v for k, v in rope.items() if k != "short_mscale"}})


def _declared_defaults(cls) -> dict:
    import dataclasses

    return {
        name: f.default
        for name, f in getattr(cls, "__dataclass_fields__", {}).items()
        if not isinstance(f.default, dataclasses._MISSING_TYPE)
    }


# The family's transformers config class, where the causal-LM class's own is a multimodal or text-only variant.
CONFIG_CLASS = {
    "llama4": "Llama4TextConfig",
    "gemma3": "Gemma3TextConfig",
    "gemma4": "Gemma4TextConfig",
    "gemma3n": "Gemma3nTextConfig",
    "qwen3_5": "Qwen3_5TextConfig",
    "qwen3_5_moe": "Qwen3_5MoeTextConfig",
    "mistral4": "Mistral4Config",
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_defaults_are_its_config_class_defaults(family):
    """Keys a config.json may omit take what transformers' config class declares: head_dim and num_key_value_heads
    (a fixed number in many classes, whatever hidden_size / heads gives), eps, context, bos."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    arch = FAMILIES[family].HF_ARCHITECTURE
    model_type = getattr(FAMILIES[family], "MODEL_TYPE", None)  # a family transformers runs on another's class
    model_type = model_type or next((t for t, a in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items() if a == arch), None)
    name = CONFIG_CLASS.get(family) or CONFIG_MAPPING_NAMES.get(model_type)
    declared = _declared_defaults(getattr(transformers, name))
    ours = FAMILIES[family].DEFAULTS
    for key in ("head_dim", "num_key_value_heads", "max_position_embeddings", "bos_token_id"):
        if isinstance(declared.get(key), int):
            assert ours.get(key) == declared[key], key
        elif key in ("head_dim", "num_key_value_heads"):  # none declared, or None: computed from the shape
            assert ours.get(key) is None, key
    if isinstance(declared.get("rms_norm_eps"), float):
        assert ours["rms_norm_eps"] == declared["rms_norm_eps"]


def _rename(old: str, new: str):
    return lambda cfg: cfg.__setitem__(new, cfg.pop(old))


def _as_released(architecture: str, written: dict | None = None, **renamed: str):
    """A config as the family's releases write it: their `architectures` (transformers saves the class it ran the
    model on), keys under the names of their `attribute_map`, keys of their own format (`written`; None: removed)."""

    def edit(cfg: dict) -> None:
        cfg["architectures"] = [architecture]
        for old, new in renamed.items():
            _rename(old, new)(cfg)
        for key, value in (written or {}).items():
            cfg.pop(key) if value is None else cfg.__setitem__(key, value)

    return edit


# sarvam-105b's own format: derived head sizes, DeepSeek's YaRN under its remote code's name.
_SARVAM_MLA_RELEASED = {
    "head_dim": 24,  # kv_lora_rank + qk_rope_head_dim, for vLLM
    "q_head_dim": 24,
    "rope_parameters": None,
    "rope_theta": 10000.0,
    "rope_scaling": {
        "type": "deepseek_yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 16,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 0.8,
    },
}


@pytest.mark.parametrize(
    "family, edit, overrides",
    [
        ("hunyuan_v1_moe", _rename("moe_topk", "num_experts_per_tok"), {}),  # transformers' attribute_map alias
        (
            "exaone",
            _as_released(
                "ExaoneForCausalLM",
                num_hidden_layers="num_layers",
                rms_norm_eps="layer_norm_epsilon",
                hidden_act="activation_function",
            ),
            {"rms_norm_eps": 0.1},  # far from the default, so that reading it counts
        ),
        (
            "sarvam_moe",
            _as_released(
                "SarvamMoEForCausalLM",
                n_routed_experts="num_experts",
                n_shared_experts="num_shared_experts",
                attention_bias="use_qkv_bias",
            ),
            {"n_shared_experts": 2, "attention_bias": False},  # apart from the defaults and the tiny model's
        ),
        (
            "internlm3",  # its releases' bias names and their legacy dynamic rope scaling
            _as_released(
                "InternLM3ForCausalLM",
                {"rope_parameters": None, "rope_theta": 50000.0, "rope_scaling": {"type": "dynamic", "factor": 6.0}},
                attention_bias="qkv_bias",
                mlp_bias="bias",
            ),
            {"attention_bias": False, "mlp_bias": False},
        ),
        ("mellum", _rename("num_local_experts", "num_experts"), {}),
        (
            "minicpm3",  # its releases' LongRoPE over the rope channels (past the original context: the long set)
            None,
            {
                "max_position_embeddings": 64,
                "rope_parameters": {
                    "rope_type": "longrope",
                    "rope_theta": 10000.0,
                    "short_factor": [1.0, 1.5, 2.0, 3.0],
                    "long_factor": [2.0, 3.0, 4.0, 5.0],
                    "original_max_position_embeddings": 16,
                },
            },
        ),
        (
            "sarvam_mla",
            _as_released("SarvamMLAForCausalLM", _SARVAM_MLA_RELEASED, n_routed_experts="num_experts"),
            {"n_routed_experts": 4},
        ),
        ("flex_olmo", _rename("num_experts", "num_local_experts"), {}),
        ("cwm", lambda cfg: cfg.__setitem__("attention_bias", True), {}),  # a key its model does not read
        ("kolibri1", lambda cfg: cfg.__setitem__("attention_bias", True), {}),
        ("glm", lambda cfg: cfg.pop("num_key_value_heads"), {"num_key_value_heads": 2}),  # GlmConfig's default
        # Google's spelling of the full-attention layers' geometry (transformers saves per_layer_config instead)
        (
            "gemma4",
            lambda cfg: cfg.update(global_head_dim=32, num_global_key_value_heads=1) or cfg.pop("per_layer_config"),
            {},
        ),
        # Gemma 3n's releases: RoPE bases as rope_theta and rope_local_base_freq, one MLP width per layer
        (
            "gemma3n",
            lambda cfg: (
                cfg.pop("rope_parameters")
                and cfg.update(
                    rope_theta=100000.0, rope_local_base_freq=5000.0, rope_scaling=None, intermediate_size=[96] * 5
                )
            ),
            {},
        ),
        (
            "phimoe",  # its mscale replaces YaRN's factor on cos/sin too
            None,
            {
                "rope_parameters": {
                    "rope_type": "yarn",
                    "rope_theta": 1e4,
                    "factor": 2.0,
                    "original_max_position_embeddings": 256,
                    "short_mscale": 1.2,
                    "long_mscale": 1.2,
                }
            },
        ),
    ],
)
def test_config_spellings_are_read_as_transformers_reads_them(tmp_path, family, edit, overrides):
    import transformers

    from keel.quant.loading import load_model

    hf = save_hf_model(family, tmp_path, **overrides)
    if edit is not None:
        data = json.loads((tmp_path / "config.json").read_text())
        edit(data)
        (tmp_path / "config.json").write_text(json.dumps(data))
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    tokens = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref, ours = hf(tokens).logits, load_model(tmp_path, "float32").model(tokens)
    assert ((ours - ref).abs().max() / ref.abs().max()).item() < 1e-4
    config = ModelConfig.from_json_file(tmp_path / "config.json")
    assert ModelConfig.from_hf(config.to_hf()) == config


def test_mellum_refuses_a_rotary_share_per_layer_kind(tmp_path):
    save_hf_model("mellum", tmp_path)
    hf = json.loads((tmp_path / "config.json").read_text())
    hf["rope_parameters"]["full_attention"]["partial_rotary_factor"] = 0.5  # Laguna's, which keel runs for all
    with pytest.raises(ConfigError, match="partial_rotary_factor per layer kind"):
        ModelConfig.from_hf(hf)
    hf["rope_parameters"]["sliding_attention"]["partial_rotary_factor"] = 0.5
    assert ModelConfig.from_hf(hf).partial_rotary_factor == 0.5


def test_falcon_h1_mixer_options_are_read_and_layers_without_mlp_refused():
    """Falcon-H1's gated norm: none (mamba_rms_norm false), before or after the gate; mamba_d_ssm absent is the
    config class's 1024 channels, null mamba_expand x hidden_size; `mamba_use_mlp` false refused by name."""
    import transformers

    from tiny_models import COMMON

    data = transformers.FalconH1Config(**COMMON, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_state=8).to_dict()
    data["architectures"] = ["FalconH1ForCausalLM"]
    assert ModelConfig.from_hf(data).mamba_norm == "gate"
    for before, norm in ((True, "norm_gate"), (False, "gate_norm")):
        config = ModelConfig.from_hf({**data, "mamba_rms_norm": True, "mamba_norm_before_gate": before})
        assert config.mamba_norm == norm and config.mamba_n_heads * config.mamba_d_head == 64
    widths = {key: ModelConfig.from_hf({**data, "mamba_d_ssm": key, "mamba_d_head": "auto"}) for key in (None, 256)}
    assert [c.mamba_n_heads * c.mamba_d_head for c in widths.values()] == [2 * 64, 256]
    absent = {k: v for k, v in data.items() if k not in ("mamba_d_ssm", "mamba_d_head", "mamba_n_heads")}
    assert ModelConfig.from_hf(absent).mamba_n_heads * ModelConfig.from_hf(absent).mamba_d_head == 1024
    with pytest.raises(ConfigError, match="mamba_use_mlp"):
        ModelConfig.from_hf({**data, "mamba_use_mlp": False})


@pytest.mark.parametrize("name", ["gemma4-moe", "gemma4-e"])
def test_gemma4_multimodal_release_is_read_on_text(tmp_path, name):
    """Gemma 4's releases are `Gemma4ForConditionalGeneration`: the text config under `text_config`, the decoder under
    `model.language_model.`, the vision tower unread; transformers' logits on text."""
    import transformers

    from keel.quant.loading import load_model
    from tiny_models import COMMON, TINY_CONFIGS

    text = {**COMMON, **TINY_CONFIGS[name][2]}
    vision = dict(hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, head_dim=16)
    torch.manual_seed(0)
    config = transformers.Gemma4Config(text_config=text, vision_config=vision)
    hf = transformers.Gemma4ForConditionalGeneration(config).eval()
    hf.save_pretrained(tmp_path)
    tokens = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, ours = hf(input_ids=tokens).logits, load_model(tmp_path, "float32").model(tokens)
    assert ((ours - want).abs().max() / want.abs().max()).item() < 1e-5


def test_gemma3n_multimodal_release_is_read_on_text(tmp_path):
    """Gemma 3n's releases are `Gemma3nForConditionalGeneration`: the text config under `text_config`, the decoder
    under `model.language_model.`, the vision and audio towers and their embedders unread; the text model's logits.
    (The checkpoint is written by hand in that layout: transformers builds the vision tower with timm, which the
    test environment lacks.)"""
    import transformers
    from safetensors.torch import save_file

    from keel.quant.loading import load_model
    from tiny_models import COMMON, TINY_CONFIGS, build_hf_model

    hf = build_hf_model("gemma3n")
    config = transformers.Gemma3nConfig(text_config={**COMMON, **TINY_CONFIGS["gemma3n"][2]}).to_dict()
    config["architectures"] = ["Gemma3nForConditionalGeneration"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    tensors = {
        f"model.language_model.{n[len('model.') :]}": t for n, t in hf.state_dict().items() if n != "lm_head.weight"
    }
    tensors["model.embed_audio.embedding.weight"] = torch.randn(8, 64)
    tensors["model.vision_tower.timm_model.conv_stem.conv.weight"] = torch.randn(4, 3, 3, 3)
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(tmp_path / "model.safetensors"))
    tokens = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, ours = hf(tokens).logits, load_model(tmp_path, "float32").model(tokens)
    assert ((ours - want).abs().max() / want.abs().max()).item() < 1e-5


@pytest.mark.parametrize(
    "key, value, message",
    [
        (
            "intermediate_size",
            [96, 96, 96, 96, 128],
            "intermediate_size: MLPs of different widths per layer",
        ),
        ("activation_sparsity_pattern", [0.5, 0.5], "activation_sparsity_pattern"),
        ("altup_active_idx", 3, "altup_active_idx"),
    ],
)
def test_gemma3n_refuses_what_it_cannot_run_by_name(tmp_path, key, value, message):
    save_hf_model("gemma3n", tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf({**data, key: value}, source="config.json")


def test_gemma3n_refuses_training_parallelism_and_the_compiled_step(tmp_path):
    """AltUp's model is not trained (transformers clips its coefficients in training), its stream's copies cross no
    pipeline stage, AltUp and LAuReL are not cut by tensor parallelism, and the compiled decode step steps aside."""
    from keel.errors import KeelError
    from keel.model.stages import split_stage
    from keel.model.transformer import build_model
    from keel.serve.compiled_decode import compile_unsupported
    from keel.serve.parallel.load import check_parallel_model
    from keel.train import config as train_config

    save_hf_model("gemma3n", tmp_path)
    config = ModelConfig.from_json_file(tmp_path / "config.json")
    cfg = SimpleNamespace(parallel=train_config.ParallelSection(), moe=train_config.MoESection())
    with pytest.raises(ConfigError, match="altup_coef_clip"):
        train_config._check_model_fits(cfg, config, 1, lambda message: ConfigError(message))
    plain = dataclasses.replace(config, per_layer_input_size=0, kv_shared_layers=0)
    with pytest.raises(ValueError, match="AltUp"):
        split_stage(build_model(plain), 0, 2)
    with pytest.raises(KeelError, match="altup_num_inputs, laurel_rank"):
        check_parallel_model(plain, tmp_path, 2, 1)
    laurel_only = dataclasses.replace(plain, altup_num_inputs=0)
    cfg = SimpleNamespace(parallel=train_config.ParallelSection(tp=2), moe=train_config.MoESection())
    with pytest.raises(ConfigError, match="laurel_rank"):
        train_config._check_model_fits(cfg, laurel_only, 1, lambda message: ConfigError(message))
    # the sparse gates' cut-off reads the mean and spread of the gate's whole width, which a rank holds a share of
    sparse_only = dataclasses.replace(laurel_only, laurel_rank=0)
    assert any(sparse_only.activation_sparsity)
    with pytest.raises(KeelError, match="activation_sparsity"):
        check_parallel_model(sparse_only, tmp_path, 2, 1)
    with pytest.raises(ConfigError, match="activation sparsity"):
        train_config._check_model_fits(cfg, sparse_only, 1, lambda message: ConfigError(message))
    assert compile_unsupported(build_model(plain), SimpleNamespace()) == "AltUp (altup_num_inputs)"


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("use_bidirectional_attention", "vision", "use_bidirectional_attention"),
        ("enable_moe_block", True, "use_double_wide_mlp"),  # the MoE block's MLP doubled in the shared layers
        ("per_layer_config", {"2": {"head_dim": 32, "intermediate_size": 8}}, "per_layer_config"),
        ("per_layer_config", {"0": {"head_dim": 32}, "2": {"head_dim": 32}}, "per_layer_config"),
    ],
)
def test_gemma4_refuses_what_it_cannot_run_by_name(tmp_path, key, value, message):
    save_hf_model("gemma4-e", tmp_path)  # KV sharing with use_double_wide_mlp
    data = json.loads((tmp_path / "config.json").read_text())
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf({**data, key: value}, source="config.json")


@pytest.mark.parametrize("name", ["gemma4", "gemma4-moe"])
def test_gemma4_refuses_tensor_parallelism(tmp_path, name):
    """The full-attention layers' own head width (and the MoE block's branch norms, over a branch's whole output):
    neither serving nor training cuts them over tensor-parallel ranks; pipeline stages cut whole layers."""
    from keel.errors import KeelError
    from keel.serve.parallel.load import check_parallel_model
    from keel.train import config as train_config

    save_hf_model(name, tmp_path)
    config = ModelConfig.from_json_file(tmp_path / "config.json")
    with pytest.raises(KeelError, match="global_head_dim"):
        check_parallel_model(config, tmp_path, 2, 1)
    check_parallel_model(config, tmp_path, 1, 2)
    cfg = SimpleNamespace(parallel=train_config.ParallelSection(tp=2), moe=train_config.MoESection())
    with pytest.raises(ConfigError, match="own geometry"):
        train_config._check_model_fits(cfg, config, 1, lambda message: ConfigError(message))
    if name == "gemma4-moe":  # a uniform geometry still leaves the branch norms
        uniform = dataclasses.replace(config, global_head_dim=0)
        with pytest.raises(KeelError, match="branch norms"):
            check_parallel_model(uniform, tmp_path, 2, 1)


def test_gemma4_e_refuses_tensor_parallelism_and_split_kv_sharing(tmp_path):
    """E2B/E4B: tensor parallelism cuts neither the per-layer inputs nor the layers sharing K/V; a pipeline
    stage cannot hold a layer without the one whose keys and values it attends over, nor the per-layer inputs."""
    from keel.errors import KeelError
    from keel.model.stages import split_stage
    from keel.model.transformer import build_model
    from keel.serve.parallel.load import check_parallel_model
    from keel.train import config as train_config

    save_hf_model("gemma4-e", tmp_path)
    config = dataclasses.replace(ModelConfig.from_json_file(tmp_path / "config.json"), global_head_dim=0)
    with pytest.raises(KeelError, match="kv_shared_layers"):
        check_parallel_model(config, tmp_path, 2, 1)
    with pytest.raises(KeelError, match="per_layer_input_size"):
        check_parallel_model(dataclasses.replace(config, kv_shared_layers=0, kv_shared_mlp_factor=1), tmp_path, 2, 1)
    cfg = SimpleNamespace(parallel=train_config.ParallelSection(tp=2), moe=train_config.MoESection())
    with pytest.raises(ConfigError, match="kv_shared_layers"):
        train_config._check_model_fits(cfg, config, 1, lambda message: ConfigError(message))
    with pytest.raises(ValueError, match="per-layer inputs"):
        split_stage(build_model(config), 0, 2)
    with pytest.raises(ValueError, match="kv_shared_layers"):  # layers 3 and 4 without 1 and 2
        split_stage(build_model(dataclasses.replace(config, per_layer_input_size=0)), 1, 2)


def test_flint_takes_its_config_classs_layer_rules_where_a_file_has_none():
    """Flint's config class makes the first two layers, every fourth from layer 1 and the last full attention (those
    without position encoding) and the first two dense; a file without layer_types or mlp_only_layers reads them so."""
    import transformers

    hf = {"architectures": ["FlintForCausalLM"], "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 256}
    hf.update(num_hidden_layers=11, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2)
    config = ModelConfig.from_hf(hf)
    reference = transformers.FlintConfig(**{k: v for k, v in hf.items() if k != "architectures"})
    assert config.layer_types == reference.layer_types and config.mlp_only_layers == reference.mlp_only_layers == [0, 1]
    assert config.rope_layers == [kind == "sliding_attention" for kind in reference.layer_types]
    assert config.sliding_window == reference.sliding_window and not config.shared_expert_gated
    assert ModelConfig.from_hf(config.to_hf()) == config
    with pytest.raises(ConfigError, match="layer_types"):
        ModelConfig.from_hf({**hf, "layer_types": ["chunked_attention"] * 11})


def test_lfm3_takes_its_config_classs_layers_and_ropes_where_a_file_has_none():
    """LFM3's config class makes layer 2 of every four full attention, layer 0 of every four after the first sliding
    and the rest convolutions, with a rope per attention kind; a file without them reads them so, and a per-head gate
    without the gate itself is refused."""
    import transformers

    hf = {"architectures": ["Lfm3ForCausalLM"], "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 256}
    hf.update(num_hidden_layers=9, num_key_value_heads=2, head_dim=16, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    config = ModelConfig.from_hf(hf)
    reference = transformers.Lfm3Config(**{k: v for k, v in hf.items() if k != "architectures"})
    assert config.layer_types == reference.layer_types and config.sliding_window == reference.sliding_window
    full, sliding = reference.rope_parameters["full_attention"], reference.rope_parameters["sliding_attention"]
    assert (config.rope_theta, config.rope_scaling.type, config.rope_scaling.rotated_share) == (
        full["rope_theta"],
        full["rope_type"],
        full["partial_rotary_factor"],
    )
    assert (config.sliding_rope_theta, config.sliding_rope_scaling.type) == (sliding["rope_theta"], "default")
    assert config.attention_gate_per_head and config.norm_placement == "sandwich"
    assert ModelConfig.from_hf(config.to_hf()) == config
    with pytest.raises(ConfigError, match="attention_gate_per_head"):
        dataclasses.replace(config, attention_output_gate=False)


def test_axk1_reads_its_releases_without_the_selection_bias_and_its_legacy_layer_keys(tmp_path):
    """A.X-K1's releases store no router selection bias (transformers leaves it at zero) and an unused output norm in
    the dense layers; their configs give DeepSeek's first_k_dense_replace / moe_layer_freq, not mlp_layer_types."""
    import transformers
    from safetensors.torch import load_file, save_file

    from keel.quant.loading import load_model

    save_hf_model("axk1", tmp_path)
    path = tmp_path / "model.safetensors"
    tensors = {k: v for k, v in load_file(path).items() if not k.endswith("e_score_correction_bias")}
    tensors["model.layers.0.post_mlp_layernorm.weight"] = torch.full((64,), 3.0)  # a dense layer's: unread
    save_file(tensors, path, metadata={"format": "pt"})
    data = json.loads((tmp_path / "config.json").read_text())
    del data["mlp_layer_types"]
    data.update(first_k_dense_replace=1, moe_layer_freq=2)
    (tmp_path / "config.json").write_text(json.dumps(data))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert hf.config.mlp_layer_types == ["dense", "dense", "sparse", "dense"]
    loaded = load_model(tmp_path, "float32")
    assert loaded.model.config.mlp_only_layers == [0, 1, 3]
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref, ours = hf(tokens).logits, loaded.model(tokens)
    assert ((ours - ref).abs().max() / ref.abs().max()).item() < 1e-4
    with pytest.raises(ConfigError, match="q_lora_rank"):
        ModelConfig.from_hf({**data, "q_lora_rank": None})
    from keel.errors import KeelError
    from keel.weights.shard import TensorParallelLayout

    with pytest.raises(KeelError, match="moe_output_norm"):  # a rank holds a partial sum of the normed output
        TensorParallelLayout(loaded.model.config, tp=2, rank=0)


def test_laguna_reads_its_config_classs_defaults_and_refuses_what_it_cannot_run(tmp_path):
    """Laguna's config class makes every layer full attention rotating half of each head, the first layer dense;
    a head count per layer and router weights on the experts' input are refused by name."""
    import transformers

    hf = {"architectures": ["LagunaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 256}
    hf.update(num_hidden_layers=3, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2)
    config = ModelConfig.from_hf(hf)
    reference = transformers.LagunaConfig(**{k: v for k, v in hf.items() if k != "architectures"})
    assert config.layer_types == reference.layer_types and config.rotary_dim == 8
    assert config.rope_theta == reference.rope_parameters["full_attention"]["rope_theta"]
    assert config.mlp_only_layers == [0] and reference.mlp_layer_types[0] == "dense"
    assert config.attention_gate_per_head and config.attention_gate_activation == "softplus"
    assert ModelConfig.from_hf(config.to_hf()) == config
    for key, value in (("num_attention_heads_per_layer", [4, 2, 4]), ("moe_apply_router_weight_on_input", True)):
        with pytest.raises(ConfigError, match=key):
            ModelConfig.from_hf({**hf, key: value})
    assert ModelConfig.from_hf({**hf, "num_attention_heads_per_layer": [4, 4, 4]}) == config
    with pytest.raises(ConfigError, match="sliding_partial_rotary_factor"):  # a share without the sliding RoPE
        dataclasses.replace(config, sliding_rope_theta=None, sliding_partial_rotary_factor=0.5)


def test_mimo_v2_flash_reads_its_config_classs_defaults_and_refuses_what_it_cannot_run():
    """MiMo-V2-Flash's config class makes the first and every sixth layer full attention (the others sliding, with
    twice the KV heads and sinks), rotating a third of each head (0.334) at 5e6 / 1e4, values 128 wide beside 192-wide
    heads times 0.707, the first layer dense; layer kinds other than sliding / full are refused by name."""
    import transformers

    hf = {"architectures": ["MiMoV2FlashForCausalLM"], "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 256}
    hf.update(num_hidden_layers=7, num_key_value_heads=1, n_routed_experts=8, num_experts_per_tok=2)
    config = ModelConfig.from_hf(hf)
    reference = transformers.MiMoV2FlashConfig(**{k: v for k, v in hf.items() if k != "architectures"})
    assert config.layer_types == reference.layer_types and config.layer_types[0] == config.layer_types[5]
    assert [config.layer_num_kv_heads(i) for i in (0, 1, 5)] == [1, 2, 1]
    assert [config.layer_has_sinks(i) for i in (0, 1, 5)] == [False, True, False]
    assert (config.head_dim, config.layer_v_head_dim(1), config.attention_value_scale) == (192, 128, 0.707)
    assert config.rotary_dim == config.sliding_rotary_dim == 64  # int(192 x 0.334)
    assert (config.rope_theta, config.sliding_rope_theta) == (5e6, 1e4)
    assert config.mlp_only_layers == [0] and config.shared_expert_intermediate_size == 0
    assert ModelConfig.from_hf(config.to_hf()) == config
    with pytest.raises(ConfigError, match="layer_types"):
        ModelConfig.from_hf({**hf, "layer_types": ["chunked_attention"] * 7})
    with pytest.raises(ConfigError, match="attention_sinks_sliding_only"):
        dataclasses.replace(config, attention_sinks=False)


def _apertus1p5_release(path):
    """A tiny `Apertus1p5ForConditionalGeneration` as released: its head pruned to the first 200 of 256 ids (the
    image and audio codes' rows of the embedding beyond), untied, with small vision and audio tokenizers."""
    import transformers

    from tiny_models import COMMON, TINY_CONFIGS

    text = {**COMMON, **TINY_CONFIGS["apertus1p5"][2], "output_vocab_size": 200, "tie_word_embeddings": False}
    vision = dict(
        codebook_size=16,
        embed_dim=32,
        latent_channels=32,
        base_channels=32,
        channel_multiplier=[1, 2],
        num_res_blocks=1,
        attn_resolutions=[],
    )
    audio = dict(model_type="wavtokenizer_encoder", codebook_size=16, codebook_dim=8, hidden_size=8, num_filters=4)
    config = transformers.Apertus1p5Config(
        text_config=text,
        vision_config=vision,
        audio_config={**audio, "num_lstm_layers": 1, "upsampling_ratios": [2, 2]},
        image_token_offset=200,
        audio_token_offset=216,
        image_token_id=3,
        audio_token_id=4,
    )
    torch.manual_seed(0)
    hf = transformers.Apertus1p5ForConditionalGeneration(config).eval()
    with torch.no_grad():  # norms and biases off their initial values, so that they count
        for name, p in hf.named_parameters():
            if name.endswith(("norm.weight", ".bias")) and "language_model" in name:
                p.add_(torch.randn_like(p) * 0.1)
    hf.save_pretrained(path)
    return hf


def test_apertus1p5_release_is_read_on_text_with_its_pruned_head(tmp_path):
    """Apertus 1.5's releases are `Apertus1p5ForConditionalGeneration` with the LM head pruned to `output_vocab_size`
    ids: keel reads the decoder on text, its vocabulary the head's (the embedding's rows beyond unread), and gives
    transformers' logits; `keel convert` writes that text model, which transformers loads to the same logits."""
    from keel.weights.convert import convert

    hf = _apertus1p5_release(tmp_path / "src")
    config = ModelConfig.from_json_file(tmp_path / "src" / "config.json")
    assert config.architecture == "apertus1p5" and config.vocab_size == 200
    tokens = torch.randint(0, 200, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, ours = hf(input_ids=tokens).logits, load_model(tmp_path / "src", "float32").model(tokens)
    assert ours.shape == want.shape == (2, 20, 200)
    assert ((ours - want).abs().max() / want.abs().max()).item() < 1e-5

    import transformers

    convert(tmp_path / "src", tmp_path / "dst")
    text = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "dst").eval()
    assert type(text).__name__ == "Apertus1p5TextForCausalLM" and text.config.vocab_size == 200
    with torch.no_grad():
        assert ((text(tokens).logits - want).abs().max() / want.abs().max()).item() < 1e-5


@pytest.mark.parametrize(
    "extra, message",
    [
        (dict(output_vocab_size=200, tie_word_embeddings=True), "tie_word_embeddings"),
        (dict(output_vocab_size=300), "output_vocab_size"),
    ],
)
def test_apertus1p5_refuses_what_it_cannot_run_by_name(tmp_path, extra, message):
    save_hf_model("apertus1p5", tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf({**data, **extra}, source="config.json")


def test_gemma4_unified_release_is_read_on_text(tmp_path):
    """Gemma 4 unified's releases are `Gemma4UnifiedForConditionalGeneration`: the decoder under
    `model.language_model.`, the vision embedder unread; causal on text (its default use_bidirectional_attention
    "vision" only opens image tokens both ways); transformers' logits."""
    import transformers

    from tiny_models import COMMON, TINY_CONFIGS

    text = {**COMMON, **TINY_CONFIGS["gemma4_unified"][2]}
    vision = dict(mm_embed_dim=32, output_proj_dims=64, mm_posemb_size=8, patch_size=4, pooling_kernel_size=1)
    torch.manual_seed(0)
    config = transformers.Gemma4UnifiedConfig(text_config=text, vision_config=vision, audio_config=None)
    assert config.text_config.use_bidirectional_attention == "vision"
    hf = transformers.Gemma4UnifiedForConditionalGeneration(config).eval()
    hf.save_pretrained(tmp_path)
    keel = ModelConfig.from_json_file(tmp_path / "config.json")
    assert keel.architecture == "gemma4_unified" and keel.per_layer_input_size == 0 and keel.kv_shared_layers == 2
    tokens = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, ours = hf(input_ids=tokens).logits, load_model(tmp_path, "float32").model(tokens)
    assert ((ours - want).abs().max() / want.abs().max()).item() < 1e-5


def test_gemma4_unified_refuses_bidirectional_text_by_name(tmp_path):
    save_hf_model("gemma4_unified", tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    assert ModelConfig.from_hf({**data, "use_bidirectional_attention": None}) == ModelConfig.from_hf(data)
    with pytest.raises(ConfigError, match="use_bidirectional_attention 'all'"):
        ModelConfig.from_hf({**data, "use_bidirectional_attention": "all"}, source="config.json")


@pytest.mark.parametrize(
    "extra, message", [(dict(rotary_dim=None), "rotary_dim"), (dict(n_embd=66, n_head=6), "hidden_size 66")]
)
def test_codegen_refuses_what_it_cannot_run_by_name(tmp_path, extra, message):
    save_hf_model("codegen", tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf({**data, **extra}, source="config.json")


def test_gpt_neox_japanese_reads_its_release_config_as_transformers():
    """abeja/gpt-neox-japanese-2.7b's config.json (its rotary under `rotary_pct` / `rotary_emb_base`, no
    rope_parameters, the MLP width as `intermediate_multiple_size`); the head tied where the file says nothing, as
    the config class's default; the last layer's attention output bias alone; the export read back the same."""
    import transformers

    data = dict(
        architectures=["GPTNeoXJapaneseForCausalLM"],
        model_type="gpt_neox_japanese",
        hidden_size=2560,
        num_hidden_layers=32,
        num_attention_heads=32,
        intermediate_multiple_size=4,
        rotary_pct=0.5,
        rotary_emb_base=20000,
        layer_norm_eps=1e-5,
        vocab_size=32000,
    )
    config = ModelConfig.from_hf(data)
    want = transformers.GPTNeoXJapaneseConfig(**{k: v for k, v in data.items() if k != "architectures"})
    assert config.intermediate_size == 10240 and config.head_dim == 80 and config.num_kv_heads == 32
    assert config.partial_rotary_factor == want.rope_parameters["partial_rotary_factor"] == 0.5
    assert config.rope_theta == want.rope_parameters["rope_theta"] == 20000
    assert config.tie_word_embeddings == want.tie_word_embeddings is True
    assert (config.o_bias, config.o_bias_layers, config.parallel_residual) == (False, [31], False)
    assert ModelConfig.from_hf(config.to_hf()) == config


def test_o_bias_layers_out_of_range_are_refused_by_name():
    config = ModelConfig.from_hf(
        dict(architectures=["GPTNeoXJapaneseForCausalLM"], hidden_size=64, num_hidden_layers=2, vocab_size=256)
    )
    with pytest.raises(ConfigError, match="o_bias_layers"):
        dataclasses.replace(config, o_bias_layers=[2]).validate()
    # a layer without attention has no o_proj to give a bias: refused, not dropped
    with pytest.raises(ConfigError, match="o_bias_layers must name attention layers"):
        dataclasses.replace(config, layer_types=["mamba", "full_attention"], o_bias_layers=[0]).validate()
    with pytest.raises(ConfigError, match="o_bias_layers"):
        dataclasses.replace(config, o_bias=True).to_hf()


def test_zamba2_shared_blocks_are_copies_read_once_and_written_once(tmp_path):
    """Zamba 2's shared block is read into each hybrid layer of its turn (blocks 0, 1, 0 in the tiny model's hybrid
    layers 1, 3 and 4); keel_to_hf writes each block once, and refuses copies that differ (trained apart)."""
    from keel.errors import WeightsError
    from keel.weights.names import keel_to_hf

    save_hf_model("zamba2", tmp_path)
    model = load_model(tmp_path, "float32").model
    config = model.config
    assert config.shared_block_layers() == [[1, 4], [3]]
    q = {i: model.layers[str(i)].self_attn.q_proj.weight for i in (1, 3, 4)}
    assert torch.equal(q[1], q[4]) and q[1] is not q[4] and not torch.equal(q[1], q[3])
    stored = SafetensorsReader(tmp_path)
    out = keel_to_hf(config, model.state_dict().items())
    assert sorted(out) == sorted(n for n in stored.names())
    for name in out:
        assert torch.equal(out[name], stored.get(name)), name
    # (in the checkpoint's dtype the copies share the file's mapped bytes: one of them made apart)
    weight = model.layers["4"].mlp.down_proj.weight
    weight.data = weight.data + 1e-3
    with pytest.raises(WeightsError, match="shared_transformer.feed_forward.down_proj.weight: keel's copies"):
        keel_to_hf(config, model.state_dict().items())


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"use_shared_attention_adapter": True, "num_key_value_heads": 1}, "use_shared_attention_adapter"),
        ({"rms_norm_eps": 1e-6}, "rms_norm_eps"),
        ({"tie_word_embeddings": False, "num_mem_blocks": 1}, "tie_word_embeddings false"),
        ({"layers_block_type": ["mamba", "attention", "hybrid"]}, "layers_block_type"),
    ],
)
def test_zamba2_configs_keel_cannot_run_are_refused_by_name(overrides, message):
    import transformers

    data = transformers.Zamba2Config(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=3,
        num_attention_heads=2,
        intermediate_size=64,
        n_mamba_heads=2,
        mamba_d_state=8,
        layers_block_type=["mamba", "hybrid", "hybrid"],
        adapter_rank=4,
    ).to_dict()
    data["architectures"] = ["Zamba2ForCausalLM"]
    assert ModelConfig.from_hf(data).shared_block_layers() == [[1, 2]]
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf({**data, **overrides})


def test_shared_block_fields_need_zamba2s_hybrid_block():
    """The shared blocks' fields mean nothing beside Falcon-H1's hybrid layers, and need adapters and blocks."""
    base = dict(
        architecture="zamba2", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
        num_kv_heads=2, head_dim=32, layer_types=["mamba", "hybrid"], mlp_layers=[False, True], mamba_n_heads=2,
        mamba_d_head=32, mamba_d_state=8,
    )  # fmt: skip
    ModelConfig(**base, hybrid_block="shared", shared_blocks=1, adapter_rank=4).validate()
    for fields, message in (
        ({"shared_blocks": 1}, "need hybrid_block 'shared'"),
        ({"hybrid_block": "shared", "adapter_rank": 4}, "shared_blocks >= 1"),
        ({"hybrid_block": "shared", "shared_blocks": 1}, "adapter_rank > 0"),
        ({"hybrid_block": "serial"}, "hybrid_block 'serial'"),
    ):
        with pytest.raises(ConfigError, match=message):
            ModelConfig(**base, **fields).validate()


def test_jetmoe_reads_its_config_classs_derived_keys_and_refuses_what_it_cannot_run(tmp_path):
    """JetMoE's config class derives the query heads (num_key_value_heads x top-k) and takes kv_channels as the head
    width (128 by default), ties the head by default; the file's eps is the final norm's (its layers' are 1e-6);
    attention experts beside options they do not read, and tensor or expert parallelism are refused by name."""
    import transformers

    from keel.errors import KeelError
    from keel.serve.parallel.load import check_parallel_model
    from keel.train import config as train_config

    hf = {"architectures": ["JetMoeForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 256}
    hf.update(num_key_value_heads=2, num_experts_per_tok=3, num_local_experts=4)
    config = ModelConfig.from_hf(hf)
    reference = transformers.JetMoeConfig(**{k: v for k, v in hf.items() if k != "architectures"})
    assert (config.num_heads, config.num_kv_heads) == (reference.num_attention_heads, 2) == (6, 2)
    assert config.head_dim == reference.kv_channels == 128 and config.tie_word_embeddings
    assert config.mixture_of_attention and config.o_bias and config.moe_output_bias
    assert ModelConfig.from_hf(config.to_hf()) == config
    wide = ModelConfig.from_hf({**hf, "rms_norm_eps": 1e-5})
    assert (wide.rms_norm_eps, wide.final_norm_eps) == (1e-6, 1e-5) and ModelConfig.from_hf(wide.to_hf()) == wide
    with pytest.raises(ConfigError, match="qkv_bias"):
        dataclasses.replace(config, qkv_bias=True)
    # (keel.model.moa projects its own values and orders its heads kv-head-major: neither would be read)
    with pytest.raises(ConfigError, match="attention_value_scale is not read by mixture_of_attention"):
        dataclasses.replace(config, attention_value_scale=0.5)
    with pytest.raises(ConfigError, match="position_embedding alibi is not read by mixture_of_attention"):
        dataclasses.replace(config, position_embedding="alibi")
    with pytest.raises(ConfigError, match="num_experts_per_tok"):
        dataclasses.replace(config, num_heads=4)
    save_hf_model("jetmoe", tmp_path)
    config = ModelConfig.from_json_file(tmp_path / "config.json")
    with pytest.raises(KeelError, match="mixture_of_attention"):
        check_parallel_model(config, tmp_path, 2, 1)
    check_parallel_model(config, tmp_path, 1, 2)  # pipeline stages cut whole layers
    for parallel in (train_config.ParallelSection(tp=2), train_config.ParallelSection(ep=2)):
        cfg = SimpleNamespace(parallel=parallel, moe=train_config.MoESection())
        with pytest.raises(ConfigError, match="mixture_of_attention"):
            train_config._check_model_fits(cfg, config, 1, lambda message: ConfigError(message))


def test_jetmoe_final_norm_takes_the_files_eps_and_its_layers_1e_6(tmp_path):
    """transformers' JetMoE builds its layers' norms at 1e-6 and the final norm alone at rms_norm_eps: a large eps
    shows in the logits, which match transformers'."""
    hf = save_hf_model("jetmoe", tmp_path, rms_norm_eps=0.5)
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    model = load_model(tmp_path, "float32").model
    with torch.no_grad():
        ref, ours = hf(tokens).logits, model(tokens)
    assert ((ours - ref).abs().max() / ref.abs().max()).item() < 1e-4
    assert model.norm.eps == 0.5 and model.layers["0"].input_layernorm.eps == 1e-6


def test_jetmoe_trains_from_the_layout_independent_initialisation(tmp_path):
    """Built on the meta device for training, JetMoE's attention experts and output biases have initialisation rules
    (keel.model.seeded_init: normal experts, zero biases), and a loss's gradient reaches every one of them."""
    from keel.model.seeded_init import init_weights_seeded, materialize
    from keel.model.transformer import Transformer

    save_hf_model("jetmoe", tmp_path)
    config = ModelConfig.from_json_file(tmp_path / "config.json")
    with torch.device("meta"):
        model = Transformer(config)
    materialize(model, "cpu", lambda m: init_weights_seeded(m, 0))  # the buffers (rotary's) recomputed too
    attention, mlp = model.layers["0"].self_attn, model.layers["0"].mlp
    assert attention.q_experts.std().item() == pytest.approx(0.02, rel=0.2)
    assert not attention.output_bias.any() and not mlp.output_bias.any()
    model(torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))).logsumexp(-1).mean().backward()
    for param in (attention.q_experts, attention.o_experts, attention.router.weight, attention.output_bias):
        assert param.grad.abs().sum() > 0
    assert mlp.output_bias.grad.abs().sum() > 0
