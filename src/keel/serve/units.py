"""Numbers as people type them on a command line: `32k` tokens, as vLLM reads them."""

from __future__ import annotations

import re

_HUMAN_INT = re.compile(r"(\d+(?:\.\d+)?)([kKmMgGtT])")
# vLLM's human_readable_int: a lowercase suffix is decimal, an uppercase one binary (1k = 1000, 1K = 1024).
_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def human_readable_int(text: str) -> int:
    """'32k' -> 32000, '32K' -> 32768, '25.6k' -> 25600, '4096' -> 4096; ValueError with a message otherwise
    (keel.cli shows it as the option's error)."""
    value = text.strip()
    match = _HUMAN_INT.fullmatch(value)
    if match is None:
        try:
            return int(value)
        except ValueError:
            raise ValueError(f"{text!r} is not an integer (such as 4096, 32k = 32000, 32K = 32768)") from None
    number, suffix = match.groups()
    if suffix in _DECIMAL:
        return int(float(number) * _DECIMAL[suffix])
    if "." in number:  # as vLLM: a binary multiple of a fraction is most likely a typo for the decimal one
        raise ValueError(f"{text!r}: decimals need a decimal suffix ({number}{suffix.lower()})")
    return int(number) * _BINARY[suffix]


AUTO_LENGTH = -1  # --max-model-len auto (vLLM's -1): the longest length the KV cache holds, up to the model's context


def model_length(text: str) -> int:
    """--max-model-len: a human-readable integer, or 'auto' / -1 (`AUTO_LENGTH`), as vLLM reads it."""
    if text.strip().lower() in ("auto", str(AUTO_LENGTH)):
        return AUTO_LENGTH
    return human_readable_int(text)
