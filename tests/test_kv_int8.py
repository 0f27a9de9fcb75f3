"""The compact paged KV caches: int8 (keel.serve.kv_quant: quantization, attention against the float cache, a tiny
model) and bfloat16 rows under a float32 model (`kv_cache_dtype="bfloat16"`), on every attention backend."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from keel import kernels
from keel.config import ModelConfig
from keel.errors import KeelError
from keel.model.kv_size import kv_cache_bytes
from keel.quant.loading import load_model
from keel.serve import EngineConfig, LLMEngine, SamplingParams
from keel.serve.kv_cache import DecodeGroup, PagedKVCache, PrefillChunk, StepPlan
from keel.serve.kv_quant import (
    Int8PagedKVCache,
    dequantize_kv,
    make_paged_kv_cache,
    quantize_kv,
    sequence_plan,
)
from tiny_models import save_hf_model

pytestmark = pytest.mark.isa  # run again under KEEL_CPU_ISA=avx2 by `make test`
NEEDS_KERNELS = pytest.mark.skipif(not kernels.active(), reason="keel's C++ kernels are off")

LLAMA = dict(
    architecture="llama",
    vocab_size=256,
    hidden_size=128,
    intermediate_size=256,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
)
MLA = dict(
    architecture="deepseek_v3",
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=4,
    head_dim=24,
    kv_lora_rank=16,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=24,
)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("parts", [None, (16, 8)])
def test_round_trip_is_within_half_a_step(parts):
    torch.manual_seed(0)
    x = torch.randn(3, 50, 24) * torch.logspace(-3, 3, 50).view(1, 50, 1)  # rows of very different magnitude
    x[0, 0] = 0.0  # an all-zero row: scale 0, no division by zero
    x[1, 1, 5] = 1e4  # an outlier sets its own row's scale only
    q, scales = quantize_kv(x, parts)
    assert q.dtype == torch.int8 and scales.dtype == torch.float16
    assert scales.shape == (3, 50, len(parts or (24,))) and q.abs().max() <= 127
    deq = dequantize_kv(q, scales, torch.float32, parts)
    # Each element's step is its row's (or part's) scale; the float16 rounding of the scale adds < 0.1%.
    step = scales.float().repeat_interleave(torch.tensor(parts or (24,)), dim=-1)
    assert ((deq - x).abs() <= 0.5 * step * 1.001 + 1e-12).all()
    assert (deq[0, 0] == 0).all() and (deq[1, 2] != 0).any()
    assert dequantize_kv(q, scales, torch.bfloat16, parts).dtype == torch.bfloat16


def packed_plan(steps: list[tuple[list[int], int, int]], block_size: int) -> StepPlan:
    """A packed step of several sequences, as the runner builds it: (block table, start, num tokens) each."""
    slots, dec_index, dec_tables, dec_pos, prefills, offset = [], [], [], [], [], 0
    for table, start, n in steps:
        slots += [table[p // block_size] * block_size + p % block_size for p in range(start, start + n)]
        blocks = table[: -(-(start + n) // block_size)]
        if n == 1:
            dec_index.append(offset)
            dec_tables.append(blocks)
            dec_pos.append(start)
        else:
            prefills.append(
                PrefillChunk(offset, offset + n, torch.tensor(blocks), torch.arange(start, start + n), start + n)
            )
        offset += n
    width = max((len(t) for t in dec_tables), default=0)
    decodes = (
        [
            DecodeGroup(
                torch.tensor(dec_index),
                torch.tensor([t + [0] * (width - len(t)) for t in dec_tables]),
                torch.tensor(dec_pos),
            )
        ]
        if dec_index
        else []
    )
    return StepPlan(torch.tensor(slots), decodes, prefills)


# Step 1 writes three prompts; step 2 decodes two of them (one group, different lengths) and prefills
# a 6-token chunk of the third on top of its cached 10-token prefix.
BS = 4
TABLES = {"a": [3, 7, 1, 9], "b": [2, 5, 8], "c": [0, 6, 4]}
STEP1 = [(TABLES["a"], 0, 10), (TABLES["b"], 0, 9), (TABLES["c"], 0, 7)]
STEP2 = [(TABLES["b"], 9, 1), (TABLES["a"], 10, 6), (TABLES["c"], 7, 1)]


def both_steps_on_backend(config, make_inputs, backend: str, int8: bool, window, monkeypatch, *extra):  # noqa: ANN001, ANN201
    """STEP1 then STEP2 through a paged cache (int8 or float) on attention `backend` (skipped where it cannot run
    here: Triton not installed, keel's kernels not active): the second step's output on the CPU, and the (q, k, v)
    of both steps a float reference should read (what an int8 cache stores). `make_inputs(device)` gives each step's
    (q, k, v); `extra` follows the window in `attend` (score modifiers: tensors moved to the cache's device)."""
    from keel.kernels import triton_paged
    from keel.serve.attention_backends import ENV

    device, block_size = "cpu", 4
    if backend == "triton":
        if not triton_paged.available():
            pytest.skip("Triton is not installed")
        device, block_size = ("cuda" if torch.cuda.is_available() else "cpu"), 16  # the kernel's smallest block
    if backend == "kernels" and not kernels.active():
        pytest.skip("keel's kernels are not active here")
    monkeypatch.setenv(ENV, backend)
    inputs = make_inputs(device)
    cache = (Int8PagedKVCache if int8 else PagedKVCache)(config, 10, block_size, torch.float32, device)
    assert cache.attention_backend() == backend
    extra = tuple(x.to(device) if isinstance(x, torch.Tensor) else x for x in extra)
    for steps, args in zip((STEP1, STEP2), inputs, strict=True):
        plan = packed_plan(steps, block_size)
        cache.plan = StepPlan(
            plan.slot_mapping.to(device),
            [dataclasses.replace(g, index=g.index.to(device), tables=g.tables.to(device),
                                 positions=g.positions.to(device)) for g in plan.decodes],
            [c._replace(table=c.table.to(device), positions=c.positions.to(device)) for c in plan.prefills],
        )  # fmt: skip
        out = cache.attend(0, *args, None, window, *extra)
    inputs = [tuple(t.cpu() for t in step) for step in inputs]
    if int8:  # the reference reads what the cache stores
        inputs = [
            (q, *(dequantize_kv(*quantize_kv(x, None), torch.float32, None) for x in (k, v))) for q, k, v in inputs
        ]
    return out.cpu(), inputs


def run_steps(cache: PagedKVCache, inputs: list[tuple], latent: bool, window: int | None) -> torch.Tensor:
    for steps, args in zip((STEP1, STEP2), inputs, strict=True):
        cache.plan = packed_plan(steps, BS)
        out = cache.attend_latent(0, *args, None, 0.3) if latent else cache.attend(0, *args, None, window)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ["llama", "llama-window", "mla"])
def test_attention_matches_the_float_cache(dtype, arch):
    """Decode group + prefill chunk over a cached prefix. Two references: the float cache fed the
    dequantized K/V (the same math: float32 rounding only, or bfloat16's), and the float cache fed the
    original K/V (the quantization error: < 2% relative for unit-normal K/V)."""
    latent, window = arch == "mla", (5 if arch == "llama-window" else None)
    config = ModelConfig(**(MLA if latent else LLAMA))
    torch.manual_seed(0)
    heads, kv_heads = config.num_heads, (1 if latent else config.num_kv_heads)
    dim = config.kv_lora_rank + config.qk_rope_head_dim if latent else config.head_dim
    parts = (config.kv_lora_rank, config.qk_rope_head_dim) if latent else None
    inputs, dequantized = [], []
    for steps in (STEP1, STEP2):
        t = sum(n for _, _, n in steps)
        q = torch.randn(1, heads, t, dim, dtype=dtype)
        k, v = torch.randn(1, t, kv_heads, dim, dtype=dtype), torch.randn(1, t, kv_heads, dim, dtype=dtype)
        if latent:  # the rope key 20x larger than the latent: each part needs its own scale
            k[..., config.kv_lora_rank :] *= 20
        inputs.append((q, k) if latent else (q, k, v))
        deq = [dequantize_kv(*quantize_kv(x, parts), dtype, parts) for x in (k, v)]
        dequantized.append((q, deq[0]) if latent else (q, *deq))
    int8 = Int8PagedKVCache(config, 10, BS, dtype)
    got = run_steps(int8, inputs, latent, window)
    same_math = run_steps(PagedKVCache(config, 10, BS, dtype), dequantized, latent, window)
    want = run_steps(PagedKVCache(config, 10, BS, dtype), inputs, latent, window)
    assert got.dtype == dtype and got.shape == want.shape
    assert rel(got, same_math) < (1e-5 if dtype == torch.float32 else 1e-2)
    assert rel(got, want) < 0.02


def greedy_run(model, cache: PagedKVCache, prompt: list[int], new_tokens: int, chunk: int, forced=None):
    """Prompt logits (prefill chunks of `chunk` tokens over the cached prefix) and `new_tokens` greedy
    decode steps; with `forced`, feed those tokens instead of the argmax (teacher forcing)."""
    table = list(range(cache.num_blocks))
    logits, tokens = [], list(prompt)
    with torch.inference_mode():
        for start in range(0, len(prompt), chunk):
            n = min(chunk, len(prompt) - start)
            cache.plan = sequence_plan(table, start, n, cache.block_size)
            x = torch.tensor([prompt[start : start + n]])
            logits.append(model(x, positions=torch.arange(start, start + n)[None], cache=cache)[0])
        for i in range(new_tokens):
            tokens.append(forced[i] if forced is not None else int(logits[-1][-1].argmax()))
            pos = len(tokens) - 1
            cache.plan = sequence_plan(table, pos, 1, cache.block_size)
            logits.append(model(torch.tensor([[tokens[-1]]]), positions=torch.tensor([[pos]]), cache=cache)[0])
    cache.plan = None
    return torch.cat(logits), tokens[len(prompt) :]


def test_tiny_llama_logits_and_greedy_tokens():
    """Random tiny llama, 48 prompt tokens in chunks of 16, 32 greedy tokens. Stated bounds (measured:
    1.6%, 96%, 15): logits within 3% of the float cache's (relative norm, teacher-forced on the float
    run's tokens), >= 90% of those argmaxes equal, the first 8 free-running greedy tokens identical."""
    from keel.model.transformer import build_model

    config = ModelConfig(**LLAMA)
    torch.manual_seed(0)
    model = build_model(config).eval()
    with torch.no_grad():  # weights of std 0.1, not 0.02: varied greedy tokens instead of one repeated
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.1)
    prompt = torch.randint(0, config.vocab_size, (48,)).tolist()
    cache = lambda kind: make_paged_kv_cache(config, 24, 4, torch.float32, "cpu", kind)
    want, tokens = greedy_run(model, cache("auto"), prompt, 32, 16)
    forced, _ = greedy_run(model, cache("int8"), prompt, 32, 16, forced=tokens)
    _, free_tokens = greedy_run(model, cache("int8"), prompt, 32, 16)
    assert len(set(tokens)) > 16
    assert rel(forced, want) < 0.03
    assert (forced.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9
    assert free_tokens[:8] == tokens[:8]


def test_bytes_are_about_half_of_bfloat16():
    smollm2 = ModelConfig(
        architecture="llama",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
    )
    bf16 = kv_cache_bytes(smollm2, torch.bfloat16)
    int8 = kv_cache_bytes(smollm2, torch.bfloat16, "int8")
    assert int8 == 2 * 30 * 3 * (64 + 2)  # int8 rows + one float16 scale per head and token
    assert bf16 / 2 < int8 <= bf16 / 2 * (1 + 2 / 64)  # 51.6% of bfloat16 at head_dim 64
    assert kv_cache_bytes(smollm2, torch.float32, "int8") == int8  # whatever the compute dtype
    assert kv_cache_bytes(smollm2, torch.bfloat16, "auto") == bf16
    assert kv_cache_bytes(smollm2, torch.bfloat16, "int8", tokens=16) == 16 * int8
    for config in (ModelConfig(**LLAMA), ModelConfig(**MLA)):
        cache = make_paged_kv_cache(config, 5, 4, torch.bfloat16, "cpu", "int8")
        assert isinstance(cache, Int8PagedKVCache)
        assert cache.nbytes() == kv_cache_bytes(config, torch.bfloat16, "int8", tokens=4) * 5
        # "auto": the model's dtype, as the float cache allocates it (what `keel profile decode` counts per token)
        assert make_paged_kv_cache(config, 5, 4, torch.bfloat16).nbytes() == kv_cache_bytes(config, torch.bfloat16) * 20
    assert kv_cache_bytes(ModelConfig(**MLA), torch.bfloat16, "int8") == 2 * (16 + 8 + 2 * 2)
    assert type(make_paged_kv_cache(ModelConfig(**LLAMA), 5, 4, torch.bfloat16)) is PagedKVCache
    with pytest.raises(KeelError, match="kv_cache_dtype"):
        make_paged_kv_cache(ModelConfig(**LLAMA), 5, 4, torch.bfloat16, "cpu", "fp8")
    with pytest.raises(KeelError, match="kv_cache_dtype"):
        kv_cache_bytes(ModelConfig(**LLAMA), torch.bfloat16, "fp8")


def test_values_narrower_than_keys_are_stored_and_counted_at_their_own_width():
    """MiMo-V2-Flash's values (v_head_dim 12 beside head_dim 16), the sliding layers with twice the KV heads: the
    float cache's value rows are 12 wide and the bytes per token count them so; the int8 cache refuses them."""
    mimo = ModelConfig(
        architecture="mimo_v2_flash",
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        global_num_kv_heads=1,
        head_dim=16,
        v_head_dim=12,
        sliding_window=8,
        layer_types=["full_attention", "sliding_attention"],
    )
    assert kv_cache_bytes(mimo, torch.float32) == 4 * (1 * (16 + 12) + 2 * (16 + 12))
    cache = make_paged_kv_cache(mimo, 5, 4, torch.float32)
    assert [v.shape for v in cache.values] == [(1, 20, 12), (2, 20, 12)]
    assert [k.shape for k in cache.keys] == [(1, 20, 16), (2, 20, 16)]
    assert cache.nbytes() == kv_cache_bytes(mimo, torch.float32) * 20
    assert not cache.attends_in_place(0)  # keel's kernel reads values as wide as the keys
    with pytest.raises(KeelError, match="v_head_dim"):
        make_paged_kv_cache(mimo, 5, 4, torch.float32, "cpu", "int8")


def budget_engine(loaded, kind: str, adapt: bool = False) -> LLMEngine:
    """An engine of a 4 MiB KV budget (its block count shows the bytes per token), 32-token steps."""
    config = EngineConfig.of(
        kv_cache_memory="4MiB", block_size=8, max_model_len=128, max_num_batched_tokens=32, kv_cache_dtype=kind
    )
    return LLMEngine(loaded, config, adapt=adapt)


def test_engine_option_sizes_the_pool_and_generates(tmp_path):
    """EngineConfig.of(kv_cache_dtype="int8"): the same budget holds more blocks, and generation works
    through prefill chunks, decode batches and prefix hits; a bad value is a clear error."""
    save_hf_model("llama", tmp_path / "m")
    loaded = load_model(tmp_path / "m")
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [[i % 250 for i in range(s, s + 40)] for s in (0, 0, 7)]  # two share a prefix
    outputs, blocks = {}, {}
    for kind in ("auto", "int8"):
        engine = budget_engine(loaded, kind)
        for i, p in enumerate(prompts):
            engine.add_request(p, params, request_id=str(i))
        done = {}
        while engine.has_unfinished_requests():
            done.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
        outputs[kind], blocks[kind] = done, engine.kv.num_blocks
        assert engine.stats()["prefix_cache_hits"] > 0
    assert blocks["int8"] >= 3.5 * blocks["auto"]  # float32 model: 4 bytes -> 1 byte + a scale per 32 values
    agree = sum(a == b for r in outputs["auto"] for a, b in zip(outputs["auto"][r], outputs["int8"][r], strict=True))
    assert agree >= 0.8 * 3 * 12
    with pytest.raises(KeelError, match="kv_cache_dtype|kv-cache-dtype"):
        LLMEngine(loaded, EngineConfig.of(num_blocks=64, block_size=8, max_model_len=128, kv_cache_dtype="fp8"))


# ------------------------------------------------------------------ bfloat16 rows, float32 compute
class RoundedCache(PagedKVCache):
    """The reference for a bfloat16 store: a float32 cache whose written K/V are rounded to bfloat16 first."""

    def _write(self, store: torch.Tensor, rows: torch.Tensor) -> None:
        super()._write(store, rows.to(torch.bfloat16).float())


@pytest.mark.parametrize("backend", [pytest.param("kernels", marks=NEEDS_KERNELS), "torch"])
@pytest.mark.parametrize("arch", ["llama", "llama-window", "mla"])
def test_bfloat16_store_attends_as_rounded_float32(arch, backend, monkeypatch):
    """A float32 model's queries over bfloat16 rows (decode group + prefill chunk over a cached prefix): the
    float32 cache fed the same rows rounded to bfloat16, to float32 rounding; float32 outputs, half the bytes."""
    monkeypatch.setenv("KEEL_ATTENTION_BACKEND", backend)
    latent, window = arch == "mla", (5 if arch == "llama-window" else None)
    config = ModelConfig(**(MLA if latent else LLAMA))
    torch.manual_seed(0)
    heads, kv_heads = config.num_heads, (1 if latent else config.num_kv_heads)
    dim = config.kv_lora_rank + config.qk_rope_head_dim if latent else config.head_dim
    inputs = []
    for steps in (STEP1, STEP2):
        t = sum(n for _, _, n in steps)
        q = torch.randn(1, heads, t, dim)
        k, v = torch.randn(1, t, kv_heads, dim), torch.randn(1, t, kv_heads, dim)
        inputs.append((q, k) if latent else (q, k, v))
    bf16 = make_paged_kv_cache(config, 10, BS, torch.float32, "cpu", "bfloat16")
    assert type(bf16) is PagedKVCache and bf16.keys[0].dtype == torch.bfloat16
    assert bf16.attention_backend() == backend
    got = run_steps(bf16, inputs, latent, window)
    want = run_steps(RoundedCache(config, 10, BS, torch.float32), inputs, latent, window)
    unrounded = run_steps(PagedKVCache(config, 10, BS, torch.float32), inputs, latent, window)
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert rel(got, want) < 1e-5
    assert rel(got, unrounded) > 1e-4  # the rows were stored rounded: the test can tell
    assert bf16.nbytes() * 2 == PagedKVCache(config, 10, BS, torch.float32).nbytes()
    assert kv_cache_bytes(config, torch.float32, "bfloat16") == kv_cache_bytes(config, torch.bfloat16)


@pytest.mark.parametrize("backend", [pytest.param("kernels", marks=NEEDS_KERNELS), "torch"])
def test_engine_bfloat16_cache_of_a_float32_model(tmp_path, backend, monkeypatch):
    """EngineConfig.of(kv_cache_dtype="bfloat16") on a float32 model, as served (fused layers, prefill chunks,
    decode batches, prefix hits): twice the blocks of the same budget, and greedy tokens equal to the float32
    model over a cache that rounds its rows to bfloat16."""
    monkeypatch.setenv("KEEL_ATTENTION_BACKEND", backend)
    save_hf_model("llama", tmp_path / "m")
    loaded = load_model(tmp_path / "m", "float32")
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [[i % 250 for i in range(s, s + 40)] for s in (0, 0, 7)]  # two share a prefix
    blocks, done = {}, {}
    for kind in ("auto", "bfloat16"):
        engine = budget_engine(loaded, kind, adapt=True)
        blocks[kind] = engine.kv.num_blocks
        if kind == "auto":
            continue
        assert engine.cache.keys[0].dtype == torch.bfloat16 and "paged bfloat16" in engine.backends
        for i, p in enumerate(prompts):
            engine.add_request(p, params, request_id=str(i))
        while engine.has_unfinished_requests():
            done.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
        assert engine.stats()["prefix_cache_hits"] > 0
    assert blocks["bfloat16"] in (2 * blocks["auto"], 2 * blocks["auto"] + 1)
    config = loaded.model.config
    for i, p in enumerate(prompts):
        _, want = greedy_run(loaded.model, RoundedCache(config, 24, 8, torch.float32), p, 12, 16)
        assert done[str(i)] == want
