"""AsyncEngine: the engine for asyncio servers.

Model compute runs in one background thread that steps the engine whenever it has work; an
asyncio event loop never blocks on it. `generate()` yields each step's output for one request
(with `delta_text`); cancelling the consumer (a client that disconnects) aborts the request and
frees its blocks at once.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator

from keel.serve.engine import LLMEngine, RequestOutput
from keel.serve.sampling import SamplingParams

log = logging.getLogger("keel.serve")


class EngineDeadError(RuntimeError):
    """The engine thread failed; no request can make progress."""


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._lock = threading.Lock()  # the engine is not thread-safe: add/abort/step/stats take it
        self._wake = threading.Event()
        self._stopped = False
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="keel-engine", daemon=True)
        self._thread.start()

    # -------------------------------------------------------------- clients
    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        if self.error is not None:
            raise EngineDeadError(f"engine failed: {self.error}")
        queue: asyncio.Queue = asyncio.Queue()
        with self._lock:
            request_id = self.engine.add_request(prompt, params, request_id, priority)
            self._streams[request_id] = (asyncio.get_running_loop(), queue)
        self._wake.set()
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise EngineDeadError(f"engine failed: {item}") from item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:  # consumer gone (disconnect, timeout, cancellation): free the blocks now
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        with self._lock:
            self.engine.abort_request(request_id)
            self._streams.pop(request_id, None)

    def stats(self) -> dict[str, float]:
        with self._lock:
            return self.engine.stats()

    def shutdown(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=10)

    # --------------------------------------------------------------- thread
    def _loop(self) -> None:
        while not self._stopped:
            with self._lock:
                busy = self.engine.has_unfinished_requests()
            if not busy:
                self._wake.wait()
                self._wake.clear()
                continue
            try:
                with self._lock:
                    outputs = self.engine.step()
                    targets = [(out, self._streams.get(out.request_id)) for out in outputs]
                    for out in outputs:
                        if out.finished:
                            self._streams.pop(out.request_id, None)
            except BaseException as e:  # deliver the failure to every waiting client, then stop
                log.exception("engine step failed")
                self.error = e
                with self._lock:
                    streams, self._streams = list(self._streams.values()), {}
                for loop, queue in streams:
                    loop.call_soon_threadsafe(queue.put_nowait, e)
                return
            for out, target in targets:
                if target is not None:
                    loop, queue = target
                    loop.call_soon_threadsafe(queue.put_nowait, out)
