"""Serving models with Gated DeltaNet layers (Qwen3.5: config.has_linear_attention), whose per-sequence past is a
recurrent state (keel.model.linear_attention.RecurrentStates, one slot per running sequence) beside the paged KV
cache of their attention layers.

A state summarises a whole prefix and cannot be rewound or shared: prefix caching is off for such models (a cached
prefix's blocks would skip tokens whose state no slot holds), and what needs either (speculative decoding's
rejected drafts), or that keel has not built for them (tensor/pipeline-parallel workers, an int8 KV cache), is refused
here by name; the compiled decode step steps aside (keel.serve.compiled_decode.compile_unsupported).
"""

from __future__ import annotations

import logging

from keel.config import ModelConfig
from keel.errors import KeelError
from keel.serve.config import EngineConfig

log = logging.getLogger("keel.serve")


def check_linear_attention(model: ModelConfig, config: EngineConfig) -> None:
    """A one-line KeelError for an engine option such a model cannot run with."""
    if not model.has_linear_attention:
        return
    refused = [
        (config.speculative is not None, "speculative decoding"),
        (config.parallel.uses_workers, "tensor/pipeline-parallel workers"),
        (config.cache.kv_cache_dtype == "int8", "--kv-cache-dtype int8"),
    ]
    for asked, what in refused:
        if asked:
            raise KeelError(f"{what} does not run with Gated DeltaNet (linear_attention) layers yet")


def prefix_caching(model: ModelConfig, config: EngineConfig) -> bool:
    """Whether the engine caches prefixes: as asked, except for a model with Gated DeltaNet layers."""
    if config.cache.enable_prefix_caching and model.has_linear_attention:
        log.info("prefix caching off: Gated DeltaNet layers keep a recurrent state per sequence, not per block")
        return False
    return config.cache.enable_prefix_caching
