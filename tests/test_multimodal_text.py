"""The text model of multimodal releases (keel.config.TEXT_MODEL_OF): Gemma 3, Qwen2-VL, Qwen2.5-VL, Qwen3-VL(-MoE),
GLM-4V, GLM-4.5V, ERNIE-4.5-VL, HunYuan-VL, Mistral 3, LLaVA, LLaVA-NeXT, LLaVA-OneVision, FastVLM, InternVL3(.5),
Aya Vision, LFM2-VL, LFM3-VL, Idefics3, SmolVLM and Llama 3.2 Vision (its self-attention layers) read as the text
families they pair with a vision tower (the tower, ERNIE-4.5-VL's vision experts and Llama 3.2 Vision's cross-attention
layers left unread; PaliGemma, a prefix LM, refused); transformers' multimodal
model's logits on text alone, the older file layouts transformers still loads, `keel convert` to the text model, and
the engine's greedy tokens. M-RoPE is the plain rotary on text (its position components are the same there), which
the Qwen-VL, GLM-4V, ERNIE-4.5-VL and HunYuan-VL comparisons check."""

from __future__ import annotations

import json

import pytest
import torch

from keel.config import ModelConfig
from keel.errors import ConfigError
from keel.quant.loading import load_model
from tiny_models import COMMON, TINY_CONFIGS, save_byte_tokenizer

SLOW = pytest.mark.slow
TOKENS = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(1))

_SIGLIP = dict(hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28)
_TOWER = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=64)
_PIXTRAL = dict(_SIGLIP, head_dim=16, patch_size=14, model_type="pixtral")


_MLLAMA_TEXT = dict(
    num_hidden_layers=5,
    intermediate_size=128,
    cross_attention_layers=[1, 3],
    max_position_embeddings=128,
    pad_token_id=0,  # MllamaTextConfig's 128004 is past the tiny vocab
    rope_parameters={
        "rope_type": "llama3",
        "rope_theta": 5000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8,
    },
)
_MLLAMA_VISION = dict(
    hidden_size=32,
    intermediate_size=32,
    num_hidden_layers=2,
    num_global_layers=1,
    attention_heads=2,
    image_size=28,
    patch_size=14,
    vision_output_dim=64,
    intermediate_layers_indices=[0],
)


def _mrope(sections: list[int], **extra) -> dict:
    return {"rope_parameters": {"rope_type": "default", "mrope_section": sections, "rope_theta": 5000.0, **extra}}


# name -> (transformers config class, model class, text config, vision config, outer kwargs, keel family)
RELEASES = {
    # the releases set no final_logit_softcapping (transformers' multimodal model would not apply it; the text model,
    # keel and vLLM do)
    "gemma3": (
        "Gemma3Config",
        "Gemma3ForConditionalGeneration",
        {**COMMON, **TINY_CONFIGS["gemma3"][2], "final_logit_softcapping": None},
        dict(_SIGLIP, patch_size=14),
        dict(mm_tokens_per_image=4),
        "gemma3",
    ),
    "qwen2_vl": (
        "Qwen2VLConfig",
        "Qwen2VLForConditionalGeneration",
        {**COMMON, "intermediate_size": 128, **_mrope([2, 3, 3])},
        dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=1),
        {},
        "qwen2",
    ),
    "qwen2_5_vl": (
        "Qwen2_5_VLConfig",
        "Qwen2_5_VLForConditionalGeneration",
        {**COMMON, "intermediate_size": 128, **_mrope([2, 3, 3])},
        dict(_TOWER, fullatt_block_indexes=[0]),
        dict(tie_word_embeddings=True),
        "qwen2",
    ),
    "qwen3_vl": (
        "Qwen3VLConfig",
        "Qwen3VLForConditionalGeneration",
        {**COMMON, "intermediate_size": 128, "head_dim": 32, **_mrope([6, 5, 5], mrope_interleaved=True)},
        dict(_TOWER, deepstack_visual_indexes=[0]),
        {},
        "qwen3",
    ),
    # the router renormalises its top k whatever the text config says (norm_topk_prob left at Qwen3-MoE's False)
    "qwen3_vl_moe": (
        "Qwen3VLMoeConfig",
        "Qwen3VLMoeForConditionalGeneration",
        {
            **COMMON,
            **{k: v for k, v in TINY_CONFIGS["qwen3_moe"][2].items() if k != "norm_topk_prob"},
            **_mrope([3, 3, 2], mrope_interleaved=True),
        },
        dict(_TOWER, deepstack_visual_indexes=[0]),
        {},
        "qwen3_moe",
    ),
    # GLM-4's block with M-RoPE over half of each head, its q/k/v biases and head width fixed by the class
    "glm4v": (
        "Glm4vConfig",
        "Glm4vForConditionalGeneration",
        {**COMMON, "intermediate_size": 128, **_mrope([1, 2, 1], partial_rotary_factor=0.5)},
        _TOWER,
        {},
        "glm4",
    ),
    # GLM-4.5V: GLM-4.5's MoE block with M-RoPE over half of each head
    "glm4v_moe": (
        "Glm4vMoeConfig",
        "Glm4vMoeForConditionalGeneration",
        {
            **COMMON,
            "intermediate_size": 128,
            "moe_intermediate_size": 48,
            "n_routed_experts": 8,
            "num_experts_per_tok": 2,
            "n_shared_experts": 1,
            "first_k_dense_replace": 1,
            "routed_scaling_factor": 2.5,
            "attention_bias": True,
            "head_dim": 32,
            **_mrope([2, 3, 3], partial_rotary_factor=0.5),
        },
        _TOWER,
        {},
        "glm4_moe",
    ),
    # HunyuanOCR: Hunyuan dense's block (NTK alpha) with four-axis M-RoPE (xdrope_section), one position on text
    "hunyuan_vl": (
        "HunYuanVLConfig",
        "HunYuanVLForConditionalGeneration",
        {
            **COMMON,
            **TINY_CONFIGS["hunyuan_v1_dense"][2],
            "rope_parameters": {
                "rope_type": "xdrope",
                "rope_theta": 10000.0,
                "alpha": 1000.0,
                "factor": 1.0,
                "xdrope_section": [2, 2, 2, 2],
            },
        },
        dict(hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, out_hidden_size=64),
        {},
        "hunyuan_v1_dense",
    ),
    # ERNIE-4.5-VL: ERNIE 4.5 MoE's block with a second set of experts (and router) for vision tokens, unread on text
    "ernie4_5_vl_moe": (
        "Ernie4_5_VLMoeConfig",
        "Ernie4_5_VLMoeForConditionalGeneration",
        {
            **COMMON,
            "intermediate_size": 128,
            "moe_intermediate_size": [32, 16],
            "moe_num_experts": 8,
            "moe_k": 2,
            "moe_num_shared_experts": 1,
            **_mrope([2, 2, 4]),
        },
        dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2),
        {},
        "ernie4_5_moe",
    ),
    "mistral3": (
        "Mistral3Config",
        "Mistral3ForConditionalGeneration",
        {**COMMON, **TINY_CONFIGS["mistral"][2], "model_type": "mistral"},
        _PIXTRAL,
        dict(tie_word_embeddings=False),
        "mistral",
    ),
    "mistral3-ministral3": (
        "Mistral3Config",
        "Mistral3ForConditionalGeneration",
        {**COMMON, **TINY_CONFIGS["ministral3"][2], "model_type": "ministral3"},
        _PIXTRAL,
        dict(tie_word_embeddings=False),
        "ministral3",
    ),
    "llava-qwen2": (
        "LlavaConfig",
        "LlavaForConditionalGeneration",
        {**COMMON, **TINY_CONFIGS["qwen2"][2], "model_type": "qwen2"},
        dict(_SIGLIP, patch_size=14, model_type="clip_vision_model"),
        dict(tie_word_embeddings=True),
        "qwen2",
    ),
    "smolvlm": (
        "SmolVLMConfig",
        "SmolVLMForConditionalGeneration",
        {**COMMON, "intermediate_size": 128, "model_type": "llama"},
        dict(_SIGLIP, patch_size=14),
        dict(tie_word_embeddings=False),
        "llama",
    ),
    "idefics3": (
        "Idefics3Config",
        "Idefics3ForConditionalGeneration",
        {**COMMON, "intermediate_size": 128, "model_type": "llama"},
        dict(_SIGLIP, patch_size=14),
        dict(tie_word_embeddings=False),
        "llama",
    ),
    # LLaVA-NeXT / OneVision / FastVLM: LLaVA's layout, their decoders by the text config's model_type
    "llava_next": (
        "LlavaNextConfig",
        "LlavaNextForConditionalGeneration",
        {**COMMON, **TINY_CONFIGS["mistral"][2], "model_type": "mistral"},
        dict(_SIGLIP, patch_size=14, model_type="clip_vision_model"),
        dict(tie_word_embeddings=False),
        "mistral",
    ),
    "llava_onevision": (
        "LlavaOnevisionConfig",
        "LlavaOnevisionForConditionalGeneration",
        {**COMMON, **TINY_CONFIGS["qwen2"][2], "model_type": "qwen2"},
        dict(_SIGLIP, patch_size=14, model_type="siglip_vision_model"),
        dict(tie_word_embeddings=True),
        "qwen2",
    ),
    "fast_vlm": (
        "FastVlmConfig",
        "FastVlmForConditionalGeneration",
        {**COMMON, **TINY_CONFIGS["qwen2"][2], "model_type": "qwen2"},
        dict(_SIGLIP, patch_size=14, model_type="siglip_vision_model"),
        dict(tie_word_embeddings=True),
        "qwen2",
    ),
    # InternVL3 (Qwen2.5 / Llama 3 decoders) and InternVL3.5 (Qwen3's, q/k norms)
    "internvl-qwen3": (
        "InternVLConfig",
        "InternVLForConditionalGeneration",
        {**COMMON, **TINY_CONFIGS["qwen3"][2], "model_type": "qwen3"},
        dict(hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28),
        dict(tie_word_embeddings=False),
        "qwen3",
    ),
    "internvl-qwen2": (
        "InternVLConfig",
        "InternVLForConditionalGeneration",
        {**COMMON, **TINY_CONFIGS["qwen2"][2], "model_type": "qwen2"},
        dict(hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28),
        dict(tie_word_embeddings=False),
        "qwen2",
    ),
    # Aya Vision: Command R7B's decoder; transformers' head applies no logit_scale (TEXT_MODEL_FIXED)
    "aya_vision": (
        "AyaVisionConfig",
        "AyaVisionForConditionalGeneration",
        {**COMMON, **TINY_CONFIGS["cohere2"][2], "model_type": "cohere2"},
        dict(_SIGLIP, patch_size=14, model_type="siglip_vision_model"),
        dict(tie_word_embeddings=True),
        "cohere2",
    ),
    "lfm2_vl": (
        "Lfm2VlConfig",
        "Lfm2VlForConditionalGeneration",
        {**COMMON, **TINY_CONFIGS["lfm2"][2], "model_type": "lfm2"},
        dict(_SIGLIP, patch_size=14, model_type="siglip2_vision_model", num_patches=16),
        dict(tie_word_embeddings=True, projector_hidden_size=32),
        "lfm2",
    ),
    "lfm3_vl": (
        "Lfm3VlConfig",
        "Lfm3VlForConditionalGeneration",
        {**COMMON, **TINY_CONFIGS["lfm3"][2], "model_type": "lfm3"},
        dict(hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2),
        dict(tie_word_embeddings=False, projector_hidden_size=32),
        "lfm3",
    ),
    # Llama 3.2 Vision: on text, the Llama of its self-attention layers (its cross-attention layers 1 and 3 skipped),
    # its embedding 8 rows longer than its head, never tied (whatever the outer config says)
    "mllama": (
        "MllamaConfig",
        "MllamaForConditionalGeneration",
        {**COMMON, **_MLLAMA_TEXT},
        _MLLAMA_VISION,
        dict(tie_word_embeddings=True),
        "llama",
    ),
}


def _release(name: str, directory):  # noqa: ANN001, ANN202
    """The tiny multimodal model `name`, saved to `directory` as transformers saves it (with a tokenizer)."""
    import transformers

    config_class, model_class, text, vision, outer, _ = RELEASES[name]
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(text_config=text, vision_config=vision, **outer)
    hf = getattr(transformers, model_class)(config).eval()
    hf.save_pretrained(directory)
    save_byte_tokenizer(directory)
    return hf


def _rel(ours: torch.Tensor, want: torch.Tensor) -> float:
    return ((ours - want).abs().max() / want.abs().max()).item()


# by default the releases whose reading has a part of its own (sparse defaults, M-RoPE, interleaved M-RoPE, experts)
_DEFAULT = ("gemma3", "qwen2_vl", "qwen3_vl", "qwen3_vl_moe", "internvl-qwen3", "lfm2_vl", "aya_vision", "mllama")


@pytest.mark.parametrize("name", [n if n in _DEFAULT else pytest.param(n, marks=SLOW) for n in RELEASES])
def test_the_text_model_of_a_multimodal_release_is_read(tmp_path, name):
    hf = _release(name, tmp_path)
    loaded = load_model(tmp_path, "float32")
    assert loaded.config.architecture == RELEASES[name][5]
    with torch.no_grad():
        assert _rel(loaded.model(TOKENS), hf(input_ids=TOKENS).logits) < 1e-5


def _rewrite(directory, rename) -> None:  # noqa: ANN001
    """The checkpoint's tensors under other names (`rename(name, tensor)` -> (name, tensor) or None to drop)."""
    from safetensors.torch import load_file, save_file

    path = directory / "model.safetensors"
    tensors = {}
    for name, tensor in load_file(str(path)).items():
        out = rename(name, tensor)
        if out is not None:
            tensors[out[0]] = out[1].contiguous()
    save_file(tensors, str(path), metadata={"format": "pt"})


def test_mllama_text_model_on_its_own_is_read(tmp_path):
    """MllamaForCausalLM (config model_type mllama_text_model, tensors under `model.`), with cross-attention layers at
    the ends: the same Llama; transformers' greedy tokens too."""
    import transformers

    torch.manual_seed(0)
    config = transformers.MllamaTextConfig(**{**COMMON, **_MLLAMA_TEXT, "cross_attention_layers": [0, 4]})
    hf = transformers.MllamaForCausalLM(config).eval()
    hf.save_pretrained(tmp_path)
    save_byte_tokenizer(tmp_path)
    loaded = load_model(tmp_path, "float32")
    assert loaded.config.architecture == "llama" and loaded.config.num_layers == 3
    assert not loaded.config.tie_word_embeddings and loaded.config.vocab_size == 256
    with torch.no_grad():
        assert _rel(loaded.model(TOKENS), hf(input_ids=TOKENS).logits) < 1e-5
        want = hf.generate(TOKENS[:, :8], max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
        tokens = TOKENS[:, :8]
        for _ in range(6):  # greedy by whole forward passes
            tokens = torch.cat([tokens, loaded.model(tokens)[:, -1:].argmax(-1)], dim=1)
    assert tokens.tolist() == want.tolist()


@pytest.mark.parametrize("layers", [[5], [-1], [0, 1, 2, 3, 4], "3"])
def test_mllama_cross_attention_layers_keel_cannot_read_are_refused_by_name(layers):
    text = {**COMMON, **_MLLAMA_TEXT, "model_type": "mllama_text_model", "cross_attention_layers": layers}
    data = {"architectures": ["MllamaForConditionalGeneration"], "model_type": "mllama", "text_config": text}
    with pytest.raises(ConfigError, match="cross_attention_layers"):
        ModelConfig.from_hf({**data, "vision_config": {}})


def test_gemma3_in_the_layout_of_transformers_4_52(tmp_path):
    """Gemma 3's files saved by transformers 4.52 to 4.x: the decoder under `model.language_model.` (transformers 5
    saves, and the releases hold, `language_model.model.`); both are read."""
    hf = _release("gemma3", tmp_path)
    _rewrite(tmp_path, lambda n, t: (n.replace("language_model.model.", "model.language_model."), t))
    with torch.no_grad():
        assert _rel(load_model(tmp_path, "float32").model(TOKENS), hf(input_ids=TOKENS).logits) < 1e-5


def test_qwen2_vl_in_its_release_layout(tmp_path):
    """Qwen2-VL's and Qwen2.5-VL's releases before transformers 4.52: the text model's keys at the config's top level
    with `rope_scaling: {"type": "mrope", ...}` (read as the plain rotary), the tensors under the text model's own
    names and the tower under `visual.`."""
    import transformers

    hf = _release("qwen2_5_vl", tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    text = {k: v for k, v in data.pop("text_config").items() if k != "rope_parameters"}
    flat = {**data, **text, "model_type": "qwen2_5_vl", "rope_theta": 5000.0}
    flat["rope_scaling"] = {"type": "mrope", "mrope_section": [2, 3, 3]}
    (tmp_path / "config.json").write_text(json.dumps(flat))
    reloaded = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        want = reloaded(input_ids=TOKENS).logits
        assert _rel(want, hf(input_ids=TOKENS).logits) < 1e-6  # transformers reads the old file as the new one
        assert _rel(load_model(tmp_path, "float32").model(TOKENS), want) < 1e-5


def test_qwen3_vl_moe_experts_in_the_release_layout(tmp_path):
    """Qwen3-VL-MoE's releases store each layer's experts stacked and transposed (gate_up [E, H, 2I], down
    [E, I, H]); transformers 5 saves its own layout (keel's). Both are read, as transformers reads both."""
    hf = _release("qwen3_vl_moe", tmp_path)
    _rewrite(tmp_path, lambda n, t: (n, t.transpose(1, 2) if ".mlp.experts." in n else t))
    with torch.no_grad():
        assert _rel(load_model(tmp_path, "float32").model(TOKENS), hf(input_ids=TOKENS).logits) < 1e-5


def test_ernie_vl_reads_the_text_experts(tmp_path):
    """ERNIE-4.5-VL's checkpoints (transformers 5 saves its release layout) hold the text experts then the vision
    ones, the routers transposed and both selection biases in one [2, E] tensor: text reads the text experts by the
    text row, which here picks other experts than the vision row would."""
    import transformers

    name = "ernie4_5_vl_moe"
    config_class, model_class, text, vision, outer, _ = RELEASES[name]
    torch.manual_seed(0)
    hf = getattr(transformers, model_class)(getattr(transformers, config_class)(text_config=text, vision_config=vision))
    for layer in hf.model.language_model.layers[1:]:
        layer.mlp.text_moe.gate.moe_statics.e_score_correction_bias.data[0, :4] = 1.0
        layer.mlp.vision_moe.gate.moe_statics.e_score_correction_bias.data[0, 4:] = 1.0
    hf.eval().save_pretrained(tmp_path)
    save_byte_tokenizer(tmp_path)
    loaded = load_model(tmp_path, "float32")
    assert loaded.config.architecture == "ernie4_5_moe" and loaded.config.num_experts == 8
    with torch.no_grad():
        assert _rel(loaded.model(TOKENS), hf(input_ids=TOKENS).logits) < 1e-5


@pytest.mark.parametrize(
    ("change", "field"),
    [({"mlp_layer_types": ["sparse", "dense", "sparse"]}, "mlp_layer_types"), ({"use_bias": True}, "use_bias")],
)
def test_ernie_vl_text_models_keel_does_not_run_are_refused_by_name(change, field):
    """Expert layers that are not one run (ERNIE 4.5 MoE's start/end indices), and biases (the VL head has none,
    ERNIE 4.5 MoE's would), are refused."""
    text = {**RELEASES["ernie4_5_vl_moe"][2], "model_type": "ernie4_5_vl_moe_text", **change}
    data = {"architectures": ["Ernie4_5_VLMoeForConditionalGeneration"], "text_config": text, "vision_config": {}}
    with pytest.raises(ConfigError, match=field):
        ModelConfig.from_hf(data)


def test_hunyuan_vl_in_its_release_config(tmp_path):
    """HunyuanOCR's release names its rotary `xdrope` (NTK alpha, `xdrope_section` over four position components) in
    `rope_scaling`; transformers reads it as the `dynamic` rotary with `alpha` and M-RoPE sections, one position on
    text: Hunyuan dense's rotary."""
    import transformers

    hf = _release("hunyuan_vl", tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    text = data["text_config"]
    text.pop("rope_parameters")
    text.update(
        rope_theta=10000.0,
        rope_scaling={"type": "xdrope", "alpha": 1000.0, "factor": 1.0, "xdrope_section": [2, 2, 2, 2]},
    )
    (tmp_path / "config.json").write_text(json.dumps(data))
    reloaded = transformers.HunYuanVLForConditionalGeneration.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        want = reloaded(input_ids=TOKENS).logits
        assert _rel(want, hf(input_ids=TOKENS).logits) < 1e-6  # transformers reads the release's names as its own
        assert _rel(load_model(tmp_path, "float32").model(TOKENS), want) < 1e-5


def test_gemma3_release_config_leaves_the_text_defaults_out():
    """gemma-3-4b-it's text_config names six keys; the rest are Gemma3TextConfig's defaults (vocab_size 262208,
    8 heads of 256, 4 KV heads), as transformers reads them."""
    import transformers

    text = dict(
        hidden_size=2560,
        intermediate_size=10240,
        model_type="gemma3_text",
        num_hidden_layers=34,
        rope_scaling={"factor": 8.0, "rope_type": "linear"},
        sliding_window=1024,
    )
    data = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "text_config": text}
    config = ModelConfig.from_hf(data)
    want = transformers.Gemma3Config(text_config=text).text_config
    assert config.architecture == "gemma3"
    assert (config.vocab_size, config.num_heads, config.num_kv_heads, config.head_dim) == (
        want.vocab_size,
        want.num_attention_heads,
        want.num_key_value_heads,
        want.head_dim,
    )
    assert config.rope_scaling.type == "linear" and config.rope_scaling.factor == 8.0


def test_a_text_model_keel_does_not_run_is_refused_by_name():
    data = {
        "architectures": ["LlavaForConditionalGeneration"],
        "model_type": "llava",
        "text_config": {**COMMON, "model_type": "not_a_family"},
        "vision_config": {},
    }
    with pytest.raises(ConfigError, match="not_a_family"):
        ModelConfig.from_hf(data)


def test_m_rope_with_a_scaling_keel_lacks_is_refused_by_name():
    """The plain rotary's equivalence holds for any frequencies; a rope type keel does not run stays refused."""
    text = {**COMMON, "intermediate_size": 128, **_mrope([2, 3, 3])}
    text["rope_parameters"]["rope_type"] = "not_a_rope"
    data = {"architectures": ["Qwen2VLForConditionalGeneration"], "model_type": "qwen2_vl", "text_config": text}
    with pytest.raises(ConfigError, match="not_a_rope"):
        ModelConfig.from_hf(data)


@pytest.mark.parametrize(
    "name",
    [
        "gemma3",
        "mllama",
        *[
            pytest.param(n, marks=SLOW)
            for n in (
                "qwen2_5_vl",
                "qwen3_vl_moe",
                "glm4v",
                "smolvlm",
                "aya_vision",
                "lfm2_vl",
                "internvl-qwen3",
                "ernie4_5_vl_moe",
            )
        ],
    ],
)
def test_convert_writes_the_text_model(tmp_path, name):
    """`keel convert` of a multimodal release writes the text model, which transformers runs as its causal LM."""
    import transformers

    from keel.weights.convert import convert

    hf = _release(name, tmp_path / "mm")
    convert(tmp_path / "mm", tmp_path / "text")
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "text").eval()
    assert "ConditionalGeneration" not in type(exported).__name__
    with torch.no_grad():
        assert _rel(exported(TOKENS).logits, hf(input_ids=TOKENS).logits) < 1e-5


@pytest.mark.parametrize("name", [pytest.param(n, marks=SLOW) for n in ("gemma3", "qwen3_vl", "mistral3", "mllama")])
def test_the_engine_serves_the_text_model(tmp_path, name):
    """The engine's greedy tokens are transformers' multimodal model's on a text prompt."""
    from keel.serve import LLM, EngineConfig, SamplingParams

    hf = _release(name, tmp_path)
    prompt = TOKENS[:1, :12]
    with torch.no_grad():
        greedy = hf.generate(prompt, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    llm = LLM(str(tmp_path), EngineConfig.of(dtype="float32", compile=False, max_model_len=64))
    out = llm.generate([prompt[0].tolist()], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert out[0].outputs[0].token_ids == greedy[0, 12:].tolist()


def test_gemma3_config_as_its_releases_write_it(tmp_path):
    """Gemma 3's releases (transformers 4.50): the text config without layer_types, rope_parameters or the default
    keys, the global layers' `rope_scaling` (linear, factor 8), the sliding ones' `rope_local_base_freq`, the layer
    kinds by `sliding_window_pattern`, no outer tie_word_embeddings; read as transformers 5 reads it."""
    import transformers

    _release("gemma3", tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    text = data["text_config"]
    for key in ("rope_parameters", "layer_types", "_sliding_window_pattern", "tie_word_embeddings"):
        text.pop(key, None)
    data.pop("tie_word_embeddings")
    text.update(
        rope_scaling={"factor": 8.0, "rope_type": "linear"},
        rope_theta=100_000.0,
        rope_local_base_freq=5000.0,
        sliding_window_pattern=3,
    )
    (tmp_path / "config.json").write_text(json.dumps(data))
    hf = transformers.Gemma3ForConditionalGeneration.from_pretrained(tmp_path).eval()
    loaded = load_model(tmp_path, "float32")
    assert loaded.config.layer_types == hf.config.text_config.layer_types
    with torch.no_grad():
        assert _rel(loaded.model(TOKENS), hf(input_ids=TOKENS).logits) < 1e-5


def test_llava_release_config_leaves_the_text_defaults_out():
    """llava-1.5-7b-hf's text_config names five keys of its Vicuna; the rest are LlamaConfig's defaults."""
    import transformers

    text = dict(max_position_embeddings=4096, model_type="llama", rms_norm_eps=1e-5, vocab_size=32064)
    data = {"architectures": ["LlavaForConditionalGeneration"], "model_type": "llava", "text_config": text}
    config = ModelConfig.from_hf({**data, "vision_config": {}})
    want = transformers.LlavaConfig(text_config=text).text_config
    assert config.architecture == "llama"
    got = (config.vocab_size, config.hidden_size, config.intermediate_size, config.num_layers, config.num_heads)
    assert got == (want.vocab_size, want.hidden_size, want.intermediate_size, want.num_hidden_layers, 32)
    assert config.num_kv_heads == want.num_key_value_heads and config.max_position_embeddings == 4096


def test_llava_next_release_config_leaves_the_text_defaults_out():
    """llava-v1.6-mistral-7b-hf's text_config names its Mistral's MLP width and KV heads; the rest are
    MistralConfig's defaults."""
    import transformers

    text = dict(
        intermediate_size=14336,
        max_position_embeddings=32768,
        model_type="mistral",
        num_key_value_heads=8,
        rms_norm_eps=1e-5,
        rope_theta=1e6,
        sliding_window=None,
        vocab_size=32064,
    )
    data = {"architectures": ["LlavaNextForConditionalGeneration"], "model_type": "llava_next", "text_config": text}
    config = ModelConfig.from_hf({**data, "vision_config": {}})
    want = transformers.LlavaNextConfig(text_config=text).text_config
    assert config.architecture == "mistral"
    got = (config.vocab_size, config.hidden_size, config.num_layers, config.num_heads, config.num_kv_heads)
    assert got == (want.vocab_size, want.hidden_size, want.num_hidden_layers, 32, want.num_key_value_heads)
    assert config.head_dim == want.head_dim == 128


def test_paligemma_is_refused_by_name(tmp_path):
    """PaliGemma is a prefix LM: its processor marks the prompt token_type_ids 0, over which transformers' model
    attends bidirectionally (so its logits on a text prompt are not the causal decoder's), its positions from 1."""
    import transformers

    text = {**COMMON, "intermediate_size": 128, "head_dim": 16, "model_type": "gemma"}
    config = transformers.PaliGemmaConfig(text_config=text, vision_config=dict(_SIGLIP, patch_size=14))
    torch.manual_seed(0)
    hf = transformers.PaliGemmaForConditionalGeneration(config).eval()
    with torch.no_grad():
        prefix = hf(input_ids=TOKENS, token_type_ids=torch.zeros_like(TOKENS)).logits
        causal = hf(input_ids=TOKENS, token_type_ids=torch.ones_like(TOKENS)).logits
    assert _rel(prefix, causal) > 1e-2  # the prompt's tokens see the later ones
    hf.save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match="PaliGemmaForConditionalGeneration.*bidirectionally"):
        load_model(tmp_path, "float32")


def test_the_processor_chat_template_of_a_release_is_read(tmp_path):
    """Multimodal releases keep their chat template in the processor's `chat_template.json`; read where there is no
    `chat_template.jinja` (transformers 5's), before the tokenizer config's."""
    from keel.tokenizer import Tokenizer

    save_byte_tokenizer(tmp_path)
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    (tmp_path / "chat_template.jinja").unlink(missing_ok=True)
    assert Tokenizer.from_hf_dir(tmp_path).chat_template == template
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    assert Tokenizer.from_hf_dir(tmp_path).chat_template == "{{ messages[0]['content'] }}"
