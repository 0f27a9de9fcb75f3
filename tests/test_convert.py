"""HF export: what keel opens, written as an HF directory that transformers (and keel) load alike."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers

from keel.config import ModelConfig
from keel.errors import KeelError, WeightsError
from keel.quant.loading import load_model
from keel.tokenizer import Tokenizer
from keel.tools.align import transformers_model
from keel.weights.checkpoint import Checkpoint
from keel.weights.convert import convert, output_dtype
from tiny_models import COMMON, TINY_CONFIGS, save_hf_model

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

TOKENS = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def _keel_logits(path) -> torch.Tensor:
    loaded = load_model(path)
    with torch.no_grad():
        logits = loaded.model(TOKENS)
    loaded.checkpoint.reader.close()
    return logits


def _hf_logits(path) -> torch.Tensor:
    model = transformers_model(path).eval()
    with torch.no_grad():
        return model(TOKENS).logits


def _tensors(path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
        return {name: f.get_tensor(name) for name in f.keys()}


def _siblings(path) -> list[str]:
    return sorted(p.name for p in path.parent.iterdir() if p.name.startswith(f".{path.name}."))


LIGHTNING_TABLES = ("slope_rate", "query_decay", "key_decay", "diagonal_decay")


@pytest.mark.parametrize("name", list(TINY_CONFIGS))
def test_round_trip(name, tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    save_hf_model(name, src)
    assert convert(src, dst) == dst
    assert sorted(p.name for p in dst.iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
    ]
    assert json.loads((dst / "config.json").read_text())["dtype"] == "float32"
    assert ModelConfig.from_json_file(dst / "config.json") == ModelConfig.from_json_file(src / "config.json")

    # Same hub names (per-expert MoE weights, no lm_head when tied) and the same float32 values.
    before, after = _tensors(src / "model.safetensors"), _tensors(dst / "model.safetensors")
    # MiniMax's lightning layers: transformers saves its decay tables, functions of the layer's place that keel
    # computes (keel.model.lightning.slopes) and does not write; transformers computes them when absent
    before = {n: t for n, t in before.items() if not n.endswith(LIGHTNING_TABLES)}
    assert sorted(after) == sorted(before)
    assert all(torch.equal(after[n], before[n]) for n in before)

    reference = _keel_logits(src)
    assert _rel_err(_hf_logits(dst), reference) <= 1e-4
    assert torch.equal(_keel_logits(dst), reference)


def test_sharded_round_trip(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    save_hf_model("qwen2_moe", src)
    convert(src, dst, max_shard_bytes=64 * 1024)
    files = sorted(p.name for p in dst.glob("*.safetensors"))
    assert len(files) > 2 and not (dst / "model.safetensors").exists()
    assert files == [f"model-{i:05d}-of-{len(files):05d}.safetensors" for i in range(1, len(files) + 1)]
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(files)
    shards = {f: _tensors(dst / f) for f in files}
    assert all(name in shards[f] for name, f in index["weight_map"].items())
    assert sum(len(t) for t in shards.values()) == len(index["weight_map"])
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for s in shards.values() for t in s.values()
    )
    assert set(index["weight_map"]) == set(_tensors(src / "model.safetensors"))
    # An ordinary model directory: every file readable by others (safetensors alone creates them 0600).
    assert all(p.stat().st_mode & 0o044 == 0o044 for p in [dst, *dst.iterdir()])

    reference = _keel_logits(src)
    assert _rel_err(_hf_logits(dst), reference) <= 1e-4
    assert torch.equal(_keel_logits(dst), reference)


def test_dtype_bfloat16(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    save_hf_model("qwen3", src)
    convert(src, dst, dtype="bfloat16")
    assert json.loads((dst / "config.json").read_text())["dtype"] == "bfloat16"
    before, after = _tensors(src / "model.safetensors"), _tensors(dst / "model.safetensors")
    assert all(after[n].dtype == torch.bfloat16 and torch.equal(after[n], before[n].bfloat16()) for n in before)
    assert load_model(dst).checkpoint.config.dtype == "bfloat16"
    with pytest.raises(KeelError, match="--dtype 'int3'"):
        convert(src, tmp_path / "other", dtype="int3")


def test_refuses_to_overwrite(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    save_hf_model("llama", src)
    dst.mkdir()  # an empty directory is fine
    convert(src, dst)
    with pytest.raises(KeelError) as info:
        convert(src, dst, dtype="bfloat16")
    assert str(dst) in str(info.value) and "\n" not in str(info.value)
    assert json.loads((dst / "config.json").read_text())["dtype"] == "float32"  # untouched

    convert(src, dst, dtype="bfloat16", overwrite=True)
    assert json.loads((dst / "config.json").read_text())["dtype"] == "bfloat16"
    assert _siblings(dst) == []  # no temporary or old directories left behind


def test_refuses_the_current_directory_or_one_that_holds_it(tmp_path, monkeypatch):
    """`keel convert SRC . --overwrite` would rename the shell's own directory away from under it."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    save_hf_model("llama", src)
    (dst / "inner").mkdir(parents=True)
    monkeypatch.chdir(dst / "inner")
    for name in (".", "./", "..", str(dst)):
        with pytest.raises(KeelError, match="current directory"):
            convert(src, name, overwrite=True)
    assert sorted(p.name for p in dst.iterdir()) == ["inner"] and list((dst / "inner").iterdir()) == []
    assert convert(src, "model") == dst / "inner" / "model"  # a relative name below it, made absolute
    assert (dst / "inner" / "model" / "config.json").is_file()


def test_failure_leaves_nothing(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    save_hf_model("llama", src)
    tensors = _tensors(src / "model.safetensors")
    del tensors["model.layers.2.mlp.up_proj.weight"]
    from safetensors.torch import save_file

    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(WeightsError, match="up_proj"):
        convert(src, dst)
    assert not dst.exists() and _siblings(dst) == []


def test_tokenizer_and_generation_config(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    save_hf_model("llama", src)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 256)}}
    hf_tokenizer = HFTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    hf_tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    template = "{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}"
    Tokenizer(hf_tokenizer, chat_template=template, bos_token="<s>", eos_token="</s>").save_hf(src)

    convert(src, dst)
    keel_tokenizer = Tokenizer.from_hf_dir(dst)
    assert keel_tokenizer.chat_template == template
    assert keel_tokenizer.encode("w3 w7 w200") == [3, 7, 200]
    auto = transformers.AutoTokenizer.from_pretrained(dst)
    messages = [{"role": "user", "content": "w5 w6"}]
    assert auto.apply_chat_template(messages, tokenize=False) == keel_tokenizer.apply_chat_template(messages, False)

    generation = transformers.GenerationConfig.from_pretrained(dst)
    assert (generation.bos_token_id, generation.eos_token_id) == (1, 2)


def test_from_shapes(tmp_path):
    """A directory without config.json converts into one that transformers loads."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    save_hf_model("qwen2", src)  # its unrecoverable values are Qwen2's defaults
    (src / "config.json").unlink()
    convert(src, dst, head_dim=16)
    config = json.loads((dst / "config.json").read_text())
    assert (config["architectures"], config["num_attention_heads"], config["head_dim"]) == (
        ["Qwen2ForCausalLM"],
        4,
        16,
    )
    assert _rel_err(_hf_logits(dst), _keel_logits(dst)) <= 1e-4


def _checkpoint(fmt: str, storage: dict[str, int], dtype: str = "float32") -> Checkpoint:
    config = ModelConfig("llama", 16, 8, 16, 1, 2, 2, 4, dtype=dtype)
    return Checkpoint(path=None, format=fmt, config=config, reader=None, tokenizer=None, bytes_by_dtype=storage)


def test_output_dtype():
    assert output_dtype(_checkpoint("hf", {"BF16": 10}, "bfloat16"), None) == "bfloat16"
    assert output_dtype(_checkpoint("hf", {"F32": 10}), "auto") == "float32"
    assert output_dtype(_checkpoint("hf", {"F32": 10}), "float16") == "float16"
    # Quantized GGUF weights have no float dtype of their own: bfloat16.
    assert output_dtype(_checkpoint("gguf", {"Q4_1": 10, "F32": 2}), None) == "bfloat16"
    assert output_dtype(_checkpoint("gguf", {"F16": 10, "F32": 2}, "float16"), None) == "float16"
    with pytest.raises(KeelError, match="--dtype"):
        output_dtype(_checkpoint("hf", {}), "fp8")


def test_olmo_hybrid_convolutions_saved_in_thirds_are_read_and_written_by_width(tmp_path):
    """transformers saves OLMo Hybrid's fused q/k/v convolution cut into equal thirds whatever the widths (values
    twice as wide as keys here, as in the releases): keel reads each stored block at its own width, and `keel
    convert` writes q_conv1d / k_conv1d / v_conv1d at q's, k's and v's widths, which transformers concatenates into
    the same model."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    save_hf_model("olmo_hybrid", src, linear_value_head_dim=16)  # keys 2 x 16, values 4 x 16: 128 channels
    reference = _hf_logits(src)
    assert _rel_err(_keel_logits(src), reference) <= 1e-4
    convert(src, dst)
    before, after = _tensors(src / "model.safetensors"), _tensors(dst / "model.safetensors")
    widths = [before[f"model.layers.0.linear_attn.{p}_conv1d.weight"].shape[0] for p in "qkv"]
    assert widths == [43, 43, 42]  # torch.chunk's thirds
    assert [after[f"model.layers.0.linear_attn.{p}_conv1d.weight"].shape[0] for p in "qkv"] == [32, 32, 64]
    assert sorted(after) == sorted(before)
    assert _rel_err(_hf_logits(dst), reference) <= 1e-4


def test_a_model_its_config_json_cannot_hold_is_not_exported(tmp_path):
    """A keel option set on a config built by hand (a q/k norm on a Llama) is not written as Llama's config.json,
    which would read back as another model: the export names the field and writes nothing."""
    import dataclasses

    from keel.errors import ConfigError
    from keel.model.transformer import Transformer
    from keel.weights.convert import save_model

    save_hf_model("llama", tmp_path / "hf")
    config = ModelConfig.from_hf(json.loads((tmp_path / "hf" / "config.json").read_text()))
    assert ModelConfig.from_hf(config.exported_hf()) == dataclasses.replace(config, dtype=ModelConfig.dtype)
    normed = dataclasses.replace(config, qk_norm=True)
    with pytest.raises(ConfigError, match="qk_norm True"):
        normed.exported_hf()
    with pytest.raises(ConfigError, match="cannot hold"):
        save_model(Transformer(normed), None, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 10000.0},
        {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
    ],
    ids=["yarn", "linear"],
)
def test_phi3_rope_scaling_other_than_longrope_is_exported(rope):
    """Phi-3's pre-training context is written at the top level, which keel (as transformers) reads before the rope
    parameters': written as max_position_embeddings for YaRN, it read back as another model (refused by name)."""
    hf = {**COMMON, **TINY_CONFIGS["phi3-longrope"][2], "architectures": ["Phi3ForCausalLM"], "rope_parameters": rope}
    config = ModelConfig.from_hf(hf)
    assert config.rope_scaling.type == rope["rope_type"]
    assert ModelConfig.from_hf(config.exported_hf()).rope_scaling == config.rope_scaling
