"""The options of `keel serve` beyond the engine's: the HTTP server's, and the model source.

Each field's docstring is its command-line help (keel.cli derives the options from the fields).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from keel.serve.openai.settings import ServerSettings


@dataclass
class ServeOptions:
    """The HTTP server"""

    host: str = "127.0.0.1"
    """bind address (loopback by default)"""

    port: int = 8000
    """TCP port"""

    served_model_name: str | None = None
    """the model id clients send (default: MODEL)"""

    api_key: list[str] = field(default_factory=list, metadata={"metavar": "KEY"})
    """accept this Bearer key (tenant 'default', no limits); repeatable"""

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

    auto_parallel: str | None = field(default=None, metadata={"nargs": "?", "const": "local", "metavar": "COUNTxTYPE"})
    """take tp and pp from `keel plan serve` for this machine's GPUs (or the given cluster, e.g. 8xH200)"""

    def settings(self, model: str) -> ServerSettings:
        return ServerSettings(
            served_model_name=self.served_model_name or str(model),
            max_queue=self.max_queue,
            request_timeout=self.request_timeout or None,
            max_tokens_cap=self.max_tokens_cap,
            max_body_bytes=self.max_body_bytes,
            audit_prompts=self.audit_prompts,
        )


@dataclass
class ModelSource:
    """What to serve: a path or catalog name, and the shape hints of a checkpoint without config.json."""

    model: str
    head_dim: int | None = None
    num_heads: int | None = None
