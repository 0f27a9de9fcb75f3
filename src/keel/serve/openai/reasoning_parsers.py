"""Reasoning parsers: a thinking model's `<think>...</think>` split off the reply, whole or streamed.

    parser = get_reasoning_parser("deepseek_r1")()       # one per output
    reasoning_delta, content_delta = parser.feed(delta)  # never a partial marker
    ...
    reasoning_delta, content_delta = parser.finish()

`extract` runs the same state machine over the whole text, so streamed deltas concatenate to it exactly.
The markers are stripped; the newlines after `</think>` stay in the content, as vLLM keeps them.

- `deepseek_r1`: the chat template may already have put `<think>` in the prompt, so the output starts in
  reasoning: everything up to `</think>` is reasoning (a leading `<think>`, and whitespace before it, is
  dropped); with no `</think>` at all, everything is reasoning.
- `qwen3`: reasoning only when the output opens with `<think>` (Qwen3's template with thinking on); an
  output without it is all content, `</think>` included, as when thinking is disabled. An open `<think>`
  never closed (cut off by max_tokens) is all reasoning, as vLLM streams it and as its current non-streamed
  parser returns it. Templates that put `<think>` in the prompt (Qwen3-2507 Thinking, Qwen3.5) need
  `starts_in_reasoning=True`, which the route can tell from the rendered prompt's end.
- `openai_gptoss`: GPT-OSS's harmony channels (keel.serve.openai.harmony), not `<think>`: the analysis channel
  is reasoning, the final channel content; the default for GPT-OSS models (vLLM reads harmony for them too).
"""

from __future__ import annotations

from typing import ClassVar, NamedTuple

from keel.serve.openai.harmony import CALL_END, CALL_HEAD, MESSAGE, HarmonyReader
from keel.serve.openai.parser_registry import ParserRegistry

THINK_START = "<think>"
THINK_END = "</think>"

# States: undecided (leading whitespace and a possible `<think>` held); reasoning; content.
_START, _REASONING, _CONTENT = range(3)


class ReasoningDelta(NamedTuple):
    """What one `feed`/`finish` releases ("" for nothing)."""

    reasoning: str
    content: str


class ReasoningParser:
    """Splits `<think>` reasoning from content; subclasses set the markers and where an output starts."""

    name: ClassVar[str] = ""
    start_token: ClassVar[str] = THINK_START
    end_token: ClassVar[str] = THINK_END
    # Whether an output that does not open with start_token is reasoning (the prompt opened it).
    default_starts_in_reasoning: ClassVar[bool] = True
    # The route must decode with special tokens kept: the markers are special tokens (GPT-OSS's harmony).
    needs_special_tokens: ClassVar[bool] = False

    def __init__(self, *, starts_in_reasoning: bool | None = None) -> None:
        self.starts_in_reasoning = (
            self.default_starts_in_reasoning if starts_in_reasoning is None else starts_in_reasoning
        )
        self._state = _START
        self._buf = ""
        self._finished = False

    def extract(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole output; each None when empty."""
        parser = type(self)(starts_in_reasoning=self.starts_in_reasoning)
        first, last = parser.feed(text), parser.finish()
        reasoning, content = first.reasoning + last.reasoning, first.content + last.content
        return reasoning or None, content or None

    def is_reasoning_end(self, text_so_far: str) -> bool:
        """Whether the output so far has finished its reasoning, so a grammar on the reply may apply now.

        False while the output is empty or could still be opening a `<think>`, which a grammar would forbid."""
        head = text_so_far.lstrip()
        if head.startswith(self.start_token):
            return self.end_token in head[len(self.start_token) :]
        if _could_become(head, self.start_token):
            return False
        return not self.starts_in_reasoning or self.end_token in text_so_far

    def feed(self, delta: str) -> ReasoningDelta:
        if self._finished:
            raise RuntimeError("feed() after finish(): make a new parser for each output")
        self._buf += delta
        return self._drain(final=False)

    def finish(self) -> ReasoningDelta:
        if self._finished:
            raise RuntimeError("finish() called twice")
        self._finished = True
        return self._drain(final=True)

    def _drain(self, final: bool) -> ReasoningDelta:
        reasoning: list[str] = []
        content: list[str] = []
        while True:
            buf = self._buf
            if self._state == _START:
                head = buf.lstrip()
                if head.startswith(self.start_token):
                    self._buf = head[len(self.start_token) :]  # the marker and the whitespace before it go
                    self._state = _REASONING
                    continue
                if _could_become(head, self.start_token) and not final:
                    break
                self._state = _REASONING if self.starts_in_reasoning else _CONTENT
                continue
            if self._state == _CONTENT:
                content.append(buf)
                self._buf = ""
                break
            # _REASONING
            end = buf.find(self.end_token)
            if end >= 0:
                reasoning.append(buf[:end])
                self._buf = buf[end + len(self.end_token) :]
                self._state = _CONTENT
                continue
            keep = 0 if final else _partial_suffix(buf, self.end_token)
            reasoning.append(buf[: len(buf) - keep])
            self._buf = buf[len(buf) - keep :]
            break
        return ReasoningDelta("".join(reasoning), "".join(content))


def _could_become(text: str, marker: str) -> bool:
    """Whether `text` is a proper prefix of `marker` (the empty string included)."""
    return len(text) < len(marker) and marker.startswith(text)


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


# `@register_reasoning_parser("mine")` on a ReasoningParser subclass makes `get_reasoning_parser("mine")` return it.
_REGISTRY: ParserRegistry[type[ReasoningParser]] = ParserRegistry(
    ReasoningParser, "reasoning parser", "register_reasoning_parser"
)
REASONING_PARSERS = _REGISTRY.classes
register_reasoning_parser = _REGISTRY.register
get_reasoning_parser = _REGISTRY.get


@register_reasoning_parser("deepseek_r1")
class DeepSeekR1ReasoningParser(ReasoningParser):
    default_starts_in_reasoning = True


@register_reasoning_parser("qwen3")
class Qwen3ReasoningParser(ReasoningParser):
    default_starts_in_reasoning = False


@register_reasoning_parser("openai_gptoss")
class GptOssReasoningParser(ReasoningParser):
    """GPT-OSS's harmony messages (keel.serve.openai.harmony): the `analysis` channel is reasoning; the `final`
    channel and commentary without a recipient (preambles) are content; a tool call's message (`to=functions.NAME`)
    passes to the content as `<|start|>assistant to=functions.NAME<|message|>ARGS<|call|>`, which the `openai`
    tool parser reads. The markers are special tokens (`needs_special_tokens`). A request whose output a grammar
    constrains (`starts_in_reasoning=False`) writes no harmony: its text is all content."""

    start_token = "<|channel|>analysis<|message|>"
    end_token = "<|end|>"
    needs_special_tokens = True
    default_starts_in_reasoning = True

    def __init__(self, *, starts_in_reasoning: bool | None = None) -> None:
        super().__init__(starts_in_reasoning=starts_in_reasoning)
        self._reader = HarmonyReader()
        self._kind = "content"  # the current message's: reasoning, content or call

    def feed(self, delta: str) -> ReasoningDelta:
        if self._finished:
            raise RuntimeError("feed() after finish(): make a new parser for each output")
        if not self.starts_in_reasoning:
            return ReasoningDelta("", delta)
        return self._route(self._reader.feed(delta))

    def finish(self) -> ReasoningDelta:
        if self._finished:
            raise RuntimeError("finish() called twice")
        self._finished = True
        if not self.starts_in_reasoning:
            return ReasoningDelta("", "")
        return self._route(self._reader.finish())

    def is_reasoning_end(self, text_so_far: str) -> bool:
        """Whether a reply's or a tool call's message has begun (its header is complete)."""
        if not self.starts_in_reasoning:
            return True
        return any(
            p.kind == "header" and (p.header.channel != "analysis" or p.header.function is not None)
            for p in HarmonyReader().feed(text_so_far)
        )

    def _route(self, pieces: list) -> ReasoningDelta:  # noqa: ANN001
        reasoning: list[str] = []
        content: list[str] = []
        for piece in pieces:
            if piece.kind == "header":
                header = piece.header
                if header.function is not None:
                    self._kind = "call"
                    content.append(f"{CALL_HEAD}{header.function}{MESSAGE}")
                else:
                    self._kind = "reasoning" if header.channel == "analysis" else "content"
            elif piece.kind == "body":
                (reasoning if self._kind == "reasoning" else content).append(piece.text)
            elif self._kind == "call":  # the call's end, whatever ended it (<|call|>, or the output)
                content.append(CALL_END)
        return ReasoningDelta("".join(reasoning), "".join(content))
