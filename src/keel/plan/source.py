"""The model a plan is for: a config.json file, a directory holding one, or anything keel opens."""

from __future__ import annotations

from pathlib import Path

from keel.config import ModelConfig


def model_config(model: str) -> ModelConfig:
    """A config.json file, a directory holding one, or anything keel opens (GGUF, catalog name)."""
    path = Path(model)
    if path.is_file() and path.suffix == ".json":
        return ModelConfig.from_json_file(path, structure_only=True)
    if path.is_dir() and (path / "config.json").exists():
        return ModelConfig.from_json_file(path / "config.json", structure_only=True)
    from keel.weights.loader import open_checkpoint  # a checkpoint's header only: no weights

    return open_checkpoint(model).config
