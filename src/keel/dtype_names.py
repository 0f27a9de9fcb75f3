"""The names of the float dtypes keel loads, trains and writes models in, without torch (the CLI parses them
before any torch import: `keel train --nproc N` execs torchrun without ever importing it); keel.dtypes maps
them to torch dtypes."""

from __future__ import annotations

DTYPE_NAMES = ("float32", "bfloat16", "float16")
# `--dtype` choices: "auto" lets keel.platform pick the compute dtype for the host and checkpoint.
DTYPE_CHOICES = ("auto", *DTYPE_NAMES)
# vLLM's (and torch's) other spellings, read as the names above wherever a dtype is given.
DTYPE_ALIASES = {"half": "float16", "float": "float32"}
# KV-cache storage (`--kv-cache-dtype`): "auto" is the model's dtype (keel.model.kv_size).
KV_CACHE_DTYPES = ("auto", "bfloat16", "int8")


def canonical_dtype(name: str) -> str:
    """`name` with vLLM's aliases resolved ("half" -> "float16", "float" -> "float32")."""
    return DTYPE_ALIASES.get(name, name)
