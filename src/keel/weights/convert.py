"""Export any model keel opens (HF directory, directory without config, GGUF, catalog name) as an
HF-format directory that transformers loads: config.json, (sharded) safetensors with hub tensor
names, tokenizer files with the chat template, and generation_config.json.

Tensors are streamed: each keel parameter is read from the source, mapped to its HF names and
written shard by shard, so peak memory is about one shard rather than the whole model.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import torch
from safetensors.torch import save_file
from torch import Tensor

from keel.atomic import fsync_dir, fsync_tree, replace_dir
from keel.config import ModelConfig
from keel.dtypes import DTYPES, parse_dtype
from keel.errors import KeelError
from keel.model.transformer import Transformer
from keel.tokenizer import Tokenizer
from keel.weights.checkpoint import Checkpoint
from keel.weights.loader import checked_tensors, open_checkpoint
from keel.weights.names import fused_stream, keel_to_hf
from keel.weights.safetensors import INDEX_FILE, SINGLE_FILE

T = TypeVar("T")

DEFAULT_MAX_SHARD_BYTES = 2 * 1024**3
# Storage types that are plain floating point; anything else in a GGUF file is a quantized block format.
_FLOAT_STORAGE = {"F64", "F32", "F16", "BF16"}
# transformers refuses safetensors files whose metadata does not name the framework.
_METADATA = {"format": "pt"}


def output_dtype(checkpoint: Checkpoint, dtype: str | None) -> str:
    """The dtype to write: as asked, or "auto" = the checkpoint's own dtype.

    Quantized GGUF weights have no float dtype of their own; bfloat16 keeps their range at half
    the size of float32 (dequantized 4/8-bit values need no more precision than that).
    """
    if dtype not in (None, "auto"):
        parse_dtype(dtype)  # one-line KeelError naming --dtype for an unknown name
        return dtype
    if checkpoint.format == "gguf" and any(t.upper() not in _FLOAT_STORAGE for t in checkpoint.bytes_by_dtype):
        return "bfloat16"
    if checkpoint.config.dtype not in DTYPES:
        return "bfloat16"
    return checkpoint.config.dtype


def convert(
    model: str | Path,
    dst: str | Path,
    dtype: str | None = None,
    head_dim: int | None = None,
    num_heads: int | None = None,
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
) -> Path:
    """Write `model` as an HF directory at `dst` (atomically) and return its path."""
    dst = _check_destination(Path(dst), overwrite)
    if max_shard_bytes <= 0:
        raise KeelError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    checkpoint = open_checkpoint(model, head_dim=head_dim, num_heads=num_heads)
    if checkpoint.bitnet is not None:  # its float tensors without the int8 activations would be another model
        raise KeelError(
            f"{model}: a BitNet checkpoint's ternary layers (quantization_config, quant_method 'bitnet') are not "
            "converted; load or serve it with keel itself"
        )
    write_model_dir(
        checkpoint,
        dst,
        overwrite,
        lambda tmp: _write(checkpoint, tmp, output_dtype(checkpoint, dtype), max_shard_bytes),
    )
    return dst


def write_model_dir(checkpoint: Checkpoint, dst: Path, overwrite: bool, write: Callable[[Path], T]) -> T:
    """`write(tmp)` into a temporary sibling of `dst` (same file system, so the final rename is atomic),
    then the checkpoint is closed and the directory moved into place: a failure or an interrupt never
    leaves a half-written model at dst. Returns what `write` returned."""
    try:
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", suffix=".tmp", dir=dst.parent))
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the result is an ordinary model directory
        try:
            result = write(tmp)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    finally:
        checkpoint.reader.close()  # before the rename: dst may be the source itself (overwrite=True)
    try:
        _move_into_place(tmp, dst, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return result


def _check_destination(dst: Path, overwrite: bool) -> Path:
    """`dst` as an absolute path, once it is known to be one the model can be moved to."""
    if dst.is_file() or dst.is_symlink():
        raise KeelError(f"{dst}: exists and is not a directory")
    if dst.is_dir() and any(dst.iterdir()) and not overwrite:
        raise KeelError(f"{dst}: directory exists and is not empty (pass --overwrite to replace it)")
    absolute = dst.resolve()
    # The model is written beside dst and renamed over it: a directory that is, or holds, the current
    # one would be renamed away under the shell that asked for it ("." or a parent of it).
    if dst.is_dir() and (absolute == Path.cwd().resolve() or absolute in Path.cwd().resolve().parents):
        raise KeelError(f"{dst}: is the current directory or holds it; name a directory below it instead")
    return absolute


def _move_into_place(tmp: Path, dst: Path, overwrite: bool) -> None:
    if dst.is_dir() and any(dst.iterdir()):
        if not overwrite:  # appeared while we were writing
            raise KeelError(f"{dst}: directory exists and is not empty (pass --overwrite to replace it)")
        fsync_tree(tmp)  # the new model on disk before a rename publishes it
        # Move the old directory aside first, so dst is never missing a complete model for long
        # and the old one is only deleted once the new one is in place.
        old = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", suffix=".old", dir=dst.parent))
        try:
            os.replace(dst, old / "model")
        except BaseException:
            old.rmdir()
            raise
        try:
            os.replace(tmp, dst)
        except BaseException:
            os.replace(old / "model", dst)  # the old model back where it was
            old.rmdir()
            raise
        fsync_dir(dst.parent)
        shutil.rmtree(old, ignore_errors=True)
        return
    replace_dir(tmp, dst)  # replaces an empty directory too


def _write(checkpoint: Checkpoint, out: Path, dtype: str, max_shard_bytes: int) -> None:
    config = dataclasses.replace(checkpoint.config, dtype=dtype)
    _write_tensors(_hf_tensors(checkpoint, config, parse_dtype(dtype)), out, max_shard_bytes)
    _write_metadata(config, checkpoint.tokenizer, out)


def _write_metadata(config: ModelConfig, tokenizer: Tokenizer | None, out: Path) -> None:
    hf = config.exported_hf()
    hf["dtype"] = config.dtype
    _write_json(out / "config.json", hf)
    _write_json(out / "generation_config.json", _generation_config(config))
    if tokenizer is not None:
        tokenizer.save_hf(out)


def save_model(
    model: Transformer,
    tokenizer: Tokenizer | None,
    dst: str | Path,
    dtype: str = "float32",
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
) -> Path:
    """Write a model held in memory (e.g. one keel built) as an HF directory at `dst`, atomically."""
    dst = _check_destination(Path(dst), overwrite)
    config = dataclasses.replace(model.config, dtype=dtype)
    torch_dtype = parse_dtype(dtype)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", suffix=".tmp", dir=dst.parent))
    os.chmod(tmp, 0o755)
    try:
        state = ((name, t.detach()) for name, t in model.state_dict().items())
        tensors = ((n, _owned(t.to(torch_dtype))) for n, t in keel_to_hf(config, state).items())
        _write_tensors(tensors, tmp, max_shard_bytes)
        _write_metadata(config, tokenizer, tmp)
        _move_into_place(tmp, dst, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dst


def _generation_config(config: ModelConfig) -> dict[str, Any]:
    gen: dict[str, Any] = {"bos_token_id": config.bos_token_id}
    eos = config.eos_token_id
    gen["eos_token_id"] = eos[0] if len(eos) == 1 else (list(eos) or None)
    if config.pad_token_id is not None:
        gen["pad_token_id"] = config.pad_token_id
    return gen


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")


def _hf_tensors(checkpoint: Checkpoint, config: ModelConfig, dtype: torch.dtype) -> Iterator[tuple[str, Tensor]]:
    """HF hub-named tensors of the checkpoint, one keel parameter at a time, in `dtype`."""
    with torch.device("meta"):  # names and shapes only; no memory
        skeleton = Transformer(checkpoint.config)
    # named_parameters lists a tied head once (as embed_tokens); keel_to_hf drops lm_head when tied.
    parts = (
        item
        for name, tensor in checked_tensors(skeleton, checkpoint)
        for item in keel_to_hf(config, [(name, tensor)], fuse=False).items()
    )
    for hf_name, hf_tensor in fused_stream(config, parts):
        yield hf_name, _owned(hf_tensor.to(dtype))


def _owned(tensor: Tensor) -> Tensor:
    """A contiguous tensor that owns all of its storage: safetensors refuses views that share memory
    (per-expert slices of a stacked tensor are such views)."""
    tensor = tensor.contiguous()
    if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
        tensor = tensor.clone()
    return tensor


def _write_tensors(tensors: Iterator[tuple[str, Tensor]], out: Path, max_shard_bytes: int) -> None:
    """Safetensors shards of at most max_shard_bytes (one file when it fits), with the hub's index."""
    shards: list[list[str]] = []  # tensor names per written shard
    pending: dict[str, Tensor] = {}
    pending_bytes = total = 0

    def flush() -> None:
        nonlocal pending, pending_bytes
        if pending:
            path = out / f"shard-{len(shards):05d}.safetensors"
            save_file(pending, str(path), metadata=_METADATA)
            os.chmod(path, 0o644)  # safetensors creates its files private (0600); a model directory is readable
            shards.append(list(pending))
            pending, pending_bytes = {}, 0

    for name, tensor in tensors:
        size = tensor.numel() * tensor.element_size()
        if pending and pending_bytes + size > max_shard_bytes:
            flush()  # a tensor larger than the limit still gets a shard of its own
        pending[name] = tensor
        pending_bytes += size
        total += size
    flush()

    if len(shards) == 1:
        os.replace(out / "shard-00000.safetensors", out / SINGLE_FILE)
        return
    # The shard count is known only now: rename to the hub's model-0000i-of-0000n names.
    weight_map: dict[str, str] = {}
    for i, names in enumerate(shards):
        file_name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        os.replace(out / f"shard-{i:05d}.safetensors", out / file_name)
        weight_map.update(dict.fromkeys(names, file_name))
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    _write_json(out / INDEX_FILE, index)
