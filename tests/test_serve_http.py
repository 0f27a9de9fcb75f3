"""`keel serve` over real HTTP with the official openai client, on a tiny random Llama."""

from __future__ import annotations

import asyncio
import json
import random
import signal
import string
import threading
import time

import httpx
import openai
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from keel.quant.loading import load_model
from keel.serve import LLM, SamplingParams
from keel.serve.openai.child import ServerProcess
from tiny_models import save_byte_tokenizer, save_hf_model

CONTEXT = 8192  # long enough that one request can outlive a short deadline


def start_server(model_dir, *args: str, log_path) -> ServerProcess:
    """The served name the tests send, and one thread: the other core is the clients'."""
    return ServerProcess(model_dir, "--served-model-name", "tiny", "--threads", "1", *args, log_path=log_path)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("http") / "llama"
    save_hf_model("llama", path, max_position_embeddings=CONTEXT)
    save_byte_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def reference(model_dir):
    """Solo outputs: one request at a time in-process (max_num_seqs=1)."""
    llm = LLM(str(model_dir), num_blocks=1024, max_num_seqs=1)

    def run(prompt, max_tokens: int, **kw) -> str:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)
        return llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].text

    run.tokenizer = llm.engine.tokenizer
    return run


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "server.log"
    proc = start_server(model_dir, "--num-blocks", "2048", "--max-tokens-cap", "8000", log_path=log).wait_ready()
    yield proc
    assert proc.terminate() == 0, proc.tail(40)


def client(server: ServerProcess, key: str = "none", **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=key, max_retries=0, **kw)


def metrics(server: ServerProcess) -> dict[tuple[str, tuple], float]:
    """Every sample as {(name, sorted labels): value}, parsed by prometheus_client's parser."""
    text = httpx.get(server.base_url + "/metrics").text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("model", "model_name"))))] = (
                s.value
            )
    return out


def metric(samples: dict, name: str, **labels) -> float:
    return sum(v for (n, lab), v in samples.items() if n == name and all((k, v2) in lab for k, v2 in labels.items()))


GREEDY = dict(temperature=0, extra_body={"ignore_eos": True})
GREEDY_BODY = {"temperature": 0, "ignore_eos": True}  # the same, in a raw body


# ---------------------------------------------------------------- the official client
def test_completions_match_engine_streamed_or_not(server, reference):
    c = client(server)
    want = reference("The quick brown fox", 12)
    r = c.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=12, **GREEDY)
    assert r.choices[0].text == want and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 12
    assert r.usage.prompt_tokens == len(reference.tokenizer.encode("The quick brown fox"))
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12 and r.object == "text_completion" and r.created > 0

    chunks = list(
        c.completions.create(
            model="tiny",
            prompt="The quick brown fox",
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == want
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 12 and not chunks[-1].choices
    assert len({ch.id for ch in chunks}) == 1

    ids = reference.tokenizer.encode("token ids")  # prompt as token ids, and echo
    r = c.completions.create(model="tiny", prompt=ids, max_tokens=5, echo=True, **GREEDY)
    assert r.choices[0].text == "token ids" + reference(ids, 5)
    r = c.completions.create(model="tiny", prompt=["one", "two"], max_tokens=4, **GREEDY)  # a batch of prompts
    assert [ch.text for ch in sorted(r.choices, key=lambda ch: ch.index)] == [reference("one", 4), reference("two", 4)]


def test_chat_streamed_and_not(server, reference):
    c = client(server)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    want = reference(reference.tokenizer.encode_chat(messages), 9)
    r = c.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=9, **GREEDY)
    assert r.choices[0].message.content == want and r.choices[0].message.role == "assistant"
    assert r.usage.completion_tokens == 9 and r.choices[0].finish_reason == "length"
    stream = c.chat.completions.create(
        model="tiny", messages=messages, max_tokens=9, stream=True, stream_options={"include_usage": True}, **GREEDY
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == want
    assert chunks[-1].usage.completion_tokens == 9 and chunks[-1].usage.prompt_tokens == r.usage.prompt_tokens
    # The system prompt's blocks were cached by the first request.
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0
    models = c.models.list()
    assert [m.id for m in models.data] == ["tiny"]


def test_stop_strings_logprobs_seed_and_n(server, reference):
    c = client(server)
    full = reference("stop here", 24)
    stop = full[10:12]
    r = c.completions.create(model="tiny", prompt="stop here", max_tokens=24, stop=[stop], **GREEDY)
    assert r.choices[0].text == full[: full.index(stop)] and r.choices[0].finish_reason == "stop"
    assert stop not in r.choices[0].text
    streamed = c.completions.create(model="tiny", prompt="stop here", max_tokens=24, stop=stop, stream=True, **GREEDY)
    assert "".join(ch.choices[0].text for ch in streamed if ch.choices) == r.choices[0].text

    r = c.completions.create(model="tiny", prompt="logprobs", max_tokens=6, logprobs=3, **GREEDY)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert chosen <= 0 and 3 <= len(top) <= 4 and chosen == pytest.approx(max(top.values()))  # greedy = argmax
    chat = c.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_completion_tokens=5,
        logprobs=True,
        top_logprobs=2,
        **GREEDY,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 5 and all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)
    assert "".join(t.token for t in content) == chat.choices[0].message.content

    sampled = dict(model="tiny", prompt="seeded", max_tokens=16, temperature=1.0, extra_body={"ignore_eos": True})
    a = c.completions.create(seed=1234, **sampled).choices[0].text
    b = c.completions.create(seed=1234, **sampled).choices[0].text
    other = [c.completions.create(seed=s, **sampled).choices[0].text for s in (1, 2, 3)]
    assert a == b and any(o != a for o in other)

    r = c.completions.create(n=3, seed=7, **sampled)
    assert sorted(ch.index for ch in r.choices) == [0, 1, 2]
    assert r.usage.completion_tokens == 48 and len({ch.text for ch in r.choices}) > 1
    again = c.completions.create(n=3, seed=7, **sampled)
    assert [ch.text for ch in sorted(again.choices, key=lambda ch: ch.index)] == [
        ch.text for ch in sorted(r.choices, key=lambda ch: ch.index)
    ]


def test_64_concurrent_streams_equal_solo(server, reference):
    prompts = [f"request {i}: " + "abcdefgh"[: i % 8] for i in range(64)]
    lengths = [8 + (i * 7) % 25 for i in range(64)]

    async def one(c: openai.AsyncOpenAI, prompt: str, n: int) -> tuple[str, str | None]:
        stream = await c.completions.create(model="tiny", prompt=prompt, max_tokens=n, stream=True, **GREEDY)
        text, finish = "", None
        async for chunk in stream:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        return text, finish

    async def main():
        async with openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0) as c:
            return await asyncio.gather(*(one(c, p, n) for p, n in zip(prompts, lengths, strict=True)))

    results = asyncio.run(main())
    for prompt, n, (text, finish) in zip(prompts, lengths, results, strict=True):
        assert finish == "length" and text == reference(prompt, n), prompt


# ---------------------------------------------------------------- echo: scoring prompts (lm-eval's loglikelihood)
@pytest.fixture(scope="module")
def direct_prompt_logprobs(model_dir):
    """Each prompt token's logprob given its prefix, from one full float32 forward (the first: None)."""
    model = load_model(str(model_dir), "float32").model

    @torch.inference_mode()
    def run(ids: list[int]) -> list[float | None]:
        logprobs = model(torch.tensor([ids]))[0].float().log_softmax(-1)
        return [None] + [logprobs[i - 1, t].item() for i, t in enumerate(ids) if i > 0]

    return run


def check_echoed(choice, ids: list[int], want: list[float | None], generated: int, decode) -> None:
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(ids) + generated
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # no prefix: null, as OpenAI and vLLM
    assert lp.token_logprobs[1 : len(ids)] == pytest.approx(want[1:], abs=1e-4)
    for chosen, top in zip(lp.token_logprobs[1:], lp.top_logprobs[1:], strict=True):
        assert 2 <= len(top) <= 3 and max(top.values()) >= chosen  # the top 2, and the prompt's token
    assert choice.text.startswith(decode(ids)) and choice.finish_reason == "length"


def test_echo_logprobs_of_token_id_prompts_batched_and_max_tokens_0(server, reference, direct_prompt_logprobs):
    """What lm-eval's local-completions sends (token ids, echo, logprobs, max_tokens 1, a list of
    prompts per request) and its max_tokens 0 form: prompt logprobs equal to a direct computation,
    also for a prompt longer than one prefill chunk (--max-num-batched-tokens 2048)."""
    c = client(server)
    rng = random.Random(0)
    texts = ["".join(rng.choice(string.ascii_letters + " .,") for _ in range(n)) for n in (1, 7, 40, 2500)]
    prompts = [reference.tokenizer.encode(text) for text in texts]  # one token per character
    assert [len(ids) for ids in prompts] == [1, 7, 40, 2500]
    want = [direct_prompt_logprobs(ids) for ids in prompts]
    decode = reference.tokenizer.decode
    lm_eval = dict(model="tiny", prompt=prompts, echo=True, logprobs=2, temperature=0, seed=1234)
    r = c.completions.create(max_tokens=1, **lm_eval)
    choices = sorted(r.choices, key=lambda ch: ch.index)
    assert [ch.index for ch in choices] == [0, 1, 2, 3]
    for choice, ids, lps in zip(choices, prompts, want, strict=True):
        check_echoed(choice, ids, lps, 1, decode)
    assert r.usage.prompt_tokens == sum(map(len, prompts)) and r.usage.completion_tokens == 4

    r = c.completions.create(max_tokens=0, **lm_eval)  # score the prompts only: nothing generated
    choices = sorted(r.choices, key=lambda ch: ch.index)
    for choice, ids, lps in zip(choices, prompts, want, strict=True):
        check_echoed(choice, ids, lps, 0, decode)
    assert [ch.text for ch in choices] == texts
    assert r.usage.completion_tokens == 0 and r.usage.total_tokens == r.usage.prompt_tokens == sum(map(len, prompts))

    chunks = list(
        c.completions.create(
            model="tiny",
            prompt="score me",
            max_tokens=0,
            echo=True,
            logprobs=1,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == "score me"
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    streamed = [t for ch in chunks if ch.choices and ch.choices[0].logprobs for t in ch.choices[0].logprobs.tokens]
    assert "".join(streamed) == "score me" and chunks[-1].usage.completion_tokens == 0
    r = c.completions.create(model="tiny", prompt="no logprobs", max_tokens=0, echo=True)
    assert r.choices[0].text == "no logprobs" and r.choices[0].logprobs is None

    with pytest.raises(openai.BadRequestError) as e:  # nothing to return without echo
        c.completions.create(model="tiny", prompt="x", max_tokens=0)
    assert "max_tokens" in e.value.message and e.value.body["param"] == "max_tokens"


def test_completion_text_offsets_index_the_text(server):
    """`text_offset`: where each token starts in the returned text, whole or streamed (a stream's offsets run on
    across its chunks), counting characters of the text, not of the "bytes:\\x.." names of tokens that hold part
    of a character (this byte-level vocabulary spells each of "é" and "日本" in several such tokens)."""
    c = client(server)
    prompt = "Le café 日本 ok"
    request = dict(model="tiny", prompt=prompt, max_tokens=6, echo=True, logprobs=0, temperature=0)
    request["extra_body"] = {"ignore_eos": True}
    whole = c.completions.create(**request).choices[0]
    offsets, tokens = whole.logprobs.text_offset, whole.logprobs.tokens
    assert any(t.startswith("bytes:") for t in tokens) and whole.text.startswith(prompt)
    steps = [b - a for a, b in zip(offsets, offsets[1:], strict=False)]
    for token, offset, step in zip(tokens, offsets, steps, strict=False):
        if token.startswith("bytes:"):  # part of a character: at most the one character it completes
            assert step in (0, 1), (token, step)
        elif offset < len(prompt):  # the echoed prompt: each whole token at its place
            assert prompt[offset : offset + len(token)] == token and step == len(token)
    assert offsets[-6] == len(prompt)  # the first generated token starts right after the prompt
    streamed = [
        o for chunk in c.completions.create(stream=True, **request) for o in chunk.choices[0].logprobs.text_offset
    ]
    assert streamed == offsets


# ---------------------------------------------------------------- errors and validation
def test_bad_requests_are_4xx_with_openai_errors(server):
    c = client(server)
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="tiny", prompt="x", max_tokens=10, temperature=-1)
    assert "temperature" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="tiny", prompt="x" * 300, max_tokens=8000, **GREEDY)
    assert "300" in e.value.message and "8000" in e.value.message and str(CONTEXT) in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="tiny", prompt="x", max_tokens=8001)  # over --max-tokens-cap
    assert "8000" in e.value.message
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="gpt-4", prompt="x", max_tokens=1)
    with pytest.raises(openai.BadRequestError):
        c.completions.create(model="tiny", prompt=[999999], max_tokens=1)
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model="tiny", messages=[], max_tokens=1)
    url = server.base_url + "/v1/completions"
    r = httpx.post(url, content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(url, content=b"x" * (5 * 2**20))
    assert r.status_code == 413 and "limit" in r.json()["error"]["message"]


def test_logprob_and_stream_rules_as_vllm_takes_them(server):
    """vLLM's rules: top_logprobs 0 (none) needs no logprobs and prompt_logprobs 0 streams, larger values do not;
    stream_options needs stream; an output too long for the model names the field the client sent."""
    chat = server.base_url + "/v1/chat/completions"
    completions = server.base_url + "/v1/completions"
    hi = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert httpx.post(chat, json={**hi, "top_logprobs": 0}).status_code == 200
    r = httpx.post(chat, json={**hi, "top_logprobs": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"
    prompt = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
    assert httpx.post(completions, json={**prompt, "stream": True, "prompt_logprobs": 0}).status_code == 200
    r = httpx.post(completions, json={**prompt, "stream": True, "prompt_logprobs": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"
    for url, body in ((chat, hi), (completions, prompt)):
        r = httpx.post(url, json={**body, "stream_options": {"include_usage": True}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options"
    for field in ("max_tokens", "max_completion_tokens"):
        r = httpx.post(chat, json={"model": "tiny", "messages": hi["messages"], field: CONTEXT})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def test_context_length_errors_read_as_openai_and_vllm_word_them(server):
    """Clients (LiteLLM, LangChain, agents that trim history) tell a prompt that does not fit from other 400s by
    OpenAI's wording, "This model's maximum context length is N tokens", or its code context_length_exceeded."""
    c = client(server)
    for ask in (
        lambda: c.completions.create(model="tiny", prompt="x" * (CONTEXT + 5), max_tokens=1),
        lambda: c.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "x" * 300}], max_tokens=8000
        ),
    ):
        with pytest.raises(openai.BadRequestError) as e:
            ask()
        assert f"This model's maximum context length is {CONTEXT} tokens" in e.value.message
        assert e.value.code == "context_length_exceeded"


def test_x_request_id_names_the_response_and_is_echoed(server):
    """vLLM's: a client's X-Request-Id header is the completion's id (chatcmpl-<id>, streamed or not, before the
    body's request_id); keel echoes the header back, as vLLM does with --enable-request-id-headers."""
    c = client(server)
    hi = [{"role": "user", "content": "hi"}]
    raw = c.chat.completions.with_raw_response.create(
        model="tiny",
        messages=hi,
        max_tokens=2,
        extra_headers={"X-Request-Id": "trace-7"},
        extra_body={"request_id": "b"},
    )
    assert raw.headers["x-request-id"] == "trace-7" and raw.parse().id == "chatcmpl-trace-7"
    stream = c.completions.create(
        model="tiny", prompt="hi", max_tokens=2, stream=True, extra_headers={"X-Request-Id": "trace-8"}
    )
    assert {chunk.id for chunk in stream} == {"cmpl-trace-8"}
    plain = c.chat.completions.with_raw_response.create(model="tiny", messages=hi, max_tokens=2)
    assert "x-request-id" not in plain.headers and len(plain.parse().id) > len("chatcmpl-")


def test_explicit_nulls_mean_the_defaults(server):
    """OpenAI's and vLLM's optional fields are nullable: clients that serialise their whole request type send
    `"n": null`, `"stream": null`, `"logprobs": null`; each means the default. (Fields that take null keep it:
    completions' `max_tokens: null` is the rest of the context, not 16.)"""
    nulls = {"n": None, "stream": None, "logprobs": None, "echo": None, "temperature": None, "stop": None}
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "seed": None}
    r = httpx.post(server.base_url + "/v1/chat/completions", json={**chat, **nulls, "top_logprobs": None})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 1 and r.json()["choices"][0]["logprobs"] is None
    r = httpx.post(
        server.base_url + "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 3, **nulls}
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 3, r.text
    r = httpx.post(server.base_url + "/v1/chat/completions", json={**chat, "messages": None})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


def test_sampling_bounds_are_vllms(server):
    """vLLM takes any temperature >= 0 (OpenAI stops at 2) and clamps a logit bias to [-100, 100] rather than
    refusing it: a bias of 1000 forces its token as 100 does."""
    c = client(server)
    hot = c.completions.create(model="tiny", prompt="hi", max_tokens=2, temperature=2.5, seed=1)
    assert hot.usage.completion_tokens <= 2
    forced = [
        c.completions.create(model="tiny", prompt="hi", max_tokens=3, logit_bias={"65": b}, **GREEDY)
        for b in (100, 1000)
    ]
    text = forced[0].choices[0].text
    assert text == forced[1].choices[0].text and len(text) == 3 and len(set(text)) == 1, text
    with pytest.raises(openai.BadRequestError):
        c.completions.create(model="tiny", prompt="hi", max_tokens=2, temperature=-0.5)
    url = server.base_url + "/v1/completions"
    for field, value in (("logit_bias", {"999999": 1}), ("stop_token_ids", [999999]), ("allowed_token_ids", [999999])):
        r = httpx.post(url, json={"model": "tiny", "prompt": "hi", "max_tokens": 2, field: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def test_stream_options_default_to_usage_as_vllms(server):
    """vLLM's StreamOptions: include_usage defaults to true once stream_options is given, so `{}` or
    `{"continuous_usage_stats": true}` alone bring the usage chunk (and usage in every chunk with the latter)."""
    url = server.base_url + "/v1/completions"
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 3, "stream": True, **GREEDY_BODY}

    def chunks(options) -> list[dict]:
        with httpx.stream("POST", url, json={**body, "stream_options": options}) as r:
            lines = [line[len("data: ") :] for line in r.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "[DONE]"
        return [json.loads(line) for line in lines[:-1]]

    final = chunks({})[-1]
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 3
    every = chunks({"continuous_usage_stats": True})
    assert all("usage" in c for c in every) and every[-1]["choices"] == []
    assert all("usage" not in c for c in chunks({"include_usage": False}))
    assert all("usage" not in c for c in chunks({"include_usage": None}))


def test_cors_preflight_and_headers_as_vllm_defaults(server):
    """vLLM answers browsers from any origin by default (--allowed-origins '["*"]'): a preflight is a 200 that
    allows the method and headers asked for, and responses carry Access-Control-Allow-Origin."""
    url = server.base_url + "/v1/chat/completions"
    origin = {"Origin": "http://localhost:3000"}
    asked = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"}
    r = httpx.options(url, headers={**origin, **asked})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
    assert "POST" in r.headers["access-control-allow-methods"]
    assert "authorization" in r.headers["access-control-allow-headers"]
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    r = httpx.post(url, json=body, headers=origin)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"


def test_cors_and_request_id_flags():
    from keel.errors import KeelError
    from keel.serve.openai.options import ServeOptions

    settings = ServeOptions(
        allowed_origins=['["https://a.example", "https://b.example"]'], enable_request_id_headers=True
    ).settings("m")
    assert settings.cors.allowed_origins == ["https://a.example", "https://b.example"]
    assert settings.cors.allowed_methods == ["*"] and settings.request_id_headers
    assert ServeOptions(allowed_origins=["https://a.example"]).settings("m").cors.allowed_origins == [
        "https://a.example"
    ]
    with pytest.raises(KeelError, match="JSON list"):
        ServeOptions(allowed_origins=["[1, 2]"]).settings("m")


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)
FIELDS = [
    "model",
    "prompt",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "n",
    "stop",
    "seed",
    "logprobs",
    "echo",
    "stream",
    "ignore_eos",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "stop_token_ids",
    "messages",
    "max_completion_tokens",
    "top_logprobs",
    "stream_options",
    "min_tokens",
]
SMALL_VALID = {
    "model": st.just("tiny"),
    "prompt": st.just("hi"),
    "max_tokens": st.integers(-2, 4),
    "messages": st.just([{"role": "user", "content": "hi"}]),
}


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    endpoint=st.sampled_from(["completions", "chat/completions"]),
    body=st.dictionaries(
        st.sampled_from(FIELDS), st.one_of(JSON_VALUES, st.integers(-3, 5), st.floats(-3, 3)), max_size=6
    ),
    base=st.fixed_dictionaries({}, optional=SMALL_VALID),
)
def test_fuzzed_bodies_never_500_never_hang(server, endpoint, body, base):
    payload = {**base, **body}
    if payload.get("max_tokens") is None and payload.get("max_completion_tokens") is None:
        # The default is the rest of the 8192-token context: greedy on a random model (no EOS), 30 s here.
        payload["max_tokens"] = 8
    if isinstance(payload.get("max_tokens"), int) and payload["max_tokens"] > 8:
        payload["max_tokens"] = 8  # keep the valid ones quick
    payload.pop("max_completion_tokens", None) if not isinstance(payload.get("max_completion_tokens"), int) else None
    if isinstance(payload.get("max_completion_tokens"), int):
        payload["max_completion_tokens"] = min(payload["max_completion_tokens"], 8)
    if isinstance(payload.get("n"), int):
        payload["n"] = min(payload["n"], 3)
    r = httpx.post(f"{server.base_url}/v1/{endpoint}", content=json.dumps(payload, allow_nan=True), timeout=30)
    assert r.status_code in (200, 400, 404), (payload, r.status_code, r.text)
    if r.status_code != 200:
        error = r.json()["error"]
        assert error["message"] and error["type"]


# ---------------------------------------------------------------- metrics, disconnects
def test_metrics_parse_and_move(server):
    before = metrics(server)
    c = client(server)
    r = c.completions.create(model="tiny", prompt="count me", max_tokens=7, **GREEDY)
    after = metrics(server)
    delta = lambda name, **lab: metric(after, name, **lab) - metric(before, name, **lab)  # noqa: E731
    assert delta("vllm:request_success_total", finished_reason="length") == 1
    assert delta("keel:tenant_request_success_total", finished_reason="length", tenant="anonymous") == 1
    assert delta("vllm:generation_tokens_total") == 7
    assert delta("keel:tenant_generation_tokens_total", tenant="anonymous") == 7
    assert delta("vllm:prompt_tokens_total") == r.usage.prompt_tokens
    assert delta("keel:tenant_prompt_tokens_total", tenant="anonymous") == r.usage.prompt_tokens
    assert delta("vllm:time_to_first_token_seconds_count") == 1
    assert delta("vllm:inter_token_latency_seconds_count") == 6
    assert delta("vllm:e2e_request_latency_seconds_count") == 1
    assert delta("vllm:request_queue_time_seconds_count") == 1
    assert delta("vllm:prefix_cache_queries_total") == r.usage.prompt_tokens
    for gauge in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert any(n == gauge for n, _ in after), gauge
    assert any(n == "vllm:num_preemptions_total" for n, _ in after)


def wait_idle(server: ServerProcess, timeout: float = 10.0) -> dict:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        m = metrics(server)
        if metric(m, "vllm:num_requests_running") == 0 and metric(m, "vllm:kv_cache_usage_perc") == 0:
            return m
        time.sleep(0.05)
    raise AssertionError(f"server not idle after {timeout} s")


def test_disconnected_stream_is_aborted_and_frees_blocks(server):
    before = wait_idle(server)
    body = {"model": "tiny", "prompt": "long", "max_tokens": 6000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        got = [line for line in (next(lines) for _ in range(6)) if line.startswith("data:")]
        assert got
        busy = metrics(server)
        assert metric(busy, "vllm:kv_cache_usage_perc") > 0 and metric(busy, "vllm:num_requests_running") == 1
    start = time.monotonic()
    after = wait_idle(server)  # the abort reached the engine and its blocks are back
    assert time.monotonic() - start < 10  # the request alone would run for minutes; slack for a loaded machine
    aborted = metric(after, "vllm:request_success_total", finished_reason="abort") - metric(
        before, "vllm:request_success_total", finished_reason="abort"
    )
    assert aborted == 1
    assert metric(after, "vllm:generation_tokens_total") - metric(before, "vllm:generation_tokens_total") < 6000


# ---------------------------------------------------------------- keys, tenants, limits, deadline
@pytest.fixture(scope="module")
def limited(model_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("limited")
    (d / "keys.toml").write_text(
        '[[keys]]\nkey = "key-a"\ntenant = "a"\nmax_concurrent = 1\nmax_queued = 0\n'
        '[[keys]]\nkey = "key-b"\ntenant = "b"\ntokens_per_minute = 60\n'
        '[[keys]]\nkey = "key-c"\ntenant = "c"\n'
    )
    proc = start_server(
        model_dir,
        "--num-blocks",
        "2048",
        "--api-keys-file",
        str(d / "keys.toml"),
        "--max-num-seqs",
        "1",
        "--max-queue",
        "2",
        "--request-timeout",
        "2",
        "--enable-force-include-usage",
        "--enable-request-id-headers",
        log_path=d / "server.log",
    ).wait_ready()
    yield proc
    assert proc.terminate() == 0, proc.tail(40)


def long_stream(server: ServerProcess, key: str, started: threading.Event, lines: list) -> None:
    body = {"model": "tiny", "prompt": "hold", "max_tokens": 6000, "ignore_eos": True, "stream": True}
    headers = {"Authorization": f"Bearer {key}"}
    with httpx.stream("POST", server.base_url + "/v1/completions", json=body, headers=headers, timeout=30) as r:
        for line in r.iter_lines():
            started.set()
            lines.append(line)


def test_api_keys(limited):
    with pytest.raises(openai.AuthenticationError):
        client(limited, "wrong").completions.create(model="tiny", prompt="x", max_tokens=1)
    r = httpx.post(limited.base_url + "/v1/completions", json={"model": "tiny", "prompt": "x"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert client(limited, "key-c").completions.create(model="tiny", prompt="x", max_tokens=2).usage.completion_tokens
    assert httpx.get(limited.base_url + "/health").status_code == 200  # health and metrics need no key


def test_forced_usage_and_request_id_headers(limited):
    """vLLM's --enable-force-include-usage: a stream that did not ask for usage still ends with it;
    --enable-request-id-headers: every response carries an X-Request-Id, a new one where the client sent none."""
    c = client(limited, "key-c")
    chunks = list(c.completions.create(model="tiny", prompt="x", max_tokens=2, stream=True))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 2
    raw = c.completions.with_raw_response.create(model="tiny", prompt="x", max_tokens=1)
    given = raw.headers["x-request-id"]
    assert len(given) >= 16 and raw.parse().id.startswith("cmpl-")
    assert len(httpx.get(limited.base_url + "/health").headers["x-request-id"]) >= 16


def test_tenant_limits_429_with_retry_after(limited):
    url = limited.base_url + "/v1/completions"
    # b: 60 tokens per minute; a request that needs more is refused, and the bucket drains.
    r = httpx.post(url, json={"prompt": "x" * 10, "max_tokens": 100}, headers={"Authorization": "Bearer key-b"})
    assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1
    # ignore_eos: a request that stops early is refunded its unused tokens, which would refill the bucket.
    body = {"prompt": "x", "max_tokens": 40, "ignore_eos": True}
    ok = httpx.post(url, json=body, headers={"Authorization": "Bearer key-b"})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 40
    r = httpx.post(url, json=body, headers={"Authorization": "Bearer key-b"})
    assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"
    assert 1 <= int(r.headers["Retry-After"]) <= 60
    # a: one request at a time, none queued.
    started, lines = threading.Event(), []
    holder = threading.Thread(target=long_stream, args=(limited, "key-a", started, lines))
    holder.start()
    assert started.wait(10)
    r = httpx.post(url, json={"prompt": "x", "max_tokens": 1}, headers={"Authorization": "Bearer key-a"})
    assert r.status_code == 429 and r.headers["Retry-After"] == "1"
    # c has its own limits: not blocked by a.
    holder.join(30)
    assert any("deadline" in line for line in lines)  # the 2 s deadline ended the 6000-token stream


def test_full_queue_is_503_at_once(limited):
    """max_num_seqs 1 and max_queue 2: one running, two waiting, the next is refused at once. The three
    hold the queue only until the 2 s request deadline: on a loaded machine the probe can come after
    they expired, so the scenario runs up to 3 times and one probe must meet a full queue."""
    outcomes = []
    for _ in range(3):
        threads = [
            threading.Thread(target=long_stream, args=(limited, "key-c", threading.Event(), [])) for _ in range(3)
        ]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 5
        while metric(metrics(limited), "vllm:num_requests_waiting") < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        r = httpx.post(
            limited.base_url + "/v1/completions",
            json={"prompt": "x", "max_tokens": 1},
            headers={"Authorization": "Bearer key-c"},
        )
        for t in threads:
            t.join(30)
        outcomes.append(r.status_code)
        if r.status_code == 503:
            # Refused at admission, not queued: a queued request would have run once a holder's deadline
            # freed the slot (a 200). No time bound: on a loaded machine the answer took 1.6 s.
            assert "queue is full (2 waiting, limit 2)" in r.json()["error"]["message"]
            break
    assert outcomes[-1] == 503, outcomes


def test_request_larger_than_the_queue_is_400_not_503(limited):
    """n x prompts over --max-queue can never be admitted: a 400 naming the limit, not a retryable 503."""
    body = {"model": "tiny", "prompt": ["x", "y"], "n": 2, "max_tokens": 1}
    r = httpx.post(limited.base_url + "/v1/completions", json=body, headers={"Authorization": "Bearer key-c"})
    assert r.status_code == 400, r.text
    assert "4 sequences" in r.json()["error"]["message"] and "--max-queue" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "n"
    body = {"model": "tiny", "prompt": ["x", "y", "z", "w"], "max_tokens": 1}  # n 1: the prompts are too many
    r = httpx.post(limited.base_url + "/v1/completions", json=body, headers={"Authorization": "Bearer key-c"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    body = {"model": "tiny", "prompt": ["x", "y"], "max_tokens": 1}  # 2 fit
    r = httpx.post(limited.base_url + "/v1/completions", json=body, headers={"Authorization": "Bearer key-c"})
    assert r.status_code == 200, r.text


def test_deadline_aborts_and_frees_blocks(limited):
    wait_idle(limited)
    start = time.monotonic()
    r = httpx.post(
        limited.base_url + "/v1/completions",
        json={"prompt": "x", "max_tokens": 8000, "ignore_eos": True},
        headers={"Authorization": "Bearer key-c"},
        timeout=30,
    )
    assert r.status_code == 504 and "deadline" in r.json()["error"]["message"]
    assert 1.9 < time.monotonic() - start < 15  # the request alone runs for minutes; slack for a loaded machine
    wait_idle(limited)


# ---------------------------------------------------------------- SIGTERM
def test_sigterm_finishes_accepted_requests_and_exits_0(model_dir, tmp_path):
    proc = start_server(
        model_dir, "--num-blocks", "2048", "--shutdown-timeout", "30", log_path=tmp_path / "server.log"
    ).wait_ready()
    results: list = [None] * 4
    tokens = 400  # each request: hundreds of decode steps still to run when SIGTERM arrives

    def call(i: int) -> None:
        body = {"prompt": f"r{i}", "max_tokens": tokens, "ignore_eos": True}
        results[i] = httpx.post(proc.base_url + "/v1/completions", json=body, timeout=60)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 5
    while (running := metric(metrics(proc), "vllm:num_requests_running")) < 4 and time.monotonic() < deadline:
        time.sleep(0.02)
    code = proc.terminate(timeout=60)
    for t in threads:
        t.join(60)
    assert running == 4, proc.tail(40)  # all four accepted and mid-generation when the signal came
    assert code == 0, proc.tail(40)
    for r in results:
        assert r is not None and r.status_code == 200, proc.tail(40)
        assert r.json()["usage"]["completion_tokens"] == tokens
    with pytest.raises(httpx.ConnectError):
        httpx.get(proc.base_url + "/health")


def test_sigterm_past_the_shutdown_timeout_answers_503_without_tracebacks(model_dir, tmp_path):
    """Requests still running when --shutdown-timeout passes end with a 503 (a stream: its error event, then
    [DONE]) instead of tasks cancelled under them (a 500, a cut stream, a traceback each in the log)."""
    (tmp_path / "keys.toml").write_text('[[keys]]\nkey = "k"\ntenant = "t"\nmax_concurrent = 2\nmax_queued = 1\n')
    proc = start_server(
        model_dir,
        *("--num-blocks", "2048", "--shutdown-timeout", "1", "--api-keys-file", str(tmp_path / "keys.toml")),
        log_path=tmp_path / "server.log",
    ).wait_ready()
    body = {"prompt": "hold", "max_tokens": 6000, "ignore_eos": True}
    auth = {"Authorization": "Bearer k"}
    plain: list = []
    queued: list = []  # waits for the tenant's slot: gets a 503 too, not a start once a slot frees
    stream_lines: list[str] = []
    started = threading.Event()

    def post(into: list) -> None:
        into.append(httpx.post(proc.base_url + "/v1/completions", json=body, headers=auth, timeout=60))

    def stream() -> None:
        json_body = {**body, "stream": True}
        with httpx.stream("POST", proc.base_url + "/v1/completions", json=json_body, headers=auth, timeout=60) as r:
            for line in r.iter_lines():
                started.set()
                stream_lines.append(line)

    threads = [threading.Thread(target=post, args=(plain,)), threading.Thread(target=stream)]
    for t in threads:
        t.start()
    assert started.wait(10)
    deadline = time.monotonic() + 5
    while metric(metrics(proc), "vllm:num_requests_running") < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    threads.append(threading.Thread(target=post, args=(queued,)))
    threads[-1].start()
    time.sleep(0.5)  # it reaches the tenant's queue (no gauge shows it)
    code = proc.terminate(timeout=30)
    for t in threads:
        t.join(30)
    log = proc.log_path.read_text()
    assert code == 0 and "Traceback" not in log, proc.tail(40)
    assert plain and plain[0].status_code == 503, proc.tail(40)
    assert "--shutdown-timeout 1 s" in plain[0].json()["error"]["message"]
    assert queued and queued[0].status_code == 503, proc.tail(40)
    events = [line for line in stream_lines if line.startswith("data:")]
    assert events[-1] == "data: [DONE]" and "shutting down" in events[-2], events[-3:]
    # The audit line of the cut stream counts the tokens it sent (one a chunk here: the byte tokenizer).
    audit = [json.loads(line.split("keel.audit: ", 1)[1]) for line in log.splitlines() if "keel.audit: {" in line]
    cut = [a for a in audit if a.get("stream") and a["status"] == 503]
    assert len(cut) == 1 and cut[0]["completion_tokens"] >= len(events) - 3 > 0, cut


def test_second_sigint_answers_the_running_requests_before_quitting(model_dir, tmp_path):
    """Ctrl+C twice (uvicorn's force quit) during a long drain: the request still running gets a 503 at once,
    not a 500 from a task cancelled under it."""
    proc = start_server(
        model_dir, "--num-blocks", "2048", "--shutdown-timeout", "60", log_path=tmp_path / "server.log"
    ).wait_ready()
    answers: list = []
    body = {"prompt": "hold", "max_tokens": 6000, "ignore_eos": True}
    thread = threading.Thread(
        target=lambda: answers.append(httpx.post(proc.base_url + "/v1/completions", json=body, timeout=60))
    )
    thread.start()
    deadline = time.monotonic() + 5
    while metric(metrics(proc), "vllm:num_requests_running") < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.proc.send_signal(signal.SIGINT)
    time.sleep(0.5)  # the drain has begun
    proc.proc.send_signal(signal.SIGINT)
    code = proc.terminate(timeout=30)
    thread.join(30)
    assert code == 130, proc.tail(40)  # interrupted, as keel reports Ctrl+C
    assert answers and answers[0].status_code == 503, proc.tail(40)
    assert "forced to quit" in answers[0].json()["error"]["message"]


# ---------------------------------------------------------------- keel bench serve against keel serve
def test_bench_serve_against_keel_serve(server, tmp_path, capsys):
    from keel.cli import main

    result = tmp_path / "result.json"
    code = main(
        [
            "bench",
            "serve",
            "--base-url",
            server.base_url,
            "--model",
            "tiny",
            "--num-prompts",
            "8",
            "--input-len",
            "16",
            "--output-len",
            "8",
            "--ignore-eos",
            "--goodput",
            "ttft:60000",
            "--result-file",
            str(result),
            "--disable-tqdm",
        ]
    )
    assert code == 0
    data = json.loads(result.read_text())
    assert data["completed"] == 8 and data["failed"] == 0 and data["total_output_tokens"] == 64
    assert data["output_lens"] == [8] * 8 and all(t > 0 for t in data["ttfts"])
    assert data["request_goodput"] == pytest.approx(data["request_throughput"])  # a 60 s TTFT SLO: all meet it
    assert "Output token throughput" in capsys.readouterr().out


def test_speculative_server_streams_plain_greedy_text_and_counts_drafts(model_dir, reference, tmp_path):
    """n-gram speculation behind the API: the streamed text is the plain greedy text, the drafts show
    in the spec_decode metrics."""
    spec = '{"method": "ngram", "num_speculative_tokens": 3}'
    proc = start_server(model_dir, "--num-blocks", "600", "--speculative-config", spec, log_path=tmp_path / "log")
    proc.wait_ready()
    try:
        prompt = "abcabcabcabcabc"
        stream = client(proc).completions.create(model="tiny", prompt=prompt, max_tokens=24, stream=True, **GREEDY)
        text = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
        assert text == reference(prompt, 24)
        m = metrics(proc)
        drafted = metric(m, "vllm:spec_decode_num_draft_tokens_total")
        accepted = metric(m, "vllm:spec_decode_num_accepted_tokens_total")
        assert drafted > 0 and 0 <= accepted <= drafted
        assert 0 < metric(m, "vllm:spec_decode_num_drafts_total") <= drafted  # a verification holds 1..k drafts
        assert metric(m, "vllm:spec_decode_num_accepted_tokens_per_pos_total") == accepted
    finally:
        assert proc.terminate() == 0, proc.tail(40)
