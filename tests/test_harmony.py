"""GPT-OSS's harmony format in the OpenAI server: the `openai_gptoss` reasoning parser (analysis channel ->
reasoning_content, final -> content), the `openai` tool parser (messages to=functions.NAME -> tool_calls), both
whole and streamed however the text is split, the server's defaults for GPT-OSS, and the route keeping the
harmony markers (special tokens) in the text it parses, over real HTTP with the official client."""

from __future__ import annotations

import json
import random

import openai
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from keel.serve.openai.chat_output import ChatOutputs
from keel.serve.openai.child import ServerProcess
from keel.serve.openai.harmony import HarmonyReader
from keel.serve.openai.options import ServeOptions
from keel.serve.openai.reasoning_parsers import get_reasoning_parser
from keel.serve.openai.tool_parsers import get_tool_parser
from test_cli_errors import assert_one_line_error, run_keel
from tiny_models import save_hf_model

ANALYSIS = "<|channel|>analysis<|message|>The user wants the weather. I should call get_weather.<|end|>"
REPLY = ANALYSIS + "<|start|>assistant<|channel|>final<|message|>It is sunny in Paris."
CALL = ANALYSIS + (
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city": "Paris", "days": 2}'
)
# The recipient before the channel, a preamble on commentary, two calls, each ended by <|call|> but the last.
TWO_CALLS = (
    "<|channel|>commentary<|message|>Let me check both.<|end|>"
    '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Nice"}<|call|>'
    "<|start|>assistant<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{}"
)
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}},
]


def split(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


@pytest.mark.parametrize(
    ("text", "reasoning", "content"),
    [
        (REPLY, "The user wants the weather. I should call get_weather.", "It is sunny in Paris."),
        (REPLY + "<|return|>", "The user wants the weather. I should call get_weather.", "It is sunny in Paris."),
        ("<|channel|>analysis<|message|>Cut off by max_tok", "Cut off by max_tok", None),
        ("<|channel|>final<|message|>No reasoning.", None, "No reasoning."),
        ("Plain text, no harmony at all.", None, "Plain text, no harmony at all."),  # nothing lost
        (
            CALL,
            "The user wants the weather. I should call get_weather.",
            '<|start|>assistant to=functions.get_weather<|message|>{"city": "Paris", "days": 2}<|call|>',
        ),
    ],
)
def test_reasoning_parser_splits_channels_whole_and_streamed(text, reasoning, content):
    parser = get_reasoning_parser("openai_gptoss")
    assert parser.needs_special_tokens
    assert parser().extract(text) == (reasoning, content)
    rng = random.Random(0)
    for size in (1, 2, 3, 7, None):
        streaming = parser()
        pieces = split(text, rng) if size is None else [text[i : i + size] for i in range(0, len(text), size)]
        deltas = [streaming.feed(p) for p in pieces] + [streaming.finish()]
        for delta in deltas:  # a marker never leaks, whole or in part
            assert "<|" not in delta.reasoning and not delta.content.startswith(("|", "channel", "message|"))
        got = ("".join(d.reasoning for d in deltas) or None, "".join(d.content for d in deltas) or None)
        assert got == (reasoning, content), size


def test_constrained_outputs_and_reasoning_end():
    """A grammar-constrained output writes no harmony (all content at once); is_reasoning_end turns true with the
    first reply or call header, which a grammar on the reply waits for."""
    parser = get_reasoning_parser("openai_gptoss")
    assert parser(starts_in_reasoning=False).extract('{"a": 1}') == (None, '{"a": 1}')
    ends = [parser().is_reasoning_end(REPLY[:n]) for n in range(len(REPLY) + 1)]
    first = REPLY.index("<|channel|>final<|message|>") + len("<|channel|>final<|message|>")
    assert ends == [n >= first for n in range(len(REPLY) + 1)]


@pytest.mark.parametrize("text", [CALL, TWO_CALLS, REPLY])
def test_chat_message_and_stream_agree(text):
    """Through the chat route's writer (openai_gptoss, then openai): the whole message and the accumulated stream
    deltas give the same reasoning, content and calls, with finish_reason tool_calls where a call was made."""
    outputs = ChatOutputs(
        reasoning=get_reasoning_parser("openai_gptoss"),
        tool_mode="auto",
        tools=TOOLS,
        tool_parser=get_tool_parser("openai"),
    )
    message, finish = outputs.writer().message(text, "stop")
    writer, streamed = outputs.writer(), {"content": "", "reasoning": "", "calls": {}}
    pieces = split(text, random.Random(1))
    for i, piece in enumerate(pieces):
        delta = writer.delta(piece, final=i == len(pieces) - 1)
        streamed["content"] += delta.get("content", "")
        streamed["reasoning"] += delta.get("reasoning_content", "")
        for call in delta.get("tool_calls", []):
            entry = streamed["calls"].setdefault(call["index"], {"name": "", "arguments": ""})
            entry["name"] += call["function"].get("name", "")
            entry["arguments"] += call["function"].get("arguments", "")
    calls = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in message["tool_calls"]]
    assert [streamed["calls"][i] for i in sorted(streamed["calls"])] == calls
    assert (streamed["content"] or None, streamed["reasoning"] or None) == (
        message["content"],
        message["reasoning_content"],
    )
    if text is REPLY:
        assert not calls and message["content"] == "It is sunny in Paris." and finish == "stop"
    else:
        assert finish == "tool_calls" and writer.stream_finish_reason("stop") == "tool_calls"
        assert calls[0] == {
            "name": "get_weather",
            "arguments": json.dumps(
                {"city": "Paris" if text is CALL else "Nice", **({"days": 2} if text is CALL else {})}
            ),
        }
    if text is TWO_CALLS:
        assert calls[1] == {"name": "get_time", "arguments": "{}"} and message["content"] == "Let me check both."


def test_reader_gives_back_a_header_never_completed():
    reader = HarmonyReader()
    pieces = reader.feed("<|channel|>anal") + reader.finish()
    assert [(p.kind, p.text) for p in pieces] == [("header", ""), ("body", "<|channel|>anal"), ("end", "")]


def test_server_defaults_and_refusal():
    """GPT-OSS models (and the openai tool parser) get the openai_gptoss reasoning parser unless one is named;
    the openai tool parser with another reasoning parser is a one-line error."""
    options = ServeOptions()
    assert options.settings("m", architecture="gpt_oss").reasoning_parser == "openai_gptoss"
    assert options.settings("m", architecture="llama").reasoning_parser is None
    assert ServeOptions(tool_call_parser="openai").settings("m").reasoning_parser == "openai_gptoss"
    assert ServeOptions(reasoning_parser="qwen3").settings("m", architecture="gpt_oss").reasoning_parser == "qwen3"
    result = run_keel("serve", "m", "--tool-call-parser", "openai", "--reasoning-parser", "qwen3")
    assert_one_line_error(result, "--tool-call-parser openai", "qwen3")


HARMONY_SPECIALS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"]
HARMONY_TEMPLATE = (
    "{% for message in messages %}<|start|>{{ message.role }}<|message|>{{ message.content }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)


@pytest.fixture(scope="module")
def gpt_oss_server(tmp_path_factory):
    """The tiny GPT-OSS with a byte-level tokenizer whose harmony markers are special tokens, served as is."""
    path = tmp_path_factory.mktemp("harmony")
    save_hf_model("gpt_oss", path, vocab_size=264)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tokenizer = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(sorted(alphabet))}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(HARMONY_SPECIALS)
    tokenizer.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|return|>",
        "chat_template": HARMONY_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    proc = ServerProcess(str(path), "--served-model-name", "tiny", "--threads", "1", "--no-compile").wait_ready()
    yield proc, tokenizer
    proc.terminate()


def test_route_parses_the_text_with_its_markers(gpt_oss_server):
    """Over HTTP, unasked: the reply's reasoning and content are the parser's reading of the generated text with
    its special tokens kept (the tokens' own text, from logprobs). The output is drawn from the markers and two
    letters only, so markers come out often and a route that dropped them would read the text otherwise."""
    server, tokenizer = gpt_oss_server
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)
    allowed = [tokenizer.token_to_id(t) for t in HARMONY_SPECIALS if t not in ("<|return|>", "<|call|>")]
    allowed += [tokenizer.token_to_id(c) for c in "ab"]
    seen_marker = False
    for seed in range(4):
        choice = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=24,
            temperature=1.0,
            seed=seed,
            logprobs=True,
            extra_body={"allowed_token_ids": allowed, "ignore_eos": True},
        ).choices[0]
        raw = "".join(entry.token for entry in choice.logprobs.content)
        seen_marker |= "<|message|>" in raw
        reasoning, content = get_reasoning_parser("openai_gptoss")().extract(raw)
        assert (choice.message.model_extra.get("reasoning_content"), choice.message.content) == (reasoning, content)
    assert seen_marker
