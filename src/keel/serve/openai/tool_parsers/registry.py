"""Tool parsers by name (vLLM's `--tool-call-parser` names); `register_tool_parser` adds one.

`@register_tool_parser("mine")` on a ToolParser subclass makes `get_tool_parser("mine")` return it (make one per
output: `get_tool_parser(name)(tools)`); a later registration under a taken name replaces the earlier one.
"""

from __future__ import annotations

from keel.serve.openai.parser_registry import ParserRegistry
from keel.serve.openai.tool_parsers.base import ToolParser

_REGISTRY: ParserRegistry[type[ToolParser]] = ParserRegistry(ToolParser, "tool parser", "register_tool_parser")
TOOL_PARSERS = _REGISTRY.classes
register_tool_parser = _REGISTRY.register
get_tool_parser = _REGISTRY.get
