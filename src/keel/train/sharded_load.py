"""A run that starts from a checkpoint (`model.source`): each rank reads only its own shards of it.

The model is built on the meta device and parallelised there like a run from scratch; then every
rank allocates its shards and fills each from the checkpoint's tensor of the same name (keel's HF name
map, keel.weights.names), reading just the block of rows and columns that rank holds: a safetensors
file serves that block alone from disk; other formats (GGUF, whose blocks are dequantized whole) are
read one tensor at a time and cut. Experts stored one tensor per expert are read for the rank's own
experts only. No rank ever holds more than its shards plus one tensor.

A keel training checkpoint as the source is read by DCP itself (the model only), which reshards it
the same way (keel.train.checkpoint.CheckpointManager.load_model).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from keel.errors import KeelError, WeightsError
from keel.model.seeded_init import canonical_name, local_box
from keel.weights.checkpoint import Checkpoint
from keel.weights.loader import as_shape
from keel.weights.names import hf_source


def read_box(reader, name: str, offset: tuple[int, ...], shape: tuple[int, ...]) -> Tensor:
    """Block [offset, offset + shape) of the checkpoint tensor `name`."""
    if hasattr(reader, "get_box"):
        return reader.get_box(name, offset, shape)
    return reader.get(name)[tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))]


def check_loadable(checkpoint: Checkpoint, source: str) -> None:
    """Refuse sources whose tensors are not the model's float weights."""
    if checkpoint.quantization is not None:
        raise KeelError(f"model.source = {source}: a quantized checkpoint cannot be trained; start from its float one")
    if checkpoint.bitnet is not None:
        raise KeelError(f"model.source = {source}: BitNet's ternary layers (quant_method 'bitnet') cannot be trained")


@torch.no_grad()
def load_shards(model: nn.Module, checkpoint: Checkpoint) -> None:
    """Fill every parameter and persistent buffer of a materialised (`to_empty`) model, sharded or not,
    from `checkpoint`: this rank's part of each tensor only."""
    config, reader = checkpoint.config, checkpoint.reader
    available = reader.names()
    persistent = model.state_dict(keep_vars=True)
    tensors = dict(model.named_parameters())
    tensors.update({n: b for n, b in model.named_buffers() if n in persistent})
    for stored_name, tensor in tensors.items():
        name = canonical_name(stored_name)
        source = hf_source(config, name, available)
        names = source.names
        if names == ("lm_head.weight",) and names[0] not in available and config.tie_word_embeddings:
            names = ("model.embed_tokens.weight",)  # a pipeline's last stage: the tied head is the embedding
        for stored in names:
            if stored not in available:
                raise WeightsError(f"{checkpoint.path}: tensor {stored!r} is missing (needed for {name})")
        local, shape, offset = local_box(tensor)
        if len(names) == 1:
            full = tuple(reader.shape(names[0]))
            # Stored with dimensions of size 1 of its own (ERNIE 4.5 MoE's [1, E] selection bias), whole here
            reshaped = full != tuple(tensor.shape) and tuple(shape) == tuple(tensor.shape)
            if full != tuple(tensor.shape) and not (reshaped and as_shape(reader.get(names[0]), shape).shape == shape):
                raise WeightsError(
                    f"{checkpoint.path}: tensor {names[0]} has shape {list(full)}, expected {list(tensor.shape)}"
                )
            part = as_shape(reader.get(names[0]), shape) if reshaped else read_box(reader, names[0], offset, shape)
        else:  # experts stored one tensor each: this rank's experts, stacked, then cut
            per = len(names) // config.num_experts
            mine = names[offset[0] * per : (offset[0] + shape[0]) * per]
            stacked = source.combine([reader.get(n) for n in mine])
            part = stacked[(slice(None), *(slice(o, o + n) for o, n in zip(offset[1:], shape[1:], strict=True)))]
        if tuple(part.shape) != tuple(shape):
            raise WeightsError(f"{checkpoint.path}: {name} gives {list(part.shape)} here, expected {list(shape)}")
        local.copy_(part)
