"""OpenAI's harmony format (GPT-OSS): an assistant output as a sequence of messages, read as it streams.

A GPT-OSS chat template ends its prompt with `<|start|>assistant`; the output then holds one or more messages,
each a header, `<|message|>`, a body and a terminator:

    <|channel|>analysis<|message|>The user asks ...<|end|>
    <|start|>assistant<|channel|>final<|message|>Hello!<|return|>
    <|start|>assistant<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{"tz": "UTC"}<|call|>

The header names the channel (`analysis`: reasoning; `final`: the reply; `commentary`: preambles and tool calls)
and, for a tool call, the recipient (`to=functions.NAME`, before or after the channel). These markers are special
tokens, so a route reading them decodes with special tokens kept. `<|return|>` and `<|call|>` end generation
(the model's EOS ids), so the last body usually ends with the output instead.

`HarmonyReader` splits the text, fed in pieces of any size, into `Piece`s: a message's header once complete
(never a partial marker), then its body's text, then its end. The reasoning parser `openai_gptoss` and the tool
parser `openai` (vLLM's names) are built on it, so that streamed pieces concatenate to the whole-output result.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

MESSAGE = "<|message|>"
START = "<|start|>"
CHANNEL = "<|channel|>"
# What ends a body: a message's end, a tool call's, the reply's, or (a model that skips <|end|>) a new message.
TERMINATORS = ("<|end|>", "<|call|>", "<|return|>", START)
# How the openai_gptoss reasoning parser hands a tool call's message on to the `openai` tool parser, whatever
# header the model wrote: CALL_HEAD, the function's name, MESSAGE, the arguments, CALL_END.
CALL_HEAD = "<|start|>assistant to=functions."
CALL_END = "<|call|>"
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*([A-Za-z_]+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")


@dataclass(frozen=True)
class Header:
    channel: str  # "" when the header names none (treated as the reply)
    recipient: str | None  # e.g. "functions.get_weather"
    raw: str  # the header's text as generated, `<|message|>` included

    @property
    def function(self) -> str | None:
        """The function a tool call's message is addressed to, or None."""
        if self.recipient is None or not self.recipient.startswith("functions."):
            return None
        return self.recipient.removeprefix("functions.")


@dataclass(frozen=True)
class Piece:
    kind: str  # "header" (`header` set), "body" (`text`), "end" (`text`: the terminator as generated, maybe "")
    header: Header | None = None
    text: str = ""


def parse_header(raw: str) -> Header:
    """A header's channel and recipient (`raw`: the text before and including `<|message|>`)."""
    channel = _CHANNEL.search(raw)
    recipient = _RECIPIENT.search(raw)
    return Header(channel.group(1) if channel else "", recipient.group(1) if recipient else None, raw)


def _partial_suffix(text: str, markers: tuple[str, ...]) -> int:
    """The length of the longest suffix of `text` that is a proper prefix of one of `markers`."""
    longest = 0
    for marker in markers:
        for n in range(min(len(text), len(marker) - 1), longest, -1):
            if marker.startswith(text[-n:]):
                longest = n
                break
    return longest


class HarmonyReader:
    """Splits harmony text into pieces as it arrives (`feed`, then `finish`). Text before a message's header is
    complete is held; at the end, a header never completed is given back as a body of an unnamed message, so
    no text is lost (a model that wrote no harmony markup at all reads as one reply)."""

    def __init__(self) -> None:
        self._buf = ""
        self._in_body = False

    def feed(self, text: str) -> list[Piece]:
        self._buf += text
        return self._drain(final=False)

    def finish(self) -> list[Piece]:
        pieces = self._drain(final=True)
        if self._buf:  # an unfinished header: not harmony after all, or cut off; its text is not dropped
            pieces += [Piece("header", header=Header("", None, "")), Piece("body", text=self._buf)]
            self._in_body, self._buf = True, ""
        if self._in_body:
            pieces.append(Piece("end"))
            self._in_body = False
        return pieces

    def _drain(self, final: bool) -> list[Piece]:
        pieces: list[Piece] = []
        while self._buf:
            if not self._in_body:
                at = self._buf.find(MESSAGE)
                if at < 0:
                    break
                raw = self._buf[: at + len(MESSAGE)]
                pieces.append(Piece("header", header=parse_header(raw)))
                self._buf, self._in_body = self._buf[at + len(MESSAGE) :], True
                continue
            ends = [(self._buf.find(t), t) for t in TERMINATORS]
            found = [(i, t) for i, t in ends if i >= 0]
            if found:
                at, terminator = min(found)
                if at:
                    pieces.append(Piece("body", text=self._buf[:at]))
                # A new message's <|start|> belongs to its header; the others close this message.
                consumed = 0 if terminator == START else len(terminator)
                pieces.append(Piece("end", text=self._buf[at : at + consumed]))
                self._buf, self._in_body = self._buf[at + consumed :], False
                continue
            keep = 0 if final else _partial_suffix(self._buf, TERMINATORS)
            if len(self._buf) > keep:
                pieces.append(Piece("body", text=self._buf[: len(self._buf) - keep]))
                self._buf = self._buf[len(self._buf) - keep :]
            break
        return pieces
