"""Shard-wise loading: a rank builds its cut of the model on the meta device (its pipeline stage's
layers, its tensor-parallel slices) and reads only those slices from the checkpoint, so no rank
ever holds a full weight tensor of the model.

Safetensors slices are read through safetensors' lazy slicing; GGUF slices through the memory map,
whole rows (and whole blocks of a row) at a time (`GGUFTensorReader.get_shard`). MoE experts stored
one tensor per expert are cut piece by piece; GGUF's stacked experts are read whole, then cut. Pre-quantized
checkpoints are refused with a message.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from keel.config import RECURRENT_LAYERS
from keel.errors import KeelError
from keel.model.stages import split_stage
from keel.model.transformer import Transformer
from keel.serve.parallel.tensor import shard_model
from keel.weights.checkpoint import LoadedModel
from keel.weights.loader import as_shape, open_checkpoint
from keel.weights.names import hf_source
from keel.weights.shard import Shard, TensorParallelLayout


def check_parallel_model(config, source: str | Path, tp: int, pp: int, expert_parallel: bool = False) -> None:
    """Refuse what parallel serving cannot shard yet, and layouts that do not divide (one line each)."""
    if pp > config.num_layers:
        raise KeelError(f"--pipeline-parallel-size {pp}: the model has only {config.num_layers} layers")
    if expert_parallel and not config.is_moe:
        raise KeelError(f"{source}: --enable-expert-parallel needs a mixture-of-experts model")
    if tp > 1 and config.qk_norm and config.qk_norm_scope == "all":
        raise KeelError(
            f"{source}: tensor-parallel serving does not handle q/k norms over the whole projection (OLMo 2)"
        )
    if tp > 1 and config.qk_norm and config.qk_norm_scope == "each_head":
        raise KeelError(f"{source}: tensor-parallel serving does not shard q/k norms with a weight per head yet")
    if (tp > 1 or pp > 1) and config.has_recurrent_layers:
        raise KeelError(f"{source}: parallel serving does not run {RECURRENT_LAYERS} yet")
    if pp > 1 and config.is_dsa and "shared" in config.indexer_types:  # a stage may not hold the source layer
        raise KeelError(f"{source}: pipeline-parallel serving does not run DSA layers sharing another's selection yet")
    if tp > 1 and config.has_partial_layers:
        raise KeelError(f"{source}: tensor-parallel serving does not run layers without a token mixer or an MLP yet")
    if tp > 1:
        TensorParallelLayout(config, tp, 0, expert_parallel)  # raises when heads, KV heads or widths do not divide


def load_tensor_parallel(
    model: str | Path,
    dtype: torch.dtype,
    tp: int,
    rank: int,
    group: dist.ProcessGroup | None = None,
    device: str | torch.device = "cpu",
    *,
    stage: int = 0,
    num_stages: int = 1,
    expert_parallel: bool = False,
) -> LoadedModel:
    """Tensor-parallel rank `rank` of `tp` in pipeline stage `stage` of `num_stages`, read slice by slice."""
    checkpoint = open_checkpoint(model)
    config = checkpoint.config
    if checkpoint.quantization is not None:
        raise KeelError(f"{model}: a pre-quantized checkpoint cannot be served tensor/pipeline-parallel yet")
    if checkpoint.bitnet is not None:
        raise KeelError(
            f"{model}: BitNet's ternary layers (quant_method 'bitnet') cannot be served tensor/pipeline-parallel"
        )
    check_parallel_model(config, model, tp, num_stages, expert_parallel)
    reader = checkpoint.reader
    if not hasattr(reader, "get_shard"):
        raise KeelError(f"{model}: tensor/pipeline-parallel loading reads safetensors and GGUF checkpoints only")
    layout = TensorParallelLayout(config, tp, rank, expert_parallel)
    with torch.device("meta"):
        net = Transformer(config)
    if num_stages > 1:
        split_stage(net, stage, num_stages)
    if tp > 1:
        shard_model(net, layout, group)
    available = reader.names()
    state = {}
    persistent = net.state_dict(keep_vars=True)
    # Parameters, then persistent buffers (DeepSeek's / GLM-4.5's router selection bias: replicated, float32)
    tensors = [*net.named_parameters(), *((n, b) for n, b in net.named_buffers() if n in persistent and b.is_meta)]
    buffers = {n for n, _ in net.named_buffers()}
    for name, param in tensors:
        source = hf_source(config, name, available)
        names = source.names
        if names == ("lm_head.weight",) and names[0] not in available and config.tie_word_embeddings:
            names = ("model.embed_tokens.weight",)  # a last stage without the embedding reads the tied rows
        for stored in names:
            if stored not in available:
                raise KeelError(f"{checkpoint.path}: tensor {stored!r} is missing (needed for {name})")
        shard = layout.shard_of(name) if tp > 1 else None
        if len(names) == 1:
            tensor = reader.get_shard(names[0], shard)
        elif shard is not None and shard.dim == 0:  # experts stored one per tensor, split by expert: read ours
            per = len(names) // config.num_experts
            tensor = source.combine(
                [reader.get_shard(stored, None) for stored in names[shard.start * per : shard.stop * per]]
            )
        else:  # experts stored one per tensor, stacked by `combine`: each piece cut on its own dimension
            piece = None if shard is None else Shard(shard.dim - 1, shard.start, shard.stop)
            tensor = source.combine([reader.get_shard(stored, piece) for stored in names])
        # To the device as it is read: on GPUs the host never holds more than one tensor of the shard (every
        # local rank loads at once, and a whole shard per rank can exceed the host's memory).
        tensor = as_shape(tensor, param.shape).to(device=device, dtype=param.dtype if name in buffers else dtype)
        if tuple(tensor.shape) != tuple(param.shape):
            raise KeelError(
                f"{checkpoint.path}: {name} gives {list(tensor.shape)} on rank {rank}, expected {list(param.shape)}"
            )
        state[name] = tensor
    net.load_state_dict(state, strict=False, assign=True)
    net.tie_weights()  # assign=True replaced the embedding's Parameter: the head shares the new one
    net.reset_buffers(device)
    net.to(device)
    net.eval()
    return LoadedModel(net, checkpoint)
