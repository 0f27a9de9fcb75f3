"""The options of `keel serve` beyond the engine's: the HTTP server's, and the model source.

Each field's docstring is its command-line help (keel.cli derives the options from the fields).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Literal

from keel.errors import KeelError
from keel.serve.openai.settings import CorsSettings, ServerSettings

# Environment variables holding an API key, when no --api-key or --api-keys-file is given: vLLM's, and keel's own.
API_KEY_ENV = ("VLLM_API_KEY", "KEEL_API_KEY")


@dataclass
class ServeOptions:
    """The HTTP server"""

    host: str = "127.0.0.1"
    """bind address (loopback by default, unlike vLLM: keel serves without a key unless given one; 0.0.0.0 for
    all interfaces)"""

    port: int = 8000
    """TCP port"""

    served_model_name: list[str] = field(default_factory=list, metadata={"nargs": "+", "metavar": "NAME"})
    """the model ids clients may send, e.g. --served-model-name A B (default: MODEL); responses and /metrics
    name the first"""

    api_key: list[str] = field(default_factory=list, metadata={"metavar": "KEY"})
    """accept this Bearer key (tenant 'default', no limits); repeatable; without it and --api-keys-file: the
    VLLM_API_KEY or KEEL_API_KEY environment variable"""

    api_keys_file: str | None = field(default=None, metadata={"metavar": "F"})
    """TOML/JSON keys with tenants and limits"""

    max_queue: int = 256
    """accepted requests waiting to run, over all tenants; beyond it: 503"""

    request_timeout: float = 600.0
    """seconds a request may spend queued + generating (0: no deadline)"""

    max_tokens_cap: int | None = None
    """largest max_tokens a request may ask for"""

    max_body_bytes: int = 4 * 2**20
    """request body size limit"""

    shutdown_timeout: float = 30.0
    """on SIGTERM, seconds to let in-flight requests finish before aborting them"""

    audit_log: str | None = field(default=None, metadata={"metavar": "FILE"})
    """append audit lines here (default: stderr)"""

    audit_prompts: bool = False
    """include prompt token ids in audit lines"""

    engine: Literal["keel", "naive"] = "keel"
    """naive: transformers, one request at a time (a benchmark baseline)"""

    threads: int | None = None
    """torch CPU threads"""

    seed: int | None = None
    """vLLM's: seed the random draws of requests that give no seed of their own (default: unseeded)"""

    auto_parallel: str | None = field(default=None, metadata={"nargs": "?", "const": "local", "metavar": "COUNTxTYPE"})
    """take tp and pp from `keel plan serve` for this machine's GPUs (or the given cluster, e.g. 8xH200)"""

    enable_auto_tool_choice: bool = False
    """let the model decide when to call tools (tool_choice auto, the default with tools): needs --tool-call-parser"""

    tool_call_parser: str | None = field(default=None, metadata={"metavar": "NAME"})
    """how tool calls are read from the model's text: hermes (also Qwen2.5/Qwen3), llama3_json, qwen3_coder, mistral"""

    reasoning_parser: str | None = field(default=None, metadata={"metavar": "NAME"})
    """split <think> reasoning into reasoning_content: deepseek_r1, qwen3"""

    generation_config: str = field(default="auto", metadata={"metavar": "auto|vllm|PATH"})
    """sampling defaults for requests that omit them, as vLLM's: auto reads the model directory's
    generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens as max_tokens),
    vllm ignores it, PATH reads the one in that folder"""

    chat_template: str | None = field(default=None, metadata={"metavar": "PATH"})
    """a Jinja chat template file (or the template itself) used instead of the model's"""

    allowed_origins: list[str] = field(default_factory=lambda: ["*"], metadata={"nargs": "+", "metavar": "ORIGIN"})
    """CORS: origins browsers may call from (vLLM's default: *); a JSON list, as vLLM takes it, is read too"""

    allowed_methods: list[str] = field(default_factory=lambda: ["*"], metadata={"nargs": "+", "metavar": "METHOD"})
    """CORS: allowed methods"""

    allowed_headers: list[str] = field(default_factory=lambda: ["*"], metadata={"nargs": "+", "metavar": "HEADER"})
    """CORS: allowed request headers"""

    allow_credentials: bool = False
    """CORS: allow credentials (cookies, Authorization) on cross-origin requests"""

    enable_force_include_usage: bool = False
    """vLLM's: every stream ends with the usage chunk, as if it asked for stream_options.include_usage"""

    enable_request_id_headers: bool = False
    """send an X-Request-Id header with every response (the client's own, or a new one); a client's X-Request-Id is
    echoed, and names the completion (chatcmpl-<id>), without it too"""

    def api_keys(self) -> list[str]:
        """--api-key's keys; without them and without --api-keys-file, the key of the environment (vLLM reads
        VLLM_API_KEY; KEEL_API_KEY is keel's own name for it)."""
        if self.api_key or self.api_keys_file:
            return list(self.api_key)
        return [key for name in API_KEY_ENV if (key := os.environ.get(name))]

    def settings(self, model: str, default_sampling: dict | None = None, architecture: str = "") -> ServerSettings:
        """The server's settings; `architecture` (the model's keel family) picks the reasoning parser GPT-OSS's
        harmony format needs when none is given, as vLLM reads harmony for GPT-OSS unasked (and the `openai` tool
        parser reads what that parser passes on)."""
        reasoning = self.reasoning_parser
        if reasoning is None and (architecture == "gpt_oss" or self.tool_call_parser == "openai"):
            reasoning = "openai_gptoss"
        given = self.served_model_name
        names = ((given,) if isinstance(given, str) else tuple(given)) or (str(model),)  # a str: one name
        return ServerSettings(
            served_model_name=names[0],
            served_model_names=names,
            model_root=str(model),
            default_sampling=dict(default_sampling or {}),
            max_queue=self.max_queue,
            request_timeout=self.request_timeout or None,
            max_tokens_cap=self.max_tokens_cap,
            max_body_bytes=self.max_body_bytes,
            audit_prompts=self.audit_prompts,
            enable_auto_tool_choice=self.enable_auto_tool_choice,
            tool_call_parser=self.tool_call_parser,
            reasoning_parser=reasoning,
            cors=CorsSettings(
                json_list(self.allowed_origins),
                json_list(self.allowed_methods),
                json_list(self.allowed_headers),
                self.allow_credentials,
            ),
            request_id_headers=self.enable_request_id_headers,
            force_include_usage=self.enable_force_include_usage,
        )


def json_list(values: list[str]) -> list[str]:
    """A flag's values, where vLLM's spelling gives one JSON list (--allowed-origins '["https://a.example"]')."""
    if isinstance(values, str):
        values = [values]
    if len(values) == 1 and values[0].lstrip().startswith("["):
        try:
            parsed = json.loads(values[0])
        except json.JSONDecodeError as e:
            raise KeelError(f"not a JSON list of strings: {values[0]!r} ({e.msg})") from None
        if not isinstance(parsed, list) or not all(isinstance(v, str) for v in parsed):
            raise KeelError(f"not a JSON list of strings: {values[0]!r}")
        return parsed
    return list(values)


@dataclass
class ModelSource:
    """What to serve: a path or catalog name, and the shape hints of a checkpoint without config.json."""

    model: str
    head_dim: int | None = None
    num_heads: int | None = None
