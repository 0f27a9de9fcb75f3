"""keel.weights: checkpoints in (HF safetensors, GGUF, structure from shapes) and out (HF).

The model as a whole, quantized or not, is built by `keel.quant.loading.load_model` (above keel.quant).
The names below load on first use, so that the CLI can read keel.weights.quant_format's constants before torch
is imported.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from keel.lazy import lazy_exports

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

__getattr__ = lazy_exports(__name__, _HOMES)
