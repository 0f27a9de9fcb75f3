"""Request bodies of the OpenAI API (and vLLM's extensions), validated with pydantic.

Every field of vLLM's OpenAI server that changes the result is honoured or refused with a 400 naming
it (tests/test_serve_fields.py enumerates them); fields that do not change it (`user`, `metadata`,
`store`, ...) and unknown fields are accepted and ignored, as OpenAI-compatible servers do.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr, field_validator

from keel.serve.openai.errors import APIError
from keel.serve.openai.structured_fields import structured_outputs_of
from keel.serve.sampling import MAX_LOGPROBS, SamplingParams
from keel.serve.structured import StructuredOutputsParams

INT64 = 2**63
# Fields that change the result and that keel does not implement: a 400 unless the value is one that
# changes nothing (listed), never silently ignored.
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "suffix": (None, ""),
    "functions": (None, []),
    "function_call": (None, "none", "auto"),
    "use_beam_search": (None, False),
    "length_penalty": (None, 1, 1.0),
    "logits_processors": (None, []),
    "return_tokens_as_token_ids": (None, False),
    "return_token_ids": (None, False),
    "spaces_between_special_tokens": (None, True),
    "cache_salt": (None,),
    "kv_transfer_params": (None,),
    "vllm_xargs": (None,),
    "mm_processor_kwargs": (None,),
    "audio": (None,),
    "prediction": (None,),
    "web_search_options": (None,),
    "chat_template": (None,),
    "prompt_embeds": (None,),
    "structural_tag": (None,),
    "modalities": (None, ["text"]),
}


def refuse_fields(extra: dict[str, Any], refused: dict[str, tuple[Any, ...]]) -> None:
    """A 400 naming the first of `refused` that `extra` (a body's fields beyond the model's) gives a value other
    than the ones listed for it, which change nothing."""
    for name, neutral in refused.items():
        if name in extra and extra[name] not in neutral:
            raise APIError(400, f"'{name}' is not supported by this server", param=name)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    # vLLM's defaults: stream_options given at all ({} or only continuous_usage_stats) asks for the usage chunk
    include_usage: StrictBool | None = True
    continuous_usage_stats: StrictBool | None = False  # vLLM's: usage in every chunk


class _SamplingFields(BaseModel):
    """Fields shared by both endpoints."""

    model_config = ConfigDict(extra="allow")

    model: StrictStr | None = None
    # vLLM's bounds, not OpenAI's: any temperature >= 0 (OpenAI stops at 2)
    temperature: Annotated[float, Field(ge=0.0, allow_inf_nan=False)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=10.0)] | None = None
    n: Annotated[int, Field(ge=1, le=64)] = 1
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    seed: Annotated[int, Field(ge=-INT64, lt=INT64)] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    ignore_eos: StrictBool = False
    min_tokens: Annotated[int, Field(ge=0)] = 0
    skip_special_tokens: StrictBool = True
    include_stop_str_in_output: StrictBool = False
    # Token constraints and scheduling (vLLM's extensions; logit_bias is OpenAI's, keyed by token id strings)
    logit_bias: dict[str, Annotated[float, Field(allow_inf_nan=False)]] | None = None  # clamped to [-100, 100]
    allowed_token_ids: list[Annotated[int, Field(ge=0, lt=INT64)]] | None = None
    bad_words: list[StrictStr] | None = None
    priority: Annotated[int, Field(ge=-INT64, lt=INT64)] = 0
    request_id: StrictStr | None = None  # the response's id (vLLM's); the engine keeps its own unique ids
    truncate_prompt_tokens: Annotated[int, Field(ge=1)] | None = None  # keep the prompt's last N tokens
    prompt_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    # Structured outputs (keel.serve.openai.structured_fields): one of these constrains the output
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | StrictStr | None = None
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = None
    guided_grammar: StrictStr | None = None
    guided_decoding_backend: StrictStr | None = None
    guided_whitespace_pattern: StrictStr | None = None

    def check_unsupported(self) -> None:
        extra = self.model_extra or {}
        refuse_fields(extra, UNSUPPORTED)
        best_of = extra.get("best_of")
        if best_of is not None and best_of != self.n:
            raise APIError(400, "'best_of' other than n is not supported by this server", param="best_of")

    def structured(self) -> StructuredOutputsParams | None:
        guided = {name: getattr(self, name) for name in GUIDED_FIELDS}
        return structured_outputs_of(self.response_format, self.structured_outputs, guided)

    def token_bias(self) -> dict[int, float] | None:
        if self.logit_bias is None:
            return None
        try:
            # vLLM clamps a bias to [-100, 100] rather than refusing it (either end already forces or bans)
            return {int(token): min(100.0, max(-100.0, bias)) for token, bias in self.logit_bias.items()}
        except ValueError:
            raise APIError(400, "'logit_bias' keys must be token ids", param="logit_bias") from None

    def sampling_params(self, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None) -> SamplingParams:
        defaults = SamplingParams()
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not s for s in stop):
            raise APIError(400, "'stop' strings must not be empty", param="stop")
        if self.min_tokens > max_tokens:
            raise APIError(400, f"min_tokens ({self.min_tokens}) exceeds max_tokens ({max_tokens})", param="min_tokens")

        def pick(value: Any, default: Any) -> Any:
            return default if value is None else value

        temperature = pick(self.temperature, defaults.temperature)
        if self.n > 1 and temperature < 1e-5:  # vLLM's rule (SamplingParams._verify_greedy_sampling)
            raise APIError(400, f"n must be 1 when using greedy sampling, got {self.n}.", param="n")

        return SamplingParams(
            n=1,  # the server fans n out into n engine requests
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            temperature=temperature,
            top_p=pick(self.top_p, defaults.top_p),
            top_k=pick(self.top_k, defaults.top_k),
            min_p=pick(self.min_p, defaults.min_p),
            repetition_penalty=pick(self.repetition_penalty, defaults.repetition_penalty),
            presence_penalty=pick(self.presence_penalty, defaults.presence_penalty),
            frequency_penalty=pick(self.frequency_penalty, defaults.frequency_penalty),
            seed=self.seed,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logprobs=logprobs,
            prompt_logprobs=_larger(prompt_logprobs, self.prompt_logprobs),
            skip_special_tokens=self.skip_special_tokens,
            logit_bias=self.token_bias(),
            allowed_token_ids=self.allowed_token_ids,
            bad_words=list(self.bad_words or []),
            structured_outputs=self.structured(),
        )


def _larger(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else max(a, b)


GUIDED_FIELDS = (
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "guided_decoding_backend",
    "guided_whitespace_pattern",
)


PromptIds = list[Annotated[int, Field(ge=0, lt=INT64)]]


class CompletionRequest(_SamplingFields):
    prompt: StrictStr | PromptIds | list[StrictStr] | list[PromptIds]
    # OpenAI's default for completions. 0 is accepted with echo only: score the prompt, generate nothing
    # (what log-likelihood evaluations such as lm-eval send); without echo it is a 400 (see prompt_only).
    max_tokens: Annotated[int, Field(ge=0, lt=INT64)] | None = 16
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: StrictBool = False
    add_special_tokens: StrictBool = True  # BOS and the like around a text prompt, as vLLM's default

    def prompt_only(self) -> bool:
        """max_tokens 0 with echo: the response is the echoed prompt (with its logprobs when asked),
        nothing generated, as OpenAI's legacy completions and vLLM answer it."""
        if self.max_tokens != 0:
            return False
        if not self.echo:
            raise APIError(
                400, "max_tokens must be at least 1 (0 only with echo, to score the prompt)", param="max_tokens"
            )
        return True

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: text, or token ids."""
        p = self.prompt
        if isinstance(p, str):
            items: list = [p]
        elif not p:
            raise APIError(400, "'prompt' must not be empty", param="prompt")
        elif isinstance(p[0], int):
            items = [p]
        else:
            items = list(p)
        if any(len(item) == 0 for item in items):
            raise APIError(400, "'prompt' must not be empty", param="prompt")
        return items


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: StrictStr


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: StrictStr
    arguments: StrictStr  # JSON text, as OpenAI sends it


class AssistantToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    id: StrictStr
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart] | None = None
    name: StrictStr | None = None
    tool_calls: list[AssistantToolCall] | None = None  # an assistant turn that called tools
    tool_call_id: StrictStr | None = None  # a tool result: the call it answers
    reasoning_content: StrictStr | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, content: Any) -> Any:
        # Without this a list holding an image part fails the union's first branch, and the client reads
        # "Input should be a valid string" about a list it sent on purpose.
        if isinstance(content, list):
            for i, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind != "text":
                    raise ValueError(
                        f"part {i} has type {kind!r}; this server takes text only (content parts of type 'text')"
                    )
        return content

    def text(self) -> str:
        content = self.content
        if isinstance(content, list):
            content = "\n".join(part.text for part in content)  # as vLLM joins text parts for string templates
        return content or ""

    def to_template(self) -> dict[str, Any]:
        """The message as chat templates expect it (transformers' convention, as vLLM renders it): content
        as one string (text parts joined by newlines); a tool call's arguments as an object, not JSON text."""
        message: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role}
        message["content"] = self.text()
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": _arguments(call.function.arguments)},
                }
                for call in self.tool_calls
            ]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.reasoning_content is not None:
            message["reasoning_content"] = self.reasoning_content
        return message


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        raise APIError(400, f"a tool call's arguments are not JSON: {text[:80]!r}", param="messages") from None


class ToolFunction(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: StrictStr
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: ToolFunction


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: StrictStr


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1, lt=INT64)] | None = None  # deprecated by OpenAI; still honoured
    max_completion_tokens: Annotated[int, Field(ge=1, lt=INT64)] | None = None
    logprobs: StrictBool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    add_special_tokens: StrictBool = False
    chat_template_kwargs: dict[str, Any] | None = None
    echo: StrictBool = False
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool = True
    reasoning_effort: Literal["minimal", "low", "medium", "high"] | None = None
    include_reasoning: StrictBool = True  # false: reasoning_content is left out of the response
    documents: list[dict[str, Any]] | None = None  # for templates that render retrieved documents

    def tool_list(self) -> list[dict[str, Any]]:
        """The tools as OpenAI's JSON (what chat templates and the tool-call schemas take); [] without tools."""
        return [tool.model_dump(exclude_none=True) for tool in self.tools or []]

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def structured(self) -> StructuredOutputsParams | None:
        """The request's constraint: its structured-output fields, or the schema a forcing tool_choice implies
        (a named function's parameters, or vLLM's array of calls for "required"); both at once is a 400."""
        from keel.serve.openai.tool_schemas import tool_choice_schema

        constraint = super().structured()
        if not self.tools or self.tool_choice in (None, "none", "auto"):
            return constraint
        choice = self.tool_choice if isinstance(self.tool_choice, str) else self.tool_choice.model_dump()
        try:
            schema = tool_choice_schema(self.tool_list(), choice)
        except ValueError as e:
            raise APIError(400, str(e), param="tool_choice") from None
        if choice == "required" and not self.parallel_tool_calls:
            schema["maxItems"] = 1  # OpenAI's parallel_tool_calls false: at most one call
        if constraint is not None:
            raise APIError(400, "tool_choice and a structured output both constrain the output", param="tool_choice")
        return StructuredOutputsParams.of(json=schema, source="tools")

    def num_logprobs(self) -> int | None:
        if self.top_logprobs and not self.logprobs:  # vLLM's rule: 0 asks for none, so it needs nothing
            raise APIError(400, "'top_logprobs' requires 'logprobs': true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None
