"""Engine outputs -> OpenAI response bodies and stream chunks (completions and chat)."""

from __future__ import annotations

import codecs
import json
from collections.abc import Callable
from dataclasses import dataclass, field

from keel.serve.sampling import TokenLogprobs

TokenText = Callable[[int], str]


def sse(payload: dict) -> str:
    """One server-sent event in OpenAI's stream format."""
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    def to_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


def _top_map(entry: TokenLogprobs, token_text: TokenText) -> dict[str, float]:
    """vLLM's completions `top_logprobs` entry: the top-n alternatives plus the sampled token."""
    top = {token_text(t): lp for t, lp in entry.top}
    top.setdefault(token_text(entry.token_id), entry.logprob)
    return top


_UTF8 = codecs.getincrementaldecoder("utf-8")


@dataclass
class CompletionLogprobs:
    """The legacy completions `logprobs` object, built incrementally (a stream keeps one per choice and sends the
    slice each chunk adds, so offsets run on across chunks). `text_offset`: where each token starts in the text,
    in characters of the tokens' bytes decoded in turn (a token holding part of a character adds nothing until
    the character completes), not in characters of the "bytes:\\x.." names such tokens are shown by."""

    token_bytes: Callable[[int], bytes]  # a token's raw bytes (what its characters in the text are made of)
    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)
    offset: int = 0  # characters of text before the next token
    _decoder: codecs.IncrementalDecoder = field(default_factory=lambda: _UTF8("replace"))

    def add_prompt(self, prompt_ids: list[int], entries: list[TokenLogprobs | None], token_text: TokenText) -> None:
        for token_id, entry in zip(prompt_ids, entries, strict=False):
            self._append(token_id, entry, token_text)

    def add(self, entries: list[TokenLogprobs], token_text: TokenText) -> None:
        for entry in entries:
            self._append(entry.token_id, entry, token_text)

    def _append(self, token_id: int, entry: TokenLogprobs | None, token_text: TokenText) -> None:
        text = token_text(token_id)
        self.tokens.append(text)
        self.token_logprobs.append(None if entry is None else entry.logprob)
        self.top_logprobs.append(None if entry is None else _top_map(entry, token_text))
        self.text_offset.append(self.offset)
        self.offset += len(self._decoder.decode(self.token_bytes(token_id)))

    def to_dict(self, start: int = 0) -> dict:
        return {
            "tokens": self.tokens[start:],
            "token_logprobs": self.token_logprobs[start:],
            "top_logprobs": self.top_logprobs[start:],
            "text_offset": self.text_offset[start:],
        }


def chat_logprobs(entries: list[TokenLogprobs], token_text: TokenText, token_bytes: Callable[[int], bytes]) -> dict:
    """The chat `logprobs` object: {"content": [{token, logprob, bytes, top_logprobs}]}."""

    def item(token_id: int, logprob: float) -> dict:
        return {"token": token_text(token_id), "logprob": logprob, "bytes": list(token_bytes(token_id))}

    content = []
    for entry in entries:
        row = item(entry.token_id, entry.logprob)
        row["top_logprobs"] = [item(t, lp) for t, lp in entry.top]
        content.append(row)
    return {"content": content}


def vllm_prompt_logprobs(entries: list[TokenLogprobs | None], token_text: TokenText) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: per prompt token, null for the first, else {token id: {logprob, rank,
    decoded_token}} for the prompt's own token and the top-n alternatives."""

    def entry(token_id: int, logprob: float, rank: int | None) -> dict:
        return {"logprob": logprob, "rank": rank, "decoded_token": token_text(token_id)}

    result: list[dict | None] = []
    for item in entries:
        if item is None:
            result.append(None)
            continue
        row = {str(item.token_id): entry(item.token_id, item.logprob, item.rank)}
        for rank, (token_id, logprob) in enumerate(item.top, start=1):
            row.setdefault(str(token_id), entry(token_id, logprob, rank))
        result.append(row)
    return result
