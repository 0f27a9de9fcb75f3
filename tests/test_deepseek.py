"""DeepSeek-V3: multi-head latent attention, YaRN, DeepSeek's MoE, and the latent KV cache, against transformers."""

from __future__ import annotations

import math

import pytest
import torch

from keel.config import ModelConfig, RopeScaling
from keel.errors import ConfigError
from keel.model.kv_size import kv_cache_bytes
from keel.model.layers import rope_attention_factor, rope_inv_freq
from keel.model.mla import mla_softmax_scale
from keel.quant.loading import load_model
from keel.serve import EngineConfig, LLMEngine, SamplingParams
from keel.serve.kv_cache import PagedKVCache
from reference_generate import ContiguousKVCache, stream_tokens
from tiny_models import save_byte_tokenizer, save_hf_model

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

GREEDY = dict(temperature=0.0, ignore_eos=True)
# name -> (TINY_CONFIGS entry, overrides): full MoE with q_lora; the same with every layer dense;
# plain q_proj + non-interleaved rope + YaRN (dense).
VARIANTS = {
    "moe": ("deepseek_v3", {}),
    "dense": ("deepseek_v3", {"first_k_dense_replace": 3}),
    "mla-yarn": ("deepseek_v3-mla", {}),
    # DeepSeek-V2: low-rank queries and group-limited routing; V2-Lite's shape (full-rank q_proj, greedy top-k).
    "v2": ("deepseek_v2", {"q_lora_rank": 32}),
    "v2-lite": ("deepseek_v2", {"topk_method": "greedy", "n_group": 1, "topk_group": 1}),
}

# The published DeepSeek-V3 config.json (deepseek-ai/DeepSeek-V3), less auto_map and the FP8
# quantization_config (tested separately).
PUBLISHED = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "attention_bias": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "first_k_dense_replace": 3,
    "hidden_act": "silu",
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048,
    "moe_layer_freq": 1,
    "n_group": 8,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 61,
    "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "tie_word_embeddings": False,
    "topk_group": 4,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "v_head_dim": 128,
    "vocab_size": 129280,
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """variant -> (directory, transformers model) of the tiny random checkpoints."""
    root = tmp_path_factory.mktemp("deepseek")
    out = {}
    for variant, (name, overrides) in VARIANTS.items():
        directory = root / variant
        hf = save_hf_model(name, directory, **overrides)
        save_byte_tokenizer(directory)
        hf.generation_config.eos_token_id = None
        out[variant] = (directory, hf)
    return out


def _max_rel(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).abs().max() / ref.abs().max()).item()


def _hf_greedy(hf, prompt: list[int], max_new: int) -> list[int]:
    ids = torch.tensor([prompt])
    # An explicit mask: without one, generate masks every prompt token equal to pad_token_id.
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False)
    return out[0, len(prompt) :].tolist()


# ------------------------------------------------------------------------------------------ config
def test_published_config_reads_and_round_trips():
    config = ModelConfig.from_hf(PUBLISHED)
    assert (config.architecture, config.is_mla, config.is_moe) == ("deepseek_v3", True, True)
    # keel's head_dim is the query/key width; the rotary width is qk_rope_head_dim.
    assert (config.head_dim, config.rotary_dim, config.num_kv_heads, config.v_head_dim) == (192, 64, 128, 128)
    assert (config.q_lora_rank, config.kv_lora_rank, config.rope_interleave) == (1536, 512, True)
    assert config.mlp_only_layers == [0, 1, 2] and not config.is_moe_layer(2) and config.is_moe_layer(3)
    assert (config.num_experts, config.num_experts_per_tok, config.shared_expert_intermediate_size) == (256, 8, 2048)
    assert (config.router_scoring, config.router_bias, config.shared_expert_gated) == ("sigmoid", True, False)
    assert (config.n_group, config.topk_group, config.routed_scaling_factor) == (8, 4, 2.5)
    assert config.rope_scaling == RopeScaling(
        type="yarn", factor=40.0, original_max_position_embeddings=4096, mscale=1.0, mscale_all_dim=1.0
    )
    # DeepSeek-V3: 671B parameters, 37B active per token (without the multi-token-prediction layer).
    counts = config.param_counts()
    assert round(counts["total"] / 1e9) == 671 and round(counts["active"] / 1e9) == 38
    assert ModelConfig.from_hf(config.to_hf()) == config

    # transformers reads keel's export into the same architecture.
    hf_config = transformers.DeepseekV3Config(**config.to_hf())
    assert (hf_config.qk_head_dim, hf_config.head_dim, hf_config.num_key_value_heads) == (192, 64, 128)
    assert (hf_config.first_k_dense_replace, hf_config.n_shared_experts, hf_config.n_routed_experts) == (3, 1, 256)
    assert hf_config.rope_parameters["rope_type"] == "yarn" and hf_config.rope_parameters["factor"] == 40.0


# The published DeepSeek-V2-Lite config.json (deepseek-ai/DeepSeek-V2-Lite), less auto_map.
PUBLISHED_V2_LITE = {
    "architectures": ["DeepseekV2ForCausalLM"],
    "attention_bias": False,
    "aux_loss_alpha": 0.001,
    "bos_token_id": 100000,
    "eos_token_id": 100001,
    "first_k_dense_replace": 1,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "intermediate_size": 10944,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "model_type": "deepseek_v2",
    "moe_intermediate_size": 1408,
    "moe_layer_freq": 1,
    "n_group": 1,
    "n_routed_experts": 64,
    "n_shared_experts": 2,
    "norm_topk_prob": False,
    "num_attention_heads": 16,
    "num_experts_per_tok": 6,
    "num_hidden_layers": 27,
    "num_key_value_heads": 16,
    "q_lora_rank": None,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 1.0,
    "scoring_func": "softmax",
    "seq_aux": True,
    "tie_word_embeddings": False,
    "topk_group": 1,
    "topk_method": "greedy",
    "torch_dtype": "bfloat16",
    "v_head_dim": 128,
    "vocab_size": 102400,
}


def test_published_v2_lite_config_reads_and_round_trips():
    config = ModelConfig.from_hf(PUBLISHED_V2_LITE)
    assert (config.architecture, config.is_mla, config.is_moe, config.q_lora_rank) == ("deepseek_v2", True, True, None)
    assert (config.head_dim, config.rotary_dim, config.v_head_dim, config.rope_interleave) == (192, 64, 128, True)
    assert (config.router_scoring, config.router_float32, config.router_bias) == ("softmax", True, False)
    assert (config.n_group, config.norm_topk_prob, config.shared_expert_intermediate_size) == (1, False, 2816)
    assert config.mlp_only_layers == [0]
    # DeepSeek-V2-Lite: 15.7B parameters, 2.4B active per token (the embedding table aside).
    counts = config.param_counts()
    assert round(counts["total"] / 1e8) == 157 and 2.4e9 <= counts["active_matmul"] < 2.5e9
    assert ModelConfig.from_hf(config.to_hf()) == config
    hf_config = transformers.DeepseekV2Config(**config.to_hf())
    assert (hf_config.topk_method, hf_config.q_lora_rank, hf_config.num_key_value_heads) == ("greedy", None, 16)
    # DeepSeek-V2 (236B): group-limited greedy over 8 groups, 3 of them a token.
    grouped = ModelConfig.from_hf(
        {
            **PUBLISHED_V2_LITE,
            "topk_method": "group_limited_greedy",
            "n_group": 8,
            "topk_group": 3,
            "routed_scaling_factor": 16.0,
        }
    )
    assert (grouped.n_group, grouped.topk_group, grouped.router_group_score) == (8, 3, "max")
    assert ModelConfig.from_hf(grouped.to_hf()) == grouped
    with pytest.raises(ConfigError, match="topk_method 'noaux_tc'"):
        ModelConfig.from_hf({**PUBLISHED_V2_LITE, "topk_method": "noaux_tc"})
    with pytest.raises(ConfigError, match="scoring_func 'sigmoid'"):
        ModelConfig.from_hf({**PUBLISHED_V2_LITE, "scoring_func": "sigmoid"})


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_tiny_config_round_trip(tiny, variant):
    directory, hf = tiny[variant]
    config = ModelConfig.from_json_file(directory / "config.json")
    assert ModelConfig.from_hf(config.to_hf()) == config
    again = type(hf.config)(**config.to_hf())
    for key in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "rope_interleave"):
        if hasattr(hf.config, key):  # DeepSeek-V2 has no rope_interleave: it always interleaves
            assert getattr(again, key) == getattr(hf.config, key), key
    assert again.first_k_dense_replace == hf.config.first_k_dense_replace
    assert config.param_counts()["total"] == sum(p.numel() for p in hf.parameters())


def test_refusals(tmp_path):
    with pytest.raises(ConfigError, match="quant_method 'fp8'"):
        ModelConfig.from_hf({**PUBLISHED, "quantization_config": {"quant_method": "fp8", "fmt": "e4m3"}})
    with pytest.raises(ConfigError, match="scoring_func 'softmax'"):
        ModelConfig.from_hf({**PUBLISHED, "scoring_func": "softmax"})
    base = ModelConfig.from_hf(PUBLISHED)
    with pytest.raises(ConfigError, match="num_kv_heads"):
        ModelConfig(**{**base.to_dict(), "rope_scaling": base.rope_scaling, "num_kv_heads": 8})
    with pytest.raises(ConfigError, match="head_dim"):
        ModelConfig(**{**base.to_dict(), "rope_scaling": base.rope_scaling, "head_dim": 128})

    from gguf import GGUFWriter

    from keel.weights.loader import open_checkpoint

    path = tmp_path / "ds.gguf"  # a deepseek2 file without its metadata: the missing key named
    writer = GGUFWriter(str(path), "deepseek2")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ConfigError, match="ds.gguf: GGUF metadata key 'deepseek2.embedding_length' is missing"):
        open_checkpoint(path)


# ------------------------------------------------------------------------------------------- YaRN
def test_yarn_matches_transformers():
    """Frequencies, the cos/sin factor and DeepSeek's softmax correction, on the published config and
    on one where mscale != mscale_all_dim (so the cos/sin factor is not 1)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    for rope in (
        PUBLISHED["rope_scaling"],
        {**PUBLISHED["rope_scaling"], "mscale": 0.707, "mscale_all_dim": 0.5, "factor": 16, "beta_fast": 16},
    ):
        hf_dict = {**PUBLISHED, "rope_scaling": rope}
        ours = ModelConfig.from_hf(hf_dict)
        tiny = dict(hidden_size=64, num_attention_heads=2, num_key_value_heads=2, q_lora_rank=8, kv_lora_rank=8)
        hf_config = transformers.DeepseekV3Config(**{**ours.to_hf(), **tiny})
        inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_config, "cpu")
        assert torch.equal(rope_inv_freq(ours.rotary_dim, ours.rope_theta, ours.rope_scaling), inv_freq)
        assert rope_attention_factor(ours.rope_scaling) == pytest.approx(attention_factor, rel=1e-12)
        scale = DeepseekV3Attention(hf_config, 0).scaling
        assert mla_softmax_scale(ours) == pytest.approx(scale, rel=1e-12)
        assert scale != pytest.approx(192**-0.5)  # the correction is in play
    assert mla_softmax_scale(ModelConfig.from_hf(PUBLISHED)) == pytest.approx(192**-0.5 * (0.1 * math.log(40) + 1) ** 2)


def test_yarn_on_llama_matches_transformers(tmp_path):
    """YaRN outside DeepSeek: only the cos/sin attention factor (no softmax correction)."""
    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 1024}
    hf = save_hf_model("llama", tmp_path, max_position_embeddings=4096, rope_parameters=rope)
    keel = load_model(tmp_path).model
    assert keel.config.rope_scaling.type == "yarn" and keel.rotary.attention_factor > 1
    tokens = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert _max_rel(keel(tokens), hf(tokens).logits) <= 1e-4


# ---------------------------------------------------------------------------------- vs transformers
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(tiny, variant):
    directory, hf = tiny[variant]
    keel = load_model(directory, "float32").model
    tokens = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert _max_rel(keel(tokens), hf(tokens).logits) <= 1e-4
        # Through the latent cache (absorbed kv_b_proj), a prefill then decode steps: same logits.
        cache = ContiguousKVCache(keel.config, 2, 40, torch.float32)
        prefill = keel(tokens[:, :30], positions=torch.arange(30).expand(2, 30), cache=cache)
        steps = [keel(tokens[:, i : i + 1], positions=torch.full((2, 1), i), cache=cache) for i in range(30, 40)]
        assert _max_rel(torch.cat([prefill, *steps], dim=1), hf(tokens).logits) <= 1e-4


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_engine_greedy_equals_transformers_generate(tiny, variant):
    """LLMEngine on the paged latent cache, with prefix caching and chunked prefill (8-token budget,
    4-token blocks): requests sharing a 20-token prefix, added while another decodes."""
    directory, hf = tiny[variant]
    loaded = load_model(directory, "float32")
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(0, 256, (20,), generator=g).tolist()
    prompts = [shared + torch.randint(0, 256, (n,), generator=g).tolist() for n in (3, 9, 1)]
    prompts.append(torch.randint(0, 256, (7,), generator=g).tolist())
    expected = [_hf_greedy(hf, p, 16) for p in prompts]

    config = EngineConfig.of(num_blocks=64, block_size=4, max_num_batched_tokens=8, max_num_seqs=8, max_model_len=64)
    engine = LLMEngine(loaded, config)
    assert engine.cache.values == []  # latents only
    ids = [engine.add_request(prompts[0], SamplingParams(max_tokens=16, **GREEDY))]
    results, steps = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.outputs[0].token_ids
        steps += 1
        if steps == 4:  # the first prompt is cached (its first blocks) and decoding
            ids += [engine.add_request(p, SamplingParams(max_tokens=16, **GREEDY)) for p in prompts[1:]]
    assert [results[i] for i in ids] == expected
    stats = engine.stats()
    assert stats["prefix_cache_hits"] >= 2 * 20 - 2 * 4  # two later requests reuse >= 4 of the 5 shared blocks
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


@pytest.mark.parametrize("variant", ["moe", "mla-yarn"])
def test_keel_generate_and_align(tiny, variant, capsys):
    from keel.cli import main as keel_main

    directory, _ = tiny[variant]
    assert keel_main(["generate", str(directory), "--prompt", "Hello", "--max-tokens", "6", "--ignore-eos"]) == 0
    assert keel_main(["align", str(directory)]) == 0
    assert "PASS (float32" in capsys.readouterr().out


def test_batched_rows_at_different_positions_match_single(tiny):
    """The contiguous latent cache with rows at different positions (per-row slot writes)."""
    directory, _ = tiny["mla-yarn"]
    model = load_model(directory).model
    prompts = [list(range(5, 25)), list(range(40, 51))]
    singles = [list(stream_tokens(model, p, SamplingParams(max_tokens=6, **GREEDY))) for p in prompts]
    cache = ContiguousKVCache(model.config, 2, 40, torch.float32)
    width = max(len(p) for p in prompts)
    tokens = torch.tensor([p + [0] * (width - len(p)) for p in prompts])
    lengths = torch.tensor([len(p) for p in prompts])
    with torch.no_grad():
        logits = model(tokens, positions=torch.arange(width).expand(2, width), cache=cache)
        nxt = logits[torch.arange(2), lengths - 1].argmax(-1)
        out = [[t] for t in nxt.tolist()]
        for _ in range(5):
            nxt = model(nxt[:, None], positions=lengths[:, None], cache=cache)[:, -1].argmax(-1)
            lengths = lengths + 1
            for row, t in zip(out, nxt.tolist(), strict=True):
                row.append(t)
    assert out == singles


# ------------------------------------------------------------------------------------- cache size
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cache_holds_latent_and_rope_key_only(dtype):
    config = ModelConfig.from_hf(PUBLISHED)
    per_layer = (config.kv_lora_rank + config.qk_rope_head_dim) * dtype.itemsize
    assert kv_cache_bytes(config, dtype) == config.num_layers * per_layer
    assert kv_cache_bytes(config, dtype, tokens=16) == 16 * config.num_layers * per_layer

    tiny = ModelConfig.from_hf({**PUBLISHED, "num_hidden_layers": 3, "first_k_dense_replace": 1})
    paged = PagedKVCache(tiny, num_blocks=5, block_size=4, dtype=dtype)
    tiny_per_token = 3 * (512 + 64) * dtype.itemsize
    assert paged.nbytes() == 5 * 4 * tiny_per_token == kv_cache_bytes(tiny, dtype, tokens=4) * 5
    assert [tuple(k.shape) for k in paged.keys] == [(1, 20, 576)] * 3 and paged.values == []
    contiguous = ContiguousKVCache(tiny, 1, 10, dtype)
    assert sum(k.numel() * k.element_size() for k in contiguous.keys) == 10 * tiny_per_token
    assert contiguous.values == []
