"""GGUF files of the families keel serves beyond Llama/Qwen (keel.weights.gguf): Granite, Phi-3, OLMo 2,
Gemma 2, Gemma 3, StableLM (2 12B's per-head q/k norms too), GPT-NeoX, SmolLM3, StarCoder2, EXAONE 4, Command R
(R+'s per-head q/k norms too), Cohere 2, GPT-OSS, GLM-4 (dense and
MoE), dots.llm1, ERNIE 4.5 (dense and MoE), DeepSeek-V2 / V3, LFM2 (dense and MoE), Qwen3.5, Qwen3.5 MoE, Qwen3-Next,
Granite 4.0-H, Falcon-H1 and Nemotron-H; the text models of Qwen2-VL, Qwen3-VL and Qwen3-VL-MoE.

Each tiny HF model is written the way llama.cpp's convert_hf_to_gguf.py writes its architecture
(tests/test_gguf.py's `write_gguf`: llama.cpp names, Granite's q/k rows permuted as Llama's, Phi-3's
fused attn_qkv and ffn_up kept fused, OLMo 2's output norms, Gemma's norms plus 1, GPT-NeoX's q/k/v
regrouped from per head to all q, all k, all v; the others by a writer of their own, e.g. LFM2's layer kinds as
per-layer KV head counts and its conv weight squeezed, Qwen3.5's value heads tiled, A_log as -exp(A_log) and norms
plus 1), loaded by keel and compared with transformers running the original HF weights. Families keel does not
read from GGUF are refused by name.
"""

from __future__ import annotations

import re

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from keel.errors import ConfigError
from keel.quant.loading import load_model
from keel.weights.gguf import ARCHITECTURES, open_gguf
from test_gguf import TOKENS, add_mini_vocab, build_hf, rel_err, transformers_from_gguf, write_gguf
from tiny_models import build_hf_model

pytest.importorskip("transformers")


@pytest.mark.parametrize("name", ["granite", "granitemoe", "granitemoeshared", "phi3", "olmo2"])
def test_family_gguf_matches_hf_model(tmp_path, name):
    hf = build_hf(name)
    path = write_gguf(hf, tmp_path / f"{name}.gguf")
    loaded = load_model(path)
    c = loaded.config
    assert c.architecture == name and (c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (2, 4, 2, 16)
    if name == "granitemoeshared":  # llama.cpp's granitemoe architecture, with the shared expert's tensors
        assert c.shared_expert_intermediate_size == 48 and not c.shared_expert_gated
        assert loaded.checkpoint.reader.gguf_names("model.layers.1.mlp.shared_expert.down_proj.weight") == [
            "blk.1.ffn_down_shexp.weight"
        ]
    if name.startswith("granitemoe"):  # Granite's scalars around experts split into gate and up, stacked again
        assert (c.embedding_multiplier, c.residual_multiplier, c.attention_scale, c.logits_scaling) == (
            12.0,
            0.22,
            0.09,
            4.0,
        )
        assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size, c.router_scoring) == (
            8,
            2,
            32,
            "topk_softmax",
        )
        assert loaded.checkpoint.reader.gguf_names("model.layers.1.mlp.experts.gate_up_proj") == [
            "blk.1.ffn_gate_exps.weight",
            "blk.1.ffn_up_exps.weight",
        ]
    if name == "granite":
        assert (c.embedding_multiplier, c.residual_multiplier, c.attention_scale, c.logits_scaling) == (
            12.0,
            0.22,
            0.09,
            4.0,
        )
        assert c.qkv_bias and c.o_bias and c.mlp_bias
    if name == "phi3":
        assert c.sliding_window == 8 and set(c.layer_types) == {"sliding_attention"}
        assert loaded.checkpoint.reader.gguf_names("model.layers.0.self_attn.k_proj.weight") == [
            "blk.0.attn_qkv.weight"
        ]
    if name == "olmo2":
        assert (c.norm_placement, c.qk_norm, c.qk_norm_scope) == ("post", True, "all")
        reader = loaded.checkpoint.reader
        assert reader.gguf_names("model.layers.1.attn_output_norm.weight") == ["blk.1.post_attention_norm.weight"]
        assert reader.gguf_names("model.layers.1.mlp_output_norm.weight") == ["blk.1.post_ffw_norm.weight"]
    with torch.no_grad():
        assert rel_err(hf(TOKENS).logits, loaded.model(TOKENS)) <= 1e-4


def test_smollm3_gguf_takes_llama_cpps_nope_layers(tmp_path):
    """SmolLM3 as llama.cpp converts it (LlamaModel: q/k rows permuted; no key for the NoPE layers, which
    llama.cpp places every fourth): the fourth of four layers attends without position encoding, and the logits
    are transformers' on the HF weights."""
    hf = build_hf_model("smollm3", num_hidden_layers=4, no_rope_layer_interval=4, use_sliding_window=False)
    loaded = load_model(write_gguf(hf, tmp_path / "smollm3.gguf"))
    c = loaded.config
    assert c.architecture == "smollm3" and c.rope_layers == [True, True, True, False]
    assert loaded.checkpoint.provenance["rope_layers"] == "inferred"
    assert c.qkv_bias and c.o_bias and c.mlp_bias and c.sliding_window is None
    with torch.no_grad():
        assert rel_err(hf(TOKENS).logits, loaded.model(TOKENS)) <= 1e-4


def test_starcoder2_gguf_matches_hf_model(tmp_path):
    """StarCoder2 as llama.cpp converts it (TextModel: no permutation; LayerNorm eps under
    attention.layer_norm_epsilon; c_fc / c_proj as ffn_up / ffn_down with their biases; no window key, and
    llama.cpp attends over the whole context): transformers' logits on a model without a window."""
    hf = build_hf_model(
        "starcoder2", num_hidden_layers=2, sliding_window=None, norm_epsilon=1e-4, tie_word_embeddings=False
    )
    loaded = load_model(write_gguf(hf, tmp_path / "starcoder2.gguf"))
    c = loaded.config
    assert (c.architecture, c.norm_type, c.mlp_gated, c.hidden_act) == ("starcoder2", "layer", False, "gelu_tanh")
    assert c.qkv_bias and c.o_bias and c.mlp_bias and c.sliding_window is None and not c.tie_word_embeddings
    assert c.rms_norm_eps == pytest.approx(1e-4) and loaded.checkpoint.provenance["rms_norm_eps"] == "read"
    with torch.no_grad():
        assert rel_err(hf(TOKENS).logits, loaded.model(TOKENS)) <= 1e-4


@pytest.mark.parametrize("window", [8, None])
def test_exaone4_gguf_matches_hf_model(tmp_path, window):
    """EXAONE 4 as llama.cpp converts it (TextModel: no permutation; output norms as post_attention_norm and
    post_ffw_norm; the window and the per-layer pattern as keys where config.json has a window): hybrid, the global
    layer without position encoding; without a window every layer global and rotating. transformers' logits."""
    layer_types = ["sliding_attention", "full_attention", "sliding_attention"]
    # (transformers' Exaone4Config needs layer_types without a window: its own default divides by zero)
    hf = build_hf_model("exaone4", sliding_window=window, layer_types=layer_types if window else ["full_attention"] * 3)
    loaded = load_model(write_gguf(hf, tmp_path / "exaone4.gguf"))
    c = loaded.config
    assert (c.architecture, c.norm_placement, c.qk_norm, c.qk_norm_scope) == ("exaone4", "post", True, "head")
    if window:
        assert c.sliding_window == 8 and c.layer_types == layer_types and c.rope_layers == [True, False, True]
        assert loaded.checkpoint.provenance["rope_layers"] == "read"
    else:
        assert c.sliding_window is None and all(c.layer_rotates(i) for i in range(c.num_layers))
    with torch.no_grad():
        assert rel_err(hf(TOKENS).logits, loaded.model(TOKENS)) <= 1e-4


@pytest.mark.parametrize("name", ["cohere", "cohere-qk-norm", "cohere2"])
def test_command_r_gguf_matches_hf_model(tmp_path, name):
    """Command R and Cohere 2 as llama.cpp converts them (TextModel: q/k rows as in HF, interleaved pairs regrouped
    by keel as for safetensors; LayerNorm eps and logit_scale keys; Cohere 2's window key, one global layer in
    four without position encoding): transformers' logits."""
    layers = dict(num_hidden_layers=4, layer_types=None) if name == "cohere2" else dict(num_hidden_layers=2)
    hf = build_hf_model(name, **layers)
    loaded = load_model(write_gguf(hf, tmp_path / f"{name}.gguf"))
    c = loaded.config
    assert c.architecture == name.removesuffix("-qk-norm") and c.norm_type == "layer" and c.parallel_residual
    if name == "cohere-qk-norm":  # Command R+'s q/k LayerNorms, a weight per head ([head_dim, heads] in ggml order)
        assert (c.qk_norm, c.qk_norm_scope, c.qk_norm_type) == (True, "each_head", "layer")
        k_norm = "model.layers.1.self_attn.k_norm.weight"
        assert loaded.checkpoint.reader.gguf_names(k_norm) == ["blk.1.attn_k_norm.weight"]
        order = [*range(0, 16, 2), *range(1, 16, 2)]  # keel's rotary order of each head's channels
        assert torch.equal(loaded.checkpoint.reader.get(k_norm), hf.state_dict()[k_norm][:, order])
    assert c.logits_scaling == pytest.approx(4.0) and loaded.checkpoint.provenance["logits_scaling"] == "read"
    if name == "cohere2":
        assert c.sliding_window == 8 and c.rope_layers == [True, True, True, False]
    with torch.no_grad():
        assert rel_err(hf(TOKENS).logits, loaded.model(TOKENS)) <= 1e-4
    # A tensor-parallel rank's rows (two of four heads) and a column shard of the regrouped q, read alone.
    from keel.weights.shard import Shard, narrow

    reader, q = loaded.checkpoint.reader, "model.layers.0.self_attn.q_proj.weight"
    for shard in (Shard(0, 32, 64), Shard(1, 32, 64)):
        assert torch.equal(reader.get_shard(q, shard), narrow(reader.get(q), shard))


def test_phi3_fused_tensors_are_split_by_rows(tmp_path):
    """Phi-3's attn_qkv [q; k; v] and ffn_up [gate; up] (rows in HF order), each part read from its own rows,
    whole, as a row shard and as Q8_0 blocks (the rows of a quantized tensor are whole blocks)."""
    from keel.weights.shard import Shard

    hf = build_hf("phi3")
    path = write_gguf(hf, tmp_path / "phi3.gguf", qtype=Q.Q8_0)
    reader = open_gguf(path).reader
    state = hf.state_dict()
    qkv = state["model.layers.0.self_attn.qkv_proj.weight"]
    k = reader.get("model.layers.0.self_attn.k_proj.weight")
    assert k.shape == (32, 64) and torch.nn.functional.cosine_similarity(k.flatten(), qkv[64:96].flatten(), 0) > 0.999
    whole = reader.get("model.layers.0.mlp.up_proj.weight")
    assert torch.equal(reader.get_shard("model.layers.0.mlp.up_proj.weight", Shard(0, 32, 96)), whole[32:96])
    assert torch.equal(reader.get_shard("model.layers.0.mlp.up_proj.weight", Shard(1, 32, 64)), whole[:, 32:64])
    blocks = reader.get_blocks("model.layers.0.mlp.up_proj.weight")
    rebuilt = blocks.codes.float() * blocks.scales.repeat_interleave(32, dim=1)
    assert torch.equal(rebuilt, whole)


def test_phi3_gguf_without_window_matches_transformers_gguf_loader(tmp_path):
    """The writer's Phi-3 conventions are transformers' reading of llama.cpp's too (transformers' GGUF
    loader reads no sliding window: the model here has none)."""
    hf = build_hf_model("phi3", 0, num_hidden_layers=2, sliding_window=None)
    path = write_gguf(hf, tmp_path / "phi3.gguf")
    with torch.no_grad():
        theirs = transformers_from_gguf(path)(TOKENS).logits
        assert rel_err(hf(TOKENS).logits, theirs) <= 1e-5
        assert rel_err(theirs, load_model(path).model(TOKENS)) <= 1e-4


# The families llama.cpp's converter writes with their own conventions. llama.cpp takes Gemma's softmax scale
# from the head size (no key), so the models here have query_pre_attn_scalar == head_dim; Gemma 3 has llama.cpp's
# layer pattern (five sliding layers, then a global one: its converter writes no pattern).
NEW_FAMILIES = {
    "gemma": dict(num_hidden_layers=2),
    "gemma2": dict(num_hidden_layers=2, query_pre_attn_scalar=16),
    "gemma3": dict(num_hidden_layers=6, layer_types=None, query_pre_attn_scalar=16),
    "stablelm": dict(num_hidden_layers=2),
    "stablelm-parallel": dict(num_hidden_layers=2),
    "stablelm-qk-norm": dict(num_hidden_layers=2),
    "gpt_neox": dict(num_hidden_layers=2),
    "phi": dict(num_hidden_layers=2),
}


def build_new(name: str):
    return build_hf_model(name, 0, **NEW_FAMILIES[name])


@pytest.mark.parametrize("name", list(NEW_FAMILIES))
def test_gemma_stablelm_gptneox_gguf_matches_hf_model(tmp_path, name):
    hf = build_new(name)
    loaded = load_model(write_gguf(hf, tmp_path / f"{name}.gguf"))
    c, reader = loaded.config, loaded.checkpoint.reader
    assert c.architecture == name.removesuffix("-parallel").removesuffix("-qk-norm")
    if name == "gemma":  # (1 + w) norms stored plus 1 (Llama's names), the tanh GELU, the head tied
        assert (c.norm_weight_offset, c.attention_scale, c.embedding_multiplier) == (1.0, None, 8.0)
        assert c.tie_word_embeddings and c.hidden_act == "gelu_tanh" and c.head_dim == 16
        norm = "model.layers.1.post_attention_layernorm.weight"
        assert reader.gguf_names(norm) == ["blk.1.ffn_norm.weight"]
        assert torch.allclose(reader.get(norm), hf.state_dict()[norm], atol=1e-6)
    if name in ("gemma2", "gemma3"):
        assert (c.norm_weight_offset, c.attention_scale, c.embedding_multiplier) == (1.0, 0.25, 8.0)
        assert c.sliding_window == 8 and c.tie_word_embeddings and c.final_logit_softcapping == 30.0
        # The file's norms are HF's plus 1; keel reads HF's.
        norm = "model.layers.1.post_attention_layernorm.weight"
        assert reader.gguf_names("model.layers.1.attn_output_norm.weight") == ["blk.1.post_attention_norm.weight"]
        assert torch.allclose(reader.get("model.layers.1.attn_output_norm.weight"), hf.state_dict()[norm], atol=1e-6)
    if name == "gemma2":
        assert c.attn_logit_softcapping == 5.0 and c.layer_types == ["sliding_attention", "full_attention"]
        assert c.rope_theta == 10000.0 and loaded.checkpoint.provenance["rope_theta"] == "default"
    if name == "gemma3":
        assert c.layer_types == ["sliding_attention"] * 5 + ["full_attention"] and c.qk_norm
        assert (c.rope_theta, c.rope_scaling.type, c.rope_scaling.factor, c.sliding_rope_theta) == (
            100000.0,
            "linear",
            2.0,
            5000.0,
        )
    if name == "stablelm-qk-norm":  # StableLM 2 12B's LayerNorm per head, stacked by the converter as by keel
        assert (c.qk_norm, c.qk_norm_scope, c.qk_norm_type, c.num_kv_heads) == (True, "each_head", "layer", 2)
        assert reader.gguf_names("model.layers.1.self_attn.q_norm.weight") == ["blk.1.attn_q_norm.weight"]
        heads = [hf.state_dict()[f"model.layers.1.self_attn.q_layernorm.norms.{i}.weight"] for i in range(4)]
        assert torch.equal(reader.get("model.layers.1.self_attn.q_norm.weight"), torch.stack(heads))
    if name.startswith("stablelm"):
        parallel = name == "stablelm-parallel"
        assert (c.norm_type, c.norm_bias, c.parallel_residual, c.post_attention_norm) == (
            "layer",
            True,
            parallel,
            not parallel,
        )
        assert c.partial_rotary_factor == (0.25 if parallel else 0.5) and c.qkv_bias == (name == "stablelm")
    if name == "phi":  # one LayerNorm, a parallel residual, 6 of 16 channels rotating, the head's bias
        assert (c.norm_type, c.parallel_residual, c.post_attention_norm, c.rotary_dim) == ("layer", True, False, 6)
        assert c.lm_head_bias and reader.gguf_names("lm_head.bias") == ["output.bias"]
        assert reader.gguf_names("model.layers.0.self_attn.o_proj.weight") == ["blk.0.attn_output.weight"]
    if name == "gpt_neox":
        assert (c.parallel_residual, c.partial_rotary_factor, c.mlp_gated, c.hidden_act) == (True, 0.25, False, "gelu")
        assert (c.num_kv_heads, c.qkv_bias, c.o_bias, c.mlp_bias, c.tie_word_embeddings) == (4, True, True, True, False)
        assert reader.gguf_names("model.layers.0.self_attn.k_proj.weight") == ["blk.0.attn_qkv.weight"]
    with torch.no_grad():
        assert rel_err(hf(TOKENS).logits, loaded.model(TOKENS)) <= 1e-4


@pytest.mark.parametrize("name", ["phi3", "olmo2", "gpt_neox", "gemma2", "stablelm-qk-norm"])
def test_keel_convert_of_the_gguf_gives_back_the_hf_tensors(tmp_path, name):
    """GGUF -> HF safetensors (`keel convert`): the family's fused and renamed tensors as HF stores them
    (GPT-NeoX's q/k/v interleaved per head again; Gemma's norms less the converter's 1, to float32 rounding;
    StableLM 2 12B's per-head q/k norms as a LayerNorm per head again)."""
    from safetensors.torch import load_file

    from keel.weights.convert import convert

    hf = build_new(name) if name in NEW_FAMILIES else build_hf(name)
    out = convert(write_gguf(hf, tmp_path / f"{name}.gguf"), tmp_path / "hf", dtype="float32")
    written = {k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(f).items()}
    if "embed_out.weight" in written:  # the Pythia checkpoints' head name, which transformers 5 loads as lm_head
        written["lm_head.weight"] = written.pop("embed_out.weight")
    expected = {k: v for k, v in hf.state_dict().items() if not (name == "gemma2" and k == "lm_head.weight")}
    assert set(written) == set(expected)
    same = (lambda a, b: torch.allclose(a, b, rtol=0, atol=1e-6)) if name == "gemma2" else torch.equal
    assert all(same(written[k], expected[k]) for k in expected)


@pytest.mark.parametrize("arch", ["baichuan", "refact", "orion"])
def test_families_not_read_from_gguf_are_refused(tmp_path, arch):
    path = tmp_path / f"{arch}.gguf"
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ConfigError) as e:
        open_gguf(path)
    message = str(e.value)
    assert "\n" not in message and repr(arch) in message
    assert ", ".join(ARCHITECTURES) in message and "gemma3" in message and "gptneox" in message


def text_model_writer(cfg, path, arch: gguf.MODEL_ARCH, blocks: int | None = None, kv_heads: int | None = None):
    """A GGUFWriter holding the metadata llama.cpp's TextModel writes for every architecture (`blocks`: the block
    count where it is not the layer count; `kv_heads`: the KV head count written, where not the config's)."""
    w = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    w.add_block_count(cfg.num_hidden_layers if blocks is None else blocks)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    if getattr(cfg, "intermediate_size", None) is not None:  # written where config.json has it
        w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads if kv_heads is None else kv_heads)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    if hasattr(cfg, "rms_norm_eps"):  # (LFM2's is norm_eps, which its converter writes)
        w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    return w


def finish_writer(w) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def rewritten_gguf(path, out, key: str, value) -> None:
    """The GGUF file at `path` copied to `out` with metadata `key` set to `value` (a list, or an unsigned
    integer): a file a converter could have written otherwise, for the readers' refusals."""
    reader = gguf.GGUFReader(str(path))
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    w = gguf.GGUFWriter(str(out), arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in (gguf.Keys.General.ARCHITECTURE, key):
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub)
    w.add_array(key, value) if isinstance(value, list) else w.add_uint32(key, value)
    for t in reader.tensors:
        w.add_tensor(t.name, np.array(t.data).reshape(tuple(reversed([int(d) for d in t.shape]))))
    finish_writer(w)


def assert_gguf_greedy_tokens_match(hf, path) -> None:
    """keel's model read from the GGUF at `path` decodes 12 greedy tokens after an 8-token prompt, step by step
    through its caches and states, as transformers' `hf` does."""
    from keel.serve.sampling import SamplingParams
    from reference_generate import stream_tokens

    model = load_model(path, "float32").model
    prompt = TOKENS[0, :8].tolist()
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, pad_token_id=0)
    ours = list(stream_tokens(model, prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)))
    assert ours == expected[0, 8:].tolist()


def write_gpt_oss_gguf(hf, path, experts: Q = Q.F32):
    """A GPT-OSS model as llama.cpp's GptOssModel converter writes it (then `llama-quantize` for `experts`):
    metadata of TextModel plus the window and the expert width, YaRN's keys, the o200k pre-tokenizer; gate and
    up split from transformers' interleaved gate_up_proj (weights transposed to [E, I, H], biases [E, I]), down
    transposed, sinks as `attn_sinks.weight`, the router as `ffn_gate_inp`. Returns the experts' weights as the
    file holds them (dequantized), in transformers' layout, for the reference."""

    cfg = hf.config
    rope = cfg.rope_parameters
    w = gguf.GGUFWriter(str(path), "gpt-oss")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    if getattr(cfg, "intermediate_size", None) is not None:  # written where config.json has it
        w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_expert_count(cfg.num_local_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(rope["factor"])
    w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
    w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    w.add_sliding_window(cfg.sliding_window)
    w.add_expert_feed_forward_length(cfg.intermediate_size)
    w.add_vocab_size(cfg.vocab_size)
    add_mini_vocab(w, "gpt-4o")
    w.add_bos_token_id(1)
    stored: dict[str, torch.Tensor] = {}

    def add(name: str, t: torch.Tensor, kind: Q = Q.F32) -> torch.Tensor:
        a = np.ascontiguousarray(t.detach().float().numpy())
        if kind == Q.F32:
            w.add_tensor(name, a)
            return t
        blocks = gguf.quants.quantize(a, kind)
        w.add_tensor(name, blocks, raw_dtype=kind)
        return torch.from_numpy(gguf.quants.dequantize(blocks, kind).reshape(a.shape))

    names = {
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "post_attention_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.router": "ffn_gate_inp",
    }
    for hf_name, t in hf.state_dict().items():
        if hf_name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            add({"model.embed_tokens.weight": "token_embd", "model.norm.weight": "output_norm"}.get(
                hf_name, "output") + ".weight", t)  # fmt: skip
            continue
        layer, rest = re.match(r"model\.layers\.(\d+)\.(.+)$", hf_name).groups()
        blk = f"blk.{layer}"
        if rest == "self_attn.sinks":
            add(f"{blk}.attn_sinks.weight", t)
        elif rest == "mlp.experts.gate_up_proj":  # [E, H, 2I] -> gate / up [E, I, H]
            rows = t.transpose(1, 2)
            gate = add(f"{blk}.ffn_gate_exps.weight", rows[:, ::2], experts)
            up = add(f"{blk}.ffn_up_exps.weight", rows[:, 1::2], experts)
            stored[hf_name] = torch.stack([gate, up], dim=2).flatten(1, 2).transpose(1, 2)
        elif rest == "mlp.experts.gate_up_proj_bias":
            add(f"{blk}.ffn_gate_exps.bias", t[:, ::2])
            add(f"{blk}.ffn_up_exps.bias", t[:, 1::2])
        elif rest == "mlp.experts.down_proj":  # [E, I, H] -> [E, H, I]
            stored[hf_name] = add(f"{blk}.ffn_down_exps.weight", t.transpose(1, 2), experts).transpose(1, 2)
        elif rest == "mlp.experts.down_proj_bias":
            add(f"{blk}.ffn_down_exps.bias", t)
        else:
            module, suffix = rest.rsplit(".", 1)
            add(f"{blk}.{names[module]}.{suffix}", t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored


@pytest.mark.parametrize("experts", [Q.F32, Q.MXFP4])
def test_gpt_oss_gguf_matches_hf_model(tmp_path, experts):
    """GPT-OSS as llama.cpp converts it, with float experts or MXFP4 ones (as gpt-oss GGUFs ship them): the config
    from metadata (sinks, biases, the window on even layers, YaRN unrounded as transformers' GptOssConfig), and
    transformers' logits on the weights the file holds."""
    hf = build_hf_model("gpt_oss", num_hidden_layers=2)
    stored = write_gpt_oss_gguf(hf, tmp_path / "gpt-oss.gguf", experts)
    loaded = load_model(tmp_path / "gpt-oss.gguf")
    c = loaded.config
    assert (c.architecture, c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size) == ("gpt_oss", 8, 2, 32)
    assert c.attention_sinks and c.expert_bias and c.router_linear_bias and c.qkv_bias and c.o_bias
    assert c.layer_types == ["sliding_attention", "full_attention"] and c.sliding_window == 8
    assert (c.rope_scaling.type, c.rope_scaling.factor, c.rope_scaling.truncate) == ("yarn", 32.0, False)
    with torch.no_grad():
        for name, weight in stored.items():
            hf.get_parameter(name).copy_(weight)
        assert rel_err(hf(TOKENS).logits, loaded.model(TOKENS)) <= 1e-4
    if experts != Q.MXFP4:
        return
    # Run as stored (keel's default on CPU): MXFP4 as int8 codes (twice each FP4 value) with power-of-two scales,
    # exact; the same greedy tokens as the dequantized path.
    from keel.quant.experts import QuantizedGroupedExperts
    from keel.quant.loading import resolve_scheme
    from keel.serve import LLM, EngineConfig, SamplingParams

    assert resolve_scheme(loaded.checkpoint, "auto") == "gguf"
    blocks = loaded.checkpoint.reader.get_blocks("model.layers.0.mlp.experts.down_proj")
    exact = blocks.codes.float() * blocks.scales.repeat_interleave(32, dim=-1)
    assert torch.equal(exact, loaded.checkpoint.reader.get("model.layers.0.mlp.experts.down_proj"))
    prompt, greedy = TOKENS[0, :20].tolist(), SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    tokens = {}
    for quantize in ("auto", "none"):
        options = dict(num_blocks=32, block_size=8, max_model_len=128, quantize=quantize, dtype="float32")
        llm = LLM(str(tmp_path / "gpt-oss.gguf"), EngineConfig.of(**options))
        experts_module = llm.engine.model.layers["1"].mlp.experts
        assert isinstance(experts_module, QuantizedGroupedExperts) == (quantize == "auto")
        tokens[quantize] = llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids
    assert tokens["auto"] == tokens["none"]


def test_gpt4o_pre_tokenizer_splits_as_o200k(tmp_path):
    """The o200k pre-tokenizer (`gpt-4o`, GPT-OSS's GGUF files): words split at capitals, numbers in threes,
    contractions kept with their word."""
    hf = build_hf_model("gpt_oss", num_hidden_layers=1)
    write_gpt_oss_gguf(hf, tmp_path / "gpt-oss.gguf")
    tokenizer = open_gguf(tmp_path / "gpt-oss.gguf").tokenizer
    pre = tokenizer.tokenizer.pre_tokenizer.pre_tokenize_str
    assert [piece for piece, _ in pre("HelloWorld 12345 don't")] == ["Hello", "World", "Ġ", "123", "45", "Ġdon't"]


def test_phi3_longrope_gguf_matches_hf_model(tmp_path):
    """Phi-3.5 / Phi-4-mini's LongRoPE as Phi3MiniModel converts it (rope_factors_long / rope_factors_short
    tensors, the pre-training context and cos/sin factor as keys): transformers' logits within the pre-training
    context (short factors) and beyond it (long ones)."""
    hf = build_hf_model("phi3-longrope", num_hidden_layers=2)
    loaded = load_model(write_gguf(hf, tmp_path / "phi3.gguf"))
    scaling = loaded.config.rope_scaling
    assert (scaling.type, scaling.original_max_position_embeddings, scaling.factor) == ("longrope", 16, 4.0)
    assert scaling.long_factor == tuple(hf.config.rope_parameters["long_factor"])
    for length in (12, 40):
        tokens = torch.randint(0, 256, (2, length), generator=torch.Generator().manual_seed(length))
        with torch.no_grad():
            assert rel_err(hf(tokens).logits, loaded.model(tokens)) <= 1e-4, length


def write_glm4_moe_gguf(hf, path, mtp_layers: int = 1, arch: gguf.MODEL_ARCH = gguf.MODEL_ARCH.GLM4_MOE) -> None:
    """GLM-4.5 as llama.cpp's Glm4MoeModel converter writes it: TextModel's metadata plus the rotary width (half
    of each head), the experts' count, width, shared count, leading dense layers, sigmoid gating, scale and
    normalisation; block_count counting the multi-token-prediction layers after the last (here placeholders that
    keel must not read); gate and up experts apart, the selection bias as `exp_probs_b.bias`; other names by
    gguf's TensorNameMap, as the converter maps them. `arch` DOTS1: Dots1Model's (Qwen2MoeModel's metadata, whole
    heads rotating, no gating, group or MTP keys)."""

    cfg = hf.config
    layers = cfg.num_hidden_layers
    glm = arch == gguf.MODEL_ARCH.GLM4_MOE
    mtp_layers = mtp_layers if glm else 0
    w = text_model_writer(cfg, path, arch, blocks=layers + mtp_layers)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if glm:  # TextModel writes the key length where config.json has head_dim
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    if glm:
        w.add_rope_dimension_count(int(head_dim * cfg.rope_parameters.get("partial_rotary_factor", 0.5)))
    w.add_expert_count(cfg.n_routed_experts)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_expert_shared_count(cfg.n_shared_experts)
    w.add_leading_dense_block_count(cfg.first_k_dense_replace)
    if glm:
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_expert_weights_scale(cfg.routed_scaling_factor)
    w.add_expert_weights_norm(cfg.norm_topk_prob)
    if glm:
        w.add_nextn_predict_layers(mtp_layers)
    add_mini_vocab(w, "glm4")
    names = gguf.get_tensor_name_map(arch, layers + mtp_layers)

    def add(name: str, t: torch.Tensor) -> None:
        w.add_tensor(name, np.ascontiguousarray(t.detach().float().numpy()))

    for hf_name, t in hf.state_dict().items():
        blk = "blk." + hf_name.split(".")[2] if ".layers." in hf_name else ""
        if hf_name.endswith("mlp.experts.gate_up_proj"):  # [E, 2I, H]: gate rows, then up rows
            gate, up = t.chunk(2, dim=1)
            add(f"{blk}.ffn_gate_exps.weight", gate)
            add(f"{blk}.ffn_up_exps.weight", up)
        elif hf_name.endswith("mlp.experts.down_proj"):
            add(f"{blk}.ffn_down_exps.weight", t)
        elif hf_name.endswith("e_score_correction_bias"):  # the converter's rename, then TensorNameMap
            add(names.get_name(hf_name.removesuffix("_bias")) + ".bias", t)
        else:
            base, suffix = hf_name.rsplit(".", 1)
            add(f"{names.get_name(base)}.{suffix}", t)
    for layer in range(layers, layers + mtp_layers):  # a multi-token-prediction block keel does not read
        add(f"blk.{layer}.attn_norm.weight", torch.ones(cfg.hidden_size))
        add(f"blk.{layer}.nextn.eh_proj.weight", torch.zeros(cfg.hidden_size, 2 * cfg.hidden_size))
    finish_writer(w)


def test_glm4_moe_gguf_matches_hf_model(tmp_path):
    """GLM-4.5 as llama.cpp converts it: DeepSeek-V3's router from the expert keys and `exp_probs_b`, the shared
    expert, the dense first layer, half of each head rotating, the multi-token-prediction layer skipped, the glm4
    pre-tokenizer; transformers' logits."""
    hf = build_hf_model("glm4_moe", n_group=1, topk_group=1)  # GLM-4.5's: the converter writes no group keys
    write_glm4_moe_gguf(hf, tmp_path / "glm.gguf")
    loaded = load_model(tmp_path / "glm.gguf")
    c = loaded.config
    assert (c.architecture, c.num_layers, c.num_experts, c.mlp_only_layers) == ("glm4_moe", 3, 8, [0])
    assert (c.router_scoring, c.router_bias, c.routed_scaling_factor, c.partial_rotary_factor) == (
        "sigmoid",
        True,
        1.5,
        0.5,
    )
    assert c.shared_expert_intermediate_size == 32 and not c.shared_expert_gated and c.qk_norm and c.qkv_bias
    with torch.no_grad():
        assert rel_err(hf(TOKENS).logits, loaded.model(TOKENS)) <= 1e-4


def write_ernie_gguf(hf, path) -> None:
    """ERNIE 4.5 (dense or MoE) as llama.cpp's Ernie4_5Model / Ernie4_5MoeModel converters write it: q/k rows as in
    HF (llama.cpp rotates interleaved pairs; keel regroups them as from safetensors), TextModel's metadata, and for
    MoE the expert count, used count, width, shared count, leading dense blocks and interleave step; the experts
    stacked per kind, the [1, E] selection bias as `exp_probs_b.bias`; other names by gguf's TensorNameMap."""

    cfg = hf.config
    moe = cfg.model_type == "ernie4_5_moe"
    arch = gguf.MODEL_ARCH.ERNIE4_5_MOE if moe else gguf.MODEL_ARCH.ERNIE4_5
    w = text_model_writer(cfg, path, arch)
    if moe:
        w.add_expert_count(cfg.moe_num_experts)
        w.add_expert_used_count(cfg.moe_k)
        w.add_interleave_moe_layer_step(cfg.moe_layer_interval)
        w.add_leading_dense_block_count(cfg.moe_layer_start_index)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        w.add_expert_shared_count(cfg.moe_num_shared_experts)
    add_mini_vocab(w, "default")
    names = gguf.get_tensor_name_map(arch, cfg.num_hidden_layers)

    def add(name: str, t: torch.Tensor) -> None:
        w.add_tensor(name, np.ascontiguousarray(t.detach().float().numpy()))

    from safetensors.torch import load_file

    hf.save_pretrained(path.parent / "hf")  # the converter reads the checkpoint as saved (per-expert tensors)
    stacked: dict[str, dict[int, torch.Tensor]] = {}
    for hf_name, t in load_file(path.parent / "hf" / "model.safetensors").items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if ".mlp.experts." in hf_name:  # one tensor each in HF: stacked per layer and kind, as the converter does
            layer, _, _, expert, kind, _ = hf_name.removeprefix("model.layers.").split(".")
            stacked.setdefault(f"blk.{layer}.ffn_{kind.removesuffix('_proj')}_exps.weight", {})[int(expert)] = t
        elif hf_name.endswith("e_score_correction_bias"):
            add(names.get_name(hf_name.removesuffix("_bias")) + ".bias", t)
        else:
            base, suffix = hf_name.rsplit(".", 1)
            add(f"{names.get_name(base)}.{suffix}", t)
    for name, experts in stacked.items():
        add(name, torch.stack([experts[e] for e in sorted(experts)]))
    finish_writer(w)


@pytest.mark.parametrize("name", ["ernie4_5", "ernie4_5_moe"])
def test_ernie_gguf_matches_hf_model(tmp_path, name):
    """ERNIE 4.5 dense and MoE as llama.cpp converts them: interleaved rotary rows regrouped at load, biases and the
    tied head by tensor, and for MoE the dense first layer, the float32 softmax router with its [1, E] selection
    bias, the shared expert; transformers' logits."""
    hf = build_hf_model(name, **({"use_bias": True} if name == "ernie4_5" else {}))
    write_ernie_gguf(hf, tmp_path / f"{name}.gguf")
    loaded = load_model(tmp_path / f"{name}.gguf")
    c = loaded.config
    assert c.architecture == name and c.tie_word_embeddings
    if name == "ernie4_5_moe":
        assert (c.num_experts, c.mlp_only_layers, c.router_bias, c.shared_expert_intermediate_size) == (
            8,
            [0],
            True,
            32,
        )
    else:
        assert c.qkv_bias and c.o_bias and c.mlp_bias
    with torch.no_grad():
        assert rel_err(hf(TOKENS).logits, loaded.model(TOKENS)) <= 1e-4


def test_dots1_gguf_matches_hf_model(tmp_path):
    """dots.llm1 as llama.cpp's Dots1Model converts it (DeepSeek's experts from Qwen-MoE's keys plus the leading
    dense blocks, shared count, weights scale and norm; per-head q/k norms and biases by tensor): transformers'
    logits (groups of one, which dots.llm1 uses and the converter does not write; no sliding layer)."""
    hf = build_hf_model("dots1", n_group=1, topk_group=1, sliding_window=None)
    write_glm4_moe_gguf(hf, tmp_path / "dots.gguf", arch=gguf.MODEL_ARCH.DOTS1)
    loaded = load_model(tmp_path / "dots.gguf")
    c = loaded.config
    assert (c.architecture, c.mlp_only_layers, c.router_scoring, c.router_bias) == ("dots1", [0], "sigmoid", True)
    assert c.qk_norm and c.qkv_bias and c.o_bias and c.shared_expert_intermediate_size == 64
    with torch.no_grad():
        assert rel_err(hf(TOKENS).logits, loaded.model(TOKENS)) <= 1e-4


def write_deepseek2_gguf(hf, path, split_kv_b: bool = True, groups: bool = False, q8: bool = False) -> None:
    """DeepSeek-V2 / V3 as llama.cpp's DeepseekV2Model converter writes them (`deepseek2`). `split_kv_b`: current
    converters' MQA form (one KV head of kv_lora_rank + rope width, the widths as key_length_mla / value_length_mla,
    kv_b_proj split into `attn_k_b` transposed and `attn_v_b`); else older files' (a KV head per query head,
    key_length / value_length, `attn_kv_b` whole, and for V2 no gating key). YaRN as the factor, the pre-training
    context and 0.1 x mscale_all_dim; experts stacked per kind, the selection bias as `exp_probs_b.bias`. `q8`: the
    matrices whose rows split into blocks of 32 stored as Q8_0, the rest as float32, as llama-quantize leaves them."""
    from safetensors.torch import load_file

    cfg = hf.config
    v3 = cfg.model_type == "deepseek_v3"
    arch = gguf.MODEL_ARCH.DEEPSEEK2
    heads, rope, nope, v = cfg.num_attention_heads, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim
    w = text_model_writer(cfg, path, arch, kv_heads=1 if split_kv_b else heads)
    w.add_leading_dense_block_count(cfg.first_k_dense_replace)
    if cfg.q_lora_rank is not None:
        w.add_q_lora_rank(cfg.q_lora_rank)
    w.add_kv_lora_rank(cfg.kv_lora_rank)
    if split_kv_b:
        w.add_key_length(cfg.kv_lora_rank + rope)
        w.add_value_length(cfg.kv_lora_rank)
        w.add_key_length_mla(nope + rope)
        w.add_value_length_mla(v)
    else:
        w.add_key_length(nope + rope)
        w.add_value_length(v)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_expert_count(cfg.n_routed_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_expert_shared_count(cfg.n_shared_experts)
    w.add_expert_weights_scale(cfg.routed_scaling_factor)
    w.add_expert_weights_norm(bool(cfg.norm_topk_prob))
    if v3 or split_kv_b:
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if v3 else gguf.ExpertGatingFuncType.SOFTMAX)
    if groups:
        w.add_expert_group_count(cfg.n_group)
        w.add_expert_group_used_count(cfg.topk_group)
    w.add_rope_dimension_count(rope)
    scaling = cfg.rope_parameters
    if scaling.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(scaling["factor"])
        w.add_rope_scaling_orig_ctx_len(scaling["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_log_mul(0.1 * scaling["mscale_all_dim"])
    add_mini_vocab(w, "deepseek-v3" if v3 else "deepseek-llm")
    names = gguf.get_tensor_name_map(arch, cfg.num_hidden_layers)

    def add(name: str, t: torch.Tensor) -> None:
        a = np.ascontiguousarray(t.detach().float().numpy())
        if q8 and a.ndim >= 2 and a.shape[-1] % 32 == 0:
            w.add_tensor(name, gguf.quants.quantize(a, Q.Q8_0), raw_dtype=Q.Q8_0)
        else:
            w.add_tensor(name, a)

    hf.save_pretrained(path.parent / "hf")  # the converter reads the checkpoint as saved (per-expert tensors)
    stacked: dict[str, dict[int, torch.Tensor]] = {}
    for hf_name, t in load_file(path.parent / "hf" / "model.safetensors").items():
        if ".mlp.experts." in hf_name:
            layer, _, _, expert, kind, _ = hf_name.removeprefix("model.layers.").split(".")
            stacked.setdefault(f"blk.{layer}.ffn_{kind.removesuffix('_proj')}_exps.weight", {})[int(expert)] = t
        elif hf_name.endswith("e_score_correction_bias"):
            add(names.get_name(hf_name.removesuffix("_bias")) + ".bias", t)
        elif hf_name.endswith("kv_b_proj.weight") and split_kv_b:
            k_b, v_b = t.view(heads, nope + v, -1).split([nope, v], dim=1)
            blk = "blk." + hf_name.split(".")[2]
            add(f"{blk}.attn_k_b.weight", k_b.transpose(1, 2))
            add(f"{blk}.attn_v_b.weight", v_b)
        else:
            base, suffix = hf_name.rsplit(".", 1)
            add(f"{names.get_name(base)}.{suffix}", t)
    for name, experts in stacked.items():
        add(name, torch.stack([experts[e] for e in sorted(experts)]))
    finish_writer(w)


@pytest.mark.parametrize(
    ("name", "split_kv_b"),
    [("deepseek_v3", True), ("deepseek_v3", False), ("deepseek_v2", True), ("deepseek_v2", False)],
)
def test_deepseek2_gguf_matches_hf_model(tmp_path, name, split_kv_b):
    """DeepSeek-V3 (sigmoid gating, selection bias, groups from the group keys, low-rank queries) and DeepSeek-V2
    (softmax gating or none, V2-Lite's full-rank q_proj, YaRN with its mscale), in current converters' MQA form and
    in older files' form: the latent-attention config, kv_b_proj joined again, transformers' logits, `keel convert`
    back to the HF tensors; stored as Q8_0
    and run as stored (keel's default), logits close to transformers' and the same greedy tokens through the engine's
    latent cache."""
    overrides = {"topk_method": "greedy", "n_group": 1, "topk_group": 1} if name == "deepseek_v2" else {}
    hf = build_hf_model(name, **overrides)
    write_deepseek2_gguf(hf, tmp_path / "ds.gguf", split_kv_b=split_kv_b, groups=name == "deepseek_v3")
    loaded = load_model(tmp_path / "ds.gguf")
    c, cfg = loaded.config, hf.config
    assert c.architecture == name and (c.num_heads, c.num_kv_heads, c.head_dim) == (4, 4, 24)
    assert (c.q_lora_rank, c.kv_lora_rank, c.qk_rope_head_dim, c.v_head_dim) == (
        cfg.q_lora_rank,
        16,
        8,
        cfg.v_head_dim,
    )
    assert c.mlp_only_layers == [0] and c.shared_expert_intermediate_size == 32 * cfg.n_shared_experts
    if name == "deepseek_v3":
        assert (c.router_scoring, c.router_bias, c.n_group, c.topk_group) == ("sigmoid", True, 2, 1)
    else:
        assert (c.router_scoring, c.router_float32, c.router_bias, c.norm_topk_prob) == ("softmax", True, False, False)
        assert c.rope_scaling.type == "yarn" and c.rope_scaling.mscale == c.rope_scaling.mscale_all_dim == 0.707
    reader = loaded.checkpoint.reader
    expected = ["blk.0.attn_k_b.weight", "blk.0.attn_v_b.weight"] if split_kv_b else ["blk.0.attn_kv_b.weight"]
    assert reader.gguf_names("model.layers.0.self_attn.kv_b_proj.weight") == expected
    assert torch.equal(
        reader.get("model.layers.0.self_attn.kv_b_proj.weight"),
        hf.state_dict()["model.layers.0.self_attn.kv_b_proj.weight"],
    )
    with torch.no_grad():
        assert rel_err(hf(TOKENS).logits, loaded.model(TOKENS)) <= 1e-4
    if not split_kv_b:
        return
    from safetensors.torch import load_file

    from keel.weights.convert import convert

    out = convert(tmp_path / "ds.gguf", tmp_path / "back", dtype="float32")  # the HF checkpoint again
    written = {k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(f).items()}
    stored = load_file(tmp_path / "hf" / "model.safetensors")
    assert set(written) == set(stored) and all(torch.equal(written[k], stored[k]) for k in stored)
    write_deepseek2_gguf(hf, tmp_path / "q8.gguf", groups=name == "deepseek_v3", q8=True)
    from keel.serve import LLM, EngineConfig, SamplingParams

    prompt, greedy = TOKENS[0, :20].tolist(), SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    tokens = {}
    for quantize in ("auto", "none"):  # run as stored (keel's default), and dequantized at load
        options = dict(num_blocks=32, block_size=8, max_model_len=128, quantize=quantize, dtype="float32")
        llm = LLM(str(tmp_path / "q8.gguf"), EngineConfig.of(**options))
        experts = type(llm.engine.model.layers["1"].mlp.experts).__name__
        assert (experts == "GroupedExperts") == (quantize == "none"), experts
        tokens[quantize] = llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids
    assert tokens["auto"] == tokens["none"]


@pytest.mark.parametrize(
    ("pre", "text", "pieces"),
    [
        # DeepSeek-V3: numbers in threes, a kana run alone, punctuation before letters kept with them
        ("deepseek-v3", "abc 12345 ひらがな.net", ["abc", "Ġ", "123", "45", "Ġ", "ãģ²ãĤīãģĮãģª", ".net"]),
        # DeepSeek LLM / V2: digits in one run, newlines alone, punctuation runs with one leading space
        ("deepseek-llm", "Hello 12345\n\nworld !?", ["Hello", "Ġ", "12345", "Ċ", "Ċ", "world", "Ġ!?"]),
    ],
)
def test_deepseek_pre_tokenizers(tmp_path, pre, text, pieces):
    path = tmp_path / "tok.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    add_mini_vocab(w, pre)
    finish_writer(w)
    from keel.weights.gguf_file import GGUFFile
    from keel.weights.gguf_tokenizer import tokenizer_from_gguf

    fields = GGUFFile(path).fields
    tokenizer = tokenizer_from_gguf(fields.get, [2], path)
    assert [piece for piece, _ in tokenizer.tokenizer.pre_tokenizer.pre_tokenize_str(text)] == pieces


def write_text_model_gguf(hf, path, arch, rope_dims: int | None = None, pre: str = "default") -> None:
    """A model as llama.cpp's TextModel writes it (Glm4Model adds the rotary width): its metadata keys, the
    tensors of the saved checkpoint under gguf's TensorNameMap names, untouched (no q/k permutation, fused tensors
    kept fused)."""
    from safetensors.torch import load_file

    cfg = hf.config
    w = text_model_writer(cfg, path, arch)
    if getattr(cfg, "head_dim", None):  # TextModel writes the key length where config.json has head_dim
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    if rope_dims is not None:
        w.add_rope_dimension_count(rope_dims)
    add_mini_vocab(w, pre)
    names = gguf.get_tensor_name_map(arch, cfg.num_hidden_layers)
    hf.save_pretrained(path.parent / "hf")
    for hf_name, t in load_file(path.parent / "hf" / "model.safetensors").items():
        base, suffix = hf_name.rsplit(".", 1)
        w.add_tensor(f"{names.get_name(base)}.{suffix}", np.ascontiguousarray(t.float().numpy()))
    finish_writer(w)


def test_glm4_gguf_matches_hf_model(tmp_path):
    """Dense GLM-4 as llama.cpp's Glm4Model converts it (refused before): sandwich norms under llama.cpp's names,
    gate and up fused in `ffn_up`, q/k rows as in HF (rotary on interleaved pairs over half of each head, regrouped
    at load as from safetensors), the rotary width from rope.dimension_count; transformers' logits."""
    hf = build_hf_model("glm4")
    write_text_model_gguf(hf, tmp_path / "glm4.gguf", gguf.MODEL_ARCH.GLM4, rope_dims=16, pre="glm4")
    loaded = load_model(tmp_path / "glm4.gguf")
    c, reader = loaded.config, loaded.checkpoint.reader
    assert (c.architecture, c.norm_placement, c.partial_rotary_factor, c.head_dim) == ("glm4", "sandwich", 0.5, 32)
    assert c.qkv_bias and reader.gguf_names("model.layers.0.mlp.gate_proj.weight") == ["blk.0.ffn_up.weight"]
    assert reader.gguf_names("model.layers.0.attn_output_norm.weight") == ["blk.0.post_attention_norm.weight"]
    with torch.no_grad():
        assert rel_err(hf(TOKENS).logits, loaded.model(TOKENS)) <= 1e-4


def assert_served_as_transformers(
    tmp_path, hf, float_file: str, write_q8, max_model_len: int = 128, probe: str = "in_proj"
) -> None:
    """Greedy tokens through keel's engine: from the float file `float_file` as transformers gives them on the HF
    weights, and from the Q8_0 file `write_q8(path)` writes, run as stored (layer 0's self_attn.`probe` no plain
    Linear), as transformers gives them on the weights that file holds (keel convert dequantizes them)."""
    import transformers

    from keel.serve import LLM, EngineConfig, SamplingParams
    from keel.weights.convert import convert

    write_q8(tmp_path / "q8.gguf")
    q8_hf = convert(tmp_path / "q8.gguf", tmp_path / "q8_hf", dtype="float32")
    references = {float_file: hf, "q8": transformers.AutoModelForCausalLM.from_pretrained(q8_hf, dtype=torch.float32)}
    prompt, greedy = TOKENS[0, :10].tolist(), SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    for name, reference in references.items():
        with torch.no_grad():
            expected = reference.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, len(prompt) :]
        options = dict(num_blocks=32, block_size=8, max_model_len=max_model_len, dtype="float32")
        llm = LLM(str(tmp_path / f"{name}.gguf"), EngineConfig.of(**options))
        layer = llm.engine.model.layers["0"]
        mixer = layer.mamba or layer.self_attn  # (Falcon-H1's Mamba 2 mixer beside its attention)
        kind = type(getattr(mixer, probe)).__name__
        assert (kind == "Linear") == (name == float_file), kind  # the Q8_0 file run as stored
        assert llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids == expected.tolist()


def write_lfm2_gguf(hf, path, q8: bool = False, colbert: bool = False) -> None:
    """LFM2 as llama.cpp's LFM2Model converter writes it (`lfm2`): TextModel's metadata with the KV head count per
    layer (0 for a convolution layer: no layer_types key), the kernel width as shortconv.l_cache, the MLP width
    adjusted (keel.families.lfm2.mlp_width, the converter's own computation); the conv weight squeezed to [C, K],
    q/k rows as in HF, other names by gguf's TensorNameMap (`embedding_norm`, the final norm, as
    `token_embd_norm`). `q8`: the matrices whose rows split into blocks of 32 as Q8_0, the rest float32, as
    llama-quantize leaves them. `colbert`: with LFM2-ColBert's `dense_2` output projection."""
    from safetensors.torch import load_file

    from keel.families.lfm2 import mlp_width

    cfg = hf.config
    arch = gguf.MODEL_ARCH.LFM2
    kv_heads = [cfg.num_key_value_heads if kind == "full_attention" else 0 for kind in cfg.layer_types]
    w = text_model_writer(cfg, path, arch, kv_heads=kv_heads)
    w.add_shortconv_l_cache(cfg.conv_L_cache)
    w.add_layer_norm_rms_eps(cfg.norm_eps)
    w.add_feed_forward_length(mlp_width(cfg.to_dict()))
    add_mini_vocab(w, "default")
    names = gguf.get_tensor_name_map(arch, cfg.num_hidden_layers)
    hf.save_pretrained(path.parent / "hf")
    for hf_name, t in load_file(path.parent / "hf" / "model.safetensors").items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if "conv.conv.weight" in hf_name:  # (the converter squeezes any conv.conv tensor: a bias fails there)
            t = t.squeeze(1)
        base, suffix = hf_name.rsplit(".", 1)
        a = np.ascontiguousarray(t.float().numpy())
        name = f"{names.get_name(base)}.{suffix}"
        if q8 and a.ndim == 2 and a.shape[-1] % 32 == 0:
            w.add_tensor(name, gguf.quants.quantize(a, Q.Q8_0), raw_dtype=Q.Q8_0)
        else:
            w.add_tensor(name, a)
    if colbert:
        w.add_tensor("dense_2.weight", np.zeros((cfg.hidden_size // 2, cfg.hidden_size), dtype=np.float32))
    finish_writer(w)


def test_lfm2_colbert_gguf_is_refused(tmp_path):
    write_lfm2_gguf(build_hf_model("lfm2"), tmp_path / "colbert.gguf", colbert=True)
    with pytest.raises(ConfigError, match="'dense_2.weight' .LFM2-ColBert. is a retrieval model"):
        open_gguf(tmp_path / "colbert.gguf")


@pytest.mark.parametrize("conv_bias", [False, True])
def test_lfm2_gguf_matches_hf_model(tmp_path, conv_bias):
    """LFM2 as llama.cpp converts it: the layer kinds from the per-layer KV head counts (0: a convolution), the conv
    weight unsqueezed, the final norm from `token_embd_norm`, the MLP width as written (not adjusted again):
    transformers' logits; `keel convert` back to the HF checkpoint; stored as Q8_0, run as stored through the
    engine's state slots, the greedy tokens of transformers on the weights the file holds. The convolutions' biases
    are read where a file has them (the releases have none, llama.cpp reads none and its converter stops at one: a
    file written as it would, were it to keep them)."""
    from safetensors.torch import load_file

    from keel.weights.convert import convert

    hf = build_hf_model("lfm2", conv_bias=conv_bias)
    write_lfm2_gguf(hf, tmp_path / "lfm2.gguf")
    loaded = load_model(tmp_path / "lfm2.gguf")
    c, reader = loaded.config, loaded.checkpoint.reader
    assert c.architecture == "lfm2" and c.layer_types == ["conv", "conv", "full_attention", "conv"]
    assert (c.num_kv_heads, c.short_conv_kernel, c.short_conv_bias, c.qk_norm) == (2, 3, conv_bias, True)
    assert c.intermediate_size == hf.model.layers[0].feed_forward.w1.out_features and c.tie_word_embeddings
    assert loaded.checkpoint.provenance["layer_types"] == "read"
    assert reader.gguf_names("model.norm.weight") == ["token_embd_norm.weight"]
    conv = "model.layers.0.self_attn.conv.weight"
    assert reader.gguf_names(conv) == ["blk.0.shortconv.conv.weight"]
    assert torch.equal(reader.get(conv), hf.state_dict()["model.layers.0.conv.conv.weight"])
    with torch.no_grad():
        assert rel_err(hf(TOKENS).logits, loaded.model(TOKENS)) <= 1e-4
    out = convert(tmp_path / "lfm2.gguf", tmp_path / "back", dtype="float32")  # the HF checkpoint again
    written = {k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(f).items()}
    stored = load_file(tmp_path / "hf" / "model.safetensors")
    stored.pop("lm_head.weight", None)  # tied
    assert set(written) == set(stored) and all(torch.equal(written[k], stored[k]) for k in stored)
    if not conv_bias:
        assert_served_as_transformers(tmp_path, hf, "lfm2", lambda path: write_lfm2_gguf(hf, path, q8=True))


def write_lfm2_moe_gguf(hf, path, q8: bool = False, gating=gguf.ExpertGatingFuncType.SIGMOID) -> None:
    """LFM2 MoE as llama.cpp's LFM2MoeModel converter writes it (`lfm2moe`): TextModel's metadata (the KV head count
    per layer, 0 for a convolution layer; the dense width unadjusted; the expert counts), the experts' width, the
    leading dense count, sigmoid gating, shortconv.l_cache; no key for norm_topk_prob or routed_scaling_factor. The
    conv weight squeezed to [C, K], each layer's experts stacked as `layers.{bid}.feed_forward.experts.{w1,w2,w3}`
    before TensorNameMap names them, the selection bias renamed `.expert_bias.bias` (`exp_probs_b.bias`). `q8`: the
    matrices and stacked experts whose rows split into blocks of 32 as Q8_0, the rest float32; `gating`: the gating
    function written (the converter's is sigmoid)."""
    from safetensors.torch import load_file

    cfg = hf.config
    arch = gguf.MODEL_ARCH.LFM2MOE
    kv_heads = [cfg.num_key_value_heads if kind == "full_attention" else 0 for kind in cfg.layer_types]
    w = text_model_writer(cfg, path, arch, kv_heads=kv_heads)
    w.add_layer_norm_rms_eps(cfg.norm_eps)
    w.add_expert_count(cfg.num_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_leading_dense_block_count(cfg.num_dense_layers)
    w.add_expert_gating_func(gating)
    w.add_shortconv_l_cache(cfg.conv_L_cache)
    add_mini_vocab(w, "default")
    names = gguf.get_tensor_name_map(arch, cfg.num_hidden_layers)
    hf.save_pretrained(path.parent / "hf")
    stored = load_file(path.parent / "hf" / "model.safetensors")
    out: dict[str, torch.Tensor] = {}
    for hf_name, t in stored.items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if ".experts." in hf_name:
            layer, expert, which = re.match(
                r"model\.layers\.(\d+)\.feed_forward\.experts\.(\d+)\.(w\d)", hf_name
            ).groups()
            if expert != "0":
                continue
            experts = [
                stored[f"model.layers.{layer}.feed_forward.experts.{e}.{which}.weight"] for e in range(cfg.num_experts)
            ]
            hf_name, t = f"layers.{layer}.feed_forward.experts.{which}.weight", torch.stack(experts)
        if "conv.conv" in hf_name:
            t = t.squeeze(1)
        if hf_name.endswith(".expert_bias"):
            hf_name += ".bias"
        base, suffix = hf_name.rsplit(".", 1)
        out[f"{names.get_name(base)}.{suffix}"] = t
    for name, t in out.items():
        a = np.ascontiguousarray(t.float().numpy())
        if q8 and a.ndim >= 2 and a.shape[-1] % 32 == 0:
            w.add_tensor(name, gguf.quants.quantize(a, Q.Q8_0), raw_dtype=Q.Q8_0)
        else:
            w.add_tensor(name, a)
    finish_writer(w)


def test_lfm2_moe_gguf_matches_hf_model(tmp_path):
    """LFM2 MoE as llama.cpp converts it: LFM2's layer kinds and conv weight, the dense layer's width as written, the
    stacked experts, the sigmoid router's selection bias from `exp_probs_b.bias`, the chosen scores renormalised and
    unscaled (llama.cpp's fixed choice: the file has no key for either; the tiny model is built with the releases'
    routed_scaling_factor 1): transformers' logits; `keel convert` back to the HF checkpoint; greedy tokens through the
    engine from float32 and from Q8_0 run as stored (transformers on the dequantized weights)."""
    from safetensors.torch import load_file

    from keel.weights.convert import convert

    hf = build_hf_model("lfm2_moe", routed_scaling_factor=1.0)
    write_lfm2_moe_gguf(hf, tmp_path / "lfm2_moe.gguf")
    loaded = load_model(tmp_path / "lfm2_moe.gguf")
    c, reader = loaded.config, loaded.checkpoint.reader
    assert c.architecture == "lfm2_moe" and c.layer_types == ["conv", "conv", "full_attention", "conv"]
    assert (c.num_kv_heads, c.short_conv_kernel, c.intermediate_size, c.mlp_only_layers) == (2, 3, 96, [0])
    assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size) == (4, 2, 32)
    assert (c.router_scoring, c.router_bias, c.norm_topk_prob, c.routed_scaling_factor) == ("sigmoid", True, True, 1.0)
    assert reader.gguf_names("model.layers.1.mlp.gate.e_score_correction_bias") == ["blk.1.exp_probs_b.bias"]
    assert reader.gguf_names("model.layers.1.mlp.experts.gate_up_proj") == [
        "blk.1.ffn_gate_exps.weight",
        "blk.1.ffn_up_exps.weight",
    ]
    with torch.no_grad():
        assert rel_err(hf(TOKENS).logits, loaded.model(TOKENS)) <= 1e-4
    out = convert(tmp_path / "lfm2_moe.gguf", tmp_path / "back", dtype="float32")  # the HF checkpoint again
    written = {k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(f).items()}
    stored = load_file(tmp_path / "hf" / "model.safetensors")
    stored.pop("lm_head.weight", None)  # tied
    assert set(written) == set(stored) and all(torch.equal(written[k], stored[k]) for k in stored)

    assert_served_as_transformers(tmp_path, hf, "lfm2_moe", lambda path: write_lfm2_moe_gguf(hf, path, q8=True))


def test_lfm2_moe_gguf_with_softmax_gating_is_refused(tmp_path):
    hf = build_hf_model("lfm2_moe", routed_scaling_factor=1.0)
    write_lfm2_moe_gguf(hf, tmp_path / "softmax.gguf", gating=gguf.ExpertGatingFuncType.SOFTMAX)
    with pytest.raises(ConfigError, match="expert_gating_func 1 is not supported for lfm2moe .sigmoid only."):
        open_gguf(tmp_path / "softmax.gguf")


QWEN_HYBRID_ARCH = {
    "qwen3_5_text": gguf.MODEL_ARCH.QWEN35,
    "qwen3_5_moe_text": gguf.MODEL_ARCH.QWEN35MOE,
    "qwen3_next": gguf.MODEL_ARCH.QWEN3NEXT,
}


def tiled(t: torch.Tensor, dim: int, key_heads: int, size: int) -> torch.Tensor:
    """Value heads grouped by key head ([K0 v0, K0 v1, K1 v0, K1 v1]) reordered to tiled ([K0 v0, K1 v0, K0 v1, K1 v1]),
    as Qwen3.5's converter (_LinearAttentionVReorderBase) stores them along `dim`."""
    shape = list(t.shape)
    grouped = t.reshape(*shape[:dim], key_heads, -1, size, *shape[dim + 1 :])
    return grouped.transpose(dim, dim + 1).reshape(shape)


def write_qwen_hybrid_gguf(hf, path, legacy_qkvz: bool = False, q8: bool = False) -> None:
    """Qwen3.5 (dense or MoE) and Qwen3-Next as llama.cpp's Qwen3_5TextModel / Qwen3_5MoeTextModel / Qwen3NextModel
    write them: TextModel's and Qwen2MoeModel's metadata, the Gated DeltaNet's shape as ssm.* keys, the layer kinds as
    full_attention_interval (config.json's, else 4), the rotary width. Tensors: for Qwen3.5 with fewer key heads than
    value heads, the value heads tiled in in_proj_qkv's value rows, in_proj_z, in_proj_b / in_proj_a, A_log, dt_bias,
    conv1d's value channels and out_proj's columns; then A_log as -exp(A_log), dt_bias as `ssm_dt.bias`, conv1d
    squeezed to [C, K], 1 added to every norm but the Gated DeltaNet's; Qwen3-Next's in_proj_qkvz regrouped into
    `attn_qkv` ([q; k; v]) and `attn_gate` (z), or, `legacy_qkvz`, kept whole as older files' `ssm_in`; q_proj (each
    head's queries, then its gate) and in_proj_ba as in HF; experts split into gate and up; names by TensorNameMap.
    `q8`: matrices whose rows split into blocks of 32 stored as Q8_0, as llama-quantize leaves them."""
    cfg = hf.config
    arch = QWEN_HYBRID_ARCH[cfg.model_type]
    nk, nv, dk, dv = (
        cfg.linear_num_key_heads,
        cfg.linear_num_value_heads,
        cfg.linear_key_head_dim,
        cfg.linear_value_head_dim,
    )
    w = text_model_writer(cfg, path, arch)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    if arch != gguf.MODEL_ARCH.QWEN35:
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    w.add_ssm_conv_kernel(cfg.linear_conv_kernel_dim)
    w.add_ssm_state_size(dk)
    w.add_ssm_group_count(nk)
    w.add_ssm_time_step_rank(nv)
    w.add_ssm_inner_size(dv * nv)
    w.add_full_attention_interval(cfg.to_dict().get("full_attention_interval", 4))
    w.add_rope_dimension_count(int(cfg.head_dim * cfg.rope_parameters.get("partial_rotary_factor", 0.25)))
    add_mini_vocab(w, "qwen2")
    names = gguf.get_tensor_name_map(arch, cfg.num_hidden_layers)

    def add(name: str, t: torch.Tensor) -> None:
        a = np.ascontiguousarray(t.detach().float().numpy())
        if q8 and a.ndim >= 2 and a.shape[-1] % 32 == 0 and "conv1d" not in name:
            w.add_tensor(name, gguf.quants.quantize(a, Q.Q8_0), raw_dtype=Q.Q8_0)
        else:
            w.add_tensor(name, a)

    reorder = arch != gguf.MODEL_ARCH.QWEN3NEXT and nk != nv
    for hf_name, t in hf.state_dict().items():
        blk = "blk." + hf_name.split(".")[2] if ".layers." in hf_name else ""
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if reorder and ".linear_attn." in hf_name:  # _LinearAttentionVReorderBase
            if "in_proj_qkv" in hf_name:
                t = torch.cat([t[: 2 * nk * dk], tiled(t[2 * nk * dk :], 0, nk, dv)])
            elif "in_proj_z" in hf_name:
                t = tiled(t, 0, nk, dv)
            elif "in_proj_b" in hf_name or "in_proj_a" in hf_name or "A_log" in hf_name or "dt_bias" in hf_name:
                t = tiled(t, 0, nk, 1)
            elif "conv1d" in hf_name:
                t = t.squeeze()
                t = torch.cat([t[: 2 * nk * dk], tiled(t[2 * nk * dk :], 0, nk, dv)])
            elif "out_proj" in hf_name:
                t = tiled(t, 1, nk, dv)
        if hf_name.endswith(".A_log"):  # Qwen3NextModel.modify_tensors
            t = -torch.exp(t)
        elif hf_name.endswith(".dt_bias"):
            hf_name = hf_name.removesuffix(".dt_bias") + ".dt_proj.bias"
        elif "conv1d" in hf_name:
            t = t.squeeze()
        elif hf_name.endswith("norm.weight") and not hf_name.endswith("linear_attn.norm.weight"):
            t = t + 1
        if "in_proj_qkvz" in hf_name and not legacy_qkvz:  # [q, k, v, z] per key head -> [q; k; v] and z
            q, k, v, z = t.view(nk, -1, t.shape[-1]).split([dk, dk, nv // nk * dv, nv // nk * dv], dim=1)
            add(f"{blk}.attn_qkv.weight", torch.cat([x.reshape(-1, t.shape[-1]) for x in (q, k, v)]))
            add(f"{blk}.attn_gate.weight", z.reshape(-1, t.shape[-1]))
        elif hf_name.endswith("mlp.experts.gate_up_proj"):  # [E, 2I, H]: gate rows, then up rows
            gate, up = t.chunk(2, dim=1)
            add(f"{blk}.ffn_gate_exps.weight", gate)
            add(f"{blk}.ffn_up_exps.weight", up)
        elif hf_name.endswith("mlp.experts.down_proj"):
            add(f"{blk}.ffn_down_exps.weight", t)
        elif hf_name.endswith(".A_log"):  # no suffix
            add(names.get_name(hf_name), t)
        else:
            base, suffix = hf_name.rsplit(".", 1)
            add(f"{names.get_name(base)}.{suffix}", t)
    finish_writer(w)


QWEN_HYBRID = {  # llama.cpp reads experts in every Qwen3-Next layer, and the layer kinds by an interval
    "qwen3_5": dict(layer_types=None),
    "qwen3_5_moe": dict(layer_types=None),
    "qwen3_next": dict(layer_types=None, mlp_only_layers=[]),
}


@pytest.mark.parametrize(
    ("name", "legacy_qkvz"), [("qwen3_5", False), ("qwen3_5_moe", False), ("qwen3_next", False), ("qwen3_next", True)]
)
def test_qwen_hybrid_gguf_matches_hf_model(tmp_path, name, legacy_qkvz):
    """Qwen3.5, Qwen3.5 MoE and Qwen3-Next as llama.cpp converts them (refused before): the layer kinds from
    full_attention_interval, the Gated DeltaNet's shape from the ssm.* keys, its tensors back in HF's layout (value
    heads grouped again, A_log from -exp(A_log), conv1d unsqueezed, Qwen3-Next's attn_qkv / attn_gate or older files'
    ssm_in, in_proj_ba by rows), norms less 1 but the gated one, q_proj split into queries and gate by rows; the
    experts, renormalised as llama.cpp does, with the gated shared expert. transformers' logits, `keel convert` back
    to the HF tensors, and transformers' greedy tokens through keel's engine."""
    hf = build_hf_model(name, **QWEN_HYBRID[name])
    cfg = hf.config
    write_qwen_hybrid_gguf(hf, tmp_path / f"{name}.gguf", legacy_qkvz=legacy_qkvz)
    loaded = load_model(tmp_path / f"{name}.gguf")
    c, reader, provenance = loaded.config, loaded.checkpoint.reader, loaded.checkpoint.provenance
    assert c.architecture == name and c.layer_types == cfg.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert (c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim) == (
        2,
        4,
        16,
        8,
    )
    assert (c.partial_rotary_factor, c.norm_weight_offset, c.attention_output_gate) == (0.25, 1.0, True)
    assert provenance["layer_types"] == provenance["linear_num_value_heads"] == "read"
    if name != "qwen3_5":
        assert (c.num_experts, c.shared_expert_intermediate_size, c.shared_expert_gated, c.norm_topk_prob) == (
            4,
            48,
            True,
            True,
        )
    assert reader.gguf_names("model.layers.0.self_attn.A_log") == ["blk.0.ssm_a"]
    assert reader.gguf_names("model.layers.3.self_attn.output_gate.weight") == ["blk.3.attn_q.weight"]
    state = hf.state_dict()
    prefix = "model.layers.0.linear_attn."
    if name == "qwen3_next":
        expected = ["blk.0.ssm_in.weight"] if legacy_qkvz else ["blk.0.attn_qkv.weight"]
        assert reader.gguf_names("model.layers.0.self_attn.in_proj_qkv.weight") == expected
        assert reader.gguf_names("model.layers.0.self_attn.in_proj_a.weight") == ["blk.0.ssm_ba.weight"]
    else:  # the value heads in HF's order again, exactly
        for part in ("in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "out_proj.weight", "dt_bias"):
            assert torch.equal(reader.get(f"model.layers.0.self_attn.{part}"), state[prefix + part]), part
        assert torch.equal(reader.get("model.layers.0.self_attn.conv1d.weight"), state[prefix + "conv1d.weight"])
    torch.testing.assert_close(reader.get("model.layers.0.self_attn.A_log"), state[prefix + "A_log"])
    with torch.no_grad():
        assert rel_err(hf(TOKENS).logits, loaded.model(TOKENS)) <= 1e-4
    from safetensors.torch import load_file

    from keel.serve import LLM, EngineConfig, SamplingParams
    from keel.weights.convert import convert

    # `keel convert` gives back the HF checkpoint (Qwen3-Next's in_proj_qkvz / in_proj_ba grouped again); the norms
    # (w + 1 - 1) and A_log (log(exp)) to float32's rounding, the rest exactly
    hf.save_pretrained(tmp_path / "hf")
    out = convert(tmp_path / f"{name}.gguf", tmp_path / "back", dtype="float32")
    written = {k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(f).items()}
    stored = load_file(tmp_path / "hf" / "model.safetensors")
    assert set(written) == set(stored)
    for key, tensor in stored.items():
        if key.endswith(("A_log", "norm.weight")):
            torch.testing.assert_close(written[key], tensor, rtol=1e-6, atol=1e-6)
        else:
            assert torch.equal(written[key], tensor), key

    prompt, greedy = TOKENS[0, :10].tolist(), SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    llm = LLM(str(tmp_path / f"{name}.gguf"), EngineConfig.of(num_blocks=32, block_size=8, max_model_len=64))
    ours = llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids
    with torch.no_grad():
        theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, len(prompt) :].tolist()
    assert list(ours) == theirs


def test_qwen3_5_q8_0_gguf_runs_as_stored(tmp_path):
    """A Qwen3.5 file with its matrices in Q8_0: the rows regathered (q_proj's queries and gate, the value heads of
    in_proj_qkv / in_proj_z) run as stored, out_proj's regathered columns dequantized at load; the same greedy tokens
    as the file dequantized at load."""
    hf = build_hf_model("qwen3_5", layer_types=None)
    write_qwen_hybrid_gguf(hf, tmp_path / "q8.gguf", q8=True)
    reader = open_gguf(tmp_path / "q8.gguf").reader
    assert reader.get_blocks("model.layers.0.self_attn.in_proj_qkv.weight") is not None
    assert reader.get_blocks("model.layers.3.self_attn.output_gate.weight") is not None
    assert reader.get_blocks("model.layers.0.self_attn.out_proj.weight") is None
    from keel.serve import LLM, EngineConfig, SamplingParams

    prompt, greedy = TOKENS[0, :10].tolist(), SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    tokens = {}
    for quantize in ("auto", "none"):
        options = dict(num_blocks=32, block_size=8, max_model_len=64, quantize=quantize, dtype="float32")
        llm = LLM(str(tmp_path / "q8.gguf"), EngineConfig.of(**options))
        tokens[quantize] = llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids
    assert tokens["auto"] == tokens["none"]


def write_granite_hybrid_gguf(hf, path, q8: bool = False, rope: bool = False) -> None:
    """Granite 4.0-H as llama.cpp's GraniteHybridModel (on Mamba2Model and GraniteMoeModel) writes it
    (`granitehybrid`): TextModel's and GraniteModel's metadata (the four scalars, the rotary width as hidden / heads),
    the KV head count per layer (0 for a mamba layer), the context length 2**20 and rope.scaling.finetuned false (no
    position encoding), the experts' and shared MLP's widths, the mixer's shape as ssm.* keys. Tensors: q/k rows
    permuted as Llama's; the experts' input_linear split into gate and up; shared_mlp.input_linear into gate and up
    (ffn_*_shexp with experts, else ffn_gate / ffn_up, and output_linear as ffn_down); A_log as -exp(A_log) and D,
    both [n, 1]; dt_bias as `ssm_dt.bias`; conv1d squeezed to [C, K]; the gated norm as [groups, inner / groups];
    other names by TensorNameMap. `q8`: matrices whose rows split into blocks of 32 as Q8_0, as llama-quantize
    leaves them (not conv1d). `rope`: rope.scaling.finetuned true, as the converter writes BambaForCausalLM's."""
    from safetensors.torch import load_file

    from test_gguf import llama_cpp_permute

    cfg = hf.config
    arch = gguf.MODEL_ARCH.GRANITE_HYBRID
    experts, inner = cfg.num_local_experts, cfg.mamba_expand * cfg.hidden_size
    attention = [kind in ("attention", "full_attention") for kind in cfg.layer_types]  # (transformers' names too)
    kv_heads = [cfg.num_key_value_heads if attn else 0 for attn in attention]
    w = text_model_writer(cfg, path, arch, kv_heads=kv_heads)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_attention_scale(cfg.attention_multiplier)
    w.add_embedding_scale(cfg.embedding_multiplier)
    w.add_residual_scale(cfg.residual_multiplier)
    w.add_logit_scale(cfg.logits_scaling)
    w.add_expert_count(experts)
    if experts:
        w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_expert_shared_feed_forward_length(cfg.shared_intermediate_size)
    w.add_ssm_conv_kernel(cfg.mamba_d_conv)
    w.add_ssm_state_size(cfg.mamba_d_state)
    w.add_ssm_group_count(cfg.mamba_n_groups)
    w.add_ssm_inner_size(inner)
    w.add_ssm_time_step_rank(cfg.mamba_n_heads)
    w.add_rope_scaling_finetuned(rope)
    w.add_context_length(2**20)  # (overwrites TextModel's)
    add_mini_vocab(w, "default")
    names = gguf.get_tensor_name_map(arch, cfg.num_hidden_layers)
    hf.save_pretrained(path.parent / "hf")

    def add(name: str, t: torch.Tensor) -> None:
        a = np.ascontiguousarray(t.float().numpy())
        if q8 and a.ndim >= 2 and a.shape[-1] % 32 == 0 and "conv1d" not in name and "norm" not in name:
            w.add_tensor(name, gguf.quants.quantize(a, Q.Q8_0), raw_dtype=Q.Q8_0)
        else:
            w.add_tensor(name, a)

    for hf_name, t in load_file(path.parent / "hf" / "model.safetensors").items():
        blk = "blk." + hf_name.split(".")[2] if ".layers." in hf_name else ""
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_attention_heads if "q_proj" in hf_name else cfg.num_key_value_heads
            t = torch.from_numpy(llama_cpp_permute(t.numpy(), heads))
        if hf_name.endswith(".A_log"):
            t = -torch.exp(t)
        if hf_name.endswith((".A_log", ".D")):  # no suffix
            add(names.get_name(hf_name), t.reshape(-1, 1))
            continue
        if hf_name.endswith(".dt_bias"):
            hf_name = hf_name.removesuffix(".dt_bias") + ".dt_proj.bias"
        elif hf_name.endswith("mamba.conv1d.weight"):
            t = t.squeeze()
        elif hf_name.endswith("mamba.norm.weight"):
            t = t.reshape(cfg.mamba_n_groups, inner // cfg.mamba_n_groups)
        if hf_name.endswith("input_linear.weight"):  # gate rows, then up rows
            gate, up = t.chunk(2, dim=-2)
            kind = "exps" if "block_sparse_moe" in hf_name else "shexp" if experts else ""
            add(f"{blk}.ffn_gate{'_' + kind if kind else ''}.weight", gate)
            add(f"{blk}.ffn_up{'_' + kind if kind else ''}.weight", up)
        elif hf_name.endswith("shared_mlp.output_linear.weight") and not experts:
            add(f"{blk}.ffn_down.weight", t)
        else:
            base, suffix = hf_name.rsplit(".", 1)
            add(f"{names.get_name(base)}.{suffix}", t)
    finish_writer(w)


@pytest.mark.parametrize("name", ["granitemoehybrid", "granitemoehybrid-dense"])
def test_granite_hybrid_gguf_matches_hf_model(tmp_path, name):
    """Granite 4.0-H as llama.cpp converts it (refused before): the layer kinds from the per-layer KV head counts (0: a
    mamba layer), the mixer's shape from the ssm.* keys, its tensors back in HF's layout (A_log from -exp(A_log), A
    and D and the gated norm flattened, conv1d unsqueezed, dt_bias from ssm_dt.bias), q/k rows un-permuted, Granite's
    scalars, the experts stacked again with the shared MLP, or the shared MLP alone as the dense one. No position
    encoding (the converter writes none for a hybrid: the dense model is built without). transformers' logits, `keel
    convert` back to the HF tensors, transformers' greedy tokens through keel's engine from float32 and from Q8_0
    run as stored (transformers on the weights the file holds)."""
    from safetensors.torch import load_file

    from keel.weights.convert import convert

    hf = build_hf_model(name, position_embedding_type=None)
    cfg = hf.config
    write_granite_hybrid_gguf(hf, tmp_path / "f32.gguf")
    loaded = load_model(tmp_path / "f32.gguf")
    c, reader = loaded.config, loaded.checkpoint.reader
    kinds = ["full_attention" if kind in ("attention", "full_attention") else "mamba" for kind in cfg.layer_types]
    assert c.architecture == "granitemoehybrid" and c.layer_types == kinds and not any(c.rope_layers)
    assert (c.mamba_n_heads, c.mamba_d_head, c.mamba_n_groups, c.mamba_d_state) == (
        cfg.mamba_n_heads,
        cfg.mamba_d_head,
        cfg.mamba_n_groups,
        cfg.mamba_d_state,
    )
    assert (c.embedding_multiplier, c.residual_multiplier, c.attention_scale, c.logits_scaling) == (
        cfg.embedding_multiplier,
        cfg.residual_multiplier,
        cfg.attention_multiplier,
        cfg.logits_scaling,
    )
    assert loaded.checkpoint.provenance["layer_types"] == "read"
    if cfg.num_local_experts:
        assert (c.num_experts, c.shared_expert_intermediate_size) == (4, 48)
        assert reader.gguf_names("model.layers.0.mlp.shared_expert.gate_proj.weight") == ["blk.0.ffn_gate_shexp.weight"]
    else:
        assert (c.num_experts, c.intermediate_size) == (0, 96)
        assert reader.gguf_names("model.layers.0.mlp.down_proj.weight") == ["blk.0.ffn_down.weight"]
    assert reader.gguf_names("model.layers.0.self_attn.A_log") == ["blk.0.ssm_a"]
    assert reader.gguf_names("model.layers.0.self_attn.dt_bias") == ["blk.0.ssm_dt.bias"]
    state = hf.state_dict()
    for part in ("D", "dt_bias", "norm.weight", "conv1d.weight", "conv1d.bias", "in_proj.weight"):
        assert torch.equal(reader.get(f"model.layers.0.self_attn.{part}"), state[f"model.layers.0.mamba.{part}"]), part
    torch.testing.assert_close(reader.get("model.layers.0.self_attn.A_log"), state["model.layers.0.mamba.A_log"])
    with torch.no_grad():
        assert rel_err(hf(TOKENS).logits, loaded.model(TOKENS)) <= 1e-4

    # `keel convert` gives back the HF checkpoint: A_log (log(exp)) to float32's rounding, the rest exactly
    out = convert(tmp_path / "f32.gguf", tmp_path / "back", dtype="float32")
    written = {k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(f).items()}
    stored = load_file(tmp_path / "hf" / "model.safetensors")
    if cfg.tie_word_embeddings:
        stored.pop("lm_head.weight", None)
    assert set(written) == set(stored)
    for key, tensor in stored.items():
        if key.endswith("A_log"):
            torch.testing.assert_close(written[key], tensor, rtol=1e-6, atol=1e-6)
        else:
            assert torch.equal(written[key], tensor), key

    write_q8 = lambda path: write_granite_hybrid_gguf(hf, path, q8=True)  # noqa: E731
    assert_served_as_transformers(tmp_path, hf, "f32", write_q8, max_model_len=64)


def test_bamba_gguf_is_refused(tmp_path):
    """BambaForCausalLM converts to granitehybrid too, with rope.scaling.finetuned true (its rotary attention)."""
    hf = build_hf_model("granitemoehybrid-dense", position_embedding_type=None)
    write_granite_hybrid_gguf(hf, tmp_path / "bamba.gguf", rope=True)
    with pytest.raises(ConfigError, match="rope.scaling.finetuned true .*BambaForCausalLM"):
        open_gguf(tmp_path / "bamba.gguf")


def write_falcon_h1_gguf(hf, path, q8: bool = False) -> None:
    """Falcon-H1 as llama.cpp's FalconH1Model (on Mamba2Model) writes it (`falcon-h1`): TextModel's metadata with the
    head size as key_length and the mixer's shape as ssm.* keys. Tensors: every muP multiplier folded into the weights
    (q/k/v times attention_in, k times key_multiplier too, o_proj times attention_out, out_proj times ssm_out,
    in_proj times ssm_in and by segment, gate and down times mlp_multipliers, the embedding and LM head times
    theirs); A_log as -exp(A_log) and D, both [n, 1]; dt_bias as `ssm_dt.bias`; conv1d squeezed to [C, K]; the gated
    norm as [groups, inner / groups]; q/k as stored; names by TensorNameMap with the converter's suffixes (so the MLP
    norm is `ffn_norm`, no `.weight`). `q8`: matrices whose rows split into blocks of 32 as Q8_0."""
    from safetensors.torch import load_file

    cfg = hf.config
    arch = gguf.MODEL_ARCH.FALCON_H1
    inner, groups = cfg.mamba_d_ssm, cfg.mamba_n_groups * cfg.mamba_d_state
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads  # (as the converter's)
    w = text_model_writer(cfg, path, arch)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_ssm_conv_kernel(cfg.mamba_d_conv)
    w.add_ssm_state_size(cfg.mamba_d_state)
    w.add_ssm_group_count(cfg.mamba_n_groups)
    w.add_ssm_inner_size(inner)
    w.add_ssm_time_step_rank(inner // cfg.mamba_d_head)
    add_mini_vocab(w, "default")
    names = gguf.get_tensor_name_map(arch, cfg.num_hidden_layers)
    hf.save_pretrained(path.parent / "hf")
    segments = [inner, inner, groups, groups, cfg.mamba_n_heads]
    multipliers = {
        "down_proj": cfg.mlp_multipliers[1],
        "gate_proj": cfg.mlp_multipliers[0],
        "k_proj": cfg.key_multiplier * cfg.attention_in_multiplier,
        "q_proj": cfg.attention_in_multiplier,
        "v_proj": cfg.attention_in_multiplier,
        "o_proj": cfg.attention_out_multiplier,
        "out_proj": cfg.ssm_out_multiplier,
        "lm_head": cfg.lm_head_multiplier,
        "embed_tokens": cfg.embedding_multiplier,
    }
    for hf_name, t in load_file(path.parent / "hf" / "model.safetensors").items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        scale = next((m for key, m in multipliers.items() if key in hf_name), None)
        if scale is not None:
            t = t * scale
        elif "in_proj" in hf_name:
            per_row = torch.cat([torch.full((n,), m) for n, m in zip(segments, cfg.ssm_multipliers, strict=True)])
            t = t * cfg.ssm_in_multiplier * per_row[:, None]
        if hf_name.endswith(".A_log"):
            t = -torch.exp(t)
        if hf_name.endswith((".A_log", ".D")):
            t = t.reshape(-1, 1)
        elif hf_name.endswith(".dt_bias"):
            hf_name = hf_name.removesuffix(".dt_bias") + ".dt_proj.bias"
        elif hf_name.endswith("mamba.conv1d.weight"):
            t = t.squeeze()
        elif hf_name.endswith("mamba.norm.weight"):
            t = t.reshape(cfg.mamba_n_groups, inner // cfg.mamba_n_groups)
        a = np.ascontiguousarray(t.float().numpy())
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if q8 and a.ndim >= 2 and a.shape[-1] % 32 == 0 and "conv1d" not in hf_name and "norm" not in hf_name:
            w.add_tensor(name, gguf.quants.quantize(a, Q.Q8_0), raw_dtype=Q.Q8_0)
        else:
            w.add_tensor(name, a)
    finish_writer(w)


# Without attention biases: the converter scales q/k/v's biases by attention_in_multiplier too, which transformers
# does not (the releases have none). A tied head with the embedding's and head's multipliers at 1, as the releases
# that tie it have them: the converter folds the embedding's into the one matrix both use.
FALCON_H1_GGUF = {
    "falcon_h1": dict(attention_bias=False),
    "falcon_h1-gated": dict(mamba_d_ssm=128, embedding_multiplier=1.0, lm_head_multiplier=1.0),
}


@pytest.mark.parametrize("name", list(FALCON_H1_GGUF))
def test_falcon_h1_gguf_matches_hf_model(tmp_path, name):
    """Falcon-H1 as llama.cpp converts it (refused before): every layer hybrid, the mixer's shape from the ssm.* keys
    and its tensors back in HF's layout under `mamba.`, the multipliers folded into the weights (read as 1), the
    gated norm where ssm_norm is stored (after the gate, as llama.cpp runs it), the suffix-less ffn_norm as the MLP's
    norm. transformers' logits on the original weights; `keel convert` writes an HF checkpoint of the folded weights
    that transformers runs to the same logits."""
    import transformers

    from keel.weights.convert import convert

    hf = build_hf_model(name, **FALCON_H1_GGUF[name])
    cfg = hf.config
    write_falcon_h1_gguf(hf, tmp_path / "f32.gguf")
    loaded = load_model(tmp_path / "f32.gguf")
    c, reader = loaded.config, loaded.checkpoint.reader
    assert c.architecture == "falcon_h1" and c.layer_types == ["hybrid"] * cfg.num_hidden_layers
    assert (c.mamba_n_heads, c.mamba_d_head, c.mamba_n_groups, c.mamba_d_state, c.head_dim) == (
        cfg.mamba_n_heads,
        cfg.mamba_d_head,
        cfg.mamba_n_groups,
        cfg.mamba_d_state,
        cfg.hidden_size // cfg.num_attention_heads,
    )
    assert c.mamba_norm == ("gate_norm" if cfg.mamba_rms_norm else "gate") and c.mamba_out_bias == cfg.projectors_bias
    folded = (c.embedding_multiplier, c.logits_scaling, c.attention_scale, c.mamba_in_multiplier, c.mlp_gate_multiplier)
    assert folded == (1.0, 1.0, None, 1.0, 1.0) and c.mamba_proj_multipliers == ()
    assert reader.gguf_names("model.layers.0.post_attention_layernorm.weight") == ["blk.0.ffn_norm"]
    assert reader.gguf_names("model.layers.0.mamba.A_log") == ["blk.0.ssm_a"]
    state = hf.state_dict()
    for part in ("D", "dt_bias", "conv1d.weight", "conv1d.bias"):
        assert torch.equal(reader.get(f"model.layers.0.mamba.{part}"), state[f"model.layers.0.mamba.{part}"]), part
    with torch.no_grad():
        reference = hf(TOKENS).logits
        assert rel_err(reference, loaded.model(TOKENS)) <= 1e-4
    out = convert(tmp_path / "f32.gguf", tmp_path / "back", dtype="float32")
    back = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        assert rel_err(reference, back(TOKENS).logits) <= 1e-4


@pytest.mark.slow
def test_falcon_h1_gguf_is_served_as_transformers(tmp_path):
    """transformers' greedy tokens through keel's engine from the float32 file and the Q8_0 one run as stored."""
    hf = build_hf_model("falcon_h1", attention_bias=False)
    write_falcon_h1_gguf(hf, tmp_path / "f32.gguf")
    write_q8 = lambda path: write_falcon_h1_gguf(hf, path, q8=True)  # noqa: E731
    assert_served_as_transformers(tmp_path, hf, "f32", write_q8, max_model_len=64)


def write_nemotron_h_gguf(hf, path, q8: bool = False) -> None:
    """Nemotron-H as llama.cpp's NemotronHModel (on GraniteHybridModel) writes it: `nemotron_h_moe` where the config has
    experts, else `nemotron_h`; TextModel's and LlamaModel's metadata (the eps as the LayerNorm key, from
    layer_norm_epsilon), the head size as key_length, the KV head count per layer (0 but in attention layers), the
    feed-forward length per layer (the MLP's width in a dense file's MLP layers, the experts' in a MoE file's expert
    layers, else 0), the context 2**20 and rope.scaling.finetuned false, the mixer's shape as ssm.* keys (its heads as
    the time-step rank), the experts' keys. Tensors: q/k rows permuted as Llama's; each layer's experts stacked
    (`ffn_up_exps`, `ffn_down_exps`), the selection bias as `exp_probs_b.bias`; A_log as -exp(A_log) and D, both
    [n, 1]; dt_bias as `ssm_dt.bias`; conv1d squeezed; the gated norm as [groups, inner / groups]; other names by
    TensorNameMap. `q8`: matrices whose rows split into blocks of 32 as Q8_0 (not routers or norms)."""
    from safetensors.torch import load_file

    from keel.families.nemotron_h import pattern
    from test_gguf import llama_cpp_permute

    cfg = hf.config
    chars = pattern(cfg.to_dict(), "")
    moe = "E" in chars
    arch = gguf.MODEL_ARCH.NEMOTRON_H_MOE if moe else gguf.MODEL_ARCH.NEMOTRON_H
    inner = cfg.mamba_num_heads * cfg.mamba_head_dim
    w = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    w.add_block_count(len(chars))
    w.add_context_length(2**20)
    w.add_embedding_length(cfg.hidden_size)
    width = cfg.moe_intermediate_size if moe else cfg.intermediate_size
    w.add_feed_forward_length([width if c == ("E" if moe else "-") else 0 for c in chars])
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv([cfg.num_key_value_heads if c == "*" else 0 for c in chars])
    w.add_layer_norm_eps(cfg.layer_norm_epsilon)
    w.add_vocab_size(cfg.vocab_size)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_scaling_finetuned(False)
    w.add_ssm_conv_kernel(cfg.conv_kernel)
    w.add_ssm_state_size(cfg.ssm_state_size)
    w.add_ssm_group_count(cfg.n_groups)
    w.add_ssm_inner_size(inner)
    w.add_ssm_time_step_rank(cfg.mamba_num_heads)
    if moe:
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        w.add_expert_shared_feed_forward_length(cfg.moe_shared_expert_intermediate_size)
        w.add_expert_count(cfg.n_routed_experts)
        w.add_expert_shared_count(cfg.n_shared_experts)
        w.add_expert_weights_norm(cfg.norm_topk_prob)
        w.add_expert_weights_scale(cfg.routed_scaling_factor)
        w.add_expert_group_count(cfg.n_group)
    add_mini_vocab(w, "default")
    names = gguf.get_tensor_name_map(arch, len(chars))
    hf.save_pretrained(path.parent / "hf")

    def add(name: str, t: torch.Tensor) -> None:
        a = np.ascontiguousarray(t.float().numpy())
        quantize = a.shape[-1] % 32 == 0 and not any(s in name for s in ("conv1d", "norm", "ffn_gate_inp"))
        if q8 and a.ndim >= 2 and quantize:
            w.add_tensor(name, gguf.quants.quantize(a, Q.Q8_0), raw_dtype=Q.Q8_0)
        else:
            w.add_tensor(name, a)

    experts: dict[str, dict[int, torch.Tensor]] = {}
    for hf_name, t in load_file(path.parent / "hf" / "model.safetensors").items():
        if match := re.match(r"backbone\.layers\.(\d+)\.mixer\.experts\.(\d+)\.(\w+)\.weight$", hf_name):
            experts.setdefault(f"blk.{match[1]}.ffn_{match[3].removesuffix('_proj')}_exps.weight", {})[
                int(match[2])
            ] = t
            continue
        if hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_attention_heads if "q_proj" in hf_name else cfg.num_key_value_heads
            t = torch.from_numpy(llama_cpp_permute(t.numpy(), heads))
        if hf_name.endswith(".A_log"):
            t = -torch.exp(t)
        if hf_name.endswith((".A_log", ".D")):
            t = t.reshape(-1, 1)
        elif hf_name.endswith(".dt_bias"):
            hf_name = hf_name.removesuffix(".dt_bias") + ".dt.bias"
        elif hf_name.endswith("mixer.conv1d.weight"):
            t = t.squeeze()
        elif hf_name.endswith("mixer.norm.weight"):
            t = t.reshape(cfg.n_groups, -1)
        hf_name = hf_name.replace("e_score_correction_bias", "e_score_correction.bias")
        add(names.get_name(hf_name, try_suffixes=(".weight", ".bias")), t)
    for name, stacked in experts.items():
        add(name, torch.stack([stacked[e] for e in sorted(stacked)]))
    finish_writer(w)


# A Nemotron 3 Nano-like MoE (Mamba, attention and expert layers only: its converter writes no dense MLP layer; one
# group of experts: no key holds the groups' top k) and the
# dense Nemotron-H / Nano 2 (M, *, - layers from hybrid_override_pattern).
NEMOTRON_H_GGUF = {
    "nemotron_h": dict(
        layers_block_type=["linear_attention", "full_attention", "moe", "linear_attention", "moe"],
        n_group=1,
        topk_group=1,
    ),
    "nemotron_h-dense": {},
}


@pytest.mark.parametrize("name", list(NEMOTRON_H_GGUF))
def test_nemotron_h_gguf_matches_hf_model(tmp_path, name):
    """Nemotron-H as llama.cpp converts it (refused before): the layer kinds from the per-layer KV head counts and
    feed-forward lengths, the mixer's shape from the ssm.* keys and its tensors back in HF's layout, q/k un-permuted,
    the ungated experts stacked as keel's gate_up_proj, the selection bias, the eps from the LayerNorm key.
    transformers' logits, `keel convert` back to the HF tensors, and (slow) transformers' greedy tokens through keel's
    engine from float32 and from Q8_0 run as stored."""
    from safetensors.torch import load_file

    from keel.weights.convert import convert

    hf = build_hf_model(name, **NEMOTRON_H_GGUF[name])
    cfg = hf.config
    write_nemotron_h_gguf(hf, tmp_path / "f32.gguf")
    loaded = load_model(tmp_path / "f32.gguf")
    c, reader = loaded.config, loaded.checkpoint.reader
    from keel.families.nemotron_h import LAYERS, pattern

    chars = pattern(cfg.to_dict(), "")
    assert c.architecture == "nemotron_h" and c.layer_types == [LAYERS[ch][0] for ch in chars]
    assert c.mlp_layers == [LAYERS[ch][1] for ch in chars] and not any(c.rope_layers)
    assert loaded.checkpoint.provenance["layer_types"] == "read" and c.rms_norm_eps == cfg.layer_norm_epsilon
    assert (c.mamba_n_heads, c.mamba_d_head, c.mamba_n_groups, c.mamba_d_state) == (
        cfg.mamba_num_heads,
        cfg.mamba_head_dim,
        cfg.n_groups,
        cfg.ssm_state_size,
    )
    if "E" in chars:
        assert (c.num_experts, c.moe_intermediate_size, c.shared_expert_intermediate_size) == (8, 32, 48)
        assert (c.router_scoring, c.router_bias, c.n_group, c.topk_group) == ("sigmoid", True, 1, 1)
        assert c.routed_scaling_factor == pytest.approx(cfg.routed_scaling_factor)
        assert reader.gguf_names("model.layers.2.mlp.experts.gate_up_proj") == ["blk.2.ffn_up_exps.weight"]
        bias = "model.layers.2.mlp.gate.e_score_correction_bias"
        assert reader.gguf_names(bias) == ["blk.2.exp_probs_b.bias"]
    state = hf.state_dict()
    for part in ("D", "dt_bias", "norm.weight", "conv1d.weight", "in_proj.weight"):
        assert torch.equal(reader.get(f"model.layers.0.self_attn.{part}"), state[f"model.layers.0.mixer.{part}"]), part
    with torch.no_grad():
        assert rel_err(hf(TOKENS).logits, loaded.model(TOKENS)) <= 1e-4

    out = convert(tmp_path / "f32.gguf", tmp_path / "back", dtype="float32")
    written = {k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(f).items()}
    stored = load_file(tmp_path / "hf" / "model.safetensors")
    assert set(written) == set(stored)
    for key, tensor in stored.items():  # A_log (log(exp)) to float32's rounding, the rest exactly
        tolerance = 1e-6 if key.endswith("A_log") else 0
        torch.testing.assert_close(written[key], tensor, rtol=tolerance, atol=tolerance, msg=key)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(NEMOTRON_H_GGUF))
def test_nemotron_h_gguf_is_served_as_transformers(tmp_path, name):
    """transformers' greedy tokens through keel's engine from the float32 file and the Q8_0 one run as stored."""
    hf = build_hf_model(name, **NEMOTRON_H_GGUF[name])
    write_nemotron_h_gguf(hf, tmp_path / "f32.gguf")
    write_q8 = lambda path: write_nemotron_h_gguf(hf, path, q8=True)  # noqa: E731
    assert_served_as_transformers(tmp_path, hf, "f32", write_q8, max_model_len=64)


def test_nemotron_h_moe_gguf_with_a_dense_layer_is_refused(tmp_path):
    """NemotronHModel writes a MoE model's dense (`-`) layers with feed-forward length 0, as a Mamba layer, which they
    are not (llama.cpp cannot load them either): refused by name."""
    write_nemotron_h_gguf(build_hf_model("nemotron_h", n_group=1), tmp_path / "moe.gguf")
    with pytest.raises(ConfigError, match="layer 2 .*a Mamba layer. has no ssm_in"):
        open_gguf(tmp_path / "moe.gguf")


def test_nemotron_h_moe_gguf_with_expert_groups_is_refused(tmp_path):
    """NemotronHModel writes the group count but not the groups' top k (topk_group): more than one group is refused."""
    write_nemotron_h_gguf(
        build_hf_model("nemotron_h", **NEMOTRON_H_GGUF["nemotron_h"] | {"n_group": 2}), tmp_path / "g.gguf"
    )
    with pytest.raises(ConfigError, match="expert_group_count 2 without nemotron_h_moe.expert_group_used_count"):
        open_gguf(tmp_path / "g.gguf")


@pytest.mark.parametrize(
    "name, arch, sections",
    [
        ("qwen2_5_vl", "qwen2vl", [2, 3, 3, 0]),
        pytest.param("qwen3_vl", "qwen3vl", [6, 5, 5, 0], marks=pytest.mark.slow),
        pytest.param("qwen3_vl_moe", "qwen3vlmoe", [3, 3, 2, 0], marks=pytest.mark.slow),
    ],
)
def test_the_text_model_of_a_qwen_vl_gguf(tmp_path, monkeypatch, name, arch, sections):
    """llama.cpp writes the text model of Qwen2-VL / Qwen2.5-VL, Qwen3-VL and Qwen3-VL-MoE as `qwen2vl`, `qwen3vl` and
    `qwen3vlmoe` (Qwen2's, Qwen3's and Qwen3-MoE's tensors and keys, M-RoPE's `rope.dimension_sections`; the vision
    tower in an mmproj file of its own): read as qwen2 / qwen3 / qwen3_moe, the multimodal model's logits on text."""
    import transformers

    import test_gguf
    from keel.weights.convert import convert
    from test_multimodal_text import RELEASES, _release
    from test_multimodal_text import TOKENS as TEXT

    hf = _release(name, tmp_path / "mm")
    convert(tmp_path / "mm", tmp_path / "text")  # the text model, as llama.cpp's converter reads it
    text = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "text").eval()

    class Writer(gguf.GGUFWriter):  # Qwen2VLModel / Qwen3VLTextModel: the M-RoPE sections as a key
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.add_rope_dimension_sections(sections)

    monkeypatch.setitem(test_gguf.GGUF_ARCH, text.config.model_type, arch)
    monkeypatch.setattr(gguf, "GGUFWriter", Writer)
    path = write_gguf(text, tmp_path / f"{arch}.gguf")
    monkeypatch.undo()
    assert gguf.GGUFReader(str(path)).fields["general.architecture"].contents() == arch
    loaded = load_model(path, "float32")
    assert loaded.config.architecture == RELEASES[name][5]
    with torch.no_grad():
        assert rel_err(loaded.model(TEXT), hf(input_ids=TEXT).logits) < 1e-5
