"""bf16 linears pre-packed for oneDNN (keel.model.prepack): bit-identical products at every batch
size, with and without bias; the serving engine's tokens and logprobs unchanged; float32 untouched.
Where the platform has no oneDNN bf16 path (AVX2 alone, or the forced AVX2 leg), nothing is packed:
the engine serves bf16 through linears that take float32 weights for large products (UpcastLinear)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from keel.model.prepack import PackedLinear, UpcastLinear, prepack_available, prepack_linears, prepare_bf16_linears
from keel.profile.roofline import streamed_weight_bytes
from keel.serve.engine import EngineConfig
from keel.serve.llm import LLM
from keel.serve.sampling import SamplingParams
from tiny_models import save_byte_tokenizer, save_hf_model

pytestmark = pytest.mark.isa
needs_prepack = pytest.mark.skipif(not prepack_available(), reason="no oneDNN bf16 path on this CPU (keel.platform)")


@needs_prepack
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 1), (1, 7), (3, 64), (2, 300)])
def test_packed_product_is_bit_identical(bias, shape):
    torch.manual_seed(0)
    linear = nn.Linear(96, 160, bias=bias).bfloat16()
    x = torch.randn(*shape, 96).bfloat16()
    with torch.inference_mode():
        assert torch.equal(PackedLinear(linear)(x), F.linear(x, linear.weight, linear.bias))


# tied head; q/k/v biases; latent attention, whose kv_b_proj weight is read as a matrix (left unpacked)
@pytest.mark.parametrize("name", ["llama", "qwen2", "deepseek_v3-mla"])
def test_engine_outputs_unchanged_and_float32_left_alone(tmp_path, name):
    save_hf_model(name, tmp_path)
    save_byte_tokenizer(tmp_path)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, logprobs=2)
    outputs = {}
    for prepack in (True, False):
        llm = LLM(
            str(tmp_path), EngineConfig.of(dtype="bfloat16", prepack_weights=prepack, num_blocks=64, max_model_len=256)
        )
        packed = [m for m in llm.engine.model.modules() if isinstance(m, PackedLinear)]
        assert (len(packed) > 0) == (prepack and prepack_available())
        latent = [m for n, m in llm.engine.model.named_modules() if n.endswith("kv_b_proj")]
        assert all(type(m) is nn.Linear for m in latent) and len(latent) == ("mla" in name) * len(
            llm.engine.model.layers
        )
        outs = llm.generate(["hello world", "abc abc"], params, use_tqdm=False)
        outputs[prepack] = [(o.outputs[0].token_ids, [lp.logprob for lp in o.outputs[0].logprobs]) for o in outs]
    assert outputs[True] == outputs[False]
    fp32 = LLM(str(tmp_path), EngineConfig.of(dtype="float32", num_blocks=64, max_model_len=256)).engine.model
    assert not any(isinstance(m, PackedLinear) for m in fp32.modules())  # float32: aten's sums differ


def test_prepacking_follows_the_platform(tmp_path, force_isa):
    """At AVX2 (KEEL_CPU_ISA) there is no oneDNN bf16 path: prepack_linears packs nothing (the reorder
    would raise) and the engine serves bf16 through UpcastLinear (float32 weights for large products)."""
    force_isa("avx2")
    save_hf_model("llama", tmp_path)
    model = LLM(str(tmp_path), EngineConfig.of(dtype="bfloat16", num_blocks=16, max_model_len=128)).engine.model
    assert not any(isinstance(m, PackedLinear) for m in model.modules())
    assert prepack_linears(model) == 0
    upcast = [m for m in model.modules() if isinstance(m, UpcastLinear)]
    assert upcast and model.lm_head in upcast and model.lm_head.weight is model.embed_tokens.weight  # still tied


def test_upcast_head_takes_every_prompt_row(tmp_path, force_isa):
    """At AVX2 a head product of 16+ rows (prompt logprobs: every prompt row) runs on the upcast weights,
    shaped by the layer's declared width: Gemma 4's per-layer inputs once gave the tied head theirs."""
    force_isa("avx2")
    save_hf_model("gemma4-e", tmp_path)
    save_byte_tokenizer(tmp_path)
    prompt, outputs = "Once upon a time, in a land far away", {}
    for dtype in ("bfloat16", "float32"):
        llm = LLM(str(tmp_path), EngineConfig.of(dtype=dtype, num_blocks=16, max_model_len=128))
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        outputs[dtype] = torch.tensor([lp.logprob for lp in out.prompt_logprobs[1:]])
    assert isinstance(llm.engine.model.lm_head, nn.Linear)  # float32: left alone
    assert len(outputs["bfloat16"]) == len(prompt) - 1
    torch.testing.assert_close(outputs["bfloat16"], outputs["float32"], rtol=0, atol=0.05)


@needs_prepack
def test_streamed_bytes_count_packed_weights(tmp_path):
    save_hf_model("qwen2", tmp_path)
    model = LLM(
        str(tmp_path), EngineConfig.of(dtype="bfloat16", num_blocks=16, max_model_len=128, prepack_weights=False)
    ).engine.model
    before = streamed_weight_bytes(model)
    assert prepack_linears(model) > 0
    assert streamed_weight_bytes(model) == before


@pytest.mark.parametrize("rows", [1, 15, 16, 300])
def test_upcast_linear_matches_the_bf16_product(rows, force_isa):
    """Without a oneDNN bf16 path, large bf16 products run on float32 weights: the same sums as
    aten's emulated bf16 product up to float32 rounding order, in bf16, for every batch size."""
    force_isa("avx2")
    torch.manual_seed(0)
    # 1100 outputs: two full blocks of upcast rows and a partial one; [batch, rows, features] inputs.
    model = nn.Sequential(nn.Linear(96, 1100, bias=True), nn.Linear(1100, 8, bias=False)).bfloat16()
    x = torch.randn(1, rows, 96).bfloat16()
    with torch.inference_mode():
        want = model(x)
        assert prepare_bf16_linears(model) == 2 and all(isinstance(m, UpcastLinear) for m in model)
        got = model(x)
    assert got.dtype == torch.bfloat16
    if rows < model[0].rows:
        assert torch.equal(got, want)  # the bf16 product itself
    else:
        torch.testing.assert_close(got, want, rtol=1.6e-2, atol=1e-2)
