"""Structure from shapes: a directory of safetensors without config.json opens as the same model."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from safetensors.torch import load_file, save_file

from keel.config import ModelConfig
from keel.errors import ConfigError
from keel.model.transformer import Transformer
from keel.quant.loading import load_model
from keel.weights.infer import _sparse_pattern
from keel.weights.loader import load_weights, open_checkpoint
from keel.weights.names import hf_source
from tiny_models import TINY_CONFIGS, build_hf_model, save_hf_model

# Written out here rather than imported, so the test pins down the contract of infer_config.
UNRECOVERABLE = {
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "max_position_embeddings",
    "sliding_window",
    "layer_types",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
}
# Defaulted fields that change the logits (bos/eos/max_position_embeddings do not).
NUMERIC = {
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "sliding_window",
    "layer_types",
    "norm_topk_prob",
    "num_experts_per_tok",
}
# Tiny configs whose unrecoverable values are the family defaults, so that the inferred config alone
# reproduces transformers. The others set rope scaling (llama3-rope, llama-linear-rope), a sliding
# window (mistral, qwen2-sliding, mixtral), norm_topk_prob=True (qwen3_moe; Qwen's default is False) or
# top-2 routing (qwen2_moe; transformers' Qwen2-MoE default is top-4):
# no tensor records those, so there the logits legitimately differ and only the fields are compared
# (plus logits with the unrecoverable values taken from config.json, which checks the structure).
DEFAULTS_COINCIDE = {"llama", "llama-bias", "qwen2", "qwen3"}

TOKENS = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))  # longer than the windows


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def _expected_defaults(read: ModelConfig) -> set[str]:
    expected = set(UNRECOVERABLE)
    if read.is_moe:
        expected |= {"num_experts_per_tok", "norm_topk_prob"}
        if read.architecture != "mixtral" and all(read.is_moe_layer(i) for i in range(read.num_layers)):
            expected.add("intermediate_size")  # no dense layer shows the dense width
    if read.architecture in ("llama", "mistral") and not (read.qkv_bias or read.mlp_bias):
        expected.add("architecture")  # Llama and Mistral weights look alike
    return expected


def _keel_logits(checkpoint, config: ModelConfig) -> torch.Tensor:
    with torch.device("meta"):
        net = Transformer(config)
    load_weights(net, dataclasses.replace(checkpoint, config=config), torch.float32)
    net.reset_buffers("cpu")
    with torch.no_grad():
        return net.eval()(TOKENS)


# Multi-head latent attention (DeepSeek) needs its config.json: see test_mla_needs_config_json. Granite's
# multipliers are scalars no tensor shape holds. The families of keel.families (keel.families.FAMILIES) are read
# through their config.json: inference from shapes knows Llama's names and block only (SmolLM3's tensors are
# Llama's, with biases, and Ministral 3's are Mistral's: which layers rotate, or the queries' temperature, no
# shape tells).
SHAPE_INFERABLE = [
    name
    for name in TINY_CONFIGS
    # MiniMax: its lightning layers and residual factors (normed_residual's alphas and betas) no shape tells
    if name != "minimax"
    # RecurrentGemma: its recurrent blocks, window, soft cap and bfloat16-rounded embedding scale under its own names
    and name != "recurrent_gemma"
    and not name.startswith(
        (
            "deepseek",
            "granite",
            "phi",  # phi and phi3
            "stablelm",
            "gpt_neox",
            "persimmon",  # GPT-NeoX's fused q/k/v under its own names
            "gpt_bigcode",  # and gpt2: learned positions and fused, Conv1D tensors under their own names
            "gpt2",
            "falcon",
            "gptj",  # its own names, the rotary width from rotary_dim
            "codegen",  # and its q/v/k fused in 4 shards
            "opt",  # learned positions under its own names
            "gpt_neo",  # and its global / local layers from attention_types
            "bloom",  # ALiBi and the embedding's norm under its own names
            "mpt",  # ALiBi, fused q/k/v under its own names
            "xglm",  # sinusoidal positions, fc1 / fc2 under its own names
            "biogpt",  # learned positions, its own names
            "olmo",
            "gemma",
            "smollm3",
            "exaone",
            "starcoder2",
            "glm",  # glm and glm4*
            "ministral",  # and ministral3
            "cohere",
            "seed_oss",
            "ernie4_5",
            "arcee",
            "gpt_oss",
            "dots1",
            "llama4",
            "solar_open",
            "glm4_moe_lite",
            "mistral4",
            "minimax_m2",
            "exaone_moe",
            "hunyuan",
            "cwm",
            "helium",
            "jais2",
            "nemotron",  # and nemotron_h
            "vaultgemma",
            "hyperclovax",
            "youtu",
            "apertus",
            "qwen3_5",  # and qwen3_5_moe
            "qwen3_next",
            "lfm2",
            "bamba",
            "falcon_h1",
            "mamba",  # and mamba2
            "falcon_mamba",
            "jamba",
            "nanochat",
            "flex_olmo",
            "kolibri",
            "iquestcoder",
            "internlm3",
            "mellum",
            "hy_v3",
            "minicpm3",
            "afmoe",
            "sarvam",
            "dbrx",  # its own names, experts fused by rows
            "bitnet",  # its sub-norms are refused by name; ReLU squared, which no shape tells
            "flint",
            "lfm3",
            "axk1",
            "axk2",  # its gated query and norms, read through its config.json
            "laguna",
            "mimo",  # the sliding layers' KV heads and sinks, values narrower than keys
            "kimi_linear",  # its latent attention unrotated, which no shape tells
            "zamba2",  # its shared blocks, adapters and softmax scale, read through its config.json
            "glm_moe_dsa",  # latent attention (deepseek_v32 too, by its prefix) with the indexer's top-k
            "jetmoe",  # attention experts under its own names, read through its config.json
            "bailing_hybrid",  # KDA's safe gate bound and Ling's names, read through its config.json
        )
    )
]


@pytest.mark.parametrize("name", SHAPE_INFERABLE)
def test_config_from_shapes(name, tmp_path):
    hf_model = save_hf_model(name, tmp_path)
    read = ModelConfig.from_json_file(tmp_path / "config.json")
    (tmp_path / "config.json").unlink()
    checkpoint = open_checkpoint(tmp_path, head_dim=None if read.qk_norm else read.head_dim)
    inferred, provenance = checkpoint.config, checkpoint.provenance
    assert checkpoint.format == "hf-shapes"

    assert set(provenance) == set(ModelConfig.__dataclass_fields__)
    assert {f for f, p in provenance.items() if p == "default"} == _expected_defaults(read)
    assert {f for f, p in provenance.items() if p == "hint"} == (set() if read.qk_norm else {"head_dim"})
    for field, how in provenance.items():
        if how != "default":
            assert getattr(inferred, field) == getattr(read, field), field
    assert inferred.architecture == ("llama" if read.architecture == "mistral" else read.architecture)

    with torch.no_grad():
        expected = hf_model(TOKENS).logits
    # The structure is right: with the values shapes cannot give taken from config.json, the
    # inferred config reproduces transformers in every case.
    unrecoverable = {f: getattr(read, f) for f, p in provenance.items() if p == "default"}
    assert _rel_err(_keel_logits(checkpoint, dataclasses.replace(inferred, **unrecoverable)), expected) <= 1e-4

    coincide = all(getattr(inferred, f) == getattr(read, f) for f in NUMERIC if provenance[f] == "default")
    assert coincide == (name in DEFAULTS_COINCIDE)
    if coincide:  # the inferred config alone gives transformers' logits
        assert _rel_err(_keel_logits(checkpoint, inferred), expected) <= 1e-4
    checkpoint.reader.close()


def test_mla_needs_config_json(tmp_path):
    save_hf_model("deepseek_v3-mla", tmp_path)
    (tmp_path / "config.json").unlink()
    with pytest.raises(ConfigError) as info:
        open_checkpoint(tmp_path)
    message = str(info.value)
    assert "\n" not in message and str(tmp_path) in message
    assert "multi-head latent attention" in message and "config.json" in message


@pytest.fixture
def llama_dir(tmp_path):
    save_hf_model("llama", tmp_path)
    (tmp_path / "config.json").unlink()
    return tmp_path


def test_missing_hint_names_the_flags(llama_dir):
    with pytest.raises(ConfigError) as info:
        open_checkpoint(llama_dir)
    message = str(info.value)
    assert "\n" not in message
    assert str(llama_dir) in message and "--head-dim" in message and "--num-heads" in message
    assert "q_proj width 64" in message and "k/v_proj width 32" in message
    assert "2, 4, 8, 16, 32" in message


def test_num_heads_hint(llama_dir):
    checkpoint = open_checkpoint(llama_dir, num_heads=4)
    config, provenance = checkpoint.config, checkpoint.provenance
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (4, 2, 16)
    assert provenance["num_heads"] == "hint" and provenance["head_dim"] == "inferred"
    both = open_checkpoint(llama_dir, head_dim=16, num_heads=4)
    assert both.provenance["num_heads"] == both.provenance["head_dim"] == "hint"


@pytest.mark.parametrize(
    "hints, fragment",
    [
        (dict(head_dim=24), "--head-dim 24 does not divide"),
        (dict(head_dim=64), "--head-dim 64 does not divide"),  # divides q (64) but not k/v (32)
        (dict(num_heads=3), "--num-heads 3 does not divide"),
        (dict(head_dim=16, num_heads=2), "--num-heads 2 x --head-dim 16"),
        (dict(head_dim=0), "--head-dim must be positive"),
    ],
)
def test_wrong_hint(llama_dir, hints, fragment):
    with pytest.raises(ConfigError, match=fragment) as info:
        open_checkpoint(llama_dir, **hints)
    assert str(llama_dir) in str(info.value)


def test_hint_contradicting_q_norm(tmp_path):
    save_hf_model("qwen3", tmp_path)  # head_dim 32, from q_norm
    (tmp_path / "config.json").unlink()
    with pytest.raises(ConfigError, match="contradicts q_norm"):
        open_checkpoint(tmp_path, head_dim=16)
    assert open_checkpoint(tmp_path, head_dim=32).config.num_heads == 4  # an agreeing hint is fine


def test_q_norm_with_a_weight_per_head_is_refused_by_name(tmp_path):
    save_hf_model("cohere-qk-norm", tmp_path)  # q_norm [heads, head_dim]: LayerNorm or RMSNorm, unknown from shapes
    (tmp_path / "config.json").unlink()
    with pytest.raises(ConfigError, match=r"q_norm weight \[4, 16\] \(a weight per head\)"):
        open_checkpoint(tmp_path)


def test_not_a_decoder(tmp_path):
    save_file({"encoder.weight": torch.zeros(4, 4)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ConfigError, match="do not look like a decoder") as info:
        open_checkpoint(tmp_path, head_dim=2)
    assert str(tmp_path) in str(info.value)


def test_unsupported_bias_combination(llama_dir):
    tensors = load_file(str(llama_dir / "model.safetensors"))
    for i in range(3):  # o_proj bias without q/k/v bias: no supported family has that
        tensors[f"model.layers.{i}.self_attn.o_proj.bias"] = torch.zeros(64)
    save_file(tensors, str(llama_dir / "model.safetensors"))
    with pytest.raises(ConfigError, match="no supported architecture"):
        open_checkpoint(llama_dir, head_dim=16)


def test_stacked_experts(tmp_path):
    """transformers-5 in-memory layout (experts.gate_up_proj [E, 2I, H]) infers like the hub layout."""
    save_hf_model("qwen3_moe", tmp_path / "hub")
    loaded = load_model(tmp_path / "hub")
    config = loaded.config
    stacked = {
        f"model.layers.{i}.mlp.experts.{p}" for i in range(config.num_layers) for p in ("gate_up_proj", "down_proj")
    }
    tensors = {
        hf_source(config, name, stacked).names[0]: t.contiguous() for name, t in loaded.model.state_dict().items()
    }
    assert stacked <= set(tensors)
    (tmp_path / "stacked").mkdir()
    save_file(tensors, str(tmp_path / "stacked" / "model.safetensors"))
    inferred = open_checkpoint(tmp_path / "stacked").config
    assert (inferred.num_experts, inferred.moe_intermediate_size, inferred.architecture) == (
        8,
        48,
        "qwen3_moe",
    )
    for field in (
        "num_layers",
        "hidden_size",
        "num_heads",
        "num_kv_heads",
        "head_dim",
        "decoder_sparse_step",
    ):
        assert getattr(inferred, field) == getattr(config, field)


def test_stored_dtype(tmp_path):
    build_hf_model("qwen3").to(torch.bfloat16).save_pretrained(tmp_path)
    (tmp_path / "config.json").unlink()
    checkpoint = open_checkpoint(tmp_path)
    assert checkpoint.config.dtype == "bfloat16" and checkpoint.provenance["dtype"] == "inferred"


def test_sparse_pattern():
    assert _sparse_pattern([0, 2], 3) == (1, [1])  # tiny qwen2_moe: mlp_only_layers=[1]
    assert _sparse_pattern([0, 1, 2], 3) == (1, [])
    assert _sparse_pattern([1, 3], 4) == (2, [])  # every second layer
    assert _sparse_pattern([3], 4) == (4, [])
    assert _sparse_pattern([1, 2, 3], 4) == (1, [0])
