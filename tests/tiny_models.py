"""Tiny random HF models of every supported architecture, built offline with transformers."""

from __future__ import annotations

import copy
from pathlib import Path

import torch

COMMON = dict(vocab_size=256, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2)

# name -> (transformers config class, model class, extra config kwargs)
TINY_CONFIGS: dict[str, tuple[str, str, dict]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(intermediate_size=128, tie_word_embeddings=True)),
    "llama-bias": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(intermediate_size=128, attention_bias=True, mlp_bias=True),
    ),
    "llama3-rope": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            intermediate_size=128,
            max_position_embeddings=16384,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        ),
    ),
    "llama-linear-rope": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(intermediate_size=128, rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}),
    ),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(intermediate_size=128, sliding_window=8)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(intermediate_size=128, tie_word_embeddings=True)),
    "qwen2-sliding": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(intermediate_size=128, use_sliding_window=True, sliding_window=8, max_window_layers=1),
    ),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(intermediate_size=128, head_dim=32)),
    # SmolLM3: layer 1 of 3 without position encoding (NoPE), attending within a sliding window of 8, with biases.
    "smollm3": (
        "SmolLM3Config",
        "SmolLM3ForCausalLM",
        dict(
            intermediate_size=128,
            no_rope_layer_interval=2,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            use_sliding_window=True,
            sliding_window=8,
            attention_bias=True,
            mlp_bias=True,
        ),
    ),
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(intermediate_size=96, num_local_experts=4, num_experts_per_tok=2, sliding_window=8),
    ),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        dict(
            intermediate_size=128,
            moe_intermediate_size=48,
            shared_expert_intermediate_size=96,
            num_experts=8,
            num_experts_per_tok=2,
            mlp_only_layers=[1],
        ),
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            intermediate_size=128,
            moe_intermediate_size=48,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            head_dim=16,
        ),
    ),
    # Llama's block with Granite's four scalars, each away from 1 (softmax scale neither 1 nor 1/sqrt(16)).
    "granite": (
        "GraniteConfig",
        "GraniteForCausalLM",
        dict(
            intermediate_size=128,
            embedding_multiplier=12.0,
            residual_multiplier=0.22,
            attention_multiplier=0.09,
            logits_scaling=4.0,
            attention_bias=True,
            mlp_bias=True,
        ),
    ),
    # Phi-3: q/k/v and gate/up stored fused (qkv_proj, gate_up_proj), split at load; a sliding window.
    "phi3": (
        "Phi3Config",
        "Phi3ForCausalLM",
        dict(intermediate_size=128, sliding_window=8, bos_token_id=1, eos_token_id=2, pad_token_id=0),
    ),
    # Phi-3.5 / Phi-4-mini: LongRoPE over 3/4 of each head (6 frequencies), pre-trained on 16 positions: the tests'
    # 40-token sequences take the long factors, their 12-token prompts the short ones until generation passes 16.
    "phi3-longrope": (
        "Phi3Config",
        "Phi3ForCausalLM",
        dict(
            intermediate_size=128,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
            max_position_embeddings=64,
            original_max_position_embeddings=16,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.75,
                "short_factor": [1.0, 1.02, 1.1, 1.3, 1.8, 2.5],
                "long_factor": [1.0, 1.5, 3.0, 6.0, 12.0, 20.0],
            },
        ),
    ),
    # StableLM 2: LayerNorm with bias, rotary over half of each head, q/k/v bias.
    "stablelm": (
        "StableLmConfig",
        "StableLmForCausalLM",
        dict(intermediate_size=128, use_qkv_bias=True, partial_rotary_factor=0.5),
    ),
    # StableLM 2 12B's q/k LayerNorms, one per head (q_layernorm.norms.{i}), stacked at load, grouped KV heads.
    "stablelm-qk-norm": (
        "StableLmConfig",
        "StableLmForCausalLM",
        dict(intermediate_size=128, qk_layernorm=True, partial_rotary_factor=0.5),
    ),
    # ... and its parallel residual (one LayerNorm for both sublayers), a quarter of each head rotated.
    "stablelm-parallel": (
        "StableLmConfig",
        "StableLmForCausalLM",
        dict(intermediate_size=128, use_parallel_residual=True, partial_rotary_factor=0.25),
    ),
    # GPT-NeoX: its own names, q/k/v interleaved per head in one tensor, parallel residual with two
    # LayerNorms, an ungated GELU MLP with biases, a quarter of each head rotated.
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(intermediate_size=128, num_key_value_heads=4)),
    # GPT-NeoX-Japanese: a sequential residual, the last layer's attention output bias alone, an MLP 3x wide without
    # biases, rotary over half of each head at its own base, an untied head
    "gpt_neox_japanese": (
        "GPTNeoXJapaneseConfig",
        "GPTNeoXJapaneseForCausalLM",
        dict(
            intermediate_multiple_size=3,
            rotary_pct=0.5,
            rotary_emb_base=5000,
            layer_norm_eps=1e-6,
            tie_word_embeddings=False,
            bos_token_id=1,
            eos_token_id=2,
            attention_dropout=0.0,
        ),
    ),
    # NanoChat: weightless RMSNorms (the final one on the embedding too), q/k rotated the other way then L2-normed
    # per head, a relu2 MLP named fc1 / fc2, the logits (|l| < 1 here) soft-capped at 1, biased attention.
    "nanochat": (
        "NanoChatConfig",
        "NanoChatForCausalLM",
        dict(intermediate_size=128, final_logit_softcapping=1.0, attention_bias=True, pad_token_id=0, eos_token_id=2),
    ),
    # OLMo: weightless LayerNorms (no norm tensors), q, k and v clamped at 0.3 (much of q and k, some of v), biased
    # attention.
    "olmo": (
        "OlmoConfig",
        "OlmoForCausalLM",
        dict(intermediate_size=128, pad_token_id=0, eos_token_id=2, clip_qkv=0.3, attention_bias=True),
    ),
    # OLMo 2: norms on the sublayers' outputs, q/k RMSNorms over the whole projections.
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", dict(intermediate_size=128, pad_token_id=0, eos_token_id=2)),
    # Ministral 3: YaRN and Llama 4's query temperature, from position 16 on (within the tests' 40 tokens).
    "ministral3": (
        "Ministral3Config",
        "Ministral3ForCausalLM",
        dict(
            intermediate_size=128,
            head_dim=16,
            max_position_embeddings=256,
            pad_token_id=0,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 1_000_000.0,
                "factor": 2.0,
                "original_max_position_embeddings": 16,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
                "llama_4_scaling_beta": 0.5,
            },
        ),
    ),
    # Command R: one bias-free LayerNorm for a parallel residual, interleaved rotary, logits scaled.
    "cohere": (
        "CohereConfig",
        "CohereForCausalLM",
        dict(intermediate_size=128, logit_scale=0.25, pad_token_id=0, bos_token_id=1, eos_token_id=2),
    ),
    # Command R+: q/k LayerNorms with a weight per head ([heads, head_dim]), channels regrouped with the rotary pairs.
    "cohere-qk-norm": (
        "CohereConfig",
        "CohereForCausalLM",
        dict(intermediate_size=128, use_qk_norm=True, logit_scale=0.25, pad_token_id=0, bos_token_id=1, eos_token_id=2),
    ),
    # Command R7B / A: two rotating sliding layers (window 8) and a global one without position encoding.
    "cohere2": (
        "Cohere2Config",
        "Cohere2ForCausalLM",
        dict(
            intermediate_size=128,
            logit_scale=0.25,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        ),
    ),
    # Cohere 2 MoE: Command A's block with RMSNorms, a dense first layer (wider, global and rotating: the prefix
    # pattern 1), then a sliding layer (window 8) and a global one without position encoding; 8 experts behind a
    # sigmoid router (top 3, renormalised), 2 shared experts averaged with the routed output.
    "cohere2_moe": (
        "Cohere2MoeConfig",
        "Cohere2MoeForCausalLM",
        dict(
            head_dim=16,
            intermediate_size=32,
            prefix_dense_intermediate_size=96,
            num_experts=8,
            num_experts_per_tok=3,
            num_shared_experts=2,
            expert_selection_fn="sigmoid",
            rms_norm_eps=1e-5,
            logit_scale=0.25,
            sliding_window=8,
            layer_types=["full_attention", "sliding_attention", "full_attention"],
            mlp_layer_types=["dense", "sparse", "sparse"],
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        ),
    ),
    # Seed-OSS: q/k/v and o biases, no MLP bias.
    "seed_oss": (
        "SeedOssConfig",
        "SeedOssForCausalLM",
        dict(intermediate_size=128, head_dim=16, attention_out_bias=True, pad_token_id=0, bos_token_id=1),
    ),
    # ERNIE 4.5: biases everywhere, rotary on interleaved pairs.
    "ernie4_5": ("Ernie4_5Config", "Ernie4_5ForCausalLM", dict(intermediate_size=128, head_dim=16, use_bias=True)),
    # Arcee AFM: an ungated ReLU-squared MLP.
    "arcee": (
        "ArceeConfig",
        "ArceeForCausalLM",
        dict(intermediate_size=128, head_dim=16, bos_token_id=1, eos_token_id=2),
    ),
    # BitNet b1.58 (its bf16 master weights): sub-norms before o_proj and down_proj, a gated ReLU-squared MLP.
    "bitnet": (
        "BitNetConfig",
        "BitNetForCausalLM",
        dict(intermediate_size=128, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2),
    ),
    # EXAONE 3.5: Llama's model under its own tensor and config names, llama3 rope scaling.
    "exaone": (
        "ExaoneConfig",
        "LlamaForCausalLM",
        dict(
            intermediate_size=128,
            bos_token_id=1,
            eos_token_id=2,
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=1_000_000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
            ),
        ),
    ),
    # IQuest-Coder: Llama's model, a head_dim apart from hidden / heads, biases.
    "iquestcoder": (
        "IQuestCoderConfig",
        "LlamaForCausalLM",
        dict(intermediate_size=128, head_dim=24, attention_bias=True, bos_token_id=1, eos_token_id=2),
    ),
    # InternLM3: Llama's model, biases everywhere, dynamic NTK rope (within max_position_embeddings).
    "internlm3": (
        "InternLM3Config",
        "LlamaForCausalLM",
        dict(
            intermediate_size=128,
            head_dim=16,
            attention_bias=True,
            mlp_bias=True,
            max_position_embeddings=256,
            rope_parameters=dict(rope_type="dynamic", rope_theta=50000.0, factor=6.0),
            bos_token_id=1,
            eos_token_id=2,
        ),
    ),
    # Mellum 2: Qwen3-MoE's attention in sliding and global layers (a rope base of each kind's), experts where
    # mlp_layer_types says sparse.
    "mellum": (
        "MellumConfig",
        "MellumForCausalLM",
        dict(
            head_dim=16,
            intermediate_size=128,
            moe_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=False,
            attention_bias=True,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            mlp_layer_types=["dense", "sparse", "sparse"],
            rope_parameters={
                "full_attention": {"rope_type": "default", "rope_theta": 500_000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
            },
            eos_token_id=2,
        ),
    ),
    # Hy3: per-head q/k norms, DeepSeek-V3's kind of experts (biased sigmoid choice, scaled) after a dense layer,
    # two shared experts.
    "hy_v3": (
        "HYV3Config",
        "HYV3ForCausalLM",
        dict(
            head_dim=16,
            intermediate_size=128,
            moe_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            num_shared_experts=2,
            router_scaling_factor=1.5,
            attention_bias=True,
            eos_token_id=2,
        ),
    ),
    # MiniCPM3: latent attention with low-rank queries, rotate-half rope channels, muP's three scalars.
    "minicpm3": (
        "MiniCPM3Config",
        "MiniCPM3ForCausalLM",
        dict(
            num_key_value_heads=4,
            intermediate_size=128,
            q_lora_rank=32,
            kv_lora_rank=16,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=12,
            scale_emb=3.0,
            scale_depth=2.0,
            dim_model_base=16,
            bos_token_id=1,
            eos_token_id=2,
        ),
    ),
    # AFMoE (Trinity): sandwich norms, gated attention output, sliding layers rotating and a global one without
    # position encoding, DeepSeek-V3's kind of experts after a dense layer with two shared experts, muP's embedding.
    "afmoe": (
        "AfmoeConfig",
        "AfmoeForCausalLM",
        dict(
            head_dim=16,
            intermediate_size=128,
            moe_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            num_shared_experts=2,
            route_scale=2.0,
            sliding_window=8,
            global_attn_every_n_layers=2,
            mup_enabled=True,
            eos_token_id=2,
        ),
    ),
    # OLMoE: whole-projection q/k norms and 8 experts, top 2 (not renormalised).
    "olmoe": (
        "OlmoeConfig",
        "OlmoeForCausalLM",
        dict(intermediate_size=32, num_experts=8, num_experts_per_tok=2, pad_token_id=0, eos_token_id=2),
    ),
    # FlexOlmo: OLMo 2's norms after the sublayers and over the whole q/k projections, OLMoE's experts (renormalised).
    "flex_olmo": (
        "FlexOlmoConfig",
        "FlexOlmoForCausalLM",
        dict(
            intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            pad_token_id=0,
            eos_token_id=2,
        ),
    ),
    # OLMoE with q, k and v clamped (after its q/k norms) at 0.3: most q/k values and a few of v's are cut.
    "olmoe-clip": (
        "OlmoeConfig",
        "OlmoeForCausalLM",
        dict(intermediate_size=32, num_experts=8, num_experts_per_tok=2, pad_token_id=0, eos_token_id=2, clip_qkv=0.3),
    ),
    # GPT-OSS: softmax sinks, biased attention, a sliding layer (window 8) between global ones, YaRN unrounded,
    # 8 biased experts with the clamped SwiGLU, 2 a token, a biased router.
    "gpt_oss": (
        "GptOssConfig",
        "GptOssForCausalLM",
        dict(
            head_dim=16,
            intermediate_size=32,
            num_local_experts=8,
            num_experts_per_tok=2,
            sliding_window=8,
            swiglu_limit=1.5,
            pad_token_id=0,
            eos_token_id=2,
        ),
    ),
    # GLM-4.5: biased q/k/v, q/k norms, rotary over half of each head (of 32), DeepSeek-V3's router (sigmoid,
    # selection bias, 2 groups of which 1 is used, scaled weights), a shared expert, the first layer dense.
    "glm4_moe": (
        "Glm4MoeConfig",
        "Glm4MoeForCausalLM",
        dict(
            head_dim=32,
            intermediate_size=128,
            moe_intermediate_size=32,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_shared_experts=1,
            n_group=2,
            topk_group=1,
            first_k_dense_replace=1,
            use_qk_norm=True,
            attention_bias=True,
            routed_scaling_factor=1.5,
            pad_token_id=0,
            eos_token_id=2,
        ),
    ),
    # Sarvam MoE: GLM-4.5's model under its own names (fused q/k/v rows), every channel rotating.
    "sarvam_moe": (
        "SarvamMoEConfig",
        "Glm4MoeForCausalLM",
        dict(
            head_dim=16,
            intermediate_size=128,
            moe_intermediate_size=32,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_shared_experts=1,
            n_group=2,
            topk_group=1,
            first_k_dense_replace=1,
            attention_bias=True,
            routed_scaling_factor=1.5,
            eos_token_id=2,
        ),
    ),
    # Granite 3.x MoE: Granite's four scalars, 8 experts stacked under their own names, top-2 of the logits.
    "granitemoe": (
        "GraniteMoeConfig",
        "GraniteMoeForCausalLM",
        dict(
            intermediate_size=32,
            num_local_experts=8,
            num_experts_per_tok=2,
            embedding_multiplier=12.0,
            residual_multiplier=0.22,
            attention_multiplier=0.09,
            logits_scaling=4.0,
            pad_token_id=0,
            eos_token_id=2,
        ),
    ),
    # JetMoE: attention experts (top 2 of 4, each 2 heads of 16 over the 2 shared KV heads: 4 query heads) and MLP
    # experts of width 32, each with an output bias; untied head; rope base away from its default.
    "jetmoe": (
        "JetMoeConfig",
        "JetMoeForCausalLM",
        dict(
            intermediate_size=32,
            kv_channels=16,
            # its default 0.01 leaves the hidden states far smaller than the output biases (perturbed to 0.1):
            # every token would predict the same
            initializer_range=0.1,
            num_local_experts=4,
            num_experts_per_tok=2,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
            pad_token_id=0,
            eos_token_id=2,
        ),
    ),
    # Ministral (8B): Mistral's block, a sliding window of 8 in the first and last layers, the middle one global.
    "ministral": (
        "MinistralConfig",
        "MinistralForCausalLM",
        dict(
            intermediate_size=128,
            head_dim=16,  # transformers' Ministral reads no default for it
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        ),
    ),
    # Solar Open: Llama's attention (biased q/k/v) with GLM-4.5's experts in every layer (2 groups of 4, one used;
    # a shared expert).
    "solar_open": (
        "SolarOpenConfig",
        "SolarOpenForCausalLM",
        dict(
            head_dim=16,
            moe_intermediate_size=32,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_shared_experts=1,
            n_group=2,
            topk_group=1,
            routed_scaling_factor=2.0,
            attention_bias=True,
            pad_token_id=0,
            eos_token_id=2,
        ),
    ),
    # GLM-4.7-Flash's block: DeepSeek-V3's latent attention and experts, the dense layer chosen by mlp_layer_types
    # (the middle one here, not the first).
    "glm4_moe_lite": (
        "Glm4MoeLiteConfig",
        "Glm4MoeLiteForCausalLM",
        dict(
            num_key_value_heads=4,  # latent attention: every head its own key and value
            intermediate_size=96,
            moe_intermediate_size=32,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_shared_experts=1,
            n_group=2,
            topk_group=1,
            q_lora_rank=32,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            mlp_layer_types=["sparse", "dense", "sparse"],
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        ),
    ),
    # Mistral 4: DeepSeek-V3's latent attention under YaRN with Llama 4's query temperature (from position 16 here),
    # DeepSeek's experts behind a softmax router scoring 2 groups by their top two (one used).
    "mistral4": (
        "Mistral4Config",
        "Mistral4ForCausalLM",
        dict(
            num_key_value_heads=4,  # latent attention: every head its own key and value
            intermediate_size=96,
            moe_intermediate_size=32,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_shared_experts=1,
            n_group=2,
            topk_group=1,
            routed_scaling_factor=1.5,
            first_k_dense_replace=1,
            q_lora_rank=32,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            max_position_embeddings=256,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 16,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
                "llama_4_scaling_beta": 0.5,
            },
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        ),
    ),
    # MiniMax-M2: q/k norms over the whole projections, rotary over half of each head, experts in every layer
    # behind a sigmoid router with a selection bias, named as Mixtral's.
    "minimax_m2": (
        "MiniMaxM2Config",
        "MiniMaxM2ForCausalLM",
        dict(
            head_dim=16,
            rotary_dim=8,
            intermediate_size=32,
            num_local_experts=8,
            num_experts_per_tok=2,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        ),
    ),
    # MiniMax-Text-01: lightning attention (a fixed decay per head) in layers 1 and 2, full attention in 0 and 3,
    # Mixtral's experts everywhere, each residual the sublayer's normed input scaled by factors away from 1.
    "minimax": (
        "MiniMaxConfig",
        "MiniMaxForCausalLM",
        dict(
            num_hidden_layers=4,
            layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention"],
            head_dim=16,
            intermediate_size=32,
            num_local_experts=4,
            num_experts_per_tok=2,
            full_attn_alpha_factor=0.9,
            full_attn_beta_factor=1.2,
            linear_attn_alpha_factor=1.1,
            linear_attn_beta_factor=0.8,
            mlp_alpha_factor=0.7,
            mlp_beta_factor=1.3,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        ),
    ),
    # RecurrentGemma (Griffin): two RG-LRU blocks then local multi-query attention over a window of 8 (shorter than
    # the tests' sequences), an LRU narrower than the model, a 3-tap convolution, biased q/k/v, a low soft cap.
    "recurrent_gemma": (
        "RecurrentGemmaConfig",
        "RecurrentGemmaForCausalLM",
        dict(
            num_key_value_heads=1,
            intermediate_size=128,
            lru_width=48,
            conv1d_width=3,
            attention_window_size=8,
            logits_soft_cap=5.0,
            attention_bias=True,
            block_types=["recurrent", "recurrent", "attention"],
            w_init_variance_scale=1.0,  # initialisation only: livelier weights, so greedy decoding does not settle
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        ),
    ),
    # K-EXAONE: EXAONE 4's attention (sliding layers rotate, the global ones do not) in a pre-norm block, DeepSeek-V3's
    # experts (2 groups of 4, one used) with the dense layer where mlp_layer_types puts it.
    "exaone_moe": (
        "ExaoneMoeConfig",
        "ExaoneMoeForCausalLM",
        dict(
            num_hidden_layers=4,
            head_dim=16,
            intermediate_size=96,
            moe_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            num_shared_experts=1,
            n_group=2,
            topk_group=1,
            sliding_window=8,
            sliding_window_pattern=2,
            mlp_layer_types=["dense", "sparse", "sparse", "dense"],
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        ),
    ),
    # Kolibri 1: EXAONE 4's attention (two sliding layers of window 8 rotate, the global one does not) in GLM-4's
    # sandwich block, 8 experts in every layer chosen by logits + selection bias (top 3, renormalised), a shared
    # expert.
    "kolibri1": (
        "Kolibri1Config",
        "Kolibri1ForCausalLM",
        dict(
            head_dim=16,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            num_experts=8,
            num_experts_per_tok=3,
            norm_topk_prob=True,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        ),
    ),
    # Hunyuan dense: per-head q/k norms after the rotary embedding, biased attention, NTK scaling by a fixed alpha.
    "hunyuan_v1_dense": (
        "HunYuanDenseV1Config",
        "HunYuanDenseV1ForCausalLM",
        dict(
            head_dim=16,
            intermediate_size=128,
            attention_bias=True,
            rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "alpha": 1000.0, "factor": 1.0},
        ),
    ),
    # Hunyuan MoE: Hunyuan dense's attention (biased, q/k norms after the rotary embedding, NTK alpha) with 8 experts,
    # 2 a token (moe_topk listed per layer, as the released configs do), from a float32 router, and a shared MLP.
    "hunyuan_v1_moe": (
        "HunYuanMoEV1Config",
        "HunYuanMoEV1ForCausalLM",
        dict(
            head_dim=16,
            intermediate_size=32,
            num_experts=8,
            moe_topk=[2, 2, 2],
            attention_bias=True,
            rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "alpha": 1000.0, "factor": 1.0},
        ),
    ),
    # Phi-3.5-MoE: LayerNorms with biases, biased attention in windows of 8, a biased LM head, 8 experts behind the
    # SparseMixer router (a jitter of 0.1, so that some tokens' second softmax keeps a few experts and others one),
    # LongRoPE with its mscale, pre-trained on 256 positions (the engine's max_model_len: the short factors; past it
    # transformers' Phimoe keeps them where keel takes the long ones, keel.families.phimoe).
    "phimoe": (
        "PhimoeConfig",
        "PhimoeForCausalLM",
        dict(
            intermediate_size=32,
            num_local_experts=8,
            num_experts_per_tok=2,
            attention_bias=True,
            lm_head_bias=True,
            sliding_window=8,
            router_jitter_noise=0.1,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
            max_position_embeddings=1024,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "original_max_position_embeddings": 256,
                "short_factor": [1.0, 1.02, 1.1, 1.3, 1.8, 2.5, 3.0, 4.0],
                "long_factor": [1.0, 1.5, 3.0, 6.0, 12.0, 20.0, 30.0, 40.0],
                "short_mscale": 1.2,
                "long_mscale": 1.2,
            },
        ),
    ),
    # Llama 4's text model: layer 3 of 4 without position encoding (its queries' temperature from position 3,
    # floor_scale 4), the others in chunks of 8 with the weightless q/k norm; experts in layers 1 and 3 (one a token,
    # its sigmoid weight scaling the input, a shared expert), layers 0 and 2 dense and wider; interleaved rotary.
    "llama4": (
        "Llama4TextConfig",
        "Llama4ForCausalLM",
        dict(
            num_hidden_layers=4,
            head_dim=16,
            intermediate_size=32,
            intermediate_size_mlp=96,
            num_local_experts=4,
            interleave_moe_layer_step=2,
            attention_chunk_size=8,
            floor_scale=4,
            attn_scale=0.5,
            pad_token_id=0,
            eos_token_id=2,
        ),
    ),
    # Granite MoE with a shared expert: an ungated SwiGLU beside the routed experts, its gate and up rows fused.
    "granitemoeshared": (
        "GraniteMoeSharedConfig",
        "GraniteMoeSharedForCausalLM",
        dict(
            shared_intermediate_size=48,
            intermediate_size=32,
            num_local_experts=8,
            num_experts_per_tok=2,
            embedding_multiplier=12.0,
            residual_multiplier=0.22,
            attention_multiplier=0.09,
            logits_scaling=4.0,
            pad_token_id=0,
            eos_token_id=2,
        ),
    ),
    # Granite SWA: Granite's scalars and biases, softmax sinks, sliding (window 8) and global layers alternating, a
    # RoPE base per layer: the first global layer without position encoding, the other global layer's base not the
    # sliding layers'.
    "granite_swa": (
        "GraniteSWAConfig",
        "GraniteSWAForCausalLM",
        dict(
            num_hidden_layers=4,
            intermediate_size=128,
            embedding_multiplier=12.0,
            residual_multiplier=0.22,
            attention_multiplier=0.09,
            logits_scaling=4.0,
            attention_bias=True,
            mlp_bias=True,
            sliding_window=8,
            layer_types=["full_attention", "sliding_attention", "full_attention", "sliding_attention"],
            layer_rope_theta=[0, 10000.0, 500000.0, 10000.0],
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        ),
    ),
    # Granite MoE SWA: Granite MoE with a shared expert, softmax sinks, transformers' default layer_types (layer 0
    # global, the others in windows of 8) and one RoPE base.
    "granitemoe_swa": (
        "GraniteMoeSWAConfig",
        "GraniteMoeSWAForCausalLM",
        dict(
            shared_intermediate_size=48,
            intermediate_size=32,
            num_local_experts=8,
            num_experts_per_tok=2,
            embedding_multiplier=12.0,
            residual_multiplier=0.22,
            attention_multiplier=0.09,
            logits_scaling=4.0,
            sliding_window=8,
            pad_token_id=0,
            eos_token_id=2,
        ),
    ),
    # dots.llm1: Qwen3's attention with biases, DeepSeek-V3's experts (2 groups of 4, one used; 2 shared), the
    # first layer dense, the last sliding (window 8).
    "dots1": (
        "Dots1Config",
        "Dots1ForCausalLM",
        dict(
            intermediate_size=128,
            moe_intermediate_size=32,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_shared_experts=2,
            n_group=2,
            topk_group=1,
            first_k_dense_replace=1,
            norm_topk_prob=True,
            routed_scaling_factor=2.0,
            attention_bias=True,
            sliding_window=8,
            max_window_layers=2,
            pad_token_id=0,
            eos_token_id=2,
        ),
    ),
    # ERNIE 4.5 MoE: interleaved rotary, a dense first layer, 8 experts (2 a token) chosen with a selection bias
    # by a float32 softmax router, one shared expert, a tied head.
    "ernie4_5_moe": (
        "Ernie4_5_MoeConfig",
        "Ernie4_5_MoeForCausalLM",
        dict(
            intermediate_size=128,
            moe_intermediate_size=32,
            moe_num_experts=8,
            moe_k=2,
            moe_num_shared_experts=1,
            moe_layer_start_index=1,
            pad_token_id=0,
            eos_token_id=2,
        ),
    ),
    # GLM-4: sandwich norms, fused gate/up, rotary on interleaved pairs over half of each head (of 32).
    "glm4": (
        "Glm4Config",
        "Glm4ForCausalLM",
        dict(intermediate_size=128, head_dim=32, pad_token_id=0, bos_token_id=1, eos_token_id=2),
    ),
    # StarCoder2: LayerNorms, an ungated GELU MLP (c_fc, c_proj), biases everywhere, a window of 8.
    "starcoder2": (
        "Starcoder2Config",
        "Starcoder2ForCausalLM",
        dict(intermediate_size=128, sliding_window=8, bos_token_id=0, eos_token_id=2),
    ),
    # EXAONE 4: two sliding layers that rotate (window 8) and a global one without position encoding.
    "exaone4": (
        "Exaone4Config",
        "Exaone4ForCausalLM",
        dict(
            intermediate_size=128,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            tie_word_embeddings=True,
        ),
    ),
    # OLMo 3: two sliding layers (window 8, their own RoPE base) and a global one.
    "olmo3": (
        "Olmo3Config",
        "Olmo3ForCausalLM",
        dict(
            intermediate_size=128,
            pad_token_id=0,
            eos_token_id=2,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={
                "full_attention": {"rope_type": "default", "rope_theta": 500000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
        ),
    ),
    # OLMo Hybrid: Gated DeltaNet layers 0 and 2 (two key heads serving four value heads, beta in [0, 2], normed
    # before each sublayer) beside OLMo 3's post-normed, biased full-attention layers; no position encoding (the
    # releases' null rope_theta).
    "olmo_hybrid": (
        "OlmoHybridConfig",
        "OlmoHybridForCausalLM",
        dict(
            num_hidden_layers=4,
            pad_token_id=0,
            eos_token_id=2,
            intermediate_size=128,
            attention_bias=True,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=16,
            linear_value_head_dim=8,
            layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
            rope_parameters={"rope_type": "default", "rope_theta": None},
        ),
    ),
    # Gemma 3 (text): sandwich norms with (1 + w), GeGLU, sqrt(hidden) embedding, query_pre_attn_scalar, sliding
    # layers (two in three here) with their own RoPE base and linear-scaled global layers, a final soft-cap.
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(
            intermediate_size=128,
            head_dim=16,
            query_pre_attn_scalar=24,
            sliding_window=8,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            final_logit_softcapping=30.0,
            rope_parameters={
                "full_attention": {"rope_type": "linear", "rope_theta": 100000.0, "factor": 2.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 5000.0},
            },
        ),
    ),
    # Gemma 4 (text): Gemma 3's block with plain norm scales, softmax scale 1 and v norms; full-attention layers with
    # heads twice as wide, one KV head and values equal to the keys' projection (attention_k_eq_v), rotating by
    # proportional RoPE (half the frequencies turning); two sliding layers with their own RoPE, a final soft-cap.
    "gemma4": (
        "Gemma4TextConfig",
        "Gemma4ForCausalLM",
        dict(
            intermediate_size=128,
            head_dim=16,
            global_head_dim=32,
            num_global_key_value_heads=1,
            attention_k_eq_v=True,
            hidden_size_per_layer_input=0,
            sliding_window=8,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            final_logit_softcapping=30.0,
            rope_parameters={
                "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.5, "rope_theta": 10000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 5000.0},
            },
        ),
    ),
    # Gemma 4 unified: Gemma 4's decoder without per-layer inputs or experts (its config has neither key), KV sharing
    # (the last two layers over layers 1 and 2's stores) with double-wide MLPs, the full-attention layers' k = v.
    "gemma4_unified": (
        "Gemma4UnifiedTextConfig",
        "Gemma4UnifiedForCausalLM",
        dict(
            num_hidden_layers=5,
            intermediate_size=96,
            head_dim=16,
            global_head_dim=32,
            num_global_key_value_heads=1,
            attention_k_eq_v=True,
            num_kv_shared_layers=2,
            use_double_wide_mlp=True,
            sliding_window=8,
            layer_types=[
                "sliding_attention",
                "sliding_attention",
                "full_attention",
                "sliding_attention",
                "full_attention",
            ],
            final_logit_softcapping=30.0,
        ),
    ),
    # Gemma 4 MoE (26B-A4B's shape): every layer's GeGLU MLP beside 4 experts (top 2), each branch with its norms, the
    # router's own scales; the full-attention layer's heads wider with v_proj (no k = v), transformers' default RoPE.
    "gemma4-moe": (
        "Gemma4TextConfig",
        "Gemma4ForCausalLM",
        dict(
            intermediate_size=96,
            head_dim=16,
            global_head_dim=32,
            hidden_size_per_layer_input=0,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention", "full_attention"],
            enable_moe_block=True,
            num_experts=4,
            top_k_experts=2,
            moe_intermediate_size=32,
        ),
    ),
    # Gemma 4 E2B/E4B's shape: per-layer input embeddings (8 channels a layer, from a table of its own vocabulary
    # size), the full-attention layers' heads wider, the last two layers (one of each kind) attending over the K/V of
    # layers 1 and 2, their MLPs twice as wide (use_double_wide_mlp).
    "gemma4-e": (
        "Gemma4TextConfig",
        "Gemma4ForCausalLM",
        dict(
            num_hidden_layers=5,
            intermediate_size=96,
            head_dim=16,
            global_head_dim=32,
            hidden_size_per_layer_input=8,
            vocab_size_per_layer_input=320,
            num_kv_shared_layers=2,
            use_double_wide_mlp=True,
            sliding_window=8,
            layer_types=[
                "sliding_attention",
                "sliding_attention",
                "full_attention",
                "sliding_attention",
                "full_attention",
            ],
        ),
    ),
    # Gemma 3n's shape: AltUp over three copies of the stream, LAuReL of rank 8, sparse MLP gates in the first two
    # layers, per-layer input embeddings (a table shorter than the vocabulary: ids past it read row 0), the last two
    # layers attending over the K/V of layers 1 and 2; the sliding and global layers with RoPE bases of their own.
    "gemma3n": (
        "Gemma3nTextConfig",
        "Gemma3nForCausalLM",
        dict(
            num_hidden_layers=5,
            intermediate_size=96,
            head_dim=16,
            hidden_size_per_layer_input=8,
            vocab_size_per_layer_input=200,
            num_kv_shared_layers=2,
            altup_num_inputs=3,
            laurel_rank=8,
            activation_sparsity_pattern=[0.95, 0.5, 0.0, 0.0, 0.0],
            sliding_window=8,
            final_logit_softcapping=20.0,
            layer_types=[
                "sliding_attention",
                "sliding_attention",
                "full_attention",
                "sliding_attention",
                "full_attention",
            ],
            rope_parameters={
                "full_attention": {"rope_type": "default", "rope_theta": 100000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 5000.0},
            },
        ),
    ),
    # Gemma 2: Gemma 3's block without q/k norms, one RoPE, sliding and global layers alternating by transformers'
    # default rule, and attention-score soft-capping (a cap low enough here to bend the sharpened scores). Eager
    # attention: some transformers releases (5.17) run Gemma 2 under SDPA, which drops the cap.
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        dict(
            attn_implementation="eager",
            intermediate_size=128,
            head_dim=16,
            query_pre_attn_scalar=24,
            sliding_window=8,
            final_logit_softcapping=30.0,
            attn_logit_softcapping=5.0,
        ),
    ),
    # Phi (phi-2's shape): one LayerNorm feeding a parallel residual, 40% of each head rotating, biases everywhere
    # including the LM head, Phi's own names (dense, fc1/fc2, final_layernorm).
    "phi": (
        "PhiConfig",
        "PhiForCausalLM",
        dict(num_key_value_heads=4, intermediate_size=256, partial_rotary_factor=0.4),  # 4 x hidden, as released
    ),
    # ... with q/k LayerNorms (with biases) over each head, one weight for all heads, grouped KV heads.
    "phi-qk-norm": (
        "PhiConfig",
        "PhiForCausalLM",
        dict(intermediate_size=128, partial_rotary_factor=0.5, qk_layernorm=True),
    ),
    # Gemma: Llama's block with (1 + w) norms, a sqrt(hidden) embedding, the tanh GELU (the released configs' legacy
    # "gelu"), a tied head.
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(intermediate_size=128, head_dim=16, hidden_act="gelu")),
    # DeepSeek-V2: multi-head latent attention with DeepSeek-V2-Lite's full-rank q_proj, YaRN with mscale, a float32
    # softmax router choosing in the best of 2 groups of 4 (group_limited_greedy), weights scaled, 2 shared experts;
    # layer 0 dense.
    "deepseek_v2": (
        "DeepseekV2Config",
        "DeepseekV2ForCausalLM",
        dict(
            num_key_value_heads=4,
            intermediate_size=128,
            q_lora_rank=None,
            kv_lora_rank=16,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            n_routed_experts=8,
            n_shared_experts=2,
            num_experts_per_tok=2,
            topk_method="group_limited_greedy",
            n_group=2,
            topk_group=1,
            routed_scaling_factor=1.5,
            first_k_dense_replace=1,
            moe_intermediate_size=32,
            max_position_embeddings=16384,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 4096,
                "mscale": 0.707,
                "mscale_all_dim": 0.707,
                "beta_fast": 32,
                "beta_slow": 1,
            },
        ),
    ),
    # Multi-head latent attention + DeepSeek's MoE (sigmoid router, selection bias, groups, ungated
    # shared expert; layer 0 dense). transformers' reference needs num_key_value_heads == heads.
    "deepseek_v3": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        dict(
            num_key_value_heads=4,
            intermediate_size=128,
            q_lora_rank=32,
            kv_lora_rank=16,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            n_routed_experts=8,
            n_shared_experts=1,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            first_k_dense_replace=1,
            moe_intermediate_size=32,
            rope_interleave=True,
        ),
    ),
    # Sarvam MLA: DeepSeek-V3's model, queries without the low-rank path by default, one expert group.
    "sarvam_mla": (
        "SarvamMLAConfig",
        "DeepseekV3ForCausalLM",
        dict(
            num_key_value_heads=4,
            intermediate_size=128,
            kv_lora_rank=16,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            n_routed_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            routed_scaling_factor=1.5,
            eos_token_id=2,
        ),
    ),
    # MLA without the low-rank query (q_proj), rotary pairs not interleaved, YaRN with DeepSeek's
    # mscale/mscale_all_dim (a cos/sin factor != 1 and a softmax correction), all layers dense.
    "deepseek_v3-mla": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        dict(
            num_key_value_heads=4,
            intermediate_size=128,
            q_lora_rank=None,
            kv_lora_rank=16,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=24,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            first_k_dense_replace=3,
            moe_intermediate_size=32,
            rope_interleave=False,
            max_position_embeddings=16384,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 4096,
                "mscale": 1.0,
                "mscale_all_dim": 0.5,
                "beta_fast": 32,
                "beta_slow": 1,
            },
        ),
    ),
    # GLM-4 (glm-4-9b): biased q/k/v, fused gate_up_proj, rotary over half of each head on interleaved pairs.
    "glm": ("GlmConfig", "GlmForCausalLM", dict(intermediate_size=128, head_dim=32, pad_token_id=0, eos_token_id=2)),
    # Code World Model: layer 0 global, the others in windows of 8; its default llama3 rotary scaling.
    "cwm": ("CwmConfig", "CwmForCausalLM", dict(intermediate_size=128, head_dim=16, sliding_window=8)),
    # Helium: rotary on interleaved pairs over the whole head, biased q/k/v (not o), MLP biases.
    "helium": (
        "HeliumConfig",
        "HeliumForCausalLM",
        dict(intermediate_size=128, head_dim=16, attention_bias=True, mlp_bias=True),
    ),
    # Jais 2: biased LayerNorms, an ungated ReLU-squared MLP, biases everywhere.
    "jais2": ("Jais2Config", "Jais2ForCausalLM", dict(intermediate_size=128, layer_norm_eps=1e-4)),
    # Nemotron: LayerNorms scaling by (1 + w), half of each head rotating, an ungated ReLU-squared MLP, biases.
    "nemotron": (
        "NemotronConfig",
        "NemotronForCausalLM",
        dict(intermediate_size=128, attention_bias=True, mlp_bias=True, norm_eps=1e-4),
    ),
    # VaultGemma: Gemma 2 without the norms on the sublayers' outputs; windows of 8 on even layers, soft-caps.
    "vaultgemma": (
        "VaultGemmaConfig",
        "VaultGemmaForCausalLM",
        dict(intermediate_size=128, head_dim=16, sliding_window=8, query_pre_attn_scalar=24),
    ),
    # HyperCLOVA X: Granite's multipliers, norms on the sublayers' outputs, the logits multiplied by their scale.
    "hyperclovax": (
        "HyperCLOVAXConfig",
        "HyperCLOVAXForCausalLM",
        dict(
            intermediate_size=128,
            embedding_multiplier=3.0,
            residual_multiplier=0.5,
            attention_multiplier=0.2,
            logits_scaling=0.25,
            attention_bias=True,
        ),
    ),
    # Apertus: per-head q/k norms, an ungated MLP of xIELU with its own parameters per layer (perturbed below),
    # llama3 rotary scaling by default.
    "apertus": ("ApertusConfig", "ApertusForCausalLM", dict(intermediate_size=128, head_dim=16)),
    # Apertus 1.5 (text): Apertus's block with biased attention; its head unpruned here (a pruned one leaves rows of
    # the embedding unread, which `keel convert` cannot write back: tests/test_families.py).
    "apertus1p5": (
        "Apertus1p5TextConfig",
        "Apertus1p5TextForCausalLM",
        dict(intermediate_size=128, head_dim=16, attention_bias=True),
    ),
    # Qwen3.5: Gated DeltaNet layers 0, 1 and 3 (two key heads serving four value heads), layer 2 full attention
    # with its output gate, q/k norms and a quarter of each head rotating; (1 + w) norms.
    "qwen3_5": (
        "Qwen3_5TextConfig",
        "Qwen3_5ForCausalLM",
        dict(
            num_hidden_layers=4,
            intermediate_size=128,
            head_dim=32,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=16,
            linear_value_head_dim=8,
            layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
        ),
    ),
    # Qwen3.5 MoE: Qwen3.5's hybrid layers with experts everywhere (softmax top 2 of 4, renormalised) and a gated
    # shared expert.
    "qwen3_5_moe": (
        "Qwen3_5MoeTextConfig",
        "Qwen3_5MoeForCausalLM",
        dict(
            num_hidden_layers=4,
            head_dim=32,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=16,
            linear_value_head_dim=8,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        ),
    ),
    # Qwen3-Next: the same hybrid block, its Gated DeltaNet projections fused and grouped by key head (two value
    # heads per key head here), experts with layer 1 dense.
    "qwen3_next": (
        "Qwen3NextConfig",
        "Qwen3NextForCausalLM",
        dict(
            num_hidden_layers=4,
            intermediate_size=96,
            head_dim=32,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=16,
            linear_value_head_dim=8,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            mlp_only_layers=[1],
        ),
    ),
    # Kimi Linear: Kimi Delta Attention layers (a decay per key channel, kernel 3) around an unrotated latent-attention
    # layer (q_lora_rank set), DeepSeek-V3's experts in two groups with layer 0 dense.
    "kimi_linear": (
        "KimiLinearConfig",
        "KimiLinearForCausalLM",
        dict(
            num_hidden_layers=4,
            layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
            num_key_value_heads=4,  # latent attention: every head its own key and value
            intermediate_size=96,
            moe_intermediate_size=32,
            num_local_experts=8,
            num_experts_per_tok=2,
            n_shared_experts=1,
            n_group=2,
            topk_group=1,
            routed_scaling_factor=1.5,
            q_lora_rank=32,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            linear_head_dim=16,
            linear_num_heads=2,
            linear_conv_kernel_dim=3,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        ),
    ),
    # Bailing Hybrid (Ling 3): KDA layers with full-rank decay and gate, the decay bounded at -3 (kda_safe_gate), every
    # second layer latent attention with a gate per head (low-rank query); DeepSeek-V3's experts in two groups with
    # layer 0 dense; Ling's names in the checkpoint (transformers writes them back on save).
    "bailing_hybrid": (
        "BailingHybridConfig",
        "BailingHybridForCausalLM",
        dict(
            num_hidden_layers=4,
            layer_group_size=2,
            num_key_value_heads=4,
            intermediate_size=96,
            moe_intermediate_size=32,
            num_local_experts=8,
            num_experts_per_tok=2,
            n_shared_experts=1,
            n_group=2,
            topk_group=1,
            routed_scaling_factor=1.5,
            first_k_dense_replace=1,
            q_lora_rank=32,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            head_dim=16,
            short_conv_kernel_size=3,
            kda_lower_bound=-3.0,
            rope_theta=10000.0,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        ),
    ),
    # LFM2: gated short convolutions in layers 0, 1 and 3 (biased, kernel 3), attention with q/k norms in layer 2; the
    # MLP's width adjusted from intermediate_size (2/3, rounded up to 32).
    "lfm2": (
        "Lfm2Config",
        "Lfm2ForCausalLM",
        dict(
            num_hidden_layers=4,
            intermediate_size=192,
            block_multiple_of=32,
            full_attn_idxs=[2],
            conv_bias=True,
        ),
    ),
    # LFM2 MoE: layer 0 dense, experts after it (a sigmoid router with a selection bias, top 2 of 4, scaled by 1.5),
    # attention in layer 2.
    "lfm2_moe": (
        "Lfm2MoeConfig",
        "Lfm2MoeForCausalLM",
        dict(
            num_hidden_layers=4,
            intermediate_size=96,
            moe_intermediate_size=32,
            num_experts=4,
            num_experts_per_tok=2,
            num_dense_layers=1,
            routed_scaling_factor=1.5,
            layer_types=["conv", "conv", "full_attention", "conv"],
        ),
    ),
    # Granite 4.0-H: Mamba 2 mixers in layers 0, 1 and 3 (4 heads of 32 in 2 groups, state 16, biased convolution),
    # attention without position encoding in layer 2, Granite's scalars, experts plus the shared MLP; and its dense
    # form (the shared MLP alone) with rotary attention.
    "granitemoehybrid": (
        "GraniteMoeHybridConfig",
        "GraniteMoeHybridForCausalLM",
        dict(
            num_hidden_layers=4,
            intermediate_size=32,
            shared_intermediate_size=48,
            num_local_experts=4,
            num_experts_per_tok=2,
            mamba_n_heads=4,
            mamba_d_head=32,
            mamba_n_groups=2,
            mamba_d_state=16,
            embedding_multiplier=12.0,
            residual_multiplier=0.22,
            attention_multiplier=0.09,
            logits_scaling=4.0,
            layer_types=["mamba", "mamba", "attention", "mamba"],
        ),
    ),
    "granitemoehybrid-dense": (
        "GraniteMoeHybridConfig",
        "GraniteMoeHybridForCausalLM",
        dict(
            num_hidden_layers=3,
            shared_intermediate_size=96,
            num_local_experts=0,
            mamba_n_heads=8,
            mamba_d_state=16,
            position_embedding_type="rope",
            layer_types=["mamba", "attention", "mamba"],
        ),
    ),
    # Bamba: Mamba 2 mixers with attention in layer 1 (half of each head rotating), Llama's MLP.
    "bamba": (
        "BambaConfig",
        "BambaForCausalLM",
        dict(intermediate_size=128, attn_layer_indices=[1], mamba_n_heads=8, mamba_n_groups=2, mamba_d_state=16),
    ),
    # Nemotron-H: one sublayer a layer, each kind once or more (Mamba 2, attention without position encoding, an ungated
    # relu2 MLP, ungated relu2 experts routed by groups with a selection bias plus a shared expert), biases on.
    "nemotron_h": (
        "NemotronHConfig",
        "NemotronHForCausalLM",
        dict(
            layers_block_type=["linear_attention", "full_attention", "mlp", "moe", "linear_attention", "moe"],
            head_dim=16,
            intermediate_size=96,
            mlp_bias=True,
            mamba_num_heads=8,
            mamba_head_dim=16,
            n_groups=2,
            ssm_state_size=16,
            use_bias=True,
            n_routed_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            moe_shared_expert_intermediate_size=48,
            n_group=2,
            topk_group=1,
            routed_scaling_factor=2.5,
        ),
    ),
    # Zamba 2: Mamba 2 mixers (4 heads of 32, 2 groups) in every layer, a shared transformer block before the mixer of
    # the three hybrid layers, two blocks taken in turn (the first runs twice), adapters of rank 8 on gate/up and
    # q/k/v, rotary, biases (add_bias_linear), the step's lower limit away from its default.
    "zamba2": (
        "Zamba2Config",
        "Zamba2ForCausalLM",
        dict(
            num_hidden_layers=5,
            num_key_value_heads=4,
            layers_block_type=["mamba", "hybrid", "mamba", "hybrid", "hybrid"],
            intermediate_size=96,
            n_mamba_heads=4,
            mamba_d_state=16,
            mamba_ngroups=2,
            chunk_size=8,
            num_mem_blocks=2,
            use_shared_attention_adapter=True,
            adapter_rank=8,
            use_mem_rope=True,
            add_bias_linear=True,
            time_step_min=0.01,
        ),
    ),
    # Zamba 2's other form: no q/k/v adapters (grouped keys and values then), no rotary, an untied head (each hybrid
    # layer a block of its own in transformers: num_mem_blocks as many), no biases, a hybrid layer first.
    "zamba2-plain": (
        "Zamba2Config",
        "Zamba2ForCausalLM",
        dict(
            num_hidden_layers=4,
            layers_block_type=["hybrid", "mamba", "mamba", "hybrid"],
            intermediate_size=80,
            n_mamba_heads=8,
            mamba_d_state=8,
            chunk_size=4,
            num_mem_blocks=2,
            adapter_rank=4,
            tie_word_embeddings=False,
        ),
    ),
    # Nemotron Nano 2 / Nemotron-H dense: M, * and - layers from the older hybrid_override_pattern, no conv bias.
    "nemotron_h-dense": (
        "NemotronHConfig",
        "NemotronHForCausalLM",
        dict(
            hybrid_override_pattern="M-*-M-",
            num_hidden_layers=6,
            head_dim=16,
            intermediate_size=96,
            mamba_num_heads=4,
            mamba_head_dim=32,
            n_groups=1,
            ssm_state_size=16,
            use_conv_bias=False,
            tie_word_embeddings=True,
        ),
    ),
    # Falcon-H1: attention and a Mamba 2 mixer (6 heads of 16 in mamba_d_ssm 96, 2 groups) side by side in every
    # layer, every muP multiplier away from 1, the gated norm after the gate (Falcon-H1R's), biased q/k/v/o and
    # out_proj (projectors_bias) but not in_proj.
    "falcon_h1": (
        "FalconH1Config",
        "FalconH1ForCausalLM",
        dict(
            intermediate_size=96,
            mamba_d_ssm=96,
            mamba_n_heads=6,
            mamba_n_groups=2,
            mamba_d_state=16,
            mamba_chunk_size=8,
            mamba_rms_norm=True,
            mamba_norm_before_gate=False,
            projectors_bias=True,
            attention_bias=True,
            embedding_multiplier=5.656854249492381,
            lm_head_multiplier=0.0390625,
            key_multiplier=0.390625,
            attention_in_multiplier=1.5,
            attention_out_multiplier=0.9375,
            ssm_in_multiplier=1.25,
            ssm_out_multiplier=0.23570226039551587,
            ssm_multipliers=[0.3535533905932738, 0.25, 0.3535533905932738, 0.5, 0.3535533905932738],
            mlp_multipliers=[0.8838834764831844, 0.5859375],
        ),
    ),
    # Falcon-H1's other forms: the mixer's output gated without a norm (the 0.5B's), mamba_expand x hidden_size
    # channels (mamba_d_ssm null), a tied LM head, no biases.
    "falcon_h1-gated": (
        "FalconH1Config",
        "FalconH1ForCausalLM",
        dict(
            intermediate_size=96,
            tie_word_embeddings=True,
            mamba_d_ssm=None,
            mamba_n_heads=8,
            mamba_d_state=16,
            embedding_multiplier=2.0,
            lm_head_multiplier=0.75,
            key_multiplier=0.5,
            ssm_multipliers=[0.5, 1.5, 0.75, 1.25, 0.8],
            mlp_multipliers=[1.2, 0.7],
        ),
    ),
    # Mamba 2: every layer a Mamba 2 mixer without a feed-forward sublayer (8 heads of 16 in 2 groups, state 16,
    # biased projections, the step clamped above; transformers' scan in chunks of 16: its reference pads to them).
    "mamba2": (
        "Mamba2Config",
        "Mamba2ForCausalLM",
        dict(
            num_heads=8,
            head_dim=16,
            n_groups=2,
            state_size=16,
            use_bias=True,
            time_step_limit=(0.0, 4.0),
            chunk_size=16,
        ),
    ),
    # Mamba: every layer a Mamba 1 mixer without a feed-forward sublayer (128 channels, state 8, a step of rank 6,
    # biased projections, kernel 3), untied head. Falcon Mamba: its step, B and C RMS-normed without weights.
    "mamba": (
        "MambaConfig",
        "MambaForCausalLM",
        dict(state_size=8, time_step_rank=6, conv_kernel=3, use_bias=True, tie_word_embeddings=False),
    ),
    "falcon_mamba": ("FalconMambaConfig", "FalconMambaForCausalLM", dict(state_size=8, mixer_rms_eps=1e-3)),
    # Jamba: attention (no position encoding) in layer 1 of 4, Mamba 1 mixers with step/B/C norms elsewhere (state 8,
    # a step of rank 6, biased projections), experts in layers 1 and 3 (the top 2 of 4, not renormalised), Llama's
    # MLP in layers 0 and 2.
    "jamba": (
        "JambaConfig",
        "JambaForCausalLM",
        dict(
            num_hidden_layers=4,
            intermediate_size=64,
            attn_layer_period=4,
            attn_layer_offset=1,
            expert_layer_period=2,
            expert_layer_offset=1,
            num_experts=4,
            mamba_d_state=8,
            mamba_dt_rank=6,
            mamba_proj_bias=True,
        ),
    ),
    # Youtu-LLM: DeepSeek-V3's latent attention (low-rank q, interleaved rotary) with a dense MLP in every layer.
    "youtu": (
        "YoutuConfig",
        "YoutuForCausalLM",
        dict(
            num_key_value_heads=4,
            intermediate_size=128,
            q_lora_rank=32,
            kv_lora_rank=16,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            rope_interleave=True,
            initializer_range=0.02,  # its default, 2 / sqrt(5 * hidden), with the sharpened q/k: chaotic logits
        ),
    ),
    # GPT-BigCode: learned positions (256 of them: the engine's tests serve 256), one key/value head (multi_query),
    # biased LayerNorms, an ungated gelu_pytorch_tanh MLP, the head tied.
    "gpt_bigcode": ("GPTBigCodeConfig", "GPTBigCodeForCausalLM", dict(n_inner=128, n_positions=256)),
    # Without multi_query: each head's q, k, v interleaved in c_attn; no softmax scale, erf GELU, an untied head.
    "gpt_bigcode-mha": (
        "GPTBigCodeConfig",
        "GPTBigCodeForCausalLM",
        dict(
            n_inner=96,
            n_positions=256,
            multi_query=False,
            scale_attn_weights=False,
            activation_function="gelu",
            tie_word_embeddings=False,
        ),
    ),
    # GPT-2: learned positions, multi-head attention in c_attn's thirds, every weight a Conv1D stored [in, out].
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(n_inner=128, n_positions=256)),
    # Layer i's softmax scale divided by i + 1, the reordered eager softmax, ReLU 4 x hidden wide, an untied head.
    "gpt2-scaled": (
        "GPT2Config",
        "GPT2LMHeadModel",
        dict(
            n_positions=256,
            scale_attn_by_inverse_layer_idx=True,
            reorder_and_upcast_attn=True,
            activation_function="relu",
            tie_word_embeddings=False,
        ),
    ),
    # BLOOM: ALiBi over 6 heads (not a power of two: the interleaved slopes too), a biased LayerNorm after the
    # embedding, q/k/v per head in one query_key_value, biased LayerNorms and projections, a tanh-GELU MLP.
    "bloom": ("BloomConfig", "BloomForCausalLM", dict(hidden_size=96, num_attention_heads=6)),
    # MPT: ALiBi over 6 heads (interleaved slopes), q/k/v clamped (clip_qkv) at another softmax scale, weight-only
    # LayerNorms, no biases, an exact-GELU MLP, a tied head.
    "mpt": (
        "MptConfig",
        "MptForCausalLM",
        dict(hidden_size=96, num_attention_heads=6, attn_config=dict(clip_qkv=0.6, softmax_scale=0.4)),
    ),
    # Falcon-RW: ALiBi (before the softmax scale) in place of rotary, Llama's sequential block with LayerNorms, q/k/v
    # per head (neither multi_query nor the new architecture), biases.
    "falcon-rw": (
        "FalconConfig",
        "FalconForCausalLM",
        dict(ffn_hidden_size=128, alibi=True, multi_query=False, parallel_attn=False, bias=True),
    ),
    # Falcon-7B's block: attention and MLP in parallel from one LayerNorm, one key/value head (multi_query), no biases.
    "falcon": ("FalconConfig", "FalconForCausalLM", dict(ffn_hidden_size=128)),
    # Falcon-40B's: two LayerNorms (ln_attn, ln_mlp) feeding the parallel branches, q/k/v grouped by 2 KV heads,
    # biases, the tanh GELU, an untied head.
    "falcon-40b": (
        "FalconConfig",
        "FalconForCausalLM",
        dict(
            ffn_hidden_size=96,
            new_decoder_architecture=True,
            num_kv_heads=2,
            bias=True,
            activation="gelu_pytorch_tanh",
            tie_word_embeddings=False,
        ),
    ),
    # GPT-J: one LayerNorm feeding attention and MLP in parallel, rotary on interleaved pairs over the first 8 of each
    # head's 16 channels, unbiased attention, a biased tanh-GELU MLP and LM head.
    "gptj": ("GPTJConfig", "GPTJForCausalLM", dict(n_inner=96, rotary_dim=8)),
    # Persimmon: biased LayerNorms, q/k/v interleaved per head in one biased tensor, biased q/k LayerNorms per head
    # (one weight for all heads), rotary over a quarter of each head, an ungated biased ReLU-squared MLP, untied.
    "persimmon": (
        "PersimmonConfig",
        "PersimmonForCausalLM",
        dict(
            intermediate_size=96,
            num_key_value_heads=None,
            rope_parameters={"rope_type": "default", "rope_theta": 2000.0, "partial_rotary_factor": 0.25},
            layer_norm_eps=1e-4,
        ),
    ),
    # CodeGen: GPT-J's block with q/v/k fused in 4 model-parallel shards (two of its 8 heads in each), rotary on
    # interleaved pairs over the first 4 of each head's 8 channels.
    "codegen": ("CodeGenConfig", "CodeGenForCausalLM", dict(n_inner=96, num_attention_heads=8, rotary_dim=4)),
    # OPT: learned positions from row 2 of their table, biased LayerNorms, a biased ReLU MLP, a tied head.
    "opt": ("OPTConfig", "OPTForCausalLM", dict(ffn_dim=96, max_position_embeddings=256)),
    # Without biases (enable_bias), LayerNorms without weights (layer_norm_elementwise_affine), GELU, an untied head.
    "opt-plain": (
        "OPTConfig",
        "OPTForCausalLM",
        dict(
            ffn_dim=96,
            max_position_embeddings=256,
            enable_bias=False,
            layer_norm_elementwise_affine=False,
            activation_function="gelu",
            tie_word_embeddings=False,
        ),
    ),
    # DBRX: unbiased LayerNorms, fused Wqkv clamped to +-clip_qkv, its RoPE base under attn_config (and the top-level
    # one transformers 5 reads, equal), 4 experts of 2 per token from a softmax router, the top-k weights divided by
    # their sum, the experts' weights fused by rows (w2 holding each expert's down projection transposed).
    "dbrx": (
        "DbrxConfig",
        "DbrxForCausalLM",
        dict(
            d_model=64,  # by its own name: DbrxConfig gives ffn_config the width before the alias is set
            max_seq_len=256,
            attn_config={"kv_n_heads": 2, "clip_qkv": 0.5, "rope_theta": 5000.0},
            ffn_config={"ffn_hidden_size": 48, "moe_num_experts": 4, "moe_top_k": 2},
            rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
        ),
    ),
    # OPT-350m's block: each LayerNorm after its residual add, no final norm, a narrower embedding (and tied head)
    # with project_in / project_out between it and the model.
    "opt-350m": (
        "OPTConfig",
        "OPTForCausalLM",
        dict(ffn_dim=96, max_position_embeddings=256, do_layer_norm_before=False, word_embed_proj_dim=32),
    ),
    # Flint: Qwen3-MoE's q/k norms, biased attention, softmax sinks, sliding layers (window 8) rotating around a full
    # one without position encoding, a dense layer 1 (not the default first two) between layers of 8 experts routed
    # by an unbiased sigmoid, 2 a token, not renormalised, and an ungated shared expert.
    "flint": (
        "FlintConfig",
        "FlintForCausalLM",
        dict(
            head_dim=16,
            intermediate_size=96,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=False,
            attention_bias=True,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            mlp_only_layers=[1],
            eos_token_id=2,
        ),
    ),
    # LFM3: short convolutions (kernel 4, biased) around a sliding layer (window 8, plain RoPE at its own theta) and a
    # full one (proportional RoPE turning a quarter of the frequencies), Qwen3's biased attention with q/k norms and
    # the output gated per head, sandwich norms, an untied head.
    "lfm3": (
        "Lfm3Config",
        "Lfm3ForCausalLM",
        dict(
            num_hidden_layers=4,
            head_dim=16,
            intermediate_size=96,
            layer_types=["conv", "sliding_attention", "full_attention", "conv"],
            sliding_window=8,
            attention_bias=True,
            conv_bias=True,
            conv_L_cache=4,
            tie_word_embeddings=False,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                "full_attention": {"rope_type": "proportional", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
            },
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        ),
    ),
    # A.X-K1: DeepSeek-V3's latent attention (biased, rotary on halves, not the default interleaved pairs) and experts
    # (2 groups, 1 used; two shared experts; scaled), the MoE output normed; layer 2 of 4 alone sparse from DeepSeek's
    # first_k_dense_replace and moe_layer_freq.
    "axk1": (
        "AXK1Config",
        "AXK1ForCausalLM",
        dict(
            num_hidden_layers=4,
            num_key_value_heads=4,
            intermediate_size=96,
            moe_intermediate_size=32,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_shared_experts=2,
            n_group=2,
            topk_group=1,
            routed_scaling_factor=1.5,
            q_lora_rank=32,
            kv_lora_rank=16,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=12,
            rope_interleave=False,
            attention_bias=True,
            first_k_dense_replace=1,
            moe_layer_freq=2,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        ),
    ),
    # DeepSeek-V3.2: DeepSeek-V3's latent attention and experts (the first layer dense) under YaRN with DeepSeek Sparse
    # Attention: each query attends to the 4 keys its indexer picks (fewer than the tests' prompts: the selection
    # matters).
    "deepseek_v32": (
        "DeepseekV32Config",
        "DeepseekV32ForCausalLM",
        dict(
            num_key_value_heads=4,
            intermediate_size=96,
            moe_intermediate_size=32,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_shared_experts=1,
            n_group=2,
            topk_group=1,
            q_lora_rank=32,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            first_k_dense_replace=1,
            max_position_embeddings=256,
            # YaRN: its cos/sin attention factor reaches the indexer's rotary too (transformers rotates with them)
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 64,
                "beta_fast": 32,
                "beta_slow": 1,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
            },
            index_topk=4,
            index_n_heads=16,  # many heads: few keys whose score is exactly 0 (a tie topk may break either way)
            index_head_dim=16,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        ),
    ),
    # A.X-K2: DeepSeek-V3.2's block (each query attending to the 4 keys its indexer picks) with the gated query (one
    # q_gate_proj: query and output gate from the latent normed and raw), gated norms (rank 8) before the attention
    # and before the experts, grouped routing (2 groups, 1 used: the others' experts scored 0); biased attention;
    # layers 0 and 2 dense from first_k_dense_replace and moe_layer_freq.
    "axk2": (
        "AXK2Config",
        "AXK2ForCausalLM",
        dict(
            num_hidden_layers=4,
            num_key_value_heads=4,
            intermediate_size=96,
            moe_intermediate_size=32,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_shared_experts=2,
            n_group=2,
            topk_group=1,
            routed_scaling_factor=1.5,
            q_lora_rank=32,
            kv_lora_rank=16,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=12,
            attention_bias=True,
            first_k_dense_replace=1,
            moe_layer_freq=2,
            index_topk=4,
            index_n_heads=16,
            index_head_dim=12,
            gated_norm_rank=8,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        ),
    ),
    # GLM-5: DeepSeek-V3.2's block, its indexer rotating interleaved pairs; layers 1 and 2 reuse layer 0's choice of
    # keys (cross-layer sharing), layer 3 has its own; biased attention, the middle layers' MLPs dense.
    "glm_moe_dsa": (
        "GlmMoeDsaConfig",
        "GlmMoeDsaForCausalLM",
        dict(
            num_hidden_layers=4,
            num_key_value_heads=4,
            intermediate_size=96,
            moe_intermediate_size=32,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_shared_experts=1,
            q_lora_rank=32,
            kv_lora_rank=16,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=12,
            attention_bias=True,
            mlp_layer_types=["sparse", "dense", "dense", "sparse"],
            index_topk=5,
            index_n_heads=16,
            index_head_dim=12,
            indexer_types=["full", "shared", "shared", "full"],
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        ),
    ),
    # Laguna: sliding layers (window 8) rotating whole heads at their own base around a full one rotating a quarter,
    # biased attention with q/k norms, the output gated by a softplus per head, experts after a dense first layer
    # (a biased sigmoid choice, capped logits, renormalised, scaled) with an ungated shared expert.
    "laguna": (
        "LagunaConfig",
        "LagunaForCausalLM",
        dict(
            head_dim=16,
            intermediate_size=96,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            num_experts=8,
            num_experts_per_tok=2,
            attention_bias=True,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={
                "full_attention": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
                "sliding_attention": {"rope_type": "default", "rope_theta": 100.0, "partial_rotary_factor": 1.0},
            },
            moe_routed_scaling_factor=1.5,
            moe_router_logit_softcapping=2.0,
            pad_token_id=0,
            eos_token_id=2,
        ),
    ),
    # MiMo-V2-Flash: values narrower than q/k (12 against 16) and scaled, sliding layers (window 8) with twice the
    # KV heads and sinks around full ones, each kind rotating its own share at its own base, a dense first layer,
    # then DeepSeek-V3's sigmoid experts (two groups, one chosen; scaled) without shared experts.
    "mimo_v2_flash": (
        "MiMoV2FlashConfig",
        "MiMoV2FlashForCausalLM",
        dict(
            num_hidden_layers=4,
            num_key_value_heads=1,
            head_dim=16,
            v_head_dim=12,
            attention_value_scale=0.8,
            intermediate_size=96,
            moe_intermediate_size=32,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            routed_scaling_factor=1.5,
            attention_bias=True,
            sliding_window=8,
            layer_types=["full_attention", "sliding_attention", "sliding_attention", "full_attention"],
            rope_parameters={
                "full_attention": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
                "sliding_attention": {"rope_type": "default", "rope_theta": 100.0, "partial_rotary_factor": 0.25},
            },
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        ),
    ),
    # GPT-Neo: learned positions, global and local layers (windows of 8), no softmax scaling, unbiased q/k/v.
    "gpt_neo": (
        "GPTNeoConfig",
        "GPTNeoForCausalLM",
        dict(
            intermediate_size=96,
            max_position_embeddings=256,
            attention_types=[[["global", "local"], 1], [["local"], 1]],
            window_size=8,
        ),
    ),
    # XGLM: sinusoidal positions from row 2 whose row 3 (pad_token_id, fairseq's padding_idx) is zeros, so that
    # position 1 has none; the embedding times sqrt(d_model); ReLU in place of GELU; an untied head.
    "xglm": (
        "XGLMConfig",
        "XGLMForCausalLM",
        dict(
            ffn_dim=96,
            max_position_embeddings=256,
            activation_function="relu",
            pad_token_id=3,
            tie_word_embeddings=False,
        ),
    ),
    # BioGPT: learned positions from row 2, the embedding times sqrt(hidden_size), ReLU in place of GELU, an untied
    # head `output_projection`; its layer_norm_eps is never read by its model (torch's 1e-5: see test_architectures).
    "biogpt": (
        "BioGptConfig",
        "BioGptForCausalLM",
        dict(
            intermediate_size=96,
            max_position_embeddings=256,
            hidden_act="relu",
            tie_word_embeddings=False,
        ),
    ),
}


# Weights whose scale sets how peaked attention is (q/k; for multi-head latent attention the query,
# the rope key and the latent's key expansion).
SHARPENED = (
    "q_proj.weight",
    "k_proj.weight",
    "q_b_proj.weight",
    "kv_a_proj_with_mqa.weight",
    "kv_b_proj.weight",
    "attn.c_attn.weight",  # GPT-2's and GPT-BigCode's fused q/k/v (v sharpened too: no matter)
    "self_attention.query_key_value.weight",  # Falcon's and Bloom's
    "attn.Wqkv.weight",  # DBRX's and MPT's
    ".attn.qkv_proj.weight",  # CodeGen's (not Phi-3's self_attn.qkv_proj)
)


def build_hf_model(name: str, seed: int = 0, **overrides):
    """The tiny transformers model `name` (config fields in `overrides` replace the table's)."""
    import transformers

    config_cls, model_cls, extra = TINY_CONFIGS[name]
    # A deep copy: some config classes (Mistral 4's, MiniMax-M2's) write into the rope dict they are given.
    config = getattr(transformers, config_cls)(**copy.deepcopy({**COMMON, **extra, **overrides}))
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            # Random init leaves norms at 1 and biases at 0: perturb them, so those paths count.
            # (DBRX's norms: norm_attn_norm.norm_1 / norm_2, transformer.norm_f)
            dbrx_norm = pname.endswith(
                ("attn_norm.norm_1.weight", "attn_norm.norm_2.weight", "transformer.norm_f.weight")
            )
            if pname.endswith(("norm.weight", ".bias", "_bias")) or dbrx_norm:
                p.add_(torch.randn_like(p) * 0.1)
            # Per-head q/k norms (StableLM's list of LayerNorms; Cohere's [heads, head_dim]): each head its own
            # scale, far enough apart that a head read in another's place shows in the logits.
            if ".norms." in pname or (pname.endswith(("q_norm.weight", "k_norm.weight")) and p.dim() == 2):
                p.add_(torch.randn_like(p) * 0.5)
            # GPT-OSS's sinks start near 0, where they barely move the softmax: spread them, so that they count.
            # xIELU's parameters all start alike (Apertus): set each layer's apart.
            if pname.endswith((".sinks", "act_fn.alpha_p", "act_fn.alpha_n")):
                p.add_(torch.randn_like(p) * 2)
            # Gemma 4's router scales start at 1: perturb them, so that they count.
            if pname.endswith(("router.scale", "router.per_expert_scale")):
                p.add_(torch.randn_like(p) * 0.1)
            # Gemma 3n's AltUp: the output scale starts at 0 (the per-layer input branch unread), the coefficients
            # near 0: move them, so that they count.
            if pname.endswith("altup.correct_output_scale"):
                p.add_(1.0 + torch.randn_like(p) * 0.3)
            if pname.endswith(("altup.prediction_coefs.weight", "altup.correction_coefs.weight")):
                p.mul_(10)
            # At std 0.02 attention is nearly uniform and logits ignore q/k: sharpen it, so that
            # a wrong q/k layout (rotary, llama.cpp's permutation) shows in the logits.
            if pname.endswith(SHARPENED):
                p.mul_(10)
            # Zamba 2's adapters, near 0 at std 0.02 squared: scaled up, so that a wrong layer's shows.
            if "_adapter_list." in pname:
                p.mul_(5)
        for bname, b in model.named_buffers():
            # DeepSeek's router selection bias starts at zero: perturb it so that it counts too.
            # Gemma 4's layer scalars start at 1 too.
            if bname.endswith(("e_score_correction_bias", "feed_forward.expert_bias", "layer_scalar")):
                b.add_(torch.randn_like(b) * 0.1)
    return model.eval()


def save_hf_model(name: str, directory: Path, seed: int = 0, **overrides):
    model = build_hf_model(name, seed, **overrides)
    model.save_pretrained(directory)
    return model


CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def save_byte_tokenizer(directory: Path, chat_template: str | None = CHATML) -> None:
    """A byte-level tokenizer whose 256 base tokens fit the tiny models' vocab (ids 0..255);
    two special tokens take the last ids so chat prompts work."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet)) if i < 254}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    directory = Path(directory)
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "bos_token": None}
    if chat_template:
        config["chat_template"] = chat_template
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


def save_bpe_tokenizer(directory: Path, texts: list[str], vocab_size: int = 320) -> int:
    """A byte-level BPE tokenizer trained (offline, deterministically) on `texts`, so that words
    merge into multi-byte tokens as in real tokenizers; saved with a tokenizer_config.json that
    transformers' AutoTokenizer loads from the directory. Returns its vocabulary size (the model's
    vocab_size must be at least that)."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>", "bos_token": None}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return tokenizer.get_vocab_size()
