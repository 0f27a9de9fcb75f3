"""The serving engine on tiny models: paging, preemption, prefix caching, chunked prefill, sampling."""

from __future__ import annotations

import asyncio
import random
import threading

import pytest
import torch

from keel.errors import KeelError
from keel.quant.loading import load_model
from keel.serve import LLM, AsyncEngine, EngineConfig, LLMEngine, RequestOutputKind, SamplingParams
from reference_generate import stream_tokens
from tiny_models import save_byte_tokenizer, save_hf_model

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    out = {}
    for name in ("llama", "mistral", "qwen3_moe"):
        save_hf_model(name, root / name)
        save_byte_tokenizer(root / name)
        out[name] = load_model(root / name)
    return out


def solo(model, prompt: list[int], max_tokens: int) -> list[int]:
    """The reference: one request alone, contiguous cache (itself checked against transformers)."""
    return list(stream_tokens(model, prompt, SamplingParams(max_tokens=max_tokens, **GREEDY)))


def check_no_leak(engine: LLMEngine) -> None:
    kv = engine.kv
    assert kv.num_free_blocks == kv.num_blocks
    assert all(b.ref_count == 0 for b in kv.blocks)
    assert not kv.seqs and not engine.scheduler.running and not engine.scheduler.waiting


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_pressure_preemption_prefixes_aborts_match_solo(models, async_scheduling):
    """Under asynchronous scheduling too: preemption and aborts with tokens in flight, a finished request's
    extra step dropped, prefix blocks registered once their last token is read."""
    loaded = models["llama"]
    rng = random.Random(0)
    shared = [[rng.randrange(256) for _ in range(rng.choice((16, 24, 40)))] for _ in range(4)]
    requests = []
    for i in range(200):
        body = [rng.randrange(256) for _ in range(rng.randrange(1, 48))]
        prompt = (rng.choice(shared) + body) if i % 3 == 0 else body
        requests.append((str(i), prompt, rng.randrange(1, 24), i % 10 == 7))  # every 10th is aborted
    # 40 blocks of 8 tokens: far less than 64 running sequences need, so preemption must happen.
    config = EngineConfig.of(
        num_blocks=40,
        block_size=8,
        max_num_batched_tokens=96,
        max_num_seqs=64,
        max_model_len=128,
        async_scheduling=async_scheduling,
    )
    engine = LLMEngine(loaded, config)
    assert engine.async_scheduling is async_scheduling
    for rid, prompt, max_tokens, _ in requests:
        engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, **GREEDY), request_id=rid)
    to_abort = {rid for rid, *_, abort in requests if abort}
    results, steps, generated = {}, 0, 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        steps += 1
        generated += sum(len(o.delta_token_ids) for o in outputs)
        for out in outputs:
            if out.finished:
                results[out.request_id] = out
            elif out.request_id in to_abort and len(out.outputs[0].token_ids) >= 1:
                aborted = engine.abort_request(out.request_id)
                assert aborted.finished and aborted.outputs[0].finish_reason == "abort"
                results[out.request_id] = aborted
    stats = engine.stats()
    assert stats["num_preemptions_total"] > 0
    assert 0 < stats["prefix_cache_hits"] <= stats["prefix_cache_queries"]
    assert stats["generation_tokens_total"] == generated
    assert stats["prompt_tokens_total"] == sum(len(p) for _, p, _, _ in requests)
    # vLLM's iteration tokens, through preemptions and prefix hits: each step's prompts whose prefill ended
    # and tokens generated, so they add up to every prompt and generated token.
    assert 0 < sum(stats["iteration_tokens_counts"]) <= steps
    assert stats["iteration_tokens_sum"] == stats["prompt_tokens_total"] + generated
    check_no_leak(engine)
    for rid, prompt, max_tokens, aborted in requests:
        got = results[rid].outputs[0].token_ids
        want = solo(loaded.model, prompt, max_tokens)
        if aborted and results[rid].outputs[0].finish_reason == "abort":
            assert got == want[: len(got)]
        else:
            assert got == want, rid
            assert results[rid].outputs[0].finish_reason == "length"


def test_prefix_cache_hits_and_same_output_as_miss(models):
    loaded = models["llama"]
    system = list(range(10, 74))  # 64 shared tokens = 4 blocks of 16
    prompts = [system + [100 + i, 7, 8] for i in range(4)]
    llm = LLM(loaded, num_blocks=64, max_model_len=256)
    first = llm.generate(prompts[:1], SamplingParams(max_tokens=8, **GREEDY), use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    rest = llm.generate(prompts[1:], SamplingParams(max_tokens=8, **GREEDY), use_tqdm=False)
    assert all(out.num_cached_tokens == 64 for out in rest)
    stats = llm.engine.stats()
    assert stats["prefix_cache_hits"] == 3 * 64
    cold = LLM(loaded, num_blocks=64, max_model_len=256, enable_prefix_caching=False)
    misses = cold.generate(prompts, SamplingParams(max_tokens=8, **GREEDY), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in [first, *rest]] == [o.outputs[0].token_ids for o in misses]
    assert cold.engine.stats()["prefix_cache_hits"] == 0


def test_prefix_cache_eviction_keeps_correctness(models):
    loaded = models["llama"]
    llm = LLM(loaded, num_blocks=12, block_size=8, max_model_len=96)
    prompt = list(range(20, 60))
    params = SamplingParams(max_tokens=6, **GREEDY)
    before = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    # Other requests reuse every free block: the cached prefix is evicted.
    llm.generate([list(range(100 + i, 170 + i)) for i in range(3)], params, use_tqdm=False)
    after = llm.generate([prompt], params, use_tqdm=False)[0]
    assert after.num_cached_tokens == 0 and after.outputs[0].token_ids == before == solo(loaded.model, prompt, 6)
    check_no_leak(llm.engine)


def test_chunked_prefill_equals_unchunked(models):
    loaded = models["qwen3_moe"]
    prompt = [random.Random(1).randrange(256) for _ in range(150)]
    chunked = LLM(loaded, num_blocks=64, max_num_batched_tokens=32, max_model_len=256)
    out = chunked.generate([prompt], SamplingParams(max_tokens=12, **GREEDY), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == solo(loaded.model, prompt, 12)


def test_a_step_output_is_a_snapshot(models):
    """What a step returned does not change as later steps append tokens (the HTTP server reads outputs on its
    event loop while the engine thread steps on)."""
    engine = LLMEngine(models["llama"], EngineConfig.of(num_blocks=32, max_model_len=64))
    engine.add_request([1, 2, 3, 4], SamplingParams(max_tokens=6, logprobs=1, **GREEDY))
    seen = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen.append((out, list(out.outputs[0].token_ids), len(out.outputs[0].logprobs)))
    assert len(seen) == 6
    for out, ids, n_logprobs in seen:
        assert out.outputs[0].token_ids == ids and len(out.outputs[0].logprobs) == n_logprobs == len(ids)


def test_output_kinds_cumulative_delta_and_final_only(models):
    """vLLM's RequestOutputKind: DELTA outputs add up to the CUMULATIVE ones (text, tokens, logprobs; prompt
    logprobs with the first tokens only), FINAL_ONLY returns nothing until the request finishes and then the
    same output; keel.LLM asks for FINAL_ONLY and leaves the caller's params alone."""
    engine = LLMEngine(models["llama"], EngineConfig.of(num_blocks=64, max_model_len=64))
    outputs: dict[str, list] = {}
    prompt = [5, 3, 9, 1, 2]
    for kind in RequestOutputKind:
        params = SamplingParams(
            max_tokens=7, temperature=0.9, seed=4, logprobs=1, prompt_logprobs=1, ignore_eos=True, output_kind=kind
        )
        engine.add_request(prompt, params, kind.name)
        outputs[kind.name] = []
    steps = 0
    while engine.has_unfinished_requests():
        steps += 1
        for out in engine.step():
            outputs[out.request_id].append(out)
    cumulative, delta, final = (outputs[k.name] for k in RequestOutputKind)
    assert steps >= 7 and len(cumulative) == len(delta) == 7 and len(final) == 1
    whole = cumulative[-1].outputs[0]
    assert final[0].finished and final[0].outputs[0].token_ids == whole.token_ids
    assert final[0].outputs[0].text == whole.text and final[0].outputs[0].finish_reason == whole.finish_reason
    assert [lp.token_id for lp in final[0].outputs[0].logprobs] == whole.token_ids
    assert "".join(o.outputs[0].text for o in delta) == whole.text
    assert [t for o in delta for t in o.outputs[0].token_ids] == whole.token_ids
    assert [lp.logprob for o in delta for lp in o.outputs[0].logprobs] == [lp.logprob for lp in whole.logprobs]
    assert all(len(o.outputs[0].token_ids) == 1 for o in delta) and delta[-1].finished
    assert delta[0].prompt_logprobs == cumulative[0].prompt_logprobs and len(delta[0].prompt_logprobs) == len(prompt)
    assert all(o.prompt_logprobs is None for o in delta[1:])
    assert delta[-1].outputs[0].cumulative_logprob == pytest.approx(whole.cumulative_logprob)
    check_no_leak(engine)
    llm = LLM(models["llama"], num_blocks=64, max_model_len=64)
    params = SamplingParams(max_tokens=7, temperature=0.9, seed=4, ignore_eos=True)
    assert llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids == whole.token_ids
    assert params.output_kind is RequestOutputKind.CUMULATIVE
    with pytest.raises(KeelError, match="output_kind"):
        SamplingParams(output_kind=2).validate()


def test_prefill_unchunked_when_asked(models):
    """--no-enable-chunked-prefill: a prompt is prefilled in one step or waits for a step with room for it; the
    outputs are the chunked engine's; a token budget below max_model_len is refused."""
    loaded = models["llama"]
    rng = random.Random(3)
    prompts = [[rng.randrange(256) for _ in range(60)] for _ in range(3)]
    params = SamplingParams(max_tokens=5, **GREEDY)
    options = dict(num_blocks=64, max_num_batched_tokens=96, max_model_len=96)
    runs = {}
    for chunked in (True, False):
        engine = LLMEngine(loaded, EngineConfig.of(**options, enable_chunked_prefill=chunked))
        steps, execute = [], engine.runner.execute
        engine.runner.execute = lambda sched, execute=execute, steps=steps: (
            steps.append(sorted(n for _, n in sched.scheduled)) or execute(sched)
        )
        ids = [engine.add_request(p, params) for p in prompts]
        outputs = {}
        while engine.has_unfinished_requests():
            outputs.update((out.request_id, out.outputs[0].token_ids) for out in engine.step())
        runs[chunked] = steps, [outputs[i] for i in ids]
    assert runs[True][0][0] == [36, 60]  # chunked: the second prompt's first 36 tokens ride along
    assert runs[False][0][0] == [60]  # whole prompts only: the second waits
    assert {n for step in runs[False][0] for n in step} <= {1, 60}
    assert runs[False][1] == runs[True][1]
    with pytest.raises(KeelError, match="max-num-batched-tokens 32 must be >= max_model_len 96"):
        LLMEngine(loaded, EngineConfig.of(**{**options, "max_num_batched_tokens": 32}, enable_chunked_prefill=False))


def test_cpu_step_budget_follows_the_threads(models, monkeypatch):
    """Without --max-num-batched-tokens a CPU step takes 64 tokens per compute thread (a CPU step costs
    about its tokens); whole-prompt scheduling raises it to max_model_len; a given budget is kept."""
    loaded = models["llama"]
    options = dict(num_blocks=64, max_model_len=512, compile=False)
    for threads in (1, 3):
        monkeypatch.setattr(torch, "get_num_threads", lambda threads=threads: threads)
        assert LLMEngine(loaded, EngineConfig.of(**options)).scheduler.max_num_batched_tokens == 64 * threads
    whole = LLMEngine(loaded, EngineConfig.of(**options, enable_chunked_prefill=False))
    assert whole.scheduler.max_num_batched_tokens == 512
    assert (
        LLMEngine(loaded, EngineConfig.of(**options, max_num_batched_tokens=40)).scheduler.max_num_batched_tokens == 40
    )


def test_sliding_window_matches_transformers_and_frees_blocks(models, tmp_path):

    loaded = models["mistral"]  # window 8
    window, block = loaded.config.sliding_window, 4
    engine = LLMEngine(loaded, EngineConfig.of(num_blocks=64, block_size=block, max_model_len=64))
    rng = random.Random(2)
    prompts = [[rng.randrange(256) for _ in range(rng.randrange(4, 12))] for _ in range(3)]
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, SamplingParams(max_tokens=4 * window, **GREEDY), request_id=str(i))
    results = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.outputs[0].token_ids
        for request in engine.scheduler.running:
            assert engine.kv.held_blocks(request.request_id) <= window // block + 1
    directory = tmp_path / "mistral"
    hf = save_hf_model("mistral", directory)
    hf.generation_config.eos_token_id = None
    for i, prompt in enumerate(prompts):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=4 * window, do_sample=False, pad_token_id=0)
        assert results[str(i)] == ref[0, len(prompt) :].tolist()
    check_no_leak(engine)


def test_seeded_sampling_is_independent_of_the_batch(models):
    loaded = models["llama"]
    seeded = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, seed=1234, ignore_eos=True)
    prompt = [5, 6, 7, 8, 9]
    alone = LLM(loaded, num_blocks=64, max_model_len=128).generate([prompt], seeded, use_tqdm=False)
    crowd_prompts = [[1, 2, 3], prompt, [40] * 20, [9, 9]]
    crowd_params = [SamplingParams(max_tokens=10, temperature=1.0, ignore_eos=True), seeded]
    crowd_params += [SamplingParams(max_tokens=7, temperature=0.7, seed=5), SamplingParams(max_tokens=3, **GREEDY)]
    crowd = LLM(loaded, num_blocks=64, max_model_len=128).generate(crowd_prompts, crowd_params, use_tqdm=False)
    assert crowd[1].outputs[0].token_ids == alone[0].outputs[0].token_ids


def test_stop_string_across_token_boundaries():
    """On real text (SmolLM2): a stop string made of the end of one token and the start of the next."""
    llm = LLM("smollm2-135m-instruct", num_blocks=64, max_model_len=512)
    tokenizer = llm.engine.tokenizer
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Describe a cat in two sentences."}])
    sampling = dict(max_tokens=40, temperature=0.0)
    free = llm.generate(prompt, SamplingParams(**sampling), use_tqdm=False)[0].outputs[0]
    text, ids = free.text, free.token_ids
    pieces = [tokenizer.decode([t]) for t in ids]
    i = next(i for i in range(4, len(ids) - 1) if len(pieces[i].strip()) >= 3 and len(pieces[i + 1].strip()) >= 3)
    stop = pieces[i][-2:] + pieces[i + 1][:2]
    assert text.count(stop) >= 1
    out = llm.generate(prompt, SamplingParams(stop=[stop], **sampling), use_tqdm=False)[0].outputs[0]
    assert out.text == text[: text.index(stop)] and stop not in out.text
    assert out.finish_reason == "stop" and out.stop_reason == stop
    kept = llm.generate(prompt, SamplingParams(stop=stop, include_stop_str_in_output=True, **sampling), use_tqdm=False)
    assert kept[0].outputs[0].text == text[: text.index(stop) + len(stop)]


def test_logprobs_equal_log_softmax_of_reference_logits(models):
    loaded = models["llama"]
    llm = LLM(loaded, num_blocks=64, max_model_len=128)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    params = SamplingParams(max_tokens=5, temperature=0.8, seed=3, logprobs=3, prompt_logprobs=2, ignore_eos=True)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    ids = out.outputs[0].token_ids
    with torch.no_grad():
        ref = loaded.model(torch.tensor([prompt + ids]))[0].log_softmax(-1)
    for step, (token, lp) in enumerate(zip(ids, out.outputs[0].logprobs, strict=True)):
        row = ref[len(prompt) - 1 + step]
        assert lp.token_id == token
        assert lp.logprob == pytest.approx(row[token].item(), abs=1e-4)
        assert [t for t, _ in lp.top] == row.topk(3).indices.tolist()
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for i in range(1, len(prompt)):
        assert out.prompt_logprobs[i].logprob == pytest.approx(ref[i - 1, prompt[i]].item(), abs=1e-4)


def test_limits_and_errors(models):
    loaded = models["llama"]
    with pytest.raises(KeelError, match="cannot hold one sequence"):
        LLMEngine(loaded, EngineConfig.of(num_blocks=2, block_size=16, max_model_len=64))
    engine = LLMEngine(loaded, EngineConfig.of(num_blocks=16, block_size=16, max_model_len=64))
    with pytest.raises(KeelError, match="exceeds the model length 64"):
        engine.add_request(list(range(60)), SamplingParams(max_tokens=8))
    with pytest.raises(KeelError, match="temperature"):
        engine.add_request([1, 2], SamplingParams(temperature=-1))
    rid = engine.add_request(list(range(30)), SamplingParams(max_tokens=20, **GREEDY))
    engine.step()
    assert engine.kv.num_free_blocks < engine.kv.num_blocks
    engine.abort_request(rid)
    check_no_leak(engine)


def test_max_model_len_auto_fits_the_kv_cache(models, caplog):
    """vLLM's --max-model-len auto (-1): the model's context where the cache holds it, else what the cache holds
    (logged), and requests are refused past that length."""
    loaded = models["llama"]
    context = loaded.config.max_position_embeddings
    roomy = LLMEngine(loaded, EngineConfig.of(num_blocks=-(-context // 16) + 1, block_size=16, max_model_len="auto"))
    assert roomy.max_model_len == context and roomy.config.scheduler.max_model_len == -1
    with caplog.at_level("WARNING", logger="keel.serve"):
        tight = LLMEngine(loaded, EngineConfig.of(num_blocks=3, block_size=16, max_model_len=-1))
    assert tight.max_model_len == 48 < context and "--max-model-len auto: 48 tokens" in caplog.text
    with pytest.raises(KeelError, match="exceeds the model length 48"):
        tight.add_request(list(range(40)), SamplingParams(max_tokens=9))
    rid = tight.add_request(list(range(40)), SamplingParams(max_tokens=8, **GREEDY))
    while tight.has_unfinished_requests():
        outputs = tight.step()
    assert outputs[0].request_id == rid and len(outputs[0].outputs[0].token_ids) == 8
    check_no_leak(tight)
    for bad in (0, -2):
        with pytest.raises(KeelError, match="--max-model-len must be >= 1 or auto"):
            EngineConfig.of(max_model_len=bad)


def test_priority_policy_runs_important_requests_first(models):
    loaded = models["llama"]
    engine = LLMEngine(
        loaded, EngineConfig.of(num_blocks=64, max_model_len=128, max_num_seqs=1, scheduling_policy="priority")
    )
    for rid, priority in (("low", 5), ("high", -1), ("mid", 0)):
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=2, **GREEDY), request_id=rid, priority=priority)
    order = []
    while engine.has_unfinished_requests():
        order += [o.request_id for o in engine.step() if o.finished]
    assert order == ["high", "mid", "low"]


def test_async_engine_build_loads_and_steps_on_one_thread(models):
    """The server's way: the factory (model loading included) runs on the thread that steps the engine,
    so OpenMP keeps one worker pool; its failure is raised to the caller, with no thread left behind."""
    loaded = models["llama"]
    threads = {}

    class Recording(LLMEngine):
        def step(self):
            threads.setdefault("step", threading.current_thread())
            return super().step()

    def factory():
        threads["build"] = threading.current_thread()
        return Recording(loaded, EngineConfig.of(num_blocks=64, max_model_len=128))

    engine = AsyncEngine.build(factory)

    async def run():
        async for out in engine.generate([1, 2, 3], SamplingParams(max_tokens=4, **GREEDY)):
            last = out
        return last

    try:
        last = asyncio.run(run())
        assert last.outputs[0].token_ids == solo(loaded.model, [1, 2, 3], 4)
        assert threads["build"] is threads["step"] is not threading.main_thread()
        assert threads["build"].name == "keel-engine"
    finally:
        engine.shutdown()

    def broken():
        raise KeelError("cannot read model.gguf")

    before = threading.active_count()
    with pytest.raises(KeelError, match="model.gguf"):
        AsyncEngine.build(broken)
    assert threading.active_count() == before


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_async_engine_streams_deltas_and_aborts_on_cancel(models, async_scheduling):
    loaded = models["llama"]
    config = EngineConfig.of(num_blocks=64, max_model_len=128, async_scheduling=async_scheduling)
    engine = AsyncEngine(LLMEngine(loaded, config))

    async def consume(prompt, max_tokens):
        deltas, last = [], None
        async for out in engine.generate(prompt, SamplingParams(max_tokens=max_tokens, **GREEDY)):
            deltas.append(out.delta_token_ids)
            last = out
        return deltas, last

    async def cancelled():
        agen = engine.generate("hello", SamplingParams(max_tokens=100, **GREEDY))
        await agen.__anext__()
        await agen.aclose()  # what a disconnecting HTTP client does

    async def main():
        results = await asyncio.gather(*(consume([i, i + 1, i + 2], 6 + i) for i in range(4)), cancelled())
        return results[:4]

    try:
        results = asyncio.run(main())
        for i, (deltas, last) in enumerate(results):
            assert last.finished and sum(deltas, []) == last.outputs[0].token_ids
            assert last.outputs[0].token_ids == solo(loaded.model, [i, i + 1, i + 2], 6 + i)
        check_no_leak(engine.engine)
    finally:
        engine.shutdown()
