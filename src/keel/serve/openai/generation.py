"""Running a call's jobs on the engine: their outputs merged in arrival order, under the call's deadline."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from keel.errors import KeelError
from keel.serve.async_engine import AsyncEngine, EngineDeadError
from keel.serve.openai.call import Call, Job
from keel.serve.openai.errors import APIError
from keel.serve.openai.metrics import ServerMetrics
from keel.serve.outputs import RequestOutput
from keel.serve.sampling import RequestOutputKind

# (job, output, None) for an output, (job, None, error) when the job's generation failed, (None, None, error)
# when the server ends the call (end_all)
_Item = tuple[Job | None, RequestOutput | None, BaseException | None]


def generated_so_far(job: Job, out: RequestOutput) -> int:
    """The job's generated tokens once `out` is counted: a DELTA output carries only the step's."""
    count = len(out.outputs[0].token_ids)
    return job.generated + count if job.params.output_kind is RequestOutputKind.DELTA else count


class CallRunner:
    """Generates every job of one call; counts tokens and finished requests in the server metrics."""

    def __init__(
        self,
        engine: AsyncEngine,
        metrics: ServerMetrics,
        request_timeout: float | None,
        in_flight: set[asyncio.Queue] | None = None,
    ) -> None:
        self.engine = engine
        self.metrics = metrics
        self.request_timeout = request_timeout  # for the 504 message; the call carries its deadline
        # The merged queues of the calls generating now, shared by the server's runners: `end_all` ends them.
        self.in_flight: set[asyncio.Queue] = set() if in_flight is None else in_flight

    async def outputs(self, call: Call) -> AsyncIterator[tuple[Job, RequestOutput]]:
        """Every job's outputs, merged in arrival order; aborts the unfinished ones on exit."""
        merged: asyncio.Queue[_Item] = asyncio.Queue()
        tasks = [asyncio.create_task(self._pump(call, job, merged)) for job in call.jobs]
        remaining = len(call.jobs)
        self.in_flight.add(merged)
        try:
            while remaining:
                job, out = await self._next(call, merged)
                job.generated = generated_so_far(job, out)
                new = job.generated - job.sent_tokens
                self.metrics.on_output(call.tenant.name, out, job.sent_tokens, job.generated)
                if out.finished:
                    job.final = out
                    remaining -= 1
                    reason = out.outputs[0].finish_reason or "abort"
                    self.metrics.on_finished(call.tenant.name, reason, out, job.params.max_tokens, job.generated)
                    self._prompt_finished(call, job)
                yield job, out
                job.sent_tokens += new
        finally:
            self.in_flight.discard(merged)
            for task in tasks:
                task.cancel()  # an unfinished job's generate() aborts its engine request
            for job in call.jobs:
                if job.final is None:
                    self.metrics.on_finished(call.tenant.name, "abort")

    def _prompt_finished(self, call: Call, job: Job) -> None:
        """Once every choice of `job`'s prompt has finished: the prompt's n and its longest choice (vLLM
        observes them per parent request)."""
        choices = [j for j in call.jobs if j.prompt_index == job.prompt_index]
        if all(j.final is not None for j in choices):
            longest = max(j.generated for j in choices)
            self.metrics.on_prompt_finished(len(choices), longest)

    async def _pump(self, call: Call, job: Job, merged: asyncio.Queue[_Item]) -> None:
        try:
            request_id = f"{call.request_id}-{job.index}"
            async for out in self.engine.generate(job.prompt_ids, job.params, request_id, priority=call.priority):
                merged.put_nowait((job, out, None))
        except Exception as e:  # noqa: BLE001 - handed to the consumer
            merged.put_nowait((job, None, e))

    async def _next(self, call: Call, merged: asyncio.Queue[_Item]) -> tuple[Job, RequestOutput]:
        """The next output of any job; a failed job or a passed deadline as the APIError the client gets."""
        timeout = None if call.deadline is None else call.deadline - time.monotonic()
        try:
            job, out, error = await asyncio.wait_for(merged.get(), timeout)
        except TimeoutError:
            raise APIError(504, f"request deadline of {self.request_timeout:g} s passed") from None
        if error is not None:
            if isinstance(error, APIError):  # the server ended the call (end_all)
                raise error
            if isinstance(error, KeelError):
                raise APIError(400, str(error))
            if isinstance(error, EngineDeadError):
                raise APIError(503, str(error))
            raise error
        assert out is not None
        return job, out


def end_all(in_flight: set[asyncio.Queue], error: APIError) -> int:
    """End every call generating now with `error` (its engine requests are aborted as the call's handler
    leaves): the client gets a response, a stream its error event, instead of a cancelled task. Returns how
    many calls were ended."""
    for merged in in_flight:
        merged.put_nowait((None, None, error))
    return len(in_flight)
