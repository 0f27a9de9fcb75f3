"""POST /v1/completions: text or token-id prompts, echo, legacy logprobs, prompt scoring (max_tokens 0)."""

from __future__ import annotations

from keel.serve.openai.call import Call, Job
from keel.serve.openai.errors import APIError
from keel.serve.openai.protocol import CompletionRequest
from keel.serve.openai.responses import CompletionLogprobs
from keel.serve.openai.serving_base import OpenAIServing, PromptSpec, StreamDelta
from keel.serve.outputs import RequestOutput


class OpenAIServingCompletion(OpenAIServing):
    kind = "completion"
    request_model = CompletionRequest
    max_tokens_param = "max_tokens"
    prompt_param = "prompt"
    id_prefix = "cmpl-"
    response_object = "text_completion"
    chunk_object = "text_completion"

    def _prompt_spec(self, req: CompletionRequest) -> PromptSpec:
        prompt_only = req.prompt_only()
        prompts, texts = [], []
        for item in req.prompts():
            if isinstance(item, str):
                prompts.append(self._encode(item, req.add_special_tokens))
                texts.append(item)
            else:
                prompts.append(self._checked_ids(item))
                texts.append(None)
        return PromptSpec(prompts, texts, req.max_tokens, req.logprobs, req.echo, prompt_only)

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer: send the prompt as token ids", param="prompt")
        ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        if not ids:
            raise APIError(400, "'prompt' encodes to no tokens", param="prompt")
        return ids

    def _checked_ids(self, ids: list[int]) -> list[int]:
        bad = next((t for t in ids if t >= self.vocab_size), None)
        if bad is not None:
            raise APIError(400, f"prompt token id {bad} is out of range [0, {self.vocab_size})", param="prompt")
        return list(ids)

    def _final_choice(self, call: Call, job: Job) -> dict:
        out = job.final.outputs[0]
        # prompt-only: the engine's one generated token is not part of the response
        text, generated = ("", []) if call.prompt_only else (out.text, out.logprobs or [])
        logprobs = None
        if call.logprobs is not None:
            lp = CompletionLogprobs(self.tokens.token_bytes)
            if call.echo:
                lp.add_prompt(job.prompt_ids, job.final.prompt_logprobs or [], self.tokens.token_text)
            lp.add(generated, self.tokens.token_text)
            logprobs = lp.to_dict()
        if call.echo:
            text = self._prompt_text(call, job) + text
        finish, stop_reason = ("length", None) if call.prompt_only else (out.finish_reason, out.stop_reason)
        choice = {
            "index": job.index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": finish,
            "stop_reason": stop_reason,
        }
        if call.prompt_logprobs is not None:
            choice["prompt_logprobs"] = self._prompt_logprobs(job)
        return choice

    def _stream_choice(self, call: Call, job: Job, out: RequestOutput, delta: StreamDelta) -> dict:
        text, logprobs = delta.text, None
        if call.logprobs is not None and job.stream_logprobs is None:
            job.stream_logprobs = CompletionLogprobs(self.tokens.token_bytes)
        lp: CompletionLogprobs | None = job.stream_logprobs
        start = 0 if lp is None else len(lp.tokens)
        if call.echo and not job.echoed:  # the first chunk of a choice carries its prompt
            job.echoed = True
            text = self._prompt_text(call, job) + text
            if lp is not None:
                lp.add_prompt(job.prompt_ids, out.prompt_logprobs or [], self.tokens.token_text)
        if lp is not None:
            lp.add(delta.logprobs, self.tokens.token_text)
            logprobs = lp.to_dict(start)
        choice = {"index": job.index, "text": text, "logprobs": logprobs, "finish_reason": delta.finish}
        return {**choice, "stop_reason": delta.stop_reason}  # vLLM's: null until the choice ends

    def _prompt_text(self, call: Call, job: Job) -> str:
        """The prompt as echo returns it: as sent when it was text, else decoded."""
        text = call.prompt_texts[job.prompt_index]
        return text if text is not None else self.tokens.decode(job.prompt_ids)
