"""The output `tool_choice: "required"` forces, read as it arrives: an array of `{"name": ..., "parameters": {...}}`
objects (keel.serve.openai.tool_schemas.required_tools_schema), one tool call each.

A call starts once its name is complete, and its arguments are the `parameters` value's text as generated, sent
piece by piece as it grows (vLLM streams required calls so; a named call's arguments are streamed alike). The
whole response reads the same text in one piece, so the streamed pieces of a call add up to the whole response's
arguments, and an output cut by max_tokens still has its calls, the last one's arguments as far as they came.
The grammar guarantees the shape; the reader only follows the JSON's nesting, strings and escapes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field


@dataclass
class CallUpdate:
    """What one piece of output adds to call `index`: its name the first time (None after), more arguments."""

    index: int
    name: str | None
    arguments: str


@dataclass
class _Element:
    name: str | None = None
    key: str | None = None  # the key being read, or whose value is being read
    value_of: str | None = None  # after a colon: the key whose value comes next
    held: str = ""  # arguments read before the name (sent with it)


@dataclass
class RequiredCalls:
    """Feed the output's text piece by piece (`feed`); each call's name and argument pieces come back in order."""

    names: list[str] = field(default_factory=list)
    arguments: list[str] = field(default_factory=list)
    _text: str = ""
    _pos: int = 0
    _depth: int = 0
    _in_string: bool = False
    _escaped: bool = False
    _string_start: int = 0
    _element: _Element | None = None
    _args_from: int | None = None  # inside a parameters value: where its unread text starts
    _args_pending: bool = False  # after "parameters": the value starts at the next non-space character

    @property
    def closed(self) -> bool:
        """Whether the array has closed (the output is whole, not cut off)."""
        return self._depth == 0 and "]" in self._text

    def feed(self, text: str) -> list[CallUpdate]:
        """Read `text` (more of the output); the calls it starts and the arguments it adds."""
        self._text += text
        updates: list[CallUpdate] = []
        while self._pos < len(self._text):
            self._step(self._text[self._pos], updates)
            self._pos += 1
        if self._args_from is not None:  # the value is still arriving: what came so far
            self._add_arguments(self._args_from, len(self._text), updates)
            self._args_from = len(self._text)
        return updates

    def _step(self, c: str, updates: list[CallUpdate]) -> None:
        if self._in_string:
            if self._escaped:
                self._escaped = False
            elif c == "\\":
                self._escaped = True
            elif c == '"':
                self._in_string = False
                if self._depth == 2 and self._args_from is None:
                    self._string_done(json.loads(self._text[self._string_start : self._pos + 1]), updates)
            return
        if self._args_pending and not c.isspace():
            self._args_pending, self._args_from = False, self._pos
        if c == '"':
            self._in_string, self._string_start = True, self._pos
        elif c in "{[":
            self._depth += 1
            if self._depth == 2:
                self._element = _Element()
        elif c in "}]":
            self._depth -= 1
            if self._args_from is not None and self._depth == 2:  # the parameters object closed
                self._end_arguments(self._pos + 1, updates)
            elif self._depth == 1 and self._args_from is not None:  # a scalar value ended by the element's close
                self._end_arguments(self._pos, updates)
        elif self._depth == 2 and self._element is not None:
            if c == ":":
                self._element.value_of, self._element.key = self._element.key, None
                self._args_pending = self._element.value_of == "parameters"
            elif c == ",":
                if self._args_from is not None:  # a scalar value ended by the next key
                    self._end_arguments(self._pos, updates)
                self._element.value_of = None

    def _string_done(self, value: object, updates: list[CallUpdate]) -> None:
        element = self._element
        if element is None:
            return
        if element.value_of == "name" and isinstance(value, str) and element.name is None:
            element.name = value
            self.names.append(value)
            self.arguments.append(element.held)
            updates.append(CallUpdate(len(self.names) - 1, value, element.held))
            element.value_of = None
        elif element.value_of is None and isinstance(value, str):
            element.key = value

    def _add_arguments(self, start: int, end: int, updates: list[CallUpdate]) -> None:
        piece = self._text[start:end]
        element = self._element
        if not piece or element is None:
            return
        if element.name is None:  # parameters before the name: held until the call starts
            element.held += piece
            return
        index = len(self.names) - 1
        self.arguments[index] += piece
        if updates and updates[-1].index == index:
            updates[-1].arguments += piece
        else:
            updates.append(CallUpdate(index, None, piece))

    def _end_arguments(self, end: int, updates: list[CallUpdate]) -> None:
        self._add_arguments(self._args_from, end, updates)
        self._args_from = None
        if self._element is not None:
            self._element.value_of = None
