"""What a tool parser returns, and the streaming machinery every parser shares.

A parser turns the model's text into OpenAI tool calls, either all at once (`extract`) or delta by delta
(`feed`, then `finish`). Both run the same state machine (`extract` feeds the whole text to a fresh copy),
so a streamed reply concatenates to exactly the non-streamed one, however the text is split.

Streaming never sends text as content that it might later have to take back: text that could be the start
of a tool-call marker is held until it is known not to be one, and a call is only sent once it is known to
be valid, so a malformed call can still come back as plain content: the JSON formats send a call whole once
its JSON is complete and parsed; qwen3_coder sends the name once `<function=NAME>` is complete, then each
parameter as it ends.
The rules on the content around calls, the same for every parser:
- with no call in the output, the content is the output, unchanged;
- a call that is malformed (bad JSON, no name, a marker never completed) ends parsing: it, the whitespace
  before it and everything after it are content, verbatim; if it was the first call, the content is thus
  the whole output (vLLM's rule). A malformed call after valid ones leaves those standing (vLLM would
  return the whole text as content, but a stream has sent them by then);
- whitespace just before a call and at the end of an output with calls is dropped (vLLM would send
  `"\\n\\n"` as content next to the calls of `"</think>\\n\\n<tool_call>..."`); other text around and
  between calls is content (vLLM's non-streamed parsers keep only the text before the first call).
"""

from __future__ import annotations

import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from keel.serve.openai.tool_parsers.scan import find_marker


@dataclass
class ToolCall:
    """One complete call: `arguments` is the JSON text of an object, as OpenAI sends it."""

    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict[str, Any]:
        """The `message.tool_calls[i]` entry of a chat completion."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ExtractedToolCalls:
    """A whole output split into content (None when calls leave no text) and calls."""

    content: str | None
    tool_calls: list[ToolCall]

    @property
    def tools_called(self) -> bool:
        return bool(self.tool_calls)


@dataclass
class ToolCallDelta:
    """One entry of a chunk's `delta.tool_calls`: the first for a call carries id, type and name (and
    `arguments=""`); later ones carry pieces of the arguments, which concatenate to the call's JSON."""

    index: int
    id: str | None = None
    type: str | None = None
    name: str | None = None
    arguments: str | None = None

    def to_openai(self) -> dict[str, Any]:
        out: dict[str, Any] = {"index": self.index}
        if self.id is not None:
            out["id"] = self.id
        if self.type is not None:
            out["type"] = self.type
        function = {k: v for k, v in (("name", self.name), ("arguments", self.arguments)) if v is not None}
        if function:
            out["function"] = function
        return out


@dataclass
class StreamUpdate:
    """What one `feed`/`finish` releases: content to send now, and tool-call deltas in order."""

    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.tool_calls)


def random_call_id() -> str:
    """vLLM's tool-call id: `chatcmpl-tool-` and 32 random hex digits."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def assemble(updates: Iterable[StreamUpdate]) -> ExtractedToolCalls:
    """The whole result a sequence of updates amounts to (what a client accumulating the stream holds)."""
    content: list[str] = []
    calls: dict[int, ToolCall] = {}
    for update in updates:
        content.append(update.content)
        for d in update.tool_calls:
            if d.index not in calls:
                calls[d.index] = ToolCall(id=d.id or "", name=d.name or "", arguments="")
            calls[d.index].arguments += d.arguments or ""
    text = "".join(content)
    ordered = [calls[i] for i in sorted(calls)]
    return ExtractedToolCalls(content=text if text or not ordered else None, tool_calls=ordered)


class ToolParser(ABC):
    """Parses one output (one choice of one request): make a new parser for each.

    Subclasses implement `_step`, which consumes the front of `self._buf` for the state the parser is in,
    using `_content`, `_at_marker`, `_give_up`, `_open_call` and `_call_arguments` to produce output.
    """

    name: ClassVar[str] = ""
    # The route must decode with special tokens kept: the marker is a special token (Mistral's [TOOL_CALLS]).
    needs_special_tokens: ClassVar[bool] = False

    def __init__(self, tools: list[dict] | None = None, *, id_factory: Callable[[], str] | None = None) -> None:
        self.tools: list[dict] = list(tools or [])
        self._id_factory = id_factory or self.new_call_id
        self._buf = ""
        self._out: list[str] = []
        self._deltas: list[ToolCallDelta] = []
        self._ws = ""  # whitespace held back: content unless a call marker or the end follows
        self._ws_at_marker = ""  # what was held at the last marker, given back if that call proves malformed
        self._calls = 0
        self._passthrough = False
        self._finished = False

    # The public interface -------------------------------------------------------------------------------

    @staticmethod
    def new_call_id() -> str:
        return random_call_id()

    @property
    def tools_called(self) -> bool:
        """Whether a call has been sent (finish_reason "tool_calls")."""
        return self._calls > 0

    def feed(self, delta: str) -> StreamUpdate:
        """The next piece of generated text; returns what can be sent for it now."""
        if self._finished:
            raise RuntimeError("feed() after finish(): make a new parser for each output")
        self._buf += delta
        self._drain(final=False)
        return self._take()

    def finish(self) -> StreamUpdate:
        """The end of the output: releases what was held back (an unclosed call is parsed as it stands)."""
        if self._finished:
            raise RuntimeError("finish() called twice")
        self._drain(final=True)
        if self._buf:  # every _step consumes all of it when final; kept as content rather than lost
            self._emit(self._buf)
            self._buf = ""
        if self._calls == 0:
            self._emit(self._ws)
        self._ws = ""
        self._finished = True
        return self._take()

    def extract(self, text: str) -> ExtractedToolCalls:
        """The calls in a whole output (the non-streamed reply), by the same rules as streaming."""
        parser = self._fresh()
        return assemble([parser.feed(text), parser.finish()])

    # For subclasses ---------------------------------------------------------------------------------------

    def _fresh(self) -> ToolParser:
        """A new parser configured like this one (subclasses with more constructor arguments override)."""
        return type(self)(self.tools, id_factory=self._id_factory)

    @abstractmethod
    def _step(self, final: bool) -> bool:
        """Consume what the current state can of `self._buf`; False when it needs more text (or, when
        `final`, once the buffer is empty). When `final`, no more text will come: resolve every state."""

    def _content(self, text: str) -> None:
        """Text outside calls: sent, except whitespace that may yet turn out to precede a call."""
        if not text:
            return
        self._ws += text
        kept = self._ws.rstrip()
        if kept:
            self._emit(kept)
            self._ws = self._ws[len(kept) :]

    def _text_to_marker(self, markers: tuple[str, ...], final: bool) -> str | None:
        """Release the text before the first of `markers` as content and consume the marker (returned); None
        when the buffer holds none yet (its end that could start one stays buffered, unless `final`)."""
        pos, marker = find_marker(self._buf, markers)
        if marker is None:
            cut = len(self._buf) if final else pos
            self._content(self._buf[:cut])
            self._buf = self._buf[cut:]
            return None
        self._content(self._buf[:pos])
        self._at_marker()
        self._buf = self._buf[pos + len(marker) :]
        return marker

    def _at_marker(self) -> None:
        """A call marker was found: the whitespace before it is dropped (unless the call proves malformed)."""
        self._ws_at_marker, self._ws = self._ws, ""

    def _give_up(self, raw: str) -> None:
        """A malformed call: its text and all that follows are content, verbatim."""
        self._emit(self._ws_at_marker + self._ws + raw)
        self._ws_at_marker = self._ws = ""
        self._passthrough = True

    def _open_call(self, name: str) -> int:
        """Send a call's first delta (id, type, name); returns its index for the argument pieces."""
        index = self._calls
        self._calls += 1
        self._ws_at_marker = ""
        self._deltas.append(ToolCallDelta(index, id=self._id_factory(), type="function", name=name, arguments=""))
        return index

    def _call_arguments(self, index: int, piece: str) -> None:
        if piece:
            self._deltas.append(ToolCallDelta(index, arguments=piece))

    def _call(self, name: str, arguments: str) -> None:
        """A whole call at once."""
        self._call_arguments(self._open_call(name), arguments)

    # Internals ---------------------------------------------------------------------------------------------

    def _emit(self, text: str) -> None:
        if text:
            self._out.append(text)

    def _drain(self, final: bool) -> None:
        while True:
            if self._passthrough:
                self._emit(self._buf)
                self._buf = ""
                return
            if not self._step(final):
                return

    def _take(self) -> StreamUpdate:
        """The pending output, with a call's consecutive deltas merged (one entry per call per update)."""
        merged: list[ToolCallDelta] = []
        for d in self._deltas:
            if merged and merged[-1].index == d.index and d.id is None:
                merged[-1].arguments = (merged[-1].arguments or "") + (d.arguments or "")
            else:
                merged.append(d)
        update = StreamUpdate("".join(self._out), merged)
        self._out, self._deltas = [], []
        return update
