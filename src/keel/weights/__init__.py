"""keel.weights: checkpoints in (HF safetensors, GGUF, structure from shapes) and out (HF).

The model as a whole, quantized or not, is built by `keel.quant.loading.load_model` (above keel.quant).
"""

from keel.weights.checkpoint import Checkpoint, LoadedModel, TensorReader
from keel.weights.loader import open_checkpoint, resolve_path

__all__ = ["Checkpoint", "LoadedModel", "TensorReader", "open_checkpoint", "resolve_path"]
