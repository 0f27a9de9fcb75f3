"""llama.cpp's `kimi-linear` GGUF files (keel.weights.gguf): a tiny Kimi Linear written as KimiLinearModel
(convert_hf_to_gguf.py) writes it (TextModel's keys, the KV head count per layer with 0 marking a KDA layer and 1 the
latent attention's MQA form, `kda.head_dim`, `ssm.conv_kernel`, the latent attention's ranks and widths, the experts'
keys; the short convolutions as [1, C, 1, K], A_log as -exp(A_log), dt_bias as `ssm_dt.bias`, kv_b_proj split into
`attn_k_b` (transposed) and `attn_v_b`, the experts stacked per kind), loaded by keel and compared with transformers
running the original HF weights."""

from __future__ import annotations

import re

import gguf
import numpy as np
import pytest
import torch

from keel.errors import ConfigError
from keel.quant.loading import load_model
from test_gguf import TOKENS, add_mini_vocab, rel_err
from test_gguf_families import assert_gguf_greedy_tokens_match, finish_writer, rewritten_gguf
from tiny_models import build_hf_model

pytest.importorskip("transformers")

# Kimi-Linear-48B-A3B's routing (one group: the converter writes no group keys, llama.cpp routes without groups); the
# latent attention's KV heads the query heads (the converter splits kv_b_proj by num_key_value_heads)
_BUILD = dict(num_expert_group=1, topk_group=1)
_EXPERTS = (("w1", gguf.MODEL_TENSOR.FFN_GATE_EXP), ("w2", gguf.MODEL_TENSOR.FFN_DOWN_EXP))
_EXPERTS += (("w3", gguf.MODEL_TENSOR.FFN_UP_EXP),)


def _keys(w: gguf.GGUFWriter, hp: dict) -> None:
    """TextModel's keys from Moonshot's config.json names, then KimiLinearModel's (which overwrite head_count_kv and
    key_length)."""
    layers = hp["num_hidden_layers"]
    w.add_block_count(layers)
    w.add_context_length(hp["model_max_length"])
    w.add_embedding_length(hp["hidden_size"])
    w.add_feed_forward_length(hp["intermediate_size"])
    w.add_head_count(hp["num_attention_heads"])
    w.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    w.add_expert_count(hp["num_experts"])
    w.add_expert_used_count(hp["num_experts_per_token"])
    w.add_vocab_size(hp["vocab_size"])
    w.add_head_count_kv([1 if kind == "full_attention" else 0 for kind in hp["layer_types"]])
    w.add_ssm_conv_kernel(hp["linear_conv_kernel_dim"])
    w.add_kda_head_dim(hp["linear_head_dim"])
    w.add_q_lora_rank(hp["q_lora_rank"])
    w.add_kv_lora_rank(hp["kv_lora_rank"])
    w.add_rope_dimension_count(hp["qk_rope_head_dim"])
    w.add_key_length(hp["kv_lora_rank"] + hp["qk_rope_head_dim"])
    w.add_key_length_mla(hp["qk_nope_head_dim"] + hp["qk_rope_head_dim"])
    w.add_value_length_mla(hp["v_head_dim"])
    w.add_expert_feed_forward_length(hp["moe_intermediate_size"])
    w.add_expert_shared_count(hp["num_shared_experts"])
    w.add_leading_dense_block_count(hp["mlp_layer_types"].index("sparse"))
    w.add_expert_weights_scale(hp["routed_scaling_factor"])


def write_kimi_linear(hf, path) -> None:
    """`hf` as KimiLinearModel writes it, from the checkpoint as saved (Moonshot's names)."""
    from safetensors.torch import load_file

    hp = hf.config.to_dict()
    hf.save_pretrained(path.parent / "hf")
    state = load_file(path.parent / "hf" / "model.safetensors")
    w = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.KIMI_LINEAR])
    _keys(w, hp)
    add_mini_vocab(w, "default")
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.KIMI_LINEAR, hp["num_hidden_layers"])
    out: dict[str, torch.Tensor] = {}
    experts: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    for name, t in state.items():
        if match := re.match(r"model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.(w\d)\.weight$", name):
            experts.setdefault((int(match[1]), match[3]), {})[int(match[2])] = t
            continue
        if name.endswith(("q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight")):
            t = t.reshape(1, t.shape[0], 1, t.shape[-1])
        if name.endswith(".A_log"):
            t = -torch.exp(t)
        name = name.replace("e_score_correction_bias", "e_score_correction.bias")  # (TextModel's, for every model)
        if name.endswith(".dt_bias"):
            name = name.removesuffix(".dt_bias") + ".dt_proj.bias"
        if name.endswith("kv_b_proj.weight"):
            heads, v, nope = hp["num_key_value_heads"], hp["v_head_dim"], hp["qk_nope_head_dim"]
            k_b, v_b = torch.split(t.view(heads, v + nope, t.shape[-1]), [nope, v], dim=1)
            out[name.replace("kv_b_proj", "k_b_proj")] = k_b.transpose(1, 2)
            out[name.replace("kv_b_proj", "v_b_proj")] = v_b
            continue
        # (Moonshot's release names its dense MLPs `mlp.`, which TensorNameMap maps; transformers saves them under
        # block_sparse_moe.)
        out[re.sub(r"block_sparse_moe\.(\w+_proj)\.", r"mlp.\1.", name)] = t
    for name, t in out.items():
        base, suffix = name.rsplit(".", 1) if not name.endswith("A_log") else (name, "")
        gguf_name = names.get_name(name) or f"{names.get_name(base)}.{suffix}"
        w.add_tensor(gguf_name, np.ascontiguousarray(t.float().numpy()))
    for (layer, wid), by_expert in experts.items():
        kind = dict(_EXPERTS)[wid]
        stacked = torch.stack([by_expert[i] for i in sorted(by_expert)])
        w.add_tensor(f"{gguf.TENSOR_NAMES[kind].format(bid=layer)}.weight", stacked.float().numpy())
    finish_writer(w)


def test_kimi_linear_gguf_matches_transformers(tmp_path):
    hf = build_hf_model("kimi_linear", **_BUILD)
    write_kimi_linear(hf, tmp_path / "k.gguf")
    loaded = load_model(tmp_path / "k.gguf", "float32")
    c, reader, cfg = loaded.config, loaded.checkpoint.reader, hf.config
    assert c.architecture == "kimi_linear" and c.linear_variant == "kda"
    assert c.layer_types == list(cfg.layer_types) and not any(c.rope_layers)
    assert (c.linear_num_value_heads, c.linear_value_head_dim, c.linear_conv_kernel_dim) == (2, 16, 3)
    assert (c.q_lora_rank, c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim) == (32, 32, 16, 8, 16)
    assert c.num_kv_heads == c.num_heads == 4 and c.mlp_only_layers == [0] and c.n_group == 1
    assert c.routed_scaling_factor == pytest.approx(1.5) and c.router_bias and c.norm_topk_prob
    assert reader.gguf_names("model.layers.0.self_attn.q_conv1d.weight") == ["blk.0.ssm_conv1d_q.weight"]
    from safetensors.torch import load_file

    saved = load_file(tmp_path / "hf" / "model.safetensors")  # Moonshot's names, as keel's
    for part in ("A_log", "dt_bias", "k_conv1d.weight", "f_b_proj.weight", "o_norm.weight"):
        name = f"model.layers.2.self_attn.{part}"
        torch.testing.assert_close(reader.get(name), saved[name], rtol=1e-6, atol=0)
    with torch.no_grad():
        assert rel_err(hf(TOKENS).logits, loaded.model(TOKENS)) <= 1e-4
    from keel.weights.convert import convert

    out = convert(tmp_path / "k.gguf", tmp_path / "back", dtype="float32")  # the HF checkpoint back (A_log to 1e-6)
    written = {k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(f).items()}
    assert set(written) == set(saved)
    for key, tensor in saved.items():
        torch.testing.assert_close(written[key], tensor, rtol=1e-6, atol=1e-6)


def test_kimi_linear_gguf_without_per_layer_kv_heads_is_refused(tmp_path):
    hf = build_hf_model("kimi_linear", **_BUILD)
    path = tmp_path / "k.gguf"
    write_kimi_linear(hf, path)
    key = gguf.Keys.Attention.HEAD_COUNT_KV.format(arch="kimi-linear")
    rewritten_gguf(path, tmp_path / "bad.gguf", key, 1)
    with pytest.raises(ConfigError, match="head_count_kv"):
        load_model(tmp_path / "bad.gguf", "float32")


@pytest.mark.slow
def test_kimi_linear_gguf_greedy_tokens_match_transformers(tmp_path):
    """The KDA states and latent-attention cache step by step from the file: transformers' greedy tokens."""
    hf = build_hf_model("kimi_linear", **_BUILD)
    write_kimi_linear(hf, tmp_path / "k.gguf")
    assert_gguf_greedy_tokens_match(hf, tmp_path / "k.gguf")
