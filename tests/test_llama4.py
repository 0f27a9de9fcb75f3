"""Llama 4's text model (keel.families.llama4) against transformers: each of its block's features is live in the
comparison (dropping any one of them from keel's config moves the logits well past the match), its defaults are
read as transformers reads them, and what keel cannot run is refused by name."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from keel.config import ModelConfig
from keel.errors import ConfigError
from keel.model.transformer import Transformer
from keel.quant.loading import load_model
from tiny_models import save_hf_model

pytest.importorskip("transformers")

TOKENS = torch.randint(0, 256, (2, 30), generator=torch.Generator().manual_seed(0))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def test_each_feature_of_the_block_is_live(tmp_path):
    """The tiny model of tests/tiny_models.py: chunks of 8 over 30 tokens, a NoPE layer whose queries' temperature
    moves every 4 positions, the weightless q/k norm, experts fed their input scaled by the router's sigmoid."""
    hf = save_hf_model("llama4", tmp_path)
    loaded = load_model(tmp_path, "float32")
    with torch.no_grad():
        want = hf(TOKENS).logits
        assert _rel(loaded.model(TOKENS), want) < 1e-5
    config = loaded.model.config
    variants = {
        "no chunks": dict(layer_types=["full_attention"] * config.num_layers),
        "no temperature": dict(query_scale_beta=0.0),
        "temperature at p, not p + 1": dict(query_scale_offset=0),
        "temperature in every layer": dict(query_scale_nope_only=False),
        "no q/k norm": dict(qk_l2_norm=False),
        "weights on the output": dict(router_scales_input=False),
    }
    for name, change in variants.items():
        other = Transformer(dataclasses.replace(config, **change))
        other.load_state_dict(loaded.model.state_dict())
        other.reset_buffers("cpu")
        with torch.no_grad():
            assert _rel(other.eval()(TOKENS), want) > 1e-3, name


def test_defaults_are_read_as_transformers_reads_them(tmp_path):
    """A config.json with the keys a release sets left out: every fourth layer NoPE and global, the others in
    chunks of 8192, experts in every layer, the temperature's 0.1 and 8192; the exported config round-trips."""
    save_hf_model("llama4", tmp_path, num_hidden_layers=8, interleave_moe_layer_step=1)
    path = tmp_path / "config.json"
    hf = json.loads(path.read_text())
    for key in ("no_rope_layers", "layer_types", "moe_layers", "attention_chunk_size", "floor_scale", "attn_scale"):
        hf.pop(key, None)
    config = ModelConfig.from_hf(hf)
    assert [config.layer_rotates(i) for i in range(8)] == [True, True, True, False] * 2
    assert [config.layer_window(i) for i in range(8)] == [-8192, -8192, -8192, None] * 2
    assert [config.is_moe_layer(i) for i in range(8)] == [True] * 8
    assert (config.query_scale_beta, config.query_scale_length, config.query_scale_offset) == (0.1, 8192, 1)
    assert config.qk_l2_norm and config.router_scales_input and not config.shared_expert_gated
    assert ModelConfig.from_hf(config.to_hf()) == config
    hf.update(attn_temperature_tuning=False, use_qk_norm=False, attention_chunk_size=None)
    plain = ModelConfig.from_hf(hf)
    assert (plain.query_scale_beta, plain.qk_l2_norm) == (0.0, False)
    assert [plain.layer_window(i) for i in range(8)] == [None] * 8


def test_more_than_one_expert_a_token_is_refused(tmp_path):
    """transformers' router scales one input per expert slot; keel scales the token's input once: one expert."""
    save_hf_model("llama4", tmp_path)
    hf = json.loads((tmp_path / "config.json").read_text())
    with pytest.raises(ConfigError, match="num_experts_per_tok 2"):
        ModelConfig.from_hf({**hf, "num_experts_per_tok": 2}, "config.json")


def test_the_text_model_of_a_multimodal_checkpoint_is_served(tmp_path):
    """Llama 4's releases are `Llama4ForConditionalGeneration`: keel runs their decoder on text (the config's
    `text_config`, the tensors under `language_model.`, the vision tower's left unread), transformers' logits
    and greedy tokens; exported as the text model it is."""
    import transformers

    from keel.serve import LLM, EngineConfig, SamplingParams
    from keel.weights.convert import convert
    from tiny_models import COMMON, TINY_CONFIGS, save_byte_tokenizer

    text = transformers.Llama4TextConfig(**{**COMMON, **TINY_CONFIGS["llama4"][2], "num_hidden_layers": 2})
    vision = transformers.Llama4VisionConfig(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        vision_output_dim=32,
        projector_input_dim=32,
        projector_output_dim=64,
        image_size=28,
        patch_size=14,
    )
    torch.manual_seed(0)
    config = transformers.Llama4Config(text_config=text.to_dict(), vision_config=vision.to_dict())
    hf = transformers.Llama4ForConditionalGeneration(config).eval()
    hf.save_pretrained(tmp_path / "mm")
    save_byte_tokenizer(tmp_path / "mm")
    loaded = load_model(tmp_path / "mm", "float32")
    assert loaded.model.config.architecture == "llama4" and loaded.model.config.num_layers == 2
    from keel.cli import main as keel_main

    assert keel_main(["inspect", str(tmp_path / "mm")]) == 0  # read as the model keel runs, not refused
    decoder = hf.language_model  # transformers' multimodal forward fails on text alone (image_outputs)
    with torch.no_grad():
        want = decoder(input_ids=TOKENS).logits
        assert _rel(loaded.model(TOKENS), want) < 1e-5
        prompt = TOKENS[:1, :12]
        greedy = decoder.generate(prompt, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    llm = LLM(str(tmp_path / "mm"), EngineConfig.of(dtype="float32", compile=False, max_model_len=64))
    out = llm.generate([prompt[0].tolist()], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert out[0].outputs[0].token_ids == greedy[0, 12:].tolist()
    convert(tmp_path / "mm", tmp_path / "text")
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "text").eval()
    assert type(exported).__name__ == "Llama4ForCausalLM"
    with torch.no_grad():
        assert _rel(exported(TOKENS).logits, want) < 1e-5


def test_a_gguf_file_as_llama_cpps_converter_writes_it(tmp_path):
    """llama.cpp's `llama4`: q/k rows as HF stores them (no permutation), experts split from the transposed
    gate_up, the dense width as feed_forward_length; the chunk, NoPE step, temperature and q/k norm are llama.cpp's
    fixed ones (no keys), so the HF model here takes those values; Scout's llama3 rope from its rope_freqs. Its Q8_0
    blocks run as stored."""
    from gguf import GGMLQuantizationType as Q

    from test_gguf import TOKENS as GGUF_TOKENS
    from test_gguf import write_gguf
    from tiny_models import build_hf_model

    # Scout's rope: llama3 with both frequency factors 1 (a step), stored as rope_freqs.weight
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 16.0, "low_freq_factor": 1.0}
    rope.update(high_freq_factor=1.0, original_max_position_embeddings=8192)
    hf = build_hf_model("llama4", 0, attention_chunk_size=8192, floor_scale=8192, attn_scale=0.1, rope_parameters=rope)
    loaded = load_model(write_gguf(hf, tmp_path / "llama4.gguf"))
    c = loaded.config
    assert (c.rope_scaling.type, c.rope_scaling.factor, c.rope_scaling.high_freq_factor) == ("llama3", 16.0, 1.0)
    assert (c.architecture, c.num_experts, c.moe_intermediate_size, c.intermediate_size) == ("llama4", 4, 32, 96)
    assert [c.is_moe_layer(i) for i in range(4)] == [False, True, False, True] and c.qk_l2_norm
    assert [c.layer_window(i) for i in range(4)] == [-8192, -8192, -8192, None]
    assert loaded.checkpoint.reader.gguf_names("model.layers.1.mlp.router.weight") == ["blk.1.ffn_gate_inp.weight"]
    with torch.no_grad():
        want = hf(GGUF_TOKENS).logits
        assert _rel(loaded.model(GGUF_TOKENS), want) < 1e-4
        q8 = load_model(write_gguf(hf, tmp_path / "q8.gguf", qtype=Q.Q8_0), quantize="auto")
        assert q8.model.quantization["scheme"] == "gguf" and q8.model.quantization["stats"]["experts"] == 2
        assert _rel(q8.model(GGUF_TOKENS), want) < 3e-2


@pytest.mark.parametrize("name", ["llama4", "gpt_oss"])
def test_a_training_checkpoint_of_transposed_experts_loads(tmp_path, name):
    """A `keel train` checkpoint (DCP) holds keel's tensors; read under HF names, the families whose experts are
    stored transposed (Llama 4, GPT-OSS) read them back through the same reader as their HF files."""
    import torch.distributed.checkpoint as dcp

    save_hf_model(name, tmp_path / "hf")
    loaded = load_model(tmp_path / "hf", "float32")
    state = {k: v.detach().clone() for k, v in loaded.model.state_dict().items()}
    dcp.save({"model": state}, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    (tmp_path / "ck" / "config.json").write_text(json.dumps(loaded.model.config.to_hf()))
    again = load_model(tmp_path / "ck", "float32")
    assert again.checkpoint.format == "keel-dcp"
    with torch.no_grad():
        assert torch.equal(again.model(TOKENS), loaded.model(TOKENS))
