"""`keel quantize save`: write a quantized model to disk as portable integer tensors.

`keel quantize save MODEL --quantize int4 --quant-group-size 64 --out DIR` writes an HF-style
directory (safetensors shards + index, config.json, generation_config.json, tokenizer files)
atomically (a temporary sibling, renamed at the end), streaming: one module's float weights are
read, quantized and queued at a time. `keel serve DIR` / `load_model(DIR)` rebuild the quantized
layers from those tensors without expanding them to float.

Format (config.json `quantization_config`: {"quant_method": "keel", "scheme", "group_size",
"modules_not_converted": [keel module names kept in float], "format": 1}). For a quantized module
whose HF weight is `P.weight` (experts: `P = <HF experts prefix>.gate_up_proj` / `.down_proj`,
stacked [E, ...] in keel's layout, gate rows then up rows):
- int8: `P.qweight` int8 [N, K]; `P.scales` float32 [N]; w = qweight * scales[:, None];
- int4: `P.qweight` uint8 [N, K/2], column 2j in the low nibble of byte j, 2j+1 in the high one;
  `P.scales`, `P.mins` float32 [N, K/g]; w = q * scale + min per group of g input channels.
The kernels' packed layouts are device- and torch-version-specific, so they are never written.
Biases, embeddings, norms and kept layers are ordinary HF-named float tensors in the saved dtype.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import Tensor, nn

from keel.dtypes import parse_dtype
from keel.errors import KeelError
from keel.model.moe import GroupedExperts
from keel.model.transformer import Transformer
from keel.quant.apply import check_keep, check_scheme, is_kept, linear_fits, quantizable
from keel.quant.experts import experts_fit
from keel.quant.linear import SCHEMES, pack_nibbles, quantize_int4, quantize_int8
from keel.quant.on_load import saved_base
from keel.weights.checkpoint import Checkpoint
from keel.weights.convert import (
    DEFAULT_MAX_SHARD_BYTES,
    _check_destination,
    _owned,
    _write_metadata,
    _write_tensors,
    output_dtype,
    write_model_dir,
)
from keel.weights.loader import checked_tensors, open_checkpoint
from keel.weights.names import keel_to_hf

FORMAT_VERSION = 1


def save_quantized(
    model: str | Path,
    dst: str | Path,
    scheme: str,
    group_size: int = 128,
    keep: set[str] | tuple[str, ...] = ("lm_head",),
    dtype: str | None = None,
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
) -> dict:
    """Quantize `model` (any checkpoint keel opens) and write it to `dst`; returns the written
    quantization_config. `dtype`: of the float tensors and of the weights before quantization
    (default: the checkpoint's, as `output_dtype` picks it), so that loading the result equals
    `load_model(model, dtype, quantize=scheme)` bit for bit."""
    if scheme not in SCHEMES:
        raise KeelError(f"--quantize: keel quantize save writes {' or '.join(SCHEMES)}, not {scheme!r}")
    check_scheme(scheme, group_size)
    dst = _check_destination(Path(dst), overwrite)
    checkpoint = open_checkpoint(model)

    def write(tmp: Path) -> dict:
        if checkpoint.quantization is not None:
            raise KeelError(f"{checkpoint.path}: already quantized ({checkpoint.quantization['scheme']})")
        written = output_dtype(checkpoint, dtype)
        return _write(checkpoint, tmp, written, scheme, group_size, set(keep), max_shard_bytes)

    return write_model_dir(checkpoint, dst, overwrite, write)


def _write(
    checkpoint: Checkpoint, out: Path, dtype: str, scheme: str, group_size: int, keep: set[str], max_shard_bytes: int
) -> dict:
    config = dataclasses.replace(checkpoint.config, dtype=dtype)
    with torch.device("meta"):
        skeleton = Transformer(checkpoint.config)
    check_keep(skeleton, keep)
    targets: dict[str, nn.Module] = {}
    not_converted = []
    for name, module in quantizable(skeleton):
        if isinstance(module, GroupedExperts):
            fits = experts_fit(scheme, module.down_proj.shape[1], module.down_proj.shape[2], group_size)
        else:
            fits = linear_fits(scheme, module.in_features, module.out_features, group_size)
        if fits and not is_kept(name, keep):
            targets[name] = module
        else:
            not_converted.append(name)
    tensors = _tensors(checkpoint, skeleton, config, parse_dtype(dtype), scheme, group_size, targets)
    _write_tensors(tensors, out, max_shard_bytes)
    _write_metadata(config, checkpoint.tokenizer, out)
    quant = {
        "quant_method": "keel",
        "format": FORMAT_VERSION,
        "scheme": scheme,
        "group_size": group_size if scheme == "int4" else None,
        "modules_not_converted": not_converted,
    }
    config_path = out / "config.json"
    hf = json.loads(config_path.read_text())
    hf["quantization_config"] = quant
    config_path.write_text(json.dumps(hf, indent=2) + "\n")
    return quant


def _tensors(
    checkpoint: Checkpoint,
    skeleton: Transformer,
    config,
    dtype: torch.dtype,
    scheme: str,
    group_size: int,
    targets: dict[str, nn.Module],
) -> Iterator[tuple[str, Tensor]]:
    """Every tensor to write, one keel parameter at a time: quantized modules' weights as portable
    integer tensors, everything else as HF-named float tensors."""
    head_from_embedding = config.tie_word_embeddings and "lm_head" in targets
    for name, tensor in checked_tensors(skeleton, checkpoint):
        module_name, _, leaf = name.rpartition(".")
        module = targets.get(module_name)
        if module is not None and leaf in ("weight", "gate_up_proj", "down_proj"):
            base = saved_base(config, module_name, module)
            if isinstance(module, GroupedExperts):
                base = f"{base}.{leaf}"
            yield from portable(base, tensor.to(dtype), scheme, group_size)
            continue
        for hf_name, hf_tensor in keel_to_hf(config, [(name, tensor)], fuse=False).items():
            yield hf_name, _owned(hf_tensor.to(dtype))
        if name == "embed_tokens.weight" and head_from_embedding:
            # A tied head that is quantized is its own copy of the embedding matrix (as quantize_model makes it).
            yield from portable("lm_head", tensor.to(dtype), scheme, group_size)


def portable(base: str, weight: Tensor, scheme: str, group_size: int) -> Iterator[tuple[str, Tensor]]:
    """The portable integer tensors of a float weight [N, K] or stacked [E, N, K] (see the module doc)."""
    stack = weight.reshape(-1, *weight.shape[-2:])
    if scheme == "int8":
        parts = [quantize_int8(w) for w in stack]
        q = torch.stack([p[0] for p in parts]).reshape(weight.shape)
        yield f"{base}.qweight", q
        yield f"{base}.scales", torch.stack([p[1] for p in parts]).reshape(*weight.shape[:-1])
        return
    parts4 = [quantize_int4(w, group_size) for w in stack]
    lead = weight.shape[:-1]
    yield f"{base}.qweight", pack_nibbles(torch.stack([p[0] for p in parts4])).reshape(*lead, -1)
    yield f"{base}.scales", torch.stack([p[1] for p in parts4]).reshape(*lead, -1)
    yield f"{base}.mins", torch.stack([p[2] for p in parts4]).reshape(*lead, -1)
