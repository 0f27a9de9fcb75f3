"""The version manifest of an eval run: everything that decides what was evaluated, so two result
files can be told apart (and `keel eval compare` can say what changed between them).

Recorded: the weights (sha256 of every weight file and of the set), the model config, the tokenizer
(sha256 of its serialised form) and chat template (sha256 of its text), the quantization, the engine
options that can change outputs (dtype, compile, speculative decoding, KV-cache dtype, fused and
pre-packed weights), the sampling of every suite, keel's version and git commit, and the machine.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import platform
import subprocess
import time
from pathlib import Path
from typing import Any

import torch

from keel.platform import cpu_model, host
from keel.serve.engine import LLMEngine
from keel.version import __version__

_WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt", ".distcp")
_HASH_CHUNK = 1 << 22


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def sha256_text(text: str | None) -> str | None:
    return None if text is None else hashlib.sha256(text.encode("utf-8")).hexdigest()


def weights_fingerprint(path: Path) -> dict[str, Any]:
    """sha256 of each weight file (a file, or a directory's weight files and config.json), and of
    the sorted list of (name, sha256): one hash naming the whole checkpoint."""
    if path.is_file():
        files = [path]
    else:
        # The directory's own files (not sub-directories such as checkpoint-*/ or optimizer states).
        wanted = [p for p in path.glob("*") if p.suffix in _WEIGHT_SUFFIXES or p.name == "config.json"]
        files = sorted(p for p in wanted if p.is_file())
    hashes = {str(p.relative_to(path) if path.is_dir() else p.name): sha256_file(p) for p in files}
    combined = hashlib.sha256("".join(f"{name}\0{h}\n" for name, h in sorted(hashes.items())).encode()).hexdigest()
    return {"path": str(path), "sha256": combined, "bytes": sum(p.stat().st_size for p in files), "files": hashes}


def git_commit() -> dict[str, Any]:
    """The commit keel runs from (and whether the tree had changes), when it runs from a git checkout."""
    root = Path(__file__).resolve().parents[3]  # src/keel/eval/manifest.py -> the checkout

    def git(*args: str) -> str | None:
        try:
            proc = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return proc.stdout.strip() if proc.returncode == 0 else None

    top = git("rev-parse", "--show-toplevel")
    if top is None or Path(top).resolve() != root:  # an installed keel inside some other repository
        return {"commit": None, "dirty": None}
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": git("rev-parse", "HEAD"), "dirty": None if status is None else bool(status)}


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }
    info["isa"] = host().describe()  # results differ by the fast paths taken (keel.platform)
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def engine_options(engine: LLMEngine) -> dict[str, Any]:
    """The engine settings that can change outputs, as they ended up (not only as asked for)."""
    config = engine.config
    spec = engine.spec
    return {
        "dtype": str(engine.model.dtype).removeprefix("torch."),
        "compile": engine.runner.compiled is not None,
        "compile_requested": config.load.compile,
        "speculative": dataclasses.asdict(spec) if spec is not None else None,
        "kv_cache_dtype": config.cache.kv_cache_dtype,
        "block_size": config.cache.block_size,
        "fuse_projections": config.load.fuse_projections,
        "prepack_weights": config.load.prepack_weights,
        "enable_prefix_caching": config.cache.enable_prefix_caching,
        "max_num_batched_tokens": engine.max_num_batched_tokens,
        "max_model_len": engine.max_model_len,
        "device": str(engine.model.device),
    }


def _quantization(quant: dict | None, engine: LLMEngine) -> dict[str, Any] | None:
    if quant is None:
        return None
    record = {k: v for k, v in quant.items() if k != "stats"}
    if record.get("scheme") == "int8":
        record["group_size"] = None  # per output channel: the int4 group-size option does not apply
    quant = engine.config.quant
    return {**record, "keep": list(quant.kept(record.get("scheme"))), "keep_as": quant.quant_keep_as}


def build_manifest(model: str, engine: LLMEngine, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The manifest of an eval of `model` (the name the user gave) served by `engine`."""
    loaded = engine.loaded
    checkpoint = loaded.checkpoint
    tokenizer = loaded.tokenizer
    quant = getattr(engine.model, "quantization", None)
    return {
        "model": model,
        "weights": {"format": checkpoint.format, **weights_fingerprint(Path(checkpoint.path))},
        "config": dataclasses.asdict(checkpoint.config),
        "tokenizer_sha256": sha256_text(tokenizer.tokenizer.to_str()) if tokenizer else None,
        "chat_template_sha256": sha256_text(tokenizer.chat_template) if tokenizer else None,
        "quantization": _quantization(quant, engine),
        "engine": engine_options(engine),
        "keel": {"version": __version__, **git_commit()},
        "machine": machine(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        **(extra or {}),
    }
