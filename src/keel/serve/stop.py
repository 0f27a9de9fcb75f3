"""When a request stops, and which of its text may be streamed (vLLM's stop checks, per request).

Stop strings must never reach the client, even when one is split over several tokens: text that
could still be the start of a stop string is held back until it either completes one (then it is
cut) or can no longer start one (then it is released). With `include_stop_str_in_output` nothing
needs holding back: the stop string is emitted anyway, and only the text after it is cut.
"""

from __future__ import annotations

from collections.abc import Iterable

from keel.serve.sampling import SamplingParams


class StopChecker:
    """Per-request stop state: feed every generated token with its text delta to `add`.

    Finish reasons (OpenAI / vLLM): "stop" for EOS, a stop token or a stop string, "length" for
    max_tokens. `stop_reason` is what vLLM reports: the matched stop string or stop token id, and
    None for EOS or length. EOS and stop tokens are not part of the text (their delta is dropped).
    Nothing stops a request while fewer than `min_tokens` tokens precede the current one (the
    sampler masks EOS / stop tokens then; stop strings ending in that text are ignored, as in vLLM).
    """

    def __init__(self, params: SamplingParams, eos_token_ids: Iterable[int] = ()) -> None:
        self.params = params
        self.stop_strings = list(params.stop)
        self.stop_token_ids = set(params.stop_token_ids)
        self.eos_token_ids = set() if params.ignore_eos else set(eos_token_ids)
        self.num_tokens = 0
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        # The text still needed: the held-back tail, plus enough emitted text before it for a stop
        # string to be found across delta boundaries. `_emitted` indexes into `_buffer`.
        self._buffer = ""
        self._emitted = 0
        self._max_stop_len = max((len(s) for s in self.stop_strings), default=0)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, token_id: int, text_delta: str) -> tuple[str, bool]:
        """Record one generated token; return (text safe to emit now, whether the request finished)."""
        if self.finished:
            return "", True
        index = self.num_tokens  # 0-based position of this token in the output
        self.num_tokens += 1
        may_stop = index >= self.params.min_tokens
        if may_stop and token_id in self.eos_token_ids:
            return self._finish("stop", None)
        if may_stop and token_id in self.stop_token_ids:
            return self._finish("stop", token_id)
        start = len(self._buffer)  # where the new text begins: a stop string must end after it
        self._buffer += text_delta
        if may_stop and self.stop_strings and text_delta:
            match = self._find_stop(start)
            if match is not None:
                begin, stop = match
                cut = begin + len(stop) if self.params.include_stop_str_in_output else begin
                text = self._buffer[self._emitted : cut]
                self._buffer, self._emitted = "", 0
                self.finish_reason, self.stop_reason = "stop", stop
                return text, True
        if self.num_tokens >= self.params.max_tokens:
            return self._finish("length", None)
        release = len(self._buffer)
        if not self.params.include_stop_str_in_output:
            release -= self._held_back_length()
        text = self._buffer[self._emitted : release]
        self._emitted = release
        self._trim()
        return text, False

    def flush(self) -> str:
        """The held-back text, when the request ends for another reason (abort, context full)."""
        text = self._buffer[self._emitted :]
        self._buffer, self._emitted = "", 0
        return text

    def finish(self, reason: str) -> tuple[str, bool]:
        """End the request for a reason of the caller's (the held-back text, True)."""
        return self._finish(reason, None)

    def _finish(self, reason: str, stop_reason: str | int | None) -> tuple[str, bool]:
        # Held-back text was not a stop string after all: the request is over, release it.
        self.finish_reason, self.stop_reason = reason, stop_reason
        return self.flush(), True

    def _find_stop(self, new_from: int) -> tuple[int, str] | None:
        """The stop string that completes first (earliest end; at equal ends the longest), ending after new_from.

        Earliest end is what a character-by-character stream would have matched, so the result
        does not depend on how the text was split into deltas.
        """
        best: tuple[int, str] | None = None
        for stop in self.stop_strings:
            begin = self._buffer.find(stop, max(0, new_from - len(stop) + 1))
            if begin < 0:
                continue
            if best is None or (begin + len(stop), begin) < (best[0] + len(best[1]), best[0]):
                best = (begin, stop)
        return best

    def _held_back_length(self) -> int:
        """Length of the longest unreleased suffix that is a proper prefix of some stop string."""
        pending = len(self._buffer) - self._emitted
        for k in range(min(pending, self._max_stop_len - 1), 0, -1):
            tail = self._buffer[-k:]
            if any(stop.startswith(tail) for stop in self.stop_strings):
                return k
        return 0

    def _trim(self) -> None:
        # Bound the buffer on long outputs. With include_stop_str_in_output a stop string may begin
        # in emitted text, so keep the last max_stop_len - 1 emitted characters for the search.
        keep_from = max(0, self._emitted - max(self._max_stop_len - 1, 0))
        if keep_from:
            self._buffer = self._buffer[keep_from:]
            self._emitted -= keep_from
