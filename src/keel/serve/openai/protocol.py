"""Request bodies of the OpenAI API (and vLLM's extensions), validated with pydantic.

Unknown fields are ignored, as OpenAI-compatible servers do (clients send `user` and others);
fields that would change the result but that keel does not implement (`logit_bias`, `suffix`,
`tools`, `response_format` other than text, `best_of` > n) are rejected with a 400 rather than
silently ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr

from keel.serve.openai.errors import APIError
from keel.serve.sampling import MAX_LOGPROBS, SamplingParams

INT64 = 2**63
# Fields that change the result and that keel does not implement: a 400, never silently ignored.
UNSUPPORTED = ("logit_bias", "suffix", "tools", "functions", "tool_choice", "function_call")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool = False


class _SamplingFields(BaseModel):
    """Fields shared by both endpoints."""

    model_config = ConfigDict(extra="allow")

    model: StrictStr | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
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

    def check_unsupported(self) -> None:
        extra = self.model_extra or {}
        for name in UNSUPPORTED:
            if extra.get(name) not in (None, {}, [], "", "none", "auto"):
                raise APIError(400, f"'{name}' is not supported by this server", param=name)
        best_of = extra.get("best_of")
        if best_of is not None and best_of != self.n:
            raise APIError(400, "'best_of' other than n is not supported by this server", param="best_of")
        fmt = extra.get("response_format")
        if isinstance(fmt, dict) and fmt.get("type") not in (None, "text"):
            raise APIError(400, "'response_format' other than text is not supported", param="response_format")

    def sampling_params(self, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None) -> SamplingParams:
        defaults = SamplingParams()
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not s for s in stop):
            raise APIError(400, "'stop' strings must not be empty", param="stop")
        if self.min_tokens > max_tokens:
            raise APIError(400, f"min_tokens ({self.min_tokens}) exceeds max_tokens ({max_tokens})", param="min_tokens")

        def pick(value: Any, default: Any) -> Any:
            return default if value is None else value

        return SamplingParams(
            n=1,  # the server fans n out into n engine requests
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            temperature=pick(self.temperature, defaults.temperature),
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
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
        )


PromptIds = list[Annotated[int, Field(ge=0, lt=INT64)]]


class CompletionRequest(_SamplingFields):
    prompt: StrictStr | PromptIds | list[StrictStr] | list[PromptIds]
    # OpenAI's default for completions. 0 is accepted with echo only: score the prompt, generate nothing
    # (what log-likelihood evaluations such as lm-eval send); without echo it is a 400 (see prompt_only).
    max_tokens: Annotated[int, Field(ge=0, lt=INT64)] | None = 16
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: StrictBool = False

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


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart] | None = None
    name: StrictStr | None = None

    def to_template(self) -> dict[str, Any]:
        """The message as chat templates expect it: content as one string (text parts joined)."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        message: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role}
        message["content"] = content or ""
        if self.name is not None:
            message["name"] = self.name
        return message


class ChatCompletionRequest(_SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1, lt=INT64)] | None = None  # deprecated by OpenAI; still honoured
    max_completion_tokens: Annotated[int, Field(ge=1, lt=INT64)] | None = None
    logprobs: StrictBool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    add_generation_prompt: StrictBool = True

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def num_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "'top_logprobs' requires 'logprobs': true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None
