"""keel.weights: checkpoints in (HF safetensors, GGUF, structure from shapes) and out (HF).

The model as a whole, quantized or not, is built by `keel.quant.loading.load_model` (above keel.quant).
The names below load on first use, so that the CLI can read keel.weights.quant_format's constants before torch
is imported.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from keel.weights.checkpoint import Checkpoint, LoadedModel, TensorReader
    from keel.weights.loader import open_checkpoint, resolve_path

__all__ = ["Checkpoint", "LoadedModel", "TensorReader", "open_checkpoint", "resolve_path"]
_HOMES = {
    "Checkpoint": "keel.weights.checkpoint",
    "LoadedModel": "keel.weights.checkpoint",
    "TensorReader": "keel.weights.checkpoint",
    "open_checkpoint": "keel.weights.loader",
    "resolve_path": "keel.weights.loader",
}


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        return getattr(import_module(_HOMES[name]), name)
    raise AttributeError(f"module 'keel.weights' has no attribute {name!r}")
