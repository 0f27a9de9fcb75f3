"""GGUF block types keel reads as float only (Q5_0, Q5_1, Q2_K, Q3_K, IQ4_NL), and the metadata keys keel
reads being gguf's own constants (keel.weights.gguf).

gguf.quants quantizes Q5_0/Q5_1 but not Q2_K/Q3_K/IQ4_NL: those blocks are made here from a model's
weights, packed by hand from ggml's documented layouts (ggml-common.h), and the values keel reads are
checked against the numbers packed (codes times scales, computed without reading the bytes back), against
gguf.quants.dequantize and, where it has the type, transformers' own torch dequantizer. Q5_0/Q5_1 blocks
(gguf's) are checked against a decoder written here from the layout.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from keel.config import ModelConfig
from keel.quant.loading import load_model
from keel.weights import gguf as keel_gguf
from keel.weights import gguf_blocks, gguf_file
from keel.weights.gguf import open_gguf
from keel.weights.shard import Shard
from test_gguf import TOKENS, rel_err, transformers_from_gguf, write_block_gguf, write_gguf
from tiny_models import build_hf_model

pytest.importorskip("transformers")

IQ4_LEVELS = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.float32)


def _f16(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float16 of `values` as (its float32 value, its two bytes [n, 2])."""
    half = values.astype(np.float16)
    return half.astype(np.float32), half.view(np.uint8).reshape(len(values), 2)


def _ratio(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.divide(a, b, out=np.zeros_like(a), where=b != 0)


# --------------------------------------------------------------------------- encoders (by hand)
def encode_q2_k(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """block_q2_K (84 bytes per 256 values): scales[16] (low nibble: scale, high: min, per 16 values),
    qs[64] (2-bit codes), fp16 d, fp16 dmin; w = d * scale * q - dmin * min. Value 128 h + 32 j + l has
    its code in bits 2j of qs[32 h + l]. Returns (blocks [rows, bytes], the values they hold)."""
    rows = x.shape[0]
    sub = x.reshape(-1, 16, 16).astype(np.float32)  # [super-blocks, sub-blocks, values]
    low = np.minimum(sub.min(-1), 0)
    step, offset = (np.maximum(sub.max(-1), 0) - low) / 3, -low
    d, d_bytes = _f16(step.max(-1) / 15)
    dmin, dmin_bytes = _f16(offset.max(-1) / 15)
    sc = np.clip(np.round(_ratio(step, d[:, None])), 0, 15).astype(np.uint8)
    mn = np.clip(np.round(_ratio(offset, dmin[:, None])), 0, 15).astype(np.uint8)
    scale, shift = d[:, None] * sc, dmin[:, None] * mn
    q = np.clip(np.round(_ratio(sub + shift[..., None], np.broadcast_to(scale[..., None], sub.shape))), 0, 3)
    q = q.astype(np.uint8)
    values = (scale[..., None] * q - shift[..., None]).reshape(rows, -1)
    grouped = q.reshape(-1, 2, 4, 32)  # [super-block, half h, shift j, l]
    qs = np.bitwise_or.reduce(grouped << (2 * np.arange(4, dtype=np.uint8))[:, None], axis=2).reshape(-1, 64)
    blocks = np.concatenate([sc | (mn << 4), qs, d_bytes, dmin_bytes], axis=1)
    return blocks.reshape(rows, -1), values


def encode_q3_k(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """block_q3_K (110 bytes per 256 values): hmask[32], qs[64] (low 2 bits), scales[12] (16 6-bit
    scales, biased by 32), fp16 d; w = d * (scale - 32) * q, q = low - 4 unless the hmask bit is set.
    Value 128 h + 32 j + l: low bits 2j of qs[32 h + l], its hmask bit 4 h + j of byte l. Scale i: low
    nibble of scales[i] (i < 8) or high nibble of scales[i - 8], high 2 bits at 2 (i // 4) of scales[8 + i % 4].
    Odd sub-blocks get negative scales (the sign bit exercised)."""
    rows = x.shape[0]
    sub = x.reshape(-1, 16, 16).astype(np.float32)
    sign = np.where(np.arange(16) % 2 == 1, -1.0, 1.0).astype(np.float32)
    step = np.abs(sub).max(-1) / 4
    d, d_bytes = _f16(step.max(-1) / 31)
    sc = np.clip(np.round(_ratio(step, d[:, None])) * sign, -32, 31).astype(np.int8)
    scale = d[:, None] * sc
    q = np.clip(np.round(_ratio(sub, np.broadcast_to(scale[..., None], sub.shape))), -4, 3).astype(np.int8)
    values = (scale[..., None] * q).reshape(rows, -1)
    grouped = q.reshape(-1, 2, 4, 32)  # [super-block, h, j, l]
    low = (grouped & 3).astype(np.uint8)
    qs = np.bitwise_or.reduce(low << (2 * np.arange(4, dtype=np.uint8))[:, None], axis=2).reshape(-1, 64)
    high = (grouped >= 0).astype(np.uint8).reshape(-1, 8, 32)  # bit 4 h + j of byte l
    hmask = np.bitwise_or.reduce(high << np.arange(8, dtype=np.uint8)[:, None], axis=1)
    biased = (sc.astype(np.int16) + 32).astype(np.uint8)  # [super-block, 16]
    packed = np.zeros((len(sub), 12), dtype=np.uint8)
    packed[:, :8] = (biased[:, :8] & 0x0F) | ((biased[:, 8:] & 0x0F) << 4)
    for i in range(16):
        packed[:, 8 + i % 4] |= (biased[:, i] >> 4) << (2 * (i // 4))
    blocks = np.concatenate([hmask, qs, packed, d_bytes], axis=1)
    return blocks.reshape(rows, -1), values


def encode_iq4_nl(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """block_iq4_nl (18 bytes per 32 values): fp16 d, qs[16]; w = d * levels[nibble], value j in the low
    nibble of qs[j], value j + 16 in its high nibble. d maps the block's largest magnitude to level -127."""
    rows = x.shape[0]
    block = x.reshape(-1, 32).astype(np.float32)
    peak = np.take_along_axis(block, np.abs(block).argmax(-1)[:, None], axis=-1)[:, 0]
    d, d_bytes = _f16(peak / -127)
    idx = np.abs(_ratio(block, np.broadcast_to(d[:, None], block.shape))[..., None] - IQ4_LEVELS).argmin(-1)
    idx = idx.astype(np.uint8)
    values = (d[:, None] * IQ4_LEVELS[idx]).reshape(rows, -1)
    blocks = np.concatenate([d_bytes, idx[:, :16] | (idx[:, 16:] << 4)], axis=1)
    return blocks.reshape(rows, -1), values


def decode_q5(blocks: np.ndarray, qtype: Q) -> np.ndarray:
    """block_q5_0 (fp16 d, qh[4], qs[16]: w = d (q - 16)) / block_q5_1 (fp16 d, fp16 m, qh, qs: w = d q + m),
    32 values: q of value j is the low nibble of qs[j] (j < 16; the high nibble of qs[j - 16] after) and
    bit j of the little-endian qh as its fifth bit."""
    raw = blocks.reshape(-1, 22 if qtype == Q.Q5_0 else 24)
    d = raw[:, 0:2].copy().view(np.float16).astype(np.float32)
    start = 2 if qtype == Q.Q5_0 else 4
    qh = raw[:, start : start + 4].astype(np.uint32)
    qh = qh[:, 0] | (qh[:, 1] << 8) | (qh[:, 2] << 16) | (qh[:, 3] << 24)
    qs = raw[:, start + 4 : start + 20]
    nibbles = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.uint32)
    q = (nibbles | (((qh[:, None] >> np.arange(32, dtype=np.uint32)) & 1) << 4)).astype(np.float32)
    if qtype == Q.Q5_0:
        return d * (q - 16)
    return d * q + raw[:, 2:4].copy().view(np.float16).astype(np.float32)


def encode(qtype: Q, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(blocks, the values they hold) of float rows x: by hand, or by gguf.quants and decoded here."""
    if qtype in HAND:
        return HAND[qtype](x)
    blocks = gguf.quants.quantize(x, qtype)
    return blocks, decode_q5(blocks, qtype).reshape(x.shape)


HAND = {Q.Q2_K: encode_q2_k, Q.Q3_K: encode_q3_k, Q.IQ4_NL: encode_iq4_nl}
NEW_TYPES = [Q.Q5_0, Q.Q5_1, Q.Q2_K, Q.Q3_K, Q.IQ4_NL]


@pytest.mark.parametrize("qtype", NEW_TYPES, ids=[t.name for t in NEW_TYPES])
def test_new_block_types_read_as_packed(tmp_path, qtype):
    from transformers.integrations.gguf.dequant import GGML_BLOCK
    from transformers.integrations.gguf.dequant import dequantize as hf_dequantize
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    rng = np.random.default_rng(int(qtype))
    weights = {"blk.0.attn_v.weight": (128, 256), "blk.0.attn_q.weight": (256, 256)}
    raw, packed = {}, {}
    for name, shape in weights.items():
        x = (rng.standard_normal(shape) * rng.uniform(0.01, 1.0, size=(shape[0], 1))).astype(np.float32)
        raw[name], packed[name] = encode(qtype, x)
        assert (
            raw[name].dtype == np.uint8 and raw[name].shape[1] == gguf.quants.quant_shape_to_byte_shape(shape, qtype)[1]
        )
        assert packed[name].shape == shape and rel_err(torch.from_numpy(x), torch.from_numpy(packed[name])) < 0.5
    write_block_gguf(tmp_path / "blocks.gguf", qtype, raw)
    reader = open_gguf(tmp_path / "blocks.gguf").reader
    v = reader.get("model.layers.0.self_attn.v_proj.weight")
    assert v.dtype == torch.float32 and tuple(v.shape) == (128, 256)
    assert reader.dtype("model.layers.0.self_attn.v_proj.weight") == qtype.name
    np.testing.assert_allclose(v.numpy(), packed["blk.0.attn_v.weight"], rtol=1e-6, atol=1e-8)
    assert np.array_equal(v.numpy(), gguf.quants.dequantize(raw["blk.0.attn_v.weight"], qtype))
    if int(qtype) in GGML_BLOCK:  # transformers' torch dequantizer has Q2_K, Q3_K, IQ4_NL (not Q5_0/Q5_1)
        theirs = hf_dequantize(torch.from_numpy(raw["blk.0.attn_v.weight"]).reshape(-1), int(qtype))
        np.testing.assert_allclose(v.numpy(), theirs.reshape(128, 256).numpy(), rtol=1e-6, atol=1e-8)
    # attn_q: the llama un-permute applies to these rows as to any; shards read their own rows and blocks.
    unpermute = LlamaTensorProcessor({"num_attention_heads": 4, "num_key_value_heads": 2})
    q_expected = unpermute.process(packed["blk.0.attn_q.weight"], "blk.0.attn_q.weight").weights
    q = reader.get("model.layers.0.self_attn.q_proj.weight")
    np.testing.assert_allclose(q.numpy(), q_expected, rtol=1e-6, atol=1e-8)
    assert torch.equal(reader.get_shard("model.layers.0.self_attn.q_proj.weight", Shard(0, 64, 192)), q[64:192])
    assert torch.equal(reader.get_shard("model.layers.0.self_attn.v_proj.weight", Shard(1, 0, 256)), v)
    # No integer form: `--quantize gguf` loads these as float.
    assert reader.get_blocks("model.layers.0.self_attn.v_proj.weight") is None


@pytest.fixture(scope="module")
def wide_llama():
    """Tiny Llama whose every matrix is 256 wide (K-quants' super-blocks), tied head."""
    return build_hf_model("llama", 0, num_hidden_layers=2, hidden_size=256, intermediate_size=256)


# Relative RMS error of a weight read back vs the float model's: the bits per value, in a plain quantizer
# (a wrong layout or q/k un-permute would read ~1.4).
WEIGHT_ERROR = {Q.Q5_0: 0.05, Q.Q5_1: 0.05, Q.Q2_K: 0.36, Q.Q3_K: 0.2, Q.IQ4_NL: 0.09}


@pytest.mark.parametrize("qtype", NEW_TYPES, ids=[t.name for t in NEW_TYPES])
def test_new_block_types_run_end_to_end(tmp_path, wide_llama, qtype):
    """A model stored in the type loads, runs as transformers runs the same file (its GGUF loader
    dequantizes with gguf.quants), holds the float model's weights to the type's precision, and loads
    as float under --quantize gguf (no integer form: nothing is quantized, the logits are the float load's)."""
    encoders = {t: (lambda x, t=t: HAND[t](x)[0]) for t in HAND}
    path = write_gguf(wide_llama, tmp_path / f"{qtype.name}.gguf", qtype=qtype, encode=encoders)
    loaded = load_model(path)
    reader, state = loaded.checkpoint.reader, wide_llama.state_dict()
    names = [
        f"model.layers.{i}.{m}.weight"
        for i, m in ((0, "self_attn.q_proj"), (1, "self_attn.k_proj"), (0, "mlp.down_proj"))
    ]
    for name in [*names, "model.embed_tokens.weight"]:
        assert reader.dtype(name) == qtype.name
        error = (reader.get(name) - state[name]).norm() / state[name].norm()
        assert error < WEIGHT_ERROR[qtype], (name, error)
    with torch.no_grad():
        ours = loaded.model(TOKENS)
        assert rel_err(transformers_from_gguf(path)(TOKENS).logits, ours) <= 1e-4
        native = load_model(path, "float32", quantize="gguf", quant_keep=())
        assert native.model.quantization["stats"]["quantized"] == 0
        assert torch.equal(native.model(TOKENS), ours)


# ----------------------------------------------------------------------------------- metadata keys
def _gguf_keys() -> set[str]:
    """Every key template gguf names (gguf.Keys and its nested classes)."""
    out, todo = set(), [gguf.Keys]
    while todo:
        cls = todo.pop()
        for value in vars(cls).values():
            if inspect.isclass(value):
                todo.append(value)
            elif isinstance(value, str):
                out.add(value)
    return out


def test_every_key_keel_reads_is_a_gguf_constant():
    keys = _gguf_keys()
    # the one legacy key and the one newer than gguf 0.19, each named once
    assert set(keel_gguf.KEYS_READ) - keys == {keel_gguf.ROPE_SCALE_LINEAR, keel_gguf.INDEXER_TYPES}


@pytest.mark.parametrize("module", [keel_gguf, gguf_file, gguf_blocks])
def test_no_metadata_key_is_spelled_out(module):
    """No string in the module's code (docstrings aside) is a GGUF key or a piece of one: `"general.x"`,
    `"tokenizer.ggml.x"`, `f"{arch}.context_length"`, `".context_length"`, `"attention.head_count"`."""
    keys = _gguf_keys()
    suffixes = {k.removeprefix("{arch}.") for k in keys} | keys
    tree = ast.parse(Path(module.__file__).read_text())
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    spelled = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            text = node.value
            if text == keel_gguf.ROPE_SCALE_LINEAR:
                continue
            piece = text.removeprefix("{arch}").removeprefix(".")
            bare_field = piece == text and piece in ModelConfig.__dataclass_fields__  # f.read("vocab_size", ...)
            if (piece in suffixes and not bare_field) or text.startswith(("general.", "tokenizer.")):
                spelled.append(text)
    assert not spelled, spelled


def test_keys_read_at_run_time_are_gguf_constants(tmp_path, monkeypatch):
    """What opening real files asks of the metadata (config, rope, experts, tokenizer) is all in gguf.Keys."""
    asked: set[str] = set()

    class Recording(dict):
        def get(self, key, default=None):
            asked.add(key)
            return super().get(key, default)

        def __getitem__(self, key):
            asked.add(key)
            return super().__getitem__(key)

    class RecordingFile(gguf_file.GGUFFile):
        def __init__(self, path):
            super().__init__(path)
            self.fields = Recording(self.fields)

    monkeypatch.setattr(keel_gguf, "GGUFFile", RecordingFile)
    for name in ("llama3-rope", "llama-linear-rope", "qwen2_moe", "granite", "phi3"):
        open_gguf(write_gguf(build_hf_model(name, 0, num_hidden_layers=2), tmp_path / f"{name}.gguf"))
    archs = [keel_gguf.MODEL_ARCH_NAMES[a] for a in keel_gguf._FAMILIES]
    own = {keel_gguf.ROPE_SCALE_LINEAR, keel_gguf.INDEXER_TYPES}
    templates = {k for k in _gguf_keys() | own if "{" not in k.replace("{arch}", "")}
    allowed = {k.format(arch=a) for k in templates for a in archs}
    assert asked and asked <= allowed, sorted(asked - allowed)
    registered = {k.format(arch=a) for k in keel_gguf.KEYS_READ for a in archs}  # KEYS_READ lists them all
    assert {k for k in asked if not k.startswith("tokenizer.")} <= registered
    assert {"llama.rope.scaling.type", "qwen2moe.expert_used_count", "granite.logit_scale"} <= asked
    assert {"phi3.attention.sliding_window", "tokenizer.ggml.merges"} <= asked
