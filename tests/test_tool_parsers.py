"""Tool-call parsers (keel.serve.openai.tool_parsers): each format on realistic model outputs, the content
rules around calls, and the streaming contract: however the output is split into deltas, the streamed
content and call deltas concatenate to exactly what `extract` returns on the whole text."""

from __future__ import annotations

import itertools
import json
import random
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from keel.serve.openai.tool_parsers import (
    TOOL_PARSERS,
    ExtractedToolCalls,
    StreamUpdate,
    ToolCall,
    ToolCallDelta,
    ToolParser,
    get_tool_parser,
    register_tool_parser,
)

WEATHER_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "lat": {"type": "number"},
                    "metric": {"type": "boolean"},
                    "options": {"type": "object"},
                    "hours": {"type": "array", "items": {"type": "integer"}},
                    "note": {"type": ["string", "null"]},
                },
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}},
]


def counting_ids():
    counter = itertools.count()
    return lambda: f"call-{next(counter)}"


def make(name: str, tools=None) -> ToolParser:
    return get_tool_parser(name)(tools, id_factory=counting_ids())


def extract(name: str, text: str, tools=None) -> ExtractedToolCalls:
    return make(name, tools).extract(text)


def calls_of(result: ExtractedToolCalls) -> list[tuple[str, dict]]:
    """(name, decoded arguments) of each call: what a client acts on."""
    out = []
    for call in result.tool_calls:
        arguments = json.loads(call.arguments)
        assert isinstance(arguments, dict)
        out.append((call.name, arguments))
    return out


def accumulate(updates: list[StreamUpdate]) -> ExtractedToolCalls:
    """What a client accumulating the stream holds, written independently of the parsers' own assemble,
    and checking OpenAI's delta shape on the way: a call's first delta has its id, type and name, later
    ones only argument pieces; indices count up from 0."""
    content = ""
    calls: list[ToolCall] = []
    for update in updates:
        content += update.content
        for d in update.tool_calls:
            if d.index == len(calls):
                assert d.id and d.type == "function" and d.name, d
                assert d.arguments is not None
                calls.append(ToolCall(d.id, d.name, d.arguments))
            else:
                assert d.index == len(calls) - 1, "deltas of an earlier call after a later one started"
                assert d.id is None and d.type is None and d.name is None, d
                calls[-1].arguments += d.arguments or ""
    return ExtractedToolCalls(content if content or not calls else None, calls)


def stream(name: str, pieces: list[str], tools=None) -> ExtractedToolCalls:
    parser = make(name, tools)
    updates = [parser.feed(p) for p in pieces] + [parser.finish()]
    return accumulate(updates)


def random_pieces(text: str, rng: random.Random) -> list[str]:
    """The text cut at random places, pieces of 0 to ~12 characters (empty deltas included)."""
    pieces, i = [], 0
    while i < len(text):
        n = rng.choice([0, 1, 1, 2, 3, 5, 8, 12])
        pieces.append(text[i : i + n])
        i += n
    return pieces


def assert_stream_matches(name: str, text: str, tools=None, seeds=range(25)) -> ExtractedToolCalls:
    whole = extract(name, text, tools)
    assert stream(name, [text], tools) == whole
    assert stream(name, list(text), tools) == whole
    for seed in seeds:
        assert stream(name, random_pieces(text, random.Random(seed)), tools) == whole, seed
    return whole


# Realistic outputs per parser -------------------------------------------------------------------------------

HERMES_ONE = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "San Francisco, CA", "days": 2}}\n</tool_call>'
HERMES_TWO = (
    "I'll look up both.\n"
    "<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    "</tool_call>\n"
    "<tool_call>\n"
    '{"name": "get_time", "arguments": {}}\n'
    "</tool_call>"
)
HERMES_UNICODE = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "東京", "note": "☔ \\u00e9"}}\n</tool_call>'
)


def test_hermes_without_calls_is_content_unchanged():
    text = "The capital of France is Paris.\nUse the <tools> menu, or <tool_calls> — not a call."
    assert extract("hermes", text) == ExtractedToolCalls(text, [])


def test_hermes_one_call():
    result = extract("hermes", HERMES_ONE)
    assert result.content is None
    assert result.tool_calls == [
        ToolCall("call-0", "get_weather", '{"city": "San Francisco, CA", "days": 2}'),
    ]


def test_hermes_several_calls_with_content_before():
    result = extract("hermes", HERMES_TWO)
    assert result.content == "I'll look up both."
    assert calls_of(result) == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert [c.id for c in result.tool_calls] == ["call-0", "call-1"]


def test_hermes_unicode_arguments_are_kept_as_text():
    result = extract("hermes", HERMES_UNICODE)
    assert result.tool_calls[0].arguments == '{"city": "東京", "note": "☔ é"}'


def test_hermes_whitespace_around_calls_is_not_content():
    # What Qwen3 leaves after its reasoning parser: blank lines, then the calls, then a newline.
    result = extract("hermes", "\n\n" + HERMES_ONE + "\n")
    assert result.content is None and len(result.tool_calls) == 1
    # Prose after a call stays content.
    result = extract("hermes", HERMES_ONE + "\nDone.")
    assert result.content == "\nDone." and len(result.tool_calls) == 1


@pytest.mark.parametrize(
    "bad",
    [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>',  # a brace short
        '<tool_call>\n{"arguments": {"city": "Paris"}}\n</tool_call>',  # no name
        '<tool_call>\n{"name": "get_weather", "arguments": [1, 2]}\n</tool_call>',  # arguments not an object
        '<tool_call>\n{"name": "get_weather", "arguments": {"x": NaN}}\n</tool_call>',  # not strict JSON
        "<tool_call>\nget_weather(city='Paris')\n</tool_call>",
        'Let me see.\n<tool_call>\n{"name": "get_weather", "arguments": {}} trailing\n</tool_call>',
    ],
)
def test_hermes_malformed_call_returns_the_whole_text_as_content(bad):
    assert extract("hermes", bad) == ExtractedToolCalls(bad, [])


def test_hermes_malformed_call_after_a_valid_one_keeps_the_valid_one():
    # Streaming has sent the first call by the time the second proves bad, so that one stands; the bad one
    # is content from the whitespace before it on.
    bad = '\n<tool_call>\n{"name": "get_time", "arguments": {\n</tool_call>'
    result = extract("hermes", HERMES_ONE + bad)
    assert [c.name for c in result.tool_calls] == ["get_weather"]
    assert result.content == bad


def test_hermes_unclosed_final_call_is_parsed():
    # A stop string can eat </tool_call>; vLLM parses the block to the end of the output.
    result = extract("hermes", '<tool_call>\n{"name": "get_time", "arguments": {}}\n')
    assert calls_of(result) == [("get_time", {})]
    truncated = '<tool_call>\n{"name": "get_time", "argu'
    assert extract("hermes", truncated) == ExtractedToolCalls(truncated, [])


def test_hermes_arguments_given_as_a_json_string_are_decoded():
    text = '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}</tool_call>'
    assert calls_of(extract("hermes", text)) == [("get_weather", {"city": "Oslo"})]


def test_hermes_streaming_holds_back_a_possible_marker():
    parser = make("hermes")
    assert parser.feed("Checking the weather <tool").content == "Checking the weather"
    assert parser.feed("_ca").content == ""
    update = parser.feed('ll>\n{"name": "get_time", "arguments": {}}\n</tool_')
    assert update == StreamUpdate("", [])  # the call is only judged once its block closes
    update = parser.feed("call>")
    assert update.content == ""
    assert [d.to_openai() for d in update.tool_calls] == [
        {"index": 0, "id": "call-0", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}
    ]
    assert parser.tools_called
    assert parser.finish() == StreamUpdate("", [])
    # Text that merely starts like a marker is released once it is known not to be one.
    parser = make("hermes")
    assert parser.feed("a <tool").content == "a"
    assert parser.feed("box>").content == " <toolbox>"


LLAMA_ONE = '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}'
LLAMA_TAGGED = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}'
LLAMA_TWO = '{"name": "get_weather", "parameters": {"city": "Zürich"}}; {"name": "get_time", "parameters": {}}'


def test_llama3_json_calls():
    assert calls_of(extract("llama3_json", LLAMA_ONE)) == [("get_weather", {"city": "Paris", "days": 3})]
    assert calls_of(extract("llama3_json", LLAMA_TAGGED)) == [("get_weather", {"city": "Paris"})]
    result = extract("llama3_json", LLAMA_TWO)
    assert result.content is None
    assert calls_of(result) == [("get_weather", {"city": "Zürich"}), ("get_time", {})]
    assert result.tool_calls[0].arguments == '{"city": "Zürich"}'
    # Leading whitespace, "arguments" for "parameters", calls separated by newlines only.
    text = '\n {"name": "get_time", "arguments": {"tz": "UTC"}}\n{"name": "get_time", "parameters": {}}'
    assert calls_of(extract("llama3_json", text)) == [("get_time", {"tz": "UTC"}), ("get_time", {})]
    assert extract("llama3_json", text).content is None


def test_llama3_json_content_before_the_python_tag():
    result = extract("llama3_json", "Let me check." + LLAMA_TAGGED)
    assert result.content == "Let me check."
    assert calls_of(result) == [("get_weather", {"city": "Paris"})]


@pytest.mark.parametrize(
    "text",
    [
        "Paris is the capital of France.",
        "Sets look like {1, 2}; dicts like {'a': 1}.",
        '{"answer": 42}',  # JSON, but not a call
        '{"name": "get_weather", "parameters": {"city": "Paris"}',  # cut off
        '{"name": "get_weather", "parameters": {"city": "Paris",}}',  # trailing comma
        '<|python_tag|>brave_search.call(query="weather in Paris")',  # Llama's built-in tool syntax
        'Here it is: {"name": "get_weather", "parameters": {"city": "Paris"}}',  # prose first: not a call
        "",
    ],
)
def test_llama3_json_non_calls_are_the_whole_text(text):
    assert extract("llama3_json", text) == ExtractedToolCalls(text, [])


def test_llama3_json_bad_second_call_keeps_the_first():
    text = LLAMA_ONE + '; {"name": "get_time", "parameters": oops}'
    result = extract("llama3_json", text)
    assert [c.name for c in result.tool_calls] == ["get_weather"]
    assert result.content == '; {"name": "get_time", "parameters": oops}'


MISTRAL_ARRAY = (
    '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "San Francisco", "metric": false}}, '
    '{"name": "get_time", "arguments": {}}]'
)
MISTRAL_V11 = '[TOOL_CALLS]get_weather{"city": "Málaga"}[TOOL_CALLS]get_time{}'
MISTRAL_V13 = '[TOOL_CALLS]get_weather[ARGS]{"city": "Lyon", "days": 1}'


def test_mistral_formats():
    result = extract("mistral", MISTRAL_ARRAY)
    assert result.content is None
    assert calls_of(result) == [("get_weather", {"city": "San Francisco", "metric": False}), ("get_time", {})]
    assert calls_of(extract("mistral", MISTRAL_V11)) == [("get_weather", {"city": "Málaga"}), ("get_time", {})]
    assert calls_of(extract("mistral", MISTRAL_V13)) == [("get_weather", {"city": "Lyon", "days": 1})]
    single = '[TOOL_CALLS] {"name": "get_time", "arguments": {"tz": "CET"}}'
    assert calls_of(extract("mistral", single)) == [("get_time", {"tz": "CET"})]
    result = extract("mistral", "Sure, one moment. " + MISTRAL_ARRAY)
    assert result.content == "Sure, one moment."
    assert len(result.tool_calls) == 2


def test_mistral_call_ids_are_nine_alphanumerics():
    ids = [c.id for c in get_tool_parser("mistral")().extract(MISTRAL_ARRAY).tool_calls]
    assert len(ids) == 2 and ids[0] != ids[1]
    assert all(re.fullmatch(r"[A-Za-z0-9]{9}", i) for i in ids)
    assert get_tool_parser("mistral").needs_special_tokens


@pytest.mark.parametrize(
    "text",
    [
        "No tools needed: the answer is [1, 2, 3].",
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}]',  # mismatched brackets
        "[TOOL_CALLS][]",
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"',  # cut off
        "[TOOL_CALLS]get_weather(city='Paris')",
        "Before [TOOL_CALLS] !!",
    ],
)
def test_mistral_non_calls_are_the_whole_text(text):
    assert extract("mistral", text) == ExtractedToolCalls(text, [])


def test_mistral_array_cut_after_a_whole_element_keeps_it():
    text = '[TOOL_CALLS][{"name": "get_time", "arguments": {}}, {"name": "get_we'
    result = extract("mistral", text)
    assert calls_of(result) == [("get_time", {})]
    assert result.content == ', {"name": "get_we'


def qwen_call(function: str, params: list[tuple[str, str]]) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params)
    return f"<tool_call>\n<function={function}>\n{body}</function>\n</tool_call>"


QWEN_TYPED = qwen_call(
    "get_weather",
    [
        ("city", "New York"),
        ("days", "3"),
        ("lat", "40.5"),
        ("metric", "True"),
        ("options", '{"detail": ["wind", "rain"]}'),
        ("hours", "[9, 12]"),
        ("note", "null"),
        ("extra", "42"),
    ],
)


def test_qwen3_coder_types_values_by_the_tool_schema():
    result = extract("qwen3_coder", QWEN_TYPED, WEATHER_TOOLS)
    assert result.content is None
    assert calls_of(result) == [
        (
            "get_weather",
            {
                "city": "New York",
                "days": 3,
                "lat": 40.5,
                "metric": True,
                "options": {"detail": ["wind", "rain"]},
                "hours": [9, 12],
                "note": None,
                "extra": "42",  # not in the schema: kept as written
            },
        )
    ]


def test_qwen3_coder_without_tools_keeps_strings():
    text = qwen_call("get_weather", [("city", "Paris"), ("days", "3")])
    assert calls_of(extract("qwen3_coder", text)) == [("get_weather", {"city": "Paris", "days": "3"})]


def test_qwen3_coder_values_that_do_not_fit_their_type_stay_strings():
    text = qwen_call("get_weather", [("days", "three"), ("lat", "nan"), ("metric", "maybe"), ("hours", "[9,")])
    args = calls_of(extract("qwen3_coder", text, WEATHER_TOOLS))[0][1]
    assert args == {"days": "three", "lat": "nan", "metric": "maybe", "hours": "[9,"}
    text = qwen_call("get_weather", [("days", "3.0"), ("options", "{'a': True, 'b': None}")])
    assert calls_of(extract("qwen3_coder", text, WEATHER_TOOLS))[0][1] == {
        "days": "3.0",
        "options": {"a": True, "b": None},
    }


def test_qwen3_coder_multiline_string_value_is_kept_verbatim():
    code = "def f(x):\n    return x < 3 and x > 1\n\n"
    text = qwen_call("write_file", [("path", "a.py"), ("content", code)])
    assert calls_of(extract("qwen3_coder", text)) == [("write_file", {"path": "a.py", "content": code})]


def test_qwen3_coder_several_calls_with_content_and_unicode():
    text = "Let me check both cities.\n" + qwen_call("get_weather", [("city", "München")]) + "\n"
    text += qwen_call("get_time", []) + "\n"
    result = extract("qwen3_coder", text, WEATHER_TOOLS)
    assert result.content == "Let me check both cities."
    assert calls_of(result) == [("get_weather", {"city": "München"}), ("get_time", {})]
    assert result.tool_calls[0].arguments == '{"city": "München"}'


def test_qwen3_coder_lenient_forms():
    # Closing tags left out, as vLLM's regexes allow: a parameter ends at the next one or at </function>.
    text = "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n<parameter=days>\n2\n</function>"
    assert calls_of(extract("qwen3_coder", text, WEATHER_TOOLS)) == [("get_weather", {"city": "Rome", "days": 2})]
    # A bare <function=...> block, and output cut off inside a parameter.
    text = "<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n<parameter=days>\n4"
    assert calls_of(extract("qwen3_coder", text, WEATHER_TOOLS)) == [("get_weather", {"city": "Oslo", "days": 4})]


@pytest.mark.parametrize(
    "text",
    [
        "Plain answer, with a <function> mention but no call.",
        "<tool_call>\nhello\n</tool_call>",
        "<tool_call>\n<function=get\nweather>\n</function>\n</tool_call>",
        "<tool_call>\n<funct",
        "<tool_call>\n<function=get_weather",
    ],
)
def test_qwen3_coder_non_calls_are_the_whole_text(text):
    assert extract("qwen3_coder", text, WEATHER_TOOLS) == ExtractedToolCalls(text, [])


def test_qwen3_coder_streams_each_parameter_as_it_ends():
    parser = make("qwen3_coder", WEATHER_TOOLS)
    assert parser.feed("<tool_call>\n<function=get_weather").tool_calls == []
    first = parser.feed(">\n<parameter=city>\nPa")
    assert [d.to_openai() for d in first.tool_calls] == [
        {"index": 0, "id": "call-0", "type": "function", "function": {"name": "get_weather", "arguments": ""}}
    ]
    assert parser.feed("ris\n</parameter>\n").tool_calls == [ToolCallDelta(0, arguments='{"city": "Paris"')]
    assert parser.feed("<parameter=days>\n5\n</parameter>\n").tool_calls == [ToolCallDelta(0, arguments=', "days": 5')]
    assert parser.feed("</function>\n</tool_call>").tool_calls == [ToolCallDelta(0, arguments="}")]
    assert parser.finish() == StreamUpdate("", [])


# The streaming contract, on every parser -------------------------------------------------------------------

# GPT-OSS's calls as the openai_gptoss reasoning parser passes them on (keel.serve.openai.harmony).
OPENAI_ONE = '<|start|>assistant to=functions.get_weather<|message|>{"city": "Paris", "days": 2}<|call|>'
OPENAI_TIME = "<|start|>assistant to=functions.get_time<|message|>{}<|call|>"
CASES = {
    "hermes": [
        HERMES_ONE,
        HERMES_TWO,
        HERMES_UNICODE,
        "\n\n" + HERMES_TWO + "\nThat's all.\n",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call> and after',
        HERMES_ONE + '\n<tool_call>{"name": 1}</tool_call>\ntail <tool_call>',
        "<tool_call><tool_call>" + HERMES_ONE,
        "Just text with </tool_call> and <tool_cal",
    ],
    "llama3_json": [
        LLAMA_ONE,
        LLAMA_TAGGED,
        LLAMA_TWO,
        "Hi." + LLAMA_TAGGED + " trailing",
        LLAMA_ONE + " ; " + LLAMA_ONE + ";",
        LLAMA_ONE + "\nAnd some prose after. " + LLAMA_TAGGED,
        '  {"name": "get_weather", "parameters": {"q": "a \\" } { quote"}}',
        '{"answer": {"nested": [1, {"x": "}"}]}}',
        "<|python_tag|>print('hi')",
        "<|python_ta",
    ],
    "mistral": [
        MISTRAL_ARRAY,
        MISTRAL_V11,
        MISTRAL_V13,
        "Let me call. " + MISTRAL_ARRAY + " Done.",
        '[TOOL_CALLS][{"name": "get_time", "arguments": {}}, 7]',
        '[TOOL_CALLS][{"name": "get_time", "arguments": {}}] [TOOL_CALLS]get_weather{"city": "Nice"}',
        "text [TOOL_CA",
        "[TOOL_CALLS]get_weather[ARG",
    ],
    "openai": [
        OPENAI_ONE,
        "Checking both. " + OPENAI_ONE + OPENAI_TIME,
        OPENAI_ONE.removesuffix("<|call|>"),  # the call ended the output (<|call|> is an EOS token)
        '<|start|>assistant to=functions.get_weather<|message|>{"city": "Par',  # cut off by max_tokens
        "<|start|>assistant to=functions.<|message|>{}<|call|>",  # no name
        OPENAI_TIME + "<|start|>assistant to=functions.get_weather<|message|>[1]<|call|> after",
        "text <|start|>assist",
    ],
    "qwen3_coder": [
        QWEN_TYPED,
        "Intro.\n" + qwen_call("get_weather", [("city", "Köln")]) + "\n" + qwen_call("get_time", []),
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n<parameter=days>\n2\n</function>",
        "<tool_call>\n<function=a>\n</function>\n<function=b>\n<parameter=x>\n1\n</parameter>\n</function>\n</tool_call>",
        "<tool_call>\nnot a function\n</tool_call>",
        qwen_call("get_time", []) + "\n<tool_call>\nbroken",
        "<function=get_weather>\n<parameter=city\nno close",
        qwen_call("get_weather", [("city", "a </parameter b"), ("days", "x")]) + " after",
    ],
}


@pytest.mark.parametrize("name,text", [(name, text) for name, texts in CASES.items() for text in texts])
def test_streaming_concatenates_to_extract_under_random_splits(name, text):
    whole = assert_stream_matches(name, text, WEATHER_TOOLS)
    if not whole.tool_calls:
        assert whole.content == text


def test_every_registered_parser_has_streaming_cases():
    assert {"hermes", "llama3_json", "qwen3_coder", "mistral"} <= set(TOOL_PARSERS)
    assert set(CASES) >= {n for n, cls in TOOL_PARSERS.items() if cls.__module__.startswith("keel.")} - {"llama4_json"}


# Fuzzing: texts built from each format's pieces, valid and broken, split at random.
FRAGMENTS = {
    "hermes": [
        HERMES_ONE,
        '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
        "<tool_call>",
        "</tool_call>",
        "<tool_",
        '{"name": "get_time", "arguments": {}}',
        '{"name": "get_weather", "arguments": {"city": "Paris"}}',
        "{",
        "}",
        '"',
    ],
    "llama3_json": [
        "<|python_tag|>",
        "<|python",
        '{"name": "get_time", "parameters": {}}',
        '{"name": "get_weather", "arguments": {"city": "}{"}}',
        ";",
        "{",
        "}",
        '"',
        "\\",
    ],
    "mistral": [
        MISTRAL_ARRAY,
        "[TOOL_CALLS]",
        "[TOOL_",
        "[",
        "]",
        ",",
        '{"name": "get_time", "arguments": {}}',
        'get_weather{"city": "Paris"}',
        "get_time[ARGS]{}",
        "[ARGS]",
    ],
    "openai": [
        OPENAI_ONE,
        "<|start|>assistant to=functions.",
        "<|start|>assist",
        "get_time",
        "<|message|>",
        "<|call|>",
        '{"city": "Paris"}',
        "{}",
    ],
    "qwen3_coder": [
        "<tool_call>",
        "</tool_call>",
        "<function=get_weather>",
        "<function=",
        "</function>",
        "<parameter=days>",
        "<parameter=city>",
        "</parameter>",
        "<param",
        "12",
        "true",
    ],
}
COMMON = ["\n", " ", "\n\n", "Hello", "é漢字🙂", "<", ">", "x"]


@pytest.mark.parametrize("name", sorted(FRAGMENTS))
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzzed_outputs_stream_exactly_as_extracted(name, data):
    parts = data.draw(st.lists(st.sampled_from(FRAGMENTS[name] + COMMON), max_size=14))
    text = "".join(parts)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=10)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    whole = extract(name, text, WEATHER_TOOLS)
    assert stream(name, pieces, WEATHER_TOOLS) == whole
    if whole.tool_calls:
        for call in whole.tool_calls:
            assert isinstance(json.loads(call.arguments), dict)
    else:
        assert whole.content == text


# The registry and the base contract ------------------------------------------------------------------------


def test_unknown_parser_name_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown tool parser 'nope'.*hermes"):
        get_tool_parser("nope")


def test_a_user_parser_can_be_registered():
    @register_tool_parser("test_upper_calls")
    class UpperCalls(ToolParser):
        """A call is a line `CALL name`; everything else is content."""

        def _step(self, final: bool) -> bool:
            line, newline, rest = self._buf.partition("\n")
            if not newline and not final:
                return False
            if line.startswith("CALL "):
                self._at_marker()
                self._call(line[5:], "{}")
            else:
                self._content(line + newline)
            self._buf = rest
            return bool(rest)

    try:
        assert get_tool_parser("test_upper_calls") is UpperCalls
        assert UpperCalls.name == "test_upper_calls"
        result = UpperCalls(id_factory=counting_ids()).extract("hi\nCALL ping\n")
        assert result == ExtractedToolCalls("hi", [ToolCall("call-0", "ping", "{}")])
    finally:
        del TOOL_PARSERS["test_upper_calls"]
    with pytest.raises(TypeError):
        register_tool_parser("bad")(dict)


def test_parser_is_single_use_and_ids_are_vllm_shaped():
    parser = get_tool_parser("hermes")()
    update = parser.feed(HERMES_ONE)
    assert re.fullmatch(r"chatcmpl-tool-[0-9a-f]{32}", update.tool_calls[0].id)
    parser.finish()
    with pytest.raises(RuntimeError):
        parser.feed("more")
    with pytest.raises(RuntimeError):
        parser.finish()
    # extract() does not disturb a parser's own stream.
    parser = make("hermes")
    assert parser.feed("Hi <tool").content == "Hi"
    assert len(parser.extract(HERMES_TWO).tool_calls) == 2
    assert parser.feed("box>").content == " <toolbox>"


def test_tool_call_openai_shape():
    call = ToolCall("call-0", "get_time", "{}")
    assert call.to_openai() == {"id": "call-0", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}
    assert ToolCallDelta(2, arguments='"x"').to_openai() == {"index": 2, "function": {"arguments": '"x"'}}
