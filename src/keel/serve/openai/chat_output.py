"""A chat choice's text as OpenAI's message: reasoning split off, tool calls read out, whole or streamed.

Per call, `ChatOutputs` knows the server's parsers and the request's tool mode; per choice, a
`ChoiceWriter` turns the engine's text into message fields:
- reasoning (`--reasoning-parser`): `<think>...</think>` becomes `reasoning_content`, the rest content;
- tool calls: `tool_choice` naming a function or "required" forced the output with a grammar (the
  arguments object, sent as generated, or vLLM's array of {name, parameters}, parsed), which becomes
  `tool_calls`; "auto" reads calls out of free text with `--tool-call-parser` (needs
  `--enable-auto-tool-choice`, as in vLLM).
A request whose output a grammar constrains has no reasoning (the grammar holds from the first token),
so its text is all content.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from keel.serve.openai.errors import APIError
from keel.serve.openai.protocol import ChatCompletionRequest
from keel.serve.openai.reasoning_parsers import ReasoningParser, get_reasoning_parser
from keel.serve.openai.required_calls import RequiredCalls
from keel.serve.openai.settings import ServerSettings
from keel.serve.openai.tool_parsers import ToolCall, ToolParser, get_tool_parser, random_call_id
from keel.serve.openai.tool_schemas import parse_required_calls, validate_tools


@dataclass
class ChatOutputs:
    """What every choice of one chat call shares."""

    reasoning: type[ReasoningParser] | None = None
    starts_in_reasoning: bool | None = None
    tool_mode: str | None = None  # None (no tools or "none"), "auto", "required", "named"
    tools: list[dict[str, Any]] = field(default_factory=list)
    tool_choice: Any = None
    tool_parser: type[ToolParser] | None = None
    include_reasoning: bool = True
    parallel_tool_calls: bool = True  # false: only the first call the parser finds is returned

    @classmethod
    def of(cls, req: ChatCompletionRequest, settings: ServerSettings, constrained: bool) -> ChatOutputs:
        outputs = cls(include_reasoning=req.include_reasoning, parallel_tool_calls=req.parallel_tool_calls)
        if settings.reasoning_parser:
            outputs.reasoning = get_reasoning_parser(settings.reasoning_parser)
            if constrained:
                outputs.starts_in_reasoning = False
        if not req.tools:
            if req.tool_choice not in (None, "none", "auto"):
                raise APIError(400, "tool_choice needs 'tools'", param="tool_choice")
            return outputs
        try:
            outputs.tools = validate_tools(req.tool_list())
        except ValueError as e:
            raise APIError(400, str(e), param="tools") from None
        choice = req.tool_choice if req.tool_choice is not None else "auto"  # OpenAI's default with tools
        if choice == "none":
            return outputs
        if choice == "auto":
            if not (settings.enable_auto_tool_choice and settings.tool_call_parser):
                raise APIError(
                    400,
                    'tool_choice "auto" (the default with tools) needs a server started with'
                    " --enable-auto-tool-choice and --tool-call-parser",
                    param="tool_choice",
                )
            outputs.tool_mode, outputs.tool_parser = "auto", get_tool_parser(settings.tool_call_parser)
            return outputs
        outputs.tool_mode = "required" if choice == "required" else "named"
        outputs.tool_choice = choice if choice == "required" else choice.model_dump()
        return outputs

    def writer(self) -> ChoiceWriter:
        return ChoiceWriter(self)


class ChoiceWriter:
    """One choice's message, whole (`message`) or as stream deltas (`delta`, then `delta(final=True)`)."""

    def __init__(self, outputs: ChatOutputs) -> None:
        self.outputs = outputs
        self.reasoning = (
            outputs.reasoning(starts_in_reasoning=outputs.starts_in_reasoning) if outputs.reasoning else None
        )
        self.parser = outputs.tool_parser(outputs.tools) if outputs.tool_parser else None
        self.called = False  # a tool call was sent
        self._forced = ""  # a forced call's output so far
        self._required = RequiredCalls()  # tool_choice "required": the calls as they stream
        self._required_ids: list[str] = []
        self._named_id: str | None = None

    # ------------------------------------------------------------ whole
    def message(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """(the choice's message, its finish_reason)."""
        reasoning, content = self.reasoning.extract(text) if self.reasoning else (None, text)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if self.reasoning is not None and self.outputs.include_reasoning:
            message["reasoning_content"] = reasoning
        calls = self._calls(content or "")
        if calls is not None:
            message["content"], message["tool_calls"] = calls[0], [call.to_openai() for call in calls[1]]
            if calls[1] and self._calls_finish(finish_reason):
                finish_reason = "tool_calls"
        elif self.outputs.tool_mode is not None:
            message["tool_calls"] = []
        return message, finish_reason

    def _calls(self, content: str) -> tuple[str | None, list[ToolCall]] | None:
        mode = self.outputs.tool_mode
        if mode == "auto":
            extracted = self.parser.extract(content)
            calls = extracted.tool_calls[:1] if not self.outputs.parallel_tool_calls else extracted.tool_calls
            return (extracted.content, calls) if calls else None
        if mode == "named":
            # The output is the arguments, as the stream sends them (vLLM's), cut off by max_tokens or not.
            return None, [ToolCall(random_call_id(), self.outputs.tool_choice["function"]["name"], content)]
        if mode == "required":
            try:
                return None, parse_required_calls(content, self.outputs.tools)
            except ValueError:
                return None  # not the forced form: the text stays content
        return None

    # ------------------------------------------------------------ streamed
    def delta(self, text: str, final: bool = False) -> dict[str, Any]:
        """The delta fields a stream chunk carries for `text` (more of the output); final: the output ended."""
        delta: dict[str, Any] = {}
        if self.reasoning is not None:
            step = self.reasoning.feed(text)
            if final:
                last = self.reasoning.finish()
                step = type(step)(step.reasoning + last.reasoning, step.content + last.content)
            if step.reasoning and self.outputs.include_reasoning:
                delta["reasoning_content"] = step.reasoning
            text = step.content
        mode = self.outputs.tool_mode
        if mode == "auto":
            update = self.parser.feed(text)
            if final:
                last = self.parser.finish()
                update.content += last.content
                update.tool_calls += last.tool_calls
            if update.content:
                delta["content"] = update.content
            calls = [d for d in update.tool_calls if self.outputs.parallel_tool_calls or d.index == 0]
            if calls:
                self.called = True
                delta["tool_calls"] = [d.to_openai() for d in calls]
        elif mode == "named":
            calls = self._named_delta(text)
            if calls:
                delta["tool_calls"] = calls
        elif mode == "required":
            self._forced += text
            calls = self._required_delta(text)
            if calls:
                delta["tool_calls"] = calls
            if final and not self.called and self._calls(self._forced) is None:
                delta["content"] = self._forced  # not the forced form: the text is the content, as the whole says
        elif text:
            delta["content"] = text
        return delta

    def _required_delta(self, text: str) -> list[dict[str, Any]]:
        """Required calls stream as OpenAI's: a call's id, type and name once its name is out, then its
        arguments as they come (keel.serve.openai.required_calls)."""
        calls = []
        for update in self._required.feed(text):
            if update.name is not None:
                self._required_ids.append(random_call_id())
                self.called = True
                head = {"index": update.index, "id": self._required_ids[update.index], "type": "function"}
                calls.append({**head, "function": {"name": update.name, "arguments": update.arguments}})
            else:
                calls.append({"index": update.index, "function": {"arguments": update.arguments}})
        return calls

    def _calls_finish(self, finish_reason: str | None) -> bool:
        """Whether calls turn the finish reason into "tool_calls": auto's always; required's unless the length
        cut them (their arguments are then incomplete, as a named call's)."""
        mode = self.outputs.tool_mode
        return mode == "auto" or (mode == "required" and finish_reason != "length")

    def _named_delta(self, text: str) -> list[dict[str, Any]]:
        """A named call streams as OpenAI's: id, type and name first, then the arguments as they come."""
        calls = []
        if self._named_id is None:
            self._named_id = random_call_id()
            self.called = True
            name = self.outputs.tool_choice["function"]["name"]
            calls.append(
                {"index": 0, "id": self._named_id, "type": "function", "function": {"name": name, "arguments": ""}}
            )
        if text:
            calls.append({"index": 0, "function": {"arguments": text}})
        return calls

    def stream_finish_reason(self, finish_reason: str | None) -> str | None:
        if finish_reason is not None and self.called and self._calls_finish(finish_reason):
            return "tool_calls"
        return finish_reason
