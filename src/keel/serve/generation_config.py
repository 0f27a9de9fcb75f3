"""The model's recommended sampling defaults: its generation_config.json, read as vLLM's `--generation-config`.

"auto" (vLLM's default) reads the file from the model's directory, "vllm" reads none, a PATH reads the file in
that folder (or the file itself). The sampling fields vLLM applies are taken, each one that is set (HF's
max_new_tokens is vLLM's max_tokens); a request that omits a field gets the file's value (vLLM's
`get_diff_sampling_param`). A model that is not a directory (a .gguf file, a catalog name) has no file, so no
defaults under "auto".
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from keel.errors import KeelError

GENERATION_CONFIG_FILE = "generation_config.json"
# The fields of generation_config.json that become sampling defaults, with their types (vLLM's list).
SAMPLING_FIELDS: dict[str, type] = {
    "temperature": float,
    "top_p": float,
    "top_k": int,
    "min_p": float,
    "repetition_penalty": float,
    "max_new_tokens": int,
}


def sampling_defaults(model: str | Path | None, generation_config: str = "auto") -> dict[str, Any]:
    """The sampling parameters by SamplingParams' names (max_tokens for max_new_tokens); {} when none apply
    (`model` None: a model with no directory). KeelError naming the file and field for a file that cannot be used."""
    if generation_config == "vllm":
        return {}
    if generation_config == "auto":
        if model is None:
            return {}
        path = Path(model) / GENERATION_CONFIG_FILE
        return read_sampling_defaults(path) if path.is_file() else {}
    path = Path(generation_config)
    if path.is_dir():
        path = path / GENERATION_CONFIG_FILE
    if not path.is_file():
        raise KeelError(f"--generation-config {generation_config}: no {GENERATION_CONFIG_FILE} there")
    return read_sampling_defaults(path)


def read_sampling_defaults(path: Path) -> dict[str, Any]:
    try:
        raw = json.loads(path.read_text())
    except OSError as e:
        raise KeelError(f"{path}: cannot read ({e.strerror})") from None
    except json.JSONDecodeError as e:
        raise KeelError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(raw, dict):
        raise KeelError(f"{path}: expected a JSON object")
    defaults: dict[str, Any] = {}
    for name, kind in SAMPLING_FIELDS.items():
        value = raw.get(name)
        if value is None:
            continue
        defaults["max_tokens" if name == "max_new_tokens" else name] = _number(path, name, value, kind)
    _check_ranges(path, defaults)
    return defaults


def _number(path: Path, name: str, value: Any, kind: type) -> int | float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise KeelError(f"{path}: {name} must be a number, got {value!r}")
    if kind is int and value != int(value):
        raise KeelError(f"{path}: {name} must be an integer, got {value!r}")
    return kind(value)


def _check_ranges(path: Path, defaults: dict[str, Any]) -> None:
    """The values SamplingParams accepts (its own message names the field)."""
    from keel.serve.sampling import SamplingParams

    if defaults.get("max_tokens", 1) < 1:
        raise KeelError(f"{path}: max_new_tokens must be >= 1, got {defaults['max_tokens']}")
    try:
        SamplingParams(**defaults).validate()
    except KeelError as e:
        raise KeelError(f"{path}: {e}") from None


def describe(defaults: dict[str, Any]) -> str:
    """The defaults as the start-up log shows them."""
    return ", ".join(f"{name}={value}" for name, value in defaults.items())
