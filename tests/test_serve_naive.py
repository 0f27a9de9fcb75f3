"""The naive baseline engine (transformers, one request at a time) behind the same async driver."""

from __future__ import annotations

import asyncio

import pytest

from keel.errors import KeelError
from keel.quant.loading import load_model
from keel.serve import LLM, AsyncEngine, SamplingParams
from keel.serve.naive import NaiveEngine
from tiny_models import save_byte_tokenizer, save_hf_model

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    path = tmp_path_factory.mktemp("naive") / "qwen2"
    save_hf_model("qwen2", path)
    save_byte_tokenizer(path)
    return load_model(path, "float32")


def test_naive_engine_matches_keel_engine(loaded):
    prompts = ["hello", "a longer prompt here", [5, 6, 7, 8]]
    lengths = [5, 9, 7]
    want = LLM(loaded, num_blocks=64, max_model_len=128).generate(
        prompts, [SamplingParams(max_tokens=n, **GREEDY) for n in lengths], use_tqdm=False
    )
    naive = NaiveEngine(loaded)
    ids = [naive.add_request(p, SamplingParams(max_tokens=n, **GREEDY)) for p, n in zip(prompts, lengths, strict=True)]
    finished, running = {}, []
    while naive.has_unfinished_requests():
        running.append(naive.stats()["num_requests_running"])
        for out in naive.step():
            if out.finished:
                finished[out.request_id] = out
    assert max(running) == 1  # one request at a time
    for rid, ref in zip(ids, want, strict=True):
        out = finished[rid].outputs[0]
        assert out.token_ids == ref.outputs[0].token_ids and out.text == ref.outputs[0].text
        assert out.finish_reason == "length"
    assert naive.stats()["generation_tokens_total"] == sum(lengths)


def test_naive_engine_async_abort_and_errors(loaded):
    naive = NaiveEngine(loaded, max_model_len=64)
    with pytest.raises(KeelError, match="exceeds the model length 64"):
        naive.add_request([1] * 60, SamplingParams(max_tokens=10))
    engine = AsyncEngine(naive)

    async def main():
        agen = engine.generate("abc", SamplingParams(max_tokens=40, **GREEDY))
        await agen.__anext__()
        await agen.aclose()  # a disconnecting client
        outs = [o async for o in engine.generate("xyz", SamplingParams(max_tokens=4, **GREEDY))]
        return outs[-1]

    try:
        last = asyncio.run(main())
        assert last.finished and len(last.outputs[0].token_ids) == 4
        assert not naive.has_unfinished_requests() and naive.current is None
    finally:
        engine.shutdown()
