"""What every route shares: the engine and the server's companions to it, and whether the server drains."""

from __future__ import annotations

import asyncio

from fastapi.responses import JSONResponse

from keel.serve.async_engine import AsyncEngine
from keel.serve.openai.audit import AuditLog
from keel.serve.openai.errors import APIError
from keel.serve.openai.generation import end_all
from keel.serve.openai.metrics import ServerMetrics
from keel.serve.openai.settings import ServerSettings
from keel.serve.openai.tenants import Tenants
from keel.serve.openai.tokens import TokenRenderer


class ServerState:
    def __init__(self, engine: AsyncEngine, settings: ServerSettings, tenants: Tenants) -> None:
        self.engine = engine
        self.settings = settings
        self.tenants = tenants
        core = engine.engine
        cache_info = core.cache_config_info() if hasattr(core, "cache_config_info") else None  # not --engine naive
        self.metrics = ServerMetrics(
            settings.served_model_name, engine.stats, max_model_len=core.max_model_len, cache_info=cache_info
        )
        self.audit = AuditLog(settings.audit_prompts)
        self.tokens = TokenRenderer(engine.engine.tokenizer)
        self.draining = False  # set when the server shuts down: new requests get 503
        self.in_flight: set[asyncio.Queue] = set()  # the calls generating now (CallRunner)

    def end_in_flight(self, why: str) -> int:
        """The drain's time is up: new requests get 503, and every call generating now ends with a 503 (a
        stream with its error event) rather than a task cancelled under it. Returns how many were ended."""
        self.draining = True
        return end_all(self.in_flight, APIError(503, why))

    def shutdown(self) -> None:
        self.draining = True
        self.engine.shutdown()

    def check_ready(self) -> None:
        """503 unless the server takes new generation requests."""
        if self.draining:
            raise APIError(503, "server is shutting down")
        if not self.engine.alive:
            raise APIError(503, f"engine failed: {self.engine.error}")

    def health(self) -> JSONResponse:
        if not self.engine.alive:
            return JSONResponse({"status": "error", "error": str(self.engine.error)}, status_code=503)
        if self.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return JSONResponse({"status": "ok"})
