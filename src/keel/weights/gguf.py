"""GGUF checkpoints (llama.cpp's format): config from metadata, HF-named tensors, tokenizer.

A GGUF file carries everything in one place: the hyper-parameters as `<arch>.*` metadata keys, the
vocabulary as `tokenizer.ggml.*` keys, and the tensors under llama.cpp names (`blk.N.attn_q.weight`)
with shapes in ggml order (innermost dimension first). `open_gguf` turns that into the same
`Checkpoint` the safetensors path builds: a `ModelConfig`, a reader that serves tensors under HF
names in HF layout (dequantized lazily with `gguf.quants.dequantize`), and a `tokenizers` tokenizer.
Q4_0/Q4_1/Q8_0/Q4_K/Q5_K/Q6_K tensors are also served as integer codes and group scales
(`get_blocks`, keel.weights.gguf_blocks), which `--quantize gguf` (keel.quant.on_load) repacks for
the integer kernels without a float copy.

Supported: architectures llama (and llama with experts, i.e. Mixtral), qwen2, qwen3, qwen2moe,
qwen3moe; tensor types F32 F16 BF16 Q8_0 Q4_0 Q4_1 Q4_K Q5_K Q6_K; byte-level BPE vocabularies
(`tokenizer.ggml.model == "gpt2"`). SentencePiece vocabularies (`"llama"`) raise a KeelError.
"""

from __future__ import annotations

import copy
import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize
from torch import Tensor

from keel.config import FAMILY_DEFAULTS, ModelConfig, RopeScaling
from keel.errors import ConfigError, WeightsError
from keel.weights.checkpoint import Checkpoint
from keel.weights.gguf_blocks import BLOCK_TYPES, QuantBlocks, decode_blocks
from keel.weights.gguf_file import GGUFFile, GGUFTensor
from keel.weights.gguf_tokenizer import tokenizer_from_gguf
from keel.weights.shard import Shard, narrow

# general.architecture -> keel family ("llama" with experts becomes "mixtral" below).
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"}

_T = GGMLQuantizationType
SUPPORTED_TYPES = (_T.F32, _T.F16, _T.BF16, _T.Q8_0, _T.Q4_0, _T.Q4_1, _T.Q4_K, _T.Q5_K, _T.Q6_K)

# llama.cpp per-layer tensor name -> HF name after `model.layers.N.`. "{moe}" is the MoE block
# (`mlp`, or `block_sparse_moe` for Mixtral).
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "{moe}.gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSOR = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
# Old Mixtral GGUFs store experts one by one (blk.N.ffn_gate.E.weight); names.py reads the hub form.
_OLD_EXPERT = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)\.(\d+)\.weight$")
_MIXTRAL_EXPERT = {"gate": "w1", "up": "w3", "down": "w2"}


def open_gguf(path: Path) -> Checkpoint:
    """Open a .gguf file as a keel Checkpoint (config, HF-named tensors, tokenizer)."""
    path = Path(path)
    if not path.is_file():
        raise WeightsError(f"{path}: file not found")
    try:
        reader = GGUFFile(path)
    except Exception as e:  # ValueError (truncated, bad magic), UnicodeDecodeError, an unknown type id, ...
        raise WeightsError(f"{path}: not a readable GGUF file, truncated or corrupt ({_one_line(e)})") from None
    meta = _Metadata(reader, path)
    tensors = {t.name: t for t in reader.tensors}
    try:
        config, provenance = _config_from_metadata(meta, tensors, path)
    except (TypeError, ValueError, IndexError) as e:  # a key of the wrong type or shape
        raise ConfigError(f"{path}: malformed GGUF metadata ({_one_line(e)})") from None
    tensor_reader = GGUFTensorReader(path, reader, config)
    tokenizer = tokenizer_from_gguf(meta.get, config.eos_token_id, path)
    sizes: dict[str, int] = {}
    for t in reader.tensors:
        sizes[t.tensor_type.name] = sizes.get(t.tensor_type.name, 0) + int(t.n_bytes)
    return Checkpoint(path, "gguf", config, tensor_reader, tokenizer, provenance, sizes)


def _one_line(e: BaseException) -> str:
    return " ".join(f"{type(e).__name__}: {e}".split())


class _Metadata:
    """Typed access to GGUF key/values, with errors that name the file and key."""

    def __init__(self, reader: GGUFFile, path: Path) -> None:
        self.fields = reader.fields
        self.path = path

    def get(self, key: str, default: Any = None) -> Any:
        value = self.fields.get(key)
        return default if value is None else value

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ConfigError(f"{self.path}: GGUF metadata key {key!r} is missing")
        return value


def _f32(value: float) -> float:
    """GGUF stores floats as float32: take the shortest decimal that rounds to it (1e-5, not 9.99e-06)."""
    return float(str(np.float32(value)))


# ------------------------------------------------------------------------------------------ config
class _Fields:
    """One file's `<arch>.*` metadata read into config fields, recording where each field came from:
    "read" (metadata), "inferred" (tensor names and shapes) or "default" (the family default)."""

    def __init__(self, meta: _Metadata, arch: str, family: str) -> None:
        self.meta, self.arch = meta, arch
        self.defaults = FAMILY_DEFAULTS[family]
        self.provenance = {name: "default" for name in ModelConfig.__dataclass_fields__}

    def key(self, name: str, default: Any = None) -> Any:
        return self.meta.get(f"{self.arch}.{name}", default)

    def require(self, name: str) -> Any:
        return self.meta.require(f"{self.arch}.{name}")

    def read(self, field: str, value: Any, how: str = "read") -> Any:
        self.provenance[field] = how
        return value

    def pick(self, field: str, value: Any, convert: Callable[[Any], Any]) -> Any:
        """The metadata value (provenance "read"), or the family default when the key is absent."""
        if value is not None:
            return self.read(field, convert(value))
        if field in self.defaults:
            return copy.copy(self.defaults[field])
        spec = ModelConfig.__dataclass_fields__[field]
        if spec.default_factory is not dataclasses.MISSING:
            return spec.default_factory()
        return 0 if spec.default is dataclasses.MISSING else spec.default


def _config_from_metadata(
    meta: _Metadata, tensors: dict[str, GGUFTensor], path: Path
) -> tuple[ModelConfig, dict[str, str]]:
    arch = _architecture(meta, path)
    num_experts = int(meta.get(f"{arch}.expert_count", 0) or 0)
    family = "mixtral" if arch == "llama" and num_experts else ARCHITECTURES[arch]
    f = _Fields(meta, arch, family)
    hidden, num_heads, kv_heads, head_dim = _attention_shape(f, path)
    vocab = _vocab_size(f, tensors, path)
    rope_theta = f.pick("rope_theta", f.key("rope.freq_base"), _f32)
    scaling = _rope_scaling(meta, arch, tensors, head_dim, rope_theta, path, f.provenance)
    has = lambda suffix: f"blk.0.{suffix}" in tensors  # noqa: E731
    num_layers = int(f.require("block_count"))
    moe: dict[str, Any] = {}
    if family in ("mixtral", "qwen2_moe", "qwen3_moe"):
        moe = _moe_fields(meta, arch, family, tensors, num_layers, num_experts, f.read, path)
    elif f.key("feed_forward_length") is None:
        raise ConfigError(f"{path}: GGUF metadata key {arch + '.feed_forward_length'!r} is missing")
    eos_ids = _eos_ids(meta)
    try:
        config = ModelConfig(
            architecture=f.read("architecture", family),
            vocab_size=vocab,
            hidden_size=hidden,
            # All-sparse MoE files have no dense width; the family default is then unused.
            intermediate_size=f.pick("intermediate_size", f.key("feed_forward_length"), int),
            num_layers=f.read("num_layers", num_layers),
            num_heads=num_heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=f.pick("rms_norm_eps", f.key("attention.layer_norm_rms_epsilon"), _f32),
            rope_theta=rope_theta,
            rope_scaling=scaling,
            max_position_embeddings=f.pick("max_position_embeddings", f.key("context_length"), int),
            # llama.cpp writes output.weight only when the head is not the embedding matrix.
            tie_word_embeddings=f.read("tie_word_embeddings", "output.weight" not in tensors, "inferred"),
            qkv_bias=f.read("qkv_bias", has("attn_q.bias"), "inferred"),
            o_bias=f.read("o_bias", has("attn_output.bias"), "inferred"),
            mlp_bias=f.read("mlp_bias", has("ffn_up.bias"), "inferred"),
            qk_norm=f.read("qk_norm", has("attn_q_norm.weight"), "inferred"),
            bos_token_id=f.pick("bos_token_id", meta.get("tokenizer.ggml.bos_token_id"), int),
            eos_token_id=f.pick("eos_token_id", eos_ids, list),
            pad_token_id=f.pick("pad_token_id", meta.get("tokenizer.ggml.padding_token_id"), int),
            dtype=f.read("dtype", _checkpoint_dtype(tensors), "inferred"),
            **moe,
        )
    except ConfigError as e:  # ModelConfig.validate does not know the file
        raise ConfigError(f"{path}: {e}") from None
    return config, f.provenance


def _architecture(meta: _Metadata, path: Path) -> str:
    """general.architecture, when keel reads it from GGUF."""
    arch = meta.get("general.architecture")
    if arch == "deepseek2":  # llama.cpp's name for DeepSeek-V2/V3 (multi-head latent attention)
        raise ConfigError(
            f"{path}: GGUF architecture 'deepseek2' (DeepSeek-V2/V3, multi-head latent attention) is not supported "
            "from GGUF; use the HF safetensors checkpoint (config.json + model*.safetensors)"
        )
    if arch not in ARCHITECTURES:
        raise ConfigError(f"{path}: unsupported GGUF architecture {arch!r}; supported: {', '.join(ARCHITECTURES)}")
    return arch


def _attention_shape(f: _Fields, path: Path) -> tuple[int, int, int, int]:
    """(hidden size, attention heads, KV heads, head dim), their provenance recorded."""
    hidden = f.read("hidden_size", int(f.require("embedding_length")))
    heads = _per_layer_constant(f.require("attention.head_count"), "attention.head_count", path)
    num_heads = f.read("num_heads", heads)
    kv_heads = f.key("attention.head_count_kv")
    if kv_heads is None:
        kv_heads = f.read("num_kv_heads", num_heads, "default")
    else:
        kv_heads = f.read("num_kv_heads", _per_layer_constant(kv_heads, "attention.head_count_kv", path))
    rope_dims = f.key("rope.dimension_count")
    if f.key("attention.key_length") is not None:
        head_dim = f.read("head_dim", int(f.key("attention.key_length")))
    elif rope_dims is not None:  # llama.cpp writes the head size here for llama
        head_dim = f.read("head_dim", int(rope_dims))
    else:
        head_dim = f.read("head_dim", hidden // num_heads, "inferred")
    if rope_dims is not None and int(rope_dims) != head_dim:
        raise ConfigError(
            f"{path}: partial rotary embeddings are not supported "
            f"(rope.dimension_count={rope_dims}, head_dim={head_dim})"
        )
    return hidden, num_heads, kv_heads, head_dim


def _vocab_size(f: _Fields, tensors: dict[str, GGUFTensor], path: Path) -> int:
    """From vocab_size, else the token list, else the embedding's rows."""
    embed = tensors.get("token_embd.weight")
    tokens = f.meta.fields.get("tokenizer.ggml.tokens")
    if f.key("vocab_size") is not None:
        return f.read("vocab_size", int(f.key("vocab_size")))
    if tokens is not None:
        return f.read("vocab_size", len(tokens))
    if embed is not None:
        return f.read("vocab_size", int(embed.shape[-1]), "inferred")
    raise ConfigError(f"{path}: cannot tell the vocabulary size (no vocab_size, token list or token_embd)")


def _eos_ids(meta: _Metadata) -> list[int] | None:
    """llama.cpp stops generation at any of these; keel's eos list plays that role."""
    eos = [meta.get(f"tokenizer.ggml.{key}") for key in ("eos_token_id", "eot_token_id", "eom_token_id")]
    return list(dict.fromkeys(int(i) for i in eos if i is not None)) or None


def _per_layer_constant(value: Any, key: str, path: Path) -> int:
    """Head counts may be stored per layer (an array); keel needs one value for all layers."""
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise ConfigError(f"{path}: per-layer {key} {sorted(set(value))} is not supported (needs one value)")
        value = value[0]
    return int(value)


def _moe_fields(
    meta: _Metadata,
    arch: str,
    family: str,
    tensors: dict[str, GGUFTensor],
    num_layers: int,
    num_experts: int,
    read: Callable[..., Any],
    path: Path,
) -> dict[str, Any]:
    k = lambda name, default=None: meta.get(f"{arch}.{name}", default)  # noqa: E731
    if family == "mixtral":
        width = k("feed_forward_length")
    else:
        width = k("expert_feed_forward_length")
    how = "read"
    if width is None:  # from the stacked down projection: ggml shape [I, H, E]
        down = next((t for n, t in tensors.items() if n.endswith("ffn_down_exps.weight")), None)
        if down is None:
            raise ConfigError(f"{path}: cannot tell the expert width (no expert_feed_forward_length)")
        width, how = int(down.shape[0]), "inferred"
    # A layer without a router is dense (Qwen-MoE's mlp_only_layers).
    dense = [i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensors]
    # llama.cpp normalises the top-k weights for Mixtral and Qwen3-MoE, not for Qwen2-MoE.
    norm = k("expert_weights_norm")
    shared = int(k("expert_shared_feed_forward_length", 0) or 0) if family == "qwen2_moe" else 0
    return {
        "num_experts": read("num_experts", num_experts),
        "num_experts_per_tok": read("num_experts_per_tok", int(meta.require(f"{arch}.expert_used_count"))),
        "moe_intermediate_size": read("moe_intermediate_size", int(width), how),
        "norm_topk_prob": read("norm_topk_prob", bool(norm), "read") if norm is not None else family != "qwen2_moe",
        "shared_expert_intermediate_size": read("shared_expert_intermediate_size", shared)
        if family == "qwen2_moe"
        else 0,
        "mlp_only_layers": read("mlp_only_layers", dense, "inferred"),
    }


def _rope_scaling(
    meta: _Metadata,
    arch: str,
    tensors: dict[str, GGUFTensor],
    head_dim: int,
    theta: float,
    path: Path,
    prov: dict[str, str],
) -> RopeScaling:
    kind = meta.get(f"{arch}.rope.scaling.type")
    factor = meta.get(f"{arch}.rope.scaling.factor", meta.get(f"{arch}.rope.scale_linear"))
    if kind in (None, "none") and meta.get(f"{arch}.rope.scale_linear") is not None:
        kind = "linear"  # older files: only rope.scale_linear
    if kind == "linear" and factor is not None and _f32(factor) != 1.0:
        prov["rope_scaling"] = "read"
        return RopeScaling(type="linear", factor=_f32(factor))
    if kind not in (None, "none", "linear"):
        raise ConfigError(f"{path}: rope scaling type {kind!r} is not supported (supported: linear, llama3)")
    freqs = tensors.get("rope_freqs.weight")
    if freqs is None:
        return RopeScaling()
    # Llama 3.x: the converter stores per-frequency divisors instead of the rope_scaling parameters.
    scaling = _llama3_from_rope_freqs(_to_numpy(freqs, path), head_dim, theta, meta, arch)
    if scaling is None:
        raise ConfigError(
            f"{path}: rope_freqs.weight does not match llama3 rope scaling; custom rope factors are not supported"
        )
    prov["rope_scaling"] = "inferred"
    return scaling


def _llama3_from_rope_freqs(
    freqs: np.ndarray, head_dim: int, theta: float, meta: _Metadata, arch: str
) -> RopeScaling | None:
    """The llama3 RopeScaling whose frequencies equal base / rope_freqs, or None."""
    from keel.model.layers import rope_inv_freq

    freqs = freqs.astype(np.float64).reshape(-1)
    if freqs.shape[0] != head_dim // 2:
        return None
    if np.allclose(freqs, 1.0):
        return RopeScaling()
    base = rope_inv_freq(head_dim, theta, RopeScaling()).double().numpy()
    target = base / freqs
    # The file keeps only the resulting divisors. Llama 3.1 / 3.2 / 3.3 all use low_freq_factor 1,
    # high_freq_factor 4 and an original context of 8192; the factor is the largest divisor. Accept
    # that reading only if it reproduces every stored frequency.
    original = int(meta.get(f"{arch}.rope.scaling.original_context_length") or 8192)
    candidate = RopeScaling("llama3", float(freqs.max()), 1.0, 4.0, original)
    got = rope_inv_freq(head_dim, theta, candidate).double().numpy()
    return candidate if np.allclose(got, target, rtol=1e-4, atol=0) else None


def _checkpoint_dtype(tensors: dict[str, GGUFTensor]) -> str:
    """bfloat16/float16 when every matrix is stored so; float32 otherwise (keel dequantizes to float32)."""
    kinds = {t.tensor_type for t in tensors.values() if len(t.shape) >= 2}
    if kinds == {_T.BF16}:
        return "bfloat16"
    if kinds == {_T.F16}:
        return "float16"
    return "float32"


# ----------------------------------------------------------------------------------------- tensors
def _hf_shape(t: GGUFTensor) -> tuple[int, ...]:
    return tuple(int(d) for d in reversed(t.shape.tolist()))  # ggml lists the innermost dimension first


def _to_numpy(t: GGUFTensor, path: Path) -> np.ndarray:
    """Dequantize one GGUF tensor to float32 in numpy (HF / row-major) shape."""
    if t.tensor_type not in SUPPORTED_TYPES:
        supported = ", ".join(s.name for s in SUPPORTED_TYPES)
        raise WeightsError(
            f"{path}: tensor {t.name!r} has ggml type {t.tensor_type.name}, which keel cannot read "
            f"(supported: {supported})"
        )
    shape = _hf_shape(t)
    try:
        return dequantize(t.data, t.tensor_type).reshape(shape)
    except Exception as e:
        raise WeightsError(f"{path}: cannot read tensor {t.name!r} ({_one_line(e)})") from None


def _unpermute(heads: int) -> Callable[[list[np.ndarray]], np.ndarray]:
    """Undo llama.cpp's q/k row permutation (its rotary pairs adjacent rows; HF pairs row i with i + d/2)."""

    def apply(arrays: list[np.ndarray]) -> np.ndarray:
        w = arrays[0]
        return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    apply.heads = heads  # type: ignore[attr-defined]  # a row shard un-permutes its own heads (get_shard)
    return apply


@dataclass(frozen=True)
class _Entry:
    """One HF tensor: the GGUF tensors it is made of, its HF shape and how to combine them."""

    sources: tuple[GGUFTensor, ...]
    shape: tuple[int, ...]
    combine: Callable[[list[np.ndarray]], np.ndarray]


def _single(arrays: list[np.ndarray]) -> np.ndarray:
    return arrays[0]


class GGUFTensorReader:
    """GGUF tensors under HF names in HF layout, dequantized to float32 on `get()`; integer-block
    tensors also as integer blocks (`get_blocks()`), for the integer kernels."""

    def __init__(self, path: Path, reader: GGUFFile, config: ModelConfig) -> None:
        self.path = path
        self._reader: GGUFFile | None = reader
        self._entries: dict[str, _Entry] = {}
        moe = "block_sparse_moe" if config.architecture == "mixtral" else "mlp"
        # llama.cpp's converter permutes q/k rows for the llama architecture (Mixtral included) only.
        permuted = config.architecture in ("llama", "mixtral")
        tensors = {t.name: t for t in reader.tensors}
        for name, t in tensors.items():
            if name in _GLOBAL_NAMES:
                self._add(_GLOBAL_NAMES[name], (t,), _hf_shape(t), _single)
                continue
            if match := _OLD_EXPERT.match(name):
                layer, kind, expert = match.groups()
                hf = f"model.layers.{layer}.block_sparse_moe.experts.{expert}.{_MIXTRAL_EXPERT[kind]}.weight"
                self._add(hf, (t,), _hf_shape(t), _single)
                continue
            match = _LAYER_TENSOR.match(name)
            if match is None:
                continue  # rope_freqs.weight (read into the config) and tensors keel has no use for
            layer, kind, suffix = match.groups()
            prefix = f"model.layers.{layer}"
            shape = _hf_shape(t)
            if kind == "ffn_down_exps":
                self._add(f"{prefix}.{moe}.experts.down_proj", (t,), shape, _single)
            elif kind == "ffn_gate_exps":
                up = tensors.get(f"blk.{layer}.ffn_up_exps.weight")
                if up is None:
                    raise WeightsError(f"{path}: tensor 'blk.{layer}.ffn_up_exps.weight' is missing")
                # HF-v5 stacked layout: [E, 2I, H], gate rows first, then up.
                stacked = (shape[0], shape[1] + _hf_shape(up)[1], shape[2])
                concat = lambda arrays: np.concatenate(arrays, axis=1)  # noqa: E731
                self._add(f"{prefix}.{moe}.experts.gate_up_proj", (t, up), stacked, concat)
            elif kind == "ffn_gate_inp_shexp":  # stored as [H]; HF's shared_expert_gate is Linear(H, 1)
                row = lambda arrays: arrays[0].reshape(1, -1)  # noqa: E731
                self._add(f"{prefix}.mlp.shared_expert_gate.{suffix}", (t,), (1, shape[-1]), row)
            elif kind in _LAYER_NAMES:
                hf = f"{prefix}.{_LAYER_NAMES[kind].format(moe=moe)}.{suffix}"
                combine: Callable[[list[np.ndarray]], np.ndarray] = _single
                if permuted and kind == "attn_q":
                    combine = _unpermute(config.num_heads)
                elif permuted and kind == "attn_k":
                    combine = _unpermute(config.num_kv_heads)
                self._add(hf, (t,), shape, combine)

    def _add(self, name: str, sources: tuple[GGUFTensor, ...], shape: tuple[int, ...], combine) -> None:
        self._entries[name] = _Entry(sources, shape, combine)

    def names(self) -> set[str]:
        return set(self._entries)

    def _entry(self, name: str) -> _Entry:
        try:
            return self._entries[name]
        except KeyError:
            raise WeightsError(f"{self.path}: tensor {name!r} not found in the checkpoint") from None

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entry(name).shape

    def dtype(self, name: str) -> str:
        """The ggml storage type (F32, Q4_K, ...) of the tensor's first GGUF source."""
        return self._entry(name).sources[0].tensor_type.name

    def gguf_names(self, name: str) -> list[str]:
        """The llama.cpp tensor names behind an HF name."""
        return [t.name for t in self._entry(name).sources]

    def get(self, name: str) -> Tensor:
        if self._reader is None:
            raise WeightsError(f"{self.path}: the checkpoint is closed")
        entry = self._entry(name)
        arrays = [_to_numpy(t, self.path) for t in entry.sources]
        try:
            array = entry.combine(arrays)
        except ValueError as e:  # e.g. a q/k row count that does not split into the config's heads
            raise WeightsError(f"{self.path}: cannot form tensor {name!r} ({_one_line(e)})") from None
        # F32 tensors are read-only views of the memory map and permuted ones are strided: copy those.
        if not (array.flags.writeable and array.flags.c_contiguous and array.dtype == np.float32):
            array = np.array(array, dtype=np.float32, order="C", copy=True)
        return torch.from_numpy(array)

    def get_shard(self, name: str, shard: Shard | None) -> Tensor:
        """A parallel rank's slice (keel.weights.shard.Shard; None: all) of a 2-D tensor, dequantizing
        only the rows it covers, and of those rows only the blocks it covers when its columns start and end
        on a block boundary (else whole rows, then cut). q/k rows are cut at head boundaries, so a row
        shard is un-permuted head by head like the whole tensor."""
        entry = self._entry(name)
        if shard is None:
            return self.get(name)
        if len(entry.sources) != 1 or len(entry.shape) != 2:  # stacked experts: read whole, then cut
            return narrow(self.get(name), shard)
        t = entry.sources[0]
        if t.tensor_type not in SUPPORTED_TYPES:
            _to_numpy(t, self.path)  # raises the unsupported-type error
        rows, cols = entry.shape
        raw = np.asarray(t.data).reshape(rows, -1)  # one row per HF row: bytes of blocks, or values
        block, type_size = GGML_QUANT_SIZES[t.tensor_type]
        start, stop = shard.start, shard.stop
        cut_after = None
        if shard.dim == 0:
            part, width = raw[start:stop], cols
        elif start % block == 0 and stop % block == 0:
            if raw.dtype == np.uint8:  # raw bytes: type_size of them per block of `block` values
                lo, hi = start // block * type_size, stop // block * type_size
            else:  # float values
                lo, hi = start, stop
            part, width = raw[:, lo:hi], stop - start
        else:
            part, width, cut_after = raw, cols, (start, stop)
        try:
            array = dequantize(np.ascontiguousarray(part), t.tensor_type).reshape(part.shape[0], width)
        except Exception as e:
            raise WeightsError(f"{self.path}: cannot read a slice of tensor {t.name!r} ({_one_line(e)})") from None
        if cut_after is not None:
            array = array[:, cut_after[0] : cut_after[1]]
        heads = getattr(entry.combine, "heads", None)
        if heads is not None and shard.dim == 0:
            array = _unpermute(heads * (stop - start) // rows)([array])
        elif heads is not None:  # a column shard keeps every row: the entry's own un-permute
            array = entry.combine([array])
        return torch.from_numpy(np.array(array, dtype=np.float32, order="C", copy=True))

    def get_blocks(self, name: str) -> QuantBlocks | None:
        """The tensor as integer codes and group scales (keel.weights.gguf_blocks), or None when any of
        its GGUF sources has no integer form or they differ in kind or group (then it loads as float
        through `get()`). The combination (llama q/k un-permute, gate+up concatenation) moves whole
        rows, so it applies to codes and scales alike."""
        if self._reader is None:
            raise WeightsError(f"{self.path}: the checkpoint is closed")
        entry = self._entry(name)
        specs = [BLOCK_TYPES.get(t.tensor_type) for t in entry.sources]
        if None in specs or len({s.form for s in specs}) != 1:  # type: ignore[union-attr]
            return None
        spec = specs[0]
        parts = [decode_blocks(t.tensor_type, t.data, _hf_shape(t)) for t in entry.sources]
        try:
            codes = entry.combine([p[0] for p in parts])
            scales = entry.combine([p[1] for p in parts])
            mins = entry.combine([p[2] for p in parts]) if parts[0][2] is not None else None
        except ValueError as e:
            raise WeightsError(f"{self.path}: cannot form tensor {name!r} ({_one_line(e)})") from None
        if tuple(codes.shape) != entry.shape:
            raise WeightsError(
                f"{self.path}: tensor {name!r} decodes to {list(codes.shape)}, expected {list(entry.shape)}"
            )
        own = lambda a: torch.from_numpy(np.ascontiguousarray(a))  # noqa: E731
        return QuantBlocks(
            spec.kind,
            spec.group,
            tuple(t.tensor_type.name for t in entry.sources),
            own(codes),
            own(scales),
            None if mins is None else own(mins),
        )

    def close(self) -> None:
        # Dropping the file (and the tensor views) releases the memory map.
        self._reader = None
        self._entries = {}
