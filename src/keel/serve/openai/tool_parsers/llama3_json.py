"""`llama3_json`: Llama 3.1/3.2's JSON tool calls, `{"name": ..., "parameters": {...}}`.

The output is a call when it starts (after whitespace) with `{`, or from a `<|python_tag|>` on (kept in the
text only when special tokens are not skipped); several calls are separated by `;`. vLLM's non-streamed
parser also takes a JSON object found after prose, but its streamed one does not, and the two must agree
here: an output that starts with prose is content, as Llama's template has the model answer either with
a call alone or with text. Prose after the calls is content (vLLM drops it). `arguments` is accepted for
`parameters`, as some prompts name it so.
"""

from __future__ import annotations

from keel.serve.openai.tool_parsers.base import ToolParser
from keel.serve.openai.tool_parsers.registry import register_tool_parser
from keel.serve.openai.tool_parsers.scan import JsonEnd, is_marker_prefix, parse_call_json

PYTHON_TAG = "<|python_tag|>"
ARGUMENT_KEYS = ("arguments", "parameters")

# States: the start of the output (a `{` there opens a call); prose; expecting an object (after the tag);
# inside an object; between objects (`;` and whitespace).
START, TEXT, EXPECT, OBJECT, BETWEEN = range(5)


@register_tool_parser("llama3_json", "llama4_json")
class Llama3JsonToolParser(ToolParser):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._state = START
        self._raw = ""  # the text consumed since the marker, given back verbatim if the call is malformed
        self._end = JsonEnd()

    def _step(self, final: bool) -> bool:
        buf = self._buf
        if self._state == START:
            head = buf.lstrip()
            if head.startswith("{"):
                self._content(buf[: len(buf) - len(head)])
                self._at_marker()
                self._buf = head
                self._open_object()
                return True
            if (not head or is_marker_prefix(head, PYTHON_TAG)) and not final:
                return False
            self._state = TEXT
            return True
        if self._state == TEXT:
            if self._text_to_marker((PYTHON_TAG,), final) is None:
                return False
            self._raw = PYTHON_TAG
            self._state = EXPECT
            return True
        if self._state == EXPECT:
            head = buf.lstrip()
            if head.startswith("{"):
                self._raw += buf[: len(buf) - len(head)]
                self._buf = head
                self._open_object()
                return True
            if not head and not final:
                return False
            self._give_up(self._raw + buf)  # the tag is not followed by JSON (Llama's Python code, say)
            self._buf = ""
            return False
        if self._state == BETWEEN:
            head = buf.lstrip()
            if head.startswith(";"):
                head = head[1:].lstrip()
            if head.startswith("{"):
                self._at_marker()
                self._raw = buf[: len(buf) - len(head)]  # the separator, given back if this call is malformed
                self._buf = head
                self._open_object()
                return True
            if not head:  # only separators so far: at the end they are dropped
                if final:
                    self._buf = ""
                return False
            self._state = TEXT  # prose after the calls is content; a later python tag starts calls again
            return True
        # OBJECT
        end = self._end.advance(buf)
        if end is None:
            if not final:
                return False
            end = len(buf)
        body, self._buf = buf[:end], buf[end:]
        call = parse_call_json(body, ARGUMENT_KEYS)
        if call is None:
            self._give_up(self._raw + body)
            return True
        self._call(*call)
        self._raw = ""
        self._state = BETWEEN
        return True

    def _open_object(self) -> None:
        self._state = OBJECT
        self._end = JsonEnd()
