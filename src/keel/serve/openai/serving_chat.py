"""POST /v1/chat/completions: messages through the chat template; reasoning, tool calls and echo on the way out."""

from __future__ import annotations

from keel.serve.openai.call import Call, Job
from keel.serve.openai.chat_output import ChatOutputs, ChoiceWriter
from keel.serve.openai.chat_prompt import render_chat
from keel.serve.openai.protocol import ChatCompletionRequest
from keel.serve.openai.responses import chat_logprobs
from keel.serve.openai.serving_base import OpenAIServing, PromptSpec, StreamDelta
from keel.serve.outputs import RequestOutput


class OpenAIServingChat(OpenAIServing):
    kind = "chat"
    request_model = ChatCompletionRequest
    max_tokens_param = "max_completion_tokens"

    def _max_tokens_name(self, req) -> str:  # noqa: ANN001
        """The field the client used: the older max_tokens where it sent that one."""
        if req.max_completion_tokens is None and req.max_tokens is not None:
            return "max_tokens"
        return self.max_tokens_param

    prompt_param = "messages"
    id_prefix = "chatcmpl-"
    response_object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def _prompt_spec(self, req: ChatCompletionRequest) -> PromptSpec:
        ids = render_chat(self.tokenizer, req)
        return PromptSpec([ids], [None], req.requested_max_tokens(), req.num_logprobs())

    def _prepare(self, body: object, tenant) -> Call:
        call = super()._prepare(body, tenant)
        req: ChatCompletionRequest = call.request
        constrained = call.jobs[0].params.structured_outputs is not None
        call.chat = ChatOutputs.of(req, self.settings, constrained)
        if call.chat.reasoning is not None and not constrained and self._prompt_opens_reasoning(call):
            call.chat.starts_in_reasoning = True  # the template opened <think> (Qwen3 thinking, DeepSeek-R1)
        # A parser whose markers are special tokens (Mistral's [TOOL_CALLS], GPT-OSS's harmony): keep them in the text
        parsers = (call.chat.tool_parser, call.chat.reasoning if not constrained else None)
        if any(parser is not None and parser.needs_special_tokens for parser in parsers):
            for job in call.jobs:
                job.params.skip_special_tokens = False
        last = req.messages[-1]
        # vLLM's echo: the reply is prefixed with the last message when that is the assistant's own turn
        call.chat_echo = last.text() if req.echo and last.role == "assistant" else ""
        return call

    def _prompt_opens_reasoning(self, call: Call) -> bool:
        tail = self.tokenizer.decode(call.prompts[0][-8:], skip_special_tokens=False)
        return tail.rstrip().endswith(call.chat.reasoning.start_token)

    def _writer(self, call: Call, job: Job) -> ChoiceWriter:
        if job.writer is None:
            job.writer = call.chat.writer()
        return job.writer

    def _first_choices(self, call: Call) -> list[dict]:
        """The role comes first, as OpenAI streams it (with the echoed message, when asked)."""
        return [
            _chat_choice(job.index, {"role": "assistant", "content": call.chat_echo}, None, None) for job in call.jobs
        ]

    def _final_choice(self, call: Call, job: Job) -> dict:
        out = job.final.outputs[0]
        logprobs = None
        if call.logprobs is not None:
            logprobs = chat_logprobs(out.logprobs or [], self.tokens.token_text, self.tokens.token_bytes)
        message, finish = self._writer(call, job).message(out.text, out.finish_reason)
        if call.chat_echo and message.get("content") is not None:
            message["content"] = call.chat_echo + message["content"]
        return {
            "index": job.index,
            "message": message,
            "logprobs": logprobs,
            "finish_reason": finish,
            "stop_reason": out.stop_reason,
        }

    def _finish_body(self, call: Call, body: dict) -> dict:
        if call.prompt_logprobs is not None:
            body["prompt_logprobs"] = self._prompt_logprobs(call.jobs[0])
        return body

    def _stream_choice(self, call: Call, job: Job, out: RequestOutput, delta: StreamDelta) -> dict | None:
        logprobs = None
        if call.logprobs is not None:
            logprobs = chat_logprobs(delta.logprobs, self.tokens.token_text, self.tokens.token_bytes)
        writer = self._writer(call, job)
        fields = writer.delta(delta.text, final=delta.finish is not None)
        if not fields and delta.finish is None:
            if logprobs is None:
                return None  # text a parser holds: vLLM sends no chunk for it
            fields = {"content": ""}  # the step's logprobs still go out
        if "tool_calls" in fields:
            fields["tool_calls"] = _one_entry_per_call(fields["tool_calls"])
        choice = _chat_choice(job.index, fields, logprobs, writer.stream_finish_reason(delta.finish))
        if delta.finish is not None:
            choice["stop_reason"] = delta.stop_reason  # vLLM's: on the chunk that ends the choice
        return choice


def _chat_choice(index: int, delta: dict, logprobs: dict | None, finish: str | None) -> dict:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}


def _one_entry_per_call(calls: list[dict]) -> list[dict]:
    """A chunk's tool-call deltas with one entry per call index, as vLLM sends them: a call's header and the first
    piece of its arguments, found in one step, become one entry."""
    merged: list[dict] = []
    for call in calls:
        if not merged or merged[-1]["index"] != call["index"]:
            merged.append({**call, "function": dict(call.get("function") or {})})
            continue
        entry = merged[-1]
        for key, value in call.items():
            if key != "function":
                entry.setdefault(key, value)
        function = entry["function"]
        for key, value in (call.get("function") or {}).items():
            function[key] = function.get(key, "") + value if key == "arguments" else function.get(key, value)
    return merged
