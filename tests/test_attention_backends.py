"""The paged KV cache's attention backends (keel.serve.attention_backends): which one the probe picks, the
Triton paged-attention kernel against a plain reference (run by Triton's interpreter where there is no
GPU: the code a GPU runs, on CPU tensors), and the engine's greedy tokens equal under every backend."""

from __future__ import annotations

import random

import pytest
import torch

from keel import kernels
from keel.errors import KeelError
from keel.kernels import triton_paged
from keel.quant.loading import load_model
from keel.serve import LLM, SamplingParams
from keel.serve.attention_backends import ENV, attend_chunk, attention_backend
from tiny_models import save_byte_tokenizer, save_hf_model

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def reference(queries, k_store, v_store, tables, table_of, positions, block_size, window, scale, v_dim, softcap=0.0):
    """Each token over its sequence's rows, gathered one by one: softmax(scale q.k) v in float64 (each score
    capped at softcap * tanh(score / softcap) when softcap > 0)."""
    values = k_store if v_store is None else v_store
    tokens, heads, _ = queries.shape
    group = heads // k_store.shape[0]
    out = torch.empty(tokens, heads, v_dim, dtype=torch.float64)
    for t in range(tokens):
        p = int(positions[t])
        first = max(0, p - window + 1) if window > 0 else (p - p % -window if window < 0 else 0)
        slots = [int(tables[table_of[t], j // block_size]) * block_size + j % block_size for j in range(first, p + 1)]
        for h in range(heads):
            k = k_store[h // group, slots].double()
            v = values[h // group, slots, :v_dim].double()
            scores = k @ queries[t, h].double() * scale
            if softcap:
                scores = softcap * torch.tanh(scores / softcap)
            weights = torch.softmax(scores, dim=0)
            out[t, h] = weights @ v
    return out


def random_case(kv_heads, group, head_dim, v_dim, block_size, dtype, latent=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    num_blocks = 24
    k = torch.randn(kv_heads, num_blocks * block_size, head_dim, generator=gen).to(dtype)
    v = None if latent else torch.randn(kv_heads, num_blocks * block_size, v_dim, generator=gen).to(dtype)
    # three sequences: a decode at a block's last slot, one at a block's first, a chunk of five tokens
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.tensor([order[0:6], order[6:12], order[12:18]], dtype=torch.int32)
    last = 6 * block_size - 1
    positions = torch.tensor([last, 2 * block_size, *range(last - 4, last + 1)])
    table_of = torch.tensor([0, 1, 2, 2, 2, 2, 2])
    queries = torch.randn(len(positions), kv_heads * group, head_dim, generator=gen).to(dtype)
    return queries, k, v, tables, table_of, positions


@pytest.mark.parametrize(
    "kv_heads, group, head_dim, v_dim, block_size, latent",
    [
        (2, 3, 24, 24, 16, False),  # GQA group not a power of two, head dim not a multiple of 16
        (1, 8, 64, 64, 32, False),
        (4, 1, 80, 80, 16, False),  # multi-head attention, head dim 80
        (1, 4, 40, 32, 16, True),  # latent (MLA): values are the keys' first channels
        (1, 20, 32, 24, 16, True),  # a group past one tile of 16 heads (MLA's 64-128)
    ],
)
@pytest.mark.parametrize("window", [0, 20, -32])  # -32: Llama 4's chunks of 32 positions
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_triton_kernel_matches_the_reference(kv_heads, group, head_dim, v_dim, block_size, latent, window, dtype):
    case = random_case(kv_heads, group, head_dim, v_dim, block_size, dtype, latent)
    queries, k, v, tables, table_of, positions = case
    scale = head_dim**-0.5
    args = (tables, table_of, positions, block_size, window, scale, v_dim)
    dev = [t.to(DEVICE) for t in (queries, k)] + [None if v is None else v.to(DEVICE)]
    out = triton_paged.paged_attention(*dev, *(a.to(DEVICE) if torch.is_tensor(a) else a for a in args)).cpu()
    assert out.dtype == dtype and out.shape == (len(positions), kv_heads * group, v_dim)
    expected = reference(queries, k, v, *args)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.double(), expected, atol=tolerance, rtol=tolerance)
    if dtype != torch.float16 and kernels.active():  # the CPU kernel reads the same stores the same way
        cpu = torch.ops.keel.paged_attention(queries, k, v, None, None, *args)
        torch.testing.assert_close(out.float(), cpu.float(), atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("splits", [2, 5, 8])
@pytest.mark.parametrize("window", [0, 20, -32])
def test_a_context_split_across_programs_combines_to_the_reference(splits, window):
    """Flash-decoding: each token's visible blocks shared out among `splits` programs (some of them empty:
    five or eight splits of a context of at most six blocks), combined by the second kernel."""
    queries, k, v, tables, table_of, positions = random_case(2, 4, 32, 32, 16, torch.float32, seed=4)
    args = (tables, table_of, positions, 16, window, 32**-0.5, 32)
    dev = [t.to(DEVICE) for t in (queries, k, v)]
    out = triton_paged.paged_attention(
        *dev, *(a.to(DEVICE) if torch.is_tensor(a) else a for a in args), splits=splits
    ).cpu()
    torch.testing.assert_close(out.double(), reference(queries, k, v, *args), atol=1e-5, rtol=1e-5)


def test_the_split_count_fills_the_device_from_shapes_alone(monkeypatch):
    """Enough programs for every multiprocessor a few (at batch 1 the context is split; at a batch that fills
    the device it is not), never more splits than the table has blocks, and none on CPU."""
    monkeypatch.setattr(triton_paged, "_multiprocessors", lambda device: 132)
    cuda = torch.device("cuda")
    assert triton_paged.context_splits(8, 64, cuda) == 64  # batch 1, 8 KV heads: 528 programs wanted
    assert triton_paged.context_splits(8, 20, cuda) == 20
    assert triton_paged.context_splits(128 * 8, 64, cuda) == 1
    assert 1 < triton_paged.context_splits(16 * 8, 64, cuda) < 64
    assert triton_paged.context_splits(8, 64, torch.device("cpu")) == 1


@pytest.mark.parametrize("splits", [1, 3])
def test_scores_are_soft_capped_when_asked(splits):
    """Gemma 2's attention soft-capping (softcap * tanh(score / softcap)), with the scores made large
    enough that the cap changes the result."""
    queries, k, v, tables, table_of, positions = random_case(1, 4, 32, 32, 16, torch.float32, seed=5)
    queries = queries * 6
    args = (tables, table_of, positions, 16, 0, 32**-0.5, 32)
    dev = [t.to(DEVICE) for t in (queries, k, v)]
    device_args = [a.to(DEVICE) if torch.is_tensor(a) else a for a in args]
    out = triton_paged.paged_attention(*dev, *device_args, softcap=5.0, splits=splits).cpu()
    capped = reference(queries, k, v, *args, softcap=5.0)
    torch.testing.assert_close(out.double(), capped, atol=1e-5, rtol=1e-5)
    assert (capped - reference(queries, k, v, *args)).abs().max() > 0.05  # the cap mattered


def test_triton_kernel_reads_bfloat16_rows_for_float32_queries():
    """kv_cache_dtype="bfloat16" under a float32 model: float32 queries and outputs over bfloat16 stores,
    as the float64 reference and keel's CPU kernel compute them over the same rows."""
    queries, k, v, tables, table_of, positions = random_case(2, 3, 64, 64, 16, torch.float32)
    k, v = k.to(torch.bfloat16), v.to(torch.bfloat16)
    args = (tables, table_of, positions, 16, 0, 0.125, 64)
    dev = [t.to(DEVICE) for t in (queries, k, v)]
    out = triton_paged.paged_attention(*dev, *(a.to(DEVICE) if torch.is_tensor(a) else a for a in args)).cpu()
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), reference(queries, k, v, *args), atol=1e-5, rtol=1e-5)
    if kernels.active():
        cpu = torch.ops.keel.paged_attention(queries, k, v, None, None, *args)
        torch.testing.assert_close(out, cpu, atol=1e-5, rtol=1e-5)


def test_triton_kernel_refuses_a_block_size_it_cannot_tile():
    queries, k, v, tables, table_of, positions = random_case(1, 2, 16, 16, 16, torch.float32)
    with pytest.raises(ValueError, match="block size"):
        triton_paged.paged_attention(queries, k, v, tables, table_of, positions, 12, 0, 0.25, 16)


def test_the_probe_picks_a_backend_and_a_forced_one_is_checked(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    store = torch.zeros(2, 64, 32)
    assert attention_backend(store, 32, 16) == ("kernels" if kernels.active() else "torch")
    assert attention_backend(store.half(), 32, 16) == "torch"  # no CPU kernel reads fp16 rows
    assert attention_backend(torch.zeros(2, 64, 32, device="meta"), 32, 16) == "torch"
    monkeypatch.setenv(ENV, "torch")
    assert attention_backend(store, 32, 16) == "torch"
    monkeypatch.setenv(ENV, "triton")
    device_store = store.to(DEVICE)
    assert attention_backend(device_store, 32, 16) == "triton"  # on CPU: interpreted
    with pytest.raises(KeelError, match="power-of-two block size"):
        attention_backend(device_store, 32, 4)
    with pytest.raises(KeelError, match="float rows"):
        attention_backend(device_store.to(torch.int8), 32, 16)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(KeelError, match="TRITON_INTERPRET"):
        attention_backend(store, 32, 16)
    monkeypatch.setenv(ENV, "flash")
    with pytest.raises(KeelError, match="kernels, triton, torch"):
        attention_backend(store, 32, 16)


@pytest.mark.parametrize("window", [None, 5])
def test_a_chunk_attends_causally_from_its_end(window):
    gen = torch.Generator().manual_seed(1)
    queries, keys = torch.randn(1, 6, 4, 16, generator=gen), torch.randn(1, 2, 11, 16, generator=gen)
    values = torch.randn(1, 2, 11, 8, generator=gen)
    positions = torch.arange(7, 11)  # the chunk is the last 4 of 11 keys
    key_positions = torch.arange(11)
    allowed = key_positions[None, :] <= positions[:, None]
    if window:
        allowed &= key_positions[None, :] > positions[:, None] - window
    out = attend_chunk(queries, keys, values, allowed[None, None] if window else None, None)
    repeat = lambda t: t.repeat_interleave(3, dim=1)  # noqa: E731
    scores = (queries @ repeat(keys).transpose(-1, -2)) / 4.0
    expected = scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ repeat(values)
    torch.testing.assert_close(out, expected)


def test_float32_grouped_heads_are_repeated_for_cudas_fused_kernels():
    """CUDA's memory-efficient SDPA takes no grouped heads, so float32 GQA would fall back to the math kernel and
    its [S, L] score matrices: there keys and values get the query heads (the same attention); half precision and
    the CPU keep them grouped. The rule is checked here with the device test overridden (tests/test_cuda.py
    measures the memory on a GPU)."""
    from keel.model.attention import sdpa, sdpa_kv_heads

    gen = torch.Generator().manual_seed(2)
    q, k, v = torch.randn(1, 6, 5, 8, generator=gen), torch.randn(1, 2, 5, 8, generator=gen), torch.randn(1, 2, 5, 8)
    repeated_k, repeated_v = sdpa_kv_heads(q, k, v, cuda=True)
    assert repeated_k.shape[1] == repeated_v.shape[1] == 6
    torch.testing.assert_close(repeated_k[:, 3:6], k[:, 1:2].expand(1, 3, 5, 8))
    full = torch.nn.functional.scaled_dot_product_attention(q, repeated_k, repeated_v, is_causal=True)
    torch.testing.assert_close(full, sdpa(q, k, v, causal=True))
    assert sdpa_kv_heads(q, k, v)[0] is k  # the CPU: grouped
    assert sdpa_kv_heads(q.bfloat16(), k.bfloat16(), v.bfloat16(), cuda=True)[0].shape[1] == 2
    assert sdpa_kv_heads(q[:, :2], k, v, cuda=True)[0] is k  # no groups


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("backends")
    out = {}
    for name in ("llama", "mistral"):  # mistral: a sliding window of 8
        save_hf_model(name, root / name)
        save_byte_tokenizer(root / name)
        out[name] = load_model(root / name, device=DEVICE)
    return out


@pytest.mark.parametrize("name", ["llama", "mistral"])
def test_greedy_tokens_are_the_same_under_every_backend(models, name, monkeypatch):
    """Decodes of different lengths, prefill chunks over cached blocks (a budget smaller than a prompt) and
    prefix hits, through the engine under each backend: the same greedy tokens."""
    rng = random.Random(3)
    prompts = [[rng.randrange(250) for _ in range(n)] for n in (5, 23, 40, 23)]
    prompts[3][:16] = prompts[1][:16]  # a cached block shared with the second prompt
    backends = ["torch", "triton"] + (["kernels"] if kernels.active() and DEVICE == "cpu" else [])
    results = {}
    calls = []
    real = triton_paged.paged_attention
    monkeypatch.setattr(triton_paged, "paged_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    for backend in backends:
        monkeypatch.setenv(ENV, backend)
        llm = LLM(
            models[name], num_blocks=32, block_size=16, max_model_len=96, max_num_batched_tokens=24, device=DEVICE
        )
        params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        results[backend] = [o.outputs[0].token_ids for o in outputs]
        assert bool(calls) == (backend == "triton")
        calls.clear()
    for backend in backends[1:]:
        assert results[backend] == results["torch"], backend


def test_the_compiled_decode_op_attends_through_triton_as_the_eager_cache(models, monkeypatch):
    """keel::paged_decode_attention (the op a compiled decode graph calls, CUDA-graph-safe: no host sync)
    under the Triton backend: the same rows as the eager cache's decode groups."""
    from keel.serve.compiled_decode import paged_decode_attention
    from keel.serve.kv_cache import DecodeGroup, PagedKVCache, StepPlan, decode_mask

    monkeypatch.setenv(ENV, "triton")
    config = models["llama"].config
    gen = torch.Generator().manual_seed(0)
    caches = [PagedKVCache(config, 8, 16, torch.float32, DEVICE) for _ in range(2)]
    for a, b in zip(caches[1].keys + caches[1].values, caches[0].keys + caches[0].values, strict=True):
        a.copy_(b.copy_(torch.randn(b.shape, generator=gen)))
    h, hkv, d = config.num_heads, config.num_kv_heads, config.head_dim
    q = torch.randn(1, h, 3, d, generator=gen).to(DEVICE)
    k, v = (torch.randn(1, 3, hkv, d, generator=gen).to(DEVICE) for _ in range(2))
    tables = torch.tensor([[1, 2, 0], [3, 4, 5], [6, 0, 0]], device=DEVICE)
    positions = torch.tensor([20, 40, 2], device=DEVICE)
    slots = torch.tensor([2 * 16 + 4, 5 * 16 + 8, 6 * 16 + 2], device=DEVICE)
    caches[0].plan = StepPlan(slots, [DecodeGroup(torch.arange(3, device=DEVICE), tables, positions, True)], [])
    eager = caches[0].attend(0, q, k, v, None, window=None)
    widths = torch.tensor([2, 3, 1], device=DEVICE)
    mask = decode_mask(positions, 48, None)
    op = paged_decode_attention(
        q, k, v, caches[1].keys[0], caches[1].values[0], slots, tables, widths, mask, positions, 0, 16, d**-0.5
    )
    torch.testing.assert_close(op, eager)
    monkeypatch.setenv(ENV, "torch")
    caches[0].plan = StepPlan(slots, [DecodeGroup(torch.arange(3, device=DEVICE), tables, positions, True)], [])
    torch.testing.assert_close(caches[0].attend(0, q, k, v, None, window=None), eager)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_chunks_that_start_their_sequences_attend_as_one_batch(models, backend, monkeypatch):
    """A step of two decodes, four first chunks of 3-30 tokens (three batched together, the shortest left
    alone: padding it to 30 would waste too much) and a chunk over cached rows: the same rows as one call per
    chunk gives, under the backends that batch them (the C++ kernel takes every row in one call anyway)."""
    from keel.serve import kv_cache
    from keel.serve.kv_cache import DecodeGroup, PagedKVCache, PrefillChunk, StepPlan

    monkeypatch.setenv(ENV, backend)
    config = models["llama"].config
    gen = torch.Generator().manual_seed(2)
    cache = PagedKVCache(config, 32, 16, torch.float32, DEVICE)
    for store in cache.keys + cache.values:
        store.copy_(torch.randn(store.shape, generator=gen))
    lengths = [30, 3, 12, 10]
    chunks, start, block = [], 2, 1
    for n in lengths:
        table = torch.arange(block, block + 2, device=DEVICE)
        chunks.append(PrefillChunk(start, start + n, table, torch.arange(n, device=DEVICE), n))
        start, block = start + n, block + 2
    cached = PrefillChunk(start, start + 4, torch.tensor([20, 21], device=DEVICE), torch.arange(20, 24).to(DEVICE), 24)
    chunks.append(cached)
    total = start + 4
    first_slots = [
        c.table.cpu()[torch.arange(len(c.positions)) // 16] * 16 + torch.arange(len(c.positions)) % 16
        for c in chunks[:4]
    ]
    slots = torch.cat([
        torch.tensor([30 * 16, 31 * 16]),
        *first_slots,
        torch.tensor([21 * 16 + 4 + i for i in range(4)]),
    ]).to(DEVICE)  # fmt: skip
    decodes = [DecodeGroup(torch.arange(2, device=DEVICE), torch.tensor([[24, 30], [25, 31]], device=DEVICE),
                           torch.tensor([16, 16], device=DEVICE))]  # fmt: skip
    h, hkv, d = config.num_heads, config.num_kv_heads, config.head_dim
    q = torch.randn(1, h, total, d, generator=gen).to(DEVICE)
    k, v = (torch.randn(1, total, hkv, d, generator=gen).to(DEVICE) for _ in range(2))

    cache.plan = StepPlan(slots, decodes, chunks)
    batches = cache.plan.fresh_prefills()
    assert [sorted(b.chunks) for b in batches] == [[0, 2, 3]]
    batched = cache.attend(0, q, k, v, None, window=None)
    monkeypatch.setattr(kv_cache, "fresh_batches", lambda *a, **kw: [])
    cache.plan = StepPlan(slots, decodes, chunks)
    torch.testing.assert_close(batched, cache.attend(0, q, k, v, None, window=None))
