"""Serving DeepSeek Sparse Attention (`ModelConfig.is_dsa`: DeepSeek-V3.2, GLM-5; keel.model.dsa): the paged cache
keeps each indexer's keys beside the latent rows and attends through torch with each query's selection
(keel.serve.kv_cache.PagedKVCache._attend_indexed); prefix caching and chunked prefill compose with it. What keel has
not built for it is refused here by name: speculative decoding and tensor/pipeline-parallel workers (the int8 KV
cache refuses it where it is made, keel.serve.kv_quant.make_paged_kv_cache; the compiled decode step steps aside for
latent attention, keel.serve.compiled_decode.compile_unsupported).
"""

from __future__ import annotations

from keel.config import ModelConfig
from keel.errors import KeelError
from keel.serve.config import EngineConfig


def check_sparse_attention(model: ModelConfig, config: EngineConfig) -> None:
    """A one-line KeelError for an engine option a DSA model cannot run with."""
    if not model.is_dsa:
        return
    refused = [
        (config.speculative is not None, "speculative decoding"),
        (config.parallel.uses_workers, "tensor/pipeline-parallel workers"),
    ]
    for asked, what in refused:
        if asked:
            raise KeelError(f"{what} does not run with DeepSeek Sparse Attention (index_topk) yet")
