"""Structured outputs, tool calls and reasoning over real HTTP with the official openai client, on SmolLM2:
JSON answers validate against their schemas (jsonschema), guided regexes match, named and required tool
calls' arguments validate, a tool round trip works streamed and not, and reasoning is split off."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

from keel.serve.openai.child import ServerProcess

MODEL = "smol"
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 30}, "unit": {"type": "string", "enum": ["c", "f"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 20}},
            "required": ["zone"],
        },
    },
}
# A Hermes-style template (as Qwen2.5's): the tools in a system turn, calls as <tool_call> JSON, results
# as <tool_response> user turns.
TOOLS_TEMPLATE = """
{%- if tools %}<|im_start|>system
You may call these functions:
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}Call one as <tool_call>{"name": ..., "arguments": ...}</tool_call>.<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{% for call in message.tool_calls %}<tool_call>
{{ {"name": call.function.name, "arguments": call.function.arguments} | tojson }}
</tool_call>{% endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("structured")
    template = root / "tools.jinja"
    template.write_text(TOOLS_TEMPLATE)
    args = ["--served-model-name", MODEL, "--threads", "1", "--no-compile", "--chat-template", str(template)]
    args += ["--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3"]
    proc = ServerProcess("smollm2-135m-instruct", *args, log_path=root / "server.log").wait_ready()
    yield proc
    proc.terminate()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)


def chat(client, messages=ASK, **kw):
    return client.chat.completions.create(model=MODEL, messages=messages, **{"temperature": 0.0, **kw})


def streamed(client, messages=ASK, **kw) -> tuple[str, dict[int, dict], str | None, str]:
    """(content, tool calls by index accumulated as OpenAI's SDK helpers do, finish_reason, reasoning)."""
    content, reasoning, calls, finish = "", "", {}, None
    for chunk in client.chat.completions.create(model=MODEL, messages=messages, temperature=0.0, stream=True, **kw):
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
            for call in delta.tool_calls or []:
                entry = calls.setdefault(call.index, {"id": None, "name": "", "arguments": ""})
                entry["id"] = call.id or entry["id"]
                if call.function is not None:
                    entry["name"] += call.function.name or ""
                    entry["arguments"] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, calls, finish, reasoning


def test_json_schema_response_validates(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    messages = [{"role": "user", "content": "Describe a person as JSON."}]
    whole = chat(client, messages, max_tokens=80, response_format=fmt).choices[0]
    assert whole.finish_reason == "stop"
    jsonschema.validate(json.loads(whole.message.content), PERSON)
    content, _, finish, _ = streamed(client, messages, max_tokens=80, response_format=fmt)
    assert content == whole.message.content and finish == "stop"
    sampled = chat(client, messages, max_tokens=80, response_format=fmt, n=3, seed=5, temperature=1.0)
    for choice in sampled.choices:
        jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_guided_regex_choice_and_grammar(client):
    pattern = r"[A-Z]{2}-\d{3}-[a-z]{2}"
    for body in ({"structured_outputs": {"regex": pattern}}, {"guided_regex": pattern}):
        text = chat(client, max_tokens=20, extra_body=body).choices[0].message.content
        assert re.fullmatch(pattern, text), text
    completion = client.completions.create(
        model=MODEL,
        prompt="The plate number is",
        max_tokens=20,
        temperature=0.7,
        seed=3,
        extra_body={"guided_regex": pattern},
    )
    assert re.fullmatch(pattern, completion.choices[0].text)
    choice = chat(client, max_tokens=10, extra_body={"guided_choice": ["sunny", "rainy"]}).choices[0].message.content
    assert choice in ("sunny", "rainy")
    grammar = 'root ::= "temp=" [0-9] [0-9]? "C"'
    text = (
        chat(client, max_tokens=12, extra_body={"structured_outputs": {"grammar": grammar}}).choices[0].message.content
    )
    assert re.fullmatch(r"temp=[0-9]{1,2}C", text), text
    ask = [{"role": "user", "content": "Give a JSON object with the key ok set to true."}]
    whole = chat(client, ask, max_tokens=120, response_format={"type": "json_object"}).choices[0]
    assert whole.message.content.startswith("{")  # an object from the first token (a small model may run long)
    if whole.finish_reason == "stop":
        assert isinstance(json.loads(whole.message.content), dict)


def test_bad_constraints_are_400s_naming_the_field(client):
    cases = [
        ({"guided_regex": "[a-"}, "guided_regex"),
        ({"structured_outputs": {"json": {"type": "bogus"}}}, "structured_outputs"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
        ({"response_format": {"type": "structural_tag"}}, "response_format"),
        ({"guided_decoding_backend": "outlines", "guided_regex": "a"}, "guided_decoding_backend"),
    ]
    for body, param in cases:
        with pytest.raises(openai.BadRequestError) as e:
            chat(client, max_tokens=5, extra_body=body)
        assert e.value.body["param"] == param, (body, e.value.body)


def test_named_tool_call_arguments_validate(client):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    whole = chat(client, max_tokens=60, tools=[WEATHER, TIME], tool_choice=choice).choices[0]
    assert whole.finish_reason == "stop" and whole.message.content is None  # OpenAI's for a forced function
    (call,) = whole.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("chatcmpl-tool-")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    content, calls, finish, _ = streamed(client, max_tokens=60, tools=[WEATHER, TIME], tool_choice=choice)
    assert content == "" and finish == "stop" and list(calls) == [0]
    assert calls[0]["name"] == "get_weather" and calls[0]["id"].startswith("chatcmpl-tool-")
    assert calls[0]["arguments"] == call.function.arguments  # the output as generated, whole or streamed
    # Cut off by max_tokens (vLLM's): still the call, its arguments as far as they came, streamed alike.
    short = chat(client, max_tokens=4, tools=[WEATHER, TIME], tool_choice=choice).choices[0]
    assert short.finish_reason == "length" and short.message.content is None
    (cut,) = short.message.tool_calls
    assert cut.function.name == "get_weather" and call.function.arguments.startswith(cut.function.arguments)
    content, calls, finish, _ = streamed(client, max_tokens=4, tools=[WEATHER, TIME], tool_choice=choice)
    assert content == "" and finish == "length" and calls[0]["arguments"] == cut.function.arguments


def test_required_tool_calls(client):
    whole = chat(client, max_tokens=100, tools=[WEATHER, TIME], tool_choice="required").choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.tool_calls
    by_name = {"get_weather": WEATHER, "get_time": TIME}
    for call in whole.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), by_name[call.function.name]["function"]["parameters"])
    _, calls, finish, _ = streamed(client, max_tokens=100, tools=[WEATHER, TIME], tool_choice="required")
    assert finish == "tool_calls"
    # Each call announced once its name is out, then its arguments as generated: the pieces add up to the whole.
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls
    ]
    # Cut off by max_tokens: the calls as far as they came, the arguments a prefix of the whole's, streamed alike.
    short = chat(client, max_tokens=20, tools=[WEATHER, TIME], tool_choice="required").choices[0]
    assert short.finish_reason == "length" and short.message.content is None
    cut = short.message.tool_calls[-1]
    full = whole.message.tool_calls[len(short.message.tool_calls) - 1]
    assert cut.function.name == full.function.name and full.function.arguments.startswith(cut.function.arguments)
    assert cut.function.arguments != full.function.arguments
    _, calls, finish, _ = streamed(client, max_tokens=20, tools=[WEATHER, TIME], tool_choice="required")
    assert finish == "length"
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in short.message.tool_calls
    ]
    # Cut before the first call's name is out: no calls and no content (the raw "[" came back as content before).
    early = chat(client, max_tokens=3, tools=[WEATHER, TIME], tool_choice="required").choices[0]
    assert early.finish_reason == "length" and early.message.content is None and not early.message.tool_calls
    content, calls, finish, _ = streamed(client, max_tokens=3, tools=[WEATHER, TIME], tool_choice="required")
    assert (content, calls, finish) == ("", {}, "length")


def test_auto_tool_choice_reads_hermes_calls(client):
    """tool_choice auto: the hermes parser reads <tool_call> JSON out of the text (a guided regex makes the
    small model write one), streamed and not; without a call the text stays content."""
    pattern = (
        r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Lyon)", "unit": "c"\}\}\n</tool_call>'
    )
    body = {"guided_regex": pattern}
    whole = chat(client, max_tokens=60, tools=[WEATHER], extra_body=body).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content is None
    (call,) = whole.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["unit"] == "c"
    content, calls, finish, _ = streamed(client, max_tokens=60, tools=[WEATHER], extra_body=body)
    assert finish == "tool_calls" and content == "" and calls[0]["name"] == "get_weather"
    assert json.loads(calls[0]["arguments"]) == json.loads(call.function.arguments)
    plain = chat(client, max_tokens=10, tools=[WEATHER], tool_choice="auto").choices[0]
    assert plain.message.tool_calls in (None, []) and plain.message.content


def test_tool_round_trip(client):
    """Call, tool result, answer: the assistant's tool_calls and the tool message reach the template (the
    prompt's own tokens, from prompt_logprobs, show them rendered), and the answer comes back streamed and not."""
    choice = {"type": "function", "function": {"name": "get_weather"}}
    first = chat(client, max_tokens=60, tools=[WEATHER], tool_choice=choice).choices[0].message
    call = first.tool_calls[0]
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "clear"}'},
    ]
    answer = chat(
        client, history, max_tokens=24, tools=[WEATHER], tool_choice="none", extra_body={"prompt_logprobs": 0}
    )
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls
    rendered = "".join(next(iter(e.values()))["decoded_token"] for e in answer.model_extra["prompt_logprobs"][1:])
    arguments = json.loads(call.function.arguments)
    assert json.dumps({"name": "get_weather", "arguments": arguments}) in rendered
    assert '<tool_response>\n{"temperature": 21, "sky": "clear"}\n</tool_response>' in rendered
    assert '"name": "get_weather"' in rendered.split("<|im_end|>")[0]  # the tools' system turn
    content, calls, _, _ = streamed(client, history, max_tokens=24, tools=[WEATHER], tool_choice="none")
    assert content == answer.choices[0].message.content and not calls


def test_reasoning_is_split_off(client):
    """--reasoning-parser qwen3: <think>...</think> becomes reasoning_content (the regex makes the model write
    one); without it, everything is content; streamed equals whole; include_reasoning false drops it."""
    pattern = r"<think>[a-z ]{5,30}</think>[A-Z][a-z ]{3,30}\."
    body = {"guided_regex": pattern}
    whole = chat(client, max_tokens=40, extra_body=body).choices[0].message
    reasoning = whole.model_extra["reasoning_content"]
    assert reasoning and whole.content and re.fullmatch(r"[a-z ]{5,30}", reasoning)
    assert re.fullmatch(r"[A-Z][a-z ]{3,30}\.", whole.content)
    content, _, _, streamed_reasoning = streamed(client, max_tokens=40, extra_body=body)
    assert (content, streamed_reasoning) == (whole.content, reasoning)
    hidden = chat(client, max_tokens=40, extra_body={**body, "include_reasoning": False}).choices[0].message
    assert hidden.content == whole.content and "reasoning_content" not in (hidden.model_extra or {})
    plain = chat(client, max_tokens=8).choices[0].message
    assert plain.content and plain.model_extra.get("reasoning_content") is None


def test_structured_request_reuses_the_prefix_cache(server, client):
    """A constrained request sharing a long prefix with an earlier one is served from the prefix cache."""
    long = [{"role": "user", "content": "Here is a long story about a cat. " * 20 + "Describe the cat as JSON."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}
    first = chat(client, long, max_tokens=60, response_format=fmt)
    second = chat(client, long, max_tokens=60, response_format=fmt)
    assert second.usage.prompt_tokens_details.cached_tokens >= 64
    assert second.choices[0].message.content == first.choices[0].message.content
    jsonschema.validate(json.loads(second.choices[0].message.content), PERSON)
    assert httpx.get(server.base_url + "/health").status_code == 200


def _raw_stream(server, body: dict, route: str = "/v1/chat/completions") -> list[dict]:
    with httpx.stream("POST", server.base_url + route, json=body, timeout=120) as r:
        assert r.status_code == 200
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_stream_chunks_are_shaped_as_vllm_sends_them(server):
    """One tool-call entry per call index in a chunk (a call's header and its first arguments together), no chunk
    for text a parser holds (a required call's opening bracket), and the ending chunk's stop_reason."""
    body = {"model": MODEL, "messages": ASK, "temperature": 0.0, "stream": True, "max_tokens": 60}
    for choice in ({"type": "function", "function": {"name": "get_weather"}}, "required"):
        chunks = _raw_stream(server, {**body, "tools": [WEATHER, TIME], "tool_choice": choice})
        deltas = [(ch["delta"], ch["finish_reason"]) for c in chunks for ch in c["choices"]]
        assert any(delta.get("tool_calls") for delta, _ in deltas)
        for delta, finish in deltas:
            indexes = [call["index"] for call in delta.get("tool_calls") or []]
            assert len(indexes) == len(set(indexes)), delta
            assert finish is not None or delta not in ({}, {"content": ""}), delta
    chunks = _raw_stream(server, {**body, "stop": [" "]})
    (last,) = [ch for c in chunks for ch in c["choices"] if ch["finish_reason"]]
    assert last["finish_reason"] == "stop" and last["stop_reason"] == " "
    # Greedy, and a stop that any English continuation reaches: a sampled run may go 20 tokens without a full stop.
    prompt = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 20, "temperature": 0.0}
    chunks = _raw_stream(server, {**prompt, "stop": [" ", "."], "stream": True}, "/v1/completions")
    (last,) = [ch for c in chunks for ch in c["choices"] if ch["finish_reason"]]
    assert last["finish_reason"] == "stop" and last["stop_reason"] in (" ", ".")  # null before, as vLLM's
