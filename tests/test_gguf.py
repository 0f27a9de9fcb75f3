"""GGUF checkpoints (keel.weights.gguf), checked against transformers' own GGUF loader and tokenizer.

Three sources of truth: the real SmolLM2 Q4_1 GGUF read by transformers; tiny random HF models
written to GGUF here the way llama.cpp's converter writes them (llama.cpp names, ggml shape order,
llama q/k rows permuted) and compared with the HF model they came from; and transformers' torch
dequantizer (an implementation independent of gguf.quants) for the block types keel also runs as
integer blocks. The types keel reads as float only (Q5_0, Q5_1, Q2_K, Q3_K, IQ4_NL) are in
tests/test_gguf_types.py, the families beyond Llama/Qwen in tests/test_gguf_families.py.
"""

from __future__ import annotations

import contextlib
import functools
import math
import re
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from keel.catalog import resolve_catalog
from keel.errors import ConfigError, KeelError, WeightsError
from keel.quant.loading import load_model
from keel.weights.gguf import open_gguf
from tiny_models import build_hf_model

transformers = pytest.importorskip("transformers")


def rel_err(reference: torch.Tensor, ours: torch.Tensor) -> float:
    return ((reference - ours).abs().max() / reference.abs().max()).item()


# gguf's GGUFReader parses every metadata value into numpy views (SmolLM2's 49k-token vocabulary: seconds
# each time), transformers parses the file again for the config, the tokenizer and the weights, and its
# weight loader rebuilds gguf's tensor-name table for each of the model's ~400 submodules. The packaged
# SmolLM2 file is read-only: it is parsed once for this module, and each name table is built once. Both
# are pure, so what gguf and transformers compute is unchanged; files the tests write are read as they are.
_PARSED: dict[Path, gguf.GGUFReader] = {}


@contextlib.contextmanager
def parse_smollm_once():
    real_reader, real_name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    try:
        packaged = resolve_catalog("smollm2-135m-instruct").resolve()
    except KeelError:
        packaged = None

    def reader(path, mode="r"):
        key = Path(path).resolve()
        if mode != "r" or key != packaged:
            return real_reader(path, mode)
        if key not in _PARSED:
            _PARSED[key] = real_reader(path)
        return _PARSED[key]

    with (
        mock.patch.object(gguf, "GGUFReader", reader),
        mock.patch.object(gguf, "get_tensor_name_map", functools.cache(real_name_map)),
    ):
        yield


def transformers_from_gguf(path: Path):
    """transformers' GGUF model loading, as `from_pretrained(dir, gguf_file=...)` does it for llama/qwen.

    `from_pretrained(gguf_file=)` refuses to run without `accelerate` (not a keel dependency), so
    this makes the same calls it makes: config from the GGUF metadata, then `load_gguf_checkpoint`
    (dequantize + llama q/k un-permute + renaming) for the weights.
    """
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with parse_smollm_once():
        config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        state = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model, torch_dtype=torch.float32)
    missing, _ = model.load_state_dict(state["tensors"], strict=False)
    assert set(missing) <= {"lm_head.weight"}, missing
    model.tie_weights()
    return model.eval()


# ------------------------------------------------------------------------------ SmolLM2 (real file)
@pytest.fixture(scope="module")
def smollm_path() -> Path:
    try:
        return resolve_catalog("smollm2-135m-instruct")
    except KeelError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def smollm(smollm_path):
    return load_model(smollm_path)


@pytest.fixture(scope="module")
def smollm_hf_tokenizer(smollm_path):
    with parse_smollm_once():
        return transformers.AutoTokenizer.from_pretrained(smollm_path.parent, gguf_file=smollm_path.name)


def test_smollm_config(smollm):
    checkpoint = smollm.checkpoint
    c = checkpoint.config
    assert checkpoint.format == "gguf"
    assert (c.architecture, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads) == ("llama", 30, 576, 9, 3)
    assert (c.intermediate_size, c.vocab_size, c.head_dim, c.tie_word_embeddings) == (1536, 49152, 64, True)
    assert (c.rope_theta, c.rms_norm_eps, c.max_position_embeddings) == (100000.0, 1e-5, 8192)
    assert (c.qkv_bias, c.qk_norm, c.rope_scaling.type, c.bos_token_id, c.eos_token_id) == (
        False,
        False,
        "default",
        1,
        [2],
    )
    assert checkpoint.provenance["num_kv_heads"] == "read"
    assert checkpoint.provenance["tie_word_embeddings"] == "inferred"
    assert set(checkpoint.bytes_by_dtype) == {"Q4_1", "Q8_0", "F32"}
    assert sum(checkpoint.bytes_by_dtype.values()) < checkpoint.path.stat().st_size
    reader = checkpoint.reader
    assert reader.dtype("model.embed_tokens.weight") == "Q8_0"
    assert reader.dtype("model.layers.0.self_attn.q_proj.weight") == "Q4_1"
    assert reader.shape("model.layers.0.self_attn.k_proj.weight") == (192, 576)
    assert "lm_head.weight" not in reader.names()


SAMPLES = [
    "Hello world",
    "The year 2024 has 12345 days?!",
    "naïve café 東京 🙂",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "  leading and trailing spaces  ",
    "line one\nline two\n\n\tTabbed\r\nwindows",
    "don't you'll we've I'M",
    "",
]


def test_smollm_tokenizer_matches_transformers(smollm, smollm_hf_tokenizer):
    ours = smollm.tokenizer
    assert (ours.bos_token, ours.eos_token, ours.eos_token_ids) == ("<|im_start|>", "<|im_end|>", [2])
    for text in SAMPLES:
        ids = ours.encode(text)
        assert ids == smollm_hf_tokenizer(text)["input_ids"], text
        assert ours.decode(ids, skip_special_tokens=False) == text
        assert ours.decode(ids) == smollm_hf_tokenizer.decode(ids, skip_special_tokens=True)
    assert len(ours.encode("<|im_start|>")) == 1


def test_smollm_chat_template(smollm, smollm_hf_tokenizer):
    messages = [{"role": "user", "content": "What is 2+2?"}]
    rendered = smollm.tokenizer.apply_chat_template(messages)
    assert rendered.startswith("<|im_start|>system\n") and rendered.endswith("<|im_start|>assistant\n")
    assert rendered == smollm_hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


# The real SmolLM2 GGUF's logits, in `make test-slow` (the default suite's budget); test_smollm2 checks its HF form.
@pytest.mark.slow
def test_smollm_logits_match_transformers(smollm, smollm_path):
    tok = smollm.tokenizer
    texts = ["The capital of France is Paris, and the capital of Japan is", "def fibonacci(n):\n    return"]
    ids = [tok.encode(t) for t in texts]
    n = min(len(i) for i in ids)
    tokens = torch.tensor([i[:n] for i in ids])
    reference = transformers_from_gguf(smollm_path)
    with torch.no_grad():
        theirs = reference(tokens).logits
        ours = smollm.model(tokens)
    assert rel_err(theirs, ours) <= 1e-4


# ----------------------------------------------------------------- synthetic GGUFs from HF models
# Tiny models from tests/tiny_models.py, in 2 layers; GGUF metadata has no sliding window.
MODELS = [
    "llama",
    "llama-bias",
    "llama3-rope",
    "llama-linear-rope",
    "qwen2",
    "qwen3",
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
]
OVERRIDES = {"mixtral": {"sliding_window": None}}


def build_hf(name: str, seed: int = 0):
    return build_hf_model(name, seed, num_hidden_layers=2, **OVERRIDES.get(name, {}))


# A small byte-level BPE vocabulary (exactly 256 tokens), trained here on a few sentences.
CORPUS = (
    "The quick brown fox jumps over the lazy dog. Hello world, hello again! "
    "Pack my box with five dozen liquor jugs; how vexingly quick daft zebras jump. "
    "It's the year 2024 and 12345 is a number. We'll see what they've done, I'm sure. "
    "In 2020, 2021, 2022, 2023 and 2024 the count went 100, 200, 300, 2000. "
    "Sphinx of black quartz, judge my vow: the five boxing wizards jump quickly.\n"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def mini_vocab() -> tuple[list[str], list[int], list[str]]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    b2u = bytes_to_unicode()
    tokens = [*SPECIAL, "<think>"]
    types = [3, 3, 3, 4]
    tokens += sorted({b2u[b] for b in [*range(32, 127), 10]})
    types += [1] * (len(tokens) - len(types))
    words = Counter(
        tuple(b2u[b] for b in w.encode()) for w in re.findall(r" ?[A-Za-z]+| ?[0-9]+| ?[^\sA-Za-z0-9]+|\s+", CORPUS)
    )
    merges: list[str] = []
    while len(tokens) < 256:
        pairs: Counter = Counter()
        for word, count in words.items():
            for a, b in zip(word, word[1:], strict=False):
                pairs[a, b] += count
        if not pairs:
            break
        (a, b), _ = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))
        merges.append(f"{a} {b}")
        tokens.append(a + b)
        types.append(1)
        merged: Counter = Counter()
        for word, count in words.items():
            out, i = [], 0
            while i < len(word):
                if i + 1 < len(word) and (word[i], word[i + 1]) == (a, b):
                    out.append(a + b)
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            merged[tuple(out)] += count
        words = merged
    while len(tokens) < 256:  # llama.cpp pads short vocabularies with unused placeholders
        tokens.append(f"[PAD{len(tokens)}]")
        types.append(5)
    return tokens, types, merges


def add_mini_vocab(w: gguf.GGUFWriter, pre: str) -> None:
    """`mini_vocab` as a GGUF byte-level BPE vocabulary, with pre-tokenizer `pre` and EOS 2."""
    tokens, types, merges = mini_vocab()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_eos_token_id(2)


GGUF_ARCH = {"llama": "llama", "mixtral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
GGUF_ARCH.update(qwen2_moe="qwen2moe", qwen3_moe="qwen3moe", granite="granite", phi3="phi3", olmo2="olmo2")
GGUF_ARCH.update(gemma="gemma", gemma2="gemma2", gemma3_text="gemma3", stablelm="stablelm", gpt_neox="gptneox")
GGUF_ARCH.update(smollm3="smollm3", phi="phi2", granitemoe="granitemoe", granitemoeshared="granitemoe")
GGUF_ARCH.update(starcoder2="starcoder2", exaone4="exaone4", cohere="command-r", cohere2="cohere2")
GGUF_ARCH.update(llama4_text="llama4")
# HF module path (after model.layers.N.) -> llama.cpp tensor name (after blk.N.)
LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
    "self_attn.qkv_proj": "attn_qkv",  # Phi-3 keeps q/k/v fused ...
    "mlp.gate_up_proj": "ffn_up",  # ... and gate/up in ffn_up (llama.cpp splits it in halves: gate, up)
    "attention.query_key_value": "attn_qkv",  # GPT-NeoX's own names
    "attention.dense": "attn_output",
    "mlp.dense_h_to_4h": "ffn_up",
    "mlp.dense_4h_to_h": "ffn_down",
    "mlp.c_fc": "ffn_up",  # StarCoder2's
    "mlp.c_proj": "ffn_down",
    "self_attn.dense": "attn_output",  # Phi's
    "mlp.fc1": "ffn_up",
    "mlp.fc2": "ffn_down",
    "block_sparse_moe.router": "ffn_gate_inp",  # Granite MoE's router (transformers 5's name in memory)
    "feed_forward.gate_proj": "ffn_gate",  # Llama 4's MLP is its feed_forward
    "feed_forward.up_proj": "ffn_up",
    "feed_forward.down_proj": "ffn_down",
    "feed_forward.router": "ffn_gate_inp",
    "feed_forward.shared_expert.gate_proj": "ffn_gate_shexp",
    "feed_forward.shared_expert.up_proj": "ffn_up_shexp",
    "feed_forward.shared_expert.down_proj": "ffn_down_shexp",
}
# Per-architecture names (gguf's TENSOR_NAMES): OLMo 2's norms sit after each sublayer.
# Gemma's: a norm after the attention and one before and after the MLP.
_GEMMA_NORMS = {
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
ARCH_LAYER_NAMES = {
    "olmo2": {"post_attention_layernorm": "post_attention_norm", "post_feedforward_layernorm": "post_ffw_norm"},
    "exaone4": {"post_attention_layernorm": "post_attention_norm", "post_feedforward_layernorm": "post_ffw_norm"},
    "gemma2": _GEMMA_NORMS,
    "gemma3": _GEMMA_NORMS,
}


GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "model.norm.bias": "output_norm.bias",  # StableLM's LayerNorm
    "gpt_neox.embed_in.weight": "token_embd.weight",
    "gpt_neox.final_layer_norm.weight": "output_norm.weight",
    "gpt_neox.final_layer_norm.bias": "output_norm.bias",
    "model.final_layernorm.weight": "output_norm.weight",  # Phi's
    "model.final_layernorm.bias": "output_norm.bias",
    "lm_head.bias": "output.bias",  # Phi's head bias
}
HEADS = ("lm_head.weight", "embed_out.weight")  # GPT-NeoX's head is embed_out


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py LlamaModel.permute: HF rotate-half rows -> llama.cpp interleaved pairs."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_factors(head_dim: int, rope: dict) -> np.ndarray:
    """convert_hf_to_gguf.py LlamaModel.generate_extra_tensors: the rope_freqs.weight tensor."""
    freqs = 1.0 / (rope["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    old = rope["original_max_position_embeddings"]
    low, high, factor = rope["low_freq_factor"], rope["high_freq_factor"], rope["factor"]
    factors = []
    for freq in freqs:
        wavelen = 2 * np.pi / freq
        if wavelen < old / high:
            factors.append(1.0)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def write_gguf(
    model,
    path: Path,
    qtype: Q = Q.F32,
    pre: str = "gpt2",
    add_bos: bool = False,
    per_expert: bool = False,
    mixed: dict[str, Q] | None = None,
    encode: dict[Q, Callable[[np.ndarray], np.ndarray]] | None = None,
) -> Path:
    """Write an HF model the way llama.cpp's convert_hf_to_gguf.py (+ llama-quantize) would.

    per_expert: experts one tensor each (blk.N.ffn_gate.E.weight), as older Mixtral GGUFs have them.
    mixed: other types for tensors whose llama.cpp name contains a key (as Q4_K_M keeps attn_v and
    ffn_down in Q6_K). gguf cannot quantize to K-quants: their tensors (widths in multiples of 256)
    are random blocks with small scales, not the model's weights; other widths stay float32.
    encode: for types gguf cannot quantize, a function from float rows [rows, K] to their blocks
    [rows, bytes] (the model's own weights, quantized by the test); it takes precedence.
    """
    rng = np.random.default_rng(0)
    cfg = model.config
    family = cfg.model_type
    arch = GGUF_ARCH[family]
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size_mlp if arch == "llama4" else cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    if arch != "gptneox":  # GPTNeoXModel writes no KV head count (multi-head attention)
        w.add_head_count_kv(cfg.num_key_value_heads)
    rope = cfg.rope_parameters
    if arch == "gemma3":  # TextModel: the global layers' RoPE (and its scaling), the sliding layers' base
        rope = cfg.rope_parameters["full_attention"]
        w.add_rope_freq_base_swa(cfg.rope_parameters["sliding_attention"]["rope_theta"])
    if arch not in ("gemma", "gemma2", "phi2"):  # GemmaModel / Gemma2Model / Phi2Model write no RoPE base (10000)
        w.add_rope_freq_base(rope["rope_theta"])
    if arch == "starcoder2":  # StarCoder2Model (TextModel): LayerNorms, no window key
        w.add_layer_norm_eps(cfg.norm_epsilon)
    elif arch in ("command-r", "cohere2"):  # CommandR2Model / Cohere2Model: LayerNorms, the logit scale
        w.add_layer_norm_eps(cfg.layer_norm_eps)
        w.add_logit_scale(cfg.logit_scale)
        if arch == "cohere2":
            w.add_sliding_window(cfg.sliding_window)
    elif arch == "phi2":  # Phi2Model: a LayerNorm eps, the rotary width, no RoPE base (llama.cpp's 10000)
        w.add_layer_norm_eps(cfg.layer_norm_eps)
        w.add_rope_dimension_count(int(rope["partial_rotary_factor"] * cfg.hidden_size) // cfg.num_attention_heads)
    elif arch in ("stablelm", "gptneox"):  # LayerNorms; the rotary width (rope_pct / rotary_pct of the head)
        w.add_layer_norm_eps(cfg.layer_norm_eps)
        w.add_rope_dimension_count(int(rope["partial_rotary_factor"] * (cfg.hidden_size // cfg.num_attention_heads)))
        w.add_parallel_residual(cfg.use_parallel_residual)
    else:
        w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_file_type(int(qtype))
    if arch in ("llama", "granite", "granitemoe", "smollm3", "llama4"):  # LlamaModel (and its subclasses)
        w.add_rope_dimension_count(head_dim)
    if arch == "llama4":  # Llama4Model: the experts (LlamaModel's keys), their width, the MoE step
        w.add_expert_count(cfg.num_local_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(cfg.intermediate_size)
        w.add_interleave_moe_layer_step(cfg.interleave_moe_layer_step)
    if arch == "phi3":  # Phi3MiniModel: the rotated share of each head (Phi-4-mini's 0.75)
        w.add_rope_dimension_count(
            int(rope.get("partial_rotary_factor", 1.0) * cfg.hidden_size) // cfg.num_attention_heads
        )
    if arch == "gemma2":  # Gemma2Model
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
        w.add_sliding_window(cfg.sliding_window)
    if arch == "gemma3":  # Gemma3Model: the cap where set, the window (llama.cpp: 5 sliding layers in 6)
        if cfg.final_logit_softcapping:
            w.add_final_logit_softcapping(cfg.final_logit_softcapping)
        w.add_sliding_window(cfg.sliding_window)
    if arch in ("granite", "granitemoe"):  # GraniteModel: the four multipliers under llama.cpp's names
        w.add_embedding_scale(cfg.embedding_multiplier)
        w.add_residual_scale(cfg.residual_multiplier)
        w.add_attention_scale(cfg.attention_multiplier)
        w.add_logit_scale(cfg.logits_scaling)
    if arch == "exaone4" and cfg.sliding_window is not None:  # Exaone4Model: the window, the sliding layers
        w.add_sliding_window(cfg.sliding_window)
        w.add_sliding_window_pattern([t == "sliding_attention" for t in cfg.layer_types])
    if arch == "phi3":  # Phi3MiniModel: 0 for no window
        w.add_sliding_window(cfg.sliding_window or 0)
        w.add_rope_scaling_orig_ctx_len(cfg.original_max_position_embeddings)
        if rope.get("rope_type") == "longrope":  # the cos/sin factor as a key, the factors as two tensors
            scale = cfg.max_position_embeddings / cfg.original_max_position_embeddings
            w.add_rope_scaling_attn_factors(
                math.sqrt(1 + math.log(scale) / math.log(cfg.original_max_position_embeddings))
            )
            w.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
            w.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
    if head_dim != cfg.hidden_size // cfg.num_attention_heads or arch in ("gemma", "gemma2", "gemma3"):
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if rope.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    if family in ("mixtral", "granitemoe", "granitemoeshared"):  # LlamaModel's expert keys
        w.add_expert_count(cfg.num_local_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        if family == "granitemoeshared":  # GraniteMoeModel: the shared expert's width, where it has one
            w.add_expert_shared_feed_forward_length(cfg.shared_intermediate_size)
    elif family in ("qwen2_moe", "qwen3_moe"):
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        if family == "qwen2_moe":
            w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)

    add_mini_vocab(w, pre)
    w.add_bos_token_id(1)
    w.add_eot_token_id(0)
    if cfg.pad_token_id is not None:  # gguf's SpecialVocab takes it from config.json
        w.add_pad_token_id(cfg.pad_token_id)
    w.add_add_bos_token(add_bos)
    w.add_chat_template(CHATML)

    def add(name: str, t: torch.Tensor) -> None:
        a = t.detach().float().numpy()
        kind = next((q for key, q in (mixed or {}).items() if key in name), qtype)
        block = gguf.GGML_QUANT_SIZES[kind][0]
        # llama-quantize keeps 1-D tensors and MoE routers in float32.
        if kind in (encode or {}) and a.ndim >= 2 and "ffn_gate_inp" not in name and a.shape[-1] % block == 0:
            blocks = encode[kind](a.reshape(-1, a.shape[-1]))
            w.add_tensor(name, blocks.reshape(*a.shape[:-1], -1), raw_dtype=kind)
        elif kind in K_QUANTS and a.ndim >= 2 and "ffn_gate_inp" not in name and a.shape[-1] % 256 == 0:
            blocks = random_blocks(kind, math.prod(a.shape[:-1]), a.shape[-1], rng, scale=1e-4)
            w.add_tensor(name, blocks.reshape(*a.shape[:-1], -1), raw_dtype=kind)
        elif kind not in (Q.F32, *K_QUANTS) and a.ndim >= 2 and "ffn_gate_inp" not in name and a.shape[-1] % 32 == 0:
            w.add_tensor(name, gguf.quants.quantize(a, kind), raw_dtype=kind)
        else:
            w.add_tensor(name, np.ascontiguousarray(a))

    permute = arch in ("llama", "granite", "granitemoe", "smollm3")  # convert_hf_to_gguf.py's LlamaModel
    for hf_name, t in model.state_dict().items():
        if arch in ("gemma", "gemma2", "gemma3") and hf_name.endswith("norm.weight"):
            t = t + 1  # GemmaModel / Gemma2Model / Gemma3Model: llama.cpp's RMSNorm scales by w, Gemma's by 1 + w
        if hf_name in HEADS:
            if not cfg.tie_word_embeddings:
                add("output.weight", t)
            continue
        if hf_name in GLOBAL_NAMES:
            add(GLOBAL_NAMES[hf_name], t)
            continue
        layer, rest = re.match(r"(?:model|gpt_neox)\.layers\.(\d+)\.(.+)$", hf_name).groups()
        blk = f"blk.{layer}"
        if rest == "mlp.experts.gate_up_proj":  # [E, 2I, H]: gate rows, then up rows
            gate, up = t.chunk(2, dim=1)
            for kind, part in (("gate", gate), ("up", up)):
                if per_expert:
                    for e, expert in enumerate(part):
                        add(f"{blk}.ffn_{kind}.{e}.weight", expert)
                else:
                    add(f"{blk}.ffn_{kind}_exps.weight", part)
            continue
        # GraniteMoeModel: input_linear [E, 2I, H] (in memory experts.gate_up_proj) split into gate and up
        if rest == "block_sparse_moe.experts.gate_up_proj":
            gate, up = t.chunk(2, dim=1)
            add(f"{blk}.ffn_gate_exps.weight", gate)
            add(f"{blk}.ffn_up_exps.weight", up)
            continue
        if rest == "block_sparse_moe.experts.down_proj":
            add(f"{blk}.ffn_down_exps.weight", t)
            continue
        if rest == "feed_forward.experts.gate_up_proj":  # Llama4Model: [E, H, 2I] transposed, then split
            gate, up = t.transpose(-1, -2).chunk(2, dim=1)
            add(f"{blk}.ffn_gate_exps.weight", gate)
            add(f"{blk}.ffn_up_exps.weight", up)
            continue
        if rest == "feed_forward.experts.down_proj":
            add(f"{blk}.ffn_down_exps.weight", t.transpose(-1, -2))
            continue
        if rest == "shared_mlp.input_linear.weight":  # GraniteMoeModel splits the shared gate and up rows too
            gate, up = t.chunk(2, dim=0)
            add(f"{blk}.ffn_gate_shexp.weight", gate)
            add(f"{blk}.ffn_up_shexp.weight", up)
            continue
        if rest == "shared_mlp.output_linear.weight":
            add(f"{blk}.ffn_down_shexp.weight", t)
            continue
        if rest == "mlp.experts.down_proj":
            if per_expert:
                for e, expert in enumerate(t):
                    add(f"{blk}.ffn_down.{e}.weight", expert)
            else:
                add(f"{blk}.ffn_down_exps.weight", t)
            continue
        per_head = re.fullmatch(r"self_attn\.([qk])_layernorm\.norms\.(\d+)\.weight", rest)
        if per_head:  # StableLMModel._stack_qk_norm: the heads' LayerNorm weights as one [heads, head_dim] tensor
            if per_head[2] == "0":
                prefix = f"model.layers.{layer}.self_attn.{per_head[1]}_layernorm.norms."
                heads = [v for n, v in model.state_dict().items() if n.startswith(prefix)]
                add(f"{blk}.attn_{per_head[1]}_norm.weight", torch.stack(heads))
            continue
        module, suffix = rest.rsplit(".", 1)
        name = f"{blk}.{ {**LAYER_NAMES, **ARCH_LAYER_NAMES.get(arch, {})}[module] }.{suffix}"
        if permute and module == "self_attn.q_proj":
            t = torch.from_numpy(llama_cpp_permute(t.numpy(), cfg.num_attention_heads))
        elif permute and module == "self_attn.k_proj":
            t = torch.from_numpy(llama_cpp_permute(t.numpy(), cfg.num_key_value_heads))
        elif module == "mlp.shared_expert_gate":
            t = t.reshape(-1)  # the converter stores it as [H]
        elif module == "attention.query_key_value":  # GPTNeoXModel: per-head [q; k; v] -> [all q; all k; all v]
            t = t.reshape(cfg.num_attention_heads, 3, -1, *t.shape[1:]).transpose(0, 1).reshape(t.shape)
        add(name, t)
    if rope.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_rope_factors(head_dim, rope))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


TOKENS = torch.tensor([[5, 17, 200, 33, 101, 64, 9, 250, 3, 42, 77, 128], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]])


@pytest.mark.parametrize("name", list(MODELS))
def test_float32_gguf_matches_hf_model(tmp_path, name):
    hf = build_hf(name)
    path = write_gguf(hf, tmp_path / f"{name}.gguf")
    loaded = load_model(path)
    c, hc = loaded.config, hf.config
    head_dim = getattr(hc, "head_dim", None) or 16
    assert (c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (2, 4, 2, head_dim)
    assert c.tie_word_embeddings == hc.tie_word_embeddings
    assert c.qkv_bias == (name in ("llama-bias", "qwen2", "qwen2_moe"))
    assert c.qk_norm == (name in ("qwen3", "qwen3_moe"))
    expected_rope = {"llama3-rope": "llama3", "llama-linear-rope": "linear"}.get(name, "default")
    assert c.rope_scaling.type == expected_rope
    if name == "llama3-rope":
        assert (c.rope_scaling.factor, c.rope_scaling.original_max_position_embeddings) == (8.0, 8192)
        assert loaded.checkpoint.provenance["rope_scaling"] == "inferred"
    if name == "qwen2_moe":
        assert (c.num_experts, c.shared_expert_intermediate_size, c.mlp_only_layers) == (8, 96, [1])
    assert (c.bos_token_id, c.eos_token_id, loaded.tokenizer.eos_token_ids) == (1, [2, 0], [2, 0])
    with torch.no_grad():
        assert rel_err(hf(TOKENS).logits, loaded.model(TOKENS)) <= 1e-4


def test_mixtral_with_one_tensor_per_expert(tmp_path):
    hf = build_hf("mixtral")
    loaded = load_model(write_gguf(hf, tmp_path / "mixtral.gguf", per_expert=True))
    assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in loaded.checkpoint.reader.names()
    with torch.no_grad():
        assert rel_err(hf(TOKENS).logits, loaded.model(TOKENS)) <= 1e-4


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_transformers_reads_the_synthetic_ggufs_back(tmp_path, name):
    """The writer above follows llama.cpp's conventions: transformers' GGUF loader recovers the model.

    (transformers' GGUF config mapping ignores llama attention biases and qwen3's key_length, so
    those variants are checked against the HF model only.)
    """
    hf = build_hf(name)
    path = write_gguf(hf, tmp_path / f"{name}.gguf")
    with torch.no_grad():
        assert rel_err(hf(TOKENS).logits, transformers_from_gguf(path)(TOKENS).logits) <= 1e-5


@pytest.mark.parametrize(
    ("name", "qtype", "min_cos"),
    [
        ("llama", Q.Q8_0, 0.999),
        ("qwen3", Q.Q8_0, 0.999),
        ("llama-bias", Q.Q4_0, 0.98),
        ("qwen2", Q.Q4_1, 0.98),
        ("mixtral", Q.Q8_0, 0.999),
    ],
)
def test_quantized_gguf_stays_close(tmp_path, name, qtype, min_cos):
    hf = build_hf(name)
    path = write_gguf(hf, tmp_path / f"{name}.gguf", qtype=qtype)
    loaded = load_model(path)
    assert qtype.name in loaded.checkpoint.bytes_by_dtype
    assert loaded.checkpoint.reader.dtype("model.layers.0.self_attn.q_proj.weight") == qtype.name
    with torch.no_grad():
        ours, reference = loaded.model(TOKENS).flatten(), hf(TOKENS).logits.flatten()
    assert torch.nn.functional.cosine_similarity(ours, reference, dim=0) > min_cos


def test_quantized_llama_matches_transformers(tmp_path):
    """Same quantized file, keel vs transformers: the dequantized, un-permuted weights agree."""
    path = write_gguf(build_hf("llama"), tmp_path / "q.gguf", qtype=Q.Q4_1)
    with torch.no_grad():
        theirs = transformers_from_gguf(path)(TOKENS).logits
        assert rel_err(theirs, load_model(path).model(TOKENS)) <= 1e-4


# -------------------------------------------------------------------------------------- tokenizer
TOKENIZER_SAMPLES = [
    "Hello world, hello again!",
    "The quick brown fox's jumps: they've done it.",
    "  two leading spaces and trailing  ",
    "line one\nline two\n\nthree",
    "<|im_start|>user\nhi there<|im_end|>",
    "a <think> b",
]


@pytest.mark.parametrize(("pre", "add_bos"), [("gpt2", False), ("llama-bpe", True), ("qwen2", False)])
def test_tokenizer_matches_transformers(tmp_path, pre, add_bos):
    path = write_gguf(build_hf("llama"), tmp_path / "tok.gguf", pre=pre, add_bos=add_bos)
    ours = open_gguf(path).tokenizer
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="tok.gguf")
    for text in TOKENIZER_SAMPLES:
        ids = ours.encode(text)
        assert ids == theirs(text)["input_ids"], text
        assert ours.decode(ids, skip_special_tokens=False) == ("<|im_start|>" if add_bos else "") + text
    assert (ours.encode("Hello")[0] == 1) == add_bos
    assert len(ours.encode("<think>", add_special_tokens=False)) == 1
    assert ours.apply_chat_template([{"role": "user", "content": "hi"}]) == theirs.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )


def test_smollm_pre_tokenizer_splits_digits(tmp_path):
    """llama.cpp's `smollm` pre-tokenizer isolates every digit (its `\\p{N}` split) before BPE."""
    tokens, _, _ = mini_vocab()
    assert "20" in tokens  # the mini vocabulary merges digits, so the split is visible
    gpt2 = open_gguf(write_gguf(build_hf("llama"), tmp_path / "a.gguf", pre="gpt2")).tokenizer
    smollm = open_gguf(write_gguf(build_hf("llama"), tmp_path / "b.gguf", pre="smollm")).tokenizer
    assert len(gpt2.encode("2024")) < 4
    assert [tokens[i] for i in smollm.encode("2024")] == ["2", "0", "2", "4"]


# ------------------------------------------------------------------------------------ block types
BLOCK_BYTES = {Q.Q4_0: 18, Q.Q4_1: 20, Q.Q8_0: 34, Q.Q4_K: 144, Q.Q5_K: 176, Q.Q6_K: 210, Q.Q2_K: 84}
# Byte offsets of the float16 scales (d, dmin/m) inside one block.
FP16_FIELDS = {Q.Q4_0: [0], Q.Q4_1: [0, 2], Q.Q8_0: [0], Q.Q4_K: [0, 2], Q.Q5_K: [0, 2], Q.Q6_K: [208]}
FP16_FIELDS[Q.Q2_K] = [80, 82]


K_QUANTS = (Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q2_K)


def random_blocks(qtype: Q, rows: int, cols: int, rng: np.random.Generator, scale: float = 0.01) -> np.ndarray:
    """Random bytes in the block layout, with finite float16 scales (every quant bit is exercised)."""
    per_block = 256 if qtype in K_QUANTS else 32
    n_blocks = rows * cols // per_block
    blocks = rng.integers(0, 256, size=(n_blocks, BLOCK_BYTES[qtype]), dtype=np.uint8)
    for offset in FP16_FIELDS[qtype]:
        values = (rng.standard_normal(n_blocks) * scale).astype(np.float16)
        blocks[:, offset : offset + 2] = values.view(np.uint8).reshape(n_blocks, 2)
    return blocks.reshape(rows, -1)


def write_block_gguf(path: Path, qtype: Q, raw: dict[str, np.ndarray]) -> None:
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in dict(block_count=1, embedding_length=256, feed_forward_length=256, head_count=4).items():
        getattr(w, f"add_{key}")(value)
    w.add_head_count_kv(2)
    w.add_vocab_size(32)
    for name, data in raw.items():
        w.add_tensor(name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q8_0, Q.Q4_0, Q.Q4_1])
def test_block_types_match_transformers_dequantizer(tmp_path, qtype):
    """gguf.quants (what keel calls) vs transformers' torch dequantizer, on random blocks.

    gguf.quants cannot *produce* K-quants, so the K-quant blocks are random bytes with finite
    scales; that exercises every bit of the layout. attn_q also checks the llama un-permute.
    """
    from transformers.integrations.gguf.dequant import dequantize as hf_dequantize
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    rng = np.random.default_rng(int(qtype))
    raw = {"blk.0.attn_v.weight": random_blocks(qtype, 128, 256, rng)}
    raw["blk.0.attn_q.weight"] = random_blocks(qtype, 256, 256, rng)
    write_block_gguf(tmp_path / "blocks.gguf", qtype, raw)
    reader = open_gguf(tmp_path / "blocks.gguf").reader

    def reference(name: str, rows: int) -> np.ndarray:
        return hf_dequantize(torch.from_numpy(raw[name]).reshape(-1), int(qtype)).reshape(rows, 256).numpy()

    v = reader.get("model.layers.0.self_attn.v_proj.weight")
    assert v.dtype == torch.float32 and tuple(v.shape) == (128, 256)
    np.testing.assert_allclose(v.numpy(), reference("blk.0.attn_v.weight", 128), rtol=1e-6, atol=1e-7)
    unpermute = LlamaTensorProcessor({"num_attention_heads": 4, "num_key_value_heads": 2})
    q_reference = unpermute.process(reference("blk.0.attn_q.weight", 256), "blk.0.attn_q.weight").weights
    q = reader.get("model.layers.0.self_attn.q_proj.weight").numpy()
    np.testing.assert_allclose(q, q_reference, rtol=1e-6, atol=1e-7)
    assert reader.dtype("model.layers.0.self_attn.q_proj.weight") == qtype.name


def test_float_types(tmp_path):
    rng = np.random.default_rng(0)
    values = rng.standard_normal((32, 64)).astype(np.float32)
    half = values.astype(np.float16)
    bf16_bits = (values.view(np.uint32) >> 16).astype(np.uint16)  # truncated bfloat16
    w = gguf.GGUFWriter(str(tmp_path / "f.gguf"), "qwen2")
    for key, value in dict(block_count=1, embedding_length=64, feed_forward_length=32, head_count=4).items():
        getattr(w, f"add_{key}")(value)
    w.add_vocab_size(32)
    w.add_tensor("blk.0.ffn_up.weight", half)
    w.add_tensor("blk.0.ffn_gate.weight", bf16_bits.view(np.uint8), raw_dtype=Q.BF16)
    w.add_tensor("blk.0.ffn_down.weight", values.T.copy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    checkpoint = open_gguf(tmp_path / "f.gguf")
    reader = checkpoint.reader
    assert torch.equal(reader.get("model.layers.0.mlp.up_proj.weight"), torch.from_numpy(half.astype(np.float32)))
    bf16 = torch.from_numpy(bf16_bits.view(np.int16)).view(torch.bfloat16).float()
    assert torch.equal(reader.get("model.layers.0.mlp.gate_proj.weight"), bf16)
    assert torch.equal(reader.get("model.layers.0.mlp.down_proj.weight"), torch.from_numpy(values.T.copy()))
    assert [reader.dtype(f"model.layers.0.mlp.{p}_proj.weight") for p in ("up", "gate", "down")] == [
        "F16",
        "BF16",
        "F32",
    ]
    assert checkpoint.bytes_by_dtype == {"F16": 32 * 64 * 2, "BF16": 32 * 64 * 2, "F32": 32 * 64 * 4}
    assert checkpoint.tokenizer is None  # weights-only file


def test_unsupported_block_type(tmp_path):
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=(128, 66), dtype=np.uint8)  # IQ2_XXS: 66 bytes per 256 values
    write_block_gguf(tmp_path / "iq2.gguf", Q.IQ2_XXS, {"blk.0.attn_v.weight": raw})
    reader = open_gguf(tmp_path / "iq2.gguf").reader
    with pytest.raises(WeightsError, match=r"blk\.0\.attn_v\.weight.*IQ2_XXS") as e:
        reader.get("model.layers.0.self_attn.v_proj.weight")
    assert "\n" not in str(e.value)
    readable = ("F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL")
    assert all(name in str(e.value).split("supported: ")[1] for name in readable)


# -------------------------------------------------------------------------------------- bad input
def one_line(excinfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("arch", ["refact", "baichuan"])
def test_unsupported_architecture(tmp_path, arch):
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
    message = one_line(e)
    assert str(path) in message and repr(arch) in message and "llama, qwen2, qwen3" in message


@pytest.fixture(scope="module")
def valid_gguf(tmp_path_factory) -> Path:
    return write_gguf(build_hf("llama"), tmp_path_factory.mktemp("gguf") / "valid.gguf", qtype=Q.Q8_0)


@pytest.mark.parametrize("keep", ["empty", "magic", "header", "half", "all but 10 bytes"])
def test_truncated_file(tmp_path, valid_gguf, keep):
    data = valid_gguf.read_bytes()
    n = {"empty": 0, "magic": 3, "header": 100, "half": len(data) // 2, "all but 10 bytes": len(data) - 10}[keep]
    path = tmp_path / "truncated.gguf"
    path.write_bytes(data[:n])
    with pytest.raises(WeightsError) as e:
        load_model(path)
    assert "truncated.gguf" in one_line(e)


def test_missing_and_garbage_files(tmp_path):
    with pytest.raises(WeightsError, match="not found") as e:
        open_gguf(tmp_path / "missing.gguf")
    one_line(e)
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"GGUF" + bytes(range(256)) * 4)
    with pytest.raises(WeightsError) as e:
        open_gguf(garbage)
    assert "garbage.gguf" in one_line(e)


def test_unsupported_tokenizers(tmp_path, valid_gguf):
    """A SentencePiece vocabulary without scores, or an unknown pre-tokenizer, is a clear one-line KeelError."""
    for key, value in (("tokenizer.ggml.model", "llama"), ("tokenizer.ggml.pre", "made-up")):
        reader = gguf.GGUFReader(valid_gguf)
        w = gguf.GGUFWriter(str(tmp_path / "tok.gguf"), "llama")
        for name, field in reader.fields.items():
            if name.startswith("GGUF.") or name == "general.architecture":
                continue
            contents = value if name == key else field.contents()
            vtype = field.types[0]
            sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
            w.add_key_value(name, contents, vtype, sub_type=sub)
        for t in reader.tensors:
            w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        with pytest.raises(KeelError) as e:
            open_gguf(tmp_path / "tok.gguf")
        assert repr(value) in one_line(e)


def test_rope_freqs_that_are_not_llama3(tmp_path):
    hf = build_hf("llama3-rope")
    path = write_gguf(hf, tmp_path / "rope.gguf")
    reader = gguf.GGUFReader(path, "r+")  # scale the stored factors: no llama3 parameters give these
    rope = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
    rope.data[:] = rope.data * 1.5
    reader.data.flush()
    del reader, rope
    with pytest.raises(ConfigError, match="rope_freqs") as e:
        open_gguf(path)
    one_line(e)


@pytest.mark.parametrize("source", ["tiny-q8_0", "smollm2"])
def test_header_reader_equals_ggufs_own(valid_gguf, source):
    """keel.weights.gguf_file reads every key and tensor as gguf's GGUFReader does (its reference)."""
    from keel.weights.gguf_file import GGUFFile

    path = valid_gguf if source == "tiny-q8_0" else resolve_catalog("smollm2-135m-instruct")
    with parse_smollm_once():
        ours, reference = GGUFFile(path), gguf.GGUFReader(path)
    assert ours.fields == {k: f.contents() for k, f in reference.fields.items() if not k.startswith("GGUF.")}
    assert len(ours.tensors) == len(reference.tensors)
    for a, b in zip(ours.tensors, reference.tensors, strict=True):
        assert (a.name, a.tensor_type, a.n_elements, a.n_bytes, a.data_offset) == (
            b.name,
            b.tensor_type,
            b.n_elements,
            b.n_bytes,
            b.data_offset,
        )
        assert np.array_equal(a.shape, b.shape) and a.data.shape == b.data.shape and a.data.dtype == b.data.dtype
        assert np.array_equal(a.data, b.data)
