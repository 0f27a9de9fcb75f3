"""POST /v1/responses (OpenAI's Responses API) over real HTTP with the official openai client, on SmolLM2 with the
tool-call and reasoning parsers of tests/test_serve_structured.py (its fixtures): each answer is the chat route's
answer to the conversation it amounts to (greedy), whole and streamed (raw events and the SDK's stream helper),
with instructions, structured text formats, function tools and their results as input items, logprobs, and a 400
naming each field keel does not implement."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

import test_serve_structured as structured
from test_serve_structured import PERSON, WEATHER

# The structured-output tests' fixtures: SmolLM2 with the tools template and the hermes and qwen3 parsers.
server, client = structured.server, structured.client

MODEL = "smol"
QUESTION = "What is the capital of France?"
INSTRUCTIONS = "Answer in one short sentence."
FUNCTION = {"type": "function", **WEATHER["function"]}  # the Responses API's flat function tool


def respond(client, **kw):
    return client.responses.create(model=MODEL, **{"temperature": 0.0, **kw})


def chat(client, messages, **kw):
    return client.chat.completions.create(model=MODEL, messages=messages, **{"temperature": 0.0, **kw})


def test_an_answer_is_the_chat_routes_answer(client):
    asked = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}]
    want = chat(client, asked, max_tokens=24)
    got = respond(client, input=QUESTION, instructions=INSTRUCTIONS, max_output_tokens=24)
    assert got.id.startswith("resp_") and got.object == "response" and got.model == MODEL
    assert got.output_text == want.choices[0].message.content
    assert [item.type for item in got.output] == ["message"]
    assert got.output[0].role == "assistant" and got.output[0].content[0].type == "output_text"
    finish = want.choices[0].finish_reason
    assert got.status == ("incomplete" if finish == "length" else "completed")
    assert got.usage.input_tokens == want.usage.prompt_tokens
    assert got.usage.output_tokens == want.usage.completion_tokens
    assert got.usage.total_tokens == want.usage.total_tokens
    assert got.instructions == INSTRUCTIONS and got.max_output_tokens == 24 and got.store is False
    assert got.temperature == 0.0 and got.top_p == 1.0
    # The same conversation as message items (input_text parts, a developer turn for the system one)
    items = [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": INSTRUCTIONS}]},
        {"role": "user", "content": [{"type": "input_text", "text": QUESTION}]},
    ]
    assert respond(client, input=items, max_output_tokens=24).output_text == got.output_text


def test_max_output_tokens_leaves_the_response_incomplete(client):
    got = respond(client, input="Tell a long story about a cat.", max_output_tokens=3)
    assert got.status == "incomplete" and got.incomplete_details.reason == "max_output_tokens"
    assert got.usage.output_tokens == 3 and got.output[0].status == "incomplete"
    # Streamed, the last event is response.completed (as vLLM sends it) carrying the incomplete response, so the
    # SDK's stream helper ends on it.
    request = dict(model=MODEL, input="Tell a long story about a cat.", max_output_tokens=3, temperature=0.0)
    with client.responses.stream(**request) as stream:
        final = stream.get_final_response()
    assert final.status == "incomplete" and final.output_text == got.output_text


def test_a_stream_sends_numbered_typed_events_that_build_the_answer(client):
    whole = respond(client, input=QUESTION, max_output_tokens=20)
    events = list(respond(client, input=QUESTION, max_output_tokens=20, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == whole.output_text
    final = events[-1].response
    assert final.output_text == whole.output_text and final.usage.output_tokens == whole.usage.output_tokens
    assert final.output[0].id == events[2].item.id  # the item the events announced
    # The SDK's helper accumulates the same events into the same response.
    with client.responses.stream(model=MODEL, input=QUESTION, max_output_tokens=20, temperature=0.0) as stream:
        assert stream.get_final_response().output_text == whole.output_text


def test_a_json_schema_text_format_constrains_the_answer(client):
    fmt = {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}
    got = respond(client, input="Describe a person as JSON.", max_output_tokens=80, text={"format": fmt})
    jsonschema.validate(json.loads(got.output_text), PERSON)
    assert got.text.format.type == "json_schema"


def test_function_tools_call_and_take_their_results(client):
    got = respond(client, input="What is the weather in Paris?", tools=[FUNCTION], tool_choice="required")
    calls = [item for item in got.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and calls[0].call_id
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER["function"]["parameters"])
    streamed = list(
        respond(client, input="What is the weather in Paris?", tools=[FUNCTION], tool_choice="required", stream=True)
    )
    final = streamed[-1].response
    assert [(c.name, c.arguments) for c in final.output if c.type == "function_call"] == [
        (c.name, c.arguments) for c in calls
    ]
    # The call's item opens once its name is out and its arguments follow as they are generated.
    first = next(e for e in streamed if e.type == "response.output_item.added" and e.item.type == "function_call")
    pieces = [e.delta for e in streamed if e.type == "response.function_call_arguments.delta" and e.output_index == 0]
    assert first.item.name == "get_weather" and len(pieces) > 1 and "".join(pieces) == calls[0].arguments
    assert "response.function_call_arguments.done" in [e.type for e in streamed]
    # The call and its result as input items: the chat route's answer to the same turns.
    result = '{"temperature": 21, "unit": "c"}'
    items = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather", "arguments": calls[0].arguments},
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": result},
    ]
    turns = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": calls[0].call_id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": calls[0].arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": calls[0].call_id, "content": result},
    ]
    want = chat(client, turns, max_tokens=20, tools=[WEATHER], tool_choice="none")
    answer = respond(client, input=items, max_output_tokens=20, tools=[FUNCTION], tool_choice="none")
    assert answer.output_text == want.choices[0].message.content


def test_output_logprobs_when_included(client):
    got = respond(client, input=QUESTION, max_output_tokens=6, include=["message.output_text.logprobs"], top_logprobs=2)
    want = chat(client, [{"role": "user", "content": QUESTION}], max_tokens=6, logprobs=True, top_logprobs=2)
    logprobs = got.output[0].content[0].logprobs
    assert [lp.token for lp in logprobs] == [lp.token for lp in want.choices[0].logprobs.content]
    assert all(len(lp.top_logprobs) == 2 for lp in logprobs)
    assert respond(client, input=QUESTION, max_output_tokens=6).output[0].content[0].logprobs == []


@pytest.mark.parametrize(
    ("field", "value", "param"),
    [
        ("previous_response_id", "resp_123", "previous_response_id"),
        ("conversation", "conv_123", "conversation"),
        ("background", True, "background"),
        ("truncation", "auto", "truncation"),
        ("include", ["reasoning.encrypted_content"], "include"),
        ("top_logprobs", 2, "top_logprobs"),  # without the include that returns them
        ("tools", [{"type": "web_search"}], "tools"),
        ("messages", [{"role": "user", "content": "hi"}], "messages"),
        ("input", [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}], "input"),
        ("input", [{"type": "file_search_call", "id": "fs_1"}], "input"),
        ("text", {"verbosity": "low"}, "text"),
        ("previous_input_messages", [{"role": "user", "content": "hi"}], "previous_input_messages"),
        ("cache_salt", "salt", "cache_salt"),  # a chat field keel refuses: refused here too
    ],
)
def test_what_keel_does_not_implement_is_a_400_naming_it(server, field, value, param):
    body = {"model": MODEL, "input": QUESTION, "max_output_tokens": 4, field: value}
    r = httpx.post(server.base_url + "/v1/responses", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_an_unknown_model_is_a_404(client):
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="gpt-4o", input=QUESTION)


def test_stream_events_open_and_close_each_item_in_order():
    """The event writer alone, on what a reasoning parser and a tool-call writer hand it: the reasoning item closes
    when the message starts, the message when a call starts, a call's arguments go out as they come and the call
    closes at the end; every event is numbered, and the output it built is what the events announced."""
    from keel.serve.openai.serving_responses import ResponseEvents

    events = ResponseEvents()
    sent = events.text("reasoning", "Paris is ", []) + events.text("reasoning", "the capital.", [])
    sent += events.text("message", "Paris", [{"token": "Paris", "logprob": -0.1}])
    sent += events.call({"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": ""}})
    sent += events.call({"index": 0, "function": {"arguments": '{"a": '}})
    sent += events.call({"index": 0, "function": {"arguments": "1}"}})
    sent += events.finish("completed")
    parsed = [json.loads(e.split("\ndata: ", 1)[1]) for e in sent]
    assert all(e.startswith(f"event: {p['type']}\n") for e, p in zip(sent, parsed, strict=True))
    assert [p["sequence_number"] for p in parsed] == list(range(len(parsed)))
    assert [p["type"].removeprefix("response.") for p in parsed] == [
        "output_item.added",
        "content_part.added",
        "reasoning_text.delta",
        "reasoning_text.delta",
        "reasoning_text.done",
        "content_part.done",
        "output_item.done",
        "output_item.added",
        "content_part.added",
        "output_text.delta",
        "output_text.done",
        "content_part.done",
        "output_item.done",
        "output_item.added",
        "function_call_arguments.delta",
        "function_call_arguments.delta",
        "function_call_arguments.done",
        "output_item.done",
    ]
    reasoning, message, call = events.output
    assert reasoning["type"] == "reasoning" and reasoning["content"][0]["text"] == "Paris is the capital."
    assert message["content"][0]["text"] == "Paris" and message["content"][0]["logprobs"][0]["token"] == "Paris"
    assert (call["call_id"], call["name"], call["arguments"], call["status"]) == (
        "call_1",
        "f",
        '{"a": 1}',
        "completed",
    )
    added = parsed[13]["item"]
    assert (added["id"], added["status"], added["arguments"]) == (call["id"], "in_progress", "")
    assert [p["output_index"] for p in parsed if p["type"] == "response.output_item.done"] == [0, 1, 2]
    empty = ResponseEvents()
    assert len(empty.finish("completed")) == 5 and empty.output[0]["content"][0]["text"] == ""
