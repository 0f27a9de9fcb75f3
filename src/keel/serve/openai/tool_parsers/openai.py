"""`openai`: GPT-OSS's tool calls, harmony messages addressed `to=functions.NAME` (vLLM's name for the parser).

It reads the content the `openai_gptoss` reasoning parser leaves (keel.serve.openai.harmony), where each call's
message, whatever header the model wrote, is `<|start|>assistant to=functions.NAME<|message|>ARGS<|call|>`; the
server therefore runs that reasoning parser with this one. A call is sent whole once its message ends and its
arguments (the JSON the model wrote after `<|constrain|>json`) parse as an object, as the other JSON formats'
calls are; one that does not is content, verbatim, with all that follows (the base class's rules).
"""

from __future__ import annotations

from keel.serve.openai.harmony import CALL_END, CALL_HEAD, MESSAGE
from keel.serve.openai.tool_parsers.base import ToolParser
from keel.serve.openai.tool_parsers.registry import register_tool_parser
from keel.serve.openai.tool_parsers.scan import arguments_json, find_marker, loads_strict

# States: text between calls; inside a call's message (name, then arguments).
TEXT, CALL = range(2)


@register_tool_parser("openai")
class OpenAIToolParser(ToolParser):
    needs_special_tokens = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._state = TEXT

    def _step(self, final: bool) -> bool:
        if self._state == TEXT:
            if self._text_to_marker((CALL_HEAD,), final) is None:
                return False
            self._state = CALL
            return True
        pos, marker = find_marker(self._buf, (CALL_END,))
        if marker is None and not final:
            return False
        end = pos if marker is not None else len(self._buf)
        body, rest = self._buf[:end], self._buf[end + len(marker or "") :]
        name, sep, raw_arguments = body.partition(MESSAGE)
        arguments = None
        if sep and name.strip():
            try:
                arguments = arguments_json(loads_strict(raw_arguments))
            except ValueError:
                arguments = None
        if arguments is None:  # malformed: this call's text and all after it are content
            self._give_up(CALL_HEAD + self._buf)
            self._buf = ""
            return False
        self._call(name.strip(), arguments)
        self._buf, self._state = rest, TEXT
        return True
