"""The server's own settings (what `keel serve` flags set beyond the engine's)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ServerSettings:
    served_model_name: str
    max_queue: int = 256  # accepted requests not yet running (engine queue + tenant queues)
    request_timeout: float | None = 600.0  # seconds, queue + generation
    max_tokens_cap: int | None = None
    max_body_bytes: int = 4 * 2**20
    audit_prompts: bool = False  # include prompt text in audit lines
