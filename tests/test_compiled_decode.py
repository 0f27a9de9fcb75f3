"""The compiled decode step (keel.serve.compiled_decode): the same greedy tokens as eager decoding,
at batch 1 and with mixed batches whose block tables grow past several blocks, with no compile
after start-up; the engine's auto choice; eager fallbacks where the graph does not apply."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch._dynamo.utils import counters

from keel import kernels, platform
from keel.errors import KeelError
from keel.serve import compiled_decode
from keel.serve.compiled_decode import decide_compile
from keel.serve.engine import EngineConfig
from keel.serve.llm import LLM
from keel.serve.sampling import SamplingParams
from tiny_models import save_byte_tokenizer, save_hf_model

pytestmark = pytest.mark.isa  # run again under KEEL_CPU_ISA=avx2 by `make test`

PROMPTS = ["hello world", "the cat sat on the mat and", "a", "zz top " * 6]


def _generate(path, compile_: bool, **extra):
    config = EngineConfig.of(
        dtype="bfloat16", compile=compile_, num_blocks=96, max_model_len=256, block_size=8, **extra
    )
    llm = LLM(str(path), config)
    return llm, _run(llm)


def _run(llm: LLM) -> list[list[int]]:
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    # Batch 1 first (eager on CPU), then all prompts together (the compiled graph, mixed lengths:
    # the tables grow from 1 to 7 blocks, and sequences join and leave as their prompts finish).
    alone = [llm.generate(PROMPTS[0], greedy, use_tqdm=False)[0].outputs[0].token_ids]
    params = [SamplingParams(max_tokens=12 + 9 * i, temperature=0.0, ignore_eos=True) for i in range(len(PROMPTS))]
    together = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    return alone + together


# Tied head; q/k norms (in `make test-slow`: 15 s, the norms are plain ops in the graph); sliding window of 8.
@pytest.mark.parametrize(
    "name", ["llama", pytest.param("qwen3", marks=pytest.mark.slow), pytest.param("mistral", marks=pytest.mark.slow)]
)
def test_compiled_decode_gives_the_eager_tokens(tmp_path, name):
    save_hf_model(name, tmp_path)
    save_byte_tokenizer(tmp_path)
    _, eager = _generate(tmp_path, False)
    graphs_before = counters["stats"]["unique_graphs"]
    llm, compiled = _generate(tmp_path, True)
    runner = llm.engine.runner
    assert runner.compiled is not None and runner.compiled.steps > 20  # batched decode steps really ran compiled
    assert llm.engine.compile_seconds > 0
    # One graph (batches of 2+; batch 1 stays eager on CPU), compiled at start-up: no compile while
    # serving, whatever the batch size or the block-table width.
    assert counters["stats"]["unique_graphs"] - graphs_before == 1
    assert compiled == eager
    # Asynchronous scheduling: each step's tokens are the previous step's draws, filled in on the device.
    llm.engine.async_scheduling = True
    assert _run(llm) == eager
    assert counters["stats"]["unique_graphs"] - graphs_before == 1


# In make test-slow (38 s on an AVX2 machine): the buckets are CUDA's, where tests/test_cuda.py runs them
# (greedy tokens equal to transformers' with CUDA graphs, on an H200: docs/BENCHMARKS.md).
@pytest.mark.slow
def test_batches_padded_to_buckets_give_the_eager_tokens(tmp_path):
    """CUDA's graph buckets, run on CPU: batches padded to 1, 2, 4 or 8 rows with copies of row 0 (which
    rewrite row 0's own K/V), tables padded to the longest a sequence can have: the eager tokens."""
    from keel.serve.compiled_decode import CompiledDecode

    save_hf_model("llama", tmp_path)
    save_byte_tokenizer(tmp_path)
    _, eager = _generate(tmp_path, False)
    llm = LLM(str(tmp_path), EngineConfig.of(dtype="bfloat16", num_blocks=96, max_model_len=256, block_size=8))
    engine = llm.engine  # nothing served yet: the warm-up's K/V land in blocks no sequence holds
    padded = CompiledDecode(engine.model, engine.cache, max_batch=8, max_blocks=32, pad_batches=True)
    assert padded.batch_buckets == (1, 2, 4, 8)
    assert padded.fixed_width == (32 if kernels.active() else 0)  # where attention reads rows in place
    padded.warm_up()
    engine.runner.compiled = padded
    assert _run(llm) == eager
    assert padded.steps > 20
    engine.async_scheduling = True  # the padding rows copy row 0's token, which is in flight
    assert _run(llm) == eager


@pytest.mark.parametrize("quantize", ["int4", pytest.param("int8", marks=pytest.mark.slow)])
def test_compiled_decode_runs_block_quantized_weights(tmp_path, quantize):
    """keel's block layout (the integer kernels) inside the graph: the same tokens as eager steps."""
    if not kernels.active():
        pytest.skip("the block layout runs on keel's C++ kernels, which are off (KEEL_KERNELS=0 or not built)")
    save_hf_model("llama", tmp_path)
    save_byte_tokenizer(tmp_path)
    extra = {"quantize": quantize, "quant_group_size": 32}
    _, eager = _generate(tmp_path, False, **extra)
    llm, compiled = _generate(tmp_path, True, **extra)
    assert any(getattr(m, "layout", None) == "blocks" for m in llm.engine.model.modules())
    assert llm.engine.runner.compiled is not None and llm.engine.runner.compiled.steps > 20
    assert compiled == eager


def test_auto_compiles_only_large_dense_models(tmp_path, monkeypatch):
    save_hf_model("llama", tmp_path / "dense")
    save_hf_model("qwen2_moe", tmp_path / "moe")
    monkeypatch.delenv("KEEL_COMPILE", raising=False)
    dense = LLM(str(tmp_path / "dense"), num_blocks=16, max_model_len=64).engine
    assert dense.runner.compiled is None  # under 50M parameters: compile time would not pay back
    assert decide_compile(None, dense.model, dense.cache, offloading=False) is False
    assert decide_compile(True, dense.model, dense.cache, offloading=True) is False  # expert offloading: eager
    monkeypatch.setenv("KEEL_COMPILE", "1")
    assert decide_compile(None, dense.model, dense.cache, offloading=False) is True
    assert decide_compile(False, dense.model, dense.cache, offloading=False) is False  # --no-compile wins
    moe = LLM(str(tmp_path / "moe"), num_blocks=16, max_model_len=64, compile=True).engine
    assert moe.runner.compiled is None  # MoE routing stays eager (logged), the engine still serves
    int8_kv = LLM(str(tmp_path / "dense"), num_blocks=16, max_model_len=64, compile=True, kv_cache_dtype="int8")
    assert int8_kv.engine.runner.compiled is None
    # A CPU host without a C++ compiler (keel.platform): auto stays eager, an explicit --compile is a KeelError.
    no_cxx = dataclasses.replace(platform.probe(), cpp_compiler=None)
    monkeypatch.setattr(compiled_decode, "host", lambda: no_cxx)
    monkeypatch.delenv("KEEL_COMPILE")
    assert decide_compile(None, dense.model, dense.cache, offloading=False) is False
    with pytest.raises(KeelError, match="no C\\+\\+ compiler"):
        decide_compile(True, dense.model, dense.cache, offloading=False)


def test_auto_counts_quantized_weights_as_parameters(tmp_path, monkeypatch):
    """The size rule counts the architecture's parameters: an int8 model's weights are buffers, which
    parameters() leaves out (here, on torch's int8 kernels, as with KEEL_KERNELS=0 or on CUDA)."""
    monkeypatch.delenv("KEEL_COMPILE", raising=False)
    save_hf_model("llama", tmp_path)
    engine = LLM(str(tmp_path), quantize="int8", num_blocks=16, max_model_len=64, compile=False).engine
    model = engine.model
    total = model.config.param_counts()["total"]
    stored = sum(p.numel() for p in model.parameters())
    assert stored < total // 2  # the projections are buffers now
    monkeypatch.setattr(compiled_decode, "decode_runs_fused", lambda *_: False)
    monkeypatch.setattr(compiled_decode, "AUTO_COMPILE_MIN_PARAMS", total)
    assert decide_compile(None, model, engine.cache, offloading=False) is True
    monkeypatch.setattr(compiled_decode, "AUTO_COMPILE_MIN_PARAMS", total + 1)
    assert decide_compile(None, model, engine.cache, offloading=False) is False


def test_auto_leaves_models_on_keels_fused_cpu_layers_eager(tmp_path, monkeypatch):
    """Auto compiles a large model only where its decode does not already run through keel::decoder_layers (float32
    or block weights on keel's CPU kernels), whose step the compiled modules do not beat (docs/BENCHMARKS.md)."""
    from keel.model.fused_layer import decode_runs_fused

    monkeypatch.delenv("KEEL_COMPILE", raising=False)
    monkeypatch.setattr(compiled_decode, "AUTO_COMPILE_MIN_PARAMS", 0)  # every model counts as large
    save_hf_model("llama", tmp_path / "llama")
    save_hf_model("gpt_neox", tmp_path / "neox")  # parallel residual, LayerNorm: the modules run it
    fused = LLM(str(tmp_path / "llama"), dtype="float32", num_blocks=16, max_model_len=64, compile=False).engine
    bf16 = LLM(str(tmp_path / "llama"), dtype="bfloat16", num_blocks=16, max_model_len=64, compile=False).engine
    neox = LLM(str(tmp_path / "neox"), dtype="float32", num_blocks=16, max_model_len=64, compile=False).engine
    assert decode_runs_fused(fused.model, fused.cache) is kernels.active()
    assert decide_compile(None, fused.model, fused.cache, offloading=False) is not kernels.active()
    assert decode_runs_fused(bf16.model, bf16.cache) is False  # bf16 activations keep torch's ops
    assert decide_compile(None, bf16.model, bf16.cache, offloading=False) is True
    assert decode_runs_fused(neox.model, neox.cache) is False
    assert decide_compile(None, neox.model, neox.cache, offloading=False) is True
    assert decide_compile(True, fused.model, fused.cache, offloading=False) is True  # --compile is honoured


def test_decode_attention_op_matches_the_paged_cache(tmp_path):
    """The compiled graph's attention op and the eager paged cache compute the same bits."""
    from keel.serve.compiled_decode import paged_decode_attention
    from keel.serve.kv_cache import DecodeGroup, PagedKVCache, StepPlan
    from keel.weights.loader import open_checkpoint

    save_hf_model("llama", tmp_path)
    config = open_checkpoint(str(tmp_path)).config
    gen = torch.Generator().manual_seed(0)
    caches = [PagedKVCache(config, 12, 4, torch.bfloat16) for _ in range(2)]
    for c in caches[1:]:
        for a, b in zip(c.keys + c.values, caches[0].keys + caches[0].values, strict=True):
            a.copy_(b.normal_(generator=gen))
    h, hkv, d = config.num_heads, config.num_kv_heads, config.head_dim
    q = torch.randn(1, h, 3, d, generator=gen).bfloat16()
    k, v = (torch.randn(1, 3, hkv, d, generator=gen).bfloat16() for _ in range(2))
    tables = torch.tensor([[1, 2, 0], [3, 4, 5], [6, 0, 0]])
    positions = torch.tensor([5, 10, 2])
    slots = torch.tensor([2 * 4 + 1, 5 * 4 + 2, 6 * 4 + 2])
    caches[0].plan = StepPlan(slots, [DecodeGroup(torch.arange(3), tables, positions, whole_step=True)], [])
    eager = caches[0].attend(0, q, k, v, None, window=None)
    from keel.serve.kv_cache import decode_mask

    mask = decode_mask(positions, 12, None)
    full = torch.tensor([3, 3, 3])  # every row at the padded width: one group, as in the eager plan above
    op = paged_decode_attention(
        q, k, v, caches[1].keys[0], caches[1].values[0], slots, tables, full, mask, positions, 0, 4, d**-0.5
    )
    assert torch.equal(op, eager)
    assert torch.equal(caches[1].keys[0], caches[0].keys[0]) and torch.equal(caches[1].values[0], caches[0].values[0])
    # Rows of 2, 3 and 1 blocks: the op groups them by width exactly as the runner's plan does.
    from keel.serve.runner import _decode_groups

    lists = [[1, 2], [3, 4, 5], [6]]
    caches[0].plan = StepPlan(slots, _decode_groups([0, 1, 2], lists, positions.tolist(), total=3), [])
    assert len(caches[0].plan.decodes) == 3
    eager = caches[0].attend(0, q, k, v, None, window=None)
    widths = torch.tensor([2, 3, 1])
    op = paged_decode_attention(
        q, k, v, caches[1].keys[0], caches[1].values[0], slots, tables, widths, mask, positions, 0, 4, d**-0.5
    )
    assert torch.equal(op, eager)


@pytest.mark.slow
def test_smollm2_compiled_decode_gives_the_eager_tokens():
    """The real checkpoint (bf16, the serving default here): 8 prompts, 96 greedy tokens each, alone
    and batched, the same tokens with and without compilation (~70 s of compiling on a cold cache)."""
    prompts = [
        "The capital of France is",
        "def fibonacci(n):",
        "Once upon a time",
        "List three colors:",
        "The meaning of life is",
        "import numpy as np\n",
        "Dear Sir,",
        "1, 2, 3, 5, 8,",
    ]
    greedy = SamplingParams(max_tokens=96, temperature=0.0, ignore_eos=True)
    tokens = {}
    for compile_ in (False, True):
        llm = LLM("smollm2-135m-instruct", dtype="bfloat16", compile=compile_, kv_cache_memory="256MiB")
        alone = [llm.generate(p, greedy, use_tqdm=False)[0].outputs[0].token_ids for p in prompts[:2]]
        together = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
        tokens[compile_] = alone + together
        assert (llm.engine.runner.compiled is not None) == compile_
    assert tokens[True] == tokens[False]


def test_serve_options_reach_the_engine_config():
    import argparse

    from keel.cli.config_options import add_engine_options

    parser = argparse.ArgumentParser()
    add_engine_options(parser)
    assert parser.parse_args([]).compile is None  # auto
    assert parser.parse_args(["--no-compile"]).compile is False
    assert parser.parse_args(["--compile"]).compile is True
    from keel.cli.config_options import engine_config_from_args

    config = engine_config_from_args(parser.parse_args(["--no-compile", "--max-num-seqs", "3", "-tp", "2"]))
    assert config.load.compile is False and config.scheduler.max_num_seqs == 3
    assert config.parallel.tensor_parallel_size == 2
