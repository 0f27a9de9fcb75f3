"""`hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call.

What Hermes 2 Pro and Qwen2.5/Qwen3 emit. Text before the first block is content; a block left open at
the end of the output (a stop string ate the closing tag) is parsed as it stands, as vLLM does."""

from __future__ import annotations

from keel.serve.openai.tool_parsers.base import ToolParser
from keel.serve.openai.tool_parsers.registry import register_tool_parser
from keel.serve.openai.tool_parsers.scan import parse_call_json

START = "<tool_call>"
END = "</tool_call>"


@register_tool_parser("hermes")
class HermesToolParser(ToolParser):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._in_call = False

    def _step(self, final: bool) -> bool:
        if not self._in_call:
            if self._text_to_marker((START,), final) is None:
                return False
            self._in_call = True
            return True
        end = self._buf.find(END)
        if end < 0 and not final:
            return False  # the JSON is only judged once the block is closed: text after it could spoil it
        body, close = (self._buf, "") if end < 0 else (self._buf[:end], END)
        self._buf = self._buf[len(body) + len(close) :]
        self._in_call = False
        call = parse_call_json(body)
        if call is None:
            self._give_up(START + body + close)
        else:
            self._call(*call)
        return True
