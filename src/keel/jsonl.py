"""JSON Lines input: one JSON value per line, blank lines skipped, a bad line named by file and number."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from typing import Any

from keel.errors import KeelError


def iter_jsonl(lines: Iterable[str], where: str) -> Iterator[tuple[int, Any]]:
    """(line number, value) for every non-blank line; KeelError "WHERE:N: not valid JSON (...)"."""
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as e:
            raise KeelError(f"{where}:{number}: not valid JSON ({e.msg} at column {e.colno})") from None
        yield number, value
