"""Quantize while loading: quantized layers built on the meta-built model straight from the checkpoint.

`load_model(..., quantize=...)` (keel.quant.loading) calls `quantize_while_loading` before the float weights are filled:
every linear layer and MoE expert block that is to be quantized is replaced by its quantized module,
built from the checkpoint one module at a time; `load_weights` then fills only what is still on the
meta device (embeddings, norms, kept layers). Peak memory is the quantized model plus one module's
source tensors, never the float model.

Sources:
- "int8" / "int4": the module's float weights (in the compute dtype, as `quantize_model` would see
  them after a float load: the same numbers bit for bit);
- "gguf": a GGUF file's Q4_0/Q4_1/Q8_0/Q4_K/Q5_K/Q6_K/MXFP4 blocks (`GGUFTensorReader.get_blocks`,
  keel.weights.gguf_blocks). Where keel's kernels run (keel.kernels) every block runs as its integer
  codes: Q4_0/Q4_1/Q8_0 with their float16 scales as stored, the K-quants with float32 scales (and
  mins) per 32 values (per 16 for Q6_K), the exact products of their super-block and sub-block
  scales; a tied head runs the embedding's blocks, and the embedding looks its rows up in them
  (keel.quant.embedding, one copy of the codes for both; `--quant-keep embed_tokens` keeps a float
  table). Elsewhere torch's kernels get Q4_0 (w = (q - 8) d), Q4_1 (w = q d + m) and Q4_K as int4
  groups of 32 exactly, and Q8_0 (w = q d per block of 32), which has no exact per-channel int8 form,
  as per-channel int8 (`int8_from_blocks`: error <= half a step of the row's largest value / 127);
  Q5_K and Q6_K load as float there. Other tensor types (F16, BF16, and the block types without an
  integer form here: Q5_0, Q5_1, Q2_K, Q3_K, IQ4_NL) load as float;
- a directory written by `keel quantize save` (config.json `quantization_config`, quant_method
  "keel"): its portable integer tensors (see keel.quant.save for the format).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor, nn

from keel.config import ModelConfig
from keel.errors import KeelError, WeightsError
from keel.libc import trim_heap
from keel.model.moe import GroupedExperts
from keel.quant.apply import (
    GGUF,
    check_scheme,
    is_kept,
    linear_fits,
    new_stats,
    quantizable,
    replace_module,
)
from keel.quant.embedding import BlockEmbedding
from keel.quant.experts import QuantizedGroupedExperts, experts_fit, float_parts
from keel.quant.linear import (
    QuantizedLinear,
    int4_fits,
    int8_fits,
    runs_blocks,
    unpack_nibbles,
)
from keel.weights.checkpoint import Checkpoint
from keel.weights.gguf_blocks import BLOCK_TYPES, QuantBlocks
from keel.weights.names import hf_source

GGUF_GROUP = 32  # values per block of Q4_0/Q4_1/Q8_0, and per scale of Q4_K/Q5_K


def quantize_while_loading(
    net: nn.Module,
    checkpoint: Checkpoint,
    dtype: torch.dtype,
    device: str | torch.device,
    scheme: str | None,
    group_size: int = 128,
    keep: set[str] | None = None,
) -> dict[str, int]:
    """Replace the quantizable modules of the meta-built `net` by quantized ones read from
    `checkpoint` (on `device`, computing in `dtype`); records {"scheme", "group_size", "source",
    "stats"} as `net.quantization` and returns the stats."""
    device = torch.device(device)
    saved = checkpoint.quantization
    if saved is not None:
        if scheme is not None and scheme != saved["scheme"]:
            raise KeelError(
                f"{checkpoint.path}: already quantized to {saved['scheme']} (keel quantize save); "
                f"drop --quantize {scheme} or quantize the float checkpoint"
            )
        scheme, group_size = saved["scheme"], int(saved.get("group_size") or 0)
        source = "saved by keel quantize save"
        stats = _load_saved(net, checkpoint, dtype, device)
    else:
        if scheme is None:
            raise ValueError("quantize_while_loading needs a scheme for a float checkpoint")
        check_scheme(scheme, group_size)
        if scheme == GGUF:
            if checkpoint.format != "gguf" and not stores_integer_blocks(checkpoint):
                raise KeelError(
                    f"{checkpoint.path}: --quantize gguf runs a checkpoint's own integer blocks (a GGUF file's, "
                    "GPT-OSS's MXFP4 experts), and this one has none (use --quantize int8 or int4)"
                )
            group_size = GGUF_GROUP
        source = f"from {checkpoint.path.name}"
        stats = _quantize(net, checkpoint, dtype, device, scheme, group_size, keep or set())
    net.quantization = {"scheme": scheme, "group_size": group_size, "source": source, "stats": stats}
    return stats


def stores_integer_blocks(checkpoint: Checkpoint) -> bool:
    """A GGUF file holding tensors in a block type that --quantize gguf runs as stored (Q4_0 ... Q6_K, MXFP4), or a
    checkpoint whose reader serves integer blocks of its own (GPT-OSS's MXFP4 experts: keel.weights.gpt_oss)."""
    names = {t.name for t in BLOCK_TYPES}
    if checkpoint.format == "gguf":
        return any(name in names for name in checkpoint.bytes_by_dtype)
    stores_blocks = getattr(checkpoint.reader, "stores_blocks", None)
    return stores_blocks is not None and stores_blocks()


def release_freed_memory() -> None:
    """Give the allocator's freed pages back to the OS (glibc `malloc_trim`; a no-op elsewhere).

    torch's CPU int4 packing frees large temporaries around the small packed tensor it keeps, and
    glibc does not return such heap holes on its own: without this call after each module, freed
    memory stays resident (several times the packed weights; docs/BENCHMARKS.md, issue 7)."""
    trim_heap()


# ------------------------------------------------------------------------------------ from a checkpoint
def _quantize(
    net: nn.Module,
    checkpoint: Checkpoint,
    dtype: torch.dtype,
    device: torch.device,
    scheme: str,
    group_size: int,
    keep: set[str],
) -> dict[str, int]:
    stats = new_stats()
    for name, module in quantizable(net):
        before = _meta_bytes(module, dtype)
        stats["bytes_before"] += before
        built: nn.Module | None = None
        if not is_kept(name, keep):
            if isinstance(module, GroupedExperts):
                built = _experts(checkpoint, name, module, dtype, device, scheme, group_size)
            else:
                built = _linear(checkpoint, name, module, dtype, device, scheme, group_size)
        if built is None:
            stats["kept"] += 1
            stats["bytes_after"] += before
            continue
        replace_module(net, name, built)
        stats["quantized"] += 1
        stats["experts"] += isinstance(built, QuantizedGroupedExperts)
        stats["bytes_after"] += built.weight_bytes
        release_freed_memory()
    if scheme == GGUF and not is_kept("embed_tokens", keep):
        embedding = _block_embedding(net, checkpoint, dtype, device)
        if embedding is not None:
            net.embed_tokens = embedding
    return stats


def _block_embedding(
    net: nn.Module, checkpoint: Checkpoint, dtype: torch.dtype, device: torch.device
) -> BlockEmbedding | None:
    """The GGUF embedding on its blocks where keel's kernels run: a tied head's codes shared, else the
    file's own token_embd blocks (None: it loads as float)."""
    embed = getattr(net, "embed_tokens", None)
    if not isinstance(embed, nn.Embedding) or not runs_blocks(device, embed.embedding_dim):
        return None
    head = getattr(net, "lm_head", None)
    if checkpoint.config.tie_word_embeddings and head is not None:
        # A float head (kept) reads the embedding's float table: both stay float.
        blocks_head = isinstance(head, QuantizedLinear) and head.layout == "blocks"
        return BlockEmbedding.sharing(head) if blocks_head else None
    blocks = _gguf_blocks(checkpoint, "embed_tokens.weight", (embed.num_embeddings, embed.embedding_dim))
    if blocks is None:
        return None
    return BlockEmbedding.sharing(_from_blocks(blocks, None, dtype, device))


def _meta_bytes(module: nn.Module, dtype: torch.dtype) -> int:
    tensors = (module.gate_up_proj, module.down_proj) if isinstance(module, GroupedExperts) else (module.weight,)
    return sum(t.numel() for t in tensors) * dtype.itemsize


def _linear(
    checkpoint: Checkpoint,
    name: str,
    module: nn.Linear,
    dtype: torch.dtype,
    device: torch.device,
    scheme: str,
    group_size: int,
) -> QuantizedLinear | None:
    n, k = module.out_features, module.in_features
    if scheme == GGUF:
        source = f"{name}.weight"
        if name == "lm_head" and checkpoint.config.tie_word_embeddings:
            # The head is the embedding matrix: its blocks where keel's kernels run them (a copy of the
            # codes, as quantize_model's tied head); the float embedding elsewhere.
            if not runs_blocks(device, k):
                return None
            source = "embed_tokens.weight"
        blocks = _gguf_blocks(checkpoint, source, (n, k))
        if blocks is None or not _blocks_fit(blocks, k, n, device):
            return None
        return _from_blocks(blocks, _bias(checkpoint, name, module, device), dtype, device)
    if not linear_fits(scheme, k, n, group_size):
        return None
    weight = read_float(checkpoint, f"{name}.weight", (n, k)).to(device=device, dtype=dtype)
    return QuantizedLinear.from_float(weight, scheme, group_size, _bias(checkpoint, name, module, device))


def _experts(
    checkpoint: Checkpoint,
    name: str,
    module: GroupedExperts,
    dtype: torch.dtype,
    device: torch.device,
    scheme: str,
    group_size: int,
) -> QuantizedGroupedExperts | None:
    e, two_i, h = module.gate_up_proj.shape
    i = module.down_proj.shape[2]
    if scheme == GGUF:
        gate_up = _gguf_blocks(checkpoint, f"{name}.gate_up_proj", (e, two_i, h))
        down = _gguf_blocks(checkpoint, f"{name}.down_proj", (e, h, i))
        if gate_up is None or down is None:
            return None
        if not (_blocks_fit(gate_up, h, two_i, device) and _blocks_fit(down, i, h, device)):
            return None

        def build(blocks: QuantBlocks, x: int) -> QuantizedLinear:
            mins = None if blocks.mins is None else blocks.mins[x]
            return _from_blocks(
                dataclasses.replace(blocks, codes=blocks.codes[x], scales=blocks.scales[x], mins=mins),
                None,
                dtype,
                device,
            )

        return QuantizedGroupedExperts(
            [build(gate_up, x) for x in range(e)],
            [build(down, x) for x in range(e)],
            module.num_experts,
            *float_parts(module),
        )
    if not experts_fit(scheme, h, i, group_size):
        return None
    stacks = [
        read_float(checkpoint, f"{name}.{p}", shape).to(dtype=dtype)
        for p, shape in (("gate_up_proj", (e, two_i, h)), ("down_proj", (e, h, i)))
    ]
    layers = [[QuantizedLinear.from_float(w.to(device), scheme, group_size) for w in stack] for stack in stacks]
    return QuantizedGroupedExperts(layers[0], layers[1], module.num_experts, *float_parts(module))


def _blocks_fit(blocks: QuantBlocks, in_features: int, out_features: int, device: torch.device) -> bool:
    """Whether the layer's blocks run quantized on `device`: keel's kernels take every form (inputs in
    blocks of 32); torch's take int4 groups of 32 and 8-bit codes with one scale a block of 32."""
    if runs_blocks(device, in_features):
        return True
    if blocks.kind == "int4":
        return int4_fits(in_features, out_features, GGUF_GROUP)
    return blocks.group == GGUF_GROUP and blocks.mins is None and int8_fits(in_features)


def _from_blocks(blocks: QuantBlocks, bias: Tensor | None, dtype: torch.dtype, device: torch.device) -> QuantizedLinear:
    # Scales kept as float16 where that is exact (Q4_0/Q4_1/Q8_0's own), else float32.
    scales, mins = _as_stored(blocks.scales), None if blocks.mins is None else _as_stored(blocks.mins)
    if mins is not None and scales.dtype != mins.dtype:
        scales, mins = scales.float(), mins.float()
    bits = 4 if blocks.kind == "int4" else 8
    return QuantizedLinear.from_blocks(bits, blocks.codes.to(device), scales, mins, bias, dtype)


def _as_stored(values: Tensor) -> Tensor:
    half = values.half()
    return half if torch.equal(half.float(), values.float()) else values.float()


def _gguf_blocks(checkpoint: Checkpoint, keel_name: str, shape: tuple[int, ...]) -> QuantBlocks | None:
    """A keel parameter's codes and scales from the GGUF blocks of its sources, or None when they are
    not all of one integer form (it then loads as float)."""
    reader = checkpoint.reader
    available = reader.names()
    source = hf_source(checkpoint.config, keel_name, available)
    if any(n not in available for n in source.names):
        return None  # load_weights reports what is missing
    parts = [reader.get_blocks(n) for n in source.names]  # type: ignore[attr-defined]
    if any(p is None for p in parts) or len({p.form for p in parts}) != 1:
        return None
    codes = source.combine([p.codes for p in parts])
    scales = source.combine([p.scales for p in parts])
    mins = source.combine([p.mins for p in parts]) if parts[0].mins is not None else None
    if tuple(codes.shape) != shape:
        raise WeightsError(
            f"{checkpoint.path}: tensor {source.names[0]} has shape {list(codes.shape)}, expected {list(shape)} "
            "for this config"
        )
    return dataclasses.replace(parts[0], codes=codes, scales=scales, mins=mins)


def read_float(checkpoint: Checkpoint, keel_name: str, shape: tuple[int, ...]) -> Tensor:
    """One keel parameter from the checkpoint, in its stored precision (the head of a tied model is
    the embedding matrix)."""
    config, reader = checkpoint.config, checkpoint.reader
    if keel_name == "lm_head.weight" and config.tie_word_embeddings:
        keel_name = "embed_tokens.weight"
    available = reader.names()
    source = hf_source(config, keel_name, available)
    missing = [n for n in source.names if n not in available]
    if missing:
        raise WeightsError(f"{checkpoint.path}: tensor {missing[0]!r} is missing (needed for {keel_name})")
    tensor = source.combine([reader.get(n) for n in source.names])
    if tuple(tensor.shape) != shape:
        raise WeightsError(
            f"{checkpoint.path}: tensor {source.names[0]} has shape {list(tensor.shape)}, expected {list(shape)} "
            "for this config"
        )
    return tensor


def _bias(checkpoint: Checkpoint, name: str, module: nn.Linear, device: torch.device) -> Tensor | None:
    if module.bias is None:
        return None
    return read_float(checkpoint, f"{name}.bias", (module.out_features,)).to(device)


# ------------------------------------------------------------------------------ saved (keel quantize save)
def saved_base(config: ModelConfig, module_name: str, module: nn.Module) -> str:
    """The name prefix of a quantized module's tensors: its HF weight name without `.weight`
    (`model.layers.0.self_attn.q_proj`, `lm_head`), or, for experts, the HF experts prefix
    (`model.layers.0.block_sparse_moe.experts`) followed by `.gate_up_proj` / `.down_proj`."""
    if isinstance(module, GroupedExperts | QuantizedGroupedExperts):
        per_expert = hf_source(config, f"{module_name}.down_proj", set()).names[0]
        return per_expert.split(".experts.")[0] + ".experts"
    return hf_source(config, f"{module_name}.weight", set()).names[0].removesuffix(".weight")


def _load_saved(net: nn.Module, checkpoint: Checkpoint, dtype: torch.dtype, device: torch.device) -> dict[str, int]:
    quant = checkpoint.quantization or {}
    scheme, group_size = quant["scheme"], int(quant.get("group_size") or 0)
    not_converted = set(quant.get("modules_not_converted", []))
    stats = new_stats()
    for name, module in quantizable(net):
        before = _meta_bytes(module, dtype)
        stats["bytes_before"] += before
        if name in not_converted:
            stats["kept"] += 1
            stats["bytes_after"] += before
            continue
        base = saved_base(checkpoint.config, name, module)
        built: nn.Module
        if isinstance(module, GroupedExperts):
            e, two_i, h = module.gate_up_proj.shape
            i = module.down_proj.shape[2]
            gate_up = _saved(checkpoint, f"{base}.gate_up_proj", name, scheme, group_size, (e, two_i, h), dtype, device)
            down = _saved(checkpoint, f"{base}.down_proj", name, scheme, group_size, (e, h, i), dtype, device)
            built = QuantizedGroupedExperts(gate_up, down, module.num_experts, *float_parts(module))
            stats["experts"] += 1
        else:
            shape = (module.out_features, module.in_features)
            bias = _bias(checkpoint, name, module, device)
            built = _saved(checkpoint, base, name, scheme, group_size, shape, dtype, device, bias)[0]
        replace_module(net, name, built)
        stats["quantized"] += 1
        stats["bytes_after"] += built.weight_bytes
    return stats


def _saved(
    checkpoint: Checkpoint,
    base: str,
    module_name: str,
    scheme: str,
    group_size: int,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
    bias: Tensor | None = None,
) -> list[QuantizedLinear]:
    """The QuantizedLinear(s) of one saved matrix ([N, K], or [E, N, K] experts), checked."""
    *lead, n, k = shape
    if scheme == "int8":
        expected = {"qweight": (torch.int8, (*lead, n, k)), "scales": (torch.float32, (*lead, n))}
    else:
        groups = k // group_size
        expected = {
            "qweight": (torch.uint8, (*lead, n, k // 2)),
            "scales": (torch.float32, (*lead, n, groups)),
            "mins": (torch.float32, (*lead, n, groups)),
        }
    reader, path = checkpoint.reader, checkpoint.path
    available = reader.names()
    tensors = {}
    for part, (want_dtype, want_shape) in expected.items():
        name = f"{base}.{part}"
        if name not in available:
            raise WeightsError(f"{path}: quantized tensor {name!r} is missing (needed for {module_name}, {scheme})")
        t = reader.get(name)
        if t.dtype != want_dtype or tuple(t.shape) != want_shape:
            raise WeightsError(
                f"{path}: quantized tensor {name!r} is {str(t.dtype).removeprefix('torch.')} {list(t.shape)}, "
                f"expected {str(want_dtype).removeprefix('torch.')} {list(want_shape)} ({scheme})"
            )
        if t.is_floating_point() and not torch.isfinite(t).all():
            raise WeightsError(f"{path}: quantized tensor {name!r} has non-finite values")
        tensors[part] = t
    flat = lambda t: t.reshape(-1, *t.shape[len(lead) :])  # noqa: E731 - [E, ...] or one matrix as [1, ...]
    q, scales = flat(tensors["qweight"]), flat(tensors["scales"])
    if scheme == "int8":
        return [QuantizedLinear.from_int8(q[x].to(device), scales[x], bias, dtype) for x in range(q.shape[0])]
    mins = flat(tensors["mins"])
    return [
        QuantizedLinear.from_int4(unpack_nibbles(q[x].to(device)), scales[x], mins[x], group_size, bias, dtype)
        for x in range(q.shape[0])
    ]
