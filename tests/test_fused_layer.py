"""keel::decoder_layers (keel.model.fused_layer): a serving step's layers in one kernel call give
the modules' tokens and logprobs bit for bit, for dense float32 and block-quantized weights, with
biases, q/k norms and sliding windows, over prefill chunks, mixed steps and batched decodes; caches
and layers it does not cover run the modules."""

from __future__ import annotations

import contextlib

import pytest

from keel import kernels
from keel.model import fused_layer, transformer
from keel.quant import linear as quant_linear
from keel.serve.engine import EngineConfig
from keel.serve.llm import LLM
from keel.serve.sampling import SamplingParams
from tiny_models import save_byte_tokenizer, save_hf_model

pytestmark = [
    pytest.mark.isa,  # run again under KEEL_CPU_ISA=avx2 by `make test`
    pytest.mark.skipif(not kernels.active(), reason=f"keel's kernels do not run here: {kernels.status()}"),
]

PROMPTS = ["hello world", "the cat sat on the mat and", "a", "zz top " * 6]


@pytest.fixture
def fused_calls(monkeypatch):
    """How many layers of all steps ran fused (keel::decoder_layers, the whole stack or layer by layer)
    rather than through the modules, and how many stack calls ran."""
    calls = {"fused": 0, "all": 0, "stacks": 0}
    real_layer, real_stack = transformer.fused_forward, transformer.fused_layers

    def layer_counting(layer, x, meta):  # noqa: ANN001, ANN202
        out = real_layer(layer, x, meta)
        calls["fused"] += out is not None
        calls["all"] += 1
        return out

    def stack_counting(layers, x, meta):  # noqa: ANN001, ANN202
        out = real_stack(layers, x, meta)
        if out is not None:
            calls["fused"] += len(layers)
            calls["all"] += len(layers)
            calls["stacks"] += 1
        return out

    monkeypatch.setattr(transformer, "fused_forward", layer_counting)
    monkeypatch.setattr(transformer, "fused_layers", stack_counting)
    return calls


def _llm(path, **options) -> LLM:
    options = {"dtype": "float32", **options}
    config = EngineConfig.of(
        num_blocks=64, max_model_len=256, block_size=8, compile=False, quant_group_size=32, **options
    )
    return LLM(str(path), config)


def _run(llm: LLM, fused: bool) -> list:
    params = [
        SamplingParams(max_tokens=8 + 5 * i, temperature=0.0, ignore_eos=True, logprobs=3) for i in range(len(PROMPTS))
    ]
    with contextlib.nullcontext() if fused else fused_layer.modules_only():
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]


def _generate(path, fused: bool, **options) -> list:
    return _run(_llm(path, **options), fused)


@pytest.mark.parametrize("name", ["llama", "llama-bias", "qwen3", "mistral"])  # tied; biases; q/k norms; window 8
@pytest.mark.parametrize("quantize", [None, "int4", "int8"])
def test_fused_layers_give_the_modules_results(tmp_path, fused_calls, name, quantize, monkeypatch):
    # 8-bit layers dequantize for BLAS from a few rows, and the stack leaves such steps (the prompts') to
    # the modules; here every step is to run fused, so the kernels take every size.
    monkeypatch.setattr(quant_linear, "EIGHT_BIT_DEQUANTIZE_ROWS", {1: 1 << 30, 2: 1 << 30})
    monkeypatch.setattr(quant_linear, "STORED_DEQUANTIZE_ROWS", dict.fromkeys(quant_linear.STORED_DEQUANTIZE_ROWS))
    save_hf_model(name, tmp_path)
    save_byte_tokenizer(tmp_path)
    modules = _generate(tmp_path, False, quantize=quantize)
    assert fused_calls["fused"] == 0  # modules_only really ran the modules
    fused = _generate(tmp_path, True, quantize=quantize)
    assert fused_calls["fused"] == fused_calls["all"] / 2  # every layer of every step of the second run
    assert fused_calls["stacks"] > 0  # the whole stack in one call
    assert fused == modules


@pytest.mark.parametrize("name", ["llama", "qwen3", "mistral"])  # tied; q/k norms; window 8
def test_an_int8_cache_runs_fused_with_the_modules_results(tmp_path, fused_calls, name):
    """kv_cache_dtype="int8": the stack quantizes each K/V row as keel.serve.kv_quant.quantize_kv does
    (the same codes and float16 scales) and attends over them in place; tokens and logprobs as the
    modules', which write through torch and attend with the same kernel."""
    save_hf_model(name, tmp_path)
    save_byte_tokenizer(tmp_path)
    modules = _generate(tmp_path, False, quantize="int4", kv_cache_dtype="int8")
    fused = _generate(tmp_path, True, quantize="int4", kv_cache_dtype="int8")
    assert fused_calls["stacks"] > 0 and fused_calls["fused"] == fused_calls["all"] / 2
    assert fused == modules
    assert fused != _generate(tmp_path, True, quantize="int4", kv_cache_dtype="bfloat16")  # int8 rows differ


def test_a_bfloat16_cache_runs_fused_with_the_modules_results(tmp_path, fused_calls):
    """kv_cache_dtype="bfloat16" under float32 activations: the stack writes bfloat16 rows (rounded as torch
    rounds) and attends over them in place; tokens and logprobs as the modules'."""
    save_hf_model("mistral", tmp_path)
    save_byte_tokenizer(tmp_path)
    modules = _generate(tmp_path, False, quantize="int4", kv_cache_dtype="bfloat16")
    fused = _generate(tmp_path, True, quantize="int4", kv_cache_dtype="bfloat16")
    assert fused_calls["stacks"] > 0 and fused == modules
    assert fused != _generate(tmp_path, True, quantize="int4")  # the float32 cache's logprobs differ


@pytest.mark.parametrize("level", kernels.levels_here())
def test_fused_layers_agree_at_every_kernel_level(tmp_path, fused_calls, level):
    save_hf_model("qwen3", tmp_path)
    save_byte_tokenizer(tmp_path)
    with kernels.using_level(level):
        modules = _generate(tmp_path, False, quantize="int4")
        fused = _generate(tmp_path, True, quantize="int4")
    assert fused_calls["fused"] > 0 and fused == modules


def test_caches_and_steps_it_does_not_cover_run_the_modules(tmp_path, fused_calls):
    save_hf_model("llama", tmp_path)
    save_byte_tokenizer(tmp_path)
    _generate(tmp_path, True, dtype="bfloat16")  # bf16 activations keep torch's ops
    assert fused_calls["fused"] == 0


def test_layer_by_layer_where_the_stack_does_not_run(tmp_path, fused_calls, monkeypatch):
    """Where the whole stack cannot go in one call (a layer of another kind in it), each qualifying layer
    still runs fused on its own, with the same results."""
    save_hf_model("llama-bias", tmp_path)
    save_byte_tokenizer(tmp_path)
    modules = _generate(tmp_path, False, quantize="int4")
    monkeypatch.setattr(transformer, "fused_layers", lambda layers, x, meta: None)
    fused = _generate(tmp_path, True, quantize="int4")
    assert fused_calls["stacks"] == 0 and fused_calls["fused"] == fused_calls["all"] / 2
    assert fused == modules


def test_kept_stacks_follow_changes_to_the_layers(tmp_path, fused_calls):
    """The stack's argument lists are kept between steps: a change of activation passes
    (set_activations) or of a module (here the first layer's down projection swapped for another's)
    after the first requests is seen by the next ones, whose results stay the modules'."""
    from keel.quant.apply import set_activations

    save_hf_model("llama", tmp_path)
    save_byte_tokenizer(tmp_path)
    llm = _llm(tmp_path, quantize="int4")
    model = llm.engine.model
    refined = _run(llm, True)
    set_activations(model, "int8")
    one_pass = _run(llm, True)
    assert one_pass == _run(llm, False) and one_pass != refined
    layers = model.layers
    layers["0"].mlp.down_proj = layers["1"].mlp.down_proj
    swapped = _run(llm, True)
    assert swapped == _run(llm, False) and swapped != one_pass
    assert fused_calls["stacks"] > 0
    # Kept stacks hold their lists on the C++ side (keel.DecoderStack), converted once.
    kept = layers.__dict__["_keel_stacks"][3]
    assert any(stack is not None and stack.held is not None for stack in kept.values())


@pytest.mark.parametrize("options", [dict(clip_qkv=0.3), dict(norm_affine=False)])
def test_layers_it_does_not_run_are_left_to_the_modules(options):
    """OLMo's clamped q/k/v and weightless norms (keel::decoder_layers has neither): the layer runs its modules,
    where the same layer without them would run fused."""
    import torch

    from keel.config import ModelConfig
    from keel.model.fuse import fuse_projections
    from keel.model.transformer import build_model

    shape = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4, num_kv_heads=2)
    layers = []
    for extra in ({}, options):
        model = build_model(ModelConfig(architecture="llama", head_dim=8, **shape, **extra))
        with torch.no_grad():
            fuse_projections(model)
        layers.append(model.layers["0"])
    assert fused_layer._layer_parts(layers[0], 1) is not None
    assert fused_layer._layer_parts(layers[1], 1) is None
