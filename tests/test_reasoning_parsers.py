"""Reasoning parsers (keel.serve.openai.reasoning_parsers): `<think>` reasoning split from the reply, whole
and streamed (the streamed deltas concatenate to `extract` however the text is split, and never carry
a partial marker), and `is_reasoning_end`, which tells the engine when a grammar on the reply may start."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keel.serve.openai.reasoning_parsers import (
    REASONING_PARSERS,
    ReasoningDelta,
    ReasoningParser,
    get_reasoning_parser,
    register_reasoning_parser,
)


def extract(name: str, text: str, **kwargs) -> tuple[str | None, str | None]:
    return get_reasoning_parser(name)(**kwargs).extract(text)


def stream(name: str, pieces: list[str], **kwargs) -> tuple[str | None, str | None]:
    parser = get_reasoning_parser(name)(**kwargs)
    deltas = [parser.feed(p) for p in pieces] + [parser.finish()]
    reasoning = "".join(d.reasoning for d in deltas)
    content = "".join(d.content for d in deltas)
    return reasoning or None, content or None


@pytest.mark.parametrize(
    "text,expected",
    [
        # R1's template opens <think> in the prompt: the output starts inside the reasoning.
        ("Okay, 2+2 is 4.\n</think>\n\nThe answer is 4.", ("Okay, 2+2 is 4.\n", "\n\nThe answer is 4.")),
        ("<think>\nHmm.\n</think>\n\n4", ("\nHmm.\n", "\n\n4")),
        (
            "\n<think>This is a reasoning section</think>\nThis is the rest",
            ("This is a reasoning section", "\nThis is the rest"),
        ),
        ("Still thinking, cut off by max_tokens", ("Still thinking, cut off by max_tokens", None)),
        ("</think>Only an answer.", (None, "Only an answer.")),
        ("Thinking about <think> tags</think>ok", ("Thinking about <think> tags", "ok")),
        ("Done thinking.</think>", ("Done thinking.", None)),
        ("é漢字 🙂</think>答え", ("é漢字 🙂", "答え")),
        ("", (None, None)),
    ],
)
def test_deepseek_r1(text, expected):
    assert extract("deepseek_r1", text) == expected


@pytest.mark.parametrize(
    "text,expected",
    [
        ("<think>\nThe user greets me.\n</think>\n\nHello!", ("\nThe user greets me.\n", "\n\nHello!")),
        ("<think>\n\n</think>\n\nHello!", ("\n\n", "\n\nHello!")),
        ("Hello! No thinking here.", (None, "Hello! No thinking here.")),  # enable_thinking=False
        ("Mentions </think> without opening it.", (None, "Mentions </think> without opening it.")),
        ("<think>\nCut off mid-thought", ("\nCut off mid-thought", None)),
        ("<thinking> is not the tag", (None, "<thinking> is not the tag")),
        ("", (None, None)),
    ],
)
def test_qwen3(text, expected):
    assert extract("qwen3", text) == expected


def test_qwen3_when_the_prompt_opened_the_reasoning():
    # Qwen3-2507 Thinking / Qwen3.5 templates put <think> in the prompt: the route says so.
    assert extract("qwen3", "Let me think.\n</think>\n\nHi", starts_in_reasoning=True) == ("Let me think.\n", "\n\nHi")
    # And DeepSeek R1 with a prompt that already closed the reasoning: all content.
    assert extract("deepseek_r1", "Plain", starts_in_reasoning=False) == (None, "Plain")


def test_streaming_holds_back_partial_markers():
    parser = get_reasoning_parser("deepseek_r1")()
    assert parser.feed("<thi") == ReasoningDelta("", "")  # might be the opening tag
    assert parser.feed("nk>Let me see") == ReasoningDelta("Let me see", "")
    assert parser.feed(". 42</th") == ReasoningDelta(". 42", "")
    assert parser.feed("ink>\n\nIt is") == ReasoningDelta("", "\n\nIt is")
    assert parser.feed(" 42.") == ReasoningDelta("", " 42.")
    assert parser.finish() == ReasoningDelta("", "")
    parser = get_reasoning_parser("qwen3")()
    assert parser.feed("  <th") == ReasoningDelta("", "")
    assert parser.feed("ought") == ReasoningDelta("", "  <thought")  # not the tag after all: content
    assert parser.feed("</think>") == ReasoningDelta("", "</think>")
    # A held fragment that never completes is released at the end.
    parser = get_reasoning_parser("deepseek_r1")()
    assert parser.feed("abc</thi") == ReasoningDelta("abc", "")
    assert parser.finish() == ReasoningDelta("</thi", "")


CASES = [
    "<think>\nreasoning here\n</think>\n\nThe answer.",
    "\n\n<think>x</think>y",
    "no tags at all, just text",
    "partial </thin and <thin tags",
    "reasoning</think>content with <think> and </think> again",
    "<think></think>",
    "<think>unclosed <think> reasoning",
    "  <th",
    "é漢字<think>🙂</think>終",
    "",
]


@pytest.mark.parametrize("name", ["deepseek_r1", "qwen3"])
@pytest.mark.parametrize("starts_in_reasoning", [None, True, False])
@pytest.mark.parametrize("text", CASES)
def test_streaming_concatenates_to_extract_under_random_splits(name, starts_in_reasoning, text):
    kwargs = {"starts_in_reasoning": starts_in_reasoning}
    whole = extract(name, text, **kwargs)
    assert stream(name, [text], **kwargs) == whole
    assert stream(name, list(text), **kwargs) == whole
    for seed in range(20):
        rng = random.Random(seed)
        cuts = sorted(rng.randint(0, len(text)) for _ in range(rng.randint(0, 8)))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        assert stream(name, pieces, **kwargs) == whole, pieces


FRAGMENTS = ["<think>", "</think>", "<thi", "</th", "<", ">", "\n", " ", "think", "abc", "é漢🙂"]


@pytest.mark.parametrize("name", ["deepseek_r1", "qwen3"])
@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_fuzzed_outputs_stream_exactly_as_extracted(name, data):
    text = "".join(data.draw(st.lists(st.sampled_from(FRAGMENTS), max_size=12)))
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=8)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    reasoning, content = extract(name, text)
    assert stream(name, pieces) == (reasoning, content)
    # Nothing is lost but the markers: the parts are the text with (at most) the tags and leading space cut.
    assert len(reasoning or "") + len(content or "") <= len(text)
    assert (content or "") in text


def test_is_reasoning_end_flips_exactly_after_the_closing_tag():
    text = "<think>\nWhich tool? get_weather.\n</think>\n\n"
    parser = get_reasoning_parser("deepseek_r1")()
    close = text.index("</think>") + len("</think>")
    assert [parser.is_reasoning_end(text[:i]) for i in range(len(text) + 1)] == [
        i >= close for i in range(len(text) + 1)
    ]
    # Without the opening tag (it was in the prompt), the same.
    text = "Thinking.</think>{"
    close = text.index("</think>") + len("</think>")
    assert [parser.is_reasoning_end(text[:i]) for i in range(len(text) + 1)] == [
        i >= close for i in range(len(text) + 1)
    ]


def test_qwen3_is_reasoning_end():
    parser = get_reasoning_parser("qwen3")()
    assert not parser.is_reasoning_end("")  # the model may yet open <think>
    assert not parser.is_reasoning_end("\n<thi")
    assert not parser.is_reasoning_end("<think>\nstill thinking</thi")
    assert parser.is_reasoning_end("<think>\ndone\n</think>")
    assert parser.is_reasoning_end("{")  # no reasoning at all: the reply has begun
    assert not get_reasoning_parser("qwen3")(starts_in_reasoning=True).is_reasoning_end("{")


@pytest.mark.parametrize("name", ["deepseek_r1", "qwen3"])
@pytest.mark.parametrize("text", CASES)
def test_is_reasoning_end_agrees_with_the_stream(name, text):
    """Once is_reasoning_end says so, every later character streams as content (what a grammar constrains)."""
    for i in range(len(text) + 1):
        parser = get_reasoning_parser(name)()
        parser.feed(text[:i])
        if parser.is_reasoning_end(text[:i]):
            assert parser.feed("Z") == ReasoningDelta("", "Z"), text[:i]


def test_registry():
    assert {"deepseek_r1", "qwen3"} <= set(REASONING_PARSERS)
    with pytest.raises(ValueError, match=r"unknown reasoning parser 'nope'.*deepseek_r1"):
        get_reasoning_parser("nope")

    @register_reasoning_parser("test_seed_think")
    class SeedThink(ReasoningParser):
        start_token = "<seed:think>"
        end_token = "</seed:think>"

    try:
        assert get_reasoning_parser("test_seed_think") is SeedThink
        assert SeedThink().extract("<seed:think>r</seed:think>c") == ("r", "c")
    finally:
        del REASONING_PARSERS["test_seed_think"]
    parser = get_reasoning_parser("qwen3")()
    parser.finish()
    with pytest.raises(RuntimeError):
        parser.feed("x")
