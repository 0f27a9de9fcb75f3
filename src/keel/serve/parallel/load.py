"""Shard-wise loading: a tensor-parallel rank builds its cut of the model on the meta device and
reads only its slices from the safetensors files, so no rank ever holds a full weight tensor.

Dense HF safetensors checkpoints so far (GGUF, quantized and MoE shards are not handled yet).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from keel.errors import KeelError
from keel.model.transformer import Transformer
from keel.serve.parallel.shard import TensorParallelLayout
from keel.serve.parallel.tensor import shard_model
from keel.weights.loader import LoadedModel, open_checkpoint
from keel.weights.names import hf_source
from keel.weights.safetensors import SafetensorsReader


def load_tensor_parallel(
    model: str | Path,
    dtype: torch.dtype,
    tp: int,
    rank: int,
    group: dist.ProcessGroup | None = None,
    device: str = "cpu",
) -> LoadedModel:
    """Rank `rank` of `tp`'s model, read slice by slice from the checkpoint."""
    checkpoint = open_checkpoint(model)
    config = checkpoint.config
    if not isinstance(checkpoint.reader, SafetensorsReader) or config.is_moe or config.is_mla:
        raise KeelError(f"{model}: tensor-parallel loading reads dense HF safetensors checkpoints only (so far)")
    layout = TensorParallelLayout(config, tp, rank)
    with torch.device("meta"):
        net = Transformer(config)
    shard_model(net, layout, group)
    reader, available = checkpoint.reader, checkpoint.reader.names()
    state = {}
    for name, param in net.named_parameters():
        (source,) = hf_source(config, name, available).names  # dense: one stored tensor per parameter
        if source not in available:
            raise KeelError(f"{checkpoint.path}: tensor {source!r} is missing (needed for {name})")
        tensor = reader.get_shard(source, layout.shard_of(name)).to(dtype)
        if tuple(tensor.shape) != tuple(param.shape):
            raise KeelError(f"{checkpoint.path}: {source} gives {list(tensor.shape)} on rank {rank}, "
                            f"expected {list(param.shape)}")  # fmt: skip
        state[name] = tensor
    net.load_state_dict(state, strict=False, assign=True)
    net.tie_weights()  # assign=True replaced the embedding's Parameter: the head shares the new one
    net.reset_buffers(device)
    net.to(device)
    net.eval()
    return LoadedModel(net, checkpoint)
