"""A request's structured-output fields as one StructuredOutputsParams.

Three spellings reach the same constraint, as in vLLM: OpenAI's `response_format` (json_object,
json_schema), vLLM's `structured_outputs` {json, regex, choice, grammar, json_object}, and vLLM's
older `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`. A request may use one;
two constraints at once are a 400 naming both, never one silently preferred.
"""

from __future__ import annotations

from typing import Any

from keel.errors import KeelError
from keel.serve.openai.errors import APIError
from keel.serve.structured import StructuredOutputsParams

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
_STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")
# vLLM's per-request engine choice: keel's one engine is xgrammar (vLLM's default)
_BACKENDS = (None, "auto", "xgrammar")


def structured_outputs_of(
    response_format: dict[str, Any] | None,
    structured_outputs: dict[str, Any] | None,
    guided: dict[str, Any],
) -> StructuredOutputsParams | None:
    """The request's one constraint (None without any); APIError 400 naming the field otherwise."""
    found: list[tuple[str, dict[str, Any]]] = []
    if response_format is not None:
        spec = _from_response_format(response_format)
        if spec is not None:
            found.append(("response_format", spec))
    if structured_outputs is not None:
        found.append(("structured_outputs", _from_structured_outputs(structured_outputs)))
    guided_spec = {_GUIDED[name]: value for name, value in guided.items() if name in _GUIDED and value is not None}
    if guided.get("guided_decoding_backend") not in _BACKENDS:
        raise APIError(
            400, "guided_decoding_backend: this server's grammar engine is xgrammar", param="guided_decoding_backend"
        )
    whitespace = guided.get("guided_whitespace_pattern")
    if whitespace is not None:
        raise APIError(
            400,
            "'guided_whitespace_pattern' is not supported (use disable_any_whitespace)",
            param="guided_whitespace_pattern",
        )
    if guided_spec:
        if len(guided_spec) > 1:
            names = [name for name in _GUIDED if guided.get(name) is not None]
            raise APIError(400, f"only one of {', '.join(names)} may be given", param=names[1])
        found.append((next(n for n in _GUIDED if guided.get(n) is not None), guided_spec))
    if not found:
        return None
    if len(found) > 1:
        raise APIError(400, f"{found[0][0]} and {found[1][0]} both constrain the output: give one", param=found[1][0])
    name, spec = found[0]
    try:
        return StructuredOutputsParams.of(**spec, source=name)
    except KeelError as e:
        raise APIError(400, str(e), param=name) from None
    except TypeError as e:
        raise APIError(400, f"'{name}': {e}", param=name) from None


def _from_response_format(fmt: dict[str, Any]) -> dict[str, Any] | None:
    kind = fmt.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        body = fmt.get("json_schema")
        if not isinstance(body, dict):
            raise APIError(400, "response_format json_schema needs a 'json_schema' object", param="response_format")
        schema = body.get("schema", body.get("json_schema"))
        if not isinstance(schema, dict):
            raise APIError(
                400, "response_format json_schema needs 'json_schema.schema' (an object)", param="response_format"
            )
        return {"json": schema}
    raise APIError(
        400, f"response_format type {kind!r} is not supported (text, json_object, json_schema)", param="response_format"
    )


def _from_structured_outputs(fields: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(
        set(fields)
        - set(_STRUCTURED_KEYS)
        - {"disable_any_whitespace", "disable_fallback", "disable_additional_properties", "whitespace_pattern"}
    )
    if unknown:
        raise APIError(400, f"structured_outputs.{unknown[0]} is not supported", param="structured_outputs")
    if fields.get("whitespace_pattern") is not None:
        raise APIError(400, "structured_outputs.whitespace_pattern is not supported", param="structured_outputs")
    spec = {key: fields[key] for key in _STRUCTURED_KEYS if fields.get(key) not in (None, False)}
    if fields.get("disable_any_whitespace"):
        spec["disable_any_whitespace"] = True
    return spec
