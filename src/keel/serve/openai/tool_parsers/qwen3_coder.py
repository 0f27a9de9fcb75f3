"""`qwen3_coder`: Qwen3-Coder's XML tool calls.

    <tool_call>
    <function=NAME>
    <parameter=P>
    VALUE
    </parameter>
    </function>
    </tool_call>

Values are typed by the tool's JSON schema (param_values). Streaming sends a call's name as soon as
`<function=NAME>` is complete and each parameter as soon as it ends, as pieces of the arguments object
(`{"a": 1`, `, "b": "x"`, `}`). Once the name is sent the call stands, so from there on parsing is lenient,
as vLLM's regexes are: a parameter also ends at the next `<parameter=`, at `</function>`, `</tool_call>` or
the end of the output; one without a `>` after its name is dropped; stray text between parameters is ignored.
Before the name is complete, a malformed call (no `<function=` after `<tool_call>`, a name broken by a
newline or `<`) is content, verbatim. A bare `<function=...>` without `<tool_call>` is a call too, as in vLLM.
"""

from __future__ import annotations

from keel.serve.openai.tool_parsers.base import ToolParser
from keel.serve.openai.tool_parsers.param_values import convert_value, tool_properties
from keel.serve.openai.tool_parsers.registry import register_tool_parser
from keel.serve.openai.tool_parsers.scan import dumps, find_marker, is_marker_prefix

CALL_START, CALL_END = "<tool_call>", "</tool_call>"
FUNCTION_START, FUNCTION_END = "<function=", "</function>"
PARAMETER_START, PARAMETER_END = "<parameter=", "</parameter>"
_PARAMETER_STOPS = (PARAMETER_END, PARAMETER_START, FUNCTION_END, CALL_END)

# States: prose; after <tool_call> (expecting <function=); a function's name; inside a function, between
# parameters; inside a parameter; after </function> inside a <tool_call> block.
TEXT, BLOCK, NAME, FUNCTION, PARAMETER, AFTER_FUNCTION = range(6)


@register_tool_parser("qwen3_coder")
class Qwen3CoderToolParser(ToolParser):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._properties = tool_properties(self.tools)
        self._state = TEXT
        self._raw = ""  # text since the marker, given back verbatim if the call proves malformed
        self._in_block = False
        self._index = -1
        self._function = ""
        self._params_sent = 0

    def _step(self, final: bool) -> bool:
        buf = self._buf
        state = self._state
        if state == TEXT:
            marker = self._text_to_marker((CALL_START, FUNCTION_START), final)
            if marker is None:
                return False
            self._raw = marker
            self._in_block = marker == CALL_START
            self._state = BLOCK if self._in_block else NAME
            return True
        if state == BLOCK:
            head = buf.lstrip()
            if head.startswith(FUNCTION_START):
                self._raw += buf[: len(buf) - len(head) + len(FUNCTION_START)]
                self._buf = head[len(FUNCTION_START) :]
                self._state = NAME
                return True
            if is_marker_prefix(head, FUNCTION_START) and not final:
                return False
            return self._malformed()
        if state == NAME:
            end = buf.find(">")
            broken = next((i for i, c in enumerate(buf) if c in "<\n"), -1)
            if broken >= 0 and (end < 0 or broken < end):
                return self._malformed()
            if end < 0:
                return self._malformed() if final else False
            name = buf[:end].strip()
            if not name:
                return self._malformed()
            self._buf = buf[end + 1 :]
            self._raw = ""
            self._function = name
            self._params_sent = 0
            self._index = self._open_call(name)
            self._state = FUNCTION
            return True
        if state == FUNCTION:
            pos, marker = find_marker(buf, (PARAMETER_START, FUNCTION_END, CALL_END))
            if marker is None:
                self._buf = "" if final else buf[pos:]  # text between parameters is not part of the call
                if final:
                    self._close_function()
                    self._state = TEXT
                return False
            self._buf = buf[pos + len(marker) :]
            if marker == PARAMETER_START:
                self._state = PARAMETER
            else:
                self._close_function()
                self._state = AFTER_FUNCTION if marker == FUNCTION_END and self._in_block else TEXT
            return True
        if state == PARAMETER:
            pos, marker = find_marker(buf, _PARAMETER_STOPS)
            if marker is None and not final:
                return False
            stop = len(buf) if marker is None else pos
            self._parameter(buf[:stop])
            # </parameter> is consumed; the other stops also end the parameter but are the function's to read.
            self._buf = buf[stop + len(PARAMETER_END) :] if marker == PARAMETER_END else buf[stop:]
            self._state = FUNCTION
            return True
        # AFTER_FUNCTION: `</tool_call>` closes the block, another `<function=` continues it.
        head = buf.lstrip()
        for marker, nxt in ((CALL_END, TEXT), (FUNCTION_START, NAME)):
            if head.startswith(marker):
                self._buf = head[len(marker) :]
                self._raw = marker if nxt == NAME else ""
                self._state = nxt
                return True
        if not final and (is_marker_prefix(head, CALL_END) or is_marker_prefix(head, FUNCTION_START)):
            return False
        self._state = TEXT  # the block was left unclosed: what follows is prose
        return True

    def _parameter(self, text: str) -> None:
        end = text.find(">")
        if end < 0:
            return  # no name: nothing to key the value by
        name = text[:end].strip()
        value = text[end + 1 :]
        # The value sits on lines of its own: one newline either side is layout, not value.
        if value.startswith("\n"):
            value = value[1:]
        if value.endswith("\n"):
            value = value[:-1]
        properties = self._properties.get(self._function, {})
        typed = convert_value(value, properties.get(name) if name in properties else None)
        piece = ("{" if self._params_sent == 0 else ", ") + dumps(name) + ": " + dumps(typed)
        self._params_sent += 1
        self._call_arguments(self._index, piece)

    def _close_function(self) -> None:
        self._call_arguments(self._index, "}" if self._params_sent else "{}")

    def _malformed(self) -> bool:
        self._give_up(self._raw + self._buf)
        self._raw = self._buf = ""
        return False
