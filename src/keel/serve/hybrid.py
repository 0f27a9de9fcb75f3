"""Serving models with recurrent layers (`ModelConfig.has_recurrent_layers`: Qwen3.5's Gated DeltaNet, LFM2's short
convolutions), whose per-sequence past is a state (keel.model.recurrent.RecurrentStates, one slot per running
sequence) beside the paged KV cache of their attention layers.

A state summarises a whole prefix and cannot be rewound or shared: prefix caching is off for such models (a cached
prefix's blocks would skip tokens whose state no slot holds), and what needs either (speculative decoding's
rejected drafts), or that keel has not built for them (tensor/pipeline-parallel workers), is refused here by name; the
int8 KV cache refuses them where it is made (keel.serve.kv_quant.make_paged_kv_cache) and the compiled decode step
steps aside (keel.serve.compiled_decode.compile_unsupported).

A model without attention layers (Mamba 2, Mamba) keeps nothing per token: its budget holds states only, one slot
a sequence, so the engine gives each sequence one block that spans the whole `max_model_len` and has as many
blocks as slots (`states_only`): the scheduler's block admission is then its state-slot admission.
"""

from __future__ import annotations

import logging

from keel.config import RECURRENT_LAYERS, ModelConfig
from keel.errors import KeelError
from keel.serve.config import EngineConfig

log = logging.getLogger("keel.serve")


def check_recurrent_layers(model: ModelConfig, config: EngineConfig) -> None:
    """A one-line KeelError for an engine option such a model cannot run with."""
    if not model.has_recurrent_layers:
        return
    refused = [
        (config.speculative is not None, "speculative decoding"),
        (config.parallel.uses_workers, "tensor/pipeline-parallel workers"),
    ]
    for asked, what in refused:
        if asked:
            raise KeelError(f"{what} does not run with {RECURRENT_LAYERS} yet")


def states_only(model: ModelConfig) -> bool:
    """Whether no layer attends (each recurrent, or an MLP alone): no KV cache rows at all, a state slot per sequence
    only."""
    return not any(model.is_attention_layer(i) for i in range(model.num_layers))


def prefix_caching(model: ModelConfig, config: EngineConfig) -> bool:
    """Whether the engine caches prefixes: as asked, except for a model with recurrent layers."""
    if config.cache.enable_prefix_caching and model.has_recurrent_layers:
        log.info("prefix caching off: recurrent layers keep a state per sequence, not per block")
        return False
    return config.cache.enable_prefix_caching
