"""GGUF files of the families whose llama.cpp converters write TextModel's keys and little more (keel.weights.gguf):
Gemma 3n, OLMoE, OLMo, Phi-3.5-MoE, Seed-OSS, Arcee AFM, Apertus, Nemotron, MiniMax-M2, Ministral 3, MiniCPM3,
Hunyuan dense and MoE, K-EXAONE, Jais 2, EXAONE 3, Mamba, Mamba 2, GPT-BigCode (StarCoder), GPT-2, Falcon, Jamba,
DBRX, BLOOM, MPT, ChatGLM (GLM-4-9B) and MiMo-V2-Flash.

Each tiny HF model is written the way llama.cpp's convert_hf_to_gguf.py writes its architecture (`write_converted`:
TextModel's keys from the config as the converter reads it, the family's own keys, the checkpoint as saved with each
layer's experts stacked per kind, q/k rows permuted for LlamaModel's subclasses, names by gguf's TensorNameMap), loaded
by keel and compared with transformers running the original HF weights; `keel convert` gives the HF tensors back; and
transformers' greedy tokens come through keel's engine from float32 and from Q8_0 run as stored (slow).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from keel.errors import ConfigError
from keel.quant.loading import load_model
from keel.weights.gguf import open_gguf
from test_gguf import TOKENS, add_mini_vocab, llama3_rope_factors, llama_cpp_permute, rel_err
from test_gguf_families import assert_served_as_transformers, finish_writer
from tiny_models import build_hf_model

pytest.importorskip("transformers")
SLOW = pytest.mark.slow


def text_model_keys(w: gguf.GGUFWriter, hp: dict[str, Any]) -> None:
    """The keys llama.cpp's TextModel.set_gguf_parameters writes from config.json (`hp`, as AutoConfig.to_dict()
    gives it), each where the config has its value."""
    first = lambda *keys: next((hp[k] for k in keys if hp.get(k) is not None), None)  # noqa: E731
    w.add_block_count(hp["num_hidden_layers"])
    for value, add in (
        (first("max_position_embeddings"), w.add_context_length),
        (first("hidden_size"), w.add_embedding_length),
        (first("intermediate_size"), w.add_feed_forward_length),
        (first("num_attention_heads"), w.add_head_count),
        (first("num_key_value_heads"), w.add_head_count_kv),
        (first("rms_norm_eps", "norm_eps"), w.add_layer_norm_rms_eps),
        (first("layer_norm_eps", "layer_norm_epsilon", "norm_epsilon"), w.add_layer_norm_eps),
        (first("num_local_experts", "num_experts"), w.add_expert_count),
        (first("num_experts_per_tok"), w.add_expert_used_count),
        (first("head_dim"), w.add_key_length),
        (first("head_dim"), w.add_value_length),
    ):
        if value is not None:
            add(value)
    rope = hp.get("rope_parameters") or {}
    if rope.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    elif rope.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        for key, add in (
            ("beta_fast", w.add_rope_scaling_yarn_beta_fast),
            ("beta_slow", w.add_rope_scaling_yarn_beta_slow),
        ):
            if rope.get(key) is not None:
                add(rope[key])
    if rope.get("rope_theta") is not None:
        w.add_rope_freq_base(rope["rope_theta"])


def llama_model_keys(w: gguf.GGUFWriter, hp: dict[str, Any]) -> None:
    """LlamaModel's keys beyond TextModel's: the vocabulary size and the rotary width (the head size)."""
    w.add_vocab_size(hp["vocab_size"])
    w.add_rope_dimension_count(hp.get("head_dim") or hp["hidden_size"] // hp["num_attention_heads"])


def phi3_mini_keys(w: gguf.GGUFWriter, hp: dict[str, Any]) -> None:
    """Phi3MiniModel's keys (in place of TextModel's): the pre-training context, the rotary width, the window (0:
    none), and for LongRoPE llama.cpp's factor on cos/sin, sqrt(1 + ln(scale) / ln(original)), whatever the config's
    own; PhiMoeModel adds the expert counts."""
    rope = hp["rope_parameters"]
    original = rope.get("original_max_position_embeddings", hp.get("original_max_position_embeddings"))
    w.add_context_length(hp["max_position_embeddings"])
    w.add_rope_scaling_orig_ctx_len(original)
    w.add_embedding_length(hp["hidden_size"])
    w.add_feed_forward_length(hp["intermediate_size"])
    w.add_block_count(hp["num_hidden_layers"])
    w.add_head_count(hp["num_attention_heads"])
    w.add_head_count_kv(hp["num_key_value_heads"])
    w.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    w.add_rope_dimension_count(
        int(rope.get("partial_rotary_factor", 1.0) * hp["hidden_size"]) // hp["num_attention_heads"]
    )
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_sliding_window(hp.get("sliding_window") or 0)
    if rope.get("rope_type") == "longrope":
        scale = hp["max_position_embeddings"] / original
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
        w.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
        w.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
    w.add_expert_used_count(hp["num_experts_per_tok"])
    w.add_expert_count(hp["num_local_experts"])


def llama_cpp_attn_factor(hp: dict[str, Any]) -> float:
    """Phi3MiniModel's LongRoPE factor on cos/sin (the tiny Phi-3.5-MoE is built with it as its mscale)."""
    rope = hp["rope_parameters"]
    original = rope["original_max_position_embeddings"]
    return math.sqrt(1 + math.log(hp["max_position_embeddings"] / original) / math.log(original))


@dataclass(frozen=True)
class Converter:
    """How llama.cpp's converter class writes a family: its architecture, whether it writes TextModel's keys, its
    own keys, which q/k tensors LlamaModel.permute reorders ('weight' and 'bias' suffixes), the HF tensors it turns
    into keys instead (`consumed`), and what it does to a tensor by HF name."""

    arch: gguf.MODEL_ARCH
    keys: Callable[[gguf.GGUFWriter, dict[str, Any]], None] = lambda w, hp: None
    text_model: bool = True
    permute: tuple[str, ...] = ()
    consumed: tuple[str, ...] = ()
    tensor: Callable[[str, torch.Tensor, dict[str, Any]], torch.Tensor] = lambda name, t, hp: t
    build: dict[str, Any] = field(default_factory=dict)
    rename: Callable[[str], str] = lambda name: name  # the HF name the converter maps (Mamba 2's dt_bias)
    probe: str = "o_proj"  # layer 0's self_attn Linear that a Q8_0 file runs as stored
    # the checkpoint as the converter holds it before naming (Gemma 3n's stacked and padded tensors)
    prepare: Callable[[dict[str, torch.Tensor], dict[str, Any]], dict[str, torch.Tensor]] = lambda state, hp: state


def _olmo_keys(w: gguf.GGUFWriter, hp: dict[str, Any]) -> None:
    w.add_layer_norm_eps(1e-5)
    if hp.get("clip_qkv") is not None:
        w.add_clamp_kqv(hp["clip_qkv"])


def _apertus_keys(w: gguf.GGUFWriter, hp: dict[str, Any]) -> None:
    llama_model_keys(w, hp)
    state = _SAVED[id(w)]
    layers = range(hp["num_hidden_layers"])
    values = lambda param: [float(state[f"model.layers.{i}.mlp.act_fn.{param}"]) for i in layers]  # noqa: E731
    w.add_xielu_alpha_p(values("alpha_p"))
    w.add_xielu_alpha_n(values("alpha_n"))
    w.add_xielu_beta(values("beta"))
    w.add_xielu_eps(values("eps"))


def _nemotron_keys(w: gguf.GGUFWriter, hp: dict[str, Any]) -> None:
    w.add_vocab_size(hp["vocab_size"])
    w.add_layer_norm_eps(hp["norm_eps"])
    rotary = hp["rope_parameters"].get("partial_rotary_factor", hp.get("partial_rotary_factor", 0.5))
    w.add_rope_dimension_count(int(rotary * hp["hidden_size"]) // hp["num_attention_heads"])
    w.add_rope_scaling_type(gguf.RopeScalingType.NONE)


def _minimax_m2_keys(w: gguf.GGUFWriter, hp: dict[str, Any]) -> None:
    w.add_expert_feed_forward_length(hp["intermediate_size"])
    w.add_rope_dimension_count(hp["rotary_dim"])
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)  # TextModel's, from scoring_func


def _ministral3_keys(w: gguf.GGUFWriter, hp: dict[str, Any]) -> None:
    llama_model_keys(w, hp)
    rope = hp["rope_parameters"]
    w.add_rope_scaling_yarn_log_mul(rope["mscale_all_dim"])
    w.add_attn_temperature_scale(rope["llama_4_scaling_beta"])


def _rotary_width_key(w: gguf.GGUFWriter, hp: dict[str, Any]) -> None:
    """ExaoneModel's and Jais2Model's key beyond TextModel's: the rotary width, the whole head."""
    w.add_rope_dimension_count(hp.get("head_dim") or hp["hidden_size"] // hp["num_attention_heads"])


def _minicpm3_keys(w: gguf.GGUFWriter, hp: dict[str, Any]) -> None:
    """MiniCPM3Model's keys (none of TextModel's, none of muP's scalars, no value width) and LongRoPE's factors."""
    w.add_context_length(hp["max_position_embeddings"])
    w.add_embedding_length(hp["hidden_size"])
    w.add_block_count(hp["num_hidden_layers"])
    w.add_feed_forward_length(hp["intermediate_size"])
    w.add_head_count(hp["num_attention_heads"])
    w.add_head_count_kv(hp["num_key_value_heads"])
    w.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    w.add_vocab_size(hp["vocab_size"])
    if hp.get("q_lora_rank") is not None:
        w.add_q_lora_rank(hp["q_lora_rank"])
    w.add_kv_lora_rank(hp["kv_lora_rank"])
    w.add_key_length(hp["qk_nope_head_dim"] + hp["qk_rope_head_dim"])
    w.add_rope_dimension_count(hp["qk_rope_head_dim"])
    rope = hp["rope_parameters"]
    if rope.get("long_factor") or rope.get("short_factor"):
        w.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
        w.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))


def _hunyuan_keys(w: gguf.GGUFWriter, hp: dict[str, Any]) -> None:
    """HunYuanModel's and HunYuanMoEModel's keys: NTK's alpha folded into the base (hidden / heads wide; no scaling
    left), the context llama.cpp takes; HunYuanMoEModel's the experts' widths and counts (its lists' first values)."""
    rope = hp["rope_parameters"]
    if rope.get("rope_type") == "dynamic":
        dim = hp["hidden_size"] // hp["num_attention_heads"]
        w.add_rope_freq_base(rope["rope_theta"] * rope["alpha"] ** (dim / (dim - 2)))
        w.add_rope_scaling_type(gguf.RopeScalingType.NONE)
        w.add_rope_scaling_factor(1)
        w.add_rope_scaling_orig_ctx_len(256 * 1024)
        w.add_context_length(256 * 1024)
    if "moe_topk" in hp:
        first = lambda v: v[0] if isinstance(v, list) else v  # noqa: E731
        w.add_expert_shared_feed_forward_length(hp["intermediate_size"])
        w.add_expert_feed_forward_length(first(hp.get("moe_intermediate_size") or hp["intermediate_size"]))
        w.add_expert_used_count(first(hp["moe_topk"]))
        w.add_expert_shared_count(first(hp.get("num_shared_expert") or 1))


def _exaone_moe_keys(w: gguf.GGUFWriter, hp: dict[str, Any]) -> None:
    """Exaone4Model's keys (the vocabulary, the window and which layers slide) and ExaoneMoEModel's (the experts'
    width, shared count and width, scaling and renormalisation, the leading dense layers, no rope scaling)."""
    w.add_vocab_size(hp["vocab_size"])
    if hp.get("sliding_window") is not None:
        w.add_sliding_window(hp["sliding_window"])
        w.add_sliding_window_pattern([t == "sliding_attention" for t in hp["layer_types"]])
    width, shared = hp["moe_intermediate_size"], hp["num_shared_experts"]
    w.add_expert_feed_forward_length(width)
    w.add_expert_shared_count(shared)
    w.add_expert_shared_feed_forward_length(width * shared)
    w.add_expert_weights_scale(hp["routed_scaling_factor"])
    w.add_expert_weights_norm(hp["norm_topk_prob"])
    w.add_leading_dense_block_count(hp.get("first_k_dense_replace", 0))
    w.add_nextn_predict_layers(hp.get("num_nextn_predict_layers", 0))
    w.add_rope_scaling_type(gguf.RopeScalingType.NONE)


def _plus_one(name: str, t: torch.Tensor, hp: dict[str, Any]) -> torch.Tensor:
    return t + 1 if name.endswith("norm.weight") else t


def _mamba_keys(w: gguf.GGUFWriter, hp: dict[str, Any]) -> None:
    """MambaModel's and Mamba2Model's keys (none of TextModel's): no attention (head_count and feed_forward_length 0),
    the mixer's shape as ssm.* keys, Mamba's step rank or Mamba 2's heads as the time-step rank."""
    inner = hp.get("intermediate_size") or hp["expand"] * hp["hidden_size"]
    w.add_context_length(2**20)
    w.add_embedding_length(hp["hidden_size"])
    w.add_feed_forward_length(0)
    w.add_head_count(0)
    w.add_block_count(hp["num_hidden_layers"])
    w.add_ssm_conv_kernel(hp["conv_kernel"])
    w.add_ssm_inner_size(inner)
    w.add_ssm_state_size(hp["state_size"])
    w.add_layer_norm_rms_eps(hp["layer_norm_epsilon"])
    if "n_groups" in hp:  # Mamba2Model
        w.add_ssm_time_step_rank(inner // hp["head_dim"])
        w.add_ssm_group_count(hp["n_groups"])
    else:
        w.add_ssm_time_step_rank(hp["time_step_rank"])
        w.add_ssm_dt_b_c_rms(hp["model_type"] == "falcon_mamba")  # its step, B and C normed


def _classic_keys(w: gguf.GGUFWriter, hp: dict[str, Any]) -> None:
    """StarCoderModel's, GPT2Model's and FalconModel's keys (none of TextModel's): the feed-forward length 4 x hidden
    whatever the model's; StarCoder's one KV head; Falcon's context 2048, its KV heads as its released config.json
    give them (num_kv_heads with the new architecture, else one: multi_query's) and its qkv layout's name."""
    falcon = hp["model_type"] == "falcon"
    hidden = hp.get("hidden_size") or hp["n_embd"]
    w.add_block_count(hp.get("num_hidden_layers") or hp["n_layer"])
    w.add_context_length(2048 if falcon else hp.get("n_ctx") or hp["n_positions"])
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(4 * hidden)
    w.add_head_count(hp.get("num_attention_heads") or hp["n_head"])
    if hp["model_type"] == "gpt_bigcode":
        w.add_head_count_kv(1)
    if falcon:
        w.add_tensor_data_layout("jploski")
        w.add_head_count_kv(hp["num_kv_heads"] if hp["new_decoder_architecture"] else 1)
    w.add_layer_norm_eps(hp["layer_norm_epsilon"])


def _classic_tensor(name: str, t: torch.Tensor, hp: dict[str, Any]) -> torch.Tensor:
    """GPT2Model's Conv1D weights transposed to Linear's; FalconModel's query_key_value regrouped from one group per
    KV head (its queries, key, value) to all queries, then all keys, then all values."""
    if hp["model_type"] == "gpt2" and name.endswith((".c_attn.weight", ".c_proj.weight", ".c_fc.weight")):
        return t.transpose(1, 0)
    if hp["model_type"] == "falcon" and "query_key_value" in name:
        heads, hidden = hp["num_attention_heads"], hp["hidden_size"]
        kv, d = hp["num_kv_heads"] if hp["new_decoder_architecture"] else 1, hidden // heads
        qkv = t.view(kv, heads // kv + 2, d, hidden)
        parts = (qkv[:, :-2], qkv[:, [-2]], qkv[:, [-1]])
        return torch.cat([p.reshape(-1, hidden) for p in parts]).reshape_as(t)
    return t


def _bloom_keys(w: gguf.GGUFWriter, hp: dict[str, Any]) -> None:
    """BloomModel's keys (none of TextModel's): its context as seq_length or else the width, the MLP 4 x hidden, as
    many KV heads as heads, the LayerNorms' eps."""
    hidden, heads = hp.get("hidden_size") or hp["n_embed"], hp.get("n_head") or hp["num_attention_heads"]
    w.add_context_length(hp.get("seq_length", hidden))
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(4 * hidden)
    w.add_block_count(hp.get("n_layer") or hp["num_hidden_layers"])
    w.add_head_count(heads)
    w.add_head_count_kv(heads)
    w.add_layer_norm_eps(hp["layer_norm_epsilon"])


def _bloom_tensor(name: str, t: torch.Tensor, hp: dict[str, Any]) -> torch.Tensor:
    """BloomModel's query_key_value (weight and bias) regrouped from each head's q, k, v to all q, all k, all v."""
    if "query_key_value" not in name:
        return t
    heads = hp.get("n_head") or hp["num_attention_heads"]
    per_head = t.reshape(heads, 3, -1, *t.shape[1:])
    return torch.cat([per_head[:, i].reshape(-1, *t.shape[1:]) for i in range(3)])


def _mpt_keys(w: gguf.GGUFWriter, hp: dict[str, Any]) -> None:
    """MPTModel's keys (none of TextModel's): the MLP 4 x d_model whatever expansion_ratio says, eps 1e-5 whatever
    the config's, clip_qkv as clamp_kqv where set, alibi_bias_max (0 without ALiBi); nothing of softmax_scale."""
    attn = hp["attn_config"]
    w.add_context_length(hp["max_seq_len"])
    w.add_embedding_length(hp["d_model"])
    w.add_block_count(hp["n_layers"])
    w.add_feed_forward_length(4 * hp["d_model"])
    w.add_head_count(hp["n_heads"])
    w.add_layer_norm_eps(1e-5)
    if attn.get("clip_qkv") is not None:
        w.add_clamp_kqv(attn["clip_qkv"])
    w.add_max_alibi_bias(attn["alibi_bias_max"] if attn.get("alibi", True) else 0.0)


def _jamba_keys(w: gguf.GGUFWriter, hp: dict[str, Any]) -> None:
    """JambaModel's keys (none of TextModel's): the KV head count per layer (0 for a Mamba layer), the mixer's width,
    state, kernel and step rank as ssm.* keys, the experts' counts (nothing of which layers hold them)."""
    layers, offset, period = hp["num_hidden_layers"], hp["attn_layer_offset"], hp["attn_layer_period"]
    w.add_block_count(layers)
    w.add_context_length(hp["max_position_embeddings"])
    w.add_embedding_length(hp["hidden_size"])
    w.add_feed_forward_length(hp["intermediate_size"])
    w.add_head_count(hp["num_attention_heads"])
    w.add_head_count_kv(
        [hp["num_key_value_heads"] if i >= offset and (i - offset) % period == 0 else 0 for i in range(layers)]
    )
    w.add_ssm_conv_kernel(hp["mamba_d_conv"])
    w.add_ssm_inner_size(hp["mamba_expand"] * hp["hidden_size"])
    w.add_ssm_state_size(hp["mamba_d_state"])
    w.add_ssm_time_step_rank(hp["mamba_dt_rank"])
    w.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    w.add_expert_count(hp["num_experts"])
    w.add_expert_used_count(hp["num_experts_per_tok"])


def _mamba_tensor(name: str, t: torch.Tensor, hp: dict[str, Any]) -> torch.Tensor:
    """MambaModel.modify_tensors and Mamba2Model's: A_log as -exp(A_log), conv1d squeezed to [C, K]; Mamba 2's A and
    D as [n, 1] and its gated norm as [groups, inner / groups]."""
    mamba2 = "n_groups" in hp
    if name.endswith("conv1d.weight"):
        return t.squeeze()
    if name.endswith(".A_log"):
        t = -torch.exp(t)
    if mamba2 and name.endswith((".A_log", ".D")):
        return t.reshape(-1, 1)
    if mamba2 and name.endswith("mixer.norm.weight"):
        return t.reshape(hp["n_groups"], -1)
    return t


def _dbrx_keys(w: gguf.GGUFWriter, hp: dict[str, Any]) -> None:
    """DbrxModel's keys (none of TextModel's), from its nested attn_config and ffn_config; the eps fixed at 1e-5."""
    attn, ffn = hp["attn_config"], hp["ffn_config"]
    w.add_block_count(hp["n_layers"])
    w.add_context_length(hp["max_seq_len"])
    w.add_embedding_length(hp["d_model"])
    w.add_feed_forward_length(ffn["ffn_hidden_size"])
    w.add_head_count(hp["n_heads"])
    w.add_head_count_kv(attn["kv_n_heads"])
    w.add_rope_freq_base(attn["rope_theta"])
    w.add_clamp_kqv(attn["clip_qkv"])
    w.add_expert_count(ffn["moe_num_experts"])
    w.add_expert_used_count(ffn["moe_top_k"])
    w.add_layer_norm_eps(1e-5)


def _dbrx_tensor(name: str, t: torch.Tensor, hp: dict[str, Any]) -> torch.Tensor:
    """DbrxModel.modify_tensors: the fused experts viewed as [E, I, H], w2 (each expert's down projection transposed)
    permuted to [E, H, I]."""
    if ".ffn.experts.mlp." not in name:
        return t
    ffn = hp["ffn_config"]
    t = t.view(ffn["moe_num_experts"], ffn["ffn_hidden_size"], hp["d_model"])
    return t.permute(0, 2, 1) if name.endswith(".w2") else t


def _gemma3n_keys(w: gguf.GGUFWriter, hp: dict[str, Any]) -> None:
    """Gemma3Model's keys over TextModel's (the global layers' RoPE base, the sliding layers' from TextModel, the
    final soft-cap, the window) and Gemma3NModel's: AltUp's, the per-layer inputs' width, the KV-sharing layers, each
    layer's sparsity as its standard normal quantile and which layers slide."""
    rope = hp["rope_parameters"]
    w.add_rope_freq_base(rope["full_attention"]["rope_theta"])
    w.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    if hp.get("final_logit_softcapping"):
        w.add_final_logit_softcapping(hp["final_logit_softcapping"])
    w.add_sliding_window(hp["sliding_window"])
    w.add_altup_active_idx(hp["altup_active_idx"])
    w.add_altup_num_inputs(hp["altup_num_inputs"])
    w.add_embedding_length_per_layer_input(hp["hidden_size_per_layer_input"])
    w.add_shared_kv_layers(hp["num_kv_shared_layers"])
    normal = torch.distributions.normal.Normal(0, 1)
    w.add_activation_sparsity_scale(
        [normal.icdf(torch.tensor(s, dtype=torch.float32)).item() for s in hp["activation_sparsity_pattern"]]
    )
    w.add_sliding_window_pattern([t == "sliding_attention" for t in hp["layer_types"]])


def _gemma3n_prepare(state: dict[str, torch.Tensor], hp: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Gemma3NModel.modify_tensors: the embedding and the per-layer table padded with zero rows to vocab_size, AltUp's
    projections stacked (`model.altup_projections.weight`), the `*_scale` parameters named with `.weight`."""
    out: dict[str, torch.Tensor] = {}
    stacks: dict[str, dict[int, torch.Tensor]] = {}
    for name, t in state.items():
        if match := re.match(r"(model\.altup_(?:unembed_)?projections)\.(\d+)\.weight$", name):
            stacks.setdefault(f"{match[1]}.weight", {})[int(match[2])] = t
            continue
        if name.endswith(("embed_tokens.weight", "embed_tokens_per_layer.weight")) and len(t) < hp["vocab_size"]:
            t = torch.cat([t, t.new_zeros(hp["vocab_size"] - len(t), t.shape[1])])
        out[f"{name}.weight" if name.endswith("_scale") else name] = t
    out.update({name: torch.stack([s[i] for i in sorted(s)]) for name, s in stacks.items()})
    return out


def _gemma4_geometry(hp: dict[str, Any]) -> tuple[int, int | None]:
    """The full-attention layers' head width and KV head count (None: the sliding layers') as Google's config.json
    holds them (global_head_dim, num_global_key_value_heads), from transformers' saved per_layer_config."""
    full = next(iter(hp["per_layer_config"].values()), {}) if hp.get("per_layer_config") else {}
    return full.get("head_dim", hp.get("global_head_dim") or hp["head_dim"]), full.get("num_key_value_heads")


def _gemma4_keys(w: gguf.GGUFWriter, hp: dict[str, Any]) -> None:
    """Gemma4Model's keys as they end up over TextModel's and Gemma3Model's: both RoPE bases, the full-attention
    layers' head width as key_length and the sliding layers' as key_length_swa, the KV heads per layer where the
    config names the full-attention layers' own, the MLP widths per layer with use_double_wide_mlp, the experts',
    the window, the pattern, the per-layer inputs' width, the KV-sharing layers; and rope_freqs, the full-attention
    layers' proportional RoPE (1 for each turning frequency, 1e30 for the rest)."""
    rope, layers = hp["rope_parameters"], hp["num_hidden_layers"]
    swa = [t == "sliding_attention" for t in hp["layer_types"]]
    width, full_kv = _gemma4_geometry(hp)
    n_ff, shared = hp["intermediate_size"], hp["num_kv_shared_layers"]
    w.add_block_count(layers)
    w.add_context_length(hp["max_position_embeddings"])
    w.add_embedding_length(hp["hidden_size"])
    double = [n_ff if i < layers - shared else 2 * n_ff for i in range(layers)]
    w.add_feed_forward_length(double if hp.get("use_double_wide_mlp") else n_ff)
    w.add_head_count(hp["num_attention_heads"])
    kv = hp["num_key_value_heads"]
    w.add_head_count_kv([kv if s else full_kv for s in swa] if full_kv is not None else kv)
    w.add_rope_freq_base(rope["full_attention"]["rope_theta"])
    w.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    w.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    if hp.get("enable_moe_block"):
        w.add_expert_count(hp["num_experts"])
        w.add_expert_used_count(hp["top_k_experts"])
        w.add_expert_feed_forward_length(hp["moe_intermediate_size"])
    if hp.get("final_logit_softcapping"):
        w.add_final_logit_softcapping(hp["final_logit_softcapping"])
    w.add_sliding_window(hp["sliding_window"])
    w.add_shared_kv_layers(shared)
    w.add_embedding_length_per_layer_input(hp.get("hidden_size_per_layer_input") or 0)
    w.add_sliding_window_pattern(swa)
    w.add_key_length(width)
    w.add_value_length(width)
    w.add_key_length_swa(hp["head_dim"])
    w.add_value_length_swa(hp["head_dim"])
    w.add_rope_dimension_count(width)
    w.add_rope_dimension_count_swa(int(hp["head_dim"] * hp.get("partial_rotary_factor", 1.0)))
    turning = int(width * rope["full_attention"]["partial_rotary_factor"] / 2)
    w.add_tensor("rope_freqs.weight", np.array([1.0] * turning + [1e30] * (width // 2 - turning), dtype=np.float32))


def _gemma4_prepare(state: dict[str, torch.Tensor], hp: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Gemma4Model.filter_tensors and modify_tensors: `.weight` after layer_scalar and the stacked experts, the
    router's scale and per_expert_scale as `.scale` of the router and of the down experts."""
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if name.endswith(("layer_scalar", "experts.gate_up_proj", "experts.down_proj")):
            name = f"{name}.weight"
        name = name.replace(".router.scale", ".router.proj.scale")
        out[name.replace(".router.per_expert_scale", ".experts.down_proj.scale")] = t
    return out


def _afmoe_keys(w: gguf.GGUFWriter, hp: dict[str, Any]) -> None:
    """AfmoeModel's keys over LlamaModel's: the shared experts, the experts' width, the dense layers, route_norm (where
    config.json has it) and route_scale, the window."""
    llama_model_keys(w, hp)
    w.add_expert_shared_count(hp["num_shared_experts"])
    w.add_expert_feed_forward_length(hp["moe_intermediate_size"])
    w.add_leading_dense_block_count(hp["num_dense_layers"])
    if hp.get("route_norm") is not None:
        w.add_expert_weights_norm(hp["route_norm"])
    w.add_expert_weights_scale(hp["route_scale"])
    w.add_sliding_window(hp["sliding_window"])


def _afmoe_prepare(state: dict[str, torch.Tensor], hp: dict[str, Any]) -> dict[str, torch.Tensor]:
    """AfmoeModel: the selection bias as `expert_bias.bias`, the experts stacked per kind (gate, up, down; transformers
    holds gate and up fused, gate rows first)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if name.endswith(".mlp.experts.gate_up_proj"):
            gate, up = t.chunk(2, dim=1)
            out[name.replace("gate_up_proj", "gate_proj.weight")] = gate
            out[name.replace("gate_up_proj", "up_proj.weight")] = up
        elif name.endswith(".mlp.experts.down_proj"):
            out[f"{name}.weight"] = t
        else:
            out[name.replace(".expert_bias", ".expert_bias.bias")] = t
    return out


def _mimo2_keys(w: gguf.GGUFWriter, hp: dict[str, Any]) -> None:
    """MimoV2Model's keys over TextModel's, from the release's config.json names (given here from transformers'
    equivalents: hybrid_layer_pattern 1 where a layer slides, swa_num_key_value_heads twice the full layers'): the
    KV heads per layer, the window and pattern, the value width, the experts' count and width, the rotary width (one
    share for both kinds), layernorm_epsilon as the RMS eps; the sinks named `attn_sinks.weight`."""
    pattern = [int(kind == "sliding_attention") for kind in hp["layer_types"]]
    w.add_head_count_kv([2 * hp["num_key_value_heads"] if p else hp["num_key_value_heads"] for p in pattern])
    w.add_sliding_window(hp["sliding_window"])
    w.add_sliding_window_pattern(pattern)
    w.add_value_length(hp["v_head_dim"])
    w.add_expert_count(hp["n_routed_experts"])
    w.add_expert_feed_forward_length(hp["moe_intermediate_size"])
    w.add_rope_dimension_count(int(hp["head_dim"] * hp["rope_parameters"]["full_attention"]["partial_rotary_factor"]))
    w.add_layer_norm_rms_eps(hp.get("layernorm_epsilon", hp["rms_norm_eps"]))  # (the release's name for it)
    # TextModel's RoPE keys from the per-kind parameters: the full layers' base, the sliding layers'
    w.add_rope_freq_base(hp["rope_parameters"]["full_attention"]["rope_theta"])
    w.add_rope_freq_base_swa(hp["rope_parameters"]["sliding_attention"]["rope_theta"])
    w.add_expert_group_count(hp["n_group"])
    w.add_expert_group_used_count(hp["topk_group"])


# The tiny MiMo-V2-Flash as a mimo2 file can hold it: one rotary share for both kinds (rope.dimension_count), the
# release's value scale (no key: keel reads the config's default) and no routed scale, the release's one group.
_MIMO2_BUILD = {
    "rope_parameters": {
        "full_attention": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        "sliding_attention": {"rope_type": "default", "rope_theta": 100.0, "partial_rotary_factor": 0.5},
    },
    "attention_value_scale": 0.707,  # the release's (the converter writes none: keel reads the config's default)
    "routed_scaling_factor": None,
    "n_group": 1,
    "topk_group": 1,
}


def _gptj_keys(w: gguf.GGUFWriter, hp: dict[str, Any]) -> None:
    """GPTJModel's keys (none of TextModel's): the feed-forward length 4 x hidden whatever the model's, the rotary
    width only where it is part of the head."""
    hidden, heads = hp["n_embd"], hp["n_head"]
    w.add_block_count(hp["n_layer"])
    w.add_context_length(hp.get("n_positions", 2048))
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(4 * hidden)
    w.add_head_count(heads)
    w.add_layer_norm_eps(hp["layer_norm_epsilon"])
    if (hp.get("rotary_dim") or hidden // heads) < hidden // heads:
        w.add_rope_dimension_count(hp["rotary_dim"])


def _chatglm_keys(w: gguf.GGUFWriter, hp: dict[str, Any]) -> None:
    """ChatGLMModel's keys (none of TextModel's), from ChatGLM's config.json names where it has them, else
    GlmForCausalLM's: the context as `seq_length` (absent: the hidden size), half of hidden / heads rotating
    (GlmConfig's head_dim unread), the eps as `layernorm_epsilon` (absent: 1e-5) and the base as 10000 x rope_ratio,
    both over GlmConfig's own; no BOS."""
    hidden, heads = hp["hidden_size"], hp["num_attention_heads"]
    w.add_context_length(hp.get("seq_length", hidden))
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(hp.get("ffn_hidden_size", hp.get("intermediate_size", 4 * hidden)))
    w.add_block_count(hp["num_hidden_layers"])
    w.add_head_count(heads)
    w.add_head_count_kv(hp.get("multi_query_group_num", hp.get("num_key_value_heads", heads)))
    w.add_layer_norm_rms_eps(hp.get("layernorm_epsilon", hp["rms_norm_eps"]))  # (the release's name for it)
    w.add_rope_dimension_count(int(hp.get("attention_dim", hidden // heads) * hp.get("partial_rotary_factor", 0.5)))
    w.add_add_bos_token(False)
    w.add_rope_freq_base(10000 * hp.get("rope_ratio", 1))


# A GLM checkpoint under ChatGLM's own names (THUDM/glm-4-9b-chat, chatglm3-6b; the converter drops `transformer.`):
# q, k and v fused in query_key_value, rows [all q; all k; all v], as are their biases.
_CHATGLM_NAMES = (
    (r"^model\.embed_tokens\.", "embedding.word_embeddings."),
    (r"^model\.norm\.", "encoder.final_layernorm."),
    (r"^lm_head\.", "output_layer."),
    (r"^model\.layers\.(\d+)\.self_attn\.o_proj\.", r"encoder.layers.\1.self_attention.dense."),
    (r"^model\.layers\.(\d+)\.mlp\.gate_up_proj\.", r"encoder.layers.\1.mlp.dense_h_to_4h."),
    (r"^model\.layers\.(\d+)\.mlp\.down_proj\.", r"encoder.layers.\1.mlp.dense_4h_to_h."),
    (r"^model\.layers\.(\d+)\.", r"encoder.layers.\1."),
)


def _minicpm_keys(w: gguf.GGUFWriter, hp: dict[str, Any]) -> None:
    """MiniCPMModel's keys beyond TextModel's: scale_emb, scale_depth / sqrt(layers) and hidden / dim_model_base (here
    from the Granite config that computes as MiniCPM: its embedding, residual and logits multipliers), LongRoPE's type
    (TextModel's) and factors as tensors."""
    w.add_embedding_scale(hp["embedding_multiplier"])
    w.add_residual_scale(hp["residual_multiplier"])
    w.add_logit_scale(hp["logits_scaling"])
    rope = hp["rope_parameters"]
    if rope.get("rope_type") == "longrope":
        w.add_rope_scaling_type(gguf.RopeScalingType.LONGROPE)
        w.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
        w.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))


# MiniCPM as transformers' Granite computes it: muP's scalars as Granite's multipliers, the softmax scale 1/sqrt(16)
# (llama.cpp's without an attention.scale key), no biases, LongRoPE pre-trained on the whole context (MiniCPM4's)
_MINICPM_BUILD = {
    "attention_multiplier": 0.25,
    "attention_bias": False,
    "mlp_bias": False,
    "max_position_embeddings": 64,
    "rope_parameters": {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": [1.0, 1.1, 1.25, 1.5, 2.0, 2.5, 3.5, 4.0],
        "long_factor": [1.5, 2.0, 3.0, 4.5, 6.0, 8.0, 9.0, 12.0],
        "original_max_position_embeddings": 64,
    },
}


def _chatglm_prepare(state: dict[str, torch.Tensor], hp: dict[str, Any]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if match := re.match(r"model\.layers\.(\d+)\.self_attn\.q_proj\.(\w+)$", name):
            layer, suffix = match.groups()
            parts = [state[f"model.layers.{layer}.self_attn.{p}_proj.{suffix}"] for p in "qkv"]
            out[f"encoder.layers.{layer}.self_attention.query_key_value.{suffix}"] = torch.cat(parts)
        elif not re.match(r"model\.layers\.\d+\.self_attn\.[kv]_proj\.", name):
            for pattern, repl in _CHATGLM_NAMES:
                name, n = re.subn(pattern, repl, name)
                if n:
                    break
            out[name] = t
    return out


# The converters that write Llama 3's rope scaling as rope_freqs.
_LLAMA3_FREQS = (gguf.MODEL_ARCH.APERTUS, gguf.MODEL_ARCH.ARCEE, gguf.MODEL_ARCH.EXAONE)

# The checkpoint being written, by writer (the converter's keys read some of its tensors: Apertus's xIELU).
_SAVED: dict[int, dict[str, torch.Tensor]] = {}

CONVERTERS = {
    # Gemma4Model (Gemma3Model): no norm shift; the dense model with values equal to the keys' projection, the MoE
    # model, and E2B/E4B's shape (per-layer inputs, KV sharing, the double-wide MLPs)
    # (built with a final soft-cap: llama.cpp caps at 30 where a file has none)
    **{
        name: Converter(
            gguf.MODEL_ARCH.GEMMA4,
            keys=_gemma4_keys,
            text_model=False,
            prepare=_gemma4_prepare,
            build={"final_logit_softcapping": 20.0} if name != "gemma4" else {},
        )
        for name in ("gemma4", "gemma4-moe", "gemma4-e")
    },
    # Gemma3NModel (Gemma3Model): no norm shift (Gemma 3n's norms scale by w); the four copies llama.cpp's converter
    # takes, a per-layer table as long as the vocabulary (a shorter one: test_gemma3n_gguf_pads_the_per_layer_table)
    "gemma3n": Converter(
        gguf.MODEL_ARCH.GEMMA3N,
        keys=_gemma3n_keys,
        prepare=_gemma3n_prepare,
        build={"altup_num_inputs": 4, "vocab_size_per_layer_input": 256},
    ),
    # AfmoeModel (LlamaModel, q/k as in HF): one global layer in four and the embedding scaled, as llama.cpp fixes them
    "afmoe": Converter(
        gguf.MODEL_ARCH.AFMOE,
        keys=_afmoe_keys,
        prepare=_afmoe_prepare,
        build={"num_hidden_layers": 4, "global_attn_every_n_layers": 4, "layer_types": None},
    ),
    # ChatGLMModel: its own keys; q/k rows as in HF (llama.cpp rotates their interleaved pairs), gate and up fused in
    # ffn_up. A GlmForCausalLM checkpoint keeps q/k/v apart, ChatGLM's own fuses them (`glm-qkv`: attn_qkv). Built with
    # what the converter writes in place of GlmConfig's: the head hidden / heads, eps 1e-5, base 10000
    **{
        name: Converter(
            gguf.MODEL_ARCH.CHATGLM,
            keys=_chatglm_keys,
            text_model=False,
            prepare=prepare,
            build={"head_dim": 16, "rms_norm_eps": 1e-5},
        )
        for name, prepare in (("glm", lambda state, hp: state), ("glm-qkv", _chatglm_prepare))
    },
    # InternLM2Model (TextModel's keys): wqkv split into q, k and v with q/k permuted as LlamaModel's, the rest under
    # llama's names; read as keel's llama (the tiny Llama stands in for the remote-code InternLM2)
    "llama-internlm2": Converter(gguf.MODEL_ARCH.INTERNLM2, permute=("weight",)),
    # MiniCPMModel (TextModel's keys and muP's scalars): q/k weights permuted; read as keel's granite
    "granite-minicpm": Converter(
        gguf.MODEL_ARCH.MINICPM, keys=_minicpm_keys, permute=("weight",), build=_MINICPM_BUILD
    ),
    # GPTJModel: its own keys; q/k rows as in HF (llama.cpp rotates their interleaved pairs)
    "gptj": Converter(gguf.MODEL_ARCH.GPTJ, keys=_gptj_keys, text_model=False),
    "mimo_v2_flash": Converter(
        gguf.MODEL_ARCH.MIMO2,
        keys=_mimo2_keys,
        build=_MIMO2_BUILD,
        rename=lambda name: f"{name}.weight" if name.endswith("attention_sink_bias") else name,  # as MimoV2Model
        probe="qkv_proj",  # (o_proj's rows, 4 heads x 12 value channels, split into no blocks of 32)
    ),
    # OlmoeModel: the eps fixed at 1e-5 over TextModel's; experts stacked as Qwen2MoeModel's
    "olmoe": Converter(gguf.MODEL_ARCH.OLMOE, keys=lambda w, hp: w.add_layer_norm_rms_eps(1e-5)),
    # OlmoModel: LayerNorm eps 1e-5, clamp_kqv; q/k weights permuted (not their biases)
    "olmo": Converter(gguf.MODEL_ARCH.OLMO, keys=_olmo_keys, permute=("weight",)),
    # PhiMoeModel (Phi3MiniModel's keys); the mscale llama.cpp computes, and transformers' default router jitter
    "phimoe": Converter(
        gguf.MODEL_ARCH.PHIMOE, keys=phi3_mini_keys, text_model=False, build={"router_jitter_noise": 0.01}
    ),
    "seed_oss": Converter(gguf.MODEL_ARCH.SEED_OSS),
    # ArceeModel (LlamaModel): q/k rows and biases permuted; here with YaRN
    "arcee": Converter(
        gguf.MODEL_ARCH.ARCEE,
        keys=llama_model_keys,
        permute=("weight", "bias"),
        build={
            "attention_bias": True,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 16,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
            },
            "max_position_embeddings": 64,
        },
    ),
    # ApertusModel (LlamaModel, undo_permute False): xIELU's parameters as keys, Llama 3's rope_freqs
    # (pad_token_id 0: ApertusConfig's 3 is in the prompt, which transformers' generate would mask as padding)
    "apertus": Converter(
        gguf.MODEL_ARCH.APERTUS,
        build={"pad_token_id": 0},
        keys=_apertus_keys,
        consumed=(".act_fn.alpha_p", ".act_fn.alpha_n", ".act_fn.beta", ".act_fn.eps"),
    ),
    # MiniMaxM2Model: the experts' and the rotary width, sigmoid gating, the selection bias renamed
    "minimax_m2": Converter(gguf.MODEL_ARCH.MINIMAXM2, keys=_minimax_m2_keys),
    # Ministral3Model (LlamaModel): YaRN's keys, mscale_all_dim as yarn_log_multiplier, Llama 4's temperature
    "ministral3": Converter(gguf.MODEL_ARCH.MISTRAL3, keys=_ministral3_keys, permute=("weight", "bias")),
    # NemotronModel: LayerNorm1P's weights plus 1, the eps as layer_norm_eps, the rotary width, no rope scaling
    "nemotron": Converter(gguf.MODEL_ARCH.NEMOTRON, keys=_nemotron_keys, tensor=_plus_one),
    # MiniCPM3Model: its own keys, the latent attention's tensors as in HF, LongRoPE's factors as tensors; built with
    # the scalars llama.cpp fixes (the release's), a value width of hidden / heads, and LongRoPE pre-trained on the
    # whole context (MiniCPM3-4B's)
    "minicpm3": Converter(
        gguf.MODEL_ARCH.MINICPM3,
        keys=_minicpm3_keys,
        text_model=False,
        build={
            "scale_emb": 12.0,
            "scale_depth": 1.4,
            "dim_model_base": 256,
            "v_head_dim": 16,
            "max_position_embeddings": 64,
            "rope_parameters": {
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "short_factor": [1.0, 1.25, 2.5, 3.5],
                "long_factor": [1.5, 2.0, 4.5, 9.0],
                "original_max_position_embeddings": 64,
            },
        },
    ),
    # HunYuanModel and HunYuanMoEModel (TextModel): NTK's alpha folded into the base; q/k as in HF
    "hunyuan_v1_dense": Converter(gguf.MODEL_ARCH.HUNYUAN_DENSE, keys=_hunyuan_keys),
    "hunyuan_v1_moe": Converter(gguf.MODEL_ARCH.HUNYUAN_MOE, keys=_hunyuan_keys),
    # ExaoneMoEModel (Exaone4Model): q/k as in HF, the experts stacked, the selection bias as exp_probs_b; the dense
    # layers first and last (leading_dense_block_count counts one); no key for groups: one (K-EXAONE's)
    "exaone_moe": Converter(gguf.MODEL_ARCH.EXAONE_MOE, keys=_exaone_moe_keys, build={"n_group": 1, "topk_group": 1}),
    # Jais2Model (TextModel): the rotary width; LayerNorms with biases, the ungated ReLU-squared MLP, q/k as in HF
    "jais2": Converter(gguf.MODEL_ARCH.JAIS2, keys=_rotary_width_key),
    # ExaoneModel (TextModel): the rotary width, Llama 3's rope_freqs (over the 8192 positions it takes where the
    # config has none, as EXAONE 3.5's has), q/k as in HF; biases here
    "exaone": Converter(
        gguf.MODEL_ARCH.EXAONE,
        keys=_rotary_width_key,
        build={
            "attention_bias": True,
            "mlp_bias": True,
            "max_position_embeddings": 16384,
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 1_000_000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        },
    ),
    # StarCoderModel, GPT2Model and FalconModel: their own keys; GPT-2's Conv1D weights transposed, Falcon's qkv
    # regrouped; the 7B's multi-query block and the 40B's (without biases: the converter's regrouping takes no bias)
    "gpt_bigcode": Converter(gguf.MODEL_ARCH.STARCODER, keys=_classic_keys, text_model=False),
    "gpt2": Converter(gguf.MODEL_ARCH.GPT2, keys=_classic_keys, text_model=False, tensor=_classic_tensor),
    "falcon": Converter(gguf.MODEL_ARCH.FALCON, keys=_classic_keys, text_model=False, tensor=_classic_tensor),
    "falcon-40b": Converter(
        gguf.MODEL_ARCH.FALCON, keys=_classic_keys, text_model=False, tensor=_classic_tensor, build={"bias": False}
    ),
    # BloomModel: its own keys, the `transformer.` prefix dropped, query_key_value regrouped (all q, k, v)
    "bloom": Converter(
        gguf.MODEL_ARCH.BLOOM,
        keys=_bloom_keys,
        text_model=False,
        tensor=_bloom_tensor,
        rename=lambda name: name.removeprefix("transformer."),
        probe="o_proj",
    ),
    # MPTModel: its own keys, the tensors as stored (Wqkv already all q, k, v); no softmax_scale key: built without
    "mpt": Converter(gguf.MODEL_ARCH.MPT, keys=_mpt_keys, text_model=False, build={"attn_config": {"clip_qkv": 0.6}}),
    # JambaModel: its own keys; the experts stacked under Qwen2-MoE's merged names, A_log as -exp(A_log), conv1d
    # squeezed
    "jamba": Converter(
        gguf.MODEL_ARCH.JAMBA,
        keys=_jamba_keys,
        text_model=False,
        tensor=_mamba_tensor,
        rename=lambda name: name.replace(".feed_forward.experts.", ".mlp.experts."),
        probe="in_proj",
    ),
    # DbrxModel: its own keys; the experts (named without `.weight`, which the converter adds) stacked by expert
    "dbrx": Converter(
        gguf.MODEL_ARCH.DBRX,
        keys=_dbrx_keys,
        text_model=False,
        tensor=_dbrx_tensor,
        rename=lambda name: f"{name}.weight" if ".ffn.experts.mlp." in name else name,
    ),
    # MambaModel: its own keys; A_log as -exp(A_log) and D without a suffix, conv1d squeezed
    "mamba": Converter(
        gguf.MODEL_ARCH.MAMBA, keys=_mamba_keys, text_model=False, tensor=_mamba_tensor, probe="in_proj"
    ),
    # Mamba2Model: Mamba's and the groups; dt_bias as dt_proj.bias, A and D as [n, 1], the norm by group. No key for
    # time_step_limit: built without one (llama.cpp clamps no step)
    "mamba2": Converter(
        gguf.MODEL_ARCH.MAMBA2,
        keys=_mamba_keys,
        text_model=False,
        tensor=_mamba_tensor,
        rename=lambda name: re.sub(r"\.dt_bias$", ".dt_proj.bias", name),
        build={"time_step_limit": (0.0, float("inf"))},
        probe="in_proj",
    ),
}


def write_converted(hf, path, converter: Converter, q8: bool = False) -> None:
    """`hf` as llama.cpp's converter writes it (`converter`): metadata, then the checkpoint as saved (each layer's
    experts stacked per kind, as the converters merge them), q/k permuted as LlamaModel.permute, named by
    TensorNameMap. `q8`: matrices whose rows split into blocks of 32 as Q8_0 (not routers), as llama-quantize."""
    from safetensors.torch import load_file

    cfg = hf.config
    hp = cfg.to_dict()
    hf.save_pretrained(path.parent / "hf")
    state = load_file(path.parent / "hf" / "model.safetensors")
    w = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[converter.arch])
    _SAVED[id(w)] = state
    if converter.text_model:
        text_model_keys(w, hp)
    converter.keys(w, hp)
    del _SAVED[id(w)]
    add_mini_vocab(w, "default")
    rope = hp.get("rope_parameters") or {}
    if rope.get("rope_type") == "llama3" and converter.arch in _LLAMA3_FREQS:
        head_dim = hp.get("head_dim") or hp["hidden_size"] // hp["num_attention_heads"]
        w.add_tensor("rope_freqs.weight", llama3_rope_factors(head_dim, rope))
    names = gguf.get_tensor_name_map(converter.arch, cfg.num_hidden_layers)
    tensors: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, torch.Tensor]] = {}
    for name, t in converter.prepare(state, hp).items():
        if name.endswith(converter.consumed):
            continue
        if match := re.match(r"(.+\.experts)\.(\d+)\.(\w+)\.weight$", name):
            experts.setdefault(f"{match[1]}.{match[3]}.weight", {})[int(match[2])] = t
        else:
            tensors[name] = t
    tensors.update({name: torch.stack([e[i] for i in sorted(e)]) for name, e in experts.items()})
    for name, t in tensors.items():
        # (the converters' rename of the router's selection bias, which TensorNameMap then names exp_probs_b)
        renamed = converter.rename(name.replace("e_score_correction_bias", "e_score_correction.bias"))
        base, suffix = renamed.rsplit(".", 1)
        if suffix in converter.permute and base.endswith(("q_proj", "k_proj")):
            heads = cfg.num_attention_heads if base.endswith("q_proj") else cfg.num_key_value_heads
            t = torch.from_numpy(llama_cpp_permute(t.numpy(), heads))
        a = np.ascontiguousarray(converter.tensor(name, t, hp).float().numpy())
        # (a tensor TensorNameMap names whole, e.g. Mamba's A_log, has no suffix)
        gguf_name = names.get_name(renamed) or f"{names.get_name(base)}.{suffix}"
        if q8 and a.ndim >= 2 and a.shape[-1] % 32 == 0 and not any(s in gguf_name for s in ("ffn_gate_inp", "norm")):
            w.add_tensor(gguf_name, gguf.quants.quantize(a, Q.Q8_0), raw_dtype=Q.Q8_0)
        else:
            w.add_tensor(gguf_name, a)
    finish_writer(w)


def build(name: str, **extra: Any):
    overrides = {**CONVERTERS[name].build, **extra}
    if name == "phimoe":  # the factor on cos/sin llama.cpp computes (the file's), as the model's mscale
        hp = build_hf_model(name).config.to_dict()
        factor = llama_cpp_attn_factor(hp)
        overrides["rope_parameters"] = {**hp["rope_parameters"], "short_mscale": factor, "long_mscale": factor}
    # (glm-qkv: the same model, stored fused; InternLM2 and MiniCPM as the families keel reads them into)
    return build_hf_model(_BUILT_AS.get(name, name), **overrides)


_BUILT_AS = {"glm-qkv": "glm", "llama-internlm2": "llama", "granite-minicpm": "granite"}


def assert_family_features(name: str, loaded, hf) -> None:
    """What distinguishes the family, as read from its file."""
    c, reader, cfg = loaded.config, loaded.checkpoint.reader, hf.config
    if name == "llama-internlm2":  # q/k un-permuted, the head size hidden / heads (no key)
        assert (c.head_dim, c.num_kv_heads, c.rope_scaling.type) == (16, 2, "default")
        k = "model.layers.1.self_attn.k_proj.weight"
        assert torch.equal(loaded.checkpoint.reader.get(k), hf.state_dict()[k])
    if name == "granite-minicpm":  # muP's scalars as Granite's, llama.cpp's softmax scale, LongRoPE's short factors
        assert (c.embedding_multiplier, c.residual_multiplier, c.logits_scaling, c.attention_scale) == (
            12.0,
            pytest.approx(0.22),
            4.0,
            0.25,
        )
        assert c.rope_scaling.type == "longrope" and c.rope_scaling.short_factor[:3] == pytest.approx((1.0, 1.1, 1.25))
        assert loaded.checkpoint.provenance["residual_multiplier"] == "read"
    if name == "olmoe":  # whole-projection q/k norms, softmax experts not renormalised (llama.cpp's fixed choice)
        assert (c.qk_norm_scope, c.num_experts, c.num_experts_per_tok, c.norm_topk_prob) == ("all", 8, 2, False)
        assert c.moe_intermediate_size == 32 and c.clip_qkv is None
        assert reader.gguf_names("model.layers.0.mlp.experts.gate_up_proj") == [
            "blk.0.ffn_gate_exps.weight",
            "blk.0.ffn_up_exps.weight",
        ]
    if name == "dbrx":  # unbiased LayerNorms, the clamp, experts of its fused rows stacked, renormalised
        assert (c.norm_type, c.norm_bias, c.clip_qkv, c.num_kv_heads) == ("layer", False, 0.5, 2)
        assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size, c.norm_topk_prob) == (4, 2, 48, True)
        assert c.rope_theta == 5000.0 and loaded.checkpoint.provenance["clip_qkv"] == "read"
        assert reader.gguf_names("model.layers.1.mlp.experts.down_proj") == ["blk.1.ffn_down_exps.weight"]
        assert reader.gguf_names("model.layers.0.post_attention_layernorm.weight") == ["blk.0.attn_output_norm.weight"]
        down = hf.state_dict()["transformer.blocks.1.ffn.experts.mlp.w2"].view(4, 48, 64).transpose(1, 2)
        assert torch.equal(reader.get("model.layers.1.mlp.experts.down_proj"), down)
    if name == "gemma3n":  # AltUp, LAuReL, the sparse gates, per-layer inputs, KV sharing, the RoPE bases, no shift
        assert (c.altup_num_inputs, c.altup_active_idx, c.altup_correct_scale, c.laurel_rank) == (4, 0, True, 8)
        assert (c.per_layer_input_size, c.ple_vocab_size, c.kv_shared_layers, c.norm_weight_offset) == (8, 256, 2, 0.0)
        assert c.activation_sparsity == [pytest.approx(0.95), pytest.approx(0.5), 0.0, 0.0, 0.0]
        rope = (c.rope_theta, c.sliding_rope_theta, c.sliding_window, c.final_logit_softcapping)
        assert rope == (1e5, 5000.0, 8, 20.0)
        assert c.layer_types == cfg.layer_types and loaded.checkpoint.provenance["activation_sparsity"] == "read"
        assert reader.gguf_names("model.altup_unembed_projections.2.weight") == ["altup_unembd_proj.weight"]
        for key in ("model.altup_projections.1.weight", "model.layers.3.altup.correct_output_scale"):
            assert torch.equal(reader.get(key), hf.state_dict()[key])
    if name.startswith("gemma4"):  # the full-attention layers' geometry and proportional RoPE, the sliding layers' base
        share, local = (0.5, 5000.0) if name == "gemma4" else (0.25, 10000.0)
        assert (c.head_dim, c.global_head_dim, c.layer_scalar, c.norm_weight_offset) == (16, 32, True, 0.0)
        assert (c.rope_scaling.type, c.rope_scaling.rotated_share, c.sliding_rope_theta) == (
            "proportional",
            share,
            local,
        )
        assert c.layer_types == cfg.layer_types and reader.gguf_names("model.layers.1.layer_scalar") == [
            "blk.1.layer_output_scale.weight"
        ]
    if name == "gemma4":  # one KV head and values equal to the keys' projection in the full-attention layer
        assert (c.attention_k_eq_v, c.global_num_kv_heads, c.num_kv_heads, c.final_logit_softcapping) == (
            True,
            1,
            2,
            30,
        )
    if name == "gemma4-moe":  # the dense MLP beside the experts, the router's scales
        assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size, c.shared_expert_intermediate_size) == (
            4,
            2,
            32,
            96,
        )
        assert not c.attention_k_eq_v and c.final_logit_softcapping == 20.0
        for keel, hf_name in (
            ("mlp.gate.expert_scale", "router.per_expert_scale"),
            ("mlp.gate.input_scale", "router.scale"),
        ):
            assert torch.equal(reader.get(f"model.layers.1.{keel}"), hf.state_dict()[f"model.layers.1.{hf_name}"])
        assert reader.gguf_names("model.layers.1.mlp.gate.expert_scale") == ["blk.1.ffn_down_exps.scale"]
    if name == "gemma4-e":  # per-layer inputs, the last two layers sharing K/V with MLPs twice as wide
        assert (c.per_layer_input_size, c.ple_vocab_size, c.kv_shared_layers, c.kv_shared_mlp_factor) == (8, 320, 2, 2)
        assert c.intermediate_size == 96
    if name == "afmoe":  # sliding layers rotating, the fourth global without; the output gate, sigmoid experts
        assert c.layer_types == ["sliding_attention"] * 3 + ["full_attention"] and c.rope_layers == [True] * 3 + [False]
        assert (c.attention_output_gate, c.router_scoring, c.router_bias, c.routed_scaling_factor) == (
            True,
            "sigmoid",
            True,
            2.0,
        )
        assert (c.mlp_only_layers, c.shared_expert_intermediate_size, c.embedding_multiplier) == ([0], 64, 8.0)
        assert reader.gguf_names("model.layers.1.self_attn.output_gate.weight") == ["blk.1.attn_gate.weight"]
        assert reader.gguf_names("model.layers.2.mlp.gate.e_score_correction_bias") == ["blk.2.exp_probs_b.bias"]
    if name == "mimo_v2_flash":  # narrower values, twice the KV heads and sinks in the sliding layers, their own base
        assert (c.head_dim, c.v_head_dim, c.num_kv_heads, c.global_num_kv_heads) == (16, 12, 2, 1)
        assert (c.attention_sinks, c.attention_sinks_sliding_only, c.attention_value_scale) == (True, True, 0.707)
        assert (c.rope_theta, c.sliding_rope_theta, c.partial_rotary_factor, c.sliding_partial_rotary_factor) == (
            10000.0,
            100.0,
            0.5,
            0.5,
        )
        assert (c.sliding_window, c.layer_types, c.mlp_only_layers) == (8, cfg.layer_types, [0])
        assert (c.router_scoring, c.router_bias, c.num_experts, c.moe_intermediate_size) == ("sigmoid", True, 8, 32)
        assert reader.gguf_names("model.layers.1.self_attn.sinks") == ["blk.1.attn_sinks.weight"]
        assert reader.gguf_names("model.layers.2.mlp.gate.e_score_correction_bias") == ["blk.2.exp_probs_b.bias"]
    if name == "gptj":  # the parallel block, one biased LayerNorm, partial rotary, the MLP's width from ffn_up
        assert (c.parallel_residual, c.norm_type, c.norm_bias, c.lm_head_bias, c.mlp_gated) == (
            True,
            "layer",
            True,
            True,
            False,
        )
        assert (c.rotary_dim, c.head_dim, c.intermediate_size, c.tie_word_embeddings) == (
            cfg.rotary_dim,
            16,
            cfg.n_inner,
            False,
        )
        assert reader.gguf_names("model.layers.1.self_attn.q_proj.weight") == ["blk.1.attn_q.weight"]
    if name.startswith("glm"):  # half of each head rotating, biased q/k/v (fused or apart), gate and up fused
        assert (c.partial_rotary_factor, c.rotary_dim, c.num_kv_heads, c.qkv_bias, c.o_bias) == (0.5, 8, 2, True, False)
        assert c.rope_theta == 10000.0 and c.max_position_embeddings == 64 and c.rms_norm_eps == pytest.approx(1e-5)
        qkv = "blk.1.attn_qkv" if name == "glm-qkv" else "blk.1.attn_k"
        assert reader.gguf_names("model.layers.1.self_attn.k_proj.bias") == [f"{qkv}.bias"]
        assert reader.gguf_names("model.layers.1.mlp.gate_proj.weight") == ["blk.1.ffn_up.weight"]
        v = "model.layers.1.self_attn.v_proj.weight"
        assert torch.equal(reader.get(v), hf.state_dict()[v])
    if name == "olmo":  # weightless LayerNorms, the clamp, q/k weights un-permuted and their biases as stored
        assert (c.norm_type, c.norm_affine, c.clip_qkv, c.qkv_bias) == ("layer", False, pytest.approx(0.3), True)
        assert loaded.checkpoint.provenance["clip_qkv"] == "read"
        q = "model.layers.0.self_attn.q_proj."
        assert torch.equal(reader.get(q + "weight"), hf.state_dict()[q + "weight"])
        assert torch.equal(reader.get(q + "bias"), hf.state_dict()[q + "bias"])
    if name == "phimoe":  # LayerNorms, the SparseMixer router, the window, LongRoPE with the file's factor
        assert (c.norm_type, c.router_scoring, c.sliding_window, c.lm_head_bias) == ("layer", "sparsemixer", 8, True)
        assert c.rope_scaling.type == "longrope" and c.rope_scaling.attention_factor == pytest.approx(
            llama_cpp_attn_factor(cfg.to_dict()), rel=1e-6
        )
        assert reader.gguf_names("model.layers.1.block_sparse_moe.experts.down_proj") == ["blk.1.ffn_down_exps.weight"]
    if name == "seed_oss":
        assert (c.qkv_bias, c.o_bias, c.mlp_bias, c.head_dim) == (True, True, False, 16)
    if name == "arcee":  # the ungated ReLU-squared MLP, YaRN, q/k rows and biases un-permuted
        assert (c.mlp_gated, c.hidden_act, c.rope_scaling.type, c.qkv_bias) == (False, "relu2", "yarn", True)
        for part in ("weight", "bias"):
            k = f"model.layers.0.self_attn.k_proj.{part}"
            assert torch.equal(reader.get(k), hf.state_dict()[k])
    if name == "apertus":  # xIELU's parameters from metadata, per-head q/k norms, Llama 3's rope from rope_freqs
        assert (c.hidden_act, c.qk_norm, c.rope_scaling.type) == ("xielu", True, "llama3")
        for param in ("alpha_p", "alpha_n", "beta", "eps"):
            key = f"model.layers.2.mlp.act_fn.{param}"
            assert reader.gguf_names(key) == [] and torch.equal(reader.get(key), hf.state_dict()[key]), param
    if name == "minimax_m2":  # the sigmoid router's selection bias, whole-projection q/k norms, 8 of 16 rotating
        assert (c.router_scoring, c.router_bias, c.norm_topk_prob, c.qk_norm_scope) == ("sigmoid", True, True, "all")
        assert (c.rotary_dim, c.head_dim, c.num_experts, c.moe_intermediate_size) == (8, 16, 8, 32)
        bias = "model.layers.1.block_sparse_moe.gate.e_score_correction_bias"
        assert reader.gguf_names(bias) == ["blk.1.exp_probs_b.bias"]
    if name == "ministral3":  # YaRN with its mscales, Llama 4's temperature by position
        assert (c.rope_scaling.type, c.rope_scaling.mscale, c.rope_scaling.mscale_all_dim) == ("yarn", 1.0, 1.0)
        assert (c.query_scale_beta, c.query_scale_length) == (0.5, 16)
    if name == "minicpm3":  # latent attention rotating halves, llama.cpp's scalars, LongRoPE's short factors
        assert (c.q_lora_rank, c.kv_lora_rank, c.v_head_dim, c.qk_rope_head_dim, c.rope_interleave) == (
            32,
            16,
            16,
            8,
            False,
        )
        assert (c.embedding_multiplier, c.logits_scaling) == (12.0, 0.25)
        assert c.residual_multiplier == pytest.approx(1.4 / math.sqrt(3))
        assert c.rope_scaling.type == "longrope" and c.rope_scaling.short_factor == (1.0, 1.25, 2.5, 3.5)
        assert reader.gguf_names("model.layers.0.self_attn.kv_b_proj.weight") == ["blk.0.attn_kv_b.weight"]
    if name.startswith("hunyuan"):  # q/k norms after the rotary embedding, NTK's alpha as the base
        dim = cfg.hidden_size // cfg.num_attention_heads
        base = 10000.0 * 1000.0 ** (dim / (dim - 2))
        assert (c.qk_norm, c.qk_norm_after_rope, c.qkv_bias, c.rope_scaling.type) == (True, True, True, "default")
        assert c.rope_theta == pytest.approx(base, rel=1e-6) and c.max_position_embeddings == 256 * 1024
        assert reader.gguf_names("model.layers.0.self_attn.q_norm.weight") == ["blk.0.attn_q_norm.weight"]
    if name == "hunyuan_v1_moe":  # the float32 router (gate.wg), the ungated shared MLP, the top 2 renormalised
        assert (c.num_experts, c.num_experts_per_tok, c.norm_topk_prob, c.router_float32) == (8, 2, True, True)
        assert (c.shared_expert_intermediate_size, c.shared_expert_gated) == (32, False)
        assert reader.gguf_names("model.layers.2.mlp.gate.weight") == ["blk.2.ffn_gate_inp.weight"]
    if name == "exaone_moe":  # sliding layers rotate, global ones not; sigmoid experts with the selection bias
        rotating = [True, False, True, False]
        assert (c.sliding_window, c.layer_types[:2], c.rope_layers) == (
            8,
            ["sliding_attention", "full_attention"],
            rotating,
        )
        assert (c.router_scoring, c.router_bias, c.norm_topk_prob, c.mlp_only_layers) == ("sigmoid", True, True, [0, 3])
        assert (c.routed_scaling_factor, c.shared_expert_intermediate_size) == (cfg.routed_scaling_factor, 32)
        bias = "model.layers.1.mlp.gate.e_score_correction_bias"
        assert reader.gguf_names(bias) == ["blk.1.exp_probs_b.bias"]
    if name == "jais2":  # LayerNorms with biases (their eps as layer_norm_eps), ReLU squared ungated, biases
        assert (c.norm_type, c.norm_bias, c.mlp_gated, c.hidden_act, c.qkv_bias, c.mlp_bias) == (
            "layer",
            True,
            False,
            "relu2",
            True,
            True,
        )
        assert c.rms_norm_eps == pytest.approx(1e-4) and loaded.checkpoint.provenance["rms_norm_eps"] == "read"
    if name == "exaone":  # Llama 3's rope from rope_freqs, biases, q/k rows as in HF
        assert (c.architecture, c.rope_scaling.type, c.rope_scaling.factor, c.qkv_bias, c.mlp_bias) == (
            "exaone",
            "llama3",
            8.0,
            True,
            True,
        )
        q = "model.layers.1.self_attn.q_proj.weight"
        assert torch.equal(reader.get(q), hf.state_dict()[q])
    if name in ("gpt_bigcode", "gpt2"):  # learned positions, LayerNorms, the MLP's width from ffn_up, q/k/v split
        assert (c.position_embedding, c.norm_type, c.intermediate_size, c.mlp_gated) == ("learned", "layer", 128, False)
        assert c.num_kv_heads == (1 if name == "gpt_bigcode" else 4) and c.tie_word_embeddings
        assert reader.gguf_names("model.embed_positions.weight") == ["position_embd.weight"]
        for part in ("q_proj", "k_proj", "v_proj"):
            assert reader.gguf_names(f"model.layers.0.self_attn.{part}.weight") == ["blk.0.attn_qkv.weight"]
    if name.startswith("falcon"):  # the parallel block, one or two norms, the MLP's width from ffn_up
        two = name == "falcon-40b"
        assert (c.parallel_residual, c.post_attention_norm, c.num_kv_heads) == (True, two, 2 if two else 1)
        assert c.intermediate_size == cfg.ffn_hidden_size and c.qkv_bias == cfg.bias
    if name in ("bloom", "mpt"):  # ALiBi, LayerNorms (BLOOM's embedding norm), q/k/v from one attn_qkv
        assert (c.position_embedding, c.norm_type, c.num_kv_heads) == ("alibi", "layer", 6)
        for part in ("q_proj", "k_proj", "v_proj"):
            q = f"model.layers.0.self_attn.{part}.weight"
            assert reader.gguf_names(q) == ["blk.0.attn_qkv.weight"]
        if name == "bloom":
            assert c.embedding_norm and c.norm_bias and c.qkv_bias
            assert reader.gguf_names("model.embedding_norm.bias") == ["token_embd_norm.bias"]
        else:
            assert (c.clip_qkv, c.alibi_bias_max, c.norm_bias, c.qkv_bias) == (pytest.approx(0.6), 8.0, False, False)
            assert loaded.checkpoint.provenance["alibi_bias_max"] == "read"
    if name == "jamba":  # attention in layer 1 of 4, Mamba 1 mixers with step/B/C norms, experts in layers 1 and 3
        assert c.layer_types == ["mamba1", "full_attention", "mamba1", "mamba1"] and not any(c.rope_layers)
        assert (c.mlp_only_layers, c.num_experts, c.mamba_dt_bc_norm, c.mamba_dt_rank) == ([0, 2], 4, "rms", 6)
        assert reader.gguf_names("model.layers.1.mlp.experts.gate_up_proj") == [
            "blk.1.ffn_gate_exps.weight",
            "blk.1.ffn_up_exps.weight",
        ]
        assert reader.gguf_names("model.layers.0.self_attn.dt_layernorm.weight") == ["blk.0.ssm_dt_norm.weight"]
    if name in ("mamba", "mamba2"):  # every layer the mixer alone (no attention, no MLP), its tensors back in HF's form
        kind = "mamba1" if name == "mamba" else "mamba"
        assert c.layer_types == [kind] * 3 and not any(c.mlp_layers) and c.mamba_d_state == cfg.state_size
        assert c.tie_word_embeddings == cfg.tie_word_embeddings and c.mamba_proj_bias and c.mamba_out_bias
        assert reader.gguf_names("model.layers.0.self_attn.A_log") == ["blk.0.ssm_a"]
        for part in ("D", "conv1d.weight", "in_proj.weight", "out_proj.bias"):
            assert torch.equal(
                reader.get(f"model.layers.0.self_attn.{part}"), hf.state_dict()[f"backbone.layers.0.mixer.{part}"]
            )
    if name == "mamba":
        assert (c.mamba_dt_rank, c.mamba_d_conv, c.mamba_d_inner) == (6, 3, 128)
    if name == "mamba2":
        assert (c.mamba_n_heads, c.mamba_d_head, c.mamba_n_groups, c.mamba_dt_limit) == (8, 16, 2, (0.0, float("inf")))
    if name == "nemotron":  # LayerNorm1P (the file's weights less 1), half of each head rotating, biases
        assert (c.norm_type, c.norm_weight_offset, c.partial_rotary_factor, c.mlp_gated) == ("layer", 1.0, 0.5, False)
        assert c.rms_norm_eps == pytest.approx(1e-4) and c.qkv_bias and c.mlp_bias
        norm = "model.layers.1.input_layernorm.weight"
        torch.testing.assert_close(reader.get(norm), hf.state_dict()[norm])


@pytest.mark.parametrize("name", list(CONVERTERS))
def test_converted_gguf_matches_hf_model(tmp_path, name):
    """The file read as the converter wrote it: the family's config and tensors, transformers' logits, and `keel
    convert` back to the HF checkpoint (norms written plus 1 to float32's rounding, the rest exactly)."""
    from safetensors.torch import load_file

    from keel.weights.convert import convert

    hf = build(name)
    write_converted(hf, tmp_path / f"{name}.gguf", CONVERTERS[name])
    loaded = load_model(tmp_path / f"{name}.gguf")
    assert loaded.config.architecture == name.split("-")[0]
    assert_family_features(name, loaded, hf)
    with torch.no_grad():
        assert rel_err(hf(TOKENS).logits, loaded.model(TOKENS)) <= 1e-4
    out = convert(tmp_path / f"{name}.gguf", tmp_path / "back", dtype="float32")
    written = {k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(f).items()}
    stored = load_file(tmp_path / "hf" / "model.safetensors")
    assert set(written) == set(stored)
    for key, tensor in stored.items():
        # (norms written plus 1 and A_log through -exp to float32's rounding)
        close = key.endswith(("norm.weight", "A_log"))
        torch.testing.assert_close(written[key], tensor, rtol=1e-6 if close else 0, atol=1e-6 if close else 0)


@pytest.mark.parametrize("name", [pytest.param(name, marks=SLOW) for name in CONVERTERS])
def test_converted_gguf_is_served_as_transformers(tmp_path, name):
    """Greedy tokens through keel's engine from float32 and from Q8_0 run as stored (transformers on the weights
    the Q8_0 file holds)."""
    hf = build(name)
    write_converted(hf, tmp_path / "f32.gguf", CONVERTERS[name])
    write_q8 = lambda path: write_converted(hf, path, CONVERTERS[name], q8=True)  # noqa: E731
    assert_served_as_transformers(tmp_path, hf, "f32", write_q8, max_model_len=64, probe=CONVERTERS[name].probe)


def test_gemma3n_gguf_pads_the_per_layer_table(tmp_path):
    """Gemma3NModel pads a per-layer table shorter than the vocabulary with zero rows: read as llama.cpp runs it (ids
    past HF's table read zeros, where transformers reads its row 0), the same logits for the ids within it."""
    hf = build_hf_model("gemma3n", altup_num_inputs=4)
    write_converted(hf, tmp_path / "g.gguf", CONVERTERS["gemma3n"])
    loaded = load_model(tmp_path / "g.gguf")
    table = loaded.checkpoint.reader.get("model.embed_tokens_per_layer.weight")
    assert loaded.config.ple_vocab_size == 256 and not table[200:].any()
    assert torch.equal(table[:200], hf.state_dict()["model.embed_tokens_per_layer.weight"])
    tokens = TOKENS % 200
    with torch.no_grad():
        assert rel_err(hf(tokens).logits, loaded.model(tokens)) <= 1e-4


def test_gemma3n_gguf_with_mlps_of_different_widths_is_refused(tmp_path):
    hf = build("gemma3n", intermediate_size=[96, 96, 64, 96, 96])
    write_converted(hf, tmp_path / "g.gguf", CONVERTERS["gemma3n"])
    with pytest.raises(ConfigError, match="feed_forward_length: MLPs of different widths per layer are not supported"):
        open_gguf(tmp_path / "g.gguf")


def test_apertus_gguf_without_xielu_keys_is_refused(tmp_path):
    hf = build("apertus")
    converter = CONVERTERS["apertus"]
    write_converted(
        hf, tmp_path / "apertus.gguf", Converter(converter.arch, llama_model_keys, consumed=converter.consumed)
    )
    with pytest.raises(ConfigError, match="'xielu.alpha_p' must list one value per layer"):
        open_gguf(tmp_path / "apertus.gguf")


def test_exaone_gguf_with_the_eps_as_text_models_layer_norm_key(tmp_path):
    """EXAONE's config.json names its RMSNorm eps layer_norm_epsilon, which TextModel's keys write as the LayerNorm
    key (the older converter wrote it as the RMS key, which llama.cpp reads): read from either."""
    hf = build("exaone", rms_norm_eps=1e-3)
    hp = {k: v for k, v in hf.config.to_dict().items() if k != "rms_norm_eps"} | {"layer_norm_epsilon": 1e-3}
    keys = lambda w, _: (text_model_keys(w, hp), _rotary_width_key(w, hp))  # noqa: E731
    converter = dataclasses.replace(CONVERTERS["exaone"], keys=keys, text_model=False)
    write_converted(hf, tmp_path / "exaone.gguf", converter)
    loaded = load_model(tmp_path / "exaone.gguf")
    assert loaded.config.rms_norm_eps == pytest.approx(1e-3) and loaded.checkpoint.provenance["rms_norm_eps"] == "read"
    with torch.no_grad():
        assert rel_err(hf(TOKENS).logits, loaded.model(TOKENS)) <= 1e-4


def test_hunyuan_moe_gguf_with_experts_narrower_than_the_shared_mlp_is_refused(tmp_path):
    """transformers' Hunyuan MoE runs experts as wide as the shared MLP: a file whose widths differ is refused by name,
    as a config.json would be."""
    keys = lambda w, hp: (_hunyuan_keys(w, hp), w.add_expert_feed_forward_length(16))  # noqa: E731
    converter = dataclasses.replace(CONVERTERS["hunyuan_v1_moe"], keys=keys)
    write_converted(build("hunyuan_v1_moe"), tmp_path / "moe.gguf", converter)
    with pytest.raises(ConfigError, match="moe_intermediate_size 16 differs from intermediate_size 32"):
        open_gguf(tmp_path / "moe.gguf")


def test_falcon_mamba_gguf_is_refused(tmp_path):
    """MambaModel converts Falcon Mamba too, with ssm.dt_b_c_rms true (its normed step, B and C): refused by name."""
    write_converted(build_hf_model("falcon_mamba"), tmp_path / "fm.gguf", CONVERTERS["mamba"])
    with pytest.raises(ConfigError, match=r"mamba.ssm.dt_b_c_rms true \(Falcon Mamba's\) is not supported"):
        open_gguf(tmp_path / "fm.gguf")


def test_gpt_bigcode_gguf_without_multi_query_is_refused(tmp_path):
    """StarCoderModel writes one KV head whatever multi_query says: a model without it (each head's own key and value,
    interleaved in c_attn) is refused by name rather than read as multi-query."""
    write_converted(build_hf_model("gpt_bigcode-mha"), tmp_path / "mha.gguf", CONVERTERS["gpt_bigcode"])
    with pytest.raises(ConfigError, match="GPT-BigCode without multi_query, as StarCoderModel writes it"):
        open_gguf(tmp_path / "mha.gguf")


def test_gemma4_gguf_with_other_mlp_widths_per_layer_or_partial_sliding_rotary_is_refused(tmp_path):
    """Only use_double_wide_mlp's widths per layer (the KV-sharing layers' twice the others') and sliding layers
    rotating the whole head are read; a file saying otherwise is refused by name."""
    for key, value, message in (
        ("feed_forward_length", [96, 96, 96, 128, 192], "MLP widths per layer other than use_double_wide_mlp's"),
        ("rope.dimension_count_swa", 8, "rope.dimension_count_swa 8: partial rotary in the sliding layers"),
    ):

        def keys(w: gguf.GGUFWriter, hp: dict[str, Any], key=key, value=value) -> None:
            _gemma4_keys(w, hp)
            w.kv_data[0][f"gemma4.{key}"].value = value

        converter = dataclasses.replace(CONVERTERS["gemma4-e"], keys=keys)
        write_converted(build("gemma4-e"), tmp_path / "g.gguf", converter)
        with pytest.raises(ConfigError, match=re.escape(message)):
            open_gguf(tmp_path / "g.gguf")


@pytest.mark.parametrize(
    "extra, message",
    [
        (lambda w: w.add_expert_weights_norm(False), "afmoe.expert_weights_norm false (route_norm) is not supported"),
        (lambda w: w.add_expert_gating_func(gguf.ExpertGatingFuncType.SOFTMAX), "afmoe.expert_gating_func 1 is not"),
    ],
)
def test_afmoe_gguf_without_renormalised_sigmoid_experts_is_refused(tmp_path, extra, message):
    """transformers' AFMoE renormalises its sigmoid router's top k: a file saying otherwise is refused by name."""
    keys = lambda w, hp: (_afmoe_keys(w, hp), extra(w))  # noqa: E731
    write_converted(build("afmoe"), tmp_path / "a.gguf", dataclasses.replace(CONVERTERS["afmoe"], keys=keys))
    with pytest.raises(ConfigError, match=re.escape(message)):
        open_gguf(tmp_path / "a.gguf")


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            lambda w: w.add_head_count_kv([1, 3, 3, 1]),
            "sliding layers' 3 KV heads other than twice the full layers' 1 are not supported",
        ),
        (lambda w: w.add_expert_weights_norm(False), "mimo2.expert_weights_norm false is not supported for mimo2"),
        (lambda w: w.add_expert_weights_scale(2.5), "mimo2.expert_weights_scale 2.5 is not supported for mimo2"),
        (
            lambda w: (w.add_sliding_window_pattern([0, 0, 1, 0]), w.add_head_count_kv([1, 1, 2, 1])),
            "a full-attention layer with blk.1.attn_sinks.weight is not supported for mimo2",
        ),
    ],
)
def test_mimo2_gguf_beyond_what_llama_cpp_runs_is_refused(tmp_path, edit, message):
    """llama.cpp's mimo2 graph runs renormalised sigmoid experts unscaled and sinks in the sliding layers alone, with
    one KV count per kind (keel's: the sliding layers twice the full ones'): a file saying otherwise is refused by
    name, not read with it dropped."""
    keys = lambda w, hp: (_mimo2_keys(w, hp), edit(w))  # noqa: E731
    converter = dataclasses.replace(CONVERTERS["mimo_v2_flash"], keys=keys)
    write_converted(build("mimo_v2_flash"), tmp_path / "m.gguf", converter)
    with pytest.raises(ConfigError, match=re.escape(message)):
        open_gguf(tmp_path / "m.gguf")


def _gate_and_up_apart(state: dict[str, torch.Tensor], hp: dict[str, Any]) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in state.items():
        if name.endswith("gate_up_proj.weight"):
            gate, up = t.chunk(2)
            out[name.replace("gate_up_proj", "gate_proj")], out[name.replace("gate_up_proj", "up_proj")] = gate, up
        else:
            out[name] = t
    return out


@pytest.mark.parametrize("what", ["output bias", "gate apart"])
def test_chatglm_gguf_with_what_llama_cpp_does_not_load_is_refused(tmp_path, monkeypatch, what):
    """ChatGLM's block has no output or MLP biases and keeps gate and up fused (llama.cpp's `chatglm` loads nothing
    else): a file holding an output bias or `ffn_gate` apart is refused by name, not read with them dropped."""
    if what == "output bias":
        bias = lambda state, hp: {**state, "model.layers.0.self_attn.o_proj.bias": torch.zeros(64)}  # noqa: E731
        converter = dataclasses.replace(CONVERTERS["glm"], prepare=bias)
        message = r"o_bias \(blk\.0\.attn_output\.bias\) is not supported for chatglm"
    else:  # (ChatGLMModel cannot name ffn_gate: named by llama's table, as a hand-made file would)
        names = gguf.get_tensor_name_map
        monkeypatch.setattr(gguf, "get_tensor_name_map", lambda arch, n: names(gguf.MODEL_ARCH.LLAMA, n))
        converter = dataclasses.replace(CONVERTERS["glm"], prepare=_gate_and_up_apart)
        message = r"a separate blk\.0\.ffn_gate\.weight is not supported for chatglm"
    write_converted(build("glm"), tmp_path / "glm.gguf", converter)
    with pytest.raises(ConfigError, match=message):
        open_gguf(tmp_path / "glm.gguf")


def test_minicpm_gguf_without_its_scalar_keys_takes_llama_cpps(tmp_path):
    """An older MiniCPM file without embedding_scale / residual_scale / logit_scale: llama.cpp's defaults, the
    releases' scale_emb 12, scale_depth 1.4 and dim_model_base 256 (logits over hidden / 256)."""
    hf = build(
        "granite-minicpm",
        embedding_multiplier=12.0,
        residual_multiplier=1.4 / math.sqrt(3),
        logits_scaling=64 / 256,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    converter = dataclasses.replace(CONVERTERS["granite-minicpm"], keys=lambda w, hp: None)
    write_converted(hf, tmp_path / "m.gguf", converter)
    loaded = load_model(tmp_path / "m.gguf")
    c = loaded.config
    assert (c.embedding_multiplier, c.logits_scaling, c.rope_scaling.type) == (12.0, 0.25, "default")
    assert loaded.checkpoint.provenance["embedding_multiplier"] == "default"
    with torch.no_grad():
        assert rel_err(hf(TOKENS).logits, loaded.model(TOKENS)) <= 1e-4


@pytest.mark.parametrize(
    ("key", "message"),
    [
        (lambda w: w.add_expert_count(4), "MiniCPM with experts"),
        (lambda w: w.add_attention_scale(0.5), "attention.scale"),
        (lambda w: w.add_rope_scaling_type(gguf.RopeScalingType.LONGROPE), "without its rope_factors"),
    ],
)
def test_minicpm_gguf_beyond_what_keel_reads_is_refused(tmp_path, key, message):
    hf = build("granite-minicpm", rope_parameters={"rope_type": "default", "rope_theta": 10000.0})

    def keys(w: gguf.GGUFWriter, hp: dict[str, Any]) -> None:
        _minicpm_keys(w, hp)
        key(w)

    write_converted(hf, tmp_path / "m.gguf", dataclasses.replace(CONVERTERS["granite-minicpm"], keys=keys))
    with pytest.raises(ConfigError, match=message) as e:
        open_gguf(tmp_path / "m.gguf")
    assert "\n" not in str(e.value)
