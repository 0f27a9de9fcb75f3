"""The naive baseline: one request at a time through transformers' implementation of the model.

`keel serve --engine naive` puts this behind the same HTTP server, so `keel bench serve` can
measure what a server without batching or paging gets from the same weights: requests queue
FIFO; each is prefilled whole and decoded token by token with transformers' DynamicCache, then
the next starts. It has `LLMEngine`'s methods, so `AsyncEngine` drives it unchanged, and shares
its sampler, stop checking and detokenizer, so outputs differ only by the model's numerics.
"""

from __future__ import annotations

import inspect
import itertools
import time
from collections import deque

import torch

from keel.errors import KeelError
from keel.serve.engine import encode_prompt, eos_token_ids
from keel.serve.outputs import OutputTrack, RequestOutput, build_output
from keel.serve.request import Request, Status
from keel.serve.sampling import RowState, Sampler, SamplingParams, request_generator
from keel.weights.checkpoint import LoadedModel
from keel.weights.names import keel_to_hf


def hf_model_from(loaded: LoadedModel) -> torch.nn.Module:
    """transformers' model of the same architecture, holding keel's weights (no copy on disk)."""
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError as e:  # transformers is an optional dependency (the `align` extra)
        raise KeelError("--engine naive needs transformers: pip install 'keel[align]'") from e
    config = loaded.config
    hf_dict = config.to_hf()
    model_type = hf_dict.pop("model_type")
    hf_config = AutoConfig.for_model(model_type, **hf_dict)
    hf = AutoModelForCausalLM.from_config(hf_config, dtype=loaded.model.dtype, **config.transformers_attention())
    state = keel_to_hf(config, loaded.model.state_dict().items())
    result = hf.load_state_dict(state, strict=False)
    missing = [n for n in result.missing_keys if not (config.tie_word_embeddings and n == "lm_head.weight")]
    if missing or result.unexpected_keys:
        raise KeelError(f"naive engine: weights do not match transformers' model ({missing + result.unexpected_keys})")
    if config.tie_word_embeddings:
        hf.tie_weights()
    return hf.eval()


class NaiveEngine:
    """transformers, batch 1, FIFO: the baseline of `keel bench serve`."""

    def __init__(self, loaded: LoadedModel, max_model_len: int | None = None) -> None:
        self.loaded = loaded
        self.model = loaded.model  # keel's module, kept for its config and device only
        self.tokenizer = loaded.tokenizer
        self.hf = hf_model_from(loaded)
        # The KV cache's argument and output field: `cache` in today's transformers, `past_key_values` before
        # (5.17, the GPU image's release, still names it so).
        self._cache_field = "cache" if "cache" in inspect.signature(self.hf.forward).parameters else "past_key_values"
        mc = loaded.config
        self.max_model_len = max_model_len or mc.max_position_embeddings
        self.eos_token_ids = eos_token_ids(mc, self.tokenizer)
        self.sampler = Sampler()
        self.waiting: deque[Request] = deque()
        self.current: Request | None = None
        self._past = None
        self._tracks: dict[str, OutputTrack] = {}
        self._ids = itertools.count()
        self.num_prompt_tokens = 0
        self.num_generated_tokens = 0

    # ------------------------------------------------------------- requests
    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
    ) -> str:
        params = params or SamplingParams()
        params.validate()
        if params.prompt_logprobs is not None:
            raise KeelError("prompt_logprobs (echo with logprobs) is not supported by the naive engine")
        prompt_ids, text = encode_prompt(prompt, self.tokenizer, self.loaded.config.vocab_size)
        if not prompt_ids:
            raise KeelError("the prompt is empty")
        total = len(prompt_ids) + params.max_tokens
        if total > self.max_model_len:
            raise KeelError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) = {total} "
                f"exceeds the model length {self.max_model_len}"
            )
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self._tracks:
            raise KeelError(f"request id {request_id!r} is already in use")
        request = Request(request_id, prompt_ids, params, self.eos_token_ids, priority=priority, prompt=text)
        request.generator = request_generator(params, self.hf.device)
        self.waiting.append(request)
        self._tracks[request_id] = OutputTrack(request, self.tokenizer)
        self.num_prompt_tokens += len(prompt_ids)
        return request_id

    def abort_request(self, request_id: str) -> RequestOutput | None:
        track = self._tracks.pop(request_id, None)
        if track is None:
            return None
        if self.current is not None and self.current.request_id == request_id:
            request, self.current, self._past = self.current, None, None
        else:
            request = next(r for r in self.waiting if r.request_id == request_id)
            self.waiting.remove(request)
        request.status = Status.FINISHED
        track.stop.finish_reason = track.stop.finish_reason or "abort"
        return build_output(request, track, "", [])

    def has_unfinished_requests(self) -> bool:
        return self.current is not None or bool(self.waiting)

    # ----------------------------------------------------------------- step
    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """One forward of the current request: its whole prompt, or its last token."""
        from transformers import DynamicCache

        if self.current is None:
            if not self.waiting:
                return []
            self.current = request = self.waiting.popleft()
            request.status = Status.RUNNING
            request.stats.first_scheduled = time.perf_counter()
            self._past = DynamicCache()
            feed = request.prompt_token_ids
        else:
            request = self.current
            feed = request.output_token_ids[-1:]
        ids = torch.tensor([feed], dtype=torch.long, device=self.hf.device)
        out = self.hf(input_ids=ids, use_cache=True, logits_to_keep=1, **{self._cache_field: self._past})
        self._past = getattr(out, self._cache_field)
        state = RowState(
            request.params, request.generator, request.prompt_token_ids, request.output_token_ids, self.eos_token_ids
        )
        sampled = self.sampler(out.logits[:, -1].float(), [state])
        token = int(sampled.token_ids[0])
        now = time.perf_counter()
        track = self._tracks[request.request_id]
        request.output_token_ids.append(token)
        request.num_computed_tokens = request.num_tokens - 1
        if request.stats.first_token is None:
            request.stats.first_token = now
        request.stats.token_times.append(now)
        self.num_generated_tokens += 1
        if track.logprobs is not None and sampled.logprobs is not None:
            track.add_logprob(sampled.logprobs.to_lists(sampled.token_ids)[0])
        delta = track.detok.add(token) if track.detok else ""
        released, finished = track.stop.add(token, delta)
        track.text += released
        if finished:
            request.status = Status.FINISHED
            request.stats.finished = now
            self._tracks.pop(request.request_id)
            self.current, self._past = None, None
        return [build_output(request, track, released, [token])]

    def stats(self) -> dict[str, float]:
        return {
            "num_requests_running": int(self.current is not None),
            "num_requests_waiting": len(self.waiting),
            "kv_cache_usage_perc": 0.0,
            "prefix_cache_queries": 0,
            "prefix_cache_hits": 0,
            "prefix_cache_hit_rate": 0.0,
            "num_preemptions_total": 0,
            "prompt_tokens_total": self.num_prompt_tokens,
            "generation_tokens_total": self.num_generated_tokens,
        }
