"""Read a `keel train` checkpoint directory (torch.distributed.checkpoint) as a model.

A training checkpoint holds the model under "model.<keel name>" (plus optimizer state, ignored
here), written in shards by every rank; `config.json` and the tokenizer sit beside it. The model
tensors are loaded whole in one process (DCP reassembles the shards, whatever the training
layout) and renamed to HF names, so `keel convert`, `keel serve` and `keel generate` take the
directory like any HF checkpoint.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from torch import Tensor

from keel.config import ModelConfig
from keel.errors import WeightsError
from keel.weights.names import keel_to_hf

METADATA = ".metadata"
_DTYPE_NAMES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def is_dcp_checkpoint(path: Path) -> bool:
    return path.is_dir() and (path / METADATA).is_file()


class DCPReader:
    """HF-named model tensors of a DCP checkpoint (all loaded at open)."""

    def __init__(self, directory: Path, config: ModelConfig) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.directory = Path(directory)
        try:
            metadata = dcp.FileSystemReader(str(directory)).read_metadata()
        except Exception as e:  # noqa: BLE001 - any unreadable metadata is the same user error
            raise WeightsError(f"{directory}: unreadable checkpoint metadata ({e})") from None
        state: dict[str, Tensor] = {}
        for key, meta in metadata.state_dict_metadata.items():
            if key.startswith("model.") and isinstance(meta, TensorStorageMetadata):
                state[key.removeprefix("model.")] = torch.empty(meta.size, dtype=meta.properties.dtype)
        if not state:
            raise WeightsError(f"{directory}: a checkpoint without model tensors")
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            try:
                dcp.load({"model": state}, checkpoint_id=str(directory), no_dist=True)
            except Exception as e:  # noqa: BLE001
                raise WeightsError(f"{directory}: cannot read the checkpoint's shards ({e})") from None
        self._tensors = keel_to_hf(config, state.items(), fuse=False)

    def names(self) -> set[str]:
        return set(self._tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._tensors[name].shape)

    def dtype(self, name: str) -> str:
        return _DTYPE_NAMES.get(self._tensors[name].dtype, str(self._tensors[name].dtype))

    def get(self, name: str) -> Tensor:
        return self._tensors[name]

    def get_box(self, name: str, offset: tuple[int, ...], shape: tuple[int, ...]) -> Tensor:
        """The box of `name` at `offset` of `shape` (a reader over this one reads parts of its tensors)."""
        box = self._tensors[name]
        for dim, (start, size) in enumerate(zip(offset, shape, strict=True)):
            box = box.narrow(dim, start, size)
        return box

    def close(self) -> None:
        self._tensors = {}
