"""A chat request as prompt token ids: its messages, tools and template options through the chat template.

As vLLM renders it (with transformers' conventions): `tools` reach the template as OpenAI's tool list,
`documents` and `reasoning_effort` as template variables, `chat_template_kwargs` as further variables
(e.g. Qwen3's `enable_thinking`); `continue_final_message` renders the conversation without a new
turn and cuts the text after the last message's content, so the model continues that message.
"""

from __future__ import annotations

from typing import Any

from keel.errors import KeelError
from keel.serve.openai.errors import APIError
from keel.serve.openai.protocol import ChatCompletionRequest
from keel.tokenizer import Tokenizer

# Variables the request's own fields set: chat_template_kwargs may not override them.
_RESERVED = ("messages", "add_generation_prompt", "tools", "documents", "bos_token", "eos_token")


def render_chat(tokenizer: Tokenizer | None, req: ChatCompletionRequest) -> list[int]:
    """The prompt's token ids; APIError 400 naming the field when the request cannot be rendered."""
    if tokenizer is None:
        raise APIError(400, "this model has no tokenizer, so no chat template: use /v1/completions")
    return tokenizer.encode(render_chat_text(tokenizer, req), add_special_tokens=req.add_special_tokens)


def render_chat_text(tokenizer: Tokenizer, req: ChatCompletionRequest) -> str:
    if req.continue_final_message and req.add_generation_prompt:
        raise APIError(
            400,
            "continue_final_message and add_generation_prompt cannot both be true (send add_generation_prompt: false)",
            param="continue_final_message",
        )
    messages = [m.to_template() for m in req.messages]
    variables = _template_variables(req)
    try:
        text = tokenizer.apply_chat_template(messages, req.add_generation_prompt, **variables)
    except KeelError as e:
        raise APIError(400, str(e), param="messages") from None
    if req.continue_final_message:
        text = _cut_after_final_message(text, req.messages[-1].text())
    return text


def _template_variables(req: ChatCompletionRequest) -> dict[str, Any]:
    variables: dict[str, Any] = {}
    for name, value in (req.chat_template_kwargs or {}).items():
        if name in _RESERVED:
            raise APIError(400, f"chat_template_kwargs may not set {name!r}", param="chat_template_kwargs")
        variables[name] = value
    if req.tools:  # also under tool_choice none, as vLLM renders them by default
        variables["tools"] = req.tool_list()
    if req.documents is not None:
        variables["documents"] = req.documents
    if req.reasoning_effort is not None:
        variables.setdefault("reasoning_effort", req.reasoning_effort)
    return variables


def _cut_after_final_message(text: str, final: str) -> str:
    """The rendered conversation up to the end of the last message's content (transformers' rule: the
    content as written, else stripped of surrounding whitespace, which some templates trim)."""
    for needle in (final, final.strip()):
        if needle and needle in text:
            return text[: text.rindex(needle) + len(needle)]
    raise APIError(
        400, "continue_final_message: the chat template does not write the final message's content", param="messages"
    )
