"""Tool-call parsers: the model's text -> OpenAI `tool_calls`, whole (`extract`) or streamed (`feed`/`finish`).

    parser = get_tool_parser("hermes")(request_tools)   # one per output
    update = parser.feed(delta_text)                     # StreamUpdate(content, tool_calls)
    ...
    update = parser.finish()

Built in, by vLLM's names: hermes, llama3_json (llama4_json), qwen3_coder, mistral, openai (GPT-OSS); add one with
`@register_tool_parser("name")` on a ToolParser subclass.
"""

from keel.serve.openai.tool_parsers import hermes, llama3_json, mistral, openai, qwen3_coder  # noqa: F401  (registers)
from keel.serve.openai.tool_parsers.base import (
    ExtractedToolCalls,
    StreamUpdate,
    ToolCall,
    ToolCallDelta,
    ToolParser,
    assemble,
    random_call_id,
)
from keel.serve.openai.tool_parsers.registry import TOOL_PARSERS, get_tool_parser, register_tool_parser

__all__ = [
    "TOOL_PARSERS",
    "ExtractedToolCalls",
    "StreamUpdate",
    "ToolCall",
    "ToolCallDelta",
    "ToolParser",
    "assemble",
    "get_tool_parser",
    "random_call_id",
    "register_tool_parser",
]
