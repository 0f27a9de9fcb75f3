"""Options several commands share: the model argument, --dtype, --threads."""

from __future__ import annotations

import argparse

from keel.dtype_names import DTYPE_ALIASES, DTYPE_CHOICES, canonical_dtype
from keel.errors import KeelError
from keel.quant.config import QUANTIZE_CHOICES


def add_model_args(p: argparse.ArgumentParser) -> None:
    """MODEL and the two shape hints for a checkpoint without config.json."""
    p.add_argument("model", metavar="MODEL", help="HF directory, .gguf file, or catalog name")
    p.add_argument("--head-dim", type=int, default=None, help="head size, when config.json is missing")
    p.add_argument("--num-heads", type=int, default=None, help="attention heads, when config.json is missing")


def add_dtype_arg(
    p: argparse.ArgumentParser, default: str = "auto", choices: tuple[str, ...] = DTYPE_CHOICES, help: str = ""
) -> None:
    aliases = [alias for alias, name in DTYPE_ALIASES.items() if name in choices]  # vLLM's half and float
    p.add_argument("--dtype", default=default, choices=[*choices, *aliases], type=canonical_dtype, help=help or None)


def add_quantize_arg(p: argparse.ArgumentParser, help: str) -> None:
    """--quantize as `keel serve` takes it, for commands that load a model without the engine's options."""
    p.add_argument("--quantize", default="auto", choices=list(QUANTIZE_CHOICES), help=help)


def positive_int(text: str) -> int:
    """An argparse type: a whole number of at least 1 (a thread count, a step count)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def add_threads_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads")


def set_threads(threads: int | None) -> None:
    if threads is not None and threads < 1:
        raise KeelError(f"--threads must be a positive number of threads, got {threads}")
    if threads:
        import torch

        torch.set_num_threads(threads)
