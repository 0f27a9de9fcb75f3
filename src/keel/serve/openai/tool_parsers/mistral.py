"""`mistral`: `[TOOL_CALLS]` then the calls, in either of Mistral's formats.

- before tokenizer v11 (Mistral 7B v0.3, Mistral Nemo): a JSON array, `[TOOL_CALLS][{"name": ..., "arguments":
  {...}}, ...]` (a bare object is taken too);
- v11 and later (Mistral Small 3.2, Magistral, Devstral): `[TOOL_CALLS]NAME{...}`, or `[TOOL_CALLS]NAME[ARGS]{...}`,
  one marker per call.

`[TOOL_CALLS]` is a special token, so the route must decode with special tokens kept
(`needs_special_tokens`), as vLLM's parser makes the request do. Call ids are 9 letters and digits, the
only ids Mistral's chat template accepts back.
"""

from __future__ import annotations

import secrets
import string

from keel.serve.openai.tool_parsers.base import ToolParser
from keel.serve.openai.tool_parsers.registry import register_tool_parser
from keel.serve.openai.tool_parsers.scan import (
    JsonEnd,
    arguments_json,
    is_marker_prefix,
    loads_strict,
    parse_call_json,
)

BOT = "[TOOL_CALLS]"
ARGS = "[ARGS]"
_ALPHANUMERIC = string.ascii_letters + string.digits
_NAME_CHARS = frozenset(_ALPHANUMERIC + "_-.")

# States: prose; just after the marker; inside the array, expecting an element; inside an element; after an
# element (`,` or `]`); a v11 name; a v11 arguments object.
TEXT, AFTER_BOT, ARRAY_ITEM, ARRAY_OBJECT, ARRAY_NEXT, NAME, NAMED_ARGS = range(7)


@register_tool_parser("mistral")
class MistralToolParser(ToolParser):
    needs_special_tokens = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._state = TEXT
        self._raw = ""  # text since the marker not yet part of a sent call: given back if malformed
        self._end = JsonEnd()
        self._name = ""  # a v11 call's name ("" for a call object that names itself)

    @staticmethod
    def new_call_id() -> str:
        return "".join(secrets.choice(_ALPHANUMERIC) for _ in range(9))

    def _step(self, final: bool) -> bool:
        buf = self._buf
        state = self._state
        if state == TEXT:
            if self._text_to_marker((BOT,), final) is None:
                return False
            self._raw = BOT
            self._state = AFTER_BOT
            return True
        if state == AFTER_BOT:
            head = buf.lstrip()
            if not head:
                return self._wait_or_give_up(final)
            self._take_raw(len(buf) - len(head))
            if head[0] == "[":
                self._take_raw(1)
                self._state = ARRAY_ITEM
            elif head[0] == "{":
                self._name = ""
                self._object(NAMED_ARGS)
            elif head[0] in _NAME_CHARS:
                self._name = ""
                self._state = NAME
            else:
                return self._malformed()
            return True
        if state == ARRAY_ITEM:
            head = buf.lstrip()
            if not head:
                return self._wait_or_give_up(final)
            if head[0] != "{":
                return self._malformed()  # an empty array or a non-object: no calls here
            self._take_raw(len(buf) - len(head))
            self._object(ARRAY_OBJECT)
            return True
        if state == ARRAY_NEXT:
            head = buf.lstrip()
            if not head:
                if final:  # the array was cut off after a whole element: the calls stand
                    self._buf = ""
                return False
            if head[0] not in ",]":
                return self._malformed()
            separator = buf[: len(buf) - len(head) + 1]
            self._buf = head[1:]
            if head[0] == ",":
                self._raw = separator  # given back with the next element if that one is malformed
                self._state = ARRAY_ITEM
            else:
                self._state = TEXT
            return True
        if state == NAME:
            i = 0
            while i < len(buf) and buf[i] in _NAME_CHARS:
                i += 1
            self._name += buf[:i]
            self._take_raw(i)
            rest = self._buf
            if not rest:
                return self._wait_or_give_up(final)
            if rest.startswith("{"):
                self._object(NAMED_ARGS)
                return True
            if rest.startswith(ARGS):
                self._take_raw(len(ARGS))
                return True
            if is_marker_prefix(rest, ARGS) and not final:
                return False
            return self._malformed()
        # ARRAY_OBJECT, NAMED_ARGS: a JSON object is arriving.
        end = self._end.advance(buf)
        if end is None:
            return self._wait_or_give_up(final)
        body = buf[:end]
        if state == ARRAY_OBJECT:
            call = parse_call_json(body)
        elif self._name:
            call = self._named_call(body)
        else:
            call = parse_call_json(body)  # `[TOOL_CALLS]{"name": ..., "arguments": ...}` without the array
        if call is None:
            return self._malformed()
        self._buf = buf[end:]
        self._call(*call)
        self._raw = ""
        self._state = ARRAY_NEXT if state == ARRAY_OBJECT else TEXT
        return True

    def _named_call(self, body: str) -> tuple[str, str] | None:
        try:
            arguments = arguments_json(loads_strict(body))
        except (ValueError, RecursionError):
            return None
        return None if arguments is None else (self._name, arguments)

    def _object(self, state: int) -> None:
        self._end = JsonEnd()
        self._state = state

    def _take_raw(self, n: int) -> None:
        self._raw += self._buf[:n]
        self._buf = self._buf[n:]

    def _wait_or_give_up(self, final: bool) -> bool:
        return self._malformed() if final else False

    def _malformed(self) -> bool:
        self._give_up(self._raw + self._buf)
        self._raw = self._buf = ""
        return False
