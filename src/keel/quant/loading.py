"""Load any checkpoint keel opens as a keel model, quantized or not: the one `load_model`.

It sits in keel.quant, above keel.weights, because it needs both: keel.weights opens the
checkpoint and fills float weights (it must not import keel.quant), and keel.quant builds the
layers that are quantized while loading (keel.quant.on_load) or after it (keel.quant.apply).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch

from keel.errors import KeelError
from keel.model.transformer import Transformer
from keel.quant.apply import GGUF, check_keep, quantize_kept, set_activations
from keel.quant.bitnet import load_bitnet_layers
from keel.quant.config import AUTO, FLOAT, keep_for
from keel.quant.on_load import quantize_while_loading, stores_integer_blocks
from keel.weights.checkpoint import Checkpoint, LoadedModel
from keel.weights.compute_dtype import choose_dtype
from keel.weights.loader import load_weights, open_checkpoint


def load_model(
    model: str | Path,
    dtype: str | torch.dtype = "float32",
    *,
    head_dim: int | None = None,
    num_heads: int | None = None,
    device: str = "cpu",
    quantize: str | None = None,
    quant_group_size: int = 128,
    quant_keep: Iterable[str] | None = None,
    quant_keep_as: str | None = None,
    quant_activations: str = "refined",
    check_kept: bool = True,
) -> LoadedModel:
    """Open a checkpoint and return the keel model (eval mode) with its tokenizer.

    dtype "auto": see `choose_dtype` (bfloat16 on CPUs with native bf16 matmul, float32 elsewhere).

    quantize ("int8", "int4" or "gguf", see keel.quant; None or "none": float; "auto": `resolve_scheme`'s choice for
    this checkpoint and device): the linear layers and MoE experts are built
    quantized while loading, one at a time from the checkpoint, so the model never exists in float
    as a whole; "gguf" takes a GGUF file's integer blocks (Q4_0 ... Q6_K) as they are, without expanding them
    to float. quant_keep: layers left in float (names or shell patterns; None: the scheme's default, `keep_for`),
    or in `quant_keep_as` ("int8"/"int4") when given: a second tier of the plan (e.g. int4 with an int8 head).
    A directory written by `keel quantize save` is always loaded quantized, a BitNet release with its ternary
    layers (keel.quant.bitnet). The statistics are in `model.quantization`.
    quant_activations: how keel's CPU kernels quantize activations (keel.quant.apply.set_activations).
    check_kept: refuse a quant_keep entry that names no layer of this model (off for a speculative draft, which
    takes its target's list).
    """
    checkpoint = open_checkpoint(model, head_dim=head_dim, num_heads=num_heads)
    quantize = resolve_scheme(checkpoint, quantize, device)
    given_keep = check_kept and quant_keep is not None and (quantize is not None or quant_keep_as is not None)
    quant_keep = keep_for(quant_keep, quantize, quant_keep_as)
    if quant_keep_as is not None and quantize is None and checkpoint.quantization is None:
        raise KeelError(
            f"{checkpoint.path}: --quant-keep-as {quant_keep_as} needs a quantized model, and this one loads in float "
            "(--quantize auto quantizes only a GGUF file's integer blocks on CPU): give --quantize int8|int4|gguf"
        )
    torch_dtype, dtype_reason = choose_dtype(checkpoint, dtype, device, quantize)
    with torch.device("meta"):
        net = Transformer(checkpoint.config)
    if given_keep:
        check_keep(net, quant_keep)
    if checkpoint.bitnet is not None:  # BitNet's ternary layers with int8 activations, as its release runs them
        if quantize is not None:
            raise KeelError(
                f"{checkpoint.path}: --quantize {quantize}: a BitNet checkpoint's ternary layers "
                "(quantization_config, quant_method 'bitnet') run as stored"
            )
        load_bitnet_layers(net, checkpoint, checkpoint.bitnet, torch_dtype, device)
    if quantize is not None or checkpoint.quantization is not None:
        quantize_while_loading(net, checkpoint, torch_dtype, device, quantize, quant_group_size, set(quant_keep))
    load_weights(net, checkpoint, torch_dtype)
    if quant_keep_as is not None and quantize is not None:
        quantize_kept(net, quant_keep, quant_keep_as, quant_group_size)
    set_activations(net, quant_activations)
    net.reset_buffers(device)
    net.to(device)
    net.eval()
    return LoadedModel(net, checkpoint, dtype_reason)


def resolve_scheme(checkpoint: Checkpoint, quantize: str | None, device: str | torch.device = "cpu") -> str | None:
    """The scheme a model loads in: "int8", "int4", "gguf" as asked; None (float) for None or "none"; for "auto",
    "gguf" when `checkpoint` is a GGUF file with integer blocks and the model runs on the CPU (vLLM, too, runs a
    GGUF file's blocks as stored), float otherwise (on CUDA the blocks become torch's int4/int8 kernels' layouts
    only when --quantize gguf asks for it)."""
    if quantize == AUTO:
        return GGUF if stores_integer_blocks(checkpoint) and torch.device(device).type == "cpu" else None
    return None if quantize == FLOAT else quantize


def loaded_scheme(model: torch.nn.Module) -> str | None:
    """The scheme `load_model` quantized `model` in (what "auto" chose), None for a float model."""
    return (getattr(model, "quantization", None) or {}).get("scheme")
