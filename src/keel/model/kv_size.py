"""KV-cache bytes per token: the one size the engine divides its memory budget by, the planner sizes
its pool with and the profiler counts as attention's reads.

Over all attention layers of `config` (`ModelConfig.attention_layers`: not its recurrent layers nor those without a
token mixer; a tensor-parallel rank passes its own share of the heads): K and V of every KV head, at each layer's own
head width (Gemma 4's full-attention layers: `ModelConfig.layer_head_dim`), or for multi-head latent attention
(config.is_mla) one row per layer of the latent and the rope key (kv_lora_rank + qk_rope_head_dim values) and no
values; DeepSeek Sparse Attention's layers with an indexer of their own one index key more (index_head_dim values,
`ModelConfig.dsa_index_layers`). Sliding-window layers count in full: the paged cache stores every layer's rows for
every block, windowed or not.

kv_cache_dtype "auto" stores rows in the model's `dtype`; "bfloat16" in bfloat16 whatever the compute
dtype (vLLM's option: half a float32 model's cache bytes, which decode attention streams every step);
"int8" stores int8 values with one
float16 scale per (KV head, token), two per MLA row (latent and rope key have a scale each), so
its size does not depend on the compute dtype (keel.serve.kv_quant is that cache).
"""

from __future__ import annotations

import torch

from keel.config import ModelConfig
from keel.dtype_names import KV_CACHE_DTYPES
from keel.errors import KeelError

SCALE_DTYPE = torch.float16  # 11-bit mantissa: its rounding (<0.05%) is far below int8's half step (0.4% of absmax)


def check_kv_cache_dtype(kv_cache_dtype: str) -> None:
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise KeelError(f"kv_cache_dtype {kv_cache_dtype!r}: expected one of {', '.join(KV_CACHE_DTYPES)}")


def kv_store_dtype(dtype: torch.dtype, kv_cache_dtype: str) -> torch.dtype:
    """The dtype a float cache stores its rows in, for a model computing in `dtype` (not for "int8")."""
    return torch.bfloat16 if kv_cache_dtype == "bfloat16" else dtype


def kv_cache_bytes(config: ModelConfig, dtype: torch.dtype, kv_cache_dtype: str = "auto", tokens: int = 1) -> int:
    """Cache bytes of `tokens` tokens over all layers, int8 scales included (tokens=block_size: one block)."""
    check_kv_cache_dtype(kv_cache_dtype)
    return _bytes_per_token(config, dtype, kv_cache_dtype) * tokens


def _bytes_per_token(config: ModelConfig, dtype: torch.dtype, kv_cache_dtype: str) -> int:
    # recurrent layers keep a state per sequence, not rows per token (keel.model.recurrent), hybrid ones both; "mlp"
    # layers nothing
    layers = config.kv_layers()  # not the layers attending over another's K/V (kv_shared_layers)
    if kv_cache_dtype != "int8":
        dtype = kv_store_dtype(dtype, kv_cache_dtype)
        if config.is_mla:
            index = len(config.dsa_index_layers()) * config.index_head_dim  # DSA's index keys
            return (len(layers) * (config.kv_lora_rank + config.qk_rope_head_dim) + index) * dtype.itemsize
        # each layer's own geometry, its values at their own width (MiMo-V2-Flash's are narrower than its keys)
        return sum((config.layer_kv_size(i) + config.layer_v_size(i)) * dtype.itemsize for i in layers)
    scale = SCALE_DTYPE.itemsize
    if config.is_mla:  # one latent + rope-key row per layer, a scale for each of its two parts
        return len(layers) * (config.kv_lora_rank + config.qk_rope_head_dim + 2 * scale)
    return sum(
        config.layer_num_kv_heads(i) * (config.layer_head_dim(i) + config.layer_v_head_dim(i) + 2 * scale)
        for i in layers
    )
