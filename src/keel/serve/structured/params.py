"""What a request's output must match: vLLM's `structured_outputs` fields (and its older `guided_*`)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from keel.errors import KeelError


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one constraint: a JSON schema, any JSON object, a regex, one of several strings, or an
    EBNF grammar (xgrammar's GBNF dialect, as vLLM's `grammar` field takes it)."""

    json: str | None = None  # the schema, serialised (a dict is accepted and serialised by `of`)
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = False
    source: str = field(default="", compare=False)  # the request field it came from (errors name it)

    @classmethod
    def of(
        cls,
        json: dict[str, Any] | str | None = None,
        json_object: bool = False,
        regex: str | None = None,
        choice: list[str] | tuple[str, ...] | None = None,
        grammar: str | None = None,
        disable_any_whitespace: bool = False,
        source: str = "",
    ) -> StructuredOutputsParams:
        schema = _json_text(json) if json is not None else None
        params = cls(
            schema,
            json_object,
            regex,
            tuple(choice) if choice is not None else None,
            grammar,
            disable_any_whitespace,
            source,
        )
        params.validate()
        return params

    @property
    def kind(self) -> str:
        """The field that is set: json, json_object, regex, choice or grammar."""
        set_fields = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        if self.json_object:
            set_fields.append("json_object")
        if len(set_fields) != 1:
            raise KeelError(
                "structured outputs take exactly one of json, json_object, regex, choice or grammar"
                f" (got {', '.join(set_fields) or 'none'})"
            )
        return set_fields[0]

    def validate(self) -> None:
        kind = self.kind
        if kind == "choice" and (not self.choice or any(not isinstance(c, str) or not c for c in self.choice)):
            raise KeelError("structured outputs: choice must be a non-empty list of non-empty strings")
        if kind in ("regex", "grammar") and not getattr(self, kind):
            raise KeelError(f"structured outputs: {kind} must not be empty")


def _json_text(schema: dict[str, Any] | str) -> str:
    """The schema as JSON text (the compiler's cache key), checked to be a JSON object."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise KeelError(f"structured outputs: json is not valid JSON: {e}") from None
    if not isinstance(schema, dict):
        raise KeelError("structured outputs: json must be a JSON schema object")
    return json.dumps(schema)  # key order kept: it is the order the grammar writes properties in
