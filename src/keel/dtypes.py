"""The float dtypes keel loads, trains and writes models in, by the names configs and `--dtype` use
(keel.dtype_names, which the CLI reads without torch)."""

from __future__ import annotations

import torch

from keel.dtype_names import DTYPE_NAMES, canonical_dtype
from keel.errors import KeelError

DTYPES = dict(zip(DTYPE_NAMES, (torch.float32, torch.bfloat16, torch.float16), strict=True))


def parse_dtype(name: str) -> torch.dtype:
    """A dtype name (see DTYPES, or an alias) as a torch dtype."""
    try:
        return DTYPES[canonical_dtype(name)]
    except KeyError:
        raise KeelError(f"--dtype {name!r} is not supported (choose from {', '.join(DTYPES)})") from None
