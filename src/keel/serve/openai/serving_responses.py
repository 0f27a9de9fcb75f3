"""POST /v1/responses: OpenAI's Responses API over the chat route (protocol_responses has the request's mapping).

A response's `output` is a list of items: the reasoning (when the server runs a reasoning parser), the
assistant's message (output_text, with logprobs when included), and one function_call item per tool call.
A stream sends OpenAI's typed events, each with its sequence number: response.created and in_progress, then per
item output_item.added, its part and text deltas, their done events and output_item.done, and last
response.completed (as vLLM ends every stream; its response's status is "incomplete" when max_output_tokens cut
it). A tool call's item opens as the
chat route's writer finds it (a forced call as soon as its name is out, an auto call once its parser has read
it) and its arguments follow as delta events.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from keel.serve.openai.call import Call
from keel.serve.openai.errors import APIError
from keel.serve.openai.http_io import parse_body
from keel.serve.openai.protocol_responses import ResponsesRequest
from keel.serve.openai.responses import chat_logprobs
from keel.serve.openai.serving_chat import OpenAIServingChat
from keel.serve.openai.tenants import Admission, TenantState


class OpenAIServingResponses(OpenAIServingChat):
    kind = "responses"
    max_tokens_param = "max_output_tokens"

    def _max_tokens_name(self, req) -> str:  # noqa: ANN001
        return self.max_tokens_param  # the request's one field (its chat body's is set from it)

    prompt_param = "input"
    id_prefix = "resp_"

    def _prepare(self, body: object, tenant: TenantState) -> Call:
        req = parse_body(body, ResponsesRequest)
        call = super()._prepare(req.chat_body(), tenant)
        call.responses = req
        return call

    # ------------------------------------------------------------ whole
    async def _collect(self, call: Call) -> dict:
        async for _ in self.runner.outputs(call):
            pass
        job = call.jobs[0]
        out = job.final.outputs[0]
        message, finish = self._writer(call, job).message(out.text, out.finish_reason)
        logprobs = self._logprobs(call, out.logprobs or [])
        output = []
        if message.get("reasoning_content"):
            output.append(reasoning_item(new_id("rs_"), message["reasoning_content"]))
        if message.get("content") or not message.get("tool_calls"):
            status = "incomplete" if finish == "length" else "completed"
            output.append(message_item(new_id("msg_"), message.get("content") or "", logprobs, status))
        output += [function_call_item(call["id"], call["function"]) for call in message.get("tool_calls") or []]
        return self._response(call, output, finish)

    # ------------------------------------------------------------ streamed
    def _stream(self, call: Call, admission: Admission) -> AsyncIterator[str]:
        events = ResponseEvents()

        def error(e: APIError) -> list[str]:  # an event with the stream's next number, which the official clients raise
            return [events.send("error", code=e.code, message=e.message, param=e.param, error=e.body()["error"])]

        return self._guarded_stream(call, admission, self._events(call, events), error)

    async def _events(self, call: Call, events: ResponseEvents) -> AsyncIterator[str]:
        started = self._response(call, [], None, status="in_progress")
        yield events.send("response.created", response=started)
        yield events.send("response.in_progress", response=started)
        finish = None
        async for job, out in self.runner.outputs(call):
            delta = self._stream_delta(call, job, out)
            if delta is None:
                continue
            writer = self._writer(call, job)
            fields = writer.delta(delta.text, final=delta.finish is not None)
            sent = []
            if fields.get("reasoning_content"):
                sent += events.text("reasoning", fields["reasoning_content"], [])
            if fields.get("content"):
                sent += events.text("message", fields["content"], self._logprobs(call, delta.logprobs))
            for call_delta in fields.get("tool_calls") or []:
                sent += events.call(call_delta)
            for event in sent:
                yield event
            if delta.finish is not None:
                finish = writer.stream_finish_reason(delta.finish)
        for event in events.finish("incomplete" if finish == "length" else "completed"):
            yield event
        final = self._response(call, events.output, finish)
        # vLLM's last event whatever the status (OpenAI's own sends response.incomplete for a cut response, which the
        # SDK's stream helper does not take as an end): the response it carries says "incomplete".
        yield events.send("response.completed", response=final)

    # ------------------------------------------------------------ shared
    def _logprobs(self, call: Call, entries: list) -> list[dict]:
        if call.logprobs is None:
            return []
        return chat_logprobs(entries, self.tokens.token_text, self.tokens.token_bytes)["content"]

    def _response(self, call: Call, output: list[dict], finish: str | None, status: str | None = None) -> dict:
        """The response object: `status` given (in_progress), or from the finish reason."""
        req: ResponsesRequest = call.responses
        incomplete = None
        if status is None:
            status = "incomplete" if finish == "length" else "completed"
            if finish == "length":
                incomplete = {"reason": "max_output_tokens"}
        usage = call.usage()
        return {
            "id": self.id_prefix + (call.response_id or call.request_id),
            "object": "response",
            "created_at": call.created,
            "status": status,
            "error": None,
            "incomplete_details": incomplete,
            "model": self.model_name,
            "output": output,
            "usage": None
            if status == "in_progress"
            else {
                "input_tokens": usage.prompt_tokens,
                "input_tokens_details": {"cached_tokens": usage.cached_tokens},
                "output_tokens": usage.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": usage.prompt_tokens + usage.completion_tokens,
            },
            **req.echoed(),
            # the values the sampler ran with (the server's defaults where the request left them out)
            "temperature": call.jobs[0].params.temperature,
            "top_p": call.jobs[0].params.top_p,
        }


def new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex


def message_item(item_id: str, text: str, logprobs: list[dict], status: str) -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": [part]}


def reasoning_item(item_id: str, text: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "summary": [], "content": [{"type": "reasoning_text", "text": text}]}


def function_call_item(
    call_id: str, function: dict[str, str], item_id: str | None = None, status: str = "completed"
) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id or new_id("fc_"),
        "call_id": call_id,
        "name": function["name"],
        "arguments": function["arguments"],
        "status": status,
    }


@dataclass
class _OpenItem:
    kind: str  # "reasoning" | "message"
    id: str
    index: int
    text: str = ""
    logprobs: list[dict] = field(default_factory=list)


class ResponseEvents:
    """The events of one streamed response, numbered, and the output items they built."""

    def __init__(self) -> None:
        self.sequence = 0
        self.output: list[dict[str, Any]] = []
        self.open: _OpenItem | None = None
        self.calls: dict[int, dict[str, str]] = {}  # tool-call deltas by index: id, name, arguments

    def send(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

    def text(self, kind: str, delta: str, logprobs: list[dict]) -> list[str]:
        """More text of the reasoning or of the message: the item (and its part) opened first when it is new."""
        events = []
        if self.open is None or self.open.kind != kind:
            events += self._close("completed")
            events += self._open(kind)
        item = self.open
        item.text += delta
        where = {"item_id": item.id, "output_index": item.index, "content_index": 0}
        if kind == "message":
            item.logprobs += logprobs
            events.append(self.send("response.output_text.delta", **where, delta=delta, logprobs=logprobs))
        else:
            events.append(self.send("response.reasoning_text.delta", **where, delta=delta))
        return events

    def call(self, delta: dict[str, Any]) -> list[str]:
        """A chat tool-call delta (index, then id, name and pieces of the arguments): a new call closes the open
        text item and opens its function_call item; each piece of its arguments is a delta event."""
        index = delta.get("index", 0)
        function = delta.get("function") or {}
        events = []
        entry = self.calls.get(index)
        if entry is None:
            events += self._close("completed")
            item_id, output_index = new_id("fc_"), len(self.output)
            entry = {"id": delta.get("id") or "", "name": function.get("name") or "", "arguments": ""}
            entry.update(item_id=item_id, output_index=output_index)
            self.calls[index] = entry
            added = function_call_item(entry["id"], entry, item_id, "in_progress")
            self.output.append(added)
            events.append(self.send("response.output_item.added", output_index=output_index, item=added))
        piece = function.get("arguments") or ""
        if piece:
            entry["arguments"] += piece
            where = {"item_id": entry["item_id"], "output_index": entry["output_index"]}
            events.append(self.send("response.function_call_arguments.delta", **where, delta=piece))
        return events

    def finish(self, status: str) -> list[str]:
        """Close the open item (an empty message when nothing was output) and every call."""
        events = [] if self.output else self._open("message")
        events += self._close(status)
        for index in sorted(self.calls):
            entry = self.calls[index]
            item = function_call_item(entry["id"], entry, entry["item_id"], "completed")
            self.output[entry["output_index"]] = item
            where = {"item_id": entry["item_id"], "output_index": entry["output_index"]}
            events.append(self.send("response.function_call_arguments.done", **where, arguments=item["arguments"]))
            events.append(self.send("response.output_item.done", output_index=entry["output_index"], item=item))
        return events

    def _open(self, kind: str) -> list[str]:
        item_id = new_id("msg_" if kind == "message" else "rs_")
        self.open = _OpenItem(kind, item_id, len(self.output))
        self.output.append({})  # filled when the item is done
        if kind == "message":
            shell = message_item(item_id, "", [], "in_progress")
            shell["content"] = []
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        else:
            shell = {**reasoning_item(item_id, ""), "content": []}
            part = {"type": "reasoning_text", "text": ""}
        where = {"item_id": item_id, "output_index": self.open.index, "content_index": 0}
        return [
            self.send("response.output_item.added", output_index=self.open.index, item=shell),
            self.send("response.content_part.added", **where, part=part),
        ]

    def _close(self, status: str) -> list[str]:
        item, self.open = self.open, None
        if item is None:
            return []
        where = {"item_id": item.id, "output_index": item.index, "content_index": 0}
        if item.kind == "message":
            done = message_item(item.id, item.text, item.logprobs, status)
            text_done = self.send("response.output_text.done", **where, text=item.text, logprobs=item.logprobs)
        else:
            done = reasoning_item(item.id, item.text)
            text_done = self.send("response.reasoning_text.done", **where, text=item.text)
        self.output[item.index] = done
        return [
            text_done,
            self.send("response.content_part.done", **where, part=done["content"][0]),
            self.send("response.output_item.done", output_index=item.index, item=done),
        ]
