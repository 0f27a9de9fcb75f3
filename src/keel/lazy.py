"""Package exports that load on first use: a package whose `__init__` re-exported its modules' names would import
them all (torch among them) whenever any of its modules is imported, so the CLI could not parse a command without
torch. Such a package sets `__getattr__ = lazy_exports(__name__, {name: module})`."""

from __future__ import annotations

from collections.abc import Callable
from importlib import import_module
from typing import Any


def lazy_exports(package: str, homes: dict[str, str]) -> Callable[[str], Any]:
    """A module `__getattr__` that imports `homes[name]` on first access of `name`."""

    def __getattr__(name: str) -> Any:
        if name in homes:
            return getattr(import_module(homes[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
