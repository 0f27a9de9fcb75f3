"""Continuous batching at token level (vLLM v1's scheduler shape).

Each step has a token budget (`max_num_batched_tokens`) and a cap on running sequences
(`max_num_seqs`). One representation serves prompts and decodes: a request advances by "how many
tokens to feed this step". Running requests go first, decodes before prefill chunks, so running
decodes keep flowing while a long prompt is split over several steps; waiting requests are
admitted with what budget is left, starting from their longest cached prefix.

Preemption is by recomputation: when blocks run out, a victim's blocks are freed and it goes back
to the front of the waiting queue, to recompute prompt + output so far (its prefix blocks often
survive in the prefix cache). Victim order: requests not protected first, then lower priority,
then newest. A request that was preempted is protected until it generates its next token, so it
is preempted again only when every other candidate is protected too (no ping-pong). While a
step preempts, no new request is admitted.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from dataclasses import dataclass, field

from keel.errors import KeelError
from keel.serve.config import SchedulerConfig
from keel.serve.kv_blocks import KVCacheManager
from keel.serve.request import Request, Status

POLICIES = ("fcfs", "priority")


GPU_BATCHED_TOKENS = 2048
CPU_BATCHED_TOKENS_PER_THREAD = 64


def default_batched_tokens(device_type: str, threads: int) -> int:
    """The per-step token budget when none is given: vLLM's 2048 on a GPU, where a step of a few thousand
    tokens costs little more than a decode step; on a CPU a step's time grows with its tokens, so the
    budget is sized by the compute threads (docs/SERVING.md, "Step budget")."""
    if device_type != "cpu":
        return GPU_BATCHED_TOKENS
    return CPU_BATCHED_TOKENS_PER_THREAD * max(1, threads)


def step_budget(config: SchedulerConfig, device_type: str, threads: int, max_model_len: int) -> int:
    """Tokens a step may hold: --max-num-batched-tokens, else the device's default (without chunked prefill
    at least a whole prompt of `max_model_len` tokens)."""
    if config.max_num_batched_tokens is not None:
        return config.max_num_batched_tokens
    budget = default_batched_tokens(device_type, threads)
    return budget if config.enable_chunked_prefill else max(budget, max_model_len)


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Request, int]] = field(default_factory=list)  # (request, tokens to feed)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        max_num_batched_tokens: int = 2048,
        max_num_seqs: int = 256,
        max_model_len: int = 4096,
        policy: str = "fcfs",
        sliding_window: int | None = None,
        chunked_prefill: bool = True,
    ) -> None:
        if policy not in POLICIES:
            raise KeelError(f"scheduling policy {policy!r} is not supported (choose from {', '.join(POLICIES)})")
        if max_num_batched_tokens < 1 or max_num_seqs < 1:
            raise KeelError("max_num_batched_tokens and max_num_seqs must be >= 1")
        if not chunked_prefill and max_num_batched_tokens < max_model_len:
            raise KeelError(
                f"without chunked prefill a prompt is prefilled in one step: --max-num-batched-tokens "
                f"{max_num_batched_tokens} must be >= max_model_len {max_model_len}"
            )
        self.kv = kv
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.policy = policy
        # Off: a prompt's prefill is scheduled whole or not at all (it waits for a step with room for it).
        self.chunked_prefill = chunked_prefill
        # Only when every layer slides can blocks behind the window be freed.
        self.sliding_window = sliding_window
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self._arrivals = 0

    # --------------------------------------------------------------- queue
    def add(self, request: Request) -> None:
        total = len(request.prompt_token_ids) + request.params.max_tokens
        if not request.prompt_token_ids:
            raise KeelError(f"request {request.request_id}: the prompt is empty")
        if total > self.max_model_len:
            raise KeelError(
                f"request {request.request_id}: prompt ({len(request.prompt_token_ids)} tokens) + max_tokens "
                f"({request.params.max_tokens}) = {total} exceeds the model length {self.max_model_len}"
            )
        if request.request_id in self.requests:
            raise KeelError(f"request id {request.request_id!r} is already in use")
        self._arrivals += 1
        request.arrival_order = self._arrivals
        self.requests[request.request_id] = request
        self._enqueue(request, front=False)

    def _rank(self, request: Request) -> tuple[int, int]:
        """Smaller runs first: (priority under the priority policy, arrival)."""
        priority = request.priority if self.policy == "priority" else 0
        return priority, request.arrival_order

    def _enqueue(self, request: Request, front: bool) -> None:
        request.status = Status.WAITING
        if self.policy == "fcfs":
            self.waiting.appendleft(request) if front else self.waiting.append(request)
        else:  # sorted by rank; a preempted request keeps its original rank, so it goes back near the front
            keys = [self._rank(r) for r in self.waiting]
            self.waiting.insert(bisect.bisect(keys, self._rank(request)), request)

    def abort(self, request_id: str) -> Request | None:
        """Remove a request wherever it is and free its blocks at once."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv.free(request_id)
        request.status = Status.FINISHED
        return request

    def finish(self, request: Request) -> None:
        self.requests.pop(request.request_id, None)
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:  # preempted while its last token was in flight (asynchronous scheduling)
            self.waiting.remove(request)
        self.kv.free(request.request_id)
        request.status = Status.FINISHED
        request.stats.finished = time.perf_counter()

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------ schedule
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        scheduled_ids: set[str] = set()
        # Decodes first, then prefill chunks of requests already running; each group keeps its order.
        decodes = [r for r in self.running if r.num_remaining == 1]
        prefills = [r for r in self.running if r.num_remaining > 1]
        for request in decodes + prefills:
            if budget == 0:
                break
            if request.status is not Status.RUNNING:  # preempted earlier in this step
                continue
            if request.in_flight and len(request.output_token_ids) + request.in_flight >= request.params.max_tokens:
                continue  # its last token is in flight: nothing more to compute
            # Speculative drafts ride after the last known token; the budget may cut some of them.
            n = min(request.num_remaining + len(request.spec_token_ids), budget)
            del request.spec_token_ids[max(0, n - request.num_remaining) :]
            while not self.kv.allocate(request.request_id, request.num_computed_tokens + n):
                victim = self._pick_victim(request, scheduled_ids)
                if victim is None:
                    if request.spec_token_ids:  # try again without the drafts before giving up
                        n -= len(request.spec_token_ids)
                        request.spec_token_ids.clear()
                        continue
                    n = 0  # nothing to preempt: this request waits for blocks to be freed
                    break
                self._preempt(victim, out)
            if n:
                out.scheduled.append((request, n))
                scheduled_ids.add(request.request_id)
                budget -= n

        if not out.preempted:
            self._admit(out, budget)
        now = time.perf_counter()
        for request, _ in out.scheduled:
            if request.stats.first_scheduled is None:
                request.stats.first_scheduled = now
        return out

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            if request.in_flight:  # preempted with a token in flight: recomputed once it is read
                break
            tokens = request.all_token_ids
            # Prompt logprobs need every prompt position computed: no prefix reuse for those requests.
            prefix = self.kv.find_prefix(tokens) if request.params.prompt_logprobs is None else []
            computed = len(prefix) * self.kv.block_size
            n = min(len(tokens) - computed, budget)
            if not self.chunked_prefill and n < len(tokens) - computed:
                break
            if not self.kv.allocate(request.request_id, computed + n, prefix=prefix):
                break
            if request.stats.first_scheduled is None:  # count each request's prompt lookup once
                # Queries are all the request's tokens, as vLLM counts them, so hit rates compare.
                self.kv.record_prefix_lookup(len(tokens), computed)
                request.stats.cached_tokens = computed
            request.num_computed_tokens = computed
            self.waiting.popleft()
            request.status = Status.RUNNING
            self.running.append(request)
            out.scheduled.append((request, n))
            budget -= n

    def _pick_victim(self, request: Request, scheduled_ids: set[str]) -> Request | None:
        """Lowest-ranked running request not yet scheduled this step (see the module docstring)."""
        candidates = [r for r in self.running if r is not request and r.request_id not in scheduled_ids]
        if not candidates:
            return None
        return max(candidates, key=lambda r: (not r.protected, *self._rank(r)))

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.kv.free(request.request_id)
        self.running.remove(request)
        request.num_computed_tokens = 0
        request.draft_computed = 0
        request.spec_token_ids.clear()
        request.protected = True
        request.stats.preemptions += 1
        self.num_preemptions += 1
        self._enqueue(request, front=True)
        out.preempted.append(request)

    # -------------------------------------------------------------- update
    def advance(self, request: Request, num_tokens: int) -> None:
        """After the model ran: `num_tokens` more tokens of `request` are in the cache (with speculation:
        the last known token and the accepted drafts, which must already be in its output). Blocks that
        were reserved for rejected drafts are released."""
        request.num_computed_tokens += num_tokens
        self.kv.truncate(request.request_id, request.num_computed_tokens + 1)
        self.commit(request)
        self._slide(request)

    def computed(self, request: Request, num_tokens: int) -> None:
        """`advance` for a step queued on the device and not yet run (asynchronous scheduling), its blocks
        registered for prefix reuse by `commit` once its tokens are known. Every later step is queued behind
        this one, so the blocks freed here are reused only after it has run."""
        request.num_computed_tokens += num_tokens
        self.kv.truncate(request.request_id, request.num_computed_tokens + 1)
        self._slide(request)

    def commit(self, request: Request) -> None:
        """Register the request's full computed blocks whose tokens the host knows for prefix reuse (a
        token in flight is registered once read)."""
        if request.request_id in self.kv.seqs:  # not preempted while its last token was in flight
            known = request.num_tokens - request.in_flight
            self.kv.commit(request.request_id, min(request.num_computed_tokens, known), request.token_ids_between)

    def _slide(self, request: Request) -> None:
        if self.sliding_window is not None:
            # The next query sits at position num_computed_tokens; it sees window - 1 tokens back.
            self.kv.free_outside_window(request.request_id, request.num_computed_tokens - self.sliding_window + 1)
