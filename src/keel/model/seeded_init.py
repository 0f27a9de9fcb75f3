"""Initial weights that do not depend on how the model is split: the same model on 1 rank or 64.

A model built on the meta device and parallelised there (FSDP, TP, EP, pipeline stages) holds no
data; after `to_empty` each rank fills only the shard it owns. Drawing those values from one
global RNG stream would make them depend on the layout (which rank draws which rows, in which
order). Here every random tensor is cut into fixed blocks of rows along its first dimension, and
block b of the parameter named N is drawn from its own generator seeded by (seed, N, b). A rank
draws just the blocks its shard overlaps and keeps its part, so any layout (and one process)
gets the same values: changing tp or dp changes no initial weight. The rules themselves are
`keel.model.transformer.init_weights`'s (normal(0, std) matrices, zero biases, unit norms).

Names are the whole model's fully-qualified names with wrapper prefixes removed (activation
checkpointing, torch.compile); pipeline stages keep global layer keys, and an untied last-stage
head (a tied model split into stages) starts from the embedding's values, as the whole model's
tied head does.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import torch
from torch import Tensor, nn

from keel.model.kda import SigmoidGatedRMSNorm
from keel.model.layers import XIELU, HeadNorm, RMSNorm
from keel.model.linear_attention import GatedDeltaNet, GatedRMSNorm
from keel.model.mamba import GroupedGatedRMSNorm, Mamba2Mixer
from keel.model.mamba1 import Mamba1Mixer
from keel.model.moa import MixtureOfAttention
from keel.model.moe import GroupedExperts, Router
from keel.model.rglru import RGLRU

# Elements per generator block: large enough that seeding costs nothing next to the draw, small
# enough that a rank holding a few rows of a matrix draws little beyond them.
BLOCK_ELEMENTS = 1 << 18
_WRAPPER_PARTS = ("_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module")


def canonical_name(name: str) -> str:
    """A parameter's name without the wrappers' path components."""
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_PARTS)


def _block_seed(seed: int, name: str, block: int) -> int:
    digest = hashlib.blake2b(f"{seed}:{name}:{block}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def local_box(param: Tensor) -> tuple[Tensor, tuple[int, ...], tuple[int, ...]]:
    """(the local data, its shape, its offset in the global tensor)."""
    from torch.distributed.tensor import DTensor

    if isinstance(param, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        local = param.to_local()
        shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
        if tuple(shape) != tuple(local.shape):
            raise RuntimeError(f"cannot locate the local shard of a {list(param.shape)} DTensor {param.placements}")
        return local, tuple(shape), tuple(offset)
    return param, tuple(param.shape), (0,) * param.dim()


@torch.no_grad()
def fill_normal(param: Tensor, name: str, seed: int, std: float) -> None:
    """Fill this rank's part of `param` with N(0, std) values that depend only on (seed, name)."""
    local, shape, offset = local_box(param)
    if local.numel() == 0:
        return
    global_shape = tuple(param.shape)
    row_elems = 1
    for size in global_shape[1:]:
        row_elems *= size
    rows_per_block = max(1, BLOCK_ELEMENTS // max(1, row_elems))
    first, last = offset[0], offset[0] + shape[0]
    columns = tuple(slice(o, o + s) for o, s in zip(offset[1:], shape[1:], strict=True))
    for block in range(first // rows_per_block, (last - 1) // rows_per_block + 1):
        start = block * rows_per_block
        rows = min(rows_per_block, global_shape[0] - start)
        gen = torch.Generator(device=local.device).manual_seed(_block_seed(seed, name, block))
        values = torch.empty((rows, *global_shape[1:]), dtype=torch.float32, device=local.device)
        values.normal_(0.0, std, generator=gen)
        lo, hi = max(first, start), min(last, start + rows)  # global rows of this block that are local
        local[lo - first : hi - first].copy_(values[(slice(lo - start, hi - start), *columns)])


def materialize(model: nn.Module, device: torch.device | str, fill: Callable[[nn.Module], None]) -> None:
    """A meta-device model (whole, a stage, parallelised or not) given memory on `device` for its own
    shards, then `fill`ed (e.g. `init_weights_seeded`, or a checkpoint's shards); a no-op for a model
    that holds data already."""
    if not any(p.is_meta for p in model.parameters()):
        return
    model.to_empty(device=device)
    for module in model.modules():
        if hasattr(module, "tie_weights"):  # to_empty gives a plain module's tied head a tensor of its own
            module.tie_weights()
    fill(model)
    for module in model.modules():
        if hasattr(module, "reset_buffers"):
            module.reset_buffers(torch.device(device))


@torch.no_grad()
def fill_vector(param: Tensor, values: Tensor) -> None:
    """Fill this rank's part of `param` from the whole tensor `values` (a vector, or Mamba 1's [channels, N])."""
    local, shape, offset = local_box(param)
    local.copy_(values[tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))].to(local))


@torch.no_grad()
def init_weights_seeded(model: nn.Module, seed: int, std: float = 0.02) -> None:
    """Initialise every parameter of `model` (whole, a pipeline stage, sharded or not) in place.

    Raises when a parameter has no rule, so a new module type cannot start from uninitialised memory.
    """
    config = getattr(model, "config", None)
    tied = bool(config is not None and config.tie_word_embeddings)
    done: set[int] = set()
    for module_name, module in model.named_modules():
        prefix = canonical_name(module_name)
        for param_name, param in module.named_parameters(recurse=False):
            if id(param) in done:
                continue
            done.add(id(param))
            name = f"{prefix}.{param_name}" if prefix else param_name
            if name == "lm_head.weight" and tied:
                name = "embed_tokens.weight"  # a stage's untied head starts as the tied model's
            if isinstance(module, GatedRMSNorm | GroupedGatedRMSNorm | SigmoidGatedRMSNorm) or (
                isinstance(module, GatedDeltaNet | Mamba2Mixer | Mamba1Mixer) and param_name in ("dt_bias", "D")
            ):
                param.fill_(1.0)  # before the generic bias rule: dt_bias starts at 1, as transformers starts it
            elif isinstance(module, GatedDeltaNet | Mamba2Mixer | Mamba1Mixer) and param_name == "A_log":
                fill_vector(param, module.initial_a_log())
            elif isinstance(module, RGLRU) and param_name == "recurrent_param":
                fill_vector(param, module.initial_recurrent_param())
            elif isinstance(module, RMSNorm | nn.LayerNorm | HeadNorm) and param_name == "weight":
                param.fill_(1.0 - getattr(module, "offset", 0.0))  # a scale of 1 ((offset + weight) for Gemma's)
            elif param_name == "bias" or param_name.endswith("_bias"):  # GPT-OSS's experts: gate_up_proj_bias
                param.zero_()
            elif isinstance(module, XIELU):  # its initial shape, the same on every layout
                param.fill_(module.INITIAL[param_name])
            elif (
                isinstance(module, nn.Linear | nn.Embedding | nn.Conv1d | Router | GroupedExperts | RGLRU)
                or param_name == "sinks"
                or (isinstance(module, MixtureOfAttention) and param_name in ("q_experts", "o_experts"))
            ):
                fill_normal(param, name, seed, std)
            else:
                raise ValueError(f"no initialisation rule for parameter {name} of {type(module).__name__}")
    for module in model.modules():
        for buffer_name, buffer in module.named_buffers(recurse=False):
            if buffer_name == "e_score_correction_bias":
                buffer.zero_()
            elif isinstance(module, XIELU):
                buffer.fill_(module.INITIAL[buffer_name])
