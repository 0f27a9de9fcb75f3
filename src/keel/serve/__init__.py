"""The serving engine: scheduler, paged KV cache, runner, sampling, stop conditions, API.

The names below load on first use: the CLI reads keel.serve.config's options before anything imports torch
(`keel train --nproc N` execs torchrun without it), and importing a submodule runs this file first."""

from __future__ import annotations

from typing import TYPE_CHECKING

from keel.lazy import lazy_exports

if TYPE_CHECKING:
    from keel.serve.async_engine import AsyncEngine
    from keel.serve.config import EngineConfig
    from keel.serve.engine import LLMEngine
    from keel.serve.llm import LLM
    from keel.serve.outputs import CompletionOutput, RequestOutput
    from keel.serve.sampling import RequestOutputKind, SamplingParams
    from keel.serve.structured import StructuredOutputsParams

__all__ = [
    "LLM",
    "AsyncEngine",
    "CompletionOutput",
    "EngineConfig",
    "LLMEngine",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
    "StructuredOutputsParams",
]
_HOMES = {
    "AsyncEngine": "keel.serve.async_engine",
    "EngineConfig": "keel.serve.config",
    "LLMEngine": "keel.serve.engine",
    "LLM": "keel.serve.llm",
    "CompletionOutput": "keel.serve.outputs",
    "RequestOutput": "keel.serve.outputs",
    "RequestOutputKind": "keel.serve.sampling",
    "SamplingParams": "keel.serve.sampling",
    "StructuredOutputsParams": "keel.serve.structured",
}

__getattr__ = lazy_exports(__name__, _HOMES)
