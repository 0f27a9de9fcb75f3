"""keel.weights: checkpoints in (HF safetensors, GGUF, structure from shapes) and out (HF)."""

from keel.weights.loader import Checkpoint, LoadedModel, load_model, open_checkpoint, resolve_path

__all__ = ["Checkpoint", "LoadedModel", "load_model", "open_checkpoint", "resolve_path"]
