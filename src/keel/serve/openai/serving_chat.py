"""POST /v1/chat/completions: messages through the tokenizer's chat template."""

from __future__ import annotations

from keel.errors import KeelError
from keel.serve.engine import RequestOutput
from keel.serve.openai.call import Call, Job
from keel.serve.openai.errors import APIError
from keel.serve.openai.protocol import ChatCompletionRequest
from keel.serve.openai.responses import chat_logprobs
from keel.serve.openai.serving_base import OpenAIServing, PromptSpec, StreamDelta


class OpenAIServingChat(OpenAIServing):
    kind = "chat"
    request_model = ChatCompletionRequest
    max_tokens_param = "max_completion_tokens"
    prompt_param = "messages"
    id_prefix = "chatcmpl-"
    response_object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def _prompt_spec(self, req: ChatCompletionRequest) -> PromptSpec:
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer, so no chat template: use /v1/completions")
        messages = [m.to_template() for m in req.messages]
        try:
            ids = self.tokenizer.encode_chat(messages, add_generation_prompt=req.add_generation_prompt)
        except KeelError as e:
            raise APIError(400, str(e), param="messages") from None
        return PromptSpec([ids], [None], req.requested_max_tokens(), req.num_logprobs())

    def _first_choices(self, call: Call) -> list[dict]:
        """The role comes first, as OpenAI streams it."""
        return [_chat_choice(job.index, {"role": "assistant", "content": ""}, None, None) for job in call.jobs]

    def _final_choice(self, call: Call, job: Job) -> dict:
        out = job.final.outputs[0]
        logprobs = None
        if call.logprobs is not None:
            logprobs = chat_logprobs(out.logprobs or [], self.tokens.token_text, self.tokens.token_bytes)
        return {
            "index": job.index,
            "message": {"role": "assistant", "content": out.text},
            "logprobs": logprobs,
            "finish_reason": out.finish_reason,
            "stop_reason": out.stop_reason,
        }

    def _stream_choice(self, call: Call, job: Job, out: RequestOutput, delta: StreamDelta) -> dict:
        logprobs = None
        if call.logprobs is not None:
            logprobs = chat_logprobs(delta.logprobs, self.tokens.token_text, self.tokens.token_bytes)
        content = {"content": delta.text} if delta.text or delta.finish is None else {}
        return _chat_choice(job.index, content, logprobs, delta.finish)


def _chat_choice(index: int, delta: dict, logprobs: dict | None, finish: str | None) -> dict:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
