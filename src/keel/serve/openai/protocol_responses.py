"""The body of POST /v1/responses (OpenAI's Responses API, as vLLM serves it) and its chat equivalent.

keel answers a Responses request as the chat completion it amounts to: `instructions` become the system
message, `input` (text, or message, function-call and function-output items) the conversation, function
tools and `tool_choice` the chat ones, `text.format` the structured output, `reasoning.effort` the chat
template's, `include` of output logprobs with `top_logprobs` the chat logprobs; the sampling extensions keel's
chat route takes (top_k, seed, stop, ...) pass through. keel keeps no responses: `store` is accepted and
reported false, and what needs a stored response or a conversation (`previous_response_id`, `conversation`,
`background`) is a 400, as is any other field that would change the result and keel does not implement.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr

from keel.serve.openai.errors import APIError
from keel.serve.openai.protocol import INT64, _SamplingFields
from keel.serve.sampling import MAX_LOGPROBS

# Responses fields keel refuses unless they hold a value that changes nothing.
REFUSED: dict[str, tuple[Any, ...]] = {
    "previous_response_id": (None,),
    "conversation": (None,),
    "background": (None, False),
    "prompt": (None,),
    "truncation": (None, "disabled"),
    "n": (None, 1),
    # vLLM's extensions that return or take the conversation's messages
    "enable_response_messages": (None, False),
    "previous_input_messages": (None, []),
}
LOGPROBS_INCLUDE = "message.output_text.logprobs"
# The chat fields a Responses body may not carry under their chat names (it has its own for them).
CHAT_ONLY = {"messages", "max_tokens", "max_completion_tokens", "logprobs", "response_format", "tools", "tool_choice"}


class FunctionTool(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    name: StrictStr
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text", "json_schema", "json_object"] = "text"
    name: StrictStr | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: StrictStr | None = None
    strict: StrictBool | None = None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")
    effort: Literal["minimal", "low", "medium", "high"] | None = None
    summary: StrictStr | None = None  # no summaries are written: the reasoning item carries the text itself


class ResponsesRequest(_SamplingFields):
    input: StrictStr | list[dict[str, Any]]
    instructions: StrictStr | None = None
    max_output_tokens: Annotated[int, Field(ge=1, lt=INT64)] | None = None
    text: TextConfig | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: StrictStr | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool = True
    reasoning: ReasoningConfig | None = None
    include: list[StrictStr] | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    store: StrictBool | None = None
    metadata: dict[str, StrictStr] | None = None
    user: StrictStr | None = None

    def check_responses_fields(self) -> None:
        """400 for what keel does not implement, naming the field."""
        extra = self.model_extra or {}
        for name, neutral in REFUSED.items():
            if name in extra and extra[name] not in neutral:
                raise APIError(400, f"'{name}' is not supported by this server (it keeps no responses)", param=name)
        for name in CHAT_ONLY & set(extra):
            raise APIError(400, f"'{name}' is a chat completions field; /v1/responses does not take it", param=name)
        for item in self.include or []:
            if item != LOGPROBS_INCLUDE:
                raise APIError(400, f"include {item!r} is not supported by this server", param="include")
        if self.text is not None and self.text.verbosity not in (None, "medium"):
            raise APIError(400, "'text.verbosity' other than medium is not supported by this server", param="text")

    def chat_body(self) -> dict[str, Any]:
        """The chat completions body this request amounts to."""
        self.check_responses_fields()
        body = {name: value for name, value in self.model_dump(exclude_unset=True).items() if name in _PASSED}
        body.update((name, value) for name, value in (self.model_extra or {}).items() if name not in REFUSED)
        messages = [{"role": "system", "content": self.instructions}] if self.instructions is not None else []
        body["messages"] = messages + input_messages(self.input)
        if self.max_output_tokens is not None:
            body["max_completion_tokens"] = self.max_output_tokens
        if self.text is not None and self.text.format is not None and self.text.format.type != "text":
            body["response_format"] = _response_format(self.text.format)
        if self.tools:
            body["tools"] = [_chat_tool(tool, i) for i, tool in enumerate(self.tools)]
            body["parallel_tool_calls"] = self.parallel_tool_calls
        if self.tool_choice is not None:
            body["tool_choice"] = _chat_tool_choice(self.tool_choice, bool(self.tools))
        if self.reasoning is not None and self.reasoning.effort is not None:
            body["reasoning_effort"] = self.reasoning.effort
        if LOGPROBS_INCLUDE in (self.include or []):
            body["logprobs"] = True
            body["top_logprobs"] = self.top_logprobs or 0
        elif self.top_logprobs:
            raise APIError(400, f"'top_logprobs' needs include [{LOGPROBS_INCLUDE!r}]", param="top_logprobs")
        return body

    def echoed(self) -> dict[str, Any]:
        """The request's settings as a response reports them."""
        fmt = self.text.format if self.text is not None and self.text.format is not None else TextFormat()
        return {
            "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens,
            "metadata": self.metadata or {},
            "parallel_tool_calls": self.parallel_tool_calls,
            "previous_response_id": None,
            "reasoning": {"effort": self.reasoning.effort if self.reasoning else None, "summary": None},
            "store": False,
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True)},
            "tool_choice": self.tool_choice if self.tool_choice is not None else "auto",
            "tools": self.tools or [],
            "top_logprobs": self.top_logprobs,
            "truncation": "disabled",
            "user": self.user,
        }


# Fields of the shared sampling model that pass to the chat body as they are.
_PASSED = set(_SamplingFields.model_fields) - {"stream_options", "response_format", "n"}


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`input` as chat messages: text is one user message; message items keep their role (their input_text and
    output_text parts joined), function_call items become an assistant turn's tool calls (consecutive ones one
    turn), function_call_output items tool messages. Reasoning items are dropped, as chat templates drop the
    reasoning of earlier turns."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not items:
        raise APIError(400, "'input' must not be empty", param="input")
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message") if isinstance(item, dict) else None
        where = f"input[{i}]"
        if kind == "message":
            role = item.get("role")
            if role not in ("system", "developer", "user", "assistant"):
                roles = "system, developer, user, assistant"
                raise APIError(400, f"{where}: role {role!r} is not one of {roles}", param="input")
            messages.append({"role": role, "content": _text(item.get("content"), where)})
        elif kind == "function_call":
            call = {
                "id": _field(item, "call_id", where),
                "type": "function",
                "function": {"name": _field(item, "name", where), "arguments": _field(item, "arguments", where)},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls") and not last["content"]:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            content = output if isinstance(output, str) else _text(output, where)
            messages.append({"role": "tool", "tool_call_id": _field(item, "call_id", where), "content": content})
        elif kind == "reasoning":
            continue
        else:
            takes = "message, function_call, function_call_output"
            raise APIError(400, f"{where} has type {kind!r}; this server takes {takes}", param="input")
    if not messages:
        raise APIError(400, "'input' holds no message", param="input")
    return messages


def _text(content: Any, where: str) -> str:
    """A message's content: text, or text parts (input_text, output_text) joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where}: content must be text or a list of text parts", param="input")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            raise APIError(
                400,
                f"{where} part {j} has type {kind!r}; this server takes text only (input_text parts)",
                param="input",
            )
        texts.append(part["text"])
    return "\n".join(texts)  # as a chat message's text parts


def _field(item: dict[str, Any], name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise APIError(400, f"{where}: '{name}' must be a string", param="input")
    return value


def _response_format(fmt: TextFormat) -> dict[str, Any]:
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.schema_ is None:
        raise APIError(400, "text.format of type json_schema needs a 'schema'", param="text")
    schema = {"name": fmt.name or "response", "schema": fmt.schema_, "strict": fmt.strict}
    return {"type": "json_schema", "json_schema": schema}


def _chat_tool(tool: dict[str, Any], i: int) -> dict[str, Any]:
    kind = tool.get("type") if isinstance(tool, dict) else None
    if kind != "function":
        raise APIError(400, f"tools[{i}] has type {kind!r}; this server runs function tools only", param="tools")
    function = FunctionTool.model_validate(tool).model_dump(exclude_none=True, exclude={"type"})
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: str | dict[str, Any], has_tools: bool) -> str | dict[str, Any]:
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise APIError(
                400, f"tool_choice {choice!r}: expected none, auto, required or a function", param="tool_choice"
            )
        return choice
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        raise APIError(400, f"tool_choice {json.dumps(choice)[:80]}: expected a function by name", param="tool_choice")
    if not has_tools:
        raise APIError(400, "tool_choice names a function but no tools were given", param="tool_choice")
    return {"type": "function", "function": {"name": choice["name"]}}
