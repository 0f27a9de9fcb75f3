"""The serving sampler (penalties, filters, seeded draws, logprobs) and the per-request stop checker."""

from __future__ import annotations

import math

import pytest
import torch

from keel import kernels
from keel.errors import KeelError
from keel.serve.sampling import (
    RowState,
    Sampler,
    SamplingParams,
    apply_filters,
    apply_penalties,
    prompt_logprobs,
    request_generator,
)
from keel.serve.stop import StopChecker

PROBS = [0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.02]
PATHS = ["torch"] + (["kernels"] if kernels.enabled() else [])


@pytest.fixture(autouse=True, params=PATHS)
def sampler_path(request, monkeypatch):
    """Every test on both draws: torch's (sort, exponential race) and keel::sample_rows (CPU kernels)."""
    if request.param == "torch":
        monkeypatch.setattr(kernels, "active", lambda: False)
    return request.param


def _rows(params: SamplingParams, n: int, **kwargs) -> list[RowState]:
    return [RowState(params, **kwargs) for _ in range(n)]


def _drawn(params: SamplingParams, draws: int = 4000) -> set[int]:
    """Tokens drawn from PROBS under `params`, over many rows sampled in one call."""
    logits = torch.tensor(PROBS).log().expand(draws, -1).contiguous()
    return set(Sampler()(logits, _rows(params, draws)).token_ids.tolist())


# ------------------------------------------------------------------- params
@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", -0.1),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("min_p", 1.5),
        ("repetition_penalty", 0.0),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3.0),
        ("max_tokens", 0),
        ("n", 0),
        ("logprobs", -1),
        ("logprobs", 21),
        ("prompt_logprobs", 21),
        ("min_tokens", 100),
        ("stop", [""]),
    ],
)
def test_validate_names_the_field(field, value):
    params = SamplingParams(**{field: value})
    with pytest.raises(KeelError, match=field):
        params.validate()


def test_params_defaults_and_stop_normalised():
    params = SamplingParams(stop="###")
    params.validate()
    assert params.stop == ["###"]
    assert (params.max_tokens, params.temperature, params.top_k, params.top_p) == (16, 1.0, 0, 1.0)
    SamplingParams(top_k=-1, logprobs=0, temperature=0).validate()


# ---------------------------------------------------------------- filtering
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_is_argmax(dtype):
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0)).to(dtype)
    out = Sampler()(logits, _rows(SamplingParams(temperature=0.0), 6))
    assert out.token_ids.tolist() == logits.float().argmax(dim=-1).tolist()
    assert out.logprobs is None


@pytest.mark.parametrize(
    "params,allowed",
    [
        (SamplingParams(top_k=3), {0, 1, 2}),
        (SamplingParams(top_k=1), {0}),
        (SamplingParams(top_p=0.6), {0, 1}),  # 0.4 < 0.6 <= 0.65: the first two reach it
        (SamplingParams(top_p=0.7), {0, 1, 2}),
        (SamplingParams(top_p=0.1), {0}),  # the top token always stays
        (SamplingParams(min_p=0.3), {0, 1, 2}),  # keeps p >= 0.12
        (SamplingParams(min_p=0.5), {0, 1}),  # keeps p >= 0.2
        # top-p on the top-5 renormalised mass (0.95): 0.421, 0.684, 0.842 < 0.9 <= 0.947
        (SamplingParams(top_k=5, top_p=0.9), {0, 1, 2, 3}),
        (SamplingParams(), set(range(7))),
    ],
)
def test_filters_restrict_candidates_exactly(params, allowed):
    torch.manual_seed(0)
    assert _drawn(params) == allowed
    # The processed logits are finite exactly on the allowed set.
    x, _ = Sampler().process_logits(torch.tensor([PROBS]).log(), [RowState(params)])
    assert set(torch.isfinite(x[0]).nonzero().flatten().tolist()) == allowed


def test_sampling_follows_the_renormalised_distribution():
    torch.manual_seed(1)
    draws = 20000
    logits = torch.tensor(PROBS).log().expand(draws, -1).contiguous()
    tokens = Sampler()(logits, _rows(SamplingParams(top_k=3), draws)).token_ids
    freq = torch.bincount(tokens, minlength=7).float() / draws
    expected = torch.tensor([0.4, 0.25, 0.15, 0, 0, 0, 0]) / 0.8
    assert torch.allclose(freq, expected, atol=0.015)
    # Temperature 2 flattens: p ∝ sqrt(p).
    tokens = Sampler()(logits, _rows(SamplingParams(temperature=2.0), draws)).token_ids
    freq = torch.bincount(tokens, minlength=7).float() / draws
    flat = torch.tensor(PROBS).sqrt()
    assert torch.allclose(freq, flat / flat.sum(), atol=0.015)


@pytest.mark.skipif(not kernels.enabled(), reason=f"keel kernels: {kernels.status()}")
@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.7),
        SamplingParams(top_k=40),
        SamplingParams(top_p=0.8, temperature=1.3),
        SamplingParams(top_p=0.999),  # a nucleus wider than the first candidate batch
        SamplingParams(top_k=300, top_p=0.5, min_p=0.05),
        SamplingParams(min_p=0.2),
    ],
)
@pytest.mark.parametrize("level", kernels.levels_here() if kernels.enabled() else ())
@pytest.mark.parametrize(
    ("vocab", "grid", "scale"),
    [(3000, 4000, 2.5), (20005, 600, 9.0)],  # the second: a short last chunk, and chunks enough for top-p's first 256
)
def test_kernel_draw_inverts_the_filtered_distribution(params, level, vocab, grid, scale):
    """keel::sample_rows at evenly spaced uniforms draws each token as often as apply_filters' softmax
    gives it probability (to the grid's resolution), and never a filtered one, at every kernel level: the
    candidates come from the chunks (kSampleChunk) whose maxima can hold the first k (or first 256 for
    top-p) values, and a whole-vocabulary draw walks the chunks' sums."""
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(5)) * scale
    logits[0, 7] = logits[0, 8] = logits[0].max()  # a tie at the top: the stable order keeps both, 7 first
    logits[0, 0] = float("-inf")  # a masked token (grammar, allowed_token_ids): never drawn
    keep = apply_filters(
        logits,
        torch.tensor([params.temperature]),
        torch.tensor([float(params.top_k)]),
        torch.tensor([params.top_p]),
        torch.tensor([params.min_p]),
    ).softmax(dim=-1)[0]
    rows = logits.expand(grid, -1).contiguous()
    u = (torch.arange(grid, dtype=torch.float64) + 0.5) / grid
    with kernels.using_level(level):
        got = torch.ops.keel.sample_rows(
            rows,
            torch.full((grid,), params.temperature),
            torch.full((grid,), params.top_k, dtype=torch.int64),
            torch.full((grid,), params.top_p),
            torch.full((grid,), params.min_p),
            u,
        )
    assert set(got.tolist()) <= set(keep.nonzero().flatten().tolist())
    freq = torch.bincount(got, minlength=vocab).double() / grid
    assert (freq - keep.double()).abs().max().item() <= 1.0 / grid + 1e-6
    # The lowest draw (u = 0) is the first kept token, never the masked one before it.
    with kernels.using_level(level):
        lowest = torch.ops.keel.sample_rows(
            logits,
            torch.full((1,), params.temperature),
            torch.full((1,), params.top_k, dtype=torch.int64),
            torch.full((1,), params.top_p),
            torch.full((1,), params.min_p),
            torch.zeros(1, dtype=torch.float64),
        )
    assert keep[lowest.item()] > 0
    # Greedy rows (temperature 0): the first largest logit.
    greedy = torch.ops.keel.sample_rows(
        logits,
        torch.zeros(1),
        torch.zeros(1, dtype=torch.int64),
        torch.ones(1),
        torch.zeros(1),
        torch.zeros(1, dtype=torch.float64),
    )
    assert greedy.item() == 7


def _first_largest(row: list[float]) -> int:
    """The scan greedy decoding defines: the best so far replaced only by a strictly larger value."""
    best = 0
    for i, value in enumerate(row):
        if value > row[best]:
            best = i
    return best


@pytest.mark.skipif(not kernels.enabled(), reason=f"keel kernels: {kernels.status()}")
@pytest.mark.parametrize("vocab", [1, 15, 16, 17, 49152 + 5])
def test_greedy_rows_take_the_first_largest_logit(vocab):
    g = torch.Generator().manual_seed(vocab)
    rows = torch.randint(-3, 4, (6, vocab), generator=g).float()  # many ties
    rows[1, vocab // 2] = float("inf")
    rows[2] = float("-inf")
    rows[3, 0] = float("nan")  # a NaN first logit: nothing compares greater
    rows[4, vocab - 1] = float("nan")  # a NaN elsewhere is never the largest
    rows[5, vocab - 1] = 100.0  # the largest in the tail past the last whole vector
    n = rows.shape[0]
    got = torch.ops.keel.sample_rows(
        rows,
        torch.zeros(n),
        torch.zeros(n, dtype=torch.int64),
        torch.ones(n),
        torch.zeros(n),
        torch.zeros(n, dtype=torch.float64),
    )
    assert got.tolist() == [_first_largest(r) for r in rows.tolist()]


def test_rows_keep_their_own_parameters_in_one_batch():
    torch.manual_seed(2)
    params = [SamplingParams(top_k=1), SamplingParams(top_p=0.6), SamplingParams(temperature=0), SamplingParams()]
    draws = 1000
    logits = torch.tensor(PROBS).log().expand(len(params) * draws, -1).contiguous()
    states = [RowState(p) for p in params for _ in range(draws)]
    tokens = Sampler()(logits, states).token_ids.view(len(params), draws)
    assert [set(row.tolist()) for row in tokens] == [{0}, {0, 1}, {0}, set(range(7))]


# ---------------------------------------------------------------- penalties
def test_penalties_match_a_hand_computation():
    logits = torch.tensor([[2.0, -1.0, 0.5, -0.5, 3.0, 1.0], [1.0, 1.0, -2.0, 4.0, 0.0, -1.0]])
    states = [
        RowState(
            SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25),
            prompt_ids=[0, 1, 1],
            output_ids=[2, 3, 3, 3],
        ),
        RowState(SamplingParams(frequency_penalty=-1.0), prompt_ids=[3], output_ids=[3, 0]),
    ]
    expected = logits.clone()
    # Row 0, repetition: seen = {0, 1} (prompt) ∪ {2, 3} (output); positive / 2, negative * 2.
    expected[0, :4] = torch.tensor([2.0 / 2, -1.0 * 2, 0.5 / 2, -0.5 * 2])
    # Frequency and presence on output tokens only: token 2 once, token 3 three times.
    expected[0, 2] -= 0.5 * 1 + 0.25
    expected[0, 3] -= 0.5 * 3 + 0.25
    # Row 1: no repetition penalty; a negative frequency penalty rewards tokens 3 and 0 (prompt ignored).
    expected[1, 3] += 1.0
    expected[1, 0] += 1.0
    got = apply_penalties(logits, states)
    assert torch.allclose(got, expected)
    assert logits[0, 0] == 2.0  # the raw logits are not modified


def test_penalties_steer_greedy_decoding():
    logits = torch.tensor([[3.0, 2.9, 0.0]])
    plain = RowState(SamplingParams(temperature=0), output_ids=[0])
    penalised = RowState(SamplingParams(temperature=0, repetition_penalty=1.2), output_ids=[0])
    assert Sampler()(logits, [plain]).token_ids.item() == 0
    assert Sampler()(logits, [penalised]).token_ids.item() == 1  # 3.0 / 1.2 < 2.9


def test_min_tokens_masks_eos_and_stop_tokens():
    eos, stop = 5, 6
    logits = torch.zeros(1, 8)
    logits[0, eos], logits[0, stop] = 10.0, 9.0
    params = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[stop])
    for produced in range(3):
        state = RowState(params, output_ids=[1] * produced, eos_token_ids=[eos])
        assert Sampler()(logits, [state]).token_ids.item() not in (eos, stop)
    assert Sampler()(logits, [RowState(params, output_ids=[1] * 3, eos_token_ids=[eos])]).token_ids.item() == eos
    # ignore_eos: EOS is an ordinary token (it cannot end the request), so it is not masked.
    params = SamplingParams(temperature=0, min_tokens=3, ignore_eos=True)
    assert Sampler()(logits, [RowState(params, eos_token_ids=[eos])]).token_ids.item() == eos


# ------------------------------------------------------------------- seeds
def test_seeded_row_ignores_the_rest_of_the_batch():
    vocab, steps = 40, 6
    stream = torch.Generator().manual_seed(123)
    step_logits = [torch.randn(5, vocab, generator=stream) for _ in range(steps)]
    seeded = SamplingParams(seed=7, top_p=0.95)
    others = [SamplingParams(seed=99), SamplingParams(), SamplingParams(temperature=0), SamplingParams(top_k=5)]

    def run(batch: bool) -> list[int]:
        states = [RowState(seeded, generator=request_generator(seeded))]
        if batch:
            states += [RowState(p, generator=request_generator(p)) for p in others]
        tokens = []
        for logits in step_logits:
            out = Sampler()(logits[: len(states)], states).token_ids.tolist()
            for state, token in zip(states, out, strict=True):
                state.output_ids.append(token)
            tokens.append(out[0])
        return tokens

    torch.manual_seed(0)
    alone = run(batch=False)
    torch.manual_seed(1)  # a different global RNG for the unseeded rows
    assert run(batch=True) == alone
    assert len(set(alone)) > 1  # really sampled, not a constant


def test_same_seed_same_tokens_and_request_generator():
    assert request_generator(SamplingParams()) is None
    logits = torch.randn(1, 1000)
    params = SamplingParams(seed=3)
    a = [Sampler()(logits, [RowState(params, generator=g)]).token_ids.item() for g in [request_generator(params)] * 3]
    b = [Sampler()(logits, [RowState(params, generator=g)]).token_ids.item() for g in [request_generator(params)] * 3]
    assert a == b


# ---------------------------------------------------------------- logprobs
def test_logprobs_are_raw_log_softmax():
    torch.manual_seed(3)
    logits = torch.randn(3, 30).to(torch.bfloat16)
    states = [
        RowState(SamplingParams(logprobs=4, temperature=0.5, repetition_penalty=1.5), output_ids=[1, 2]),
        RowState(SamplingParams()),
        RowState(SamplingParams(logprobs=0, temperature=0)),
    ]
    out = Sampler()(logits, states)
    assert out.logprobs is not None
    rows = out.logprobs.to_lists(out.token_ids)
    reference = logits.float().log_softmax(dim=-1)
    assert rows[1] is None
    for i in (0, 2):
        row = rows[i]
        token = out.token_ids[i].item()
        assert row is not None and row.token_id == token
        assert row.logprob == pytest.approx(reference[i, token].item(), abs=1e-6)
        assert row.rank == 1 + int((reference[i] > reference[i, token]).sum())
    assert rows[2].top == [] and rows[2].rank == 1  # greedy: the sampled token is the most likely
    top_values, top_ids = reference[0].topk(4)
    assert [t for t, _ in rows[0].top] == top_ids.tolist()
    assert [lp for _, lp in rows[0].top] == pytest.approx(top_values.tolist(), abs=1e-6)
    assert all(a[1] >= b[1] for a, b in zip(rows[0].top, rows[0].top[1:], strict=False))


def test_prompt_logprobs_small_example():
    # Logits at position t predict prompt token t + 1; the last row predicts the next token (unused).
    logits = torch.tensor([[0.0, 1.0, 2.0], [3.0, 0.0, 0.0], [0.0, 0.0, 5.0]])
    prompt = [2, 1, 0]
    result = prompt_logprobs(logits, prompt, 2)
    assert result[0] is None
    reference = logits.log_softmax(dim=-1)
    first, second = result[1], result[2]
    assert first.token_id == 1 and first.logprob == pytest.approx(reference[0, 1].item())
    assert first.rank == 2
    assert [t for t, _ in first.top] == [2, 1]
    assert second.token_id == 0 and second.rank == 1
    assert second.logprob == pytest.approx(math.log(math.exp(3) / (math.exp(3) + 2)))
    assert second.top[0] == (0, pytest.approx(second.logprob))
    assert prompt_logprobs(logits, [4], 2) == [None]


# ------------------------------------------------------------------- stops
def _feed(checker: StopChecker, deltas: list[str], token_ids: list[int] | None = None) -> tuple[str, bool]:
    text, finished = "", False
    for i, delta in enumerate(deltas):
        emitted, finished = checker.add(token_ids[i] if token_ids else 100 + i, delta)
        text += emitted
        if finished:
            break
    return text, finished


def test_stop_string_split_over_three_deltas_never_leaks():
    checker = StopChecker(SamplingParams(stop=["<END>"], max_tokens=100))
    emitted = []
    for i, delta in enumerate(["Hello wor", "ld <E", "N", "D> trailing"]):
        text, finished = checker.add(i, delta)
        emitted.append(text)
    assert emitted == ["Hello wor", "ld ", "", ""]
    assert "".join(emitted) == "Hello world "
    assert finished and checker.finish_reason == "stop" and checker.stop_reason == "<END>"
    assert checker.flush() == ""
    assert checker.add(9, "more") == ("", True)


def test_include_stop_str_in_output():
    checker = StopChecker(SamplingParams(stop=["<END>"], include_stop_str_in_output=True))
    emitted = [checker.add(i, d)[0] for i, d in enumerate(["Hi <E", "N", "D> after"])]
    assert emitted == ["Hi <E", "N", "D>"]  # nothing is held back: the stop string is emitted anyway
    assert checker.finish_reason == "stop" and checker.stop_reason == "<END>"


def test_held_back_prefix_that_is_not_a_stop_string_is_released():
    checker = StopChecker(SamplingParams(stop=["<END>"], max_tokens=100))
    assert checker.add(1, "a <E") == ("a ", False)
    assert checker.add(2, "N") == ("", False)
    assert checker.add(3, "X") == ("<ENX", False)
    # Held back at the end of the request for another reason: flush releases it.
    assert checker.add(4, "b <") == ("b ", False)
    assert checker.flush() == "<"


def test_earliest_completed_stop_string_wins():
    checker = StopChecker(SamplingParams(stop=["abc", "b"]))
    assert checker.add(1, "xabc") == ("xa", True)
    assert checker.stop_reason == "b"
    # Overlapping prefixes: "aab" begins at the second "a".
    checker = StopChecker(SamplingParams(stop=["aab"]))
    assert _feed(checker, ["a", "a", "a", "b"]) == ("a", True)


def test_stop_token_ids_and_eos():
    eos = 2
    checker = StopChecker(SamplingParams(stop_token_ids=[7]), eos_token_ids=[eos])
    assert _feed(checker, ["one", " two", "<tok7>"], [10, 11, 7]) == ("one two", True)
    assert (checker.finish_reason, checker.stop_reason) == ("stop", 7)
    checker = StopChecker(SamplingParams(stop=["###"]), eos_token_ids=[eos])
    # The text held back as a possible stop string is released when EOS ends the request.
    assert _feed(checker, ["x #", "</s>"], [10, eos]) == ("x #", True)
    assert (checker.finish_reason, checker.stop_reason) == ("stop", None)


def test_ignore_eos_and_max_tokens_length():
    checker = StopChecker(SamplingParams(ignore_eos=True, max_tokens=3), eos_token_ids=[2])
    assert checker.add(2, "a") == ("a", False)
    assert checker.add(2, "b") == ("b", False)
    assert checker.add(5, "c") == ("c", True)
    assert (checker.finish_reason, checker.stop_reason) == ("length", None)
    # EOS on the last allowed token is a natural stop, not "length".
    checker = StopChecker(SamplingParams(max_tokens=2), eos_token_ids=[2])
    assert _feed(checker, ["a", ""], [5, 2]) == ("a", True)
    assert checker.finish_reason == "stop"


def test_min_tokens_delays_stops():
    checker = StopChecker(SamplingParams(min_tokens=2, stop=["x"], stop_token_ids=[9]), eos_token_ids=[2])
    assert checker.add(2, "") == ("", False)  # EOS as token 1 of min 2: ignored
    assert checker.add(5, "x") == ("x", False)  # a stop string in the first min_tokens tokens: ignored
    assert checker.add(5, "ax") == ("a", True)
    assert checker.stop_reason == "x"


def test_stop_checker_with_the_incremental_detokenizer(tmp_path):
    from keel.tokenizer import Tokenizer
    from tiny_models import save_byte_tokenizer

    save_byte_tokenizer(tmp_path)
    tokenizer = Tokenizer.from_hf_dir(tmp_path)
    detok = tokenizer.detokenizer()
    checker = StopChecker(SamplingParams(stop=["STOP"], max_tokens=100), tokenizer.eos_token_ids)
    text = ""
    for token in tokenizer.encode("Hello STOP world"):  # one token per byte: the stop spans 4 tokens
        emitted, finished = checker.add(token, detok.add(token))
        assert "S" not in emitted
        text += emitted
        if finished:
            break
    assert text == "Hello " and checker.stop_reason == "STOP"


def test_stop_strings_do_not_depend_on_how_text_is_split():
    import random

    rng = random.Random(0)
    for _ in range(2000):
        stops = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        full = "".join(rng.choice("abc") for _ in range(rng.randint(0, 15)))
        include = rng.random() < 0.5
        # Reference: the stop string that ends first in the whole text.
        matches = [(full.find(s) + len(s), full.find(s), s) for s in stops if s in full]
        expected = full
        if matches:
            end, begin, _ = min(matches)
            expected = full[: end if include else begin]
        deltas, i = [], 0
        while i < len(full):
            j = i + rng.randint(0, 3)
            deltas.append(full[i:j])
            i = j
        checker = StopChecker(SamplingParams(stop=stops, include_stop_str_in_output=include, max_tokens=1000))
        text, finished = _feed(checker, deltas)
        if not include:
            assert not any(s in text for s in stops)
        assert text + ("" if finished else checker.flush()) == expected
