"""The JSON schemas that force tool calls, and the parsing of what such forced output holds.

With `tool_choice` naming a function, the model's output is constrained to that function's `parameters`
schema: the output is the arguments object. With `tool_choice: "required"`, it is constrained to vLLM's
schema: a non-empty array of `{"name": <a function's name>, "parameters": <its arguments>}`, one `anyOf`
branch per function, which `parse_required_calls` turns back into ToolCalls, each call's arguments as
generated, whole or cut off by max_tokens (keel.serve.openai.required_calls reads it as it streams). A named
function's output is its call's arguments as generated (vLLM's): it needs no parsing.

Every function here checks the request's `tools` first; a ValueError's message names the field at fault,
for the route to answer with a 400.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from keel.serve.openai.required_calls import RequiredCalls
from keel.serve.openai.tool_parsers.base import ToolCall, random_call_id
from keel.serve.openai.tool_parsers.scan import loads_strict

DEFAULT_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
# Definitions a schema's `$ref`s point at from its root; in the `required` schema the functions' schemas
# are no longer the root, so their definitions move to the root (a clash is an error, as in vLLM).
_DEFINITION_KEYS = ("$defs", "definitions")


def validate_tools(tools: object) -> list[dict[str, Any]]:
    """The request's `tools`, checked and normalized: copies of `{"type": "function", "function": {"name",
    "parameters" (default: an object with no properties), and "description"/"strict" when given}}`."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise ValueError("tools must be a list of {'type': 'function', 'function': {...}} objects")
    out = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        tool = _as_dict(tool)
        if not isinstance(tool, dict):
            raise ValueError(f"{where} must be an object")
        if tool.get("type") != "function":
            got = f", got {tool['type']!r}" if "type" in tool else ""
            raise ValueError(f"{where}.type must be 'function'{got}")
        function = _as_dict(tool.get("function"))
        if not isinstance(function, dict):
            raise ValueError(f"{where}.function must be an object with a name")
        name = function.get("name")
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"{where}.function.name must be a non-empty string")
        parameters = function.get("parameters")
        if parameters is None:
            parameters = DEFAULT_PARAMETERS
        elif not isinstance(parameters, dict):
            raise ValueError(f"{where}.function.parameters must be a JSON schema object")
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise ValueError(f"{where}.function.description must be a string")
        strict = function.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise ValueError(f"{where}.function.strict must be a boolean")
        normalized: dict[str, Any] = {"name": name, "parameters": copy.deepcopy(parameters)}
        if description is not None:
            normalized["description"] = description
        if strict is not None:
            normalized["strict"] = strict
        out.append({"type": "function", "function": normalized})
    return out


def named_tool_schema(tools: object, name: str) -> dict[str, Any]:
    """The schema forcing a call of function `name` (`tool_choice: {"type": "function", ...}`): its parameters."""
    for tool in validate_tools(tools):
        if tool["function"]["name"] == name:
            return tool["function"]["parameters"]
    raise ValueError(f"tool_choice names function {name!r}, which is not among the request's tools")


def required_tools_schema(tools: object) -> dict[str, Any]:
    """The schema forcing one or more calls (`tool_choice: "required"`), vLLM's shape: an array (minItems 1)
    of objects `{"name": <function name>, "parameters": <that function's arguments>}`, anyOf per function."""
    checked = validate_tools(tools)
    if not checked:
        raise ValueError("tool_choice 'required' needs at least one function in tools")
    definitions: dict[str, dict[str, Any]] = {}
    branches = []
    for tool in checked:
        name = tool["function"]["name"]
        parameters = tool["function"]["parameters"]
        for key in _DEFINITION_KEYS:
            for def_name, def_schema in (parameters.pop(key, None) or {}).items():
                if def_name in definitions.setdefault(key, {}) and definitions[key][def_name] != def_schema:
                    raise ValueError(
                        f"tools define {key} {def_name!r} twice with different schemas (function {name!r}): "
                        "a 'required' tool_choice needs one schema per definition name"
                    )
                definitions[key][def_name] = def_schema
        branches.append(
            {
                "type": "object",
                "properties": {"name": {"type": "string", "enum": [name]}, "parameters": parameters},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": branches}}
    for key, defs in definitions.items():
        if defs:
            schema[key] = defs
    return schema


def tool_choice_schema(tools: object, choice: object) -> dict[str, Any] | None:
    """The schema a `tool_choice` forces, or None when it forces nothing ("auto", "none", absent)."""
    if choice is None or choice in ("auto", "none"):
        validate_tools(tools)
        return None
    if choice == "required":
        return required_tools_schema(tools)
    return named_tool_schema(tools, _chosen_name(choice))


def parse_required_calls(text: str, tools: object, *, id_factory: Callable[[], str] | None = None) -> list[ToolCall]:
    """The calls in output that tool_choice "required" constrained: the array of `{"name", "parameters"}`, each
    call's arguments the `parameters` text as generated (keel.serve.openai.required_calls). An output cut off by
    max_tokens keeps its calls, the last one's arguments as far as they came, and one cut before the first call's
    name has none (vLLM's answer too: no calls and no content, the array's opening is not text for the client).

    Raises ValueError when the text is not what the schema forces (no array, a name not among the tools, complete
    arguments that are not a JSON object): the route may then answer with the text as content."""
    new_id = id_factory or random_call_id
    names = {tool["function"]["name"] for tool in validate_tools(tools)}
    reader = RequiredCalls()
    reader.feed(text)
    if not reader.names:
        if text.lstrip().startswith("[") and not reader.closed:
            return []
        raise ValueError("the forced tool-call output holds no call")
    complete = len(reader.names) if reader.closed else len(reader.names) - 1  # the last may be cut off
    for i, (name, arguments) in enumerate(zip(reader.names, reader.arguments, strict=True)):
        if name not in names:
            raise ValueError(f"forced tool call {i} names {name!r}, which is not among the tools")
        if i < complete:
            try:
                value = loads_strict(arguments)
            except (ValueError, RecursionError) as e:
                raise ValueError(f"forced tool call {i}'s parameters are not valid JSON: {e}") from None
            if not isinstance(value, dict):
                raise ValueError(f"forced tool call {i}'s parameters are not an object")
    return [ToolCall(new_id(), name, arguments) for name, arguments in zip(reader.names, reader.arguments, strict=True)]


def _chosen_name(choice: object) -> str:
    """The function a named tool_choice (`{"type": "function", "function": {"name": ...}}`) names."""
    choice = _as_dict(choice)
    function = _as_dict(choice.get("function")) if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or not name:
        raise ValueError(
            "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}"
        )
    return name


def _as_dict(value: object) -> object:
    """A pydantic model (the route's parsed request) as its dict; anything else unchanged."""
    dump = getattr(value, "model_dump", None)
    return dump(exclude_none=True) if callable(dump) else value
