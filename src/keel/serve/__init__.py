"""The serving engine: scheduler, paged KV cache, runner, sampling, stop conditions, API."""

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
