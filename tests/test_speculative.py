"""Speculative decoding in the engine: lossless greedy and sampled output, KV accounting, switching off."""

from __future__ import annotations

import random

import pytest
import torch

from keel.errors import KeelError
from keel.quant.loading import load_model
from keel.serve import EngineConfig, LLMEngine, SamplingParams
from keel.serve.sampling import RowState, Sampler
from keel.serve.speculative import SpeculativeConfig
from keel.serve.speculative import verify as verify_module
from keel.serve.speculative.ngram import propose_ngram
from tiny_models import build_hf_model, save_byte_tokenizer, save_hf_model

pytestmark = pytest.mark.isa  # run again under KEEL_CPU_ISA=avx2 by `make test`

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec")
    save_hf_model("llama", root / "target")
    save_byte_tokenizer(root / "target")
    save_hf_model("llama", root / "draft", seed=1)  # another random model: many drafts rejected
    save_byte_tokenizer(root / "draft")
    return root


@pytest.fixture(scope="module")
def target(dirs):
    return load_model(dirs / "target")


def copying_prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat a span, so n-gram lookup finds drafts."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        span = [rng.randrange(250) for _ in range(rng.randrange(8, 24))]
        prompts.append(span + [rng.randrange(250) for _ in range(3)] + span[: rng.randrange(2, 8)])
    return prompts


def run(engine: LLMEngine, prompts, params_list, check_blocks: bool = False) -> dict[str, list[int]]:
    for i, (prompt, params) in enumerate(zip(prompts, params_list, strict=True)):
        engine.add_request(prompt, params, request_id=str(i))
    results = {}
    bs = engine.kv.block_size
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out
        if check_blocks:
            # Blocks reserved for rejected drafts are returned at once: a running request holds the
            # blocks of its computed tokens and of its next token's slot, no more.
            held = 0
            for request in engine.scheduler.running:
                blocks = engine.kv.held_blocks(request.request_id)
                assert blocks <= -(-(request.num_computed_tokens + 1) // bs), request.request_id
                held += blocks
            assert engine.kv.num_blocks - engine.kv.num_free_blocks == held
    kv = engine.kv
    assert kv.num_free_blocks == kv.num_blocks and all(b.ref_count == 0 for b in kv.blocks)
    return results


def test_propose_ngram():
    assert propose_ngram([1, 2, 3, 4, 5, 1, 2], k=3) == [3, 4, 5]
    assert propose_ngram([1, 2, 3, 4, 5, 1, 2], k=10) == [3, 4, 5, 1, 2]
    # The longest suffix wins: "9 2" occurred before "1 2".
    assert propose_ngram([9, 2, 7, 1, 2, 8, 9, 2], k=2) == [7, 1]
    assert propose_ngram([1, 2, 3], k=3) == []  # nothing repeats
    assert propose_ngram([5, 5, 5, 5, 5], k=3) == [5, 5, 5]  # a run: an occurrence with k tokens after it
    assert propose_ngram([1, 2, 1, 2], k=2, min_n=3) == []


def test_config_errors():
    with pytest.raises(KeelError, match="unknown key 'method_name'"):
        SpeculativeConfig.from_dict({"method_name": "ngram"})
    with pytest.raises(KeelError, match="num_speculative_tokens"):
        SpeculativeConfig.from_dict({"num_speculative_tokens": 0})
    with pytest.raises(KeelError, match="method"):
        SpeculativeConfig.from_dict({"method": "eagle"})


@pytest.mark.parametrize(
    "spec",
    [
        {"method": "ngram", "num_speculative_tokens": 4},
        {"method": "draft_model", "num_speculative_tokens": 3, "model": "DRAFT"},
        {"method": "draft_model", "num_speculative_tokens": 2, "quantization": "int8"},  # a quantized copy
    ],
    ids=["ngram", "draft-model", "int8-self-draft"],
)
def test_greedy_output_identical_and_blocks_accounted(dirs, target, spec):
    spec = {**spec, "disable_by_batch_size": 64}
    if spec.get("model") == "DRAFT":
        spec["model"] = str(dirs / "draft")
    prompts = copying_prompts(12)
    rng = random.Random(1)
    params = [SamplingParams(max_tokens=rng.randrange(1, 40), **GREEDY) for _ in prompts]
    params[3] = SamplingParams(max_tokens=30, temperature=0.0, stop_token_ids=[prompts[3][5]])  # stops mid-draft
    params[4] = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, logprobs=2)
    # Few blocks: requests are preempted (their drafts dropped, their draft KV recomputed).
    config = dict(num_blocks=30, block_size=4, max_num_batched_tokens=64, max_model_len=96)
    plain = run(LLMEngine(target, EngineConfig.of(**config)), prompts, params)
    engine = LLMEngine(target, EngineConfig.of(**config, speculative_config=spec))
    fast = run(engine, prompts, params, check_blocks=True)
    for rid in plain:
        assert fast[rid].outputs[0].token_ids == plain[rid].outputs[0].token_ids, rid
        assert fast[rid].outputs[0].finish_reason == plain[rid].outputs[0].finish_reason
    lp_plain, lp_fast = plain["4"].outputs[0].logprobs, fast["4"].outputs[0].logprobs
    assert [e.token_id for e in lp_fast] == [e.token_id for e in lp_plain]
    assert max(abs(a.logprob - b.logprob) for a, b in zip(lp_fast, lp_plain, strict=True)) < 1e-4
    stats = engine.stats()
    assert stats["num_preemptions_total"] > 0
    assert 0 < stats["spec_decode_num_accepted_tokens"] <= stats["spec_decode_num_draft_tokens"]
    per_request = [fast[r].metrics for r in fast]
    assert sum(m.spec_draft_tokens for m in per_request) == stats["spec_decode_num_draft_tokens"]
    assert sum(m.spec_accepted_tokens for m in per_request) == stats["spec_decode_num_accepted_tokens"]
    # Position i is accepted only when every position before it was.
    per_pos = stats["spec_decode_num_accepted_tokens_per_pos"]
    assert per_pos == sorted(per_pos, reverse=True) and sum(per_pos) == stats["spec_decode_num_accepted_tokens"]
    if spec.get("model"):  # a different random model: some drafts are rejected
        assert stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]


def test_speculation_switches_off_for_large_batches(target):
    prompts = copying_prompts(6)
    params = [SamplingParams(max_tokens=4 if i < 4 else 30, **GREEDY) for i in range(len(prompts))]
    spec = {"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": 5}
    engine = LLMEngine(target, EngineConfig.of(num_blocks=64, block_size=8, max_model_len=96, speculative_config=spec))
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, params[i], request_id=str(i))
    drafted_while_large = 0
    while engine.has_unfinished_requests():
        running = len(engine.scheduler.running)
        before = engine.spec_num_draft_tokens
        engine.step()
        if running > 5:
            drafted_while_large += engine.spec_num_draft_tokens - before
    assert drafted_while_large == 0
    assert engine.spec_num_draft_tokens > 0  # it switched on again once requests finished


# ------------------------------------------------------------------- distribution (chi-square)
VOCAB = 16
PROMPT = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    """Target and draft with a 16-token vocabulary and peaked distributions (a scaled final norm)."""
    root = tmp_path_factory.mktemp("spec16")
    for name, seed, scale in (("target", 0, 8.0), ("draft", 3, 5.0)):
        model = build_hf_model("llama", seed, vocab_size=VOCAB, tie_word_embeddings=False)
        with torch.no_grad():
            model.model.norm.weight.mul_(scale)
        model.save_pretrained(root / name)
    return root


def exact_pair_distribution(model, params: SamplingParams) -> torch.Tensor:
    """P(t2, t3) [V, V] of plain sampling after PROMPT (t1 marginalised), from full forwards."""
    sampler = Sampler()

    def next_probs(prefixes: list[list[int]]) -> torch.Tensor:
        ids = torch.tensor([PROMPT + p for p in prefixes])
        with torch.no_grad():
            logits = model(ids)[:, -1].float()
        states = [RowState(params, None, PROMPT, p, []) for p in prefixes]
        x, _ = sampler.process_logits(logits, states)
        return x.softmax(-1).double()

    p1 = next_probs([[]])[0]  # [V]
    p2 = next_probs([[a] for a in range(VOCAB)])  # [V(t1), V(t2)]
    p3 = next_probs([[a, b] for a in range(VOCAB) for b in range(VOCAB)]).view(VOCAB, VOCAB, VOCAB)
    return torch.einsum("a,ab,abc->bc", p1, p2, p3)


def sample_pairs(engine: LLMEngine, params: SamplingParams, n: int) -> torch.Tensor:
    counts = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    for i in range(n):
        seeded = SamplingParams(**{**params.__dict__, "seed": i})
        engine.add_request(PROMPT, seeded, request_id=str(i))
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                ids = out.outputs[0].token_ids
                counts[ids[1], ids[2]] += 1
    return counts


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's test of counts against probabilities; cells expecting < 5 are pooled into one."""
    n = counts.sum()
    expected = (probs * n).flatten()
    observed = counts.flatten()
    small = expected < 5
    e = torch.cat([expected[~small], expected[small].sum()[None]])
    o = torch.cat([observed[~small], observed[small].sum()[None]])
    keep = e > 0
    chi2 = (((o - e) ** 2)[keep] / e[keep]).sum()
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0), chi2 / 2.0))


@pytest.mark.parametrize(
    "method,params",
    [
        pytest.param("draft_model", dict(temperature=1.0), marks=pytest.mark.slow),
        ("draft_model", dict(temperature=0.8, top_k=6)),
        pytest.param("ngram", dict(temperature=1.0), marks=pytest.mark.slow),
    ],
    ids=["draft-t1", "draft-t0.8-topk", "ngram-t1"],
)
def test_sampled_distribution_equals_plain_sampling(small_vocab, method, params, monkeypatch):
    loaded = load_model(small_vocab / "target")
    params = SamplingParams(max_tokens=4, ignore_eos=True, **params)
    exact = exact_pair_distribution(loaded.model, params)
    spec = {"method": method, "num_speculative_tokens": 2, "disable_by_batch_size": 512}
    if method == "draft_model":
        spec["model"] = str(small_vocab / "draft")
    config = EngineConfig.of(
        num_blocks=4096,
        block_size=4,
        max_num_seqs=512,
        max_num_batched_tokens=8192,
        max_model_len=32,
        speculative_config=spec,
    )
    engine = LLMEngine(loaded, config)
    counts = sample_pairs(engine, params, 4000)
    stats = engine.stats()
    # Both outcomes happen a lot: the test exercises acceptance and the residual resampling.
    accepted, drafted = stats["spec_decode_num_accepted_tokens"], stats["spec_decode_num_draft_tokens"]
    assert 0.02 * drafted < accepted < 0.9 * drafted, (accepted, drafted)
    p_value = chi_square_p_value(counts, exact)
    assert p_value > 1e-3, p_value
    if method == "draft_model" and params.top_k == 0:
        # The test has the power to see a wrong rule: accepting every draft samples the draft's distribution.
        monkeypatch.setattr(verify_module, "accept_drafts", lambda p, d, q, g: (len(d), verify_module.draw(p[-1], g)))
        biased = sample_pairs(LLMEngine(loaded, config), params, 4000)
        assert chi_square_p_value(biased, exact) < 1e-6


def test_default_rule_keeps_verification_bandwidth_bound():
    from keel.serve.speculative import BANDWIDTH_BOUND_TOKENS

    for k in (1, 2, 4, 7):
        config = SpeculativeConfig(num_speculative_tokens=k)
        for device in ("cpu", "cuda"):
            batch = config.max_batch(device)
            assert batch >= 1
            assert batch == 1 or batch * (k + 1) <= BANDWIDTH_BOUND_TOKENS[device] < (batch + 1) * (k + 1)
    assert SpeculativeConfig(disable_by_batch_size=7).max_batch("cpu") == 7


def test_sliding_window_target(tmp_path):
    """n-gram speculation on a sliding-window model (blocks behind the window are freed) stays exact;
    a draft model, whose catch-up could need freed blocks, is refused."""
    save_hf_model("mistral", tmp_path / "m")
    loaded = load_model(tmp_path / "m")
    prompts = copying_prompts(4, seed=5)
    params = [SamplingParams(max_tokens=40, **GREEDY) for _ in prompts]
    config = dict(num_blocks=64, block_size=4, max_model_len=128)
    plain = run(LLMEngine(loaded, EngineConfig.of(**config)), prompts, params)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 8}
    engine = LLMEngine(loaded, EngineConfig.of(**config, speculative_config=spec))
    fast = run(engine, prompts, params, check_blocks=True)
    assert {r: o.outputs[0].token_ids for r, o in fast.items()} == {r: o.outputs[0].token_ids for r, o in plain.items()}
    assert engine.spec_num_draft_tokens > 0
    with pytest.raises(KeelError, match="sliding-window"):
        LLMEngine(loaded, EngineConfig.of(**config, speculative_config={"method": "draft_model"}))
