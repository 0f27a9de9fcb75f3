"""ModelConfig: one dataclass for every architecture keel runs.

A config comes from an HF `config.json` (`ModelConfig.from_hf`), from GGUF metadata
(`keel.weights.gguf`), or is inferred from tensor shapes (`keel.weights.infer`). It is the
single source of truth for the model, the weight loaders, the trainer and the serving engine.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from keel.errors import ConfigError
from keel.families import BY_MODEL_TYPE, FAMILIES, as_current_config

# HF `architectures` value -> keel family. The family decides HF defaults and name maps.
HF_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "GraniteForCausalLM": "granite",
    **{module.HF_ARCHITECTURE: family for family, module in FAMILIES.items()},
}
FAMILY_TO_HF = {family: arch for arch, family in HF_ARCHITECTURES.items()}
MOE_FAMILIES = {"mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3"}
MLA_FAMILIES = {
    "bailing_hybrid",
    "deepseek_v2",
    "deepseek_v3",
    "glm4_moe_lite",
    "kimi_linear",
    "deepseek_v32",
    "glm_moe_dsa",
    "mistral4",
    "youtu",
    "sarvam_mla",
    "minicpm3",
    "axk1",
    "axk2",
}
# Families whose experts DeepSeek's reader and writer describe (V3: sigmoid router, selection bias, groups; V2: a
# float32 softmax router, groups by their best expert; shared experts, first k layers dense), whose checkpoints
# name the router `mlp.gate`, the shared ones `mlp.shared_experts`.
DEEPSEEK_MOE_FAMILIES = {
    "bailing_hybrid",
    "deepseek_v2",
    "deepseek_v3",
    "glm4_moe",
    "glm4_moe_lite",
    "kimi_linear",
    "deepseek_v32",
    "glm_moe_dsa",
    "dots1",
    "solar_open",
    "mistral4",
    "exaone_moe",
    "sarvam_moe",
    "sarvam_mla",
    "axk1",
    "axk2",
}
# DeepSeek-style families whose config lists each layer's MLP kind instead of DeepSeek's first_k_dense_replace.
LAYER_KINDS_LISTED = {
    "bailing_hybrid",
    "glm4_moe_lite",
    "exaone_moe",
    "axk1",
    "axk2",
    "kimi_linear",
    "deepseek_v32",
    "glm_moe_dsa",
}
# Granite MoE and its shared-expert and sliding-window variants: their experts' keys are their own
# (keel.families.granitemoe).
GRANITE_MOE_FAMILIES = {"granitemoe", "granitemoeshared", "granitemoe_swa", "granitemoehybrid"}
# Families whose router's selection bias transformers holds as a parameter (a buffer in keel): their parameter counts.
SELECTION_BIAS_PARAMETER = {"ernie4_5_moe", "afmoe", "laguna"}

# Defaults of the transformers config classes, for fields a config.json may omit and for
# fields that neither GGUF metadata nor tensor shapes can tell.
_COMMON_DEFAULTS: dict[str, Any] = {
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "bos_token_id": None,
    "eos_token_id": [],
}
FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {**_COMMON_DEFAULTS, "max_position_embeddings": 2048, "bos_token_id": 1, "eos_token_id": [2]},
    "mistral": {**_COMMON_DEFAULTS, "max_position_embeddings": 131072, "bos_token_id": 1, "eos_token_id": [2]},
    "qwen2": {**_COMMON_DEFAULTS, "max_position_embeddings": 32768},
    # Granite: Llama's block with four scalars (transformers' GraniteConfig defaults: all 1.0, so a
    # config without attention_multiplier has softmax scale 1, not 1/sqrt(head_dim)).
    "granite": {**_COMMON_DEFAULTS, "max_position_embeddings": 2048, "bos_token_id": 1, "eos_token_id": [2]},
    "qwen3": {**_COMMON_DEFAULTS, "max_position_embeddings": 32768},
    **{family: {**_COMMON_DEFAULTS, **module.DEFAULTS} for family, module in FAMILIES.items()},
    "mixtral": {
        **_COMMON_DEFAULTS,
        "rms_norm_eps": 1e-5,
        "rope_theta": 1e6,
        "max_position_embeddings": 131072,
        "bos_token_id": 1,
        "eos_token_id": [2],
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,  # Mixtral always renormalises the top-k weights
    },
    "qwen2_moe": {
        **_COMMON_DEFAULTS,
        "max_position_embeddings": 32768,
        "num_experts_per_tok": 4,
        "norm_topk_prob": False,
        "intermediate_size": 5632,  # dense width, unused when every layer is sparse
    },
    "qwen3_moe": {
        **_COMMON_DEFAULTS,
        "max_position_embeddings": 32768,
        "num_experts_per_tok": 8,
        "norm_topk_prob": False,
        "intermediate_size": 6144,
    },
    # transformers' DeepseekV2Config defaults (n_group/topk_group None there: no groups; num_experts_per_tok None
    # there, which its router cannot run: DeepSeek-V2-Lite's 6).
    "deepseek_v2": {
        **_COMMON_DEFAULTS,
        "max_position_embeddings": 2048,
        "bos_token_id": 1,
        "eos_token_id": [2],
        "intermediate_size": 11008,
        "num_experts": 64,
        "num_experts_per_tok": 6,
        "moe_intermediate_size": 1407,
        "norm_topk_prob": False,
        "n_shared_experts": 2,
        "first_k_dense_replace": 0,
        "n_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 1.0,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "rope_interleave": True,  # DeepSeek-V2 always rotates interleaved pairs (a complex product)
    },
    # transformers' DeepseekV3Config defaults (the published DeepSeek-V3 shape).
    "deepseek_v3": {
        **_COMMON_DEFAULTS,
        "max_position_embeddings": 4096,
        "bos_token_id": 0,
        "eos_token_id": [1],
        "intermediate_size": 18432,
        "num_experts": 256,  # HF: n_routed_experts
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 2048,
        "norm_topk_prob": True,
        "n_shared_experts": 1,
        "first_k_dense_replace": 3,
        "n_group": 8,
        "topk_group": 4,
        "routed_scaling_factor": 2.5,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "rope_interleave": True,
    },
}

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "dynamic", "proportional")
# transformers' hidden_act names -> keel's (keel.model.layers runs them).
HIDDEN_ACTS = {
    "silu": "silu",
    "swish": "silu",
    "gelu": "gelu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_new": "gelu_tanh",
    "gelu_fast": "gelu_tanh",  # the same tanh approximation, written out
    "relu2": "relu2",
    "relu": "relu",
    "quick_gelu": "quick_gelu",
    "xielu": "xielu",  # with parameters of its own per MLP (Apertus)
}


@dataclass(frozen=True)
class RopeScaling:
    """Rotary-embedding frequency scaling (HF `rope_parameters` / `rope_scaling`)."""

    # dynamic: NTK scaling by the sequence's length past max_position_embeddings; within it, the default frequencies
    # (what transformers computes there), and keel serves no longer context (keel.serve.model_len)
    type: str = "default"  # default | linear | llama3 | yarn | longrope | dynamic | proportional
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int = 8192  # llama3, yarn (the pre-training context)
    # YaRN: frequencies between the beta_fast and beta_slow rotation counts are interpolated; cos/sin
    # are multiplied by attention_factor (None: derived from factor, mscale and mscale_all_dim as
    # transformers does). DeepSeek also multiplies its softmax scale by yarn_get_mscale(factor,
    # mscale_all_dim)**2 (see keel.model.mla). mscale == 0 means "not given", as in transformers.
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None
    truncate: bool = True
    # LongRoPE (Phi-3 128k, Phi-3.5, Phi-4-mini): each rotary frequency divided by its own factor, the short set
    # within the pre-training context (original_max_position_embeddings), the long set beyond it; cos/sin times
    # attention_factor (None: sqrt(1 + ln(factor) / ln(original)), factor = max_position_embeddings / original).
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    # Proportional (Gemma 4's full-attention layers): the first int(share x D // 2) of the head's D / 2 frequencies
    # turn, at the default rope's frequencies over all D channels (divided by `factor`), the rest are 0 (those
    # channel pairs pass unturned), so the rotation spans the whole head.
    rotated_share: float = 1.0


# The layer kinds whose past is a state per sequence, not keys and values (keel.model.recurrent).
RECURRENT_KINDS = ("linear_attention", "conv", "mamba", "mamba1", "lightning", "rglru")
# How refusals name them (with Falcon-H1's and Zamba 2's "hybrid" layers, which keep a state too)
RECURRENT_LAYERS = f"recurrent ({', '.join(RECURRENT_KINDS)}, hybrid) layers"


@dataclass
class ModelConfig:
    """Everything needed to build a dense or mixture-of-experts decoder."""

    # keel family: llama | mistral | qwen2 | qwen3 | granite | mixtral | qwen2_moe | qwen3_moe | deepseek_v2 |
    # deepseek_v3, or one of keel.families (keel.families.FAMILIES: phi3, gemma3, llama4, ...)
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    # Multi-head latent attention: num_kv_heads == num_heads (kv_b_proj expands the latent into one
    # key and one value per head) and head_dim is the query/key width qk_nope_head_dim +
    # qk_rope_head_dim, the width the scores are taken over (HF's qk_head_dim; HF's own `head_dim`
    # is the rotary width, which keel calls `rotary_dim`). Values are v_head_dim wide.
    num_kv_heads: int
    head_dim: int
    # The full-attention layers' own geometry (Gemma 4's global_head_dim and num_global_key_value_heads); 0: the
    # same as every layer's (head_dim, num_kv_heads). Read per layer: layer_head_dim, layer_num_kv_heads.
    global_head_dim: int = 0
    global_num_kv_heads: int = 0
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    # Each rotary pair turned by -position x frequency (NanoChat: its rotate_half is cat(x2, -x1), not cat(-x2, x1)).
    rope_reversed: bool = False
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    # The layers whose o_proj has a bias beside those o_bias gives one (GPT-NeoX-Japanese: the last layer's alone)
    o_bias_layers: list[int] = field(default_factory=list)
    mlp_bias: bool = False
    lm_head_bias: bool = False  # Phi: the LM head adds a bias per vocabulary entry
    qk_norm: bool = False
    sliding_window: int | None = None
    # Per layer: "full_attention", "sliding_attention", "chunked_attention" or "linear_attention" (HF's
    # `layer_types`; the last a Gated DeltaNet layer, keel.model.linear_attention), "lightning" (MiniMax's lightning
    # attention, keel.model.lightning: num_heads heads of head_dim), "rglru" (Griffin's recurrent block with its
    # Real-Gated Linear Recurrent Unit, keel.model.rglru: RecurrentGemma), "conv", "mamba", "mamba1",
    # "hybrid" (attention and a Mamba 2 mixer side by side: Falcon-H1), or "mlp": a layer without a token mixer, its
    # MLP (dense or MoE) alone (Nemotron-H's "-" and "E" layers).
    layer_types: list[str] = field(default_factory=list)
    # Per layer: whether it has its MLP (dense or MoE) after the token mixer; False: the mixer alone (Nemotron-H's
    # attention and Mamba layers, Mamba's blocks). Empty: every layer has one.
    mlp_layers: list[bool] = field(default_factory=list)
    # Gated DeltaNet layers (Qwen3.5, Qwen3-Next): key/query heads, value heads, their widths, the causal
    # convolution's kernel over the projected q/k/v.
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 4
    # OLMo Hybrid's Gated DeltaNet: beta times this (its linear_allow_neg_eigval: 2, a write strength in [0, 2]), the
    # eps of the gated output norm (None: rms_norm_eps), and the layers' own norm placement ("": norm_placement;
    # OLMo Hybrid's are "pre" beside post-normed attention layers: `layer_norm_placement`).
    linear_beta_scale: float = 1.0
    linear_norm_eps: float | None = None
    linear_norm_placement: str = ""
    # Which layer a "linear_attention" layer is: "gated_deltanet" (Qwen3.5, Qwen3-Next, OLMo Hybrid: a decay per
    # head, keel.model.linear_attention) or "kda" (Kimi Linear's Kimi Delta Attention, keel.model.kda: a decay per key
    # channel, low-rank decay and output-gate projections, a sigmoid-gated output norm; key and value heads alike).
    linear_variant: str = "gated_deltanet"
    # Bailing Hybrid's KDA (Ling/Ring): the decay's and the output gate's projections full rank (`f_proj`, `g_proj`:
    # hidden -> heads x width, instead of Kimi's low-rank f_a/f_b and g_a/g_b), A_log one value per head ([H], not
    # Kimi's [1, 1, H, 1]).
    kda_full_rank_gates: bool = False
    # Bailing Hybrid's kda_safe_gate: the log decay bound * sigmoid(exp(A_log) (f + dt_bias)), in (bound, 0), instead
    # of -exp(A_log) softplus(f + dt_bias). None: the unbounded one.
    kda_gate_lower_bound: float | None = None
    # Qwen3.5: attention's output times sigmoid of a per-head gate, projected with the queries (keel's
    # `self_attn.output_gate`).
    attention_output_gate: bool = False
    # The output gate one unit per query head (LFM3's `g_proj`), each head's output times its sigmoid; without a
    # bias whatever qkv_bias says. False: one unit per query channel (Qwen3.5, AFMoE).
    attention_gate_per_head: bool = False
    # The output gate's function: "sigmoid" (Qwen3.5, AFMoE, LFM3) or "softplus" (Laguna: in float32, rounded to the
    # activations' dtype).
    attention_gate_activation: str = "sigmoid"
    # LFM2's gated short convolutions ("conv" layers, keel.model.short_conv): the kernel's width, biases
    short_conv_kernel: int = 3
    short_conv_bias: bool = False
    # Mamba 2's mixers ("mamba" layers, keel.model.mamba): heads, their channels, B/C groups, the state's size, the
    # convolution's kernel, biases, the step's limits after softplus
    mamba_n_heads: int = 0
    mamba_d_head: int = 0
    mamba_n_groups: int = 1
    mamba_d_state: int = 0
    mamba_d_conv: int = 4
    mamba_conv_bias: bool = True
    mamba_proj_bias: bool = False  # in_proj's bias
    mamba_out_bias: bool = False  # out_proj's bias (Falcon-H1's projectors_bias; Granite's mamba_proj_bias too)
    mamba_dt_limit: tuple[float, float] = (0.0, float("inf"))
    # How the scan's output y meets its gate z before out_proj: "gate_norm" (an RMS norm per group of y * SiLU(z):
    # Granite 4.0-H, Bamba), "norm_gate" (the norm of y, then times SiLU(z): Falcon-H1's mamba_norm_before_gate) or
    # "gate" (y * SiLU(z), no norm: Falcon-H1 without mamba_rms_norm).
    mamba_norm: str = "gate_norm"
    # The norm's weight applied in float32 and rounded once with the rest (Falcon-H1); False: the weight times the
    # norm rounded to the model's dtype (Granite 4.0-H's).
    mamba_norm_float32: bool = False
    # in_proj's output times one multiplier per segment (z, x, B, C, the steps: Falcon-H1's ssm_multipliers);
    # empty: none.
    mamba_proj_multipliers: tuple[float, ...] = ()
    # Falcon-H1's "hybrid" layers: attention and a Mamba 2 mixer (`mamba`) side by side on the same normed input,
    # their outputs summed; each branch's input and output times these (its muP multipliers).
    attention_in_multiplier: float = 1.0
    attention_out_multiplier: float = 1.0
    mamba_in_multiplier: float = 1.0
    mamba_out_multiplier: float = 1.0
    # Griffin's recurrent blocks ("rglru" layers, keel.model.rglru: RecurrentGemma): the LRU's width (its gates
    # block-diagonal, num_heads blocks) and the causal convolution's kernel.
    lru_width: int = 0
    lru_conv_kernel: int = 4
    # What a "hybrid" layer is: "parallel" (Falcon-H1's, above) or "shared" (Zamba 2's: a transformer block shared
    # between hybrid layers, its attention over the stream and the embedding side by side (2 x hidden_size wide in),
    # then its MLP, without residuals; its output projected (`shared_linear`) and added to the input of the layer's
    # Mamba 2 mixer). keel holds a copy of the shared block in each hybrid layer that runs it.
    hybrid_block: str = "parallel"
    # Zamba 2's num_mem_blocks: the number of shared blocks, the i-th hybrid layer running block i % shared_blocks
    shared_blocks: int = 0
    # The rank of the adapters (a low-rank pair per hybrid layer, added to the shared projection's output) on the
    # shared block's gate/up projection, and on its q/k/v where `attention_adapters`; 0: none.
    adapter_rank: int = 0
    attention_adapters: bool = False
    # Mamba 1's mixers ("mamba1" layers, keel.model.mamba1; with mamba_d_state, mamba_d_conv and the biases above): its
    # channels (expand x hidden), the rank of its step projection, and RMS norms of the step, B and C after x_proj:
    # "none" (Mamba), "weightless" (Falcon Mamba, eps mamba_dt_bc_norm_eps) or "rms" (Jamba: with weights).
    mamba_d_inner: int = 0
    mamba_dt_rank: int = 0
    mamba_dt_bc_norm: str = "none"
    mamba_dt_bc_norm_eps: float = 1e-6
    # Llama 4's chunked attention: a "chunked_attention" layer's query at position p sees the keys of its own chunk
    # of this many positions, from p - p % size to p.
    attention_chunk_size: int | None = None
    # Mixture of experts (num_experts == 0: dense).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    shared_expert_intermediate_size: int = 0
    shared_expert_gated: bool = True  # Qwen2-MoE: sigmoid-gated shared expert; DeepSeek: added as is
    # How the shared expert's output joins the routed experts': "sum" (added) or "average" (Cohere 2 MoE: the mean
    # of the two, (routed + shared) / 2).
    shared_expert_combination: str = "sum"
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)  # dense layers (DeepSeek: the first k)
    # Router: "softmax" (Mixtral, Qwen-MoE), "topk_softmax" (GPT-OSS: top-k logits, then their softmax) or
    # "sigmoid" (DeepSeek-V3: per-expert sigmoid scores, a selection-only bias for aux-loss-free balancing,
    # group-limited top-k, scaled weights) or "topk_sigmoid" (Llama 4: the top k of the logits, then their sigmoid,
    # renormalised where norm_topk_prob: Cohere 2 MoE's sigmoid router) or "sparsemixer" (Phi-3.5-MoE: two experts,
    # each weighted by a softmax over the logits near its own; keel.model.moe.sparsemixer).
    router_scoring: str = "softmax"
    # SparseMixer: a logit more than 2 x this below the chosen one, relative to its magnitude, leaves that expert's
    # softmax (Phi-3.5-MoE's `router_jitter_noise`).
    router_jitter_eps: float = 0.01
    # Llama 4: a token's routing weight scales the expert's input, not its output (one expert per token).
    router_scales_input: bool = False
    router_bias: bool = False  # e_score_correction_bias: added to scores for selection only
    # The sigmoid router's selection bias added to the logits, not to their sigmoid (Kolibri: top-k of logits + bias;
    # the sigmoid is monotonic, but a bias before it moves the choice otherwise than one after it).
    router_bias_on_logits: bool = False
    # The sigmoid router's logits -> cap * tanh(logits / cap) before their sigmoid (Laguna's
    # moe_router_logit_softcapping); None: not capped.
    router_logit_softcapping: float | None = None
    # DeepSeek-V2, Hunyuan MoE: the router's matmul and softmax in float32 whatever the model's dtype
    router_float32: bool = False
    # A group's score for group-limited selection: "top2_sum" (DeepSeek-V3: the sum of its two best experts' scores)
    # or "max" (DeepSeek-V2's group_limited_greedy: its best expert's).
    router_group_score: str = "top2_sum"
    # A.X-K2's grouped routing: the experts outside the chosen groups score 0 for the choice (its reference's
    # masked_fill(0.0)) instead of -inf, so a chosen group's expert whose biased score is negative may lose to them.
    router_group_mask_zero: bool = False
    n_group: int = 1  # experts split into n_group groups; tokens pick experts from topk_group of them
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    # Gemma 4's router: its input normed (no weight), times a learned scale per channel (`router.input_scale`) and
    # hidden_size^-1/2; each chosen expert's weight, after the renormalisation, times its learned `expert_scale`.
    router_input_norm: bool = False
    router_expert_scale: bool = False
    # Gemma 4's MoE block: the shared expert (its dense MLP, ungated) and the routed experts each with a norm before and
    # after them (the layer's norm before the MLP is the shared expert's: the block reads the un-normed residual,
    # which its router takes as it is).
    moe_branch_norms: bool = False
    # A.X-K1: the MoE block's output (routed plus shared experts) normed by a norm of its own (`mlp.output_norm`),
    # in the sparse layers only, before the residual add.
    moe_output_norm: bool = False
    # JetMoE: one bias [hidden] added to the MoE block's summed expert outputs (`mlp.output_bias`).
    moe_output_bias: bool = False
    # JetMoE's mixture of attention heads (MoA, keel.model.moa): the router (the MoE's routing: num_experts,
    # num_experts_per_tok, router_scoring) picks each token's top-k attention experts, each with its own query
    # and output projections over num_kv_heads heads, keys and values shared (num_heads = top-k x num_kv_heads);
    # o_bias: one bias [hidden] after the weighted sum of the experts' outputs.
    mixture_of_attention: bool = False
    router_linear_bias: bool = False  # GPT-OSS: the router's linear layer has a bias (it moves the logits)
    expert_bias: bool = False  # GPT-OSS: each expert's gate/up and down projections have biases
    # The experts' gated activation: "silu" (act(gate) * up) or "swiglu_clamped" (GPT-OSS: gate clamped above
    # and up on both sides at swiglu_limit, then gate * sigmoid(swiglu_alpha * gate) * (up + 1)).
    expert_activation: str = "silu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    # Multi-head latent attention (DeepSeek-V2/V3); kv_lora_rank == 0: ordinary attention.
    q_lora_rank: int | None = None  # None: q_proj is one full-rank matrix
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    # MLA's value width; without MLA, a value width other than head_dim where > 0 (MiMo-V2-Flash's narrower values)
    v_head_dim: int = 0
    # The values times this as projected (MiMo-V2-Flash's attention_value_scale), before the cache keeps them.
    attention_value_scale: float = 1.0
    rope_interleave: bool = False  # DeepSeek's checkpoints store rotary pairs interleaved
    # A.X-K2's gated latent query: one `q_gate_proj` (no q_b_proj) from the query latent normed and raw side by side
    # (2 x q_lora_rank) to each head's query and a gate per value channel; the heads' outputs times its sigmoid
    # before o_proj.
    mla_query_gate: bool = False
    # DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5; keel.model.dsa): multi-head latent attention whose queries
    # each attend only to the index_topk earlier keys a lightning indexer (index_n_heads heads of index_head_dim
    # channels, its first qk_rope_head_dim rotated) scores highest; index_topk 0: dense latent attention.
    index_topk: int = 0
    index_n_heads: int = 0
    index_head_dim: int = 0
    index_rope_interleave: bool = False  # GLM-5's indexer rotates interleaved pairs, DeepSeek-V3.2's halves
    # Per layer, "full" (the layer's own indexer selects its keys) or "shared" (it attends to the keys the last
    # full layer before it selected: GLM-5's cross-layer sharing); empty: every layer full.
    indexer_types: list[str] = field(default_factory=list)
    # Scalars of the block (Granite's four; 1.0 / None: not there).
    embedding_multiplier: float = 1.0  # the embedding's output is multiplied by this
    residual_multiplier: float = 1.0  # each sublayer's output is multiplied by this before the residual add
    # MiniMax's block: each sublayer's residual is its *normed* input, x = alpha norm(x) + beta sublayer(norm(x)),
    # with alpha and beta of the attention ("full"/other kinds), lightning and MLP sublayers (its
    # full_attn_alpha_factor ...: 1.0 each still differs from the pre-norm block, whose residual is unnormed).
    normed_residual: bool = False
    attn_residual_alpha: float = 1.0
    attn_residual_beta: float = 1.0
    lightning_residual_alpha: float = 1.0
    lightning_residual_beta: float = 1.0
    mlp_residual_alpha: float = 1.0
    mlp_residual_beta: float = 1.0
    attention_scale: float | None = None  # the softmax scale of q.k; None: 1/sqrt(head_dim)
    # GPT-2's scale_attn_by_inverse_layer_idx: layer i's softmax scale (above) further divided by i + 1.
    attention_scale_by_layer: bool = False
    logits_scaling: float = 1.0  # the logits are divided by this
    # Block options of issue 25, each aligned against a transformers family that has it.
    partial_rotary_factor: float = 1.0  # rotary over the first int(head_dim * factor) channels of each head
    norm_type: str = "rms"  # rms | layer: the block and final norms (eps: rms_norm_eps); q/k norms stay RMSNorm
    norm_bias: bool = False  # LayerNorm with a bias
    # False: the block and final norms have no weight (nor bias), normalised in float32 and rounded once (OLMo's
    # LayerNorm, NanoChat's RMSNorm); their checkpoints hold no norm tensors.
    norm_affine: bool = True
    # The embedding's output normed before the first layer by a block norm of its own: weightless under norm_affine
    # False (NanoChat: its one weightless `norm`, applied twice), else with its weight (and bias under norm_bias),
    # `embedding_norm.*` (Bloom's word_embeddings_layernorm).
    embedding_norm: bool = False
    parallel_residual: bool = False  # x + attn(norm1(x)) + mlp(norm2(x)) (GPT-NeoX; StableLM's option)
    post_attention_norm: bool = True  # False: under parallel_residual the MLP reads norm1(x) (StableLM)
    # pre: a norm before each sublayer (Llama); post: after each, on its output (OLMo 2); sandwich: both (Gemma 2);
    # post_residual: after each residual add, x = norm(x + sublayer(x)) (OPT-350m, the original Transformer's), with
    # the pre-norm block's two norms (input_layernorm after the attention's add, post_attention_layernorm after the
    # MLP's)
    norm_placement: str = "pre"
    # A.X-K2's gated norms: input_layernorm in every layer and post_attention_layernorm before the experts are an
    # RMSNorm times sigmoid(fc2(silu(fc1(y)))) of its output y, fc1/fc2 a low-rank pair of this rank (0: plain norms).
    gated_norm_rank: int = 0
    # False: no norm after the last layer (OPT-350m's post_residual block ends normed; OPT's _remove_final_layer_norm)
    final_norm: bool = True
    # The final norm's eps where other than rms_norm_eps (JetMoE's: its layers' norms are built at 1e-6 whatever the
    # file says, the final one at rms_norm_eps); None: rms_norm_eps
    final_norm_eps: float | None = None
    # The token embedding's (and the LM head's) width where other than hidden_size (OPT-350m's word_embed_proj_dim):
    # `project_in` [hidden, E] maps the embedding to the model's width and `project_out` [E, hidden] the last hidden
    # state (after the final norm) to the head's, Linear without bias; 0: hidden_size, no projections.
    embedding_size: int = 0
    # head: q/k norms over each head, one weight [head_dim] shared by the heads (Qwen3); all: over the whole
    # projection (OLMo 2); each_head: over each head, a weight of its own per head ([heads, head_dim]: Cohere's
    # Command R+, StableLM 2 12B)
    qk_norm_scope: str = "head"
    qk_norm_type: str = "rms"  # the q/k norms' kind: rms (RMSNorm) or layer (LayerNorm: Cohere, StableLM, Phi)
    qk_norm_bias: bool = False  # the q/k LayerNorms add a bias (Phi's)
    qk_norm_after_rope: bool = False  # HunYuan: the per-head q/k norms after the rotary embedding, not before
    # q, k and v clamped to [-clip_qkv, clip_qkv] after their projections (and after q/k norms over the whole
    # projections: OLMoE's order), before the rotary embedding (OLMo, OLMoE); None: not clamped.
    clip_qkv: float | None = None
    # the block norms scale by (offset + weight): RMSNorm in float32 (Gemma: 1), LayerNorm as is (Nemotron: 1)
    norm_weight_offset: float = 0.0
    final_logit_softcapping: float | None = None  # logits -> cap * tanh(logits / cap) (Gemma 2)
    # Attention scores (after the softmax scale) -> cap * tanh(scores / cap), before the mask (Gemma 2).
    attn_logit_softcapping: float | None = None
    # Sliding-window layers' own RoPE (Gemma 3's local layers); None: every layer takes rope_theta/rope_scaling.
    sliding_rope_theta: float | None = None
    sliding_rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    # The sliding layers' own rotary share (Laguna: the full layers rotate half of each head, the sliding ones all of
    # it), with their own RoPE (sliding_rope_theta); None: partial_rotary_factor.
    sliding_partial_rotary_factor: float | None = None
    # Per layer: whether it rotates q and k (False: no position encoding, SmolLM3's NoPE layers); empty: all do.
    rope_layers: list[bool] = field(default_factory=list)
    # How positions are encoded: "rope" (rotary, in the attention layers), "learned" (GPT-2, GPT-BigCode, OPT: a
    # table of max_position_embeddings + position_offset rows, `embed_positions`, added to the token embedding,
    # h = embed(tokens) + embed_positions(positions + position_offset); no layer rotates) or "alibi" (Bloom, MPT,
    # Falcon-RW: no layer rotates; each query head h's scaled scores gain alibi_scale * slope_h * (key position -
    # query position), slopes as `keel.model.attention.alibi_slopes` gives them for alibi_bias_max) or "sinusoidal"
    # (XGLM: fairseq's fixed table, computed and never stored, added to the embedding as a learned one is: row
    # r = position + position_offset holds sin(r * f_i) for i < d/2, then cos(r * f_i), f_i = 10000^(-i / (d/2 - 1)),
    # a zero column for an odd width; keel.model.layers.SinusoidalPositions).
    position_embedding: str = "rope"
    # The sinusoidal table's row read as zeros (fairseq's padding_idx, XGLM's pad_token_id: a position whose row
    # it is, position + position_offset, gets no position signal); None: none.
    position_padding_idx: int | None = None
    # ALiBi's slopes: 2^(-alibi_bias_max * i / n) for heads i = 1..n (n the power of two at or below the heads; the
    # rest interleaved from 2n), MPT's `alibi_bias_max` (Bloom's and Falcon's are 8).
    alibi_bias_max: float = 8.0
    # A factor on every slope: Falcon-RW adds the bias before its softmax scale (1/sqrt(head_dim)), Bloom and MPT after.
    alibi_scale: float = 1.0
    position_offset: int = 0  # OPT's table starts at row 2 (XGLM's sinusoidal one too)
    # Llama 4's attention temperature (Ministral 3's `llama_4_scaling_beta`): queries at position p are scaled by
    # 1 + beta * log(1 + floor(p / query_scale_length)); 0: off.
    query_scale_beta: float = 0.0
    query_scale_length: int = 8192
    # Llama 4's own form: p + 1 in place of p, and only in the layers without position encoding (`rope_layers`).
    query_scale_offset: int = 0
    query_scale_nope_only: bool = False
    # Gemma 4: the full-attention layers have no v_proj, their values are the keys' projection (before k's norm and
    # rotary): `layer_k_eq_v`.
    attention_k_eq_v: bool = False
    # Gemma 4: values divided by their root mean square over each head (no weight), as stored and attended.
    v_norm: bool = False
    # BitNet's sub-norms: an RMSNorm (the block's eps) over the attention's output before o_proj
    # (`self_attn.attn_sub_norm`), and one over the gated MLP's act(gate) * up before down_proj (`mlp.ffn_sub_norm`).
    attn_sub_norm: bool = False
    ffn_sub_norm: bool = False
    # Gemma 4: each layer's output (residual stream included) multiplied by a stored scalar (the `layer_scalar` buffer).
    layer_scalar: bool = False
    # Gemma 4 E2B/E4B's per-layer input embeddings: a table of per_layer_input_size channels per layer and token
    # (`embed_tokens_per_layer`, per_layer_input_vocab_size rows, 0: vocab_size), plus the embedding's projection
    # to the same (`per_layer_model_projection`, normed), feed each layer a residual branch after its MLP: its output
    # through `per_layer_input_gate`, the activation, times its per-layer input, `per_layer_projection` and a norm.
    per_layer_input_size: int = 0
    per_layer_input_vocab_size: int = 0
    # Gemma 4 E2B/E4B: the last kv_shared_layers layers compute no keys or values (no k_proj, v_proj, k_norm) and
    # attend over those of the last earlier layer of their own layer type (`kv_source`), which alone keeps a store.
    kv_shared_layers: int = 0
    # Gemma 4's use_double_wide_mlp: the KV-sharing layers' dense MLPs this many times intermediate_size wide
    # (`layer_intermediate_size`).
    kv_shared_mlp_factor: int = 1
    # Gemma 3n's AltUp: the residual stream held as altup_num_inputs copies ([n, B, S, H]; 0: one stream), made from
    # the embedding by `altup_projections` (each renormalised to its magnitude) and merged back after the last layer
    # by `altup_unembed_projections` (the same renormalisation, then their mean). Each layer predicts every copy from
    # all of them (`altup.prediction_coefs`, mixed per token by `altup.modality_router`), runs its sublayers on copy
    # altup_active_idx and corrects every copy by the innovation (`altup.correction_coefs`); the per-layer input
    # branch reads the corrected active copy (times `altup.correct_output_scale` where altup_correct_scale) and is
    # added to the copies after the first.
    altup_num_inputs: int = 0
    altup_active_idx: int = 0
    altup_correct_scale: bool = False
    # Gemma 3n's LAuReL: a low-rank branch on the attention's normed input (`laurel.linear_left`, `linear_right`,
    # `post_laurel_norm`, plus that input), joining the attention's residual sum as (x + attn + laurel) / sqrt(2).
    laurel_rank: int = 0
    # Gemma 3n: per layer, the target sparsity s of its MLP's gate (0: dense): activations below the gate's
    # mean + std x Phi^-1(s) over the channels are cut to 0 before the activation (a Gaussian top-k). Empty: none.
    activation_sparsity: list[float] = field(default_factory=list)
    # Llama 4: q and k of the rotating layers divided by their root mean square over each head (no weight), after
    # the rotary embedding.
    qk_l2_norm: bool = False
    # A learned logit per query head that joins every softmax of attention without a value (GPT-OSS's "sinks"):
    # probabilities exp(s_j) / (sum_i exp(s_i) + exp(sink)), so a head may attend to nothing.
    attention_sinks: bool = False
    # The sinks in the sliding-window layers only (MiMo-V2-Flash's); the full-attention layers have none.
    attention_sinks_sliding_only: bool = False
    # The MLPs' activation, the experts' and shared experts' too: silu | gelu (erf) | gelu_tanh | relu2 (ReLU
    # squared) | relu | quick_gelu (x sigmoid(1.702 x))
    hidden_act: str = "silu"
    # down(act(gate(x)) * up(x)); False: down(act(up(x))) (GPT-NeoX), the experts and shared experts too (Nemotron-H)
    mlp_gated: bool = True
    # The dense MLPs' gate projection and output times these (Falcon-H1's mlp_multipliers).
    mlp_gate_multiplier: float = 1.0
    mlp_down_multiplier: float = 1.0
    # Tokens and provenance.
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)
    pad_token_id: int | None = None
    dtype: str = "float32"  # the checkpoint's own dtype

    def __post_init__(self) -> None:
        if not self.layer_types:
            kind = "sliding_attention" if self.sliding_window else "full_attention"
            self.layer_types = [kind] * self.num_layers
        self.validate()

    # ----------------------------------------------------------------- derived
    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def is_dsa(self) -> bool:
        """DeepSeek Sparse Attention: latent attention over the keys an indexer selects (keel.model.dsa)."""
        return self.index_topk > 0

    def index_source(self, layer: int) -> int:
        """The layer whose indexer selects `layer`'s keys: itself, or for a "shared" layer the last full one
        before it."""
        while self.indexer_types and self.indexer_types[layer] == "shared" and layer > 0:
            layer -= 1
        return layer

    def dsa_index_layers(self) -> list[int]:
        """The DSA layers with an indexer of their own (whose index keys a cache keeps)."""
        return [i for i in self.kv_layers() if self.is_dsa and self.index_source(i) == i]

    @property
    def rotary_dim(self) -> int:
        """Channels per head that rotary embeddings rotate (MLA: only the decoupled qk_rope part; with a
        partial_rotary_factor the first int(head_dim * factor), transformers' rounding)."""
        return self.qk_rope_head_dim if self.is_mla else int(self.head_dim * self.partial_rotary_factor)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def ple_vocab_size(self) -> int:
        """Rows of the per-layer input table (per_layer_input_size): per_layer_input_vocab_size, or vocab_size."""
        return self.per_layer_input_vocab_size or self.vocab_size

    def _has_global_geometry(self, layer: int) -> bool:
        return self.layer_types[layer] == "full_attention"

    def layer_head_dim(self, layer: int) -> int:
        """`layer`'s head width: global_head_dim in the full-attention layers where the config has one, else
        head_dim."""
        return self.global_head_dim if self.global_head_dim and self._has_global_geometry(layer) else self.head_dim

    def layer_num_kv_heads(self, layer: int) -> int:
        """`layer`'s KV heads: global_num_kv_heads in the full-attention layers where set, else num_kv_heads."""
        global_heads = self.global_num_kv_heads and self._has_global_geometry(layer)
        return self.global_num_kv_heads if global_heads else self.num_kv_heads

    def layer_v_head_dim(self, layer: int) -> int:
        """`layer`'s value width: v_head_dim where set without MLA (MiMo-V2-Flash's), else its head width."""
        return self.v_head_dim if self.v_head_dim and not self.is_mla else self.layer_head_dim(layer)

    def layer_v_size(self, layer: int) -> int:
        return self.layer_num_kv_heads(layer) * self.layer_v_head_dim(layer)

    def layer_has_sinks(self, layer: int) -> bool:
        """Whether `layer` has softmax sinks: attention_sinks, in the sliding layers only where
        attention_sinks_sliding_only."""
        if not self.attention_sinks:
            return False
        return not self.attention_sinks_sliding_only or self.layer_types[layer] == "sliding_attention"

    def layer_q_size(self, layer: int) -> int:
        return self.num_heads * self.layer_head_dim(layer)

    def layer_kv_size(self, layer: int) -> int:
        return self.layer_num_kv_heads(layer) * self.layer_head_dim(layer)

    def layer_k_eq_v(self, layer: int) -> bool:
        """Whether `layer`'s values are its keys' projection (no v_proj: attention_k_eq_v's full-attention layers)."""
        return self.attention_k_eq_v and self._has_global_geometry(layer)

    @property
    def uniform_attention(self) -> bool:
        """Whether every attention layer has the same head width and KV heads (no full-attention geometry of its
        own); what tensor parallelism's one cut of the heads needs."""
        return all(
            self.layer_head_dim(i) == self.head_dim
            and self.layer_num_kv_heads(i) == self.num_kv_heads
            and self.layer_v_head_dim(i) == self.head_dim
            for i in range(self.num_layers)
        )

    def layer_rotary_dim(self, layer: int) -> int:
        """`rotary_dim` at `layer`'s own head width (and the sliding layers' own share, where they have one)."""
        if self.is_mla:
            return self.rotary_dim
        factor = self.partial_rotary_factor
        if self.sliding_partial_rotary_factor is not None and self.layer_types[layer] == "sliding_attention":
            factor = self.sliding_partial_rotary_factor
        return int(self.layer_head_dim(layer) * factor)

    @property
    def sliding_rotary_dim(self) -> int:
        """The width of the sliding layers' own RoPE table (sliding_rope_theta): their rotary share of head_dim."""
        if self.is_mla or self.sliding_partial_rotary_factor is None:
            return self.rotary_dim
        return int(self.head_dim * self.sliding_partial_rotary_factor)

    @property
    def full_rotary_dim(self) -> int:
        """`rotary_dim` of the layers that rotate by `rope_theta` / `rope_scaling` (the full-attention layers' head
        width where they have their own; the sliding layers' own RoPE, where there is one, is `rotary_dim` wide)."""
        if self.is_mla or not self.global_head_dim:
            return self.rotary_dim
        return int(self.global_head_dim * self.partial_rotary_factor)

    def attention_layers(self) -> list[int]:
        """The layers that keep K/V and attend (`is_attention_layer`: not the recurrent ones, which keep a state per
        sequence instead, hybrid ones both, nor "mlp" layers, which keep nothing)."""
        return [i for i in range(self.num_layers) if self.is_attention_layer(i)]

    def is_moe_layer(self, layer: int) -> bool:
        """Whether `layer` has a sparse MoE block (HF's decoder_sparse_step / mlp_only_layers rule)."""
        if not self.is_moe or layer in self.mlp_only_layers or not self.has_mlp(layer):
            return False
        return (layer + 1) % self.decoder_sparse_step == 0

    def layer_rotates(self, layer: int) -> bool:
        """Whether `layer` rotates q and k by RoPE (False: no position encoding in the layer, `rope_layers`, or
        positions added to the embedding, `position_embedding`)."""
        return self.position_embedding == "rope" and (not self.rope_layers or self.rope_layers[layer])

    @property
    def learned_positions(self) -> int:
        """Rows of the learned position table (`position_embedding` "learned"), 0 without one."""
        return self.max_position_embeddings + self.position_offset if self.position_embedding == "learned" else 0

    @property
    def has_linear_attention(self) -> bool:
        """Whether some layers are Gated DeltaNet layers, whose state per sequence is recurrent, not a KV cache."""
        return "linear_attention" in self.layer_types

    def is_linear_layer(self, layer: int) -> bool:
        return self.layer_types[layer] == "linear_attention"

    def layer_norm_placement(self, layer: int) -> str:
        """`layer`'s norm placement: `linear_norm_placement` in the Gated DeltaNet layers where set, else
        `norm_placement`."""
        if self.linear_norm_placement and self.is_linear_layer(layer):
            return self.linear_norm_placement
        return self.norm_placement

    @property
    def has_recurrent_layers(self) -> bool:
        """Whether some layers keep a state per sequence instead of keys and values (Gated DeltaNet, LFM2's short
        convolutions: keel.model.recurrent)."""
        return any(self.is_recurrent_layer(i) for i in range(self.num_layers))

    def is_recurrent_layer(self, layer: int) -> bool:
        """Whether `layer` keeps a state per sequence (keel.model.recurrent): a recurrent kind's, or the Mamba 2
        mixer of a "hybrid" layer (which keeps keys and values too)."""
        return self.layer_types[layer] in RECURRENT_KINDS or self.layer_types[layer] == "hybrid"

    def is_attention_layer(self, layer: int) -> bool:
        """Whether `layer` attends over keys and values it keeps (a KV cache's rows): every kind but the recurrent
        ones ("hybrid" included) and an "mlp" layer, which keeps nothing."""
        return self.layer_types[layer] not in (*RECURRENT_KINDS, "mlp")

    def kv_source(self, layer: int) -> int:
        """The layer whose keys and values `layer` attends over: itself, or for the last kv_shared_layers layers
        the last layer before them of the same layer type."""
        first_shared = self.num_layers - self.kv_shared_layers
        if layer < first_shared:
            return layer
        kind = self.layer_types[layer]
        return max(i for i in range(first_shared) if self.layer_types[i] == kind)

    def layer_intermediate_size(self, layer: int) -> int:
        """`layer`'s dense MLP width: intermediate_size, times kv_shared_mlp_factor in the KV-sharing layers."""
        return self.intermediate_size * (self.kv_shared_mlp_factor if self.kv_source(layer) != layer else 1)

    @property
    def widest_intermediate_size(self) -> int:
        """The widest dense MLP's width (activation estimates)."""
        return max(self.layer_intermediate_size(i) for i in range(self.num_layers))

    def kv_layers(self) -> list[int]:
        """The attention layers that keep keys and values (a KV cache's stores): not those reusing another's."""
        return [i for i in self.attention_layers() if self.kv_source(i) == i]

    def has_mamba(self, layer: int) -> bool:
        """Whether `layer` runs a Mamba 2 mixer: as its token mixer ("mamba") or beside its attention ("hybrid")."""
        return self.layer_types[layer] in ("mamba", "hybrid")

    def shared_hybrid(self, layer: int) -> bool:
        """Whether `layer` is a Zamba 2 hybrid layer: a copy of a shared transformer block before its Mamba 2 mixer."""
        return self.hybrid_block == "shared" and self.layer_types[layer] == "hybrid"

    def shared_block_layers(self) -> list[list[int]]:
        """Per shared block (`shared_blocks`), the hybrid layers that run it (a copy each), in order."""
        hybrid = [i for i in range(self.num_layers) if self.shared_hybrid(i)]
        return [hybrid[b :: self.shared_blocks] for b in range(self.shared_blocks)]

    def attention_input_size(self, layer: int) -> int:
        """The width q/k/v project from: hidden_size, twice that in a Zamba 2 hybrid layer (the stream and the
        embedding side by side)."""
        return 2 * self.hidden_size if self.shared_hybrid(layer) else self.hidden_size

    def has_mixer(self, layer: int) -> bool:
        """Whether `layer` has a token mixer (attention or a recurrent one); an "mlp" layer has its MLP alone."""
        return self.layer_types[layer] != "mlp"

    def has_mlp(self, layer: int) -> bool:
        """Whether `layer` has its MLP (dense or MoE) sublayer (`mlp_layers`)."""
        return not self.mlp_layers or self.mlp_layers[layer]

    @property
    def has_partial_layers(self) -> bool:
        """Whether some layers lack a token mixer or an MLP (the fused CPU layer and tensor parallelism skip or
        refuse them)."""
        return "mlp" in self.layer_types or not all(self.has_mlp(i) for i in range(self.num_layers))

    def layer_window(self, layer: int) -> int | None:
        """The keys `layer`'s queries see besides causality, as every attention path takes it (`keel.model.attention.
        visible`): None, all; a positive size, a sliding window (q_pos - k_pos < window); a negative one, Llama 4's
        chunks of -window positions (k_pos at or after q_pos - q_pos % -window)."""
        kind = self.layer_types[layer]
        if kind == "sliding_attention" and self.sliding_window:
            return self.sliding_window
        if kind == "chunked_attention" and self.attention_chunk_size:
            return -self.attention_chunk_size
        return None

    def validate(self) -> None:
        def need(cond: bool, message: str) -> None:
            if not cond:
                raise ConfigError(f"invalid model config: {message}")

        need(self.architecture in FAMILY_TO_HF, f"architecture {self.architecture!r} is not supported")
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim"):
            need(getattr(self, name) > 0, f"{name} must be positive, got {getattr(self, name)}")
        need(self.rms_norm_eps > 0, f"rms_norm_eps must be positive, got {self.rms_norm_eps}")  # NaN too
        need(
            self.final_norm_eps is None or self.final_norm_eps > 0,
            f"final_norm_eps must be positive, got {self.final_norm_eps}",
        )
        need(
            self.num_heads % self.num_kv_heads == 0,
            f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})",
        )
        self._validate_layer_geometry(need)
        if self.is_mla:
            self._validate_mla(need)
        if not self.is_mla:
            need(self.head_dim % 2 == 0, f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        need(len(self.layer_types) == self.num_layers, "layer_types must have one entry per layer")
        kinds = {"full_attention", "sliding_attention", "chunked_attention", "hybrid", "mlp", *RECURRENT_KINDS}
        need(set(self.layer_types) <= kinds, f"layer_types must be among {sorted(kinds)}, got {set(self.layer_types)}")
        need(not self.mlp_layers or len(self.mlp_layers) == self.num_layers, "mlp_layers must have one entry per layer")
        need(
            all(0 <= i < self.num_layers for i in self.o_bias_layers),
            f"o_bias_layers must be layer indices below num_layers ({self.num_layers}), got {self.o_bias_layers}",
        )
        need(not (self.o_bias_layers and self.is_mla), "o_bias_layers with multi-head latent attention")
        need(
            all(self.has_mixer(i) and self.layer_types[i] not in RECURRENT_KINDS for i in self.o_bias_layers),
            f"o_bias_layers must name attention layers (not recurrent or mlp ones), got {self.o_bias_layers}",
        )
        # after the layer kinds' checks: it reads each layer's kind
        if self.is_dsa or self.index_n_heads or self.index_head_dim or self.indexer_types:
            self._validate_dsa(need)
        need(
            not self.mla_query_gate or (self.is_mla and self.q_lora_rank is not None),
            "mla_query_gate needs multi-head latent attention with a low-rank query (q_lora_rank)",
        )
        need(self.gated_norm_rank >= 0, f"gated_norm_rank must be >= 0, got {self.gated_norm_rank}")
        if self.mixture_of_attention:
            self._validate_moa(need)
        need(not self.moe_output_bias or self.is_moe, "moe_output_bias needs experts (num_experts)")
        need(
            not self.gated_norm_rank
            or (
                self.norm_type == "rms"
                and self.norm_affine
                and not self.norm_weight_offset
                and self.norm_placement == "pre"
                and not self.linear_norm_placement
                and not self.parallel_residual
                and not self.normed_residual
                and not self.has_partial_layers
            ),
            "gated_norm_rank needs the pre-norm block with affine RMSNorms (no offset, parallel or normed residual) "
            "and a mixer and an MLP in every layer",
        )
        need(
            all(self.has_mixer(i) or self.has_mlp(i) for i in range(self.num_layers)),
            "a layer needs a token mixer or an MLP (an mlp layer with mlp_layers False has neither)",
        )
        need(
            not (self.has_partial_layers and self.parallel_residual),
            "parallel_residual needs both sublayers in every layer",
        )
        if self.has_linear_attention:
            self._validate_linear(need)
        if "rglru" in self.layer_types:
            need(
                self.lru_width > 0 and self.lru_width % self.num_heads == 0,
                f"lru_width ({self.lru_width}) must be a positive multiple of num_heads ({self.num_heads})",
            )
            need(self.lru_conv_kernel >= 2, f"lru_conv_kernel must be at least 2, got {self.lru_conv_kernel}")
        self._validate_shared_block(need)
        if "lightning" in self.layer_types:
            need(not self.is_mla, "lightning layers beside multi-head latent attention are not supported")
        scales = ("attn", "lightning", "mlp")
        if self.normed_residual:
            need(
                self.norm_placement == "pre"
                and not self.linear_norm_placement
                and not self.parallel_residual
                and not self.has_partial_layers
                and "hybrid" not in self.layer_types
                and self.residual_multiplier == 1.0
                and not (self.altup_num_inputs or self.laurel_rank or self.per_layer_input_size),
                "normed_residual needs the pre-norm block with both sublayers in every layer (no parallel_residual, "
                "hybrid layers, residual_multiplier, AltUp, LAuReL or per-layer inputs)",
            )
        else:
            need(
                all(getattr(self, f"{k}_residual_{ab}") == 1.0 for k in scales for ab in ("alpha", "beta")),
                "attn/lightning/mlp_residual_alpha and _beta need normed_residual",
            )
        need(self.mamba_norm in ("gate_norm", "norm_gate", "gate"), f"mamba_norm {self.mamba_norm!r} is not known")
        need(len(self.mamba_proj_multipliers) in (0, 5), "mamba_proj_multipliers: none or one for each of 5 segments")
        if any(self.has_mamba(i) for i in range(self.num_layers)):
            for name in ("mamba_n_heads", "mamba_d_head", "mamba_d_state", "mamba_n_groups"):
                need(getattr(self, name) > 0, f"{name} must be positive with mamba layers")
            need(self.mamba_n_heads % self.mamba_n_groups == 0, "mamba_n_groups must divide mamba_n_heads")
            need(self.mamba_d_conv >= 2, "mamba_d_conv must be at least 2")
            need(not self.is_mla, "mamba layers beside multi-head latent attention are not supported")
        need(
            not self.is_moe or (self.mlp_gate_multiplier, self.mlp_down_multiplier) == (1.0, 1.0),
            "mlp_gate_multiplier and mlp_down_multiplier are read by dense MLPs only",
        )
        if "mamba1" in self.layer_types:
            for name in ("mamba_d_inner", "mamba_dt_rank", "mamba_d_state"):
                need(getattr(self, name) > 0, f"{name} must be positive with mamba1 layers")
            need(self.mamba_d_conv >= 2, "mamba_d_conv must be at least 2")
            norms = ("none", "weightless", "rms")
            need(self.mamba_dt_bc_norm in norms, f"mamba_dt_bc_norm {self.mamba_dt_bc_norm!r}: one of {norms}")
            need(not self.is_mla, "mamba1 layers beside multi-head latent attention are not supported")
        if "conv" in self.layer_types:
            need(self.short_conv_kernel >= 2, "short_conv_kernel must be at least 2")
            need(not self.is_mla, "conv layers beside multi-head latent attention are not supported")
        need(
            self.attention_chunk_size is None or self.attention_chunk_size > 0,
            f"attention_chunk_size must be positive, got {self.attention_chunk_size}",
        )
        need(not self.router_scales_input or self.num_experts_per_tok == 1, "router_scales_input routes to one expert")
        need(not (self.is_mla and self.qk_l2_norm), "qk_l2_norm is not read by MLA")
        need(
            not self.rope_layers or len(self.rope_layers) == self.num_layers,
            "rope_layers must have one entry per layer",
        )
        need(
            self.position_embedding in ("rope", "learned", "alibi", "sinusoidal"),
            f"position_embedding {self.position_embedding!r} is not supported (rope, learned, alibi, sinusoidal)",
        )
        need(not (self.is_mla and self.position_embedding != "rope"), "MLA layers always rotate their rope key")
        need(self.position_offset >= 0, f"position_offset must be >= 0, got {self.position_offset}")
        need(
            self.position_embedding in ("learned", "sinusoidal") or self.position_offset == 0,
            "position_offset needs position_embedding 'learned' or 'sinusoidal'",
        )
        need(
            self.position_padding_idx is None or self.position_embedding == "sinusoidal",
            "position_padding_idx needs position_embedding 'sinusoidal'",
        )
        need(
            self.position_embedding != "sinusoidal" or self.hidden_size >= 4,
            "position_embedding 'sinusoidal' needs hidden_size >= 4 (fairseq's frequencies divide by d/2 - 1)",
        )
        need(not (self.is_mla and self.attention_sinks), "attention_sinks are not read by MLA")
        need(not (self.is_mla and self.attn_sub_norm), "attn_sub_norm is not read by MLA")
        need(not (self.is_moe and self.ffn_sub_norm), "ffn_sub_norm is read by dense MLPs only, not by experts")
        need(self.alibi_bias_max > 0, f"alibi_bias_max must be positive, got {self.alibi_bias_max}")
        need(
            not self.kv_shared_layers or self.position_embedding != "alibi",
            "position_embedding 'alibi' with kv_shared_layers is not supported",
        )
        need(
            self.attention_output_gate or not self.attention_gate_per_head,
            "attention_gate_per_head needs attention_output_gate",
        )
        need(
            not (self.is_mla and self.attention_output_gate)
            or (
                self.attention_gate_per_head and self.attention_gate_activation == "sigmoid" and not self.mla_query_gate
            ),
            "attention_output_gate with multi-head latent attention is a sigmoid gate per head "
            "(attention_gate_per_head), without mla_query_gate",
        )
        need(
            self.attention_gate_activation in ("sigmoid", "softplus"),
            f"attention_gate_activation {self.attention_gate_activation!r}: sigmoid or softplus",
        )
        if self.sliding_partial_rotary_factor is not None:
            factor = self.sliding_partial_rotary_factor
            need(0 < factor <= 1, f"sliding_partial_rotary_factor must be in (0, 1], got {factor}")
            need(not self.is_mla, "sliding_partial_rotary_factor is not read by MLA")
            need(
                self.sliding_rope_theta is not None, "sliding_partial_rotary_factor needs the sliding layers' own RoPE"
            )
            need(
                self.sliding_rotary_dim > 0 and self.sliding_rotary_dim % 2 == 0,
                f"the sliding layers' rotary width must be even and positive, got {self.sliding_rotary_dim}",
            )
        need(
            self.router_logit_softcapping is None
            or (self.router_logit_softcapping > 0 and self.router_scoring == "sigmoid"),
            "router_logit_softcapping must be positive and needs router_scoring 'sigmoid'",
        )
        need(self.query_scale_length > 0, f"query_scale_length must be positive, got {self.query_scale_length}")
        need(not (self.is_mla and self.attention_scale is not None), "attention_scale is not read by MLA")
        need(not (self.is_mla and self.attention_scale_by_layer), "attention_scale_by_layer is not read by MLA")
        need(self.logits_scaling != 0, "logits_scaling must not be 0 (logits are divided by it)")
        need(
            0 < self.partial_rotary_factor <= 1,
            f"partial_rotary_factor must be in (0, 1], got {self.partial_rotary_factor}",
        )
        need(not (self.is_mla and self.partial_rotary_factor != 1), "MLA sets its rotary width by qk_rope_head_dim")
        rotary = self.rotary_dim
        need(
            self.is_mla or (rotary > 0 and rotary % 2 == 0),
            f"the rotary width int(head_dim x partial_rotary_factor) must be even and positive, got {rotary}",
        )
        need(self.norm_type in ("rms", "layer"), f"norm_type {self.norm_type!r} is not supported (rms, layer)")
        need(not self.norm_bias or self.norm_type == "layer", "norm_bias needs norm_type 'layer'")
        need(self.norm_affine or not self.norm_bias, "norm_bias needs norm_affine (a weightless norm has no bias)")
        need(self.kv_shared_mlp_factor >= 1, "kv_shared_mlp_factor must be >= 1")
        need(self.per_layer_input_size >= 0 and self.per_layer_input_vocab_size >= 0, "per-layer inputs: sizes >= 0")
        need(self.clip_qkv is None or self.clip_qkv > 0, f"clip_qkv must be positive, got {self.clip_qkv}")
        need(not (self.is_mla and self.clip_qkv is not None), "clip_qkv is not read by MLA")
        need(self.post_attention_norm or self.parallel_residual, "post_attention_norm=False needs parallel_residual")
        need(self.hidden_act in HIDDEN_ACTS.values(), f"hidden_act {self.hidden_act!r} is not supported")
        need(self.hidden_act != "xielu" or not self.is_moe, "hidden_act 'xielu' is supported in dense MLPs only")
        need(
            self.sliding_rope_scaling.type in ROPE_TYPES,
            f"sliding rope scaling type {self.sliding_rope_scaling.type!r} is not supported",
        )
        need(
            self.final_logit_softcapping is None or self.final_logit_softcapping > 0,
            "final_logit_softcapping must be > 0",
        )
        need(
            self.attn_logit_softcapping is None or self.attn_logit_softcapping > 0,
            "attn_logit_softcapping must be > 0",
        )
        need(
            not (self.is_mla and self.attn_logit_softcapping is not None),
            "attn_logit_softcapping is not read by MLA",
        )
        need(not (self.is_mla and self.sliding_rope_theta is not None), "MLA has no sliding layers")
        need(
            self.norm_placement in ("pre", "post", "sandwich", "post_residual"),
            f"norm_placement {self.norm_placement!r}: pre, post, sandwich or post_residual",
        )
        if self.norm_placement == "post_residual":  # each layer's two norms after its two residual adds
            need(
                not self.has_partial_layers and self.post_attention_norm and "hybrid" not in self.layer_types,
                "norm_placement 'post_residual' needs every layer to hold attention and an MLP, each normed",
            )
            # its block adds no LAuReL branch, and the MLP's input norm is the layer's own (not the MoE block's)
            need(
                not self.laurel_rank and not self.moe_branch_norms,
                "norm_placement 'post_residual' beside laurel_rank or moe_branch_norms is not supported",
            )
        need(self.embedding_size >= 0, f"embedding_size must be >= 0, got {self.embedding_size}")
        need(
            not (self.embedding_size and (self.per_layer_input_size or self.embedding_norm)),
            "embedding_size (project_in / project_out) beside per-layer inputs or embedding_norm",
        )
        need(
            self.linear_norm_placement in ("", "pre", "post", "sandwich"),
            f"linear_norm_placement {self.linear_norm_placement!r}: pre, post or sandwich",
        )
        need(
            self.qk_norm_scope in ("head", "all", "each_head"),
            f"qk_norm_scope {self.qk_norm_scope!r}: head, all or each_head",
        )
        need(
            not (self.qk_norm_after_rope and self.qk_norm_scope != "head"),
            "qk_norm_after_rope needs qk_norm_scope head",
        )
        need(self.qk_norm_type in ("rms", "layer"), f"qk_norm_type {self.qk_norm_type!r}: rms or layer")
        need(not (self.qk_norm_bias and self.qk_norm_type != "layer"), "qk_norm_bias needs qk_norm_type 'layer'")
        plain_qk_norm = self.qk_norm_type == "rms" and self.qk_norm_scope != "each_head"
        need(
            not (self.qk_norm and self.norm_weight_offset and not plain_qk_norm),
            "norm_weight_offset needs RMSNorm q/k norms (qk_norm_type rms) without qk_norm_scope each_head",
        )
        need(
            not (
                self.parallel_residual and (self.norm_placement, self.linear_norm_placement or "pre") != ("pre", "pre")
            ),
            "parallel_residual needs norm_placement 'pre' (and linear_norm_placement)",
        )
        for scaling, rotary in (
            (self.rope_scaling, self.full_rotary_dim),
            (self.sliding_rope_scaling, self.sliding_rotary_dim),
        ):
            need(
                scaling.type != "longrope"
                or len(scaling.short_factor) == len(scaling.long_factor) == (rotary + 1) // 2,
                f"longrope needs one short and one long factor per rotary frequency ({(rotary + 1) // 2}), "
                f"got {len(scaling.short_factor)} and {len(scaling.long_factor)}",
            )
            need(0 < scaling.rotated_share <= 1, f"rotated_share must be in (0, 1], got {scaling.rotated_share}")
        need(
            self.rope_scaling.type in ROPE_TYPES,
            f"rope scaling type {self.rope_scaling.type!r} is not supported (supported: {', '.join(ROPE_TYPES)})",
        )
        if self.is_moe:
            need(0 < self.num_experts_per_tok <= self.num_experts, "num_experts_per_tok must be in 1..num_experts")
            need(self.moe_intermediate_size > 0, "moe_intermediate_size must be positive for a MoE model")
            need(self.decoder_sparse_step >= 1, "decoder_sparse_step must be >= 1")
            scorings = ("softmax", "topk_softmax", "sigmoid", "topk_sigmoid", "sparsemixer")
            need(
                self.router_scoring in scorings,
                f"router_scoring {self.router_scoring!r} is not supported ({', '.join(scorings)})",
            )
            need(
                self.router_scoring != "sparsemixer" or self.num_experts_per_tok == 2,
                f"the sparsemixer router chooses 2 experts a token, not {self.num_experts_per_tok}",
            )
            need(self.router_jitter_eps >= 0, f"router_jitter_eps must be >= 0, got {self.router_jitter_eps}")
            need(
                self.shared_expert_combination in ("sum", "average"),
                f"shared_expert_combination {self.shared_expert_combination!r} is not supported (sum, average)",
            )
            need(
                not self.router_bias_on_logits or (self.router_scoring == "sigmoid" and self.router_bias),
                "router_bias_on_logits needs the sigmoid router with a selection bias (router_bias)",
            )
            need(self.n_group >= 1 and self.num_experts % self.n_group == 0, "n_group must divide num_experts")
            need(
                not self.router_group_mask_zero or self.router_scoring == "sigmoid",
                "router_group_mask_zero needs the sigmoid router",
            )
            need(
                self.router_group_score in ("top2_sum", "max"),
                f"router_group_score {self.router_group_score!r} is not supported (top2_sum, max)",
            )
            need(
                self.expert_activation in ("silu", "swiglu_clamped"),
                f"expert_activation {self.expert_activation!r} is not supported (silu, swiglu_clamped)",
            )
            need(self.swiglu_limit > 0, f"swiglu_limit must be positive, got {self.swiglu_limit}")
            need(
                self.mlp_gated or self.expert_activation == "silu",
                f"expert_activation {self.expert_activation!r} is gated (mlp_gated False: ungated experts)",
            )
            need(
                not self.moe_branch_norms
                or (self.shared_expert_intermediate_size > 0 and not self.shared_expert_gated),
                "moe_branch_norms needs an ungated shared expert (the block's dense MLP)",
            )
            need(1 <= self.topk_group <= self.n_group, "topk_group must be in 1..n_group")
            need(
                self.num_experts_per_tok <= self.topk_group * (self.num_experts // self.n_group),
                "num_experts_per_tok exceeds the experts of topk_group groups",
            )

    def _validate_layer_geometry(self, need: Callable[[bool, str], None]) -> None:
        """The full-attention layers' own head width and KV heads, k = v, v norms (Gemma 4)."""
        need(self.global_head_dim >= 0 and self.global_head_dim % 2 == 0, "global_head_dim must be even and >= 0")
        need(self.global_num_kv_heads >= 0, "global_num_kv_heads must be >= 0")
        need(
            not self.global_num_kv_heads or self.num_heads % self.global_num_kv_heads == 0,
            f"num_heads ({self.num_heads}) must be a multiple of global_num_kv_heads ({self.global_num_kv_heads})",
        )
        own = bool(self.global_head_dim or self.global_num_kv_heads or self.attention_k_eq_v or self.v_norm)
        need(
            self.attention_value_scale > 0, f"attention_value_scale must be positive, got {self.attention_value_scale}"
        )
        need(
            not self.attention_sinks_sliding_only or self.attention_sinks,
            "attention_sinks_sliding_only needs attention_sinks",
        )
        if not self.is_mla:
            need(self.v_head_dim >= 0, f"v_head_dim must be >= 0, got {self.v_head_dim}")
            need(
                not self.v_head_dim or not (self.global_head_dim or self.attention_k_eq_v),
                "v_head_dim beside global_head_dim or attention_k_eq_v",
            )
            need(
                not self.v_head_dim or self.v_head_dim == self.head_dim or not self.attention_output_gate,
                "v_head_dim other than head_dim beside attention_output_gate",
            )
        need(not (self.is_mla and own), "multi-head latent attention has no per-layer geometry, k = v or v norms")
        if self.full_rotary_dim != self.rotary_dim:
            # the sliding layers then rotate by a table of their own width (AttentionMetadata.sliding_rope)
            need(self.sliding_rope_theta is not None, "global_head_dim needs the sliding layers' own RoPE")
            need("chunked_attention" not in self.layer_types, "global_head_dim beside chunked attention")
        self._validate_gemma3n(need)
        if self.kv_shared_layers:
            first_shared = self.num_layers - self.kv_shared_layers
            need(0 < first_shared, f"kv_shared_layers ({self.kv_shared_layers}) must leave a layer of its own K/V")
            shared = self.layer_types[first_shared:]
            need(
                all(self.is_attention_layer(i) for i in range(self.num_layers)) and not self.is_mla,
                "kv_shared_layers needs attention layers only (no MLA, recurrent or mlp layers)",
            )
            need(
                set(shared) <= set(self.layer_types[:first_shared]),
                "kv_shared_layers: every shared layer's type needs an earlier layer of that type",
            )
            # a shared layer's queries are normed per head before the rotary embedding, or not at all
            others = self.qk_norm_scope == "all" or self.qk_norm_after_rope or self.clip_qkv or self.qk_l2_norm
            need(not others, "kv_shared_layers beside whole-projection, after-rope or L2 q/k norms or clip_qkv")

    def _validate_shared_block(self, need: Callable[[bool, str], None]) -> None:
        """Zamba 2's shared transformer blocks (`hybrid_block` "shared") on the block they are defined on."""
        need(self.hybrid_block in ("parallel", "shared"), f"hybrid_block {self.hybrid_block!r}: parallel or shared")
        need(self.adapter_rank >= 0, f"adapter_rank must be >= 0, got {self.adapter_rank}")
        if self.hybrid_block != "shared":
            need(
                not (self.shared_blocks or self.adapter_rank or self.attention_adapters),
                "shared_blocks, adapter_rank and attention_adapters need hybrid_block 'shared'",
            )
            return
        hybrid = [i for i in range(self.num_layers) if self.layer_types[i] == "hybrid"]
        need(self.shared_blocks >= 1, f"hybrid_block 'shared' needs shared_blocks >= 1, got {self.shared_blocks}")
        need(
            all(self.has_mlp(i) for i in hybrid) and self.mlp_gated and not self.is_moe and not self.is_mla,
            "hybrid_block 'shared' needs a gated dense MLP and plain attention in every hybrid layer",
        )
        need(self.adapter_rank > 0, f"hybrid_block 'shared' needs adapter_rank > 0, got {self.adapter_rank}")
        need(
            self.norm_placement == "pre" and not self.parallel_residual and self.residual_multiplier == 1.0,
            "hybrid_block 'shared' needs the pre-norm block without parallel_residual or residual_multiplier",
        )
        need(
            not (self.altup_num_inputs or self.laurel_rank or self.per_layer_input_size or self.embedding_size),
            "hybrid_block 'shared' beside AltUp, LAuReL, per-layer inputs or embedding_size is not supported",
        )

    def _validate_gemma3n(self, need: Callable[[bool, str], None]) -> None:
        """AltUp, LAuReL and the MLPs' activation sparsity (Gemma 3n's) on the blocks they are defined on."""
        need(self.altup_num_inputs >= 0 and self.laurel_rank >= 0, "altup_num_inputs and laurel_rank must be >= 0")
        if self.altup_num_inputs:
            need(0 <= self.altup_active_idx < self.altup_num_inputs, "altup_active_idx outside the AltUp copies")
            need(not self.layer_scalar, "altup_num_inputs beside layer_scalar")
        if self.altup_num_inputs or self.laurel_rank:
            need(
                not self.parallel_residual and "hybrid" not in self.layer_types and self.residual_multiplier == 1.0,
                "altup_num_inputs / laurel_rank need sequential residuals (no parallel_residual, hybrid layers or "
                "residual_multiplier)",
            )
            need(
                all(self.has_mixer(i) for i in range(self.num_layers)),
                "altup_num_inputs / laurel_rank need a token mixer in every layer",
            )
        if self.activation_sparsity:
            need(
                len(self.activation_sparsity) == self.num_layers,
                f"activation_sparsity needs one value per layer ({self.num_layers})",
            )
            need(all(0.0 <= s < 1.0 for s in self.activation_sparsity), "activation_sparsity values must be in [0, 1)")
            need(self.mlp_gated, "activation_sparsity needs a gated MLP")

    def layer_o_bias(self, layer: int) -> bool:
        """Whether `layer`'s attention output projection has a bias (o_bias, or o_bias_layers)."""
        return self.o_bias or layer in self.o_bias_layers

    def layer_activation_sparsity(self, layer: int) -> float:
        """`layer`'s MLP gate target sparsity (`activation_sparsity`; 0: dense)."""
        return self.activation_sparsity[layer] if self.activation_sparsity else 0.0

    def _validate_moa(self, need: Callable[[bool, str], None]) -> None:
        """JetMoE's mixture of attention heads (keel.model.moa): its router is the MoE's, its queries top-k experts'
        over the shared K/V heads; the attention options it does not read are refused by name."""
        need(self.is_moe, "mixture_of_attention needs experts (num_experts, num_experts_per_tok)")
        need(
            self.num_heads == self.num_kv_heads * self.num_experts_per_tok,
            f"mixture_of_attention: num_heads ({self.num_heads}) must be num_kv_heads ({self.num_kv_heads}) x "
            f"num_experts_per_tok ({self.num_experts_per_tok})",
        )
        need(not self.is_mla, "mixture_of_attention with multi-head latent attention (kv_lora_rank)")
        need(
            all(self.layer_types[i] in ("full_attention", "sliding_attention") for i in range(self.num_layers)),
            "mixture_of_attention needs attention in every layer (layer_types)",
        )
        need(self.uniform_attention, "mixture_of_attention with layers of their own head geometry")
        unread = {
            "qkv_bias": self.qkv_bias,
            "o_bias_layers": self.o_bias_layers,
            "qk_norm": self.qk_norm,
            "attention_output_gate": self.attention_output_gate,
            "attention_adapters": self.attention_adapters,
            "attn_sub_norm": self.attn_sub_norm,
            "attention_sinks": self.attention_sinks,
            "kv_shared_layers": self.kv_shared_layers,
            "clip_qkv": self.clip_qkv is not None,
            "v_norm": self.v_norm,
            "attention_k_eq_v": self.attention_k_eq_v,
            "qk_l2_norm": self.qk_l2_norm,
            # its keys and values are projected in keel.model.moa, which does not scale the values
            "attention_value_scale": self.attention_value_scale != 1.0,
            # ALiBi's slopes would follow keel's kv-head-major order of the experts' heads, not transformers'
            "position_embedding alibi": self.position_embedding == "alibi",
            "router_linear_bias": self.router_linear_bias,
            "router_bias": self.router_bias,
            "router_input_norm": self.router_input_norm,
            "router_expert_scale": self.router_expert_scale,
        }
        for name, value in unread.items():
            need(not value, f"{name} is not read by mixture_of_attention")

    def _validate_mla(self, need: Callable[[bool, str], None]) -> None:
        need(
            self.rope_interleave or self.architecture != "deepseek_v2",
            "deepseek_v2 rotates interleaved pairs (rope_interleave must be true)",
        )
        need(
            self.qk_rope_head_dim > 0 and self.qk_rope_head_dim % 2 == 0,
            f"qk_rope_head_dim must be positive and even, got {self.qk_rope_head_dim}",
        )
        need(self.qk_nope_head_dim >= 0, f"qk_nope_head_dim must be >= 0, got {self.qk_nope_head_dim}")
        need(self.v_head_dim > 0, f"v_head_dim must be positive, got {self.v_head_dim}")
        need(
            self.head_dim == self.qk_nope_head_dim + self.qk_rope_head_dim,
            f"with multi-head latent attention head_dim ({self.head_dim}) must be qk_nope_head_dim + "
            f"qk_rope_head_dim ({self.qk_nope_head_dim} + {self.qk_rope_head_dim})",
        )
        need(
            self.num_kv_heads == self.num_heads,
            f"with multi-head latent attention num_kv_heads ({self.num_kv_heads}) must equal num_heads "
            f"({self.num_heads})",
        )
        rank = self.q_lora_rank
        need(rank is None or rank > 0, f"q_lora_rank must be positive or None, got {rank}")
        need(self.sliding_window is None, "multi-head latent attention has no sliding-window variant")
        need(not self.qk_norm, "multi-head latent attention has no q/k norm")

    def _validate_dsa(self, need: Callable[[bool, str], None]) -> None:
        need(self.index_topk > 0, f"index_topk must be positive with an indexer, got {self.index_topk}")
        need(self.is_mla, "index_topk (DeepSeek Sparse Attention) needs multi-head latent attention (kv_lora_rank)")
        need(
            self.q_lora_rank is not None,
            "index_topk (DeepSeek Sparse Attention) needs a low-rank query (q_lora_rank)",
        )
        need(self.index_n_heads > 0, f"index_n_heads must be positive, got {self.index_n_heads}")
        need(
            self.index_head_dim >= self.qk_rope_head_dim > 0,
            f"index_head_dim ({self.index_head_dim}) must be at least qk_rope_head_dim ({self.qk_rope_head_dim})",
        )
        types = self.indexer_types
        need(not types or len(types) == self.num_layers, "indexer_types must have one entry per layer")
        need(set(types) <= {"full", "shared"}, f"indexer_types must be full or shared, got {sorted(set(types))}")
        need(not types or types[0] == "full", "indexer_types: the first layer must be full (a shared one reuses it)")
        need(
            all(self.is_attention_layer(i) for i in range(self.num_layers)),
            "index_topk (DeepSeek Sparse Attention) needs every layer to be attention",
        )
        need(not self.rope_layers or all(self.rope_layers), "DeepSeek Sparse Attention rotates every layer")

    def _validate_linear(self, need: Callable[[bool, str], None]) -> None:
        for name in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim"):
            need(getattr(self, name) > 0, f"{name} must be positive with linear_attention layers")
        need(
            self.linear_num_value_heads % self.linear_num_key_heads == 0,
            f"linear_num_value_heads ({self.linear_num_value_heads}) must be a multiple of linear_num_key_heads "
            f"({self.linear_num_key_heads})",
        )
        need(self.linear_conv_kernel_dim >= 2, "linear_conv_kernel_dim must be at least 2")
        need(self.linear_beta_scale > 0, f"linear_beta_scale must be positive, got {self.linear_beta_scale}")
        need(
            self.linear_norm_eps is None or self.linear_norm_eps > 0,
            f"linear_norm_eps must be positive or None, got {self.linear_norm_eps}",
        )
        need(
            self.linear_variant in ("gated_deltanet", "kda"),
            f"linear_variant {self.linear_variant!r} is not known (gated_deltanet, kda)",
        )
        if self.linear_variant == "kda":
            need(
                self.linear_num_key_heads == self.linear_num_value_heads
                and self.linear_key_head_dim == self.linear_value_head_dim,
                "linear_variant 'kda' has one head count and one width for keys and values",
            )
            need(self.linear_beta_scale == 1.0, "linear_beta_scale is Gated DeltaNet's (linear_variant 'kda' has none)")
        kda = self.kda_full_rank_gates or self.kda_gate_lower_bound is not None
        need(
            not kda or self.linear_variant == "kda",
            "kda_full_rank_gates and kda_gate_lower_bound need linear_variant 'kda'",
        )
        need(
            self.kda_gate_lower_bound is None or self.kda_gate_lower_bound < 0,
            f"kda_gate_lower_bound must be negative (a log decay), got {self.kda_gate_lower_bound}",
        )

    # ------------------------------------------------------------- parameters
    def _linear_attention_params(self) -> int:
        """A Gated DeltaNet layer's: projections of q/k/v, the output gate z, beta and the decay; the convolution;
        the decay's A_log and dt_bias; the gated norm; the output projection."""
        h, keys = self.hidden_size, self.linear_num_key_heads * self.linear_key_head_dim
        heads, values = self.linear_num_value_heads, self.linear_num_value_heads * self.linear_value_head_dim
        if self.linear_variant == "kda":  # q/k/v, beta, the low-rank decay and gate, dt_bias per channel, A_log
            d = self.linear_value_head_dim
            gates = 2 * h * values if self.kda_full_rank_gates else 2 * (h * d + d * values)  # f and g
            projections = 3 * h * values + h * heads + gates + values * h
            return projections + 3 * values * self.linear_conv_kernel_dim + values + heads + d
        conv = 2 * keys + values
        projections = h * conv + h * values + 2 * h * heads + values * h
        return projections + conv * self.linear_conv_kernel_dim + 2 * heads + self.linear_value_head_dim

    def _adapter_params(self, layer: int) -> int:
        """A Zamba 2 hybrid layer's adapters: the low-rank pairs on the shared gate/up projection and on q/k/v."""
        rank, h = self.adapter_rank, self.hidden_size
        if not rank:
            return 0
        total = rank * (h + 2 * self.intermediate_size)
        if self.attention_adapters:
            q, kv, v = self.layer_q_size(layer), self.layer_kv_size(layer), self.layer_v_size(layer)
            total += rank * (3 * 2 * h + q + kv + v)
        return total

    def _mamba_params(self) -> int:
        """A Mamba 2 mixer's: in_proj (gate, x/B/C, steps), the convolution, dt_bias / A_log / D, the norm, out_proj."""
        h, heads, inner = self.hidden_size, self.mamba_n_heads, self.mamba_n_heads * self.mamba_d_head
        channels = inner + 2 * self.mamba_n_groups * self.mamba_d_state
        projected = inner + channels + heads
        norm = 0 if self.mamba_norm == "gate" else inner
        total = h * projected + channels * self.mamba_d_conv + 3 * heads + norm + inner * h
        if self.mamba_conv_bias:
            total += channels
        return total + (projected if self.mamba_proj_bias else 0) + (h if self.mamba_out_bias else 0)

    def _mamba1_params(self) -> int:
        """A Mamba 1 mixer's: in_proj (x, gate), the convolution, x_proj (step, B, C), dt_proj, A_log [inner, N], D,
        out_proj, and the step/B/C norms' weights where they have them."""
        h, inner, n, rank = self.hidden_size, self.mamba_d_inner, self.mamba_d_state, self.mamba_dt_rank
        total = h * 2 * inner + inner * self.mamba_d_conv + inner * (rank + 2 * n) + (rank + 1) * inner
        total += inner * n + inner + inner * h
        if self.mamba_conv_bias:
            total += inner
        total += (2 * inner if self.mamba_proj_bias else 0) + (h if self.mamba_out_bias else 0)
        return total + (rank + 2 * n if self.mamba_dt_bc_norm == "rms" else 0)

    def _moa_params(self) -> tuple[int, int]:
        """(total, active) of a mixture-of-attention layer (keel.model.moa): the shared k/v projections, the router,
        each expert's query and output projections (top-k of them active) and the output bias."""
        h, width = self.hidden_size, self.kv_size
        shared = 2 * h * width + self.num_experts * h + (h if self.o_bias else 0)
        expert = 2 * h * width
        return shared + self.num_experts * expert, shared + self.num_experts_per_tok * expert

    def _attention_params(self, layer: int) -> int:
        h = self.hidden_size
        if self.is_mla:
            heads, rank, rope = self.num_heads, self.kv_lora_rank, self.qk_rope_head_dim
            if self.q_lora_rank is None:
                attn = h * self.q_size  # q_proj (never biased)
            else:  # q_a_proj (+ bias), q_a_layernorm, q_b_proj (A.X-K2: q_gate_proj, the query and the gate)
                q_b = self.q_lora_rank * self.q_size
                if self.mla_query_gate:
                    q_b = 2 * self.q_lora_rank * heads * (self.head_dim + self.v_head_dim)
                attn = h * self.q_lora_rank + self.q_lora_rank + q_b
                attn += self.q_lora_rank if self.qkv_bias else 0
            attn += h * (rank + rope) + ((rank + rope) if self.qkv_bias else 0)  # kv_a_proj_with_mqa
            attn += rank + rank * heads * (self.qk_nope_head_dim + self.v_head_dim)  # kv_a_layernorm, kv_b_proj
            if self.is_dsa and self.index_source(layer) == layer:  # wq_b, wk, k_norm (LayerNorm), weights_proj
                n, d = self.index_n_heads, self.index_head_dim
                attn += self.q_lora_rank * n * d + h * d + 2 * d + h * n
            attn += h * heads if self.attention_output_gate else 0  # Bailing Hybrid's gate per head
            return attn + heads * self.v_head_dim * h + (h if self.o_bias else 0)  # o_proj
        q_size, kv_size, head_dim = self.layer_q_size(layer), self.layer_kv_size(layer), self.layer_head_dim(layer)
        v_size = 0 if self.layer_k_eq_v(layer) else self.layer_v_size(layer)  # k = v: no v_proj
        o_size = self.num_heads * self.layer_v_head_dim(layer)
        if self.kv_source(layer) != layer:  # attends over another layer's K/V: q and o only (and q's norm)
            v_size, kv_size = 0, 0
        h_out, h = h, self.attention_input_size(layer)  # Zamba 2's hybrid layers: q/k/v read 2 x hidden_size
        attn = h * q_size + h * (kv_size + v_size) + o_size * h_out
        if self.qkv_bias:
            attn += q_size + kv_size + v_size
        if self.layer_o_bias(layer):
            attn += h_out
        if self.attention_output_gate and self.attention_gate_per_head:
            attn += h * self.num_heads
        elif self.attention_output_gate:
            attn += h * q_size + (q_size if self.qkv_bias else 0)
        if self.qk_norm:
            whole = self.qk_norm_scope in ("all", "each_head")  # a weight per channel of the projections
            k_norm = kv_size if whole else head_dim if kv_size else 0
            norms = (q_size if whole else head_dim) + k_norm
            attn += 2 * norms if self.qk_norm_bias else norms
        if self.layer_has_sinks(layer):
            attn += self.num_heads
        if self.attn_sub_norm:
            attn += self.num_heads * self.layer_v_head_dim(layer)  # over the values the heads give o_proj
        return attn

    def param_counts(self) -> dict[str, int]:
        """Parameter counts: total, active per token (MoE routes each token to top-k experts), the
        active ones a token multiplies (without the input embedding lookup) and the embedding tables.

        DeepSeek's e_score_correction_bias is a buffer (adjusted by load statistics, not by
        gradients), as in transformers, so it is not counted."""
        h = self.hidden_size
        mats = 3 if self.mlp_gated else 2

        def dense_mlp(width: int) -> int:
            params = mats * h * width + ((mats - 1) * width + h if self.mlp_bias else 0)
            params += width if self.ffn_sub_norm else 0
            return params + (2 if self.hidden_act == "xielu" else 0)  # xIELU's alpha_p and alpha_n

        width = self.moe_intermediate_size
        expert = mats * h * width + ((mats - 1) * width + h if self.expert_bias else 0)
        shared_gate = h if self.shared_expert_intermediate_size and self.shared_expert_gated else 0
        shared_width = self.shared_expert_intermediate_size
        shared = mats * h * shared_width + shared_gate
        shared += ((mats - 1) * shared_width + h) if self.mlp_bias and shared_width else 0
        norm = h * (2 if self.norm_bias else 1) if self.norm_affine else 0

        def sublayer_norms(layer: int) -> tuple[int, int]:  # the mixer's and the MLP's, by the layer's placement
            placement = self.layer_norm_placement(layer)
            pre, post = placement != "post", placement in ("post", "sandwich")  # post_residual: the pre norms' two
            return norm * (pre + post), norm * (pre * self.post_attention_norm + post)

        total = active = 0
        linear = self._linear_attention_params() if self.has_linear_attention else 0
        conv = (4 * h + self.short_conv_kernel) * h + (5 * h if self.short_conv_bias else 0)  # in, conv, out
        mamba = self._mamba_params() if any(self.has_mamba(i) for i in range(self.num_layers)) else 0
        mamba1 = self._mamba1_params() if "mamba1" in self.layer_types else 0
        inner = self.num_heads * self.head_dim  # lightning: qkv_proj, output_gate, the norm, out_proj
        lightning = 5 * h * inner + inner
        # rglru: linear_x, linear_y, linear_out and the convolution (all biased), the LRU's decay parameter and its
        # two block-diagonal gates with their biases
        w = self.lru_width
        rglru = 3 * h * w + 2 * w + h + w * (self.lru_conv_kernel + 1) + w + 2 * (w * (w // self.num_heads) + w)
        mixers = {
            "linear_attention": linear,
            "conv": conv,
            "mamba": mamba,
            "mamba1": mamba1,
            "lightning": lightning,
            "rglru": rglru,
        }
        # Zamba 2: each shared block's weights are stored once (in the first hybrid layer running it), run by each
        # hybrid layer of its turn: the total counts them once, the active parameters at each run
        stored_blocks = (
            {layers[0] for layers in self.shared_block_layers() if layers} if self.hybrid_block == "shared" else set()
        )
        for layer in range(self.num_layers):
            kind = self.layer_types[layer]
            mixer_norms, mlp_norms = sublayer_norms(layer)
            if self.shared_hybrid(layer):  # the layer's own: its mixer and norm, the projection back, the adapters
                own = mamba + norm + h * h + self._adapter_params(layer)
                block = self._attention_params(layer) + 3 * norm + dense_mlp(self.intermediate_size)
                total += own + (block if layer in stored_blocks else 0)
                active += own + block
                continue
            if not self.has_mixer(layer):
                base = 0
            elif kind in mixers:
                base = mixers[kind] + mixer_norms
            elif self.mixture_of_attention:  # the attention experts: top-k of them active
                moa_total, moa_active = self._moa_params()
                total += moa_total - moa_active
                base = moa_active + mixer_norms
            else:  # attention at the layer's own geometry; a hybrid layer's Mamba 2 mixer beside it
                base = self._attention_params(layer) + (mamba if kind == "hybrid" else 0) + mixer_norms
            if not self.has_mlp(layer):
                total += base
                active += base
                continue
            base += mlp_norms
            if self.gated_norm_rank:  # A.X-K2: fc1/fc2 of the input norm's gate, and of the norm before the experts
                base += 2 * h * self.gated_norm_rank * (1 + self.is_moe_layer(layer))
            if self.is_moe_layer(layer):
                router = (h + (1 if self.router_linear_bias else 0)) * self.num_experts
                if self.architecture in SELECTION_BIAS_PARAMETER:
                    router += self.num_experts
                router += (h if self.router_input_norm else 0) + (self.num_experts if self.router_expert_scale else 0)
                if self.moe_branch_norms:  # four norms, one of them the layer's own norm before the MLP
                    router += 3 * norm
                if self.moe_output_norm:
                    router += norm
                router += h if self.moe_output_bias else 0
                total += base + router + shared + self.num_experts * expert
                active += base + router + shared + self.num_experts_per_tok * expert
            else:
                total += base + dense_mlp(self.layer_intermediate_size(layer))
                active += base + dense_mlp(self.layer_intermediate_size(layer))
        # per-layer inputs: each layer's gate, projection and norm; the model's projection and its norm, the table
        if self.altup_num_inputs:  # per layer: the correct scale, both coefficient maps, the router and its norm
            n = self.altup_num_inputs
            altup = h + n * n + n * n * n + h * n + h
            total += self.num_layers * altup + 2 * (n - 1) * h * h  # and the model's projections in and out
            active += self.num_layers * altup + 2 * (n - 1) * h * h
        if self.laurel_rank:  # per layer: the low-rank pair and its norm
            total += self.num_layers * (2 * h * self.laurel_rank + h)
            active += self.num_layers * (2 * h * self.laurel_rank + h)
        per_layer, ple_embed = self.per_layer_input_size, 0
        if per_layer:
            ple = self.num_layers * (2 * h * per_layer + norm) + h * self.num_layers * per_layer + per_layer
            total += ple
            active += ple
            ple_embed = self.ple_vocab_size * self.num_layers * per_layer
        width = self.embedding_size or h  # the embedding's and the head's (OPT-350m's projections between)
        embed = self.vocab_size * width
        positions = self.learned_positions * h  # GPT-2's learned position table: a row lookup too
        head = 0 if self.tie_word_embeddings else self.vocab_size * width
        head += self.vocab_size if self.lm_head_bias else 0
        positions += ple_embed  # the per-layer input table: a row lookup too
        norm_count = norm if self.final_norm else 0
        norm_count += norm if self.embedding_norm else 0  # the embedding's own norm (Bloom's; NanoChat's has no weight)
        final = norm_count + (2 * h * width if self.embedding_size else 0)
        total += embed + positions + head + final
        active += embed + positions + head + final
        # The input embedding is a row lookup, not a matmul: the FLOPs (6 x N per trained token) and
        # the "activated parameters" model cards publish count the rest (a tied table, as the head, counts).
        matmul = active - positions - (0 if self.tie_word_embeddings else embed)
        return {"total": total, "active": active, "active_matmul": matmul, "embedding": embed + positions + head}

    # ---------------------------------------------------------------- HF I/O
    @classmethod
    def from_hf(cls, hf: dict[str, Any], source: str = "config.json", structure_only: bool = False) -> ModelConfig:
        """Build from an HF config.json dict (transformers 4.x `rope_scaling` or 5.x `rope_parameters`).
        structure_only: the architecture is all that is wanted (the planner), so a quantized release's
        config (DeepSeek-V3's FP8) is read too; loading such weights is still refused. A field of the wrong type
        (a string where a number goes, an object where a list goes) is a ConfigError naming the file."""
        try:
            return cls._from_hf(hf, source, structure_only)
        except (TypeError, ValueError, AttributeError, ZeroDivisionError, IndexError, KeyError) as e:
            detail = " ".join(f"{type(e).__name__}: {e}".split())
            raise ConfigError(f"{source}: malformed config, a field of the wrong type or value ({detail})") from None

    @classmethod
    def _from_hf(cls, hf: dict[str, Any], source: str, structure_only: bool) -> ModelConfig:
        hf = _text_config(hf, source)
        family = _family_from_hf(hf, source)
        hf = as_current_config(family, hf)
        defaults = FAMILY_DEFAULTS[family]
        default_rope = getattr(FAMILIES.get(family), "DEFAULT_ROPE", None)
        if default_rope is not None and not (hf.get("rope_parameters") or hf.get("rope_scaling")):
            # the family's config class sets whole rope parameters where the file has none (a top-level
            # rope_theta then goes unread, as in transformers)
            hf = {**hf, "rope_parameters": dict(default_rope)}
        own = FAMILIES[family].config_fields(hf, source) if family in FAMILIES else {}
        hidden, num_heads, num_layers, vocab = _required_from_hf(hf, source, defaults)
        if not structure_only:
            _refuse_quantized(family, hf, source)
        # where the file has none, the family's config class's own default (a fixed number in many), else the
        # common rule
        head_dim = int(_hf_get(hf, "head_dim", defaults.get("head_dim") or hidden // num_heads))
        num_kv_heads = int(_hf_get(hf, "num_key_value_heads", defaults.get("num_key_value_heads") or num_heads))
        max_positions = int(_hf_get(hf, "max_position_embeddings", defaults["max_position_embeddings"]))
        per_kind = _rope_per_layer_kind(hf)
        if per_kind is not None:  # transformers' per-kind form: {"full_attention": {...}, "sliding_attention": {...}}
            rope_theta, scaling = _rope_from_hf(
                per_kind["full_attention"], defaults["rope_theta"], source, max_positions
            )
            if "sliding_attention" in per_kind:
                local_theta, local_scaling = _rope_from_hf(
                    per_kind["sliding_attention"], defaults["rope_theta"], source, max_positions
                )
                own.update(sliding_rope_theta=local_theta, sliding_rope_scaling=local_scaling)
        else:
            rope_theta, scaling = _rope_from_hf(hf, defaults["rope_theta"], source, max_positions, family)
        sliding_window, layer_types = _sliding_from_hf(family, hf, num_layers)
        eos = _hf_get(hf, "eos_token_id", [])
        mla: dict[str, Any] = {}
        if family in MLA_FAMILIES:
            mla = _mla_from_hf(hf, defaults)
            if family == "deepseek_v2":  # no such key: V2 always rotates interleaved pairs
                mla["rope_interleave"] = True
            # HF's `head_dim` is the rotary width here; keel's is the query/key width (see the fields).
            head_dim, num_kv_heads = mla["qk_nope_head_dim"] + mla["qk_rope_head_dim"], num_heads
        moe = _moe_from_hf(family, hf, defaults, num_layers, source)
        act = _hf_get(hf, "hidden_act", defaults.get("hidden_act", "silu"))  # a family's own default (relu2)
        if act not in HIDDEN_ACTS:
            raise ConfigError(f"{source}: hidden_act {act!r} is not supported ({', '.join(HIDDEN_ACTS)})")
        fields = dict(
            architecture=family,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=int(_hf_get(hf, "intermediate_size", 0)),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(_hf_get(hf, "rms_norm_eps", defaults["rms_norm_eps"])),
            rope_theta=rope_theta,
            rope_scaling=scaling,
            max_position_embeddings=max_positions,
            hidden_act=HIDDEN_ACTS[act],
            tie_word_embeddings=bool(_hf_get(hf, "tie_word_embeddings", False)),
            **_biases_from_hf(family, hf),
            qk_norm=family in ("qwen3", "qwen3_moe"),
            **_scalars_from_hf(family, hf),
            sliding_window=sliding_window,
            layer_types=layer_types,
            bos_token_id=_hf_get(hf, "bos_token_id"),
            eos_token_id=list(eos) if isinstance(eos, list) else [int(eos)],
            pad_token_id=_hf_get(hf, "pad_token_id"),
            dtype=str(_hf_get(hf, "dtype", _hf_get(hf, "torch_dtype", "float32"))),
            **moe,
            **mla,
        )
        return cls(**{**fields, **own})  # a family file's fields over the common reading

    @classmethod
    def from_json_file(cls, path: str | Path, structure_only: bool = False) -> ModelConfig:
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{path}: file not found") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected a JSON object")
        return cls.from_hf(data, source=str(path), structure_only=structure_only)

    def transformers_attention(self) -> dict[str, str]:
        """from_pretrained / from_config options for transformers' reference of this model: eager attention
        for attention-score soft-capping (Gemma 2), which SDPA cannot do and some transformers releases run
        anyway, dropping the cap; none otherwise."""
        return {"attn_implementation": "eager"} if self.attn_logit_softcapping else {}

    def to_hf(self) -> dict[str, Any]:
        """An HF config.json dict that transformers 5.x loads into the same architecture."""
        hf: dict[str, Any] = {
            "architectures": [FAMILY_TO_HF[self.architecture]],
            "model_type": self.architecture,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": {"gelu_tanh": "gelu_pytorch_tanh"}.get(self.hidden_act, self.hidden_act),
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "rope_parameters": _rope_to_hf(self.rope_theta, self.rope_scaling)
            if self.sliding_rope_theta is None
            else {
                "full_attention": _rope_to_hf(self.rope_theta, self.rope_scaling),
                "sliding_attention": _rope_to_hf(self.sliding_rope_theta, self.sliding_rope_scaling),
            },
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id[0] if len(self.eos_token_id) == 1 else self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "dtype": self.dtype,
        }
        if self.architecture in ("llama", "granite"):
            hf["attention_bias"] = self.qkv_bias
            hf["mlp_bias"] = self.mlp_bias
        if self.architecture == "granite":
            hf.update(
                embedding_multiplier=self.embedding_multiplier,
                residual_multiplier=self.residual_multiplier,
                attention_multiplier=self.attention_scale,
                logits_scaling=self.logits_scaling,
            )
        if self.architecture in ("qwen3", "qwen3_moe"):
            hf["attention_bias"] = self.qkv_bias
        if self.architecture in DEEPSEEK_MOE_FAMILIES:
            hf.update(_deepseek_moe_to_hf(self))
        if self.architecture in MLA_FAMILIES:
            hf.update(_deepseek_to_hf(self))
        if self.architecture in FAMILIES:  # last: a family's own keys over the readers' it shares (Mistral 4's)
            family = FAMILIES[self.architecture]
            hf.update(family.hf_fields(self, hf))
            for key in getattr(family, "COMPUTED_KEYS", ()):  # its config class's properties: not to be set
                hf.pop(key, None)
        elif self.architecture in ("mistral", "mixtral"):
            hf["sliding_window"] = self.sliding_window
        elif self.architecture not in ("llama", "granite", *FAMILIES):
            hf["use_sliding_window"] = self.sliding_window is not None
            hf["sliding_window"] = self.sliding_window
            hf["layer_types"] = list(self.layer_types)
            hf["max_window_layers"] = self.num_layers
        if self.architecture == "mixtral":
            hf["num_local_experts"] = self.num_experts
            hf["num_experts_per_tok"] = self.num_experts_per_tok
            hf["intermediate_size"] = self.moe_intermediate_size
        elif self.is_moe and self.architecture not in (
            *DEEPSEEK_MOE_FAMILIES,
            *GRANITE_MOE_FAMILIES,
            "ernie4_5_moe",
            "gemma4",
        ):
            hf.update(
                num_experts=self.num_experts,
                num_experts_per_tok=self.num_experts_per_tok,
                moe_intermediate_size=self.moe_intermediate_size,
                norm_topk_prob=self.norm_topk_prob,
                decoder_sparse_step=self.decoder_sparse_step,
                mlp_only_layers=list(self.mlp_only_layers),
            )
            if self.architecture == "qwen2_moe":
                hf["shared_expert_intermediate_size"] = self.shared_expert_intermediate_size
                hf["qkv_bias"] = self.qkv_bias
        return hf

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def exported_hf(self) -> dict[str, Any]:
        """`to_hf()`, checked to read back as this config: a field its family's config.json cannot hold (a keel
        option set on a config built by hand, say) is refused by name instead of written as another model."""
        hf = self.to_hf()
        back = ModelConfig.from_hf(json.loads(json.dumps(hf)), source=f"{self.architecture} config.json")
        lost = [
            f.name
            for f in dataclasses.fields(self)
            if f.name != "dtype" and getattr(back, f.name) != getattr(self, f.name)
        ]
        if lost:
            shown = ", ".join(
                f"{name} {getattr(self, name)!r} (read back as {getattr(back, name)!r})" for name in lost[:4]
            )
            raise ConfigError(f"{self.architecture}'s config.json cannot hold this model's {shown}; not exported")
        return hf


def _refuse_quantized(family: str, hf: dict[str, Any], source: str) -> None:
    """Quantized HF checkpoints (DeepSeek-V3's FP8 release: float8 weights with per-block
    `weight_scale_inv` tensors) would load as wrong numbers: say so instead. GPT-OSS's MXFP4 experts are
    read (keel.weights.gpt_oss dequantizes them)."""
    quant = hf.get("quantization_config")
    if family == "gpt_oss" and isinstance(quant, dict) and quant.get("quant_method") == "mxfp4":
        return
    if family == "bitnet" and isinstance(quant, dict) and quant.get("quant_method") == "bitnet":
        return  # keel.quant.bitnet runs its ternary layers (the family checks the options)
    if quant:
        method = quant.get("quant_method", "unknown") if isinstance(quant, dict) else "unknown"
        raise ConfigError(
            f"{source}: quantized checkpoints (quantization_config, quant_method {method!r}) are not supported; "
            "use a bfloat16/float16/float32 checkpoint (e.g. DeepSeek's FP8 weights dequantized to bf16)"
        )


def _hf_get(hf: dict[str, Any], key: str, default: Any = None) -> Any:
    """hf[key], or the default when the key is absent or null."""
    value = hf.get(key)
    return default if value is None else value


# Multimodal checkpoints whose decoder keel runs on its own (text in, text out), by the text model's architecture,
# or None where that is the text config's own `model_type`'s (LLaVA's decoder is whatever model its release pairs
# with a vision tower): their config.json nests it under `text_config` (Qwen2-VL's older files keep it at the top
# level), its tensors under `language_model.` (keel.weights.loader). The vision (and audio) towers are not read.
TEXT_MODEL_OF: dict[str, str | None] = {
    "Llama4ForConditionalGeneration": "Llama4ForCausalLM",
    "Qwen3_5ForConditionalGeneration": "Qwen3_5ForCausalLM",
    "Qwen3_5MoeForConditionalGeneration": "Qwen3_5MoeForCausalLM",
    "Gemma4ForConditionalGeneration": "Gemma4ForCausalLM",
    "Gemma3nForConditionalGeneration": "Gemma3nForCausalLM",
    "Gemma3ForConditionalGeneration": "Gemma3ForCausalLM",
    # M-RoPE decoders (_rope_from_hf: on text alone, the plain rotary)
    "Qwen2VLForConditionalGeneration": "Qwen2ForCausalLM",
    "Qwen2_5_VLForConditionalGeneration": "Qwen2ForCausalLM",
    "Qwen3VLForConditionalGeneration": "Qwen3ForCausalLM",
    "Qwen3VLMoeForConditionalGeneration": "Qwen3MoeForCausalLM",
    "Glm4vForConditionalGeneration": "Glm4ForCausalLM",
    "Glm4vMoeForConditionalGeneration": "Glm4MoeForCausalLM",
    "Ernie4_5_VLMoeForConditionalGeneration": "Ernie4_5_MoeForCausalLM",
    "Ernie4_5_VL_MoeForConditionalGeneration": "Ernie4_5_MoeForCausalLM",
    "HunYuanVLForConditionalGeneration": "HunYuanDenseV1ForCausalLM",
    "Mistral3ForConditionalGeneration": None,
    "LlavaForConditionalGeneration": None,
    "Idefics3ForConditionalGeneration": None,
    "SmolVLMForConditionalGeneration": None,
    "LlavaNextForConditionalGeneration": None,
    "LlavaOnevisionForConditionalGeneration": None,
    "FastVlmForConditionalGeneration": None,
    "InternVLForConditionalGeneration": None,
    "AyaVisionForConditionalGeneration": None,
    "Lfm2VlForConditionalGeneration": None,
    "Lfm3VlForConditionalGeneration": None,
    "Apertus1p5ForConditionalGeneration": "Apertus1p5TextForCausalLM",
    "Gemma4UnifiedForConditionalGeneration": "Gemma4UnifiedForCausalLM",
    # Llama 3.2 Vision: a Llama over its self-attention layers on text (_mllama_text)
    "MllamaForConditionalGeneration": "LlamaForCausalLM",
}

# The text config class's defaults of the keys keel requires, by the text config's `model_type`, where releases leave
# them out of `text_config` (LLaVA 1.5's names five keys of its Vicuna: LlamaConfig's 7B shape for the rest;
# LLaVA-NeXT's Mistral names its MLP width and KV heads: MistralConfig's 7B shape for the rest).
TEXT_CONFIG_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
    },
    "mistral": {
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
    },
    # MllamaTextConfig's (Llama 3.2 11B Vision's): its eps and theta are not LlamaConfig's
    "mllama_text_model": {
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 40,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "max_position_embeddings": 131072,
    },
}
# What a multimodal release's text model does whatever its text config says (given the text config): Qwen3-VL-MoE's
# router always renormalises its top k (transformers' Qwen3VLMoeTextTopKRouter; Qwen3-MoE's own follows
# norm_topk_prob); GLM-4V's attention always has q/k/v biases and heads of hidden_size / num_attention_heads
# (GLM-4's take `attention_bias` and `head_dim`); Aya Vision's head is a plain linear, without Command R7B's
# `logit_scale` (transformers' AyaVisionForConditionalGeneration; vLLM's applies it: the same greedy tokens).
TEXT_MODEL_FIXED: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "Qwen3VLMoeForConditionalGeneration": lambda text: {"norm_topk_prob": True},
    "AyaVisionForConditionalGeneration": lambda text: {"logit_scale": 1.0},
    "MllamaForConditionalGeneration": lambda text: _mllama_text(text),
    "Ernie4_5_VLMoeForConditionalGeneration": lambda text: _ernie_vl_text(text),
    "Ernie4_5_VL_MoeForConditionalGeneration": lambda text: _ernie_vl_text(text),
    "Glm4vForConditionalGeneration": lambda text: {
        "attention_bias": True,
        "head_dim": int(text["hidden_size"]) // int(text["num_attention_heads"]),
    },
}


# Llama 3.2 Vision's text model saved on its own (its config the text config, model_type mllama_text_model)
MLLAMA_TEXT_ALONE = {"MllamaForCausalLM"}
# MllamaTextConfig's cross-attention layers where its config names none (Llama 3.2 11B Vision's)
MLLAMA_CROSS_ATTENTION_LAYERS = [3, 8, 13, 18, 23, 28, 33, 38]


def mllama_cross_attention_layers(text: dict[str, Any]) -> list[int]:
    """Llama 3.2 Vision's cross-attention layers (`cross_attention_layers`, MllamaTextConfig's default where absent)."""
    layers = text.get("cross_attention_layers")
    layers = MLLAMA_CROSS_ATTENTION_LAYERS if layers is None else layers
    count = int(text.get("num_hidden_layers", 40))
    if not isinstance(layers, list) or not all(isinstance(i, int) and 0 <= i < count for i in layers):
        raise ConfigError(f"Llama 3.2 Vision: cross_attention_layers {layers!r} are not layer indices below {count}")
    return sorted(set(layers))


def _mllama_text(text: dict[str, Any]) -> dict[str, Any]:
    """Llama 3.2 Vision's text model (MllamaTextModel) as a Llama: transformers skips its cross-attention layers when
    there is no image (nor cached image states), so on text it is the Llama of its self-attention layers, renumbered
    (keel.weights.loader reads them so). Its heads are hidden_size / num_attention_heads wide, its projections have no
    biases, and its head is never tied to its embedding (which holds 8 rows past vocab_size, for the image tokens:
    read are the first vocab_size)."""
    layers = int(text.get("num_hidden_layers", 40))
    kept = layers - len(mllama_cross_attention_layers(text))
    if kept < 1:
        raise ConfigError("Llama 3.2 Vision: cross_attention_layers leave no self-attention layer to run on text")
    return {
        "num_hidden_layers": kept,
        "head_dim": int(text["hidden_size"]) // int(text["num_attention_heads"]),
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
    }


def _ernie_vl_text(text: dict[str, Any]) -> dict[str, Any]:
    """ERNIE-4.5-VL's text model as ERNIE 4.5 MoE's: the text experts' width and count (the first of each pair, text
    then vision), its expert layers (`mlp_layer_types`, by default all but the first) as one run; a head without
    bias whatever `use_bias` says, which keel's ERNIE 4.5 MoE would give one (refused)."""
    if text.get("use_bias"):
        raise ConfigError("ERNIE-4.5-VL: use_bias is not supported (its head has no bias, ERNIE 4.5 MoE's has)")

    def first(key: str, default: int) -> int:
        value = text.get(key, default)
        return int(value[0] if isinstance(value, list) else value)

    layers = int(text["num_hidden_layers"])
    kinds = text.get("mlp_layer_types") or ["dense"] + ["sparse"] * (layers - 1)
    sparse = [i for i, kind in enumerate(kinds) if kind == "sparse"]
    if not sparse or sparse != list(range(sparse[0], sparse[-1] + 1)):
        raise ConfigError(f"ERNIE-4.5-VL: mlp_layer_types {kinds} are not one run of expert layers")
    return {
        "moe_intermediate_size": first("moe_intermediate_size", 1536),
        "moe_num_experts": first("moe_num_experts", 64),
        "moe_layer_start_index": sparse[0],
        "moe_layer_end_index": sparse[-1],
        "moe_layer_interval": 1,
    }


# Multimodal releases whose text-only computation is not their text model's, by the config's `architectures`: why.
TEXT_MODEL_REFUSED: dict[str, str] = {
    "PaliGemmaForConditionalGeneration": (
        "its prompt (the prefix, token_type_ids 0 from its processor) attends bidirectionally and its positions "
        "start at 1, which Gemma's causal decoder does not compute"
    ),
}


def _text_architecture(outer: str, text: dict[str, Any]) -> str | None:
    """The text model's architecture (TEXT_MODEL_OF), by its config's `model_type` where the release names none:
    transformers' model_type is keel's family name for most families (`gemma3_text` is Gemma 3's text model)."""
    if TEXT_MODEL_OF[outer] is not None:
        return TEXT_MODEL_OF[outer]
    model_type = str(text.get("model_type", ""))
    for family in (BY_MODEL_TYPE.get(model_type), model_type, model_type.removesuffix("_text")):
        if family in FAMILY_TO_HF:
            return FAMILY_TO_HF[family]
    return None


def _text_config(hf: dict[str, Any], source: str) -> dict[str, Any]:
    """A multimodal config's text model as a config of its own (TEXT_MODEL_OF), the outer keys it lacks kept
    (dtype, tie_word_embeddings: the outer one where both have it, as transformers ties the head by the outer
    config's), the keys its release leaves out (TEXT_CONFIG_DEFAULTS) and those its class fixes (TEXT_MODEL_FIXED);
    any other config as it is."""
    archs = hf.get("architectures") or []
    refused = next((a for a in archs if a in TEXT_MODEL_REFUSED), None) if isinstance(archs, list) else None
    if refused is not None:
        raise ConfigError(f"{source}: {refused} is not supported: {TEXT_MODEL_REFUSED[refused]}")
    if hf.get("model_type") == "mllama_text_model" or (isinstance(archs, list) and set(archs) & MLLAMA_TEXT_ALONE):
        # Llama 3.2 Vision's text model on its own (MllamaForCausalLM): the same Llama on text
        text = {**TEXT_CONFIG_DEFAULTS["mllama_text_model"], **hf}
        return {**text, **_mllama_text(text), "architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    outer = next((a for a in archs if a in TEXT_MODEL_OF), None) if isinstance(archs, list) else None
    if outer is None:
        return hf
    text = hf.get("text_config")
    if not isinstance(text, dict):
        if "vision_config" not in hf or TEXT_MODEL_OF[outer] is None:
            return hf
        text = {}  # Qwen2-VL's files before transformers 4.52: the text model's keys at the top level
    text = {**TEXT_CONFIG_DEFAULTS.get(str(text.get("model_type")), {}), **text}
    arch = _text_architecture(outer, text)
    if arch is None:
        kind = text.get("model_type")
        raise ConfigError(f"{source}: {outer}'s text model (text_config model_type {kind!r}) is no family keel runs")
    inner = {
        k: v
        for k, v in hf.items()
        if k not in ("text_config", "vision_config", "audio_config", "architectures", "model_type")
    }
    tie = {"tie_word_embeddings": hf["tie_word_embeddings"]} if "tie_word_embeddings" in hf and text else {}
    fixed = TEXT_MODEL_FIXED[outer]({**inner, **text}) if outer in TEXT_MODEL_FIXED else {}
    return {**inner, **text, **tie, **fixed, "architectures": [arch]}


def _family_from_hf(hf: dict[str, Any], source: str) -> str:
    """The keel family of the config's `model_type` where a family is known by it (keel.families.BY_MODEL_TYPE), else
    of its `architectures`, or a ConfigError listing the supported ones."""
    if hf.get("model_type") in BY_MODEL_TYPE:
        return BY_MODEL_TYPE[hf["model_type"]]
    archs = hf.get("architectures") or []
    if isinstance(archs, str):  # one name where transformers writes a list of them
        archs = [archs]
    arch = next((a for a in archs if isinstance(a, str) and a in HF_ARCHITECTURES), None)
    if arch is None:
        found = ", ".join(map(str, archs)) if archs else f"model_type={hf.get('model_type')!r}"
        raise ConfigError(f"{source}: unsupported architecture {found}; supported: {', '.join(HF_ARCHITECTURES)}")
    return HF_ARCHITECTURES[arch]


def _required_from_hf(hf: dict[str, Any], source: str, defaults: dict[str, Any]) -> tuple[int, int, int, int]:
    """(hidden_size, num_attention_heads, num_hidden_layers, vocab_size): the fields with no default (the heads have
    one in a family without attention layers, Mamba's: keel's attention fields are placeholders there)."""
    # transformers 5 writes no num_hidden_layers where it is its layer list's length (Nemotron-H's layers_block_type)
    listed = hf.get("layer_types") or hf.get("layers_block_type")
    if "num_hidden_layers" not in hf and isinstance(listed, list):
        hf = {**hf, "num_hidden_layers": len(listed)}
    try:
        return (
            int(hf["hidden_size"]),
            int(hf["num_attention_heads"] if "num_attention_heads" in hf else defaults["num_attention_heads"]),
            int(hf["num_hidden_layers"]),
            int(hf["vocab_size"] if "vocab_size" in hf else defaults["vocab_size"]),
        )
    except KeyError as e:
        raise ConfigError(f"{source}: missing required field {e.args[0]!r}") from None


def _moe_from_hf(
    family: str, hf: dict[str, Any], defaults: dict[str, Any], num_layers: int, source: str
) -> dict[str, Any]:
    """The ModelConfig fields of the experts (none for a dense family)."""
    if family in DEEPSEEK_MOE_FAMILIES:  # GLM-4.5 and dots.llm1 route and share experts as DeepSeek-V3
        return _deepseek_moe_from_hf(family, hf, defaults, num_layers, source)
    if family not in MOE_FAMILIES:
        return {}

    def get(key: str, default: Any = None) -> Any:
        return _hf_get(hf, key, default)

    return {
        "num_experts": int(get("num_local_experts", get("num_experts", 0))),
        "num_experts_per_tok": int(get("num_experts_per_tok", defaults["num_experts_per_tok"])),
        # Mixtral's experts use intermediate_size; Qwen MoE has a separate expert width.
        "moe_intermediate_size": int(get("intermediate_size") if family == "mixtral" else get("moe_intermediate_size")),
        "norm_topk_prob": True if family == "mixtral" else bool(get("norm_topk_prob", defaults["norm_topk_prob"])),
        "shared_expert_intermediate_size": int(get("shared_expert_intermediate_size", 0))
        if family == "qwen2_moe"
        else 0,
        "decoder_sparse_step": int(get("decoder_sparse_step", 1)),
        "mlp_only_layers": list(get("mlp_only_layers", [])),
    }


def _biases_from_hf(family: str, hf: dict[str, Any]) -> dict[str, bool]:
    """qkv_bias, o_bias and mlp_bias: each family spells its biases its own way."""
    attention_bias = bool(_hf_get(hf, "attention_bias", False))
    qkv_bias = {
        "qwen2": True,
        "qwen2_moe": bool(_hf_get(hf, "qkv_bias", True)),
    }.get(family, attention_bias)
    return {
        "qkv_bias": qkv_bias,
        # Llama's attention_bias covers o_proj too; Qwen's bias is on q/k/v only. DeepSeek's covers
        # q_a_proj, kv_a_proj_with_mqa and o_proj (never q_proj, q_b_proj or kv_b_proj).
        "o_bias": attention_bias
        if family in ("llama", "granite", "qwen3", "qwen3_moe", "deepseek_v2", "deepseek_v3")
        else False,
        "mlp_bias": bool(_hf_get(hf, "mlp_bias", False)) if family in ("llama", "granite") else False,
    }


def _scalars_from_hf(family: str, hf: dict[str, Any]) -> dict[str, Any]:
    """Granite's multipliers under keel's names (GraniteConfig's defaults where absent)."""
    if family != "granite":
        return {}
    return {
        "embedding_multiplier": float(_hf_get(hf, "embedding_multiplier", 1.0)),
        "residual_multiplier": float(_hf_get(hf, "residual_multiplier", 1.0)),
        "attention_scale": float(_hf_get(hf, "attention_multiplier", 1.0)),
        "logits_scaling": float(_hf_get(hf, "logits_scaling", 1.0)),
    }


def _hf_or(hf: dict[str, Any], key: str, default: Any) -> Any:
    """hf[key] when the key is present, even as null (q_lora_rank: null means a full-rank q_proj)."""
    return hf[key] if key in hf else default


def _mla_from_hf(hf: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    q_lora_rank = _hf_or(hf, "q_lora_rank", defaults["q_lora_rank"])
    out = {"q_lora_rank": None if q_lora_rank is None else int(q_lora_rank)}
    for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        out[key] = int(_hf_or(hf, key, defaults[key]))
    out["rope_interleave"] = bool(_hf_or(hf, "rope_interleave", defaults["rope_interleave"]))
    return out


def _deepseek_moe_from_hf(
    family: str, hf: dict[str, Any], defaults: dict[str, Any], num_layers: int, source: str
) -> dict[str, Any]:
    """DeepSeek's MoE: ungated shared experts, dense MLPs in the first `first_k_dense_replace` layers, and a router
    that is V3's (sigmoid scores with a selection bias, groups scored by their top two, weights optionally
    renormalised) or V2's (`_deepseek_v2_router`), the weights times routed_scaling_factor."""

    def get(key: str, default_key: str | None = None) -> Any:
        value = hf.get(key)
        return defaults[default_key or key] if value is None else value

    router = (
        _deepseek_v2_router(hf, source)
        if family == "deepseek_v2"
        else {
            "norm_topk_prob": bool(get("norm_topk_prob")),
            "router_scoring": "sigmoid",
            "router_bias": True,
            "n_group": int(get("n_group")),
            "topk_group": int(get("topk_group")),
        }
    )
    if family != "deepseek_v2":  # fields of DeepSeek-V3's own config.json that transformers fixes
        for key, expected in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
            if hf.get(key, expected) != expected:
                raise ConfigError(f"{source}: DeepSeek-V3 {key} {hf[key]!r} is not supported (only {expected!r})")
    moe_width = int(get("moe_intermediate_size"))
    first_dense = min(int(get("first_k_dense_replace")), num_layers)
    return {
        "num_experts": int(get("n_routed_experts", "num_experts")),
        "num_experts_per_tok": int(get("num_experts_per_tok")),
        "moe_intermediate_size": moe_width,
        # n_shared_experts experts of moe_intermediate_size each act as one wider MLP.
        "shared_expert_intermediate_size": moe_width * int(get("n_shared_experts")),
        "shared_expert_gated": False,
        "mlp_only_layers": list(range(first_dense)),
        "routed_scaling_factor": float(get("routed_scaling_factor")),
        **router,
    }


# DeepSeek-V2's router as ModelConfig fields, from config.json or GGUF alike: a float32 softmax, groups scored by
# their best expert, never renormalised.
DEEPSEEK_V2_ROUTER: dict[str, Any] = {
    "norm_topk_prob": False,
    "router_scoring": "softmax",
    "router_float32": True,
    "router_group_score": "max",
}


def _deepseek_v2_router(hf: dict[str, Any], source: str) -> dict[str, Any]:
    """DeepSeek-V2's router as transformers runs it: a float32 softmax, then the top k (`greedy`) or the top k of
    the topk_group groups whose best expert scores highest (`group_limited_greedy`); never renormalised
    (transformers' router ignores norm_topk_prob, which DeepSeek's V2 releases set false)."""
    method = hf.get("topk_method") or "greedy"
    if method not in ("greedy", "group_limited_greedy"):
        raise ConfigError(
            f"{source}: DeepSeek-V2 topk_method {method!r} is not supported (greedy, group_limited_greedy)"
        )
    if hf.get("scoring_func", "softmax") != "softmax":
        raise ConfigError(f"{source}: DeepSeek-V2 scoring_func {hf['scoring_func']!r} is not supported (softmax)")
    grouped = method == "group_limited_greedy"
    return {
        **DEEPSEEK_V2_ROUTER,
        "n_group": int(hf.get("n_group") or 1) if grouped else 1,
        "topk_group": int(hf.get("topk_group") or 1) if grouped else 1,
    }


def _deepseek_to_hf(config: ModelConfig) -> dict[str, Any]:
    """DeepSeek-V2's and V3's attention keys (their experts': `_deepseek_moe_to_hf`)."""
    return {
        # transformers' DeepseekV3 attention needs num_key_value_heads == num_attention_heads; its
        # `head_dim` is the rotary width.
        "num_key_value_heads": config.num_heads,
        "head_dim": config.qk_rope_head_dim,
        "attention_bias": config.qkv_bias,
        "q_lora_rank": config.q_lora_rank,
        "kv_lora_rank": config.kv_lora_rank,
        "qk_nope_head_dim": config.qk_nope_head_dim,
        "qk_rope_head_dim": config.qk_rope_head_dim,
        "v_head_dim": config.v_head_dim,
        "rope_interleave": config.rope_interleave,
    }


def _deepseek_moe_to_hf(config: ModelConfig) -> dict[str, Any]:
    """The expert keys of DeepSeek-V3 and the families that route as it does (DEEPSEEK_MOE_FAMILIES)."""
    arch = config.architecture
    # GLM-4.7-Flash's config lists each layer's kind (its family writes mlp_layer_types): any dense layers will do.
    listed = arch in LAYER_KINDS_LISTED
    if not listed and config.mlp_only_layers != list(range(len(config.mlp_only_layers))):
        raise ConfigError(
            f"{arch}: dense layers must be the first k (first_k_dense_replace), got {config.mlp_only_layers}"
        )
    moe_width = config.moe_intermediate_size
    shared = config.shared_expert_intermediate_size
    if config.is_moe and shared % moe_width:
        raise ConfigError(f"{arch}: shared expert width {shared} is not a multiple of {moe_width}")
    v2 = {"topk_method": "group_limited_greedy" if config.n_group > 1 else "greedy"} if arch == "deepseek_v2" else {}
    return {
        "n_routed_experts": config.num_experts,
        "num_experts_per_tok": config.num_experts_per_tok,
        "moe_intermediate_size": moe_width,
        "n_shared_experts": shared // moe_width if config.is_moe else 0,
        # A dense-only config: every layer is among the first k.
        **(
            {}
            if listed
            else {"first_k_dense_replace": len(config.mlp_only_layers) if config.is_moe else config.num_layers}
        ),
        "norm_topk_prob": config.norm_topk_prob,
        "n_group": config.n_group,
        "topk_group": config.topk_group,
        "routed_scaling_factor": config.routed_scaling_factor,
        "num_nextn_predict_layers": 0,  # keel neither reads nor writes multi-token-prediction layers
        **v2,
    }


def _rope_from_hf(
    hf: dict[str, Any], default_theta: float, source: str, max_positions: int, family: str = ""
) -> tuple[float, RopeScaling]:
    params = hf.get("rope_parameters") or {}
    legacy = hf.get("rope_scaling") or {}
    theta = params.get("rope_theta", hf.get("rope_theta"))
    # null as absent: a model without position encoding says so by a null base (OLMo Hybrid's, its `rope_layers`)
    theta = float(default_theta if theta is None else theta)
    spec = params if params.get("rope_type", "default") != "default" or not legacy else legacy
    rope_type = spec.get("rope_type", spec.get("type", "default")) or "default"
    if rope_type == "mrope":
        # M-RoPE (Qwen2-VL's older files name it as a type; transformers 5 reads it as the default rotary with
        # `mrope_section`, and `mrope_interleaved` in Qwen3-VL): each section of the frequencies turns by one of three
        # position components (time, height, width), which are the same position on text alone, so there it is the
        # plain rotary with the same frequencies. keel serves text only; the sections are not read.
        rope_type = "default"
    if rope_type == "xdrope":
        # HunYuan-VL's releases: the NTK-alpha rotary ("dynamic" with `alpha`, as transformers reads it) turned by four
        # position components (`xdrope_section`), one position on text: M-RoPE's case above
        rope_type = "dynamic"
    if rope_type == "su" or (rope_type == "yarn" and "short_factor" in spec):  # Phi-3's older names for longrope
        rope_type = "longrope"
    if rope_type == "dynamic" and spec.get("alpha"):
        # HunYuan's NTK scaling by a fixed alpha only stretches the base (transformers gives it its own type,
        # ntk_alpha, that no sequence length changes): base * alpha^(d / (d - 2)) over the head's d channels.
        dim = int(hf.get("head_dim") or int(hf["hidden_size"]) // int(hf["num_attention_heads"]))
        return theta * float(spec["alpha"]) ** (dim / (dim - 2)), RopeScaling()
    if rope_type not in ROPE_TYPES:
        raise ConfigError(
            f"{source}: rope scaling type {rope_type!r} is not supported (supported: {', '.join(ROPE_TYPES)})"
        )
    if rope_type == "default":
        return theta, RopeScaling()
    if rope_type == "proportional":  # transformers' default of both: 1.0
        share = float(spec.get("partial_rotary_factor", 1.0))
        return theta, RopeScaling(type="proportional", factor=float(spec.get("factor", 1.0)), rotated_share=share)
    # A family whose model puts its own factor on cos/sin in place of the type's (Phi-3.5-MoE's mscale)
    family_factor = getattr(FAMILIES.get(family), "rope_attention_factor", None)
    own_factor = family_factor(rope_type, spec, source) if family_factor is not None else None
    # As transformers' standardize_rope_params for llama3, yarn and longrope: the pre-training context from the
    # config's top level where it has one (Phi-3 keeps it there), else the rope parameters', else
    # max_position_embeddings.
    original = int(
        hf.get("original_max_position_embeddings") or spec.get("original_max_position_embeddings") or max_positions
    )
    if rope_type == "yarn":
        # As transformers: the factor defaults to the ratio of the two contexts, and a missing or zero
        # mscale/mscale_all_dim means "not given".
        factor = spec.get("factor")
        attention_factor = spec.get("attention_factor") if own_factor is None else own_factor
        return theta, RopeScaling(
            type="yarn",
            factor=float(factor if factor is not None else max_positions / original),
            original_max_position_embeddings=original,
            beta_fast=float(spec.get("beta_fast") or 32.0),
            beta_slow=float(spec.get("beta_slow") or 1.0),
            mscale=float(spec.get("mscale") or 0.0),
            mscale_all_dim=float(spec.get("mscale_all_dim") or 0.0),
            attention_factor=None if attention_factor is None else float(attention_factor),
            truncate=bool(spec.get("truncate", True)),
        )
    if rope_type == "longrope":
        # As transformers: the factor the ratio of the two contexts unless given.
        factor = spec.get("factor")
        attention_factor = spec.get("attention_factor") if own_factor is None else own_factor
        try:
            short, long = (tuple(float(x) for x in spec[key]) for key in ("short_factor", "long_factor"))
        except (KeyError, TypeError, ValueError):
            raise ConfigError(f"{source}: rope scaling longrope needs short_factor and long_factor lists") from None
        return theta, RopeScaling(
            type="longrope",
            factor=float(factor if factor is not None else max_positions / original),
            original_max_position_embeddings=original,
            attention_factor=None if attention_factor is None else float(attention_factor),
            short_factor=short,
            long_factor=long,
        )
    return theta, RopeScaling(
        type=rope_type,
        factor=float(spec.get("factor", 1.0)),
        low_freq_factor=float(spec.get("low_freq_factor", 1.0)),
        high_freq_factor=float(spec.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=original,
    )


def _rope_per_layer_kind(hf: dict[str, Any]) -> dict[str, dict[str, Any]] | None:
    """transformers' rope_parameters by layer kind ({"full_attention": {...}, "sliding_attention": {...}}), each
    as a config of its own for _rope_from_hf; None for the common flat form."""
    params = hf.get("rope_parameters")
    if not (isinstance(params, dict) and isinstance(params.get("full_attention"), dict)):
        return None
    return {kind: {"rope_parameters": spec} for kind, spec in params.items() if isinstance(spec, dict)}


def _rope_to_hf(theta: float, scaling: RopeScaling) -> dict[str, Any]:
    out: dict[str, Any] = {"rope_type": scaling.type, "rope_theta": theta}
    if scaling.type in ("linear", "llama3", "yarn", "dynamic") or (
        scaling.type == "proportional" and scaling.factor != 1.0
    ):
        out["factor"] = scaling.factor
    if scaling.type == "proportional":
        out["partial_rotary_factor"] = scaling.rotated_share
    if scaling.type == "yarn":
        out.update(
            original_max_position_embeddings=scaling.original_max_position_embeddings,
            beta_fast=scaling.beta_fast,
            beta_slow=scaling.beta_slow,
        )
        if scaling.mscale:
            out["mscale"] = scaling.mscale
        if scaling.mscale_all_dim:
            out["mscale_all_dim"] = scaling.mscale_all_dim
        if scaling.attention_factor is not None:
            out["attention_factor"] = scaling.attention_factor
        if not scaling.truncate:
            out["truncate"] = False
    if scaling.type == "longrope":
        out.update(
            short_factor=list(scaling.short_factor),
            long_factor=list(scaling.long_factor),
            original_max_position_embeddings=scaling.original_max_position_embeddings,
            factor=scaling.factor,
        )
        if scaling.attention_factor is not None:
            out["attention_factor"] = scaling.attention_factor
    if scaling.type == "llama3":
        out.update(
            low_freq_factor=scaling.low_freq_factor,
            high_freq_factor=scaling.high_freq_factor,
            original_max_position_embeddings=scaling.original_max_position_embeddings,
        )
    return out


def _sliding_from_hf(family: str, hf: dict[str, Any], num_layers: int) -> tuple[int | None, list[str]]:
    """Per-layer attention kinds, mirroring each transformers config class's own rule."""
    window = hf.get("sliding_window") or None
    if family in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe") and not hf.get("use_sliding_window", False):
        window = None
    layer_types = hf.get("layer_types")
    if layer_types and len(layer_types) == num_layers:
        return window, list(layer_types)
    if window is None or family in ("llama", "granite"):
        return None, ["full_attention"] * num_layers
    max_window_layers = int(hf.get("max_window_layers", num_layers))
    if family in ("qwen2", "qwen3"):
        is_sliding = [i >= max_window_layers for i in range(num_layers)]
    elif family == "qwen2_moe":
        is_sliding = [bool((i + 1) % 2) and i < max_window_layers for i in range(num_layers)]
    else:  # mistral, mixtral, qwen3_moe: every layer
        is_sliding = [True] * num_layers
    return window, ["sliding_attention" if s else "full_attention" for s in is_sliding]
