"""The server's own settings (what `keel serve` flags set beyond the engine's)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class CorsSettings:
    """Cross-origin requests from browsers (Starlette's CORSMiddleware), with vLLM's defaults: any origin."""

    allowed_origins: list[str] = field(default_factory=lambda: ["*"])
    allowed_methods: list[str] = field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = field(default_factory=lambda: ["*"])
    allow_credentials: bool = False


@dataclass
class ServerSettings:
    served_model_name: str  # the name responses and metrics report
    max_queue: int = 256  # accepted requests not yet running (engine queue + tenant queues)
    request_timeout: float | None = 600.0  # seconds, queue + generation
    max_tokens_cap: int | None = None
    max_body_bytes: int = 4 * 2**20
    audit_prompts: bool = False  # include prompt text in audit lines
    enable_auto_tool_choice: bool = False  # tool_choice auto: the parser reads calls from free text
    tool_call_parser: str | None = None  # keel.serve.openai.tool_parsers' name
    reasoning_parser: str | None = None  # keel.serve.openai.reasoning_parsers' name
    served_model_names: tuple[str, ...] = ()  # every name a request may send (default: served_model_name)
    model_root: str = ""  # the model as given on the command line (the model cards' `root`, as vLLM's)
    # SamplingParams fields a request that omits them gets (generation_config.json; keel.serve.generation_config)
    default_sampling: dict[str, Any] = field(default_factory=dict)
    cors: CorsSettings = field(default_factory=CorsSettings)
    force_include_usage: bool = False  # every stream sends the usage chunk (vLLM's --enable-force-include-usage)
    request_id_headers: bool = False  # an X-Request-Id header on every response (vLLM's --enable-request-id-headers)

    def __post_init__(self) -> None:
        if not self.served_model_names:
            self.served_model_names = (self.served_model_name,)
