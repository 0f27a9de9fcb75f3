"""Typing the text of an XML tool-call parameter by the tool's JSON schema (Qwen3-Coder's format carries
no types: `<parameter=n>\\n3\\n</parameter>` is the integer 3 only if the schema says so).

Follows vLLM's qwen3_coder conversions: "null" is null for any type; string types keep the text; integers
and numbers are parsed (a whole float becomes an int); object/array and unknown types are parsed as JSON,
then as a Python literal. A value that does not parse stays a string, as does one of an unknown parameter,
so nothing the model wrote is lost. Unlike vLLM, a boolean other than true/false stays a string rather
than becoming false.
"""

from __future__ import annotations

import ast
import math

from keel.serve.openai.tool_parsers.scan import dumps, loads_strict

_STRING_TYPES = {"string", "str", "text", "varchar", "char", "enum"}
_INTEGER_PREFIXES = ("int", "uint", "long", "short", "unsigned")
_BOOLEAN_TYPES = {"boolean", "bool", "binary"}


def tool_properties(tools: list[dict]) -> dict[str, dict]:
    """Function name -> its parameters' `properties` (the first tool of a name wins)."""
    out: dict[str, dict] = {}
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            continue
        parameters = function.get("parameters")
        properties = parameters.get("properties") if isinstance(parameters, dict) else None
        out.setdefault(function["name"], properties if isinstance(properties, dict) else {})
    return out


def schema_type(schema: object) -> str:
    """The declared type, lower-case; the first non-null one of a list ("string" when none is declared)."""
    if not isinstance(schema, dict):
        return "string"
    declared = schema.get("type")
    if isinstance(declared, list):
        declared = next((t for t in declared if t != "null"), "string")
    if not isinstance(declared, str):
        return "object" if "properties" in schema else "string"
    return declared.strip().lower()


def convert_value(text: str, schema: object | None) -> object:
    """The JSON value for a parameter's text; `schema` is the parameter's, None for an unknown parameter."""
    if text.lower() == "null":
        return None
    if schema is None:
        return text
    kind = schema_type(schema)
    if kind in _STRING_TYPES:
        return text
    if kind.startswith(_INTEGER_PREFIXES):
        try:
            return int(text.strip())
        except ValueError:
            return text
    if kind.startswith(("num", "float", "double")):
        try:
            number = float(text.strip())
        except ValueError:
            return text
        if not math.isfinite(number):
            return text
        return int(number) if number.is_integer() else number
    if kind in _BOOLEAN_TYPES:
        lowered = text.strip().lower()
        return lowered == "true" if lowered in ("true", "false") else text
    return _parse_structured(text)


def _parse_structured(text: str) -> object:
    try:
        return loads_strict(text)
    except (ValueError, RecursionError):
        pass
    try:
        value = ast.literal_eval(text.strip())  # Python-style literals: single quotes, True/None
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return text
    try:
        dumps(value)  # a set, bytes or complex number has no JSON form
    except (TypeError, ValueError, RecursionError):
        return text
    return value
