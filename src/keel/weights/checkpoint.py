"""What an opened checkpoint is, whatever its format: the types every reader and loader shares.

They sit at the bottom of keel.weights so that the format readers (safetensors, GGUF, keel train
checkpoints) and the layers above (keel.quant loads quantized models from a `Checkpoint`) can all
import them without importing the loader that picks between the formats.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from torch import Tensor

from keel.config import ModelConfig
from keel.model.transformer import Transformer
from keel.tokenizer import Tokenizer


class TensorReader(Protocol):
    """HF-named tensors of a checkpoint, read lazily."""

    def names(self) -> set[str]: ...

    def shape(self, name: str) -> tuple[int, ...]: ...

    def dtype(self, name: str) -> str:
        """The stored type, e.g. "BF16" (safetensors) or "Q4_1" (GGUF)."""
        ...

    def get(self, name: str) -> Tensor: ...

    def close(self) -> None: ...


@dataclass
class Checkpoint:
    """An opened checkpoint: its config, tensors, tokenizer and what was read vs inferred."""

    path: Path
    format: str  # "hf" | "hf-shapes" | "gguf" | "keel-dcp" (a keel train checkpoint)
    config: ModelConfig
    reader: TensorReader
    tokenizer: Tokenizer | None
    # Config field -> "read" (from config.json / GGUF metadata), "inferred" (from shapes),
    # "hint" (from --head-dim/--num-heads) or "default" (not recoverable; the family default).
    provenance: dict[str, str] = field(default_factory=dict)
    # Bytes of the stored tensors by storage type (e.g. BF16, Q4_1).
    bytes_by_dtype: dict[str, int] = field(default_factory=dict)
    # A directory written by `keel quantize save`: its config.json `quantization_config` (quant_method
    # "keel"); load_model rebuilds the quantized layers from its integer tensors.
    quantization: dict | None = None
    # A BitNet b1.58 release: its checked `quantization_config` (quant_method "bitnet"; keel.families.bitnet), whose
    # ternary layers only load_model runs (keel.quant.bitnet); None for float weights.
    bitnet: dict | None = None


@dataclass
class LoadedModel:
    model: Transformer
    checkpoint: Checkpoint
    dtype_reason: str = "requested"  # why the model computes in its dtype (`choose_dtype`), for the start-up log

    @property
    def config(self) -> ModelConfig:
        return self.checkpoint.config

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.checkpoint.tokenizer
