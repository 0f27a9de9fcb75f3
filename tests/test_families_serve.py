"""Families added as config options of the one model, served through the engine (paged KV cache, prefix
caching, the compiled decode step) with transformers' greedy tokens; their logits, align and conversion
are in tests/test_architectures.py and tests/test_convert.py with every tiny family."""

from __future__ import annotations

import pytest
import torch

from keel.model.layers import WeightlessNorm
from keel.serve.engine import EngineConfig
from keel.serve.llm import LLM
from keel.serve.sampling import SamplingParams
from tiny_models import save_byte_tokenizer, save_hf_model

pytestmark = pytest.mark.isa  # the compiled step and the kernels differ by ISA

NEW_TOKENS = 24


# Each family compiles a decode graph of its own (30-70 s of inductor on 2 cores): Granite, StableLM, Gemma 2 and
# Gemma 3 are served in make test-slow. Their block features are served in make test as well: GPT-NeoX's
# parallel residual and LayerNorms here, the Gemmas' sandwich norms, soft-caps and alternating layers in
# tests/test_features_compose.py, and the soft-cap on every paged-cache path, the compiled decode op's
# included, in tests/test_attention_softcap.py.
SLOW = pytest.mark.slow


@pytest.mark.parametrize(
    "name",
    [
        pytest.param("granite", marks=SLOW),
        "phi3",
        pytest.param("stablelm", marks=SLOW),
        pytest.param("stablelm-parallel", marks=SLOW),
        pytest.param("stablelm-qk-norm", marks=SLOW),
        "gpt_neox",
        pytest.param("gpt_neox_japanese", marks=SLOW),  # its last layer's attention output bias alone
        "olmo2",
        pytest.param("olmo3", marks=SLOW),
        pytest.param("exaone4", marks=SLOW),
        pytest.param("starcoder2", marks=SLOW),
        pytest.param("glm4", marks=SLOW),
        pytest.param("ministral3", marks=SLOW),
        pytest.param("cohere", marks=SLOW),
        pytest.param("cohere-qk-norm", marks=SLOW),
        pytest.param("cohere2", marks=SLOW),
        pytest.param("seed_oss", marks=SLOW),
        pytest.param("ernie4_5", marks=SLOW),
        pytest.param("arcee", marks=SLOW),
        pytest.param("gemma3", marks=SLOW),
        pytest.param("gemma2", marks=SLOW),
        pytest.param("gemma", marks=SLOW),
        pytest.param("phi", marks=SLOW),
        pytest.param("phi-qk-norm", marks=SLOW),
        pytest.param("gpt_bigcode-mha", marks=SLOW),  # learned positions through the compiled decode step
        pytest.param("falcon", marks=SLOW),
        pytest.param("gptj", marks=SLOW),
        pytest.param("gpt_neo", marks=SLOW),
        pytest.param("bitnet", marks=SLOW),  # its sub-norms through the compiled decode step
        pytest.param("opt", marks=SLOW),
        pytest.param("opt-350m", marks=SLOW),  # norms after the residual adds, the projected embedding
        pytest.param("bloom", marks=SLOW),  # ALiBi through the compiled decode step
        pytest.param("falcon-rw", marks=SLOW),
        pytest.param("mpt", marks=SLOW),
        pytest.param("xglm", marks=SLOW),  # sinusoidal positions computed in the compiled decode step
        pytest.param("biogpt", marks=SLOW),
    ],
)
def test_engine_gives_transformers_greedy_tokens(tmp_path, name):
    hf = save_hf_model(name, tmp_path)
    save_byte_tokenizer(tmp_path)
    hf.generation_config.eos_token_id = None
    shared = list(range(40, 80))  # five blocks of 8: the second prompt's prefix is served from the cache
    prompts = [shared + [7, 9, 11], shared + [100, 3], [5, 6, 7, 8, 9]]
    expected = []
    with torch.no_grad():
        for ids in prompts:
            out = hf.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
            expected.append(out[0, len(ids) :].tolist())
    config = EngineConfig.of(
        dtype="float32",
        compile=True,
        num_blocks=64,
        max_model_len=256,
        block_size=8,
        enable_prefix_caching=True,
        max_num_seqs=4,
    )
    llm = LLM(str(tmp_path), config)
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    first = llm.generate(prompts[0], greedy, use_tqdm=False)[0]
    rest = llm.generate(prompts[1:], greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in [first, *rest]] == expected
    assert rest[0].num_cached_tokens >= 32  # the shared blocks came from the prefix cache
    assert llm.engine.runner.compiled is not None and llm.engine.runner.compiled.steps > 0


@pytest.mark.parametrize(
    "name",
    [
        "smollm3",
        "ministral3",
        "olmoe",
        "glm4_moe",
        "granitemoe",
        "granitemoeshared",
        "dots1",
        "ernie4_5_moe",
        "llama4",
        # In make test-slow, to keep make test within its budget (their logits and greedy tokens against
        # transformers run in make test: tests/test_architectures.py).
        pytest.param("solar_open", marks=SLOW),
        pytest.param("ministral", marks=SLOW),
        pytest.param("glm4_moe_lite", marks=SLOW),
        pytest.param("mistral4", marks=SLOW),
        pytest.param("minimax_m2", marks=SLOW),
        pytest.param("exaone_moe", marks=SLOW),
        pytest.param("hunyuan_v1_dense", marks=SLOW),
        pytest.param("glm", marks=SLOW),
        pytest.param("cwm", marks=SLOW),
        pytest.param("helium", marks=SLOW),
        pytest.param("jais2", marks=SLOW),
        pytest.param("nemotron", marks=SLOW),
        pytest.param("vaultgemma", marks=SLOW),
        pytest.param("hyperclovax", marks=SLOW),
        pytest.param("youtu", marks=SLOW),
        pytest.param("apertus", marks=SLOW),
        pytest.param("apertus1p5", marks=SLOW),
        pytest.param("qwen3_5", marks=SLOW),
        pytest.param("qwen3_5_moe", marks=SLOW),
        pytest.param("qwen3_next", marks=SLOW),
        pytest.param("olmo_hybrid", marks=SLOW),
        pytest.param("lfm2", marks=SLOW),
        pytest.param("lfm2_moe", marks=SLOW),
        pytest.param("granitemoehybrid-dense", marks=SLOW),
        pytest.param("bamba", marks=SLOW),
        pytest.param("nemotron_h", marks=SLOW),
        pytest.param("falcon_h1", marks=SLOW),
        pytest.param("zamba2", marks=SLOW),
        pytest.param("mamba2", marks=SLOW),
        pytest.param("mamba", marks=SLOW),
        pytest.param("falcon_mamba", marks=SLOW),
        pytest.param("jamba", marks=SLOW),
        pytest.param("minimax", marks=SLOW),
        pytest.param("recurrent_gemma", marks=SLOW),
        pytest.param("hunyuan_v1_moe", marks=SLOW),
        pytest.param("phimoe", marks=SLOW),
        pytest.param("olmo", marks=SLOW),
        pytest.param("nanochat", marks=SLOW),
        pytest.param("flex_olmo", marks=SLOW),
        pytest.param("granite_swa", marks=SLOW),
        pytest.param("granitemoe_swa", marks=SLOW),
        pytest.param("cohere2_moe", marks=SLOW),
        pytest.param("kolibri1", marks=SLOW),
        pytest.param("exaone", marks=SLOW),
        pytest.param("sarvam_moe", marks=SLOW),
        pytest.param("sarvam_mla", marks=SLOW),
        pytest.param("internlm3", marks=SLOW),
        pytest.param("mellum", marks=SLOW),
        pytest.param("hy_v3", marks=SLOW),
        pytest.param("minicpm3", marks=SLOW),
        pytest.param("afmoe", marks=SLOW),
        pytest.param("gemma4", marks=SLOW),
        pytest.param("gemma4-moe", marks=SLOW),
        pytest.param("gemma4-e", marks=SLOW),
        pytest.param("gemma3n", marks=SLOW),
        pytest.param("gemma4_unified", marks=SLOW),
        pytest.param("gpt_bigcode", marks=SLOW),
        pytest.param("gpt2-scaled", marks=SLOW),
        pytest.param("falcon-40b", marks=SLOW),
        pytest.param("gptj", marks=SLOW),
        pytest.param("codegen", marks=SLOW),
        pytest.param("opt-plain", marks=SLOW),
        pytest.param("gpt_neo", marks=SLOW),
        pytest.param("dbrx", marks=SLOW),
        pytest.param("bloom", marks=SLOW),
        pytest.param("falcon-rw", marks=SLOW),
        pytest.param("mpt", marks=SLOW),
        pytest.param("flint", marks=SLOW),
        pytest.param("lfm3", marks=SLOW),
        pytest.param("axk1", marks=SLOW),
        pytest.param("laguna", marks=SLOW),
        pytest.param("persimmon", marks=SLOW),
        pytest.param("xglm", marks=SLOW),
        pytest.param("biogpt", marks=SLOW),
        pytest.param("mimo_v2_flash", marks=SLOW),
        pytest.param("kimi_linear", marks=SLOW),
        pytest.param("bailing_hybrid", marks=SLOW),
        pytest.param("deepseek_v32", marks=SLOW),
        pytest.param("glm_moe_dsa", marks=SLOW),
        pytest.param("axk2", marks=SLOW),
        pytest.param("jetmoe", marks=SLOW),
    ],
)
def test_uncompiled_families_are_served_with_transformers_greedy_tokens(tmp_path, name):
    """Uncompiled, through the engine: SmolLM3's layers without position encoding (one of three here, in a sliding
    window), Ministral 3's query temperature by position (from position 16 here), and OLMoE's experts (MoE models
    run eager). Where keel's kernels are on, the other layers run the fused layer operator and these the modules
    (the operator always rotates and does not scale queries), GLM-4.5's DeepSeek-style experts after a dense
    layer, Granite MoE's scalars and top-k softmax router; transformers' greedy tokens, with a prefix served
    from the cache."""
    hf = save_hf_model(name, tmp_path)
    save_byte_tokenizer(tmp_path)
    hf.generation_config.eos_token_id = None
    prompts = [list(range(40, 80)) + [7, 9, 11], list(range(40, 80)) + [100, 3]]
    with torch.no_grad():
        expected = [
            hf.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)[0, len(ids) :]
            for ids in prompts
        ]
    config = EngineConfig.of(dtype="float32", compile=False, num_blocks=64, max_model_len=256, block_size=8)
    llm = LLM(str(tmp_path), config)
    layers = list(llm.engine.model.layers.values())
    attention = [layer.self_attn for layer in layers]
    if name == "smollm3":
        assert [a.rotates for a in attention] == [True, False, True]
    elif name == "ministral3":
        assert all(a.scales_queries for a in attention)
    elif name == "solar_open":  # GLM-4.5's experts (a biased sigmoid choice) in every layer, Llama's attention
        assert all(llm.engine.model.config.is_moe_layer(i) for i in range(len(attention)))
        assert llm.engine.model.config.router_bias and attention[0].q_norm is None
    elif name == "glm4_moe_lite":  # latent attention; the dense layer where mlp_layer_types puts it
        moe = [llm.engine.model.config.is_moe_layer(i) for i in range(len(attention))]
        assert moe == [True, False, True] and llm.engine.model.config.is_mla
    elif name == "mistral4":  # latent attention with the query temperature, a softmax router by groups
        config = llm.engine.model.config
        assert config.is_mla and config.query_scale_beta and config.router_scoring == "softmax" and config.n_group == 2
    elif name == "minimax_m2":  # whole-projection q/k norms, half-rotated heads, a biased sigmoid choice
        config = llm.engine.model.config
        assert config.qk_norm_scope == "all" and config.rotary_dim == 8 and config.router_bias
    elif name == "exaone_moe":  # sliding layers rotate, global ones do not; experts where mlp_layer_types says
        assert [a.rotates for a in attention] == [True, False, True, False]
        assert [llm.engine.model.config.is_moe_layer(i) for i in range(4)] == [False, True, True, False]
    elif name == "gpt_bigcode":  # learned positions added to the embedding, no layer rotating; one KV head
        model = llm.engine.model
        assert model.embed_positions is not None and not any(a.rotates for a in attention)
        assert all(a.num_kv_heads == 1 for a in attention)
    elif name == "gpt2-scaled":  # learned positions; layer i's softmax scale divided by i + 1 (folded into q)
        assert llm.engine.model.embed_positions is not None and not any(a.rotates for a in attention)
        assert [a.q_multiplier for a in attention] == [1.0, 0.5, 1 / 3]
    elif name == "falcon-40b":  # parallel attention and MLP, each from a norm of its own; 2 KV heads of 4
        assert all(layer.parallel_residual and layer.post_attention_layernorm is not None for layer in layers)
        assert all(a.num_kv_heads == 2 and a.rotates for a in attention)
    elif name in ("gptj", "codegen"):  # one norm for both parallel branches, part of each head rotating, a biased head
        assert all(layer.parallel_residual and layer.post_attention_layernorm is None for layer in layers)
        assert all(a.rotary_dim == (8 if name == "gptj" else 4) and a.o_proj.bias is None for a in attention)
        assert llm.engine.model.lm_head.bias is not None
    elif name == "persimmon":  # biased q/k LayerNorms over each head, a quarter of each head rotating, biased q/k/v
        assert all(isinstance(a.q_norm, torch.nn.LayerNorm) and a.k_norm.bias is not None for a in attention)
        assert all(a.rotary_dim == 4 and a.qkv_proj.bias is not None for a in attention)
    elif name == "opt-plain":  # learned positions from row 2 of the table; weightless norms, no biases
        model = llm.engine.model
        assert model.embed_positions.num_embeddings == model.config.max_position_embeddings + 2
        assert not any(a.rotates or a.qkv_proj.bias is not None for a in attention)
        assert not any(list(layer.input_layernorm.parameters()) for layer in layers)
    elif name == "gpt_neo":  # learned positions; a global layer, then local ones in windows of 8; q.k unscaled
        assert llm.engine.model.embed_positions is not None and not any(a.rotates for a in attention)
        assert [a.window for a in attention] == [None, 8, 8] and all(a.o_proj.bias is not None for a in attention)
        assert llm.engine.model.config.attention_scale == 1.0
    elif name == "xglm":  # sinusoidal positions from row 2, no weights for them; the embedding times sqrt(64)
        model = llm.engine.model
        assert model.embed_positions.padding_idx == 3 and not list(model.embed_positions.parameters())
        assert not any(a.rotates for a in attention) and model.config.embedding_multiplier == 8.0
    elif name == "biogpt":  # learned positions from row 2; the embedding times sqrt(64); its own untied head
        model = llm.engine.model
        assert model.embed_positions.num_embeddings == model.config.max_position_embeddings + 2
        assert model.config.embedding_multiplier == 8.0 and model.lm_head.weight is not model.embed_tokens.weight
    elif name == "bitnet":  # RMSNorms before o_proj and down_proj, a gated ReLU-squared MLP
        assert all(a.attn_sub_norm is not None for a in attention)
        assert all(layer.mlp.ffn_sub_norm is not None and layer.mlp.act == "relu2" for layer in layers)
    elif name == "bloom":  # ALiBi (no layer rotating), the embedding's own biased LayerNorm, per-head q/k/v
        model = llm.engine.model
        assert not any(a.rotates for a in attention) and all(a.alibi is not None for a in attention)
        assert model.embedding_norm is not None and model.embedding_norm.bias is not None
    elif name == "falcon-rw":  # ALiBi scaled by 1/sqrt(head_dim), Llama's sequential block
        assert not any(a.rotates for a in attention) and not any(layer.parallel_residual for layer in layers)
        assert torch.equal(attention[0].alibi, torch.tensor([2.0**-2, 2.0**-4, 2.0**-6, 2.0**-8]) / 4)
    elif name == "mpt":  # ALiBi, q/k/v clamped, another softmax scale (folded into q), no biases
        assert not any(a.rotates for a in attention) and all(a.clip_qkv == 0.6 for a in attention)
        assert all(a.q_multiplier is not None and a.qkv_proj.bias is None for a in attention)
    elif name == "hunyuan_v1_dense":  # q/k norms after the rotary embedding (the fused operator norms before it)
        assert all(a.qk_norm_after_rope and a.q_norm is not None for a in attention)
    elif name == "glm":  # half of each head rotating, biased q/k/v, no output norms
        assert all(a.rotary_dim == 16 and a.qkv_proj.bias is not None and a.o_proj.bias is None for a in attention)
        assert all(layer.attn_output_norm is None for layer in layers)
    elif name == "cwm":  # the first layer global, the others in windows of 8
        assert [a.window for a in attention] == [None, 8, 8]
    elif name == "helium":  # biased q/k/v but not o
        assert all(a.qkv_proj.bias is not None and a.o_proj.bias is None for a in attention)
    elif name in ("jais2", "nemotron"):  # biased LayerNorms (Nemotron's scaling by 1 + w), ungated MLPs
        offset = 1.0 if name == "nemotron" else 0.0
        norms = [layer.input_layernorm for layer in layers]
        assert all(isinstance(n, torch.nn.LayerNorm) and getattr(n, "offset", 0.0) == offset for n in norms)
        assert all(layer.mlp.gate_proj is None for layer in layers)
    elif name == "vaultgemma":  # Gemma 2's alternating windows without its output norms
        assert [a.window for a in attention] == [8, None, 8]
        assert all(layer.attn_output_norm is None and layer.mlp_output_norm is None for layer in layers)
    elif name == "hyperclovax":  # Granite's scalars with norms on the sublayers' outputs
        assert all(layer.attn_output_norm is not None for layer in layers)
        assert llm.engine.model.config.logits_scaling == 4.0
    elif name == "exaone":  # Llama's model read from EXAONE's names, llama3 rope scaling
        config = llm.engine.model.config
        assert config.architecture == "exaone" and config.rope_scaling.type == "llama3"
    elif name == "internlm3":  # dynamic NTK rope: the default frequencies within max_position_embeddings
        assert llm.engine.model.config.rope_scaling.type == "dynamic" and all(
            a.o_proj.bias is not None for a in attention
        )
    elif name == "mellum":  # sliding and global layers, each kind with its own rope base; a dense first layer
        config = llm.engine.model.config
        assert [a.window for a in attention] == [8, None, 8] and config.sliding_rope_theta == 100.0
        assert [config.is_moe_layer(i) for i in range(3)] == [False, True, True]
    elif name == "hy_v3":  # a biased sigmoid choice, scaled, with two shared experts as one MLP; a dense first layer
        config = llm.engine.model.config
        assert config.router_bias and config.routed_scaling_factor == 1.5 and not config.is_moe_layer(0)
        assert config.shared_expert_intermediate_size == 2 * config.moe_intermediate_size
    elif name == "minicpm3":  # latent attention rotating halves, muP's scalars
        config = llm.engine.model.config
        assert config.is_mla and not config.rope_interleave and config.embedding_multiplier == 3.0
        assert config.logits_scaling == 4.0 and layers[0].residual_multiplier == 2.0 / 3**0.5
    elif name == "afmoe":  # gated output, sliding layers rotating and a global one not, sandwich norms, experts
        assert [a.rotates for a in attention] == [True, False, True] and all(
            a.output_gate is not None for a in attention
        )
        assert all(layer.attn_output_norm is not None for layer in layers) and llm.engine.model.config.is_moe_layer(1)
    elif name == "sarvam_moe":  # q/k/v read from one stored tensor, every channel rotating, q/k norms
        assert all(a.rotary_dim == a.head_dim and a.q_norm is not None for a in attention)
        assert llm.engine.model.config.router_bias
    elif name == "sarvam_mla":  # latent attention without the low-rank query, experts after a dense layer
        config = llm.engine.model.config
        assert config.is_mla and config.q_lora_rank is None and not config.is_moe_layer(0) and config.is_moe_layer(1)
    elif name == "youtu":  # latent attention, dense MLPs
        config = llm.engine.model.config
        assert config.is_mla and not any(config.is_moe_layer(i) for i in range(len(attention)))
    elif name == "qwen3_5":  # Gated DeltaNet layers around a full-attention layer with its output gate
        assert [type(a).__name__ for a in attention] == ["GatedDeltaNet"] * 2 + ["Attention", "GatedDeltaNet"]
        assert attention[2].output_gate is not None
    elif name == "olmo_hybrid":  # pre-normed Gated DeltaNet layers beside post-normed, unrotated attention layers
        assert [type(a).__name__ for a in attention] == ["GatedDeltaNet", "Attention"] * 2
        assert attention[0].beta_scale == 2.0 and not attention[1].rotates
        assert layers[0].attn_output_norm is None and layers[1].input_layernorm is None
    elif name == "lfm2":  # gated short convolutions around an attention layer with q/k norms
        assert [type(a).__name__ for a in attention] == ["ShortConv"] * 2 + ["Attention", "ShortConv"]
        assert attention[2].q_norm is not None and attention[0].conv.bias is not None
    elif name == "granitemoehybrid-dense":  # Mamba 2 mixers around a rotating attention layer, a dense MLP
        assert [type(a).__name__ for a in attention] == ["Mamba2Mixer", "Attention", "Mamba2Mixer"]
        assert attention[1].rotates and not llm.engine.model.config.is_moe
    elif name == "nemotron_h":  # one sublayer a layer: Mamba 2, unrotated attention, an ungated MLP, ungated experts
        kinds = [(type(layer.self_attn).__name__, type(layer.mlp).__name__) for layer in layers]
        none = "NoneType"
        assert kinds == [("Mamba2Mixer", none), ("Attention", none), (none, "SwiGLU"), (none, "MoE")] + [
            ("Mamba2Mixer", none),
            (none, "MoE"),
        ]
        assert not attention[1].rotates and layers[3].mlp.experts.gate_up_proj.shape[1] == 32  # up rows alone
        cache = llm.engine.cache  # K/V rows for the attention layer only, state slots for the Mamba layers
        assert [cache.slots_of(i) > 0 for i in range(6)] == [False, True, False, False, False, False]
        assert sorted(cache.recurrent.state) == [0, 4]
    elif name == "bamba":  # Mamba 2 mixers around an attention layer rotating half of each head
        assert [type(a).__name__ for a in attention] == ["Mamba2Mixer", "Attention", "Mamba2Mixer"]
        assert attention[1].rotary_dim == 8
    elif name == "falcon_h1":  # a Mamba 2 mixer beside the attention of every layer: KV rows and a state slot each
        config = llm.engine.model.config
        assert all(type(layer.mamba).__name__ == "Mamba2Mixer" for layer in layers)
        assert all(llm.engine.cache.keys[i].numel() > 0 for i in range(len(layers)))
        assert set(llm.engine.cache.recurrent.state) == set(range(len(layers)))
        assert attention[0].q_multiplier is not None and layers[0].mlp.gate_multiplier != 1.0
    elif name == "zamba2":  # a copy of a shared block before the mixer of hybrid layers 1, 3, 4: KV rows and a state
        cache = llm.engine.cache
        assert [layer.shared_linear is not None for layer in layers] == [False, True, False, True, True]
        assert [cache.slots_of(i) > 0 for i in range(5)] == [False, True, False, True, True]
        assert sorted(cache.recurrent.state) == list(range(5))
        assert layers[1].self_attn.q_adapter is not None and layers[1].mlp.gate_up_adapter is not None
    elif name == "mamba2":  # Mamba 2 mixers alone: no feed-forward sublayer, no KV cache, a block a sequence
        assert all(type(a).__name__ == "Mamba2Mixer" for a in attention)
        assert all(layer.mlp is None and layer.post_attention_layernorm is None for layer in layers)
        assert llm.engine.cache.nbytes() == 0 and llm.engine.kv.block_size == 256
    elif name in ("mamba", "falcon_mamba"):  # Mamba 1 mixers alone; Falcon Mamba's weightless step/B/C norms
        assert all(type(a).__name__ == "Mamba1Mixer" for a in attention) and all(x.mlp is None for x in layers)
        assert all((a.dt_layernorm is not None) == (name == "falcon_mamba") for a in attention)
        assert llm.engine.cache.nbytes() == 0 and llm.engine.kv.block_size == 256
    elif name == "jamba":  # Mamba 1 mixers with weighted step/B/C norms around unrotated attention; experts in 1, 3
        config = llm.engine.model.config
        assert [type(a).__name__ for a in attention] == ["Mamba1Mixer", "Attention", "Mamba1Mixer", "Mamba1Mixer"]
        assert not attention[1].rotates and attention[0].dt_layernorm.weight is not None
        assert [config.is_moe_layer(i) for i in range(4)] == [False, True, False, True]
    elif name == "minimax":  # lightning attention in layers 1 and 2 (a state each, no KV), experts everywhere
        config = llm.engine.model.config
        assert [type(a).__name__ for a in attention] == [
            "Attention",
            "LightningAttention",
            "LightningAttention",
            "Attention",
        ]
        assert config.normed_residual and all(config.is_moe_layer(i) for i in range(4))
        assert [llm.engine.cache.keys[i].numel() == 0 for i in range(4)] == [False, True, True, False]
    elif name == "recurrent_gemma":  # RG-LRU blocks (a state each, no KV) then windowed multi-query attention
        config = llm.engine.model.config
        assert [type(a).__name__ for a in attention] == ["RGLRUBlock", "RGLRUBlock", "Attention"]
        assert config.layer_types[2] == "sliding_attention" and config.sliding_window == 8
        assert [llm.engine.cache.keys[i].numel() == 0 for i in range(3)] == [True, True, False]
    elif name == "lfm2_moe":  # short convolutions; a dense first layer, then a biased sigmoid choice, scaled
        config = llm.engine.model.config
        assert [config.is_moe_layer(i) for i in range(4)] == [False, True, True, True]
        assert config.router_bias and config.routed_scaling_factor == 1.5 and config.has_recurrent_layers
    elif name == "kimi_linear":  # Kimi Delta Attention around unrotated latent attention; layer 0 dense
        config = llm.engine.model.config
        assert [type(a).__name__ for a in attention] == [
            "KimiDeltaAttention", "MLAttention", "KimiDeltaAttention", "KimiDeltaAttention"
        ]  # fmt: skip
        assert not attention[1].rotates and config.linear_variant == "kda"
        assert [config.is_moe_layer(i) for i in range(4)] == [False, True, True, True]
    elif name == "bailing_hybrid":  # full-rank, bounded KDA between gated latent attention; layer 0 dense
        config = llm.engine.model.config
        assert [type(a).__name__ for a in attention] == [
            "KimiDeltaAttention", "MLAttention", "KimiDeltaAttention", "MLAttention"
        ]  # fmt: skip
        assert attention[1].rotates and attention[1].output_gate is not None and attention[0].full_rank
        assert config.kda_gate_lower_bound == -3.0
        assert [config.is_moe_layer(i) for i in range(4)] == [False, True, True, True]
    elif name in ("qwen3_5_moe", "qwen3_next"):  # the same hybrid with gated shared experts (Qwen3-Next: layer 1 dense)
        config = llm.engine.model.config
        assert config.has_linear_attention and config.shared_expert_gated
        assert [config.is_moe_layer(i) for i in range(4)] == [True, name == "qwen3_5_moe", True, True]
    elif name in ("apertus", "apertus1p5"):  # per-head q/k norms, xIELU with each layer's own parameters
        alphas = [layer.mlp.act_fn.alpha_p.item() for layer in layers]
        assert all(a.q_norm is not None for a in attention) and len(set(alphas)) == len(layers)
    elif name == "hunyuan_v1_moe":  # q/k norms after the rotary embedding; a float32 router and an ungated shared MLP
        assert all(a.qk_norm_after_rope for a in attention) and llm.engine.model.config.router_float32
        mlps = [layer.mlp for layer in llm.engine.model.layers.values()]
        assert all(mlp.shared_expert is not None and mlp.shared_expert_gate is None for mlp in mlps)
    elif name == "phimoe":  # biased LayerNorms, the SparseMixer router, a biased LM head
        model = llm.engine.model
        assert model.config.router_scoring == "sparsemixer" and model.lm_head.bias is not None
        assert all(layer.input_layernorm.bias is not None for layer in model.layers.values())
    elif name == "olmo":  # q, k and v clamped (the fused operator does not clamp), LayerNorms without weights
        assert all(a.clip_qkv == 0.3 for a in attention)
        layer = llm.engine.model.layers["0"]
        assert isinstance(layer.input_layernorm, WeightlessNorm) and layer.input_layernorm.kind == "layer"
        assert not any("norm" in n for n, _ in llm.engine.model.named_parameters())
    elif name == "nanochat":  # reversed rotation, weightless q/k norms after it, the embedding normed, relu2 MLP
        model = llm.engine.model
        assert model.rotary.reversed and all(a.qk_l2_eps is not None for a in attention)
        assert isinstance(model.embedding_norm, WeightlessNorm) and model.embedding_norm.kind == "rms"
        assert model.layers["0"].mlp.gate_proj is None and model.layers["0"].mlp.act == "relu2"
    elif name == "flex_olmo":  # OLMo 2's norms on the sublayers' outputs and over whole q/k, experts in every layer
        layer = llm.engine.model.layers["0"]
        assert layer.input_layernorm is None and layer.attn_output_norm is not None and attention[0].qk_norm_whole
        assert all(llm.engine.model.config.is_moe_layer(i) for i in range(len(attention)))
    elif name == "granite_swa":  # sinks, windows of 8 in the sliding layers, layer 0 unrotated, two RoPE bases
        assert all(a.sinks is not None for a in attention)
        assert [(a.window, a.rotates, a.sliding_rope) for a in attention] == [
            (None, False, False),
            (8, True, True),
            (None, True, False),
            (8, True, True),
        ]
    elif name == "granitemoe_swa":  # sinks, layer 0 global, experts and the shared MLP in every layer
        assert all(a.sinks is not None for a in attention) and [a.window for a in attention] == [None, 8, 8]
        assert all(layer.mlp.shared_expert is not None for layer in llm.engine.model.layers.values())
    elif name == "cohere2_moe":  # the dense layer rotates though global; a renormalised sigmoid router, averaged
        config = llm.engine.model.config
        assert [(a.window, a.rotates) for a in attention] == [(None, True), (8, True), (None, False)]
        assert [config.is_moe_layer(i) for i in range(3)] == [False, True, True]
        assert config.router_scoring == "topk_sigmoid" and config.norm_topk_prob
        assert all(layer.mlp.averages_shared for layer in list(llm.engine.model.layers.values())[1:])
    elif name == "kolibri1":  # sliding layers rotate, the global one does not; sandwich norms; the bias on logits
        assert [(a.window, a.rotates, a.q_norm is not None) for a in attention] == [
            (8, True, True),
            (None, False, True),
            (8, True, True),
        ]
        layers = list(llm.engine.model.layers.values())
        assert all(layer.attn_output_norm is not None and layer.mlp.router.bias_on_logits for layer in layers)
    elif name in ("gemma4", "gemma4-moe"):  # the global layers' own head width and KV heads, in their own KV stores
        sliding, full = (8, 16, 2, False), (None, 32, 1, True) if name == "gemma4" else (None, 32, 2, False)
        kinds = [sliding, sliding, full] if name == "gemma4" else [sliding, full, full]
        assert [(a.window, a.head_dim, a.num_kv_heads, a.k_eq_v) for a in attention] == kinds
        stores = [tuple(k.shape[::2]) for k in llm.engine.cache.keys]
        assert stores == [(a.num_kv_heads, a.head_dim) for a in attention]
        assert all(a.v_norm_eps is not None for a in attention) and all(la.layer_scalar is not None for la in layers)
        if name == "gemma4-moe":  # the dense MLP beside the experts, each branch normed, the router's own scales
            mlps = [layer.mlp for layer in layers]
            assert all(m.expert_output_norm is not None and m.router.expert_scale is not None for m in mlps)
    elif name == "gemma4-e":  # every layer's per-layer input branch; the last two attend over layers 1 and 2's stores
        assert llm.engine.model.embed_tokens_per_layer.weight.shape == (320, 5 * 8)
        assert all(layer.per_layer_input_gate is not None for layer in layers)
        assert [a.kv_source for a in attention] == [0, 1, 2, 1, 2]
        assert [k.shape[1] > 0 for k in llm.engine.cache.keys] == [True, True, True, False, False]
    elif name == "gemma3n":  # AltUp's three copies and LAuReL in every layer, sparse gates in the first two
        model = llm.engine.model
        assert len(model.altup_projections) == 2 and all(layer.altup.n == 3 for layer in layers)
        assert all(layer.laurel is not None for layer in layers)
        assert [layer.mlp.sparsity_std is not None for layer in layers] == [True, True, False, False, False]
        assert [a.kv_source for a in attention] == [0, 1, 2, 1, 2]
    elif name == "gemma4_unified":  # no per-layer inputs; the last two layers attend over layers 1 and 2's stores
        assert llm.engine.model.embed_tokens_per_layer is None
        assert [a.kv_source for a in attention] == [0, 1, 2, 1, 2]
        assert [k.shape[1] > 0 for k in llm.engine.cache.keys] == [True, True, True, False, False]
    elif name == "ministral":  # the middle layer global, the others in windows of 8
        assert [a.window for a in attention] == [8, None, 8]
    elif name == "llama4":  # chunks of 8 in the rotating layers, the fourth global, unrotated and scaling queries
        assert [a.window for a in attention] == [-8, -8, -8, None]
        assert [(a.rotates, a.scales_queries, a.qk_l2_eps is not None) for a in attention][2:] == [
            (True, False, True),
            (False, True, False),
        ]
    elif name == "dbrx":  # experts in every layer from a softmax router, q/k/v clamped, unbiased LayerNorms
        config = llm.engine.model.config
        assert all(config.is_moe_layer(i) for i in range(len(attention)))
        assert config.clip_qkv == 0.5 and config.norm_type == "layer" and not config.norm_bias
    elif name == "flint":  # sinks, sliding layers rotating and the full one not; a dense layer 1; the shared expert
        config = llm.engine.model.config
        assert all(a.sinks is not None for a in attention)
        assert [(a.window, a.rotates) for a in attention] == [(8, True), (None, False), (8, True)]
        assert [config.is_moe_layer(i) for i in range(3)] == [True, False, True] and not config.router_bias
        assert layers[0].mlp.shared_expert is not None and layers[0].mlp.shared_expert_gate is None
    elif name == "lfm3":  # convolutions around a sliding and a full layer, each head's output gated, sandwich norms
        assert [type(a).__name__ for a in attention] == ["ShortConv", "Attention", "Attention", "ShortConv"]
        assert [(a.window, a.sliding_rope) for a in attention[1:3]] == [(8, True), (None, False)]
        assert attention[1].output_gate.weight.shape[0] == 4 and all(
            layer.mlp_output_norm is not None for layer in layers
        )
    elif name == "axk1":  # latent attention; the one sparse layer's output normed, the dense ones' not
        config = llm.engine.model.config
        assert config.is_mla and [config.is_moe_layer(i) for i in range(4)] == [False, False, True, False]
        assert layers[2].mlp.output_norm is not None and config.router_bias
    elif name == "laguna":  # sliding layers rotating whole heads by their own RoPE, the full one a quarter; softplus
        config = llm.engine.model.config
        assert [(a.window, a.rotary_dim, a.sliding_rope) for a in attention] == [(8, 16, True), (None, 4, False)] + [
            (8, 16, True)
        ]
        assert all(a.gate_softplus and a.gate_per_head for a in attention)
        assert [config.is_moe_layer(i) for i in range(3)] == [False, True, True] and config.router_logit_softcapping
    elif name == "mimo_v2_flash":  # narrower values (the paged cache's value rows too), sinks in the sliding layers
        stores = llm.engine.cache.values
        assert [(a.window, a.num_kv_heads, a.v_head_dim, a.sinks is not None) for a in attention] == [
            (None, 1, 12, False),
            (8, 2, 12, True),
            (8, 2, 12, True),
            (None, 1, 12, False),
        ]
        assert all(s.shape[-1] == 12 for s in stores)
        assert [llm.engine.model.config.is_moe_layer(i) for i in range(4)] == [False, True, True, True]
    elif name in ("deepseek_v32", "glm_moe_dsa"):  # latent attention over the keys each query's indexer selects
        cache = llm.engine.cache
        indexing = [0, 1, 2] if name == "deepseek_v32" else [0, 3]  # GLM-5's layers 1 and 2 reuse layer 0's
        assert [a.indexer is not None for a in attention] == [i in indexing for i in range(len(attention))]
        assert [i for i, k in enumerate(cache.index_keys) if k.shape[1]] == indexing
        assert [a.index_source for a in attention] == ([0, 1, 2] if name == "deepseek_v32" else [0, 0, 0, 3])
    elif name == "axk2":  # DSA in every layer with the gated query; gated norms before the attention and the experts
        config = llm.engine.model.config
        assert all(a.indexer is not None and a.q_gate_proj is not None and a.q_b_proj is None for a in attention)
        assert [config.is_moe_layer(i) for i in range(4)] == [False, False, True, False]
        assert [type(layer.post_attention_layernorm).__name__ for layer in layers] == [
            "RMSNorm",
            "RMSNorm",
            "LowRankGatedRMSNorm",
            "RMSNorm",
        ]
    elif (
        name == "jetmoe"
    ):  # attention experts over the shared KV heads (the cache keeps those only), experts in every layer
        assert all(type(a).__name__ == "MixtureOfAttention" and a.q_proj is None for a in attention)
        assert all(a.num_heads == 4 and a.num_kv_heads == 2 for a in attention)
        assert all(layer.mlp.output_bias is not None for layer in layers)
    elif name in ("olmoe", "granitemoe", "granitemoeshared"):  # Granite's scalars around experts in every layer
        assert all(llm.engine.model.config.is_moe_layer(i) for i in range(len(attention)))
        shared = [layer.mlp.shared_expert for layer in llm.engine.model.layers.values()]
        assert all((s is not None) == (name == "granitemoeshared") for s in shared)  # and its ungated shared MLP
    else:  # GLM-4.5, dots.llm1 (DeepSeek-V3's router), ERNIE 4.5 MoE (a biased softmax choice): a dense first layer
        moe = [llm.engine.model.config.is_moe_layer(i) for i in range(len(attention))]
        assert moe == [False, True, True] and llm.engine.model.config.router_bias
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    first = llm.generate(prompts[0], greedy, use_tqdm=False)[0]
    second = llm.generate(prompts[1], greedy, use_tqdm=False)[0]
    assert [first.outputs[0].token_ids, second.outputs[0].token_ids] == [e.tolist() for e in expected]
    # Gated DeltaNet layers (Qwen3.5) keep a state per sequence: prefix caching is off for them
    hybrid = llm.engine.model.config.has_recurrent_layers
    assert second.num_cached_tokens >= 32 or (hybrid and not llm.engine.kv.enable_prefix_caching)


@pytest.mark.slow
def test_jetmoe_is_served_with_an_int8_kv_cache(tmp_path):
    """JetMoE's attention experts attend as grouped-query attention over the shared KV heads, so the int8 cache
    stores those heads as any other layer's: transformers' greedy tokens (keel's float cache gives them too)."""
    hf = save_hf_model("jetmoe", tmp_path)
    save_byte_tokenizer(tmp_path)
    hf.generation_config.eos_token_id = None
    ids = list(range(40, 80)) + [7, 9, 11]
    with torch.no_grad():
        expected = hf.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    config = EngineConfig.of(
        dtype="float32", compile=False, num_blocks=64, max_model_len=256, block_size=8, kv_cache_dtype="int8"
    )
    llm = LLM(str(tmp_path), config)
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    out = llm.generate([ids], greedy, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == expected[0, len(ids) :].tolist()
