"""Parsers by name, as vLLM's `--tool-call-parser` and `--reasoning-parser` take them; users add their own."""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T", bound=type)


class ParserRegistry(Generic[T]):
    """Subclasses of `base` by name. `register(*names)` is a class decorator; a later registration under a
    taken name replaces the earlier one, so a user can override a built-in."""

    def __init__(self, base: T, kind: str, decorator: str) -> None:
        self.base, self.kind, self.decorator = base, kind, decorator
        self.classes: dict[str, T] = {}

    def register(self, *names: str) -> Callable[[T], T]:
        if not names:
            raise ValueError(f"{self.decorator} needs at least one name")

        def register(cls: T) -> T:
            if not (isinstance(cls, type) and issubclass(cls, self.base)):
                raise TypeError(f"{cls!r} is not a {self.base.__name__} subclass")
            if not cls.name:
                cls.name = names[0]
            for name in names:
                self.classes[name] = cls
            return cls

        return register

    def get(self, name: str) -> T:
        """The class registered as `name`; make one instance per output."""
        try:
            return self.classes[name]
        except KeyError:
            known = ", ".join(sorted(self.classes)) or "none"
            raise ValueError(f"unknown {self.kind} {name!r} (known: {known})") from None
