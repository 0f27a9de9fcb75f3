"""Token ids as responses show them: logprob entries and echoed prompts."""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache

from keel.tokenizer import Tokenizer


class TokenRenderer:
    """Each token's bytes and text, cached per id (logprobs render the same tokens again and again)."""

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        # Per-instance caches: a cache on the method would be shared by every renderer and keep them alive.
        self.token_bytes: Callable[[int], bytes] = lru_cache(maxsize=65536)(self._token_bytes)
        self.token_text: Callable[[int], str] = lru_cache(maxsize=65536)(self._token_text)

    def _token_bytes(self, token_id: int) -> bytes:
        return self.tokenizer.token_bytes(token_id) if self.tokenizer else str(token_id).encode()

    def _token_text(self, token_id: int) -> str:
        """A token as logprobs show it; part of a UTF-8 character as OpenAI writes it: "bytes:\\xe2"."""
        raw = self.token_bytes(token_id)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)

    def decode(self, token_ids: list[int]) -> str:
        """A token-id prompt as echoed text ("" without a tokenizer)."""
        return self.tokenizer.decode(token_ids) if self.tokenizer else ""
