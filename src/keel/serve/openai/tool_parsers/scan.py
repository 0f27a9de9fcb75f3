"""Text-scanning helpers the tool parsers share: markers that may arrive split across deltas, the end of a
JSON object that is still arriving, and the JSON checks every parser applies to a call's arguments."""

from __future__ import annotations

import json
from collections.abc import Sequence


def find_marker(buf: str, markers: Sequence[str]) -> tuple[int, str | None]:
    """The earliest complete marker in `buf` as (position, marker); else (safe, None), where `buf[:safe]` can
    hold no start of a marker: the rest may be one that later deltas complete, so it must be held back."""
    hit: tuple[int, str] | None = None
    for m in markers:
        i = buf.find(m)
        if i >= 0 and (hit is None or i < hit[0] or (i == hit[0] and len(m) > len(hit[1]))):
            hit = (i, m)
    held = partial_marker_start(buf, markers)
    if hit is not None and hit[0] <= held:
        return hit
    return held, None


def partial_marker_start(buf: str, markers: Sequence[str]) -> int:
    """Where the longest suffix of `buf` that is a proper prefix of some marker begins (len(buf) if none)."""
    longest = max((len(m) for m in markers), default=0)
    for start in range(max(0, len(buf) - longest + 1), len(buf)):
        tail = buf[start:]
        if any(len(tail) < len(m) and m.startswith(tail) for m in markers):
            return start
    return len(buf)


def is_marker_prefix(text: str, marker: str) -> bool:
    """Whether `text` could still grow into `marker` (a proper prefix of it, the empty string included)."""
    return len(text) < len(marker) and marker.startswith(text)


class JsonEnd:
    """Finds where a JSON object or array that starts at position 0 of a growing string closes.

    It counts brackets outside strings (escapes included) and scans each character once however the text
    is split into deltas; it does not validate: json.loads does that on the span it finds."""

    def __init__(self) -> None:
        self._pos = 0
        self._depth = 0
        self._in_string = False
        self._escaped = False

    def advance(self, text: str) -> int | None:
        """The index just past the closing bracket once `text` (which only ever grows) contains it."""
        while self._pos < len(text):
            c = text[self._pos]
            self._pos += 1
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif c == "\\":
                    self._escaped = True
                elif c == '"':
                    self._in_string = False
            elif c == '"':
                self._in_string = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if self._depth <= 0:
                    return self._pos
        return None


def _reject_constant(name: str) -> object:
    raise ValueError(f"{name} is not JSON")


def loads_strict(text: str) -> object:
    """json.loads without NaN/Infinity, which json.dumps would write back as invalid JSON for the client.

    Raises ValueError (json.JSONDecodeError is one) on anything that is not strict JSON."""
    return json.loads(text, parse_constant=_reject_constant)


def dumps(value: object) -> str:
    """JSON as OpenAI's arguments strings are written: UTF-8 text kept, default separators."""
    return json.dumps(value, ensure_ascii=False, allow_nan=False)


def arguments_json(value: object) -> str | None:
    """A call's arguments as the JSON string OpenAI sends, or None when they are not an object.

    Some models write the arguments as a JSON string holding the object; that is decoded once."""
    if isinstance(value, str):
        try:
            value = loads_strict(value)
        except ValueError:
            return None
    if not isinstance(value, dict):
        return None
    return dumps(value)


def call_from_object(obj: object, argument_keys: Sequence[str] = ("arguments",)) -> tuple[str, str] | None:
    """(name, arguments JSON) from a decoded `{"name": ..., "arguments": {...}}`, or None if it is not one.

    A missing arguments key means a call without arguments ("{}"), as some models write for those."""
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return None
    for key in argument_keys:
        if key in obj:
            arguments = arguments_json(obj[key])
            return None if arguments is None else (name, arguments)
    return name, "{}"


def parse_call_json(text: str, argument_keys: Sequence[str] = ("arguments",)) -> tuple[str, str] | None:
    """`call_from_object` of a JSON text; None when the text is not valid JSON."""
    try:
        obj = loads_strict(text)
    except (ValueError, RecursionError):
        return None
    return call_from_object(obj, argument_keys)
