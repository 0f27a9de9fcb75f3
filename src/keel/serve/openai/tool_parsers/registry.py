"""Tool parsers by name (vLLM's `--tool-call-parser` names); `register_tool_parser` adds one."""

from __future__ import annotations

from collections.abc import Callable

from keel.serve.openai.tool_parsers.base import ToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {}


def register_tool_parser(*names: str) -> Callable[[type[ToolParser]], type[ToolParser]]:
    """Class decorator: `@register_tool_parser("mine")` makes `get_tool_parser("mine")` return the class.

    A later registration under a taken name replaces the earlier one, so a user can override a built-in."""
    if not names:
        raise ValueError("register_tool_parser needs at least one name")

    def register(cls: type[ToolParser]) -> type[ToolParser]:
        if not (isinstance(cls, type) and issubclass(cls, ToolParser)):
            raise TypeError(f"{cls!r} is not a ToolParser subclass")
        if not cls.name:
            cls.name = names[0]
        for name in names:
            TOOL_PARSERS[name] = cls
        return cls

    return register


def get_tool_parser(name: str) -> type[ToolParser]:
    """The parser class registered as `name`; make one per output: `get_tool_parser(name)(tools)`."""
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        known = ", ".join(sorted(TOOL_PARSERS)) or "none"
        raise ValueError(f"unknown tool parser {name!r} (known: {known})") from None
