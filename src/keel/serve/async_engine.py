"""AsyncEngine: the engine for asyncio servers.

Model compute runs in one background thread that owns the engine. The event loop never touches
the engine and never waits for a step: `generate()` posts an "add" command, `abort()` an "abort"
command, and the thread applies pending commands between steps (so an abort frees its blocks
before the next step runs). Outputs come back through the request's asyncio queue
(`call_soon_threadsafe`). `stats()` returns the snapshot the thread publishes after each step.

Anything with `LLMEngine`'s methods (add_request, abort_request, has_unfinished_requests, step,
stats) can be driven this way; the naive transformers baseline is.

`AsyncEngine.build(factory)` constructs the engine (model loading included) on the thread that will
step it, which is how the server starts one. OpenMP keeps one worker pool per thread that opens a
parallel region: a model loaded on the main thread and stepped on another leaves two pools, more
OpenMP threads than cores, and libgomp then stops spin-waiting between parallel regions, so every one
of a step's regions wakes its workers from sleep (docs/ARCHITECTURE.md, "The engine thread").
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from keel.errors import KeelError
from keel.serve.outputs import RequestOutput
from keel.serve.sampling import SamplingParams

log = logging.getLogger("keel.serve")


class EngineDeadError(RuntimeError):
    """The engine thread failed; no request can make progress."""


class _Rejected:
    """An add command the engine refused (bad request): re-raised in the caller."""

    def __init__(self, error: KeelError) -> None:
        self.error = error


class AsyncEngine:
    def __init__(self, engine: Any) -> None:
        """Drive `engine`, already built (on this thread: see `build` for why that can cost speed)."""
        self._setup()
        self._adopt(engine)
        self._thread = threading.Thread(target=self._loop, name="keel-engine", daemon=True)
        self._thread.start()

    @classmethod
    def build(cls, factory: Callable[[], Any]) -> AsyncEngine:
        """Call `factory()` on the engine thread and drive what it returns; its error is raised here."""
        self = cls.__new__(cls)
        self._setup()
        built = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            try:
                self._adopt(factory())
            except BaseException as e:  # the caller re-raises it
                failure.append(e)
                return
            finally:
                built.set()
            self._loop()

        self._thread = threading.Thread(target=run, name="keel-engine", daemon=True)
        self._thread.start()
        built.wait()
        if failure:
            self._thread.join()
            raise failure[0]
        return self

    def _setup(self) -> None:
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopped = False
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}  # engine thread only
        self._lock = threading.Lock()  # guards _pending_adds, and posting against error/stop
        self._pending_adds = 0  # posted but not yet applied: they are waiting requests too
        self.error: BaseException | None = None
        self._failure_callbacks: list = []
        self.health_interval = 1.0  # seconds between idle health checks

    def _adopt(self, engine: Any) -> None:
        self.engine = engine
        self._stats: dict[str, float] = dict(engine.stats())
        self._check_health = getattr(engine, "check_health", None)
        executor = getattr(engine, "executor", None)
        if executor is not None:  # a worker's death wakes the idle loop at once
            executor.add_listener(self._wake.set)

    # -------------------------------------------------------------- clients
    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's output after every step that changed it; the last one is finished.

        Raises KeelError when the engine rejects the request (e.g. too long), EngineDeadError when
        the engine has failed. Leaving the iteration early aborts the request.
        """
        request_id = request_id if request_id is not None else uuid.uuid4().hex
        stream: asyncio.Queue = asyncio.Queue()
        # Under the lock the engine thread takes to declare itself dead: an add is either posted
        # before that (and answered by _fail_pending) or refused here, never left in the queue.
        with self._lock:
            if self.error is not None:
                raise EngineDeadError(f"engine failed: {self.error}")
            if self._stopped:
                raise EngineDeadError("engine shut down")
            self._pending_adds += 1
            self._post(("add", request_id, prompt, params, priority, asyncio.get_running_loop(), stream))
        finished = False
        try:
            while True:
                item = await stream.get()
                if isinstance(item, _Rejected):
                    finished = True  # never admitted: nothing to abort
                    raise item.error
                if isinstance(item, BaseException):
                    finished = True
                    raise EngineDeadError(f"engine failed: {item}") from item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:  # consumer gone (disconnect, timeout, cancellation): free the blocks now
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Abort a request; applied by the engine thread before its next step."""
        self._post(("abort", request_id))

    def stats(self) -> dict[str, float]:
        """The engine's gauges and counters as of its last step (never blocks on a step)."""
        stats = dict(self._stats)
        with self._lock:
            stats["num_requests_waiting"] = stats.get("num_requests_waiting", 0) + self._pending_adds
        return stats

    def on_failure(self, callback) -> None:
        """Call `callback(error)` from the engine thread when the engine fails (e.g. to stop a server)."""
        self._failure_callbacks.append(callback)

    @property
    def alive(self) -> bool:
        return self.error is None and self._thread.is_alive()

    def shutdown(self, timeout: float = 10.0) -> None:
        with self._lock:
            self._stopped = True
        self._wake.set()
        self._thread.join(timeout=timeout)
        shutdown = getattr(self.engine, "shutdown", None)
        if shutdown is not None:  # worker processes of parallel serving
            shutdown()
        error = EngineDeadError("engine shut down")
        if not self._thread.is_alive():  # the streams are ours now: end them instead of leaving them waiting
            streams, self._streams = list(self._streams.values()), {}
            for loop, stream in streams:
                _deliver(loop, stream, error)
        self._fail_pending(error)

    # --------------------------------------------------------------- thread
    def _post(self, command: tuple) -> None:
        self._commands.put(command)
        self._wake.set()

    def _drain(self) -> Iterator[tuple]:
        """The commands posted so far, oldest first."""
        while True:
            try:
                yield self._commands.get_nowait()
            except queue.Empty:
                return

    def _apply_commands(self) -> None:
        for command in self._drain():
            if command[0] == "add":
                _, request_id, prompt, params, priority, loop, stream = command
                with self._lock:
                    self._pending_adds -= 1
                try:
                    self.engine.add_request(prompt, params, request_id, priority)
                except KeelError as e:
                    _deliver(loop, stream, _Rejected(e))
                    continue
                self._streams[request_id] = (loop, stream)
            else:
                _, request_id = command
                self.engine.abort_request(request_id)
                self._streams.pop(request_id, None)

    def _loop(self) -> None:
        while not self._stopped:
            try:
                self._apply_commands()
                if not self.engine.has_unfinished_requests():
                    self._stats = dict(self.engine.stats())
                    # Idle, an engine with worker processes is still checked: a worker that dies now
                    # fails the engine within a second, not at the next request.
                    self._wake.wait(timeout=self.health_interval if self._check_health else None)
                    self._wake.clear()
                    if self._check_health is not None:
                        self._check_health()
                    continue
                outputs = self.engine.step()
                self._stats = dict(self.engine.stats())
            except BaseException as e:  # deliver the failure to every waiting client, then stop
                log.exception("engine step failed")
                with self._lock:
                    self.error = e
                streams, self._streams = list(self._streams.values()), {}
                for loop, stream in streams:
                    _deliver(loop, stream, e)
                self._fail_pending(e)
                for callback in self._failure_callbacks:
                    callback(e)
                return
            for out in outputs:
                target = self._streams.get(out.request_id)
                if out.finished:
                    self._streams.pop(out.request_id, None)
                if target is not None:
                    loop, stream = target
                    _deliver(loop, stream, out)

    def _fail_pending(self, error: BaseException) -> None:
        """Answer adds posted after the failure, so no client waits forever."""
        for command in self._drain():
            if command[0] == "add":
                loop, stream = command[5], command[6]
                _deliver(loop, stream, error)


def _deliver(loop: asyncio.AbstractEventLoop, stream: asyncio.Queue, item: object) -> None:
    """Hand `item` to a client's queue on the client's event loop (a closed loop: the client is gone)."""
    try:
        loop.call_soon_threadsafe(stream.put_nowait, item)
    except RuntimeError:
        pass
