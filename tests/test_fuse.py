"""Fused q/k/v and gate/up projections (keel.model.fuse): the serving engine's outputs are the
same bits with and without them, on every dense family (biases, q/k norms, sliding windows) and on
MoE models (attention fused, experts left alone); quantized layers are not fused."""

from __future__ import annotations

import pytest
import torch

from keel import kernels
from keel.model.attention import Attention
from keel.model.fuse import fuse_projections
from keel.model.layers import SwiGLU
from keel.quant import QuantizedLinear
from keel.serve.engine import EngineConfig
from keel.serve.llm import LLM
from keel.serve.sampling import SamplingParams
from tiny_models import save_byte_tokenizer, save_hf_model

pytestmark = pytest.mark.isa  # run again under KEEL_CPU_ISA=avx2 by `make test`

PROMPTS = ["hello world", "the cat sat on", "a b c d e f g"]


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3", "mistral", "qwen2_moe"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_projections_change_no_output(tmp_path, name, dtype):
    save_hf_model(name, tmp_path)
    save_byte_tokenizer(tmp_path)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2)
    outputs = {}
    for fuse in (True, False):
        llm = LLM(str(tmp_path), EngineConfig.of(dtype=dtype, fuse_projections=fuse, num_blocks=64, max_model_len=256))
        attns = [m for m in llm.engine.model.modules() if isinstance(m, Attention)]
        assert all((m.qkv_proj is not None) == fuse for m in attns) and attns
        assert all(not hasattr(m, "q_proj") for m in attns) == fuse  # the separate weights are gone
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        outputs[fuse] = [(o.outputs[0].token_ids, [lp.logprob for lp in o.outputs[0].logprobs]) for o in outs]
    assert outputs[True] == outputs[False]


def test_dense_mlp_fused_and_quantized_layers_left_alone(tmp_path):
    save_hf_model("llama", tmp_path)
    save_byte_tokenizer(tmp_path)
    llm = LLM(str(tmp_path), EngineConfig.of(num_blocks=64, max_model_len=256))
    mlps = [m for m in llm.engine.model.modules() if isinstance(m, SwiGLU)]
    assert mlps and all(m.gate_up_proj is not None for m in mlps)
    assert fuse_projections(llm.engine.model) == 0  # already fused: nothing more to do
    quantized = LLM(str(tmp_path), EngineConfig.of(num_blocks=64, max_model_len=256, quantize="int8"))
    attentions = [m for m in quantized.engine.model.modules() if isinstance(m, Attention)]
    if kernels.enabled():  # keel's block layers fuse themselves (QuantizedLinear.fused_with); torch's do not
        assert all(isinstance(m.qkv_proj, QuantizedLinear) and m.qkv_proj.layout == "blocks" for m in attentions)
    else:
        assert all(m.qkv_proj is None for m in attentions)
    with torch.no_grad():  # the fused weight is the rows of the three, in order
        attn = next(m for m in llm.engine.model.modules() if isinstance(m, Attention))
        assert attn.qkv_proj.weight.shape[0] == sum(attn.qkv_sizes)
