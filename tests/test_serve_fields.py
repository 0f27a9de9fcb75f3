"""Every request field of vLLM's OpenAI server is honoured or refused, never silently dropped.

The field lists are vLLM's `ChatCompletionRequest` and `CompletionRequest` (vllm/entrypoints/openai/protocol.py,
the OpenAI fields and vLLM's sampling and extra parameters). Each field is in exactly one class here:
- honoured: a request with the field gives a result that shows it (a behavioural check against the same
  request without it);
- refused: a 400 whose `param` names the field;
- no effect: fields that do not change what is generated (`user`, ...): the greedy answer is the one
  without the field.
A field vLLM adds later fails the completeness test until it is classed.
"""

from __future__ import annotations

import json
import re
import threading
import time

import httpx
import pytest

from keel.serve.openai.child import ServerProcess

MODEL = "smol"
CHAT_FIELDS = """messages model frequency_penalty logit_bias logprobs top_logprobs max_tokens max_completion_tokens n
presence_penalty response_format seed stop stream stream_options temperature top_p tools tool_choice
reasoning_effort include_reasoning parallel_tool_calls user best_of use_beam_search top_k min_p
repetition_penalty length_penalty stop_token_ids include_stop_str_in_output ignore_eos min_tokens
skip_special_tokens spaces_between_special_tokens truncate_prompt_tokens prompt_logprobs allowed_token_ids
bad_words echo add_generation_prompt continue_final_message add_special_tokens documents chat_template
chat_template_kwargs mm_processor_kwargs guided_json guided_regex guided_choice guided_grammar structural_tag
guided_decoding_backend guided_whitespace_pattern priority request_id logits_processors
return_tokens_as_token_ids cache_salt kv_transfer_params vllm_xargs""".split()
COMPLETION_FIELDS = """model prompt prompt_embeds best_of echo frequency_penalty logit_bias logprobs max_tokens n
presence_penalty seed stop stream stream_options suffix temperature top_p user use_beam_search top_k min_p
repetition_penalty length_penalty stop_token_ids include_stop_str_in_output ignore_eos min_tokens
skip_special_tokens spaces_between_special_tokens truncate_prompt_tokens allowed_token_ids prompt_logprobs
add_special_tokens response_format guided_json guided_regex guided_choice guided_grammar guided_decoding_backend
guided_whitespace_pattern priority request_id logits_processors return_tokens_as_token_ids cache_salt
kv_transfer_params vllm_xargs""".split()

# The template renders the variables some fields set, so their effect shows in the prompt's length.
TEMPLATE = """{%- if documents %}<|im_start|>system
{% for d in documents %}{{ d.title }}: {{ d.text }}
{% endfor %}<|im_end|>
{% endif %}{%- if reasoning_effort %}<|im_start|>system
Reasoning: {{ reasoning_effort }}<|im_end|>
{% endif %}{%- if persona %}<|im_start|>system
You are {{ persona }}.<|im_end|>
{% endif %}{%- if tools %}<|im_start|>system
Tools: {% for tool in tools %}{{ tool.function.name }} {% endfor %}<|im_end|>
{% endif %}{%- for message in messages %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endfor %}{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

ASK = [{"role": "user", "content": "Write the word hello five times."}]
# A long answer, whose tokens repeat (penalties show), and a short one that ends with EOS.
STORY_CHAT = {"messages": [{"role": "user", "content": "Tell a long story about a cat and a dog."}]}
STORY = {"prompt": "Once upon a time, a cat and a dog"}
SHORT = {"prompt": "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"}
# The same question as a chat: its greedy answer ends with EOS within 24 tokens in float32 and in bf16 (the
# auto dtype where bf16 matmul is native), where the base question's answer can repeat "hello" instead.
SHORT_CHAT = {"messages": [{"role": "user", "content": "What is 2+2?"}]}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}},
            "required": ["city"],
        },
    },
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("fields")
    (root / "t.jinja").write_text(TEMPLATE)
    args = ["--served-model-name", MODEL, "--threads", "1", "--no-compile", "--chat-template", str(root / "t.jinja")]
    args += ["--reasoning-parser", "qwen3", "--scheduling-policy", "priority", "--max-num-seqs", "1"]
    proc = ServerProcess("smollm2-135m-instruct", *args, log_path=root / "server.log").wait_ready()
    yield proc
    proc.terminate()


class Api:
    def __init__(self, server: ServerProcess, route: str) -> None:
        self.url = server.base_url + route
        self.route = route

    def base(self) -> dict:
        if self.route.endswith("chat/completions"):
            return {"model": MODEL, "messages": ASK, "max_tokens": 8, "temperature": 0.0}
        return {"model": MODEL, "prompt": "Write the word hello five times:", "max_tokens": 8, "temperature": 0.0}

    def post(self, **fields) -> httpx.Response:
        return httpx.post(self.url, json={**self.base(), **fields}, timeout=60)

    def ok(self, **fields) -> dict:
        r = self.post(**fields)
        assert r.status_code == 200, (fields, r.text)
        return r.json()

    def stream(self, **fields) -> list[dict]:
        with httpx.stream("POST", self.url, json={**self.base(), **fields, "stream": True}, timeout=60) as r:
            assert r.status_code == 200
            lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "[DONE]"
        return [json.loads(line) for line in lines[:-1]]


def text_of(body: dict) -> str:
    choice = body["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def texts(body: dict) -> list[str]:
    return [c["message"]["content"] if "message" in c else c["text"] for c in body["choices"]]


def streamed_text(chunks: list[dict]) -> str:
    out = ""
    for c in chunks:
        for choice in c["choices"]:
            out += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
    return out


# ------------------------------------------------------------------ the classes
REFUSED = {
    "prompt_embeds": "AAAA",
    "suffix": " the end",
    "use_beam_search": True,
    "length_penalty": 2.0,
    "spaces_between_special_tokens": False,
    "chat_template": "{{ messages }}",
    "mm_processor_kwargs": {"size": 1},
    "structural_tag": '{"structures": []}',
    "guided_whitespace_pattern": " *",
    "logits_processors": ["my.Processor"],
    "return_tokens_as_token_ids": True,
    "cache_salt": "salt",
    "kv_transfer_params": {"x": 1},
    "vllm_xargs": {"x": 1},
}
NO_EFFECT = {
    "user": "someone",
    "model": MODEL,
    # vLLM ignores it too ("the model determines the behavior"); keel honours `false` where it can (tool calls)
    "parallel_tool_calls": True,
}


_BASELINES: dict[str, dict] = {}


def _baseline(api: Api) -> dict:
    """The greedy answer without any field (per route and server)."""
    key = api.url
    if key not in _BASELINES:
        _BASELINES[key] = api.ok()
    return _BASELINES[key]


def check(api: Api, field: str, baseline: dict) -> None:  # noqa: C901, PLR0912, PLR0915 - one case per field
    """The behavioural check of one honoured field."""
    chat = api.route.endswith("chat/completions")
    base_text = text_of(baseline)
    prompt_tokens = baseline["usage"]["prompt_tokens"]
    if field in ("frequency_penalty", "presence_penalty", "repetition_penalty"):
        story = {"max_tokens": 16, **(STORY_CHAT if chat else STORY)}
        value = 3.0 if field == "repetition_penalty" else 2.0
        assert text_of(api.ok(**{field: value}, **story)) != text_of(api.ok(**story))
    elif field == "logit_bias":
        body = api.ok(logit_bias={"28120": 100}, max_tokens=3)  # " hello" in SmolLM2's vocabulary
        assert text_of(body) == "hello" * 3 or text_of(body) == " hello" * 3, text_of(body)
    elif field == "logprobs":
        body = api.ok(logprobs=True if chat else 2)
        assert body["choices"][0]["logprobs"] is not None
    elif field == "top_logprobs":
        body = api.ok(logprobs=True, top_logprobs=3)
        assert all(len(t["top_logprobs"]) == 3 for t in body["choices"][0]["logprobs"]["content"])
    elif field in ("max_tokens", "max_completion_tokens"):
        assert api.ok(**{field: 3})["usage"]["completion_tokens"] == 3
    elif field == "n":
        assert len(api.ok(n=2, temperature=1.0)["choices"]) == 2
        # vLLM's rule: n copies of one greedy answer are a 400 naming n
        assert api.post(n=2).json()["error"] == {
            "message": "n must be 1 when using greedy sampling, got 2.",
            "type": "invalid_request_error",
            "param": "n",
            "code": None,
        }
    elif field == "best_of":
        assert len(api.ok(best_of=2, n=2, temperature=1.0)["choices"]) == 2
        assert api.post(best_of=3, n=1).json()["error"]["param"] == "best_of"
    elif field == "seed":
        a, b = (api.ok(seed=7, temperature=1.5, max_tokens=16) for _ in range(2))
        assert text_of(a) == text_of(b) and text_of(a) != text_of(api.ok(seed=8, temperature=1.5, max_tokens=16))
    elif field == "temperature":
        assert any(
            text_of(api.ok(temperature=2.0, seed=s, max_tokens=16)) != text_of(api.ok(max_tokens=16)) for s in (1, 2)
        )
    elif field == "top_p":
        assert text_of(api.ok(temperature=1.0, top_p=1e-6, seed=3)) == base_text
    elif field == "top_k":
        assert text_of(api.ok(temperature=1.0, top_k=1, seed=3)) == base_text
    elif field == "min_p":
        assert text_of(api.ok(temperature=1.0, min_p=1.0, seed=3)) == base_text
    elif field == "stop":
        word = base_text.split()[1]
        assert word not in text_of(api.ok(stop=[word]))
    elif field == "stop_token_ids":
        assert api.ok(stop_token_ids=[28120], logit_bias={"28120": 100})["usage"]["completion_tokens"] == 1
    elif field == "include_stop_str_in_output":
        word = base_text.split()[1]
        assert text_of(api.ok(stop=[word], include_stop_str_in_output=True)).endswith(word)
    elif field in ("ignore_eos", "min_tokens", "skip_special_tokens"):
        short = {"max_tokens": 24, **(SHORT_CHAT if chat else SHORT)}
        free = api.ok(**short)
        ended = free["choices"][0]["finish_reason"] == "stop"
        assert ended, "the baseline answer must end with EOS within 24 tokens"
        n = free["usage"]["completion_tokens"]
        if field == "ignore_eos":
            assert api.ok(ignore_eos=True, **short)["usage"]["completion_tokens"] == 24
        elif field == "min_tokens":
            assert api.ok(min_tokens=n + 5, **short)["usage"]["completion_tokens"] >= n + 5
        else:
            assert "<|im_end|>" in text_of(api.ok(ignore_eos=True, skip_special_tokens=False, **short))
    elif field == "stream":
        assert streamed_text(api.stream()) == base_text
    elif field == "stream_options":
        chunks = api.stream(stream_options={"include_usage": True, "continuous_usage_stats": True})
        assert chunks[-1]["usage"]["completion_tokens"] == baseline["usage"]["completion_tokens"]
        assert all("usage" in c for c in chunks)
        # every chunk: the tokens generated so far (vLLM's running count), rising to the total
        running = [c["usage"]["completion_tokens"] for c in chunks[:-1]]
        assert running == sorted(running) and 0 < running[-1] == chunks[-1]["usage"]["completion_tokens"]
        assert len(set(running)) > 2
        assert all(c["usage"]["prompt_tokens"] == baseline["usage"]["prompt_tokens"] for c in chunks)
        # include_usage false: no usage at all (vLLM sends continuous usage only beside the final one)
        off = {"include_usage": False, "continuous_usage_stats": True}
        assert not any("usage" in c for c in api.stream(stream_options=off))
        # vLLM's StreamOptions default include_usage to true: continuous_usage_stats alone brings both
        assert all("usage" in c for c in api.stream(stream_options={"continuous_usage_stats": True}))
    elif field == "response_format":
        ask = [{"role": "user", "content": "Give a JSON object with the key ok set to true."}]
        body = api.ok(response_format={"type": "json_object"}, max_tokens=60, **({"messages": ask} if chat else {}))
        text = text_of(body)
        assert text.lstrip().startswith("{") and not base_text.lstrip().startswith("{")
        if body["choices"][0]["finish_reason"] == "stop":
            assert isinstance(json.loads(text), dict)
    elif field in ("tools", "tool_choice"):
        body = api.ok(
            tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=30
        )
        assert body["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
        assert body["usage"]["prompt_tokens"] > prompt_tokens  # the template lists the tools
    elif field == "reasoning_effort":
        assert api.ok(reasoning_effort="high")["usage"]["prompt_tokens"] > prompt_tokens
    elif field == "documents":
        assert api.ok(documents=[{"title": "A", "text": "B"}])["usage"]["prompt_tokens"] > prompt_tokens
    elif field == "chat_template_kwargs":
        assert api.ok(chat_template_kwargs={"persona": "a pirate"})["usage"]["prompt_tokens"] > prompt_tokens
    elif field == "include_reasoning":
        regex = {"guided_regex": "<think>[a-z]{3}</think>[a-z]{3}", "max_tokens": 12}
        assert "reasoning_content" in api.ok(**regex)["choices"][0]["message"]
        assert "reasoning_content" not in api.ok(include_reasoning=False, **regex)["choices"][0]["message"]
    elif field == "truncate_prompt_tokens":
        assert api.ok(truncate_prompt_tokens=4)["usage"]["prompt_tokens"] == 4
    elif field == "prompt_logprobs":
        body = api.ok(prompt_logprobs=1)
        entries = body["prompt_logprobs"] if chat else body["choices"][0]["prompt_logprobs"]
        assert len(entries) == prompt_tokens and entries[0] is None and all(entries[1:])
    elif field == "allowed_token_ids":
        assert text_of(api.ok(allowed_token_ids=[28120], max_tokens=3)) == "hello" * 3
    elif field == "bad_words":
        assert "hello" in base_text.lower()
        assert "hello" not in text_of(api.ok(bad_words=["hello", "Hello"])).lower()
    elif field == "echo":
        if chat:
            prefix = "Sure: hello"
            messages = ASK + [{"role": "assistant", "content": prefix}]
            body = api.ok(messages=messages, echo=True, add_generation_prompt=False, continue_final_message=True)
            assert text_of(body).startswith(prefix) and len(text_of(body)) > len(prefix)
        else:
            assert text_of(api.ok(echo=True)) == api.base()["prompt"] + base_text
    elif field == "add_generation_prompt":
        assert api.ok(add_generation_prompt=False)["usage"]["prompt_tokens"] < prompt_tokens
    elif field == "continue_final_message":
        messages = ASK + [{"role": "assistant", "content": "hello hello"}]
        body = api.ok(messages=messages, add_generation_prompt=False, continue_final_message=True)
        plain = api.ok(messages=messages)
        assert body["usage"]["prompt_tokens"] < plain["usage"]["prompt_tokens"]  # no end of turn, no new turn
        assert (
            api.post(messages=messages, continue_final_message=True).json()["error"]["param"]
            == "continue_final_message"
        )
    elif field == "add_special_tokens":
        # SmolLM2's tokenizer adds no special tokens; tests/test_serve_chat_render.py checks the flag reaches
        # the tokenizer. Here: accepted either way with the same prompt length.
        assert api.ok(add_special_tokens=not chat)["usage"]["prompt_tokens"] == prompt_tokens
    elif field in ("guided_json", "guided_regex", "guided_choice", "guided_grammar"):
        value = {
            "guided_json": {
                "type": "object",
                "properties": {"a": {"type": "integer", "maximum": 999}},
                "required": ["a"],
                "additionalProperties": False,
            },
            "guided_regex": "[0-9]{3}-[a-z]{2}",
            "guided_choice": ["left", "right"],
            "guided_grammar": 'root ::= "n=" [0-9] [0-9]?',
        }[field]
        text = text_of(api.ok(**{field: value}, max_tokens=20))
        if field == "guided_json":
            assert set(json.loads(text)) == {"a"}
        elif field == "guided_choice":
            assert text in value
        else:
            assert re.fullmatch({"guided_regex": "[0-9]{3}-[a-z]{2}", "guided_grammar": "n=[0-9]{1,2}"}[field], text)
    elif field == "guided_decoding_backend":
        assert text_of(api.ok(guided_decoding_backend="xgrammar", guided_choice=["up"])) == "up"
        assert api.post(guided_decoding_backend="outlines", guided_choice=["up"]).json()["error"]["param"] == field
    elif field == "request_id":
        assert api.ok(request_id="my-request-1")["id"].endswith("my-request-1")
    elif field == "priority":
        check_priority(api)
    else:
        raise AssertionError(f"no check for {field}")


def check_priority(api: Api) -> None:
    """--max-num-seqs 1 runs one request at a time: while a long one runs, a priority -5 request sent after
    a priority 5 one finishes first (lower runs first, vLLM's convention)."""
    finished: list[str] = []

    def run(name: str, **fields) -> None:
        api.ok(**fields)
        finished.append(name)

    # Long enough to outlast both arrivals (0.5 s) at any decode speed this suite meets (the GGUF blocks decode
    # ~100 tokens/s on one thread: 40 tokens ended before the urgent request came, then the low one ran first).
    long = threading.Thread(target=run, args=("long",), kwargs={"max_tokens": 300, "ignore_eos": True})
    long.start()
    time.sleep(0.3)
    late = threading.Thread(target=run, args=("low",), kwargs={"priority": 5})
    late.start()
    time.sleep(0.2)
    urgent = threading.Thread(target=run, args=("high",), kwargs={"priority": -5})
    urgent.start()
    for t in (long, late, urgent):
        t.join()
    assert finished.index("high") < finished.index("low"), finished


HONOURED_CHAT = sorted(set(CHAT_FIELDS) - set(REFUSED) - set(NO_EFFECT) - {"messages"})
HONOURED_COMPLETION = sorted(set(COMPLETION_FIELDS) - set(REFUSED) - set(NO_EFFECT) - {"prompt"})


def test_every_vllm_field_is_classed():
    for fields in (CHAT_FIELDS, COMPLETION_FIELDS):
        assert len(fields) == len(set(fields))
    classed = set(REFUSED) | set(NO_EFFECT) | set(HONOURED_CHAT) | set(HONOURED_COMPLETION) | {"messages", "prompt"}
    assert set(CHAT_FIELDS) | set(COMPLETION_FIELDS) <= classed


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
def test_refused_fields_are_400s_naming_them(server, route):
    api = Api(server, route)
    fields = CHAT_FIELDS if "chat" in route else COMPLETION_FIELDS
    for field, value in REFUSED.items():
        if field not in fields:
            continue
        r = api.post(**{field: value})
        assert r.status_code == 400, (field, r.text)
        assert r.json()["error"]["param"] == field, (field, r.json())


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
def test_fields_without_effect_keep_the_answer(server, route):
    api = Api(server, route)
    baseline = text_of(_baseline(api))
    for field, value in NO_EFFECT.items():
        assert text_of(api.ok(**{field: value})) == baseline, field


@pytest.mark.parametrize("field", HONOURED_CHAT)
def test_chat_field_is_honoured(server, field):
    api = Api(server, "/v1/chat/completions")
    check(api, field, _baseline(api))


# Completion fields that go through the same code as chat's (the shared sampling fields and constraints)
# run in `make test-slow`; the ones with completion-specific handling run in `make test`.
COMPLETION_SPECIFIC = {
    "echo",
    "add_special_tokens",
    "prompt_logprobs",
    "logprobs",
    "stream",
    "truncate_prompt_tokens",
    "best_of",
    "n",
    "max_tokens",
    "response_format",
    "guided_json",
    "request_id",
    "priority",
}


@pytest.mark.parametrize(
    "field",
    [f if f in COMPLETION_SPECIFIC else pytest.param(f, marks=pytest.mark.slow) for f in HONOURED_COMPLETION],
)
def test_completion_field_is_honoured(server, field):
    if field in ("tools", "tool_choice", "include_reasoning", "reasoning_effort", "documents"):
        pytest.fail(f"{field} is a chat field")
    api = Api(server, "/v1/completions")
    check(api, field, _baseline(api))
