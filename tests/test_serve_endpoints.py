"""vLLM's other endpoints and flags on `keel serve`: /tokenize, /detokenize, /version, /ping,
--generation-config, --chat-template, several served names, VLLM_API_KEY, and the engine flags a vLLM
user types (32k, half, --enforce-eager, -q). Real HTTP on a tiny random Llama, as tests/test_serve_http.py."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

import keel
from keel.cli import build_parser
from keel.cli.config_options import dataclass_from_args, engine_config_from_args
from keel.errors import KeelError
from keel.serve import LLM
from keel.serve.config import LoadConfig
from keel.serve.generation_config import sampling_defaults
from keel.serve.openai.chat_template import load_chat_template
from keel.serve.openai.options import ServeOptions
from keel.serve.sampling import SamplingParams
from keel.tokenizer import Tokenizer
from test_cli_errors import assert_one_line_error, run_keel
from test_serve_http import client, start_server
from tiny_models import save_byte_tokenizer, save_hf_model

CONTEXT = 256
# The model's own generation_config.json asks for greedy decoding and 5 new tokens by default.
GENERATION_CONFIG = {"temperature": 0.0, "max_new_tokens": 5}
# --chat-template's replacement: unlike the model's ChatML, and reading a chat_template_kwargs variable.
TEMPLATE = (
    "{% if greeting %}{{ greeting }}\n{% endif %}"
    "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant] {% endif %}"
)
MESSAGES = [{"role": "user", "content": "hello there"}]
KEY = "sk-from-env"
SAMPLED = dict(max_tokens=12, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("endpoints") / "llama"
    save_hf_model("llama", path, max_position_embeddings=CONTEXT)
    save_byte_tokenizer(path)
    config_path = path / "generation_config.json"  # save_pretrained wrote the token ids: add sampling fields
    config = json.loads(config_path.read_text()) if config_path.exists() else {}
    config_path.write_text(json.dumps({**config, **GENERATION_CONFIG}))
    return path


@pytest.fixture(scope="module")
def tokenizer(model_dir) -> Tokenizer:
    return Tokenizer.from_hf_dir(model_dir)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    """The model's generation config, two served names, and --chat-template from a file."""
    logs = tmp_path_factory.mktemp("endpoints-logs")
    (logs / "template.jinja").write_text(TEMPLATE)
    args = ("--served-model-name", "tiny", "alias", "--chat-template", str(logs / "template.jinja"))
    proc = start_server(model_dir, *args, log_path=logs / "server.log").wait_ready()
    yield proc
    assert proc.terminate() == 0, proc.tail(40)


@pytest.fixture(scope="module")
def plain_server(model_dir, tmp_path_factory):
    """--generation-config vllm (vLLM's defaults), a key from VLLM_API_KEY, vLLM's spellings of engine flags."""
    log = tmp_path_factory.mktemp("endpoints-logs") / "plain.log"
    flags = ("--generation-config", "vllm", "--max-model-len", "0.1k", "--enforce-eager", "--no-enable-prefix-caching")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_API_KEY", KEY)
        env.delenv("KEEL_API_KEY", raising=False)
        proc = start_server(model_dir, *flags, log_path=log)  # the child takes the environment as it starts
    yield proc.wait_ready()
    assert proc.terminate() == 0, proc.tail(40)


def post(server, path: str, body: dict, key: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(server.base_url + path, json=body, headers=headers, timeout=30)


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    return response.json()["error"]


# ---------------------------------------------------------------- /tokenize and /detokenize
def test_tokenize_a_prompt_and_detokenize_it_back(server, tokenizer):
    text = "Hello, wörld! <|im_end|>"
    r = post(server, "/tokenize", {"model": "tiny", "prompt": text, "return_token_strs": True}).json()
    assert r["tokens"] == tokenizer.encode(text) and r["count"] == len(r["tokens"]) > 0
    assert r["max_model_len"] == CONTEXT
    assert r["token_strs"] == [tokenizer.tokenizer.id_to_token(t) for t in r["tokens"]]
    assert "<|im_end|>" in r["token_strs"] and "Ã" in r["token_strs"]  # byte-level pieces, as vLLM's strings
    bare = post(server, "/tokenize", {"prompt": text}).json()  # no model: the served one; no strings asked
    assert bare["tokens"] == r["tokens"] and bare["token_strs"] is None
    back = post(server, "/detokenize", {"model": "alias", "tokens": r["tokens"]})
    assert back.json() == {"prompt": text}  # special tokens kept, as vLLM decodes them


def test_tokenize_messages_renders_what_the_chat_route_prompts(server, tokenizer):
    """--chat-template is the template of /tokenize and of /v1/chat/completions alike."""
    want = "[user] hello there\n[assistant] "
    r = post(server, "/tokenize", {"messages": MESSAGES}).json()
    assert tokenizer.decode(r["tokens"], skip_special_tokens=False) == want
    assert r["tokens"] == tokenizer.encode(want, add_special_tokens=False) and r["count"] == len(want)
    r = post(server, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False}).json()
    assert tokenizer.decode(r["tokens"]) == "[user] hello there\n"
    body = {"messages": MESSAGES, "chat_template_kwargs": {"greeting": "hi!"}, "return_token_strs": True}
    r = post(server, "/tokenize", body).json()
    assert tokenizer.decode(r["tokens"]) == "hi!\n" + want and len(r["token_strs"]) == r["count"]
    chat = client(server).chat.completions.create(model="tiny", messages=MESSAGES, max_completion_tokens=2)
    assert chat.usage.prompt_tokens == len(want)


def test_tokenize_errors_name_the_field(server):
    e = error_of(post(server, "/tokenize", {"model": "gpt-4", "prompt": "x"}), 404)
    assert e["param"] == "model" and e["type"] == "not_found_error" and "'tiny', 'alias'" in e["message"]
    assert error_of(post(server, "/detokenize", {"model": "gpt-4", "tokens": [1]}), 404)["param"] == "model"
    e = error_of(post(server, "/detokenize", {"tokens": [65, 256]}), 400)
    assert e["param"] == "tokens" and "256" in e["message"]
    assert error_of(post(server, "/detokenize", {"tokens": [-1]}), 400)["param"] == "tokens.0"
    assert error_of(post(server, "/tokenize", {"model": "tiny"}), 400)["param"] == "prompt"
    assert error_of(post(server, "/tokenize", {"prompt": "x", "messages": MESSAGES}), 400)["param"] == "messages"
    assert error_of(post(server, "/tokenize", {"messages": []}), 400)["param"] == "messages"
    both = {"messages": MESSAGES, "continue_final_message": True}  # with add_generation_prompt's default true
    assert error_of(post(server, "/tokenize", both), 400)["param"] == "continue_final_message"
    r = httpx.post(server.base_url + "/tokenize", content=b"{nope", headers={"content-type": "application/json"})
    assert error_of(r, 400)["type"] == "invalid_request_error"


def test_chat_content_parts_text_joined_and_other_parts_refused_by_name(server, tokenizer):
    """Text parts joined by newlines, as vLLM joins them for templates that take a string."""
    parts = [{"type": "text", "text": "hello"}, {"type": "text", "text": "there"}]
    joined = post(server, "/tokenize", {"messages": [{"role": "user", "content": parts}]}).json()
    text = {"messages": [{"role": "user", "content": "hello\nthere"}]}
    assert joined["tokens"] == post(server, "/tokenize", text).json()["tokens"]
    image = {"type": "image_url", "image_url": {"url": "http://example.com/a.png"}}
    body = {"model": "tiny", "messages": [{"role": "user", "content": [parts[0], image]}], "max_tokens": 1}
    e = error_of(post(server, "/v1/chat/completions", body), 400)
    assert e["param"] == "messages.0.content" and "part 1 has type 'image_url'" in e["message"]
    assert "text only" in e["message"]


def test_version_and_ping(server):
    assert httpx.get(server.base_url + "/version").json() == {"version": keel.__version__}
    for method in ("GET", "POST"):
        r = httpx.request(method, server.base_url + "/ping")
        assert r.status_code == 200 and r.content == b""


# ---------------------------------------------------------------- --served-model-name A B
def test_every_served_name_is_accepted_and_listed(server, model_dir):
    c = client(server)
    listed = c.models.list().data
    assert [m.id for m in listed] == ["tiny", "alias"]
    assert time.time() - 3600 < listed[0].created <= time.time()  # when the server started, not 0
    card = httpx.get(server.base_url + "/v1/models").json()["data"][1]  # vLLM's card: what it serves, no parent
    assert card["root"] == str(model_dir) and card["parent"] is None and card["max_model_len"] == CONTEXT
    assert card["permission"][0]["object"] == "model_permission"
    assert c.models.retrieve("alias").id == "alias"  # OpenAI's retrieve, each served name
    with pytest.raises(openai.NotFoundError) as missing:
        c.models.retrieve("tin")
    assert missing.value.body["code"] == "model_not_found"
    r = c.completions.create(model="alias", prompt="hi", max_tokens=2)
    assert r.model == "tiny" and r.usage.completion_tokens <= 2  # vLLM's responses name the first
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(model="tin", messages=MESSAGES, max_tokens=1)
    for unnamed in ({}, {"model": None}, {"model": ""}):  # vLLM's: no name is the served model
        r = httpx.post(server.base_url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1, **unnamed})
        assert r.status_code == 200 and r.json()["model"] == "tiny", r.text


# ---------------------------------------------------------------- --generation-config
def texts(c: openai.OpenAI, seeds=(1, 2, 3), **kw) -> set[str]:
    return {c.completions.create(model="tiny", prompt="seeded", seed=s, **SAMPLED, **kw).choices[0].text for s in seeds}


def test_the_models_generation_config_sets_the_defaults_a_request_omits(server):
    c = client(server)
    assert len(texts(c)) == 1  # temperature 0 from the file: every seed gives the greedy text
    assert len(texts(c, temperature=1.0)) > 1  # the request's own temperature wins
    chat = c.chat.completions.create(model="tiny", messages=MESSAGES, extra_body={"ignore_eos": True})
    assert chat.usage.completion_tokens == GENERATION_CONFIG["max_new_tokens"]  # max_new_tokens as max_tokens
    chat = c.chat.completions.create(
        model="tiny", messages=MESSAGES, max_completion_tokens=7, extra_body={"ignore_eos": True}
    )
    assert chat.usage.completion_tokens == 7
    log = server.log_path.read_text()
    assert "default sampling params from the model's generation_config.json: temperature=0.0, max_tokens=5" in log


def test_generation_config_vllm_ignores_the_file(plain_server):
    c = client(plain_server, KEY)
    assert len(texts(c)) > 1  # vLLM's default temperature 1
    chat = c.chat.completions.create(model="tiny", messages=MESSAGES, extra_body={"ignore_eos": True})
    prompt = chat.usage.prompt_tokens
    assert chat.usage.completion_tokens == 100 - prompt  # the rest of --max-model-len 0.1k, not the file's 5
    assert c.models.list().data[0].max_model_len == 100
    assert "default sampling params" not in plain_server.log_path.read_text()


def test_llm_takes_its_defaults_from_the_generation_config(model_dir):
    assert LLM(str(model_dir), num_blocks=32).get_default_sampling_params() == SamplingParams(
        temperature=0.0, max_tokens=5
    )
    assert (
        LLM(str(model_dir), num_blocks=32, generation_config="vllm").get_default_sampling_params() == SamplingParams()
    )


# In make test-slow (13 s on the 2-core AVX2 machine), to keep make test within its budget.
@pytest.mark.slow
def test_bad_generation_config_is_one_line_naming_file_and_field(model_dir, tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": 0, "temperature": "hot"}))
    with pytest.raises(KeelError, match="generation_config.json: temperature must be a number"):
        sampling_defaults(model_dir, str(tmp_path))
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": 0}))
    with pytest.raises(KeelError, match=r"generation_config.json: top_p must be in \(0, 1\], got 0"):
        sampling_defaults(model_dir, str(tmp_path / "generation_config.json"))
    assert sampling_defaults(model_dir, "vllm") == {} and sampling_defaults(tmp_path / "none", "auto") == {}
    result = run_keel("serve", str(model_dir), "--generation-config", str(tmp_path))
    assert_one_line_error(result, str(tmp_path / "generation_config.json"), "top_p")
    missing = run_keel("serve", str(model_dir), "--chat-template", str(tmp_path / "absent.jinja"))
    assert_one_line_error(missing, "--chat-template", "absent.jinja")


def test_chat_template_from_a_file_or_inline_checked_before_loading(tmp_path):
    (tmp_path / "t.jinja").write_text(TEMPLATE)
    assert load_chat_template(str(tmp_path / "t.jinja")) == TEMPLATE and load_chat_template(None) is None
    assert load_chat_template("{{ messages[0]['content'] }}\\n") == "{{ messages[0]['content'] }}\n"  # vLLM's
    with pytest.raises(KeelError, match=r"--chat-template \(inline\): chat template: syntax error at line 1"):
        load_chat_template("{% for m in messages %}")
    (tmp_path / "bad.jinja").write_text("ok\n{{ unclosed")
    with pytest.raises(KeelError, match="bad.jinja: chat template: syntax error at line 2"):
        load_chat_template(str(tmp_path / "bad.jinja"))


# ---------------------------------------------------------------- API key from the environment
def test_vllm_api_key_from_the_environment_is_enforced(plain_server):
    with pytest.raises(openai.AuthenticationError):
        client(plain_server, "wrong").completions.create(model="tiny", prompt="hi", max_tokens=1)
    assert error_of(post(plain_server, "/tokenize", {"prompt": "hi"}), 401)["type"] == "authentication_error"
    assert post(plain_server, "/tokenize", {"prompt": "hi"}, key=KEY).json()["count"] == 2
    assert httpx.get(plain_server.base_url + "/ping").status_code == 200  # probes need no key


def test_api_keys_from_flags_or_environment(monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", "a")
    monkeypatch.setenv("KEEL_API_KEY", "b")
    assert ServeOptions().api_keys() == ["a", "b"]
    assert ServeOptions(api_key=["flag"]).api_keys() == ["flag"]  # a flag replaces the environment
    assert ServeOptions(api_keys_file="keys.toml").api_keys() == []  # so does a keys file (tenants and limits)
    monkeypatch.delenv("VLLM_API_KEY")
    monkeypatch.setenv("KEEL_API_KEY", "")
    assert ServeOptions().api_keys() == []


# ---------------------------------------------------------------- the flags a vLLM user types
def parse(*argv: str, command: str = "serve"):
    args = build_parser().parse_args([command, "m", *argv])
    return args, engine_config_from_args(args)


def test_vllm_spellings_of_engine_flags():
    for text, want in (
        ("32k", 32000),
        ("32K", 32768),
        ("25.6k", 25600),
        ("1m", 10**6),
        ("2M", 2 * 2**20),
        ("4096", 4096),
        ("auto", -1),  # vLLM's: fit the KV cache (tests/test_serve_engine.py)
        ("-1", -1),
    ):
        assert parse("--max-model-len", text)[1].scheduler.max_model_len == want
    assert parse("--max-num-batched-tokens", "8k")[1].scheduler.max_num_batched_tokens == 8000
    for bad in ("1.5K", "32q", "k"):
        with pytest.raises(SystemExit):
            parse("--max-model-len", bad)
    assert parse("--dtype", "half")[1].load.dtype == "float16"
    assert parse("--dtype", "float")[1].load.dtype == "float32"
    assert parse("--dtype", "bfloat16")[1].load.dtype == "bfloat16" and parse()[1].load.dtype == "auto"
    ppl = build_parser().parse_args(["eval", "ppl", "m", "--corpus", "c", "--dtype", "half"])
    assert ppl.dtype == "float16"
    assert parse("--enable-prefix-caching")[1].cache.enable_prefix_caching is True
    assert parse("--no-enable-prefix-caching")[1].cache.enable_prefix_caching is False
    assert parse("--enforce-eager")[1].load.compile is False and parse()[1].load.compile is None
    assert parse("--compile")[1].load.compile is True
    # a `vllm serve` command line's flags that change nothing here are taken (and --seed seeds unseeded draws)
    vllm_line = (
        "--trust-remote-code",
        "--disable-log-requests",
        "--disable-log-stats",
        "--uvicorn-log-level",
        "warning",
    )
    args = parse(*vllm_line, "--max-log-len", "100", "--enable-prompt-tokens-details", "--seed", "0")[0]
    assert (
        dataclass_from_args(ServeOptions, args).seed == 0 and dataclass_from_args(ServeOptions, parse()[0]).seed is None
    )
    assert parse("-q", "gguf")[1].quant.quantize == "gguf"
    assert parse("--quantization", "gguf", "--quantize", "gguf")[1].quant.quantize == "gguf"
    with pytest.raises(KeelError, match="--quantization gguf means --quantize gguf, not --quantize int8"):
        parse("-q", "gguf", "--quantize", "int8")
    options = dataclass_from_args(ServeOptions, parse("--served-model-name", "a", "b")[0])
    assert options.settings("m").served_model_names == ("a", "b") and options.settings("m").served_model_name == "a"
    assert dataclass_from_args(ServeOptions, parse()[0]).settings("dir/m").served_model_names == ("dir/m",)
    assert dataclass_from_args(ServeOptions, parse()[0]).host == "127.0.0.1"  # loopback: docs/SERVING.md says why
    # the engine options keel generate and keel eval share take the same spellings
    args, config = parse("--prompt", "x", "--dtype", "half", "--enforce-eager", "-q", "gguf", command="generate")
    assert (config.load.dtype, config.load.compile, config.quant.quantize) == ("float16", False, "gguf")
    args = build_parser().parse_args(["eval", "run", "m", "--dtype", "float", "--max-model-len", "1K"])
    config = engine_config_from_args(args)
    assert config.load.dtype == "float32" and config.scheduler.max_model_len == 1024
    assert LoadConfig(dtype="half").dtype == "float16"  # keel.LLM(model, dtype="half") as vLLM's LLM


def test_quantization_keel_does_not_run_is_one_line():
    assert_one_line_error(run_keel("serve", "m", "-q", "awq"), "--quantization awq", "gguf", "int8")


def test_parser_flags_are_checked_before_loading():
    """An unknown parser name, or auto tool choice without a parser, is one line at start-up (not a failure
    of the first request that needs it)."""
    assert_one_line_error(run_keel("serve", "m", "--tool-call-parser", "nope"), "--tool-call-parser", "hermes")
    assert_one_line_error(run_keel("serve", "m", "--reasoning-parser", "nope"), "--reasoning-parser", "deepseek_r1")
    assert_one_line_error(run_keel("serve", "m", "--enable-auto-tool-choice"), "--tool-call-parser")
    assert_one_line_error(run_keel("serve", "m", "--allowed-origins", "[1]"), "--allowed-origins", "JSON list")
    assert_one_line_error(run_keel("serve", "m", "--seed", str(2**64)), "--seed", "64-bit")
