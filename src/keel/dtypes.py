"""The float dtypes keel loads, trains and writes models in, by the names configs and `--dtype` use."""

from __future__ import annotations

import torch

from keel.errors import KeelError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# `--dtype` choices: "auto" lets keel.platform pick the compute dtype for the host and checkpoint.
DTYPE_CHOICES = ("auto", *DTYPES)
# vLLM's (and torch's) other spellings, read as the names above wherever a dtype is given.
DTYPE_ALIASES = {"half": "float16", "float": "float32"}


def canonical_dtype(name: str) -> str:
    """`name` with vLLM's aliases resolved ("half" -> "float16", "float" -> "float32")."""
    return DTYPE_ALIASES.get(name, name)


def parse_dtype(name: str) -> torch.dtype:
    """A dtype name (see DTYPES, or an alias) as a torch dtype."""
    try:
        return DTYPES[canonical_dtype(name)]
    except KeyError:
        raise KeelError(f"--dtype {name!r} is not supported (choose from {', '.join(DTYPES)})") from None
