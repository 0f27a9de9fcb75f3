"""Asynchronous scheduling (SchedulerConfig.async_scheduling, vLLM's --async-scheduling): step N+1 is scheduled
and queued before step N's tokens are read, its in-flight tokens filled in from step N's draws on the device.
On a CPU nothing overlaps, but the order and the outputs are the same as on CUDA: checked here against the
synchronous engine."""

from __future__ import annotations

import dataclasses

import pytest

from keel.errors import KeelError
from keel.quant.loading import load_model
from keel.serve import LLM, EngineConfig, LLMEngine, SamplingParams
from keel.serve.speculative import SpeculativeConfig
from tiny_models import save_byte_tokenizer, save_hf_model


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    root = tmp_path_factory.mktemp("async")
    save_hf_model("llama", root)
    save_byte_tokenizer(root)
    return load_model(root)


def _config(async_scheduling: bool | None, speculative: SpeculativeConfig | None = None) -> EngineConfig:
    config = EngineConfig.of(num_blocks=64, block_size=8, max_model_len=128, async_scheduling=async_scheduling)
    return dataclasses.replace(config, speculative=speculative)


def test_each_step_is_queued_before_the_previous_is_read(loaded):
    engine = LLMEngine(loaded, _config(True))
    assert engine.async_scheduling
    runner = engine.runner
    events = []
    launch, collect = runner.launch, runner.collect

    def recording_launch(out, previous=None):
        launched = launch(out, previous)
        fed = [r.request_id for r, _ in out.scheduled if r.in_flight]
        events.append(("launch", launched, previous, fed))
        return launched

    def recording_collect(launched):
        events.append(("collect", launched))
        return collect(launched)

    runner.launch, runner.collect = recording_launch, recording_collect
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), request_id="a")
    assert engine.step() == []  # the prefill's draw is in flight
    assert engine.scheduler.requests["a"].in_flight == 1
    outputs = [engine.step() for _ in range(3)]
    assert [[len(o.outputs[0].token_ids) for o in step] for step in outputs] == [[1], [2], [3]]
    # Every launch after the first fed the token in flight, and came before the previous step was read.
    launches = [e for e in events if e[0] == "launch"]
    for i in range(1, 4):
        _, launched, previous, fed = launches[i]
        assert previous is launches[i - 1][1] and fed == ["a"]
        assert events.index(launches[i]) < events.index(("collect", previous))
    # The fourth token's draw needs no fifth step: max_tokens is reached in flight.
    last = engine.step()
    assert last[0].finished and len(last[0].outputs[0].token_ids) == 4
    assert len(launches) == 4 and not engine.has_unfinished_requests()


def _crowd() -> tuple[list[list[int]], list[SamplingParams]]:
    """Greedy and seeded rows (an unseeded draw would share the global generator, whose draws a finished
    request's extra step moves), stop tokens, stop strings, EOS, logprobs; two rows whose sampling reads their
    own tokens (a penalty, min_tokens), which make the engine wait for each step while they run."""
    prompts, params = [], []
    for i in range(12):
        prompts.append([(7 * i + j) % 250 + 1 for j in range(3 + (5 * i) % 17)])
        kind = i % 6
        if kind == 0:
            p = SamplingParams(max_tokens=20 + i, temperature=0.0, ignore_eos=True)
        elif kind == 1:
            p = SamplingParams(max_tokens=30, temperature=0.9, top_p=0.9, seed=i, logprobs=2, ignore_eos=True)
        elif kind == 2:
            p = SamplingParams(max_tokens=40, temperature=1.0, top_k=20, seed=i, stop=["e", "a"])
        elif kind == 3:
            p = SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=[prompts[-1][0], 101, 102, 103])
        elif kind == 4:
            p = SamplingParams(max_tokens=6, temperature=0.0, repetition_penalty=1.3)
        else:
            p = SamplingParams(max_tokens=25, temperature=0.8, seed=i, min_tokens=3)
        params.append(p)
    return prompts, params


def _outputs(llm: LLM, prompts, params) -> list[tuple]:
    outs = llm.generate(prompts, params, use_tqdm=False)
    rows = []
    for o in outs:
        c = o.outputs[0]
        lps = None if c.logprobs is None else [(lp.token_id, round(lp.logprob, 5), lp.rank) for lp in c.logprobs]
        rows.append((c.token_ids, c.text, c.finish_reason, c.stop_reason, lps))
    return rows


def test_outputs_equal_the_synchronous_engine(loaded):
    prompts, params = _crowd()
    sync = LLM(loaded, _config(False))
    assert not sync.engine.async_scheduling  # the default on a CPU
    want = _outputs(sync, prompts, params)
    assert {row[2] for row in want} >= {"stop", "length"}
    engine = LLM(loaded, _config(True))
    steps = {"async": 0, "sync": 0}
    step_async, step_sync = engine.engine._step_async, engine.engine._step_sync

    def counting(kind, step):
        def run():
            steps[kind] += 1
            return step()

        return run

    engine.engine._step_async, engine.engine._step_sync = counting("async", step_async), counting("sync", step_sync)
    assert _outputs(engine, prompts, params) == want
    assert steps["async"] > 10 and steps["sync"] > 0  # the penalised rows' steps waited, the others did not
    kv = engine.engine.kv
    assert kv.num_free_blocks == kv.num_blocks and not kv.seqs
    # The requests alone, all asynchronous: the same again.
    plain = [i for i, p in enumerate(params) if not p.reads_own_tokens]
    assert _outputs(engine, [prompts[i] for i in plain], [params[i] for i in plain]) == [want[i] for i in plain]


def test_refused_beside_speculation_and_off_by_default_on_cpu(loaded):
    ngram = SpeculativeConfig(method="ngram", num_speculative_tokens=2)
    with pytest.raises(KeelError, match="--async-scheduling does not run with speculative decoding"):
        LLMEngine(loaded, _config(True, speculative=ngram))
    assert LLMEngine(loaded, _config(None, speculative=ngram)).async_scheduling is False
    assert LLMEngine(loaded, _config(None)).async_scheduling is False


def test_a_token_read_after_preemption_keeps_the_request_protected(loaded):
    """Preempted while its token was in flight: the token joins its output, and the request stays protected
    from another preemption until it runs again (as when it generates its next token)."""
    from keel.serve.request import Status

    engine = LLMEngine(loaded, _config(True))
    rid = engine.add_request([1, 2, 3], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    request = engine.scheduler.requests[rid]
    track = engine._tracks[rid]
    request.status, request.protected = Status.WAITING, True
    engine._emit(request, track, [7], None, 0.0)
    assert request.output_token_ids == [7] and request.protected
    request.status = Status.RUNNING
    engine._emit(request, track, [8], None, 0.0)
    assert request.output_token_ids == [7, 8] and not request.protected
