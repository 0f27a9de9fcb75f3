"""llama.cpp's `glm-dsa` GGUF files (GLM-5, keel.weights.gguf): a tiny GLM-5 written as GlmMoeDsaModel
(convert_hf_to_gguf.py, on DeepseekV2Model) writes it (TextModel's keys with head_count_kv 1, the latent attention's
ranks and widths in MQA form, DeepSeek's expert keys, the indexer's `attention.indexer.*` keys; the
multi-token-prediction layer counted in block_count with `nextn_predict_layers`; kv_b_proj split into `attn_k_b`
(transposed) and `attn_v_b`, the experts stacked per kind, the indexer's tensors as HF's, none on a layer sharing
another's selection), loaded by keel and compared with transformers running the original HF weights."""

from __future__ import annotations

import re

import gguf
import numpy as np
import pytest
import torch

from keel.errors import ConfigError
from keel.quant.loading import load_model
from keel.weights import gguf as keel_gguf
from test_gguf import TOKENS, add_mini_vocab, rel_err
from test_gguf_families import assert_gguf_greedy_tokens_match, finish_writer, rewritten_gguf
from tiny_models import build_hf_model

pytest.importorskip("transformers")

# What the converter can write: the dense layers first (leading_dense_block_count), no attention biases (llama.cpp
# loads none); layers 1 and 2 share layer 0's selection. index_topk 5 < the 12-token prompt: the indexer selects.
_BUILD = dict(mlp_layer_types=None, first_k_dense_replace=1, attention_bias=False)
_EXPERTS = {"gate_proj": gguf.MODEL_TENSOR.FFN_GATE_EXP, "up_proj": gguf.MODEL_TENSOR.FFN_UP_EXP}
_EXPERTS["down_proj"] = gguf.MODEL_TENSOR.FFN_DOWN_EXP
_ARCH = gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.GLM_DSA]


def _keys(w: gguf.GGUFWriter, hp: dict, types: bool) -> None:
    """TextModel's keys, DeepseekV2Model's, then GlmMoeDsaModel's; `types`: the per-layer indexer key of newer
    converters (true: the layer's own indexer)."""
    layers = hp["num_hidden_layers"]
    w.add_block_count(layers + 1)  # the MTP layer after the last
    w.add_nextn_predict_layers(1)
    w.add_context_length(hp["max_position_embeddings"])
    w.add_embedding_length(hp["hidden_size"])
    w.add_feed_forward_length(hp["intermediate_size"])
    w.add_head_count(hp["num_attention_heads"])
    w.add_head_count_kv(1)
    w.add_rope_freq_base(hp["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    w.add_expert_count(hp["n_routed_experts"])
    w.add_expert_used_count(hp["num_experts_per_tok"])
    w.add_expert_group_count(hp["n_group"])
    w.add_expert_group_used_count(hp["topk_group"])
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_leading_dense_block_count(hp["first_k_dense_replace"])
    w.add_vocab_size(hp["vocab_size"])
    w.add_q_lora_rank(hp["q_lora_rank"])
    w.add_kv_lora_rank(hp["kv_lora_rank"])
    w.add_key_length(hp["kv_lora_rank"] + hp["qk_rope_head_dim"])
    w.add_value_length(hp["kv_lora_rank"])
    w.add_key_length_mla(hp["qk_nope_head_dim"] + hp["qk_rope_head_dim"])
    w.add_value_length_mla(hp["v_head_dim"])
    w.add_expert_feed_forward_length(hp["moe_intermediate_size"])
    w.add_expert_shared_count(hp["n_shared_experts"])
    w.add_expert_weights_scale(hp["routed_scaling_factor"])
    w.add_expert_weights_norm(hp["norm_topk_prob"])
    w.add_rope_dimension_count(hp["qk_rope_head_dim"])
    w.add_indexer_head_count(hp["index_n_heads"])
    w.add_indexer_key_length(hp["index_head_dim"])
    w.add_indexer_top_k(hp["index_topk"])
    if types:
        w.add_array(keel_gguf.INDEXER_TYPES.format(arch=_ARCH), [t == "full" for t in hp["indexer_types"]])


def write_glm_dsa(hf, path, types: bool = False, mtp: bool = True) -> None:
    """`hf` as GlmMoeDsaModel writes it, from the checkpoint as saved; `mtp`: with a stand-in NextN block."""
    from safetensors.torch import load_file

    hp = hf.config.to_dict()
    hf.save_pretrained(path.parent / "hf")
    state = load_file(path.parent / "hf" / "model.safetensors")
    w = gguf.GGUFWriter(str(path), _ARCH)
    _keys(w, hp, types)
    add_mini_vocab(w, "default")
    layers = hp["num_hidden_layers"]
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GLM_DSA, layers + 1)
    out: dict[str, torch.Tensor] = {}
    experts: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    for name, t in state.items():
        if match := re.match(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+_proj)\.weight$", name):
            experts.setdefault((int(match[1]), match[3]), {})[int(match[2])] = t
            continue
        name = name.replace("e_score_correction_bias", "e_score_correction.bias")  # (TextModel's, for every model)
        if name.endswith("kv_b_proj.weight"):
            heads, v, nope = hp["num_key_value_heads"], hp["v_head_dim"], hp["qk_nope_head_dim"]
            k_b, v_b = torch.split(t.view(heads, v + nope, t.shape[-1]), [nope, v], dim=1)
            out[name.replace("kv_b_proj", "k_b_proj")] = k_b.transpose(1, 2)
            out[name.replace("kv_b_proj", "v_b_proj")] = v_b
            continue
        out[name] = t
    for name, t in out.items():
        base, suffix = name.rsplit(".", 1)
        gguf_name = names.get_name(name) or f"{names.get_name(base)}.{suffix}"
        w.add_tensor(gguf_name, np.ascontiguousarray(t.float().numpy()))
    for (layer, kind), by_expert in experts.items():
        stacked = torch.stack([by_expert[i] for i in sorted(by_expert)])
        w.add_tensor(f"{gguf.TENSOR_NAMES[_EXPERTS[kind]].format(bid=layer)}.weight", stacked.float().numpy())
    if mtp:  # the NextN block (blk.<layers>): keel reads none of it
        hidden = hp["hidden_size"]
        w.add_tensor(f"blk.{layers}.nextn.eh_proj.weight", np.ones((hidden, 2 * hidden), np.float32))
        w.add_tensor(f"blk.{layers}.attn_norm.weight", np.ones(hidden, np.float32))
    finish_writer(w)


@pytest.mark.parametrize("types", [False, True], ids=["by-tensors", "types-key"])
def test_glm_dsa_gguf_matches_transformers(tmp_path, types):
    hf = build_hf_model("glm_moe_dsa", **_BUILD)
    cfg = hf.config
    assert list(cfg.indexer_types) == ["full", "shared", "shared", "full"] and cfg.index_topk < TOKENS.shape[1]
    write_glm_dsa(hf, tmp_path / "g.gguf", types=types)
    loaded = load_model(tmp_path / "g.gguf", "float32")
    c, reader = loaded.config, loaded.checkpoint.reader
    assert c.architecture == "glm_moe_dsa" and c.num_layers == 4 and c.is_dsa
    assert (c.index_topk, c.index_n_heads, c.index_head_dim, c.index_rope_interleave) == (5, 16, 12, True)
    assert c.indexer_types == ["full", "shared", "shared", "full"]
    assert [c.index_source(i) for i in range(4)] == [0, 0, 0, 3]
    assert (c.q_lora_rank, c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim) == (32, 16, 16, 8, 12)
    assert c.num_kv_heads == c.num_heads == 4 and c.mlp_only_layers == [0] and c.rope_interleave
    assert c.router_scoring == "sigmoid" and c.router_bias and c.norm_topk_prob and not c.o_bias
    assert reader.gguf_names("model.layers.3.self_attn.indexer.wq_b.weight") == ["blk.3.indexer.attn_q_b.weight"]
    assert not any(".layers.1.self_attn.indexer." in n or ".layers.4." in n for n in reader.names())
    from safetensors.torch import load_file

    saved = load_file(tmp_path / "hf" / "model.safetensors")
    for part in ("indexer.k_norm.weight", "indexer.k_norm.bias", "indexer.weights_proj.weight", "kv_b_proj.weight"):
        name = f"model.layers.3.self_attn.{part}"
        torch.testing.assert_close(reader.get(name), saved[name], rtol=0, atol=0)
    with torch.no_grad():
        assert rel_err(hf(TOKENS).logits, loaded.model(TOKENS)) <= 1e-5
    if types:
        return
    from keel.weights.convert import convert

    out = convert(tmp_path / "g.gguf", tmp_path / "back", dtype="float32")  # the HF checkpoint back
    written = {k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(f).items()}
    assert set(written) == set(saved)
    for key, tensor in saved.items():
        torch.testing.assert_close(written[key], tensor, rtol=0, atol=0)
    import json

    back = json.loads((out / "config.json").read_text())
    assert back["indexer_types"] == ["full", "shared", "shared", "full"] and back["index_topk"] == 5


def test_glm_dsa_gguf_refuses_indexer_types_against_its_tensors(tmp_path):
    """A file whose `attention.indexer.types` calls a layer without indexer tensors full (or the reverse)."""
    hf = build_hf_model("glm_moe_dsa", **_BUILD)
    write_glm_dsa(hf, tmp_path / "g.gguf", mtp=False)
    key = keel_gguf.INDEXER_TYPES.format(arch=_ARCH)
    rewritten_gguf(tmp_path / "g.gguf", tmp_path / "bad.gguf", key, [True, True, False, True])
    with pytest.raises(ConfigError, match="indexer.types .* disagrees"):
        load_model(tmp_path / "bad.gguf", "float32")
    rewritten_gguf(tmp_path / "g.gguf", tmp_path / "short.gguf", key, [True, False])
    with pytest.raises(ConfigError, match="indexer.types must list each of the 4 layers"):
        load_model(tmp_path / "short.gguf", "float32")


def test_glm_dsa_gguf_with_partial_rotary_is_refused(tmp_path):
    """GlmMoeDsaModel writes qk_rope_head_dim x partial_rotary_factor as the rotary width (transformers rotates
    qk_rope_head_dim): a width other than the keys' is refused, not read as a narrower rotary."""
    hf = build_hf_model("glm_moe_dsa", **_BUILD)
    write_glm_dsa(hf, tmp_path / "g.gguf", mtp=False)
    key = gguf.Keys.Rope.DIMENSION_COUNT.format(arch=_ARCH)
    rewritten_gguf(tmp_path / "g.gguf", tmp_path / "half.gguf", key, 4)
    with pytest.raises(ConfigError, match="partial rotary not supported"):
        load_model(tmp_path / "half.gguf", "float32")


@pytest.mark.slow
def test_glm_dsa_gguf_greedy_tokens_match_transformers(tmp_path):
    """The latent cache and the indexer's keys step by step from the file, past index_topk: transformers' tokens."""
    hf = build_hf_model("glm_moe_dsa", **_BUILD)
    write_glm_dsa(hf, tmp_path / "g.gguf")
    assert_gguf_greedy_tokens_match(hf, tmp_path / "g.gguf")
