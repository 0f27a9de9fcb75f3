"""keel on a CUDA device: run by bench/gpu_check.sh on a lent GPU (docs/BENCHMARKS.md records each run).

Every path here also runs on CPU through the same interfaces in the default suite (the engine and its
compiled decode in test_serve_engine / test_compiled_decode, the Triton kernel under Triton's interpreter
in test_attention_backends, the staging and bucket logic with the buckets forced on); these tests prove
them on the device itself, so they need one.
"""

from __future__ import annotations

import gc

import pytest
import torch

from keel.serve import LLM, SamplingParams
from keel.serve.sampling import RowState, Sampler
from keel.serve.staging import Staging
from tiny_models import build_hf_model, save_byte_tokenizer, save_hf_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (bench/gpu_check.sh)")

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 17, 42], list(range(30, 70)), [200] * 9, list(range(100, 123))]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("cuda") / "llama"
    save_hf_model("llama", path)
    save_byte_tokenizer(path)
    return path


def transformers_tokens(path, prompts, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).cuda().eval()
    model.generation_config.eos_token_id = None
    out = []
    for p in prompts:
        with torch.inference_mode():
            ids = model.generate(torch.tensor([p], device="cuda"), max_new_tokens=24, do_sample=False, pad_token_id=0)
        out.append(ids[0, len(p) :].tolist())
    return out


# Asynchronous scheduling is CUDA's default: each step is queued before the previous one's tokens are read,
# and the synchronous engine is checked once beside it.
@pytest.mark.parametrize(
    ("compile_", "async_scheduling"), [(False, None), (True, None), (False, False)], ids=["eager", "compiled", "sync"]
)
def test_greedy_tokens_equal_transformers_in_float32(llama, compile_, async_scheduling):
    from torch._dynamo.utils import counters

    skips = counters["inductor"]["cudagraph_skips"]  # compiled at start-up: counted from before
    llm = LLM(
        str(llama),
        device="cuda",
        dtype="float32",
        compile=compile_,
        max_model_len=256,
        max_num_seqs=8,
        kv_cache_memory="1GiB",
        async_scheduling=async_scheduling,
    )
    engine = llm.engine
    assert engine.async_scheduling is (async_scheduling is None)
    assert engine.model.device.type == "cuda" and engine.cache.keys[0].device.type == "cuda"
    assert "attention triton" in engine.backends
    assert (engine.runner.compiled is not None) == compile_
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert got == transformers_tokens(llama, PROMPTS)
    assert counters["inductor"]["cudagraph_skips"] == skips  # the decode graphs were captured, not skipped
    if compile_:
        assert engine.runner.compiled.steps > 10 and engine.runner.compiled.batch_buckets[:4] == (1, 2, 4, 8)


def test_chunked_prefill_and_prefix_hits_give_transformers_tokens(llama):
    """A step budget smaller than the prompts and a prompt sent twice (the second hits the prefix cache): the
    same tokens as transformers' (float32: bf16 products are not batch-invariant on a GPU)."""
    llm = LLM(
        str(llama), device="cuda", dtype="float32", max_model_len=256, max_num_batched_tokens=32, kv_cache_memory="1GiB"
    )
    prompts = PROMPTS + PROMPTS[1:2]
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert together == transformers_tokens(llama, prompts)
    assert llm.engine.kv.prefix_hits > 0


# Sampled rows with a seed, logit_bias and allowed_token_ids (none reads its own tokens, so the steps stay
# asynchronous): their per-row tables and indices cross in page-locked, non-blocking copies.
SAMPLED = dict(temperature=0.8, top_p=0.9, seed=7, logit_bias={5: 2.0}, allowed_token_ids=list(range(3, 300)))


@pytest.mark.parametrize(
    ("compile_", "sampled"), [(False, False), (True, True)], ids=["eager-greedy", "compiled-sampled"]
)
def test_an_async_step_returns_while_the_device_is_still_busy(llama, compile_, sampled):
    """Asynchronous scheduling: step() queues step N+1 and reads step N without waiting for the device. A
    ~100 ms spin queued on the stream before the call must still be running when step() returns (any host
    sync in the step, a blocking copy or a read of N+1's tensors, would wait for it). Compiled, no step
    compiles or records a graph the warm-up did not (dynamo's graph count stays)."""
    from torch._dynamo.utils import counters

    llm = LLM(str(llama), device="cuda", dtype="float32", max_model_len=256, max_num_seqs=8, kv_cache_memory="1GiB",
              compile=compile_)  # fmt: skip
    engine = llm.engine
    assert engine.async_scheduling
    graphs = counters["stats"]["unique_graphs"]
    extra = SAMPLED if sampled else {"temperature": 0.0}
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(prompt, SamplingParams(max_tokens=64, ignore_eos=True, **extra), str(i))
    for _ in range(6):  # past the prefills: decode steps only, a step queued
        engine.step()
    torch.cuda.synchronize()
    for _ in range(3):
        torch.cuda._sleep(200_000_000)
        outputs = engine.step()
        busy = not torch.cuda.current_stream().query()
        torch.cuda.synchronize()
        assert busy, "step() waited for the device"
        assert len(outputs) == len(PROMPTS)  # the previous step's tokens, one a request
    while engine.has_unfinished_requests():
        engine.step()
    assert counters["stats"]["unique_graphs"] == graphs


def test_one_rank_in_a_worker_on_nccl(llama):
    """--distributed-executor-backend mp at tp = 1: the parallel workers' path on one GPU (set_device, an NCCL
    world of one beside the gloo control groups, the KV pool on the device, rank 0's sampling, shutdown):
    the in-process engine's float32 greedy tokens. (tp > 1 needs a GPU per rank.)"""
    base = dict(device="cuda", dtype="float32", max_model_len=256, kv_cache_memory="1GiB", compile=False)
    llm = LLM(str(llama), **base)
    want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    llm = LLM(str(llama), **base, distributed_executor_backend="mp")
    try:
        assert llm.engine.executor is not None and llm.engine.model.device.type == "meta"
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == want
    finally:
        llm.engine.shutdown()


def test_sampler_reads_nothing_back_from_the_device():
    """Penalties, temperature, top-k/top-p/min-p and the draw, seeded and not: no host sync inside."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    logits = torch.randn(4, 1000, device="cuda")
    states = [
        RowState(SamplingParams(temperature=0.0)),
        RowState(SamplingParams(temperature=0.8, top_k=20, top_p=0.9), prompt_ids=[1, 2], output_ids=[3]),
        RowState(SamplingParams(temperature=1.0, min_p=0.1, repetition_penalty=1.2), output_ids=[5, 5]),
        RowState(SamplingParams(temperature=0.7, seed=3), generator=gen),
    ]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = Sampler()(logits, states)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ids = out.token_ids.tolist()
    assert ids[0] == int(logits[0].argmax()) and all(0 <= i < 1000 for i in ids)


def test_staging_moves_a_step_in_one_copy():
    staging = Staging("cuda")
    host = [torch.arange(5), torch.tensor([[1, 2], [3, 4]]), torch.tensor([7])]
    moved = staging.move(host)
    assert all(m.device.type == "cuda" and torch.equal(m.cpu(), h) for m, h in zip(moved, host, strict=True))
    assert staging._host.is_pinned()
    again = staging.move([torch.tensor([9, 9])])  # the host buffer reused once the last copy is done
    assert again[0].tolist() == [9, 9] and moved[0].tolist() == [0, 1, 2, 3, 4]


def test_staging_grown_under_inference_mode_serves_steps_outside_it():
    """The engine's dummy step grows the buffer under inference_mode; later steps run outside it."""
    staging = Staging("cuda")
    with torch.inference_mode():
        staging.move([torch.arange(4)])
    assert staging.move([torch.arange(3)])[0].tolist() == [0, 1, 2]
    with torch.inference_mode():
        assert staging.move([torch.arange(2)])[0].tolist() == [0, 1]


@pytest.mark.parametrize("quantize", ["int8", "int4"])
def test_weight_only_quantized_linears_run_on_cuda(llama, quantize):
    """keel's int8/int4 weight-only layers on the device: each layer's product equals the product with the
    weight it stores (read back through a layout-agnostic unpack), and the logits stay near the float
    model's (int4 at group 32 on random weights loses ~0.2 of the logits' norm on CPU as on CUDA)."""
    from keel.quant.linear import QuantizedLinear
    from keel.quant.loading import load_model

    dense = load_model(str(llama), "bfloat16", device="cuda")
    quant = load_model(str(llama), "bfloat16", device="cuda", quantize=quantize, quant_group_size=32)
    layers = [m for m in quant.model.modules() if isinstance(m, QuantizedLinear)]
    assert layers and all(m.qweight.device.type == "cuda" for m in layers)
    gen = torch.Generator(device="cuda").manual_seed(0)
    with torch.inference_mode():
        for layer in layers:
            for rows in (1, 7, 64):
                x = torch.randn(rows, layer.in_features, device="cuda", dtype=torch.bfloat16, generator=gen)
                want = x.float() @ layer.dequantized().T
                if layer.bias is not None:
                    want += layer.bias.float()
                got = layer(x).float()
                assert ((got - want).norm() / want.norm()) < 0.02, (layer, rows)
        tokens = torch.tensor([PROMPTS[1]], device="cuda")
        want, got = dense.model(tokens).float(), quant.model(tokens).float()
    assert got.device.type == "cuda"
    error = (got - want).norm() / want.norm()
    assert error < (0.05 if quantize == "int8" else 0.3), error


def test_a_model_of_its_own_dtype_round_trips(tmp_path):
    """The reference tiny model itself on the device: keel's forward equals transformers' in float32."""
    from keel.quant.loading import load_model

    hf = build_hf_model("qwen3").cuda().eval()
    hf.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path), "float32", device="cuda")
    tokens = torch.tensor([PROMPTS[1]], device="cuda")
    with torch.inference_mode():
        torch.testing.assert_close(loaded.model(tokens), hf(tokens).logits, atol=1e-4, rtol=1e-4)


def test_float32_grouped_query_prefill_does_not_materialise_the_scores():
    """A float32 GQA prefill of 8,192 tokens: SDPA's math kernel would hold 8 x 8192^2 float32 scores (2 GiB) per
    sequence; through the repeated heads the memory-efficient kernel holds a few MiB."""
    from keel.model.attention import sdpa

    q = torch.randn(1, 8, 8192, 64, device="cuda")
    k, v = torch.randn(1, 2, 8192, 64, device="cuda"), torch.randn(1, 2, 8192, 64, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = sdpa(q, k, v, causal=True)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - before < 2**28
    want = torch.nn.functional.scaled_dot_product_attention(
        q[:, :, -64:],
        k.repeat_interleave(4, 1),
        v.repeat_interleave(4, 1),
        attn_mask=torch.ones(64, 8192, dtype=torch.bool, device="cuda").tril(8192 - 64),
    )
    torch.testing.assert_close(out[:, :, -64:], want, atol=1e-4, rtol=1e-4)


def test_a_workers_kv_pool_leaves_room_for_its_activation_peak(llama):
    """--gpu-memory-utilization with the workers (mp at tp = 1): the rank runs its share of a full dummy step
    before its KV pool is sized, as the in-process engine does; its peak is that engine's, and the pool fits the
    share with the peak left free."""
    base = dict(device="cuda", dtype="bfloat16", max_model_len=256, compile=False, max_num_batched_tokens=1024)
    llm = LLM(str(llama), **base, kv_cache_memory="256MiB")
    want = llm.engine._activation_peak()
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    share = 0.03 + (total - free) / total
    llm = LLM(str(llama), **base, gpu_memory_utilization=share, distributed_executor_backend="mp")
    try:
        report = llm.engine.executor.reports[0]
        # The worker's first matmuls also allocate cuBLAS's workspaces (tens of MiB), which this process holds already.
        assert want > 0 and 0.75 * want - 2**21 <= report.activation_peak <= 1.33 * want + 80 * 2**20
        assert 0 < report.kv_bytes <= 0.03 * total - report.activation_peak
        assert len(llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 24
    finally:
        llm.engine.shutdown()


def test_gpu_memory_utilization_sizes_the_cache_after_a_dummy_step(llama, caplog):
    import logging

    gc.collect()  # earlier tests' cached blocks: the engine empties the cache before it measures
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    share = 0.03 + (total - free) / total  # what is in use now, and ~4 GiB more on an H200
    with caplog.at_level(logging.INFO, logger="keel.serve"):
        llm = LLM(str(llama), device="cuda", dtype="bfloat16", gpu_memory_utilization=share, max_model_len=256)
    assert any("activation peak of a" in r.getMessage() for r in caplog.records)
    cache_bytes = llm.engine.cache.nbytes()
    budget = 0.03 * total  # less the tiny model's weights and its dummy step's peak (a few MiB)
    assert budget - 2**28 < cache_bytes <= budget
    assert len(llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 24


def test_the_nccl_flight_recorder_dumps_this_ranks_collectives(tmp_path, monkeypatch):
    """One-rank NCCL group with the recorder's environment (keel.train.flight_recorder): after a collective,
    the watchdog's dump writes a recorder snapshot that names it."""
    import pickle

    import torch.distributed as dist

    from keel.train import flight_recorder

    for name, value in flight_recorder.environment(tmp_path, 100).items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29533")
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda:0"))
    try:
        t = torch.ones(4, device="cuda")
        dist.all_reduce(t)
        torch.cuda.synchronize()
        path = flight_recorder.dump(tmp_path, 0)
        assert path is not None and path.exists()
        snapshot = pickle.loads(path.read_bytes())
        assert any(e.get("profiling_name") == "nccl:all_reduce" for e in snapshot["entries"])
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("tile_keys", [16, 64])
def test_the_triton_decode_kernel_on_the_tensor_cores_matches_float32(tile_keys):
    """bf16 queries over bf16 rows with `half_dot` (bf16 products on the tensor cores, float32 sums; Triton's
    CPU interpreter cannot run bf16 dots, so this is checked here) against the float32 IEEE path, with the
    context split and not."""
    from keel.kernels import triton_paged

    gen = torch.Generator().manual_seed(7)
    k, v = (torch.randn(4, 64 * 16, 64, generator=gen).to("cuda", torch.bfloat16) for _ in range(2))
    queries = torch.randn(5, 16, 64, generator=gen).to("cuda", torch.bfloat16)
    tables = torch.randperm(64, generator=gen)[:60].view(5, 12).to("cuda")
    positions = torch.tensor([0, 15, 16, 100, 191], device="cuda")
    for splits in (1, 4):
        args = (queries, k, v, tables, None, positions, 16, 0, 0.125, 64)
        exact = triton_paged.paged_attention(*args, splits=splits, tile_keys=tile_keys, half_dot=False)
        fast = triton_paged.paged_attention(*args, splits=splits, tile_keys=tile_keys, half_dot=True)
        torch.testing.assert_close(fast.float(), exact.float(), atol=2e-2, rtol=2e-2)
