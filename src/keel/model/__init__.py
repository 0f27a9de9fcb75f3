"""keel.model: the one model definition shared by training and serving."""

from keel.model.attention import AttentionMetadata, KVCache
from keel.model.transformer import Transformer, build_model

__all__ = ["AttentionMetadata", "KVCache", "Transformer", "build_model"]
