"""`run.deterministic`: torch's deterministic kernels for a run, and the previous settings back at its end.

On a GPU, attention's backward and cuBLAS accumulate in an order that can vary between two runs of the same
step, so a resumed run matches the straight one only to the last bits unless every kernel is deterministic.
cuBLAS reads its workspace setting when its first handle is made: the variable is set before any product
runs (a `keel train` process makes none before the trainer starts; a user's own value wins).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

CUBLAS_WORKSPACE = ":4096:8"


def deterministic_kernels(enabled: bool) -> Callable[[], None]:
    """Turn torch's deterministic algorithms on (when `enabled`); returns what puts the previous state back."""
    if not enabled:
        return lambda: None
    previous = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
    )
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False

    def restore() -> None:
        enabled_before, warn_only, cudnn_deterministic, cudnn_benchmark = previous
        torch.use_deterministic_algorithms(enabled_before, warn_only=warn_only)
        torch.backends.cudnn.deterministic = cudnn_deterministic
        torch.backends.cudnn.benchmark = cudnn_benchmark

    return restore
