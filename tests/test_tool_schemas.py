"""The schemas that force tool calls (keel.serve.openai.tool_schemas): the `tools` checks the route turns
into 400s, the named and `required` schemas (validated with jsonschema), and parsing forced output."""

from __future__ import annotations

import copy
import itertools
import json

import pytest

from keel.serve.openai.tool_parsers import ToolCall
from keel.serve.openai.tool_schemas import (
    DEFAULT_PARAMETERS,
    named_tool_schema,
    parse_required_calls,
    required_tools_schema,
    tool_choice_schema,
    validate_tools,
)

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"$ref": "#/$defs/Unit"}},
    "required": ["city"],
    "$defs": {"Unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
}
SEARCH = {
    "type": "object",
    "properties": {"query": {"type": "string"}, "top_k": {"type": "integer", "minimum": 1}},
    "required": ["query", "top_k"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "search", "parameters": SEARCH}},
    {"type": "function", "function": {"name": "get_time"}},  # no parameters: an object with none
]


def counting_ids():
    counter = itertools.count()
    return lambda: f"call-{next(counter)}"


@pytest.mark.parametrize(
    "tools,field",
    [
        ({"type": "function"}, "tools must be a list"),
        (["get_weather"], r"tools\[0\] must be an object"),
        ([{"type": "retrieval", "function": {"name": "x"}}], r"tools\[0\]\.type must be 'function', got 'retrieval'"),
        ([{"function": {"name": "x"}}], r"tools\[0\]\.type must be 'function'"),
        ([TOOLS[0], {"type": "function"}], r"tools\[1\]\.function must be an object"),
        ([{"type": "function", "function": {"description": "no name"}}], r"tools\[0\]\.function\.name"),
        ([{"type": "function", "function": {"name": ""}}], r"tools\[0\]\.function\.name"),
        ([{"type": "function", "function": {"name": "x", "parameters": "{}"}}], r"tools\[0\]\.function\.parameters"),
        ([{"type": "function", "function": {"name": "x", "description": 3}}], r"tools\[0\]\.function\.description"),
        ([{"type": "function", "function": {"name": "x", "strict": "yes"}}], r"tools\[0\]\.function\.strict"),
    ],
)
def test_invalid_tools_name_the_field(tools, field):
    with pytest.raises(ValueError, match=field):
        validate_tools(tools)


def test_validate_tools_normalizes_without_touching_the_request():
    original = copy.deepcopy(TOOLS)
    checked = validate_tools(TOOLS)
    assert TOOLS == original
    assert checked[2] == {"type": "function", "function": {"name": "get_time", "parameters": DEFAULT_PARAMETERS}}
    assert checked[0]["function"]["description"] == "Weather"
    checked[0]["function"]["parameters"]["properties"].clear()
    assert TOOLS == original  # copies, not the request's own dicts
    assert validate_tools(None) == []


def test_named_tool_schema():
    assert named_tool_schema(TOOLS, "search") == SEARCH
    assert named_tool_schema(TOOLS, "get_time") == {"type": "object", "properties": {}}
    with pytest.raises(ValueError, match="'get_stock_price'"):
        named_tool_schema(TOOLS, "get_stock_price")


def test_required_schema_shape():
    schema = required_tools_schema(TOOLS)
    assert schema["type"] == "array" and schema["minItems"] == 1
    branches = schema["items"]["anyOf"]
    assert [b["properties"]["name"] for b in branches] == [
        {"type": "string", "enum": ["get_weather"]},
        {"type": "string", "enum": ["search"]},
        {"type": "string", "enum": ["get_time"]},
    ]
    assert all(b["required"] == ["name", "parameters"] for b in branches)
    # get_weather's $defs moved to the root, where its "#/$defs/Unit" reference now points.
    assert schema["$defs"] == WEATHER["$defs"]
    assert "$defs" not in branches[0]["properties"]["parameters"]
    assert "$defs" in TOOLS[0]["function"]["parameters"]  # the request is left as it was
    with pytest.raises(ValueError, match="at least one function"):
        required_tools_schema([])


def test_required_schema_rejects_clashing_definitions():
    other = copy.deepcopy(WEATHER)
    other["$defs"]["Unit"] = {"type": "string", "enum": ["kelvin"]}
    tools = [TOOLS[0], {"type": "function", "function": {"name": "get_forecast", "parameters": other}}]
    with pytest.raises(ValueError, match="'Unit'.*get_forecast"):
        required_tools_schema(tools)
    same = [TOOLS[0], {"type": "function", "function": {"name": "get_forecast", "parameters": copy.deepcopy(WEATHER)}}]
    assert required_tools_schema(same)["$defs"] == WEATHER["$defs"]


@pytest.mark.parametrize(
    "calls,valid",
    [
        ([{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}], True),
        (
            [{"name": "search", "parameters": {"query": "keel", "top_k": 3}}, {"name": "get_time", "parameters": {}}],
            True,
        ),
        ([], False),  # at least one call
        ([{"name": "get_stock", "parameters": {}}], False),  # not a tool
        ([{"name": "get_weather", "parameters": {"city": "Paris", "unit": "kelvin"}}], False),  # $ref enforced
        ([{"name": "search", "parameters": {"query": "keel"}}], False),  # search's required top_k
        ([{"name": "get_weather", "parameters": {"query": "keel", "top_k": 1}}], False),  # search's args, wrong name
        ([{"name": "get_time"}], False),  # parameters required
        ([{"name": "get_time", "parameters": {}, "extra": 1}], False),
        ({"name": "get_time", "parameters": {}}, False),  # not an array
    ],
)
def test_required_schema_validates_with_jsonschema(calls, valid):
    jsonschema = pytest.importorskip("jsonschema")
    schema = required_tools_schema(TOOLS)
    validator = jsonschema.Draft202012Validator(schema)
    jsonschema.Draft202012Validator.check_schema(schema)
    assert validator.is_valid(calls) is valid
    named = jsonschema.Draft202012Validator(named_tool_schema(TOOLS, "get_weather"))
    assert named.is_valid({"city": "Oslo", "unit": "celsius"})
    assert not named.is_valid({"unit": "celsius"})


def test_tool_choice_schema():
    assert tool_choice_schema(TOOLS, "auto") is None
    assert tool_choice_schema(TOOLS, "none") is None
    assert tool_choice_schema(TOOLS, None) is None
    assert tool_choice_schema(TOOLS, "required") == required_tools_schema(TOOLS)
    assert tool_choice_schema(TOOLS, {"type": "function", "function": {"name": "search"}}) == SEARCH
    with pytest.raises(ValueError, match="tool_choice must be"):
        tool_choice_schema(TOOLS, {"type": "function"})
    with pytest.raises(ValueError, match=r"tools\[0\]\.type"):
        tool_choice_schema([{"type": "x"}], "auto")  # tools are checked even when nothing is forced


def test_parse_forced_required_calls():
    text = '[{"name": "get_weather", "parameters": {"city": "Zürich"}}, {"name": "get_time", "parameters": {}}]'
    calls = parse_required_calls(text, TOOLS, id_factory=counting_ids())
    assert calls == [
        ToolCall("call-0", "get_weather", '{"city": "Zürich"}'),
        ToolCall("call-1", "get_time", "{}"),
    ]


@pytest.mark.parametrize(
    "text,message",
    [
        ("[]", "holds no call"),
        ('{"name": "get_time", "parameters": {}}', "holds no call"),  # not an array
        ('[{"name": "get_stock", "parameters": {}}]', "'get_stock'"),
        ('[{"parameters": {}}]', "holds no call"),
        ('[{"name": "get_time", "parameters": {"a": 1,}}, {"name": "get_time", "parameters": {}}]', "not valid JSON"),
        ('[{"name": "get_time", "parameters": []}]', "not an object"),
        ('[{"name": "get_time", "parameters": {"a": NaN}}]', "not valid JSON"),
    ],
)
def test_parse_required_calls_rejects_what_the_schema_would_not_produce(text, message):
    with pytest.raises(ValueError, match=message):
        parse_required_calls(text, TOOLS)


def test_a_cut_off_required_output_keeps_its_calls():
    """max_tokens cut the array: the calls whose names came out, the last one's arguments as far as they came."""
    text = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {"zo'
    calls = parse_required_calls(text, TOOLS, id_factory=counting_ids())
    assert calls == [ToolCall("call-0", "get_weather", '{"city": "Paris"}'), ToolCall("call-1", "get_time", '{"zo')]
    assert parse_required_calls('[{"name": "get_time", "par', TOOLS)[0].arguments == ""
    # Cut before the first call's name: no calls, and the array's opening is not content (vLLM's answer too).
    for text in ("[", ' [{"na', '[{"name": "get_w'):
        assert parse_required_calls(text, TOOLS) == []


def test_forced_output_round_trip():
    """Output valid under the required schema parses back into the calls it encodes."""
    jsonschema = pytest.importorskip("jsonschema")
    schema = required_tools_schema(TOOLS)
    output = [
        {"name": "search", "parameters": {"query": "日本語", "top_k": 2}},
        {"name": "get_weather", "parameters": {"city": "Lyon", "unit": "fahrenheit"}},
    ]
    jsonschema.validate(output, schema, cls=jsonschema.Draft202012Validator)
    calls = parse_required_calls(json.dumps(output), TOOLS)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [(o["name"], o["parameters"]) for o in output]
