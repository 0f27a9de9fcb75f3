"""GPT-OSS (keel.families.gpt_oss): softmax sinks on every attention path, biased experts with the clamped SwiGLU,
and OpenAI's MXFP4 experts read from the checkpoint. Logits, greedy `generate`, align, parameter counts and the
export round trip are in tests/test_architectures.py and tests/test_convert.py with every tiny family; tensor and
expert parallel serving in tests/test_serve_parallel_engine.py."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from keel import kernels
from keel.config import ModelConfig
from keel.errors import ConfigError, KeelError
from keel.model.attention import explicit_attention
from keel.model.moe import ExpertActivation, GroupedExperts, row_experts
from keel.model.transformer import build_model
from keel.quant.loading import load_model
from keel.serve.engine import EngineConfig
from keel.serve.llm import LLM
from keel.serve.sampling import SamplingParams
from keel.weights.gpt_oss import GptOssReader, dequantize_mxfp4, quantize_mxfp4
from keel.weights.safetensors import SafetensorsReader
from keel.weights.shard import Shard, narrow
from tiny_models import save_byte_tokenizer, save_hf_model

transformers = pytest.importorskip("transformers")

NEW_TOKENS = 24
PROMPTS = [list(range(40, 80)) + [7, 9, 11], list(range(40, 80)) + [100, 3], [5, 6, 7]]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The tiny GPT-OSS checkpoint and transformers' greedy tokens for PROMPTS."""
    path = tmp_path_factory.mktemp("gpt_oss")
    hf = save_hf_model("gpt_oss", path)
    save_byte_tokenizer(path)
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        expected = [
            hf.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)[0, len(ids) :]
            for ids in PROMPTS
        ]
    return path, hf, [e.tolist() for e in expected]


@pytest.mark.isa
@pytest.mark.parametrize(
    ("backend", "kv_dtype", "block_size"),
    [
        ("kernels", "auto", 8),  # keel's C++ paged attention, every query in place
        ("kernels", "int8", 8),
        ("torch", "auto", 8),  # gathered blocks: decode rows and prefill chunks with explicit scores
        ("torch", "bfloat16", 8),
        ("torch", "int8", 8),  # the int8 cache's own decode path
        ("triton", "auto", 16),  # the Triton decode kernel, interpreted on CPU
    ],
)
def test_engine_serves_transformers_greedy_tokens(served, monkeypatch, backend, kv_dtype, block_size):
    """Through the engine (paged cache, prefix caching, a chunked prompt): transformers' greedy tokens on every
    attention backend, which each count the sinks. MoE models run uncompiled."""
    path, _, expected = served
    if backend == "kernels" and not kernels.active():
        pytest.skip("keel's kernels are off (KEEL_KERNELS=0)")
    monkeypatch.setenv("KEEL_ATTENTION_BACKEND", backend)
    config = EngineConfig.of(
        dtype="float32",
        compile=False,
        num_blocks=64,
        max_model_len=256,
        block_size=block_size,
        kv_cache_dtype=kv_dtype,
        max_num_batched_tokens=32,
    )
    llm = LLM(str(path), config)
    assert llm.engine.cache.attention_backend() == backend
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    first = llm.generate(PROMPTS[0], greedy, use_tqdm=False)[0]
    rest = llm.generate(PROMPTS[1:], greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in [first, *rest]] == expected
    assert rest[0].num_cached_tokens >= 32  # the shared prefix came from the cache


def test_sinks_take_probability_and_no_value():
    """explicit_attention against the softmax written out: a sink adds exp(sink) to the denominator only; a query
    that sees no key (all masked) returns zeros instead of NaN."""
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 5, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    sinks = torch.tensor([3.0, -2.0, 0.0, 20.0])
    mask = torch.ones(5, 5, dtype=torch.bool).tril()
    mask[0, 0] = False  # the first query sees nothing
    out = explicit_attention(q, k, v, mask, sinks=sinks)
    kr, vr = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    scores = (q @ kr.transpose(-1, -2) * 8**-0.5).masked_fill(~mask, float("-inf"))
    weights = scores.exp() / (scores.exp().sum(-1, keepdim=True) + sinks.exp().view(1, 4, 1, 1))
    torch.testing.assert_close(out, weights @ vr)
    assert torch.equal(out[:, :, 0], torch.zeros_like(out[:, :, 0]))
    assert out[:, 3].abs().max() < 1e-6  # a sink of 20 takes nearly all of its head's mass


def test_experts_bias_and_clamped_swiglu_per_expert():
    """GroupedExperts with biases and the clamped SwiGLU equal each expert computed on its own rows; row_experts
    finds each row's expert from the cumulative counts, empty experts included."""
    torch.manual_seed(0)
    act = ExpertActivation("swiglu_clamped", alpha=1.702, limit=0.5)
    experts = GroupedExperts(4, 16, 8, bias=True, activation=act)
    for p in experts.parameters():
        torch.nn.init.normal_(p)
    counts = [3, 0, 2, 4]
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
    assert row_experts(offsets, 9).tolist() == [0, 0, 0, 2, 2, 3, 3, 3, 3]
    x = torch.randn(9, 16)
    out = experts(x, offsets)
    start = 0
    for e, n in enumerate(counts):
        rows = x[start : start + n]
        hidden = rows @ experts.gate_up_proj[e].T + experts.gate_up_proj_bias[e]
        gate, up = hidden.chunk(2, dim=-1)
        gate, up = gate.clamp(max=0.5), up.clamp(-0.5, 0.5)
        want = (gate * torch.sigmoid(1.702 * gate) * (up + 1)) @ experts.down_proj[e].T + experts.down_proj_bias[e]
        torch.testing.assert_close(out[start : start + n], want)
        start += n


def test_mxfp4_dequantizes_as_transformers():
    """keel's MXFP4 decoding against transformers' own (convert_moe_packed_tensors, which also transposes to its
    [E, K, R] layout), and keel's encoder round-trips values on the grid exactly."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    torch.manual_seed(0)
    blocks = torch.randint(0, 256, (3, 6, 2, 16), dtype=torch.uint8)
    scales = torch.randint(118, 134, (3, 6, 2), dtype=torch.uint8)
    ours = dequantize_mxfp4(blocks, scales, torch.float32)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    assert torch.equal(ours, theirs.transpose(1, 2))
    again = quantize_mxfp4(ours)
    assert torch.equal(dequantize_mxfp4(*again, torch.float32), ours)


def _mxfp4_checkpoint(src, dst) -> dict[str, torch.Tensor]:
    """`src`'s checkpoint with its experts in OpenAI's MXFP4 form (as gpt-oss-20b ships them), written to `dst`;
    returns the experts' dequantized weights in transformers' layout."""
    tensors = load_file(src / "model.safetensors")
    dequantized = {}
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        weight = tensors.pop(name).transpose(1, 2)  # as the matmul reads it: [E, rows, K]
        blocks, scales = quantize_mxfp4(weight)
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
        dequantized[name] = dequantize_mxfp4(blocks, scales, torch.float32).transpose(1, 2)
    dst.mkdir()
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (dst / "config.json").write_text(json.dumps(config))
    return dequantized


def test_mxfp4_checkpoint_reads_as_transformers_dequantized(served, tmp_path):
    """An MXFP4 checkpoint loads (its quantization_config accepted), and keel's logits equal transformers' with the
    same experts dequantized; every kind of read of an expert tensor (a row, an expert-parallel range, a
    tensor-parallel cut of gate/up's two halves or of down's columns) equals the same cut of the whole."""
    path, hf, _ = served
    dequantized = _mxfp4_checkpoint(path, tmp_path / "mxfp4")
    reference = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        for name, weight in dequantized.items():
            reference.get_parameter(name).copy_(weight)
    loaded = load_model(tmp_path / "mxfp4", "float32")
    tokens = torch.randint(0, 256, (2, 30), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want, got = reference(tokens).logits, loaded.model(tokens)
    assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-4
    reader = GptOssReader(SafetensorsReader(tmp_path / "mxfp4"))
    experts = "model.layers.1.mlp.experts"
    assert reader.dtype(f"{experts}.gate_up_proj") == "BF16"
    assert not any(n.endswith(("_blocks", "_scales")) for n in reader.names())
    for name in (f"{experts}.gate_up_proj", f"{experts}.down_proj", f"{experts}.gate_up_proj_bias"):
        whole = reader.get(name)
        assert torch.equal(reader.get_row(name, 5), whole[5])
        for shard in (Shard(0, 2, 6), Shard(1, 4, 12, parts=2), Shard(whole.dim() - 1, 8, 16)):
            assert torch.equal(reader.get_shard(name, shard), narrow(whole, shard)), (name, shard)


def test_mxfp4_experts_run_as_stored(served, tmp_path):
    """By default on CPU (`--quantize auto`) an MXFP4 checkpoint's experts run as stored: int8 codes (twice each FP4
    value) and power-of-two scales, the same weights exactly, never a bfloat16 copy of the experts; greedy tokens
    equal the dequantized path's. `--quantize gguf` asks for it by name; a checkpoint without blocks is refused."""
    from keel.quant.experts import QuantizedGroupedExperts
    from keel.quant.loading import resolve_scheme
    from keel.weights.loader import open_checkpoint

    path, _, _ = served
    dequantized = _mxfp4_checkpoint(path, tmp_path / "mxfp4")
    reader = GptOssReader(SafetensorsReader(tmp_path / "mxfp4"))
    for name in ("model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"):
        blocks = reader.get_blocks(name)
        assert blocks.codes.dtype == torch.int8 and blocks.group == 32
        exact = blocks.codes.float() * blocks.scales.repeat_interleave(32, dim=-1)
        assert torch.equal(exact, reader.get(name).float())
    assert reader.get_blocks("model.layers.1.mlp.experts.gate_up_proj_bias") is None
    checkpoint = open_checkpoint(tmp_path / "mxfp4")
    assert resolve_scheme(checkpoint, "auto") == "gguf" and resolve_scheme(open_checkpoint(path), "auto") is None
    loaded = load_model(tmp_path / "mxfp4", "float32", quantize="auto")
    assert all(isinstance(layer.mlp.experts, QuantizedGroupedExperts) for layer in loaded.model.layers.values())
    assert loaded.model.quantization["stats"]["quantized"] == len(loaded.model.layers)  # the experts only
    with pytest.raises(KeelError, match="has none"):
        load_model(path, "float32", quantize="gguf")
    prompt = list(range(40, 70))
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    tokens = {}
    for quantize in ("auto", "none"):
        options = dict(num_blocks=32, block_size=8, max_model_len=128, quantize=quantize, dtype="float32")
        llm = LLM(str(tmp_path / "mxfp4"), EngineConfig.of(**options))
        tokens[quantize] = llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids
    assert tokens["auto"] == tokens["none"] and dequantized


def test_quantized_experts_keep_biases_and_activation(served):
    """Weight-only int8 experts (keel's kernels) keep the experts' biases and clamped SwiGLU: logits near the
    float model's, where dropping either moves them far."""
    path, _, _ = served
    float_model = load_model(path, "float32").model
    quantized = load_model(path, "float32", quantize="int8", quant_keep=("lm_head",)).model
    experts = quantized.layers["0"].mlp.experts
    assert type(experts).__name__ == "QuantizedGroupedExperts" and experts.activation.kind == "swiglu_clamped"
    tokens = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want, got = float_model(tokens), quantized(tokens)
        experts.down_proj_bias.zero_()
        unbiased = quantized(tokens)
    # Mean errors: a token whose top-2 experts nearly tie may route otherwise once the weights are rounded.
    error = lambda logits: ((logits - want).abs().mean() / want.abs().mean()).item()  # noqa: E731
    assert error(got) < 0.02 and error(unbiased) > 5 * error(got)


def test_training_reaches_sinks_and_biases(served):
    """A float model trains every GPT-OSS parameter: sinks, router and expert biases get gradients."""
    config = ModelConfig.from_json_file(served[0] / "config.json")
    model = build_model(config)
    tokens = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(5))
    logits = model(tokens)
    torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten()).backward()
    layer = model.layers["0"]
    for param in (
        layer.self_attn.sinks,
        layer.mlp.router.bias,
        layer.mlp.experts.gate_up_proj_bias,
        layer.mlp.experts.down_proj_bias,
    ):
        assert param.grad is not None and param.grad.abs().sum() > 0


def test_what_is_refused(served):
    """Other quantization methods are refused by name; expert offloading, which does not move expert biases, too."""
    path, _, _ = served
    data = json.loads((path / "config.json").read_text())
    with pytest.raises(ConfigError, match="'fp8'"):
        ModelConfig.from_hf({**data, "quantization_config": {"quant_method": "fp8"}}, source="config.json")
    with pytest.raises(KeelError, match="biases"):
        LLM(str(path), EngineConfig.of(dtype="float32", compile=False, num_blocks=64, expert_cache="1MiB"))
