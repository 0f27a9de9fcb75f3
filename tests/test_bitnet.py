"""BitNet b1.58's quantized releases (quantization_config, quant_method bitnet) against transformers' BitLinear /
AutoBitLinear layers: ternary weights packed as transformers packs them, int8 activations per token."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from keel.errors import ConfigError, KeelError
from keel.quant.bitnet import BitNetLinear, unpack_ternary
from keel.quant.loading import load_model
from keel.serve.engine import EngineConfig
from keel.serve.llm import LLM
from keel.serve.sampling import SamplingParams
from reference_generate import stream_tokens
from tiny_models import build_hf_model, save_byte_tokenizer

pytestmark = pytest.mark.filterwarnings("ignore")

MODES = [
    {"linear_class": "bitlinear", "quantization_mode": "offline"},
    {"linear_class": "autobitlinear", "quantization_mode": "offline"},
    {"linear_class": "autobitlinear", "quantization_mode": "online"},
]


@pytest.fixture(autouse=True)
def _eager_transformers(monkeypatch):
    """transformers' BitNet helpers are torch.compile'd: run them eagerly (the same ops, no compiler needed; keel's
    own compiled decode step still compiles)."""
    import transformers.integrations.bitnet as bitnet

    def eager(f):
        return f._torchdynamo_orig_callable

    monkeypatch.setattr(bitnet, "unpack_weights", eager(bitnet.unpack_weights))
    for cls, name in [(bitnet.BitLinear, "activation_quant"), (bitnet.BitLinear, "post_quant_process")]:
        monkeypatch.setattr(cls, name, eager(cls.__dict__[name]))
    for cls in (bitnet.WeightQuant, bitnet.ActQuant):
        monkeypatch.setattr(cls, "forward", staticmethod(eager(cls.__dict__["forward"].__func__)))


def _save_quantized(directory, quant: dict, seed: int = 0, packed: bool = True, **overrides):
    """A tiny BitNet checkpoint in its released form, and transformers' model of it (BitLinear / AutoBitLinear layers
    holding the same tensors). Offline: each linear weight ternarized by its mean |w| and packed with transformers'
    pack_weights, its weight_scale the factor that undoes the ternarization; online: the float master weights."""
    from transformers import BitNetQuantConfig
    from transformers.integrations.bitnet import pack_weights, replace_with_bitnet_linear, unpack_weights

    hf = build_hf_model("bitnet", seed, **overrides)
    hf.config.quantization_config = {"quant_method": "bitnet", **quant}
    hf.save_pretrained(directory)
    state = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    online = quant["quantization_mode"] == "online"
    if not online:
        for name in [k for k in state if k.endswith("_proj.weight")]:
            w = state[name]
            s = 1.0 / w.abs().mean().clamp(min=1e-5)
            ternary = (w * s).round().clamp(-1, 1)
            state[name] = pack_weights(ternary.clone()) if packed else ternary
            scale = 1.0 / s if quant["linear_class"] == "autobitlinear" else s  # y * scale vs y / scale
            state[name.removesuffix("weight") + "weight_scale"] = scale.reshape(1)
    save_file({k: v.contiguous() for k, v in state.items()}, directory / "model.safetensors")
    config = json.loads((directory / "config.json").read_text())
    assert config["quantization_config"]["linear_class"] == quant["linear_class"]

    if not packed:
        return None
    replace_with_bitnet_linear(hf, ["lm_head"], BitNetQuantConfig(**quant))
    if quant["linear_class"] == "autobitlinear" and not online:  # transformers unpacks these at load
        state = {k: unpack_weights(v, torch.float32) if v.dtype == torch.uint8 else v for k, v in state.items()}
    hf.load_state_dict(state, strict=True, assign=True)
    return hf.eval()


def _max_rel(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).abs().max() / ref.abs().max()).item()


def test_unpacking_inverts_transformers_packing():
    from transformers.integrations.bitnet import pack_weights, unpack_weights

    ternary = torch.randint(-1, 2, (12, 5), generator=torch.Generator().manual_seed(0)).float()
    packed = pack_weights(ternary.clone())
    assert packed.shape == (3, 5)
    assert torch.equal(unpack_ternary(packed, torch.float32), ternary)
    assert torch.equal(unpack_ternary(packed, torch.float32), unpack_weights(packed, torch.float32))


IDS = [f"{q['linear_class']}-{q['quantization_mode']}" for q in MODES]


@pytest.mark.parametrize("quant", MODES, ids=IDS)
def test_quantized_bitnet_logits_and_greedy_tokens_match_transformers(tmp_path, quant):
    """Whole models, float32. Rounding activations to int8 turns float32's last-bit differences upstream (keel's norms
    and attention against transformers') into a whole step where one lands on a tie: seed 1's models meet none (other
    seeds' may, one value in ~10^5); the next test compares every layer exactly, on keel's own activations."""
    hf = _save_quantized(tmp_path, quant, seed=1)
    model = load_model(tmp_path, "float32").model
    layers = [m for m in model.modules() if isinstance(m, BitNetLinear)]
    assert len(layers) == 7 * 3  # q, k, v, o, gate, up, down in each layer; the head stays float
    assert type(model.lm_head) is torch.nn.Linear
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref, ours = hf(tokens).logits, model(tokens)
    assert _max_rel(ours, ref) <= 1e-4
    prompt = tokens[0, :8].tolist()
    hf.generation_config.eos_token_id = None  # 16 tokens whatever the random model predicts
    with torch.no_grad():
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, pad_token_id=0)
    ours = list(stream_tokens(model, prompt, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)))
    assert len(ours) == 16
    assert ours == expected[0, 8:].tolist()


@pytest.mark.parametrize("quant", MODES, ids=IDS)
@pytest.mark.parametrize("seed", [0, 3])
def test_every_bitnet_layer_equals_transformers_on_keels_activations(tmp_path, quant, seed):
    hf = _save_quantized(tmp_path, quant, seed=seed)
    model = load_model(tmp_path, "float32").model
    inputs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def record(name: str):
        def hook(module, args, out) -> None:
            inputs[name] = (args[0], out)

        return hook

    hooks = [m.register_forward_hook(record(n)) for n, m in model.named_modules() if isinstance(m, BitNetLinear)]
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model(tokens)
        for hook in hooks:
            hook.remove()
        assert len(inputs) == 21
        for name, (x, ours) in inputs.items():
            assert torch.equal(ours, hf.model.get_submodule(name)(x)), name


def test_the_releases_form_autobitlinear_offline_with_a_tied_head(tmp_path):
    """microsoft/bitnet-b1.58-2B-4T's: packed AutoBitLinear layers, the head the embedding (left in float)."""
    hf = _save_quantized(tmp_path, MODES[1], seed=1, tie_word_embeddings=True)
    model = load_model(tmp_path, "float32").model
    assert type(model.lm_head) is torch.nn.Linear and model.lm_head.weight is model.embed_tokens.weight
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert _max_rel(model(tokens), hf(tokens).logits) <= 1e-4


def test_activation_quantization_is_not_dropped(tmp_path):
    """The float product of the same ternary weights differs: the int8 step is what makes the model's numbers."""
    hf = _save_quantized(tmp_path, MODES[0])
    model = load_model(tmp_path, "float32").model
    layer = model.get_submodule("layers.0.self_attn.q_proj")
    x = torch.randn(3, layer.in_features)
    plain = x @ layer.weight.T / layer.weight_scale
    assert not torch.allclose(layer(x), plain, rtol=1e-5, atol=0)
    assert torch.allclose(layer(x), hf.model.get_submodule("layers.0.self_attn.q_proj")(x), rtol=1e-6, atol=1e-6)


def test_bitlinear_refuses_unpacked_weights(tmp_path):
    _save_quantized(tmp_path, MODES[0], packed=False)
    with pytest.raises(KeelError, match="bitlinear tensor .*q_proj.weight has shape"):
        load_model(tmp_path, "float32")


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        ("use_rms_norm", True, "use_rms_norm"),
        ("linear_class", "ternarylinear", "linear_class 'ternarylinear'"),
        ("quantization_mode", "qat", "quantization_mode 'qat'"),
    ],
)
def test_unsupported_bitnet_options_are_refused_by_name(tmp_path, key, value, match):
    _save_quantized(tmp_path, MODES[0])
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"][key] = value
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=match):
        load_model(tmp_path, "float32")


def test_bitnet_layers_are_not_quantized_again(tmp_path):
    _save_quantized(tmp_path, MODES[0])
    with pytest.raises(KeelError, match="--quantize int8: a BitNet checkpoint's ternary layers"):
        load_model(tmp_path, "float32", quantize="int8")


def test_bitnet_checkpoints_are_not_converted(tmp_path):
    """Its float tensors alone, without the activations' int8 step, would be another model."""
    from keel.weights.convert import convert

    _save_quantized(tmp_path / "src", MODES[0])
    with pytest.raises(KeelError, match="BitNet checkpoint's ternary layers .* are not converted"):
        convert(tmp_path / "src", tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_quantized_bitnet_serves_transformers_greedy_tokens(tmp_path):
    """The engine (paged KV cache, the compiled decode step) on BitNet's ternary layers, int8 activations included."""
    hf = _save_quantized(tmp_path, MODES[0], seed=1)
    save_byte_tokenizer(tmp_path)
    hf.generation_config.eos_token_id = None
    prompts = [list(range(40, 60)), [5, 6, 7, 8, 9]]
    expected = []
    with torch.no_grad():
        for ids in prompts:
            out = hf.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, pad_token_id=0)
            expected.append(out[0, len(ids) :].tolist())
    config = EngineConfig.of(dtype="float32", compile=True, num_blocks=32, max_model_len=128, block_size=8)
    llm = LLM(str(tmp_path), config)
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert llm.engine.runner.compiled is not None and llm.engine.runner.compiled.steps > 0
