"""The float dtypes keel loads, trains and writes models in, by the names configs and `--dtype` use."""

from __future__ import annotations

import torch

from keel.errors import KeelError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# `--dtype` choices: "auto" lets keel.platform pick the compute dtype for the host and checkpoint.
DTYPE_CHOICES = ("auto", *DTYPES)


def parse_dtype(name: str) -> torch.dtype:
    """A dtype name (see DTYPES) as a torch dtype."""
    try:
        return DTYPES[name]
    except KeyError:
        raise KeelError(f"--dtype {name!r} is not supported (choose from {', '.join(DTYPES)})") from None
