"""llama.cpp's `bitnet` GGUF files (keel.weights.gguf): BitNet b1.58 as llama.cpp's BitnetModel converter writes it
(each projection ternarized by its mean |w|, the scale folded into the stored values; older files: ternary values with
a `.scale` tensor multiplied in after the product), as float32 or in gguf's ternary blocks TQ1_0 / TQ2_0, run against
transformers' AutoBitLinear (offline: y = (x' W^T) * weight_scale, x' the activations rounded to int8 per token) on
the weights the file holds. bitnet.cpp's I2_S is refused by name."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from keel.errors import KeelError, WeightsError
from keel.quant.bitnet import BitNetLinear
from keel.quant.loading import load_model
from keel.weights.convert import convert
from keel.weights.gguf import open_gguf
from test_bitnet import _eager_transformers  # noqa: F401  (autouse: transformers' BitNet helpers run eagerly)
from test_gguf import TOKENS, add_mini_vocab, rel_err
from test_gguf_converted import text_model_keys
from test_gguf_families import finish_writer
from tiny_models import build_hf_model

pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore")

# TQ blocks hold 256 values of a row: every projection's input width a multiple of 256.
_BUILD = dict(hidden_size=256, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
_SUB_NORMS = {"self_attn.attn_sub_norm": "attn_sub_norm", "mlp.ffn_sub_norm": "ffn_sub_norm"}


def _ternarized(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """BitnetModel.weight_quant's ternary values and scale: round(w / s).clamp(-1, 1), s = mean |w|."""
    scale = w.float().abs().mean().clamp(min=1e-5)
    return (w.float() / scale).round().clamp(-1, 1), scale


def write_bitnet(hf, path, qtype: Q = Q.F32, scale_tensors: bool = False) -> dict[str, torch.Tensor]:
    """`hf` as a `bitnet` file: TextModel's keys, BitnetModel's linear rope scaling of 1, the head tied (llama.cpp
    runs the embedding), each projection ternary times its scale (or ternary with a `.scale` tensor), in `qtype`
    where it is a projection. Returns transformers' AutoBitLinear state of what the file holds."""
    cfg = hf.config
    w = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.BITNET])
    text_model_keys(w, cfg.to_dict())
    w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    w.add_rope_scaling_factor(1.0)
    add_mini_vocab(w, "default")
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.BITNET, cfg.num_hidden_layers)
    state: dict[str, torch.Tensor] = {}
    for name, t in hf.state_dict().items():
        if name == "lm_head.weight":
            state[name] = t
            continue
        base = name.removesuffix(".weight")
        sub = next((gguf_sub for hf_sub, gguf_sub in _SUB_NORMS.items() if base.endswith(hf_sub)), None)
        gguf_name = f"blk.{base.split('.')[2]}.{sub}.weight" if sub else f"{names.get_name(base)}.weight"
        if not name.endswith("_proj.weight"):
            w.add_tensor(gguf_name, t.float().numpy())
            state[name] = t
            continue
        ternary, scale = _ternarized(t)
        values = (ternary if scale_tensors else ternary * scale).numpy()
        if qtype != Q.F32:
            values = gguf.quants.dequantize(stored := gguf.quants.quantize(values, qtype), qtype).reshape(values.shape)
            w.add_tensor(gguf_name, stored, raw_dtype=qtype)
        else:
            w.add_tensor(gguf_name, values)
        state[name] = torch.from_numpy(np.ascontiguousarray(values))
        state[f"{base}.weight_scale"] = scale.reshape(1) if scale_tensors else torch.ones(1)
        if scale_tensors:
            w.add_tensor(gguf_name.replace(".weight", ".scale"), scale.reshape(1).numpy())
    finish_writer(w)
    return state


def _transformers_bitnet(hf, state: dict[str, torch.Tensor]):
    from transformers import BitNetQuantConfig
    from transformers.integrations.bitnet import replace_with_bitnet_linear

    quant = BitNetQuantConfig(linear_class="autobitlinear", quantization_mode="offline")
    replace_with_bitnet_linear(hf, ["lm_head"], quant)
    hf.load_state_dict(state, strict=True, assign=True)
    return hf.eval()


@pytest.mark.parametrize(
    "qtype, scale_tensors",
    [(Q.F32, False), (Q.TQ1_0, False), (Q.TQ2_0, False), (Q.TQ2_0, True)],
    ids=["f32", "tq1_0", "tq2_0", "tq2_0-scale-tensors"],
)
def test_bitnet_gguf_matches_transformers_on_the_files_weights(tmp_path, qtype, scale_tensors):
    """Whole models, float32. (Rounding activations to int8 turns a last-bit difference upstream into a whole step
    where a value lands on a tie, as in test_bitnet: seed 0's models meet none, seed 1's TQ models one.)"""
    hf = build_hf_model("bitnet", 0, tie_word_embeddings=True, **_BUILD)
    state = write_bitnet(hf, tmp_path / "b.gguf", qtype, scale_tensors)
    loaded = load_model(tmp_path / "b.gguf", "float32")
    c, reader = loaded.config, loaded.checkpoint.reader
    assert c.architecture == "bitnet" and c.attn_sub_norm and c.ffn_sub_norm and c.tie_word_embeddings
    assert reader.gguf_names("model.layers.1.mlp.ffn_sub_norm.weight") == ["blk.1.ffn_sub_norm.weight"]
    assert reader.dtype("model.layers.0.self_attn.q_proj.weight") == qtype.name
    layers = [m for m in loaded.model.modules() if isinstance(m, BitNetLinear)]
    assert len(layers) == 7 * hf.config.num_hidden_layers and type(loaded.model.lm_head) is torch.nn.Linear
    assert {m.linear_class for m in layers} == {"autobitlinear"}
    scale = layers[0].weight_scale.item()
    assert scale == pytest.approx(state["model.layers.0.self_attn.q_proj.weight_scale"].item(), rel=1e-6)
    assert (scale != 1.0) == scale_tensors
    with pytest.raises(KeelError, match="BitNet"):  # float tensors without the int8 activations: another model
        convert(tmp_path / "b.gguf", tmp_path / "back")
    ref = _transformers_bitnet(hf, state)
    with torch.no_grad():
        assert rel_err(ref(TOKENS).logits, loaded.model(TOKENS)) <= 1e-4


def test_bitnet_gguf_ternary_blocks_hold_the_converters_values(tmp_path):
    """TQ2_0 / TQ1_0 keep each ternary value and the scale to fp16 (the block's d is its max |w|: the scale)."""
    hf = build_hf_model("bitnet", 0, tie_word_embeddings=True, **_BUILD)
    write_bitnet(hf, tmp_path / "b.gguf", Q.TQ1_0)
    reader = open_gguf(tmp_path / "b.gguf").reader
    ternary, scale = _ternarized(hf.state_dict()["model.layers.0.mlp.down_proj.weight"])
    got = reader.get("model.layers.0.mlp.down_proj.weight")
    torch.testing.assert_close(got, ternary * scale.half().float(), rtol=0, atol=0)


def test_i2_s_tensors_are_refused_by_name(tmp_path):
    """bitnet.cpp's I2_S (type id 36, not gguf-py's): a one-line error naming it, not "corrupt"."""
    path = tmp_path / "i2s.gguf"
    hf = build_hf_model("bitnet", 0, tie_word_embeddings=True, **_BUILD)
    write_bitnet(hf, path, Q.TQ2_0)
    data = bytearray(path.read_bytes())
    name = b"blk.0.attn_q.weight"
    at = data.index(name) + len(name) + 4 + 8 * 2  # past the name, n_dims and two dims: the type id
    assert int.from_bytes(data[at : at + 4], "little") == Q.TQ2_0
    data[at : at + 4] = (36).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(WeightsError, match="I2_S"):
        open_gguf(path)
