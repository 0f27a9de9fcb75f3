"""Request bodies of /tokenize and /detokenize (vLLM's), validated with pydantic."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr

from keel.serve.openai.protocol import INT64, ChatCompletionRequest, ChatMessage, Tool, refuse_fields

# vLLM's fields that change the tokens and that keel does not take: a 400 unless left out.
_UNSUPPORTED = {"chat_template": (None,), "mm_processor_kwargs": (None,), "media_io_kwargs": (None,)}


class TokenizeCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None
    prompt: StrictStr
    add_special_tokens: StrictBool = True  # BOS and the like, as /v1/completions adds them
    return_token_strs: StrictBool | None = False


class TokenizeChatRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: StrictStr | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    add_special_tokens: StrictBool = False  # the chat template writes its own special tokens
    return_token_strs: StrictBool | None = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None

    def check_unsupported(self) -> None:
        refuse_fields(self.model_extra or {}, _UNSUPPORTED)

    def as_chat_request(self) -> ChatCompletionRequest:
        """The chat completion request these messages and template options make: /tokenize renders exactly
        the prompt /v1/chat/completions would."""
        return ChatCompletionRequest(
            messages=self.messages,
            add_generation_prompt=self.add_generation_prompt,
            continue_final_message=self.continue_final_message,
            add_special_tokens=self.add_special_tokens,
            chat_template_kwargs=self.chat_template_kwargs,
            tools=self.tools,
        )


TokenizeRequest = TokenizeCompletionRequest | TokenizeChatRequest


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None
    tokens: list[Annotated[int, Field(ge=0, lt=INT64)]]
