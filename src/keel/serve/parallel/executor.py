"""The engine's side of parallel serving: start the workers, hand them each step, watch their health.

`ParallelExecutor` spawns this node's worker processes (keel.serve.parallel.worker), waits for all of
them to report ready within a deadline (naming the ranks that did not), and from then on stands in
for the engine's ModelRunner: `execute(scheduler_output)` sends the step to rank 0 over a pipe and
returns the sampled tokens. A monitor thread waits on every worker's process sentinel: when one
exits, the executor records why, terminates the others and tells its listeners, so a step in flight
fails at once and an idle engine fails at its next health check. Nothing waits on a dead peer.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import threading
import time
import weakref
from collections.abc import Callable
from multiprocessing.connection import wait

from keel.errors import KeelError
from keel.serve.launched import StepResult
from keel.serve.parallel.worker import NewRequest, StepEntry, StepMessage, WorkerReport, WorkerSpec, worker_main
from keel.serve.scheduler import SchedulerOutput

log = logging.getLogger("keel.serve")


class WorkerFailedError(KeelError):
    """A worker process died or raised: the engine cannot make progress."""


def node_ranks(world_size: int, nnodes: int, node_rank: int) -> range:
    """The global ranks one node runs: contiguous, world_size / nnodes of them."""
    if nnodes < 1 or world_size % nnodes:
        raise KeelError(f"--nnodes {nnodes}: the {world_size} ranks (tp x pp) do not divide evenly over the nodes")
    if not 0 <= node_rank < nnodes:
        raise KeelError(f"--node-rank {node_rank} outside [0, {nnodes})")
    local = world_size // nnodes
    return range(node_rank * local, (node_rank + 1) * local)


class ParallelExecutor:
    def __init__(
        self,
        spec: WorkerSpec,
        ranks: range,
        block_tables: Callable[[str], list[int]] | None,
        *,
        startup_timeout: float = 600.0,
    ) -> None:
        """Start `ranks` (this node's) of `spec`'s world. With rank 0 among them this is the engine's
        executor (`block_tables`: the KV manager's); without, a headless node (`wait()`)."""
        self.spec = spec
        self.block_tables = block_tables
        self.failure: str | None = None
        self.compiled = None  # the workers' forward is eager (ModelRunner's attribute, read by the engine)
        self._closing = False
        self._listeners: list[Callable[[], None]] = []
        self._sent: dict[str, int] = {}  # request id -> output tokens the rank-0 mirror has
        self._released: list[str] = []
        ctx = mp.get_context("spawn")
        self._events = ctx.Queue()
        self.conn = None
        worker_conn = None
        if 0 in ranks:
            self.conn, worker_conn = ctx.Pipe()
        self.procs: dict[int, mp.Process] = {}
        for rank in ranks:
            conn = worker_conn if rank == 0 else None
            proc = ctx.Process(
                target=worker_main, args=(spec, rank, conn, self._events), name=f"keel-worker-{rank}", daemon=True
            )
            proc.start()
            log.info("worker rank %d started (pid %d)", rank, proc.pid)
            self.procs[rank] = proc
        if worker_conn is not None:
            worker_conn.close()  # the child holds its end: our copy would hide its exit
        self.reports = self._wait_ready(startup_timeout)
        self.num_blocks = min(r.num_blocks for r in self.reports.values())
        for report in sorted(self.reports.values(), key=lambda r: r.rank):
            what = "device bytes allocated" if spec.device == "cuda" else "RSS"
            log.info(
                "rank %d: weights %.1f MiB, KV cache %.1f MiB (%d blocks), loaded in %.1f s; peak %s at load "
                "%.1f MiB (%.1f MiB before loading)",
                report.rank,
                report.weight_bytes / 2**20,
                report.kv_bytes / 2**20,
                report.num_blocks,
                report.load_seconds,
                what,
                report.peak_at_load / 2**20,
                report.rss_before_load / 2**20,
            )
            if spec.device == "cuda":
                log.info(
                    "rank %d: activation peak of a full step %.1f MiB", report.rank, report.activation_peak / 2**20
                )
        self._monitor = threading.Thread(target=self._watch, name="keel-worker-monitor", daemon=True)
        self._monitor.start()
        # A script that never calls shutdown(): the workers are stopped at exit, not left to the OS.
        weakref.finalize(self, ParallelExecutor.shutdown, self)  # runs at interpreter exit (the monitor holds us)

    # ------------------------------------------------------------- start-up
    def _wait_ready(self, timeout: float) -> dict[int, WorkerReport]:
        deadline = time.monotonic() + timeout
        reports: dict[int, WorkerReport] = {}
        while len(reports) < len(self.procs):
            try:
                kind, rank, payload = self._events.get(timeout=0.2)
            except Exception:  # queue.Empty
                kind = None
            if kind == "ready":
                reports[rank] = payload
                continue
            if kind == "error":
                self._kill()
                raise WorkerFailedError(f"worker rank {rank} failed to start: {payload}")
            for rank, proc in self.procs.items():
                if rank not in reports and proc.exitcode is not None:
                    self._kill()
                    raise WorkerFailedError(f"worker rank {rank} exited with code {proc.exitcode} while starting")
            if time.monotonic() > deadline:
                missing = sorted(set(self.procs) - set(reports))
                self._kill()
                multinode = self.spec.world_size > len(self.procs)
                remote = " (rank 0 waits for every node's ranks to join)" if multinode else ""
                raise WorkerFailedError(
                    f"workers did not start within {timeout:.0f} s: rank(s) "
                    f"{', '.join(map(str, missing))} not ready{remote}"
                )
        return reports

    # --------------------------------------------------------------- health
    def add_listener(self, callback: Callable[[], None]) -> None:
        """Called (from the monitor thread) when a worker fails."""
        self._listeners.append(callback)

    def check_health(self) -> None:
        if self.failure is not None:
            raise WorkerFailedError(self.failure)

    def _watch(self) -> None:
        sentinels = {proc.sentinel: rank for rank, proc in self.procs.items()}
        ready = wait(list(sentinels))
        if self._closing:
            return
        rank = sentinels[ready[0]]
        self._fail(f"worker rank {rank} exited with code {self.procs[rank].exitcode}{self._reported_error(rank)}")

    def _reported_error(self, rank: int) -> str:
        """A worker's own last words, when it managed to say them."""
        try:
            while True:
                kind, who, payload = self._events.get(timeout=0.2)
                if kind == "error":
                    return f" ({'' if who == rank else f'rank {who}: '}{payload})"
        except Exception:  # queue.Empty
            return ""

    def _fail(self, reason: str) -> None:
        if self.failure is None:
            self.failure = reason
            log.error("%s: stopping every worker", reason)
        self._kill()
        for callback in self._listeners:
            callback()

    def _kill(self) -> None:
        for proc in self.procs.values():
            if proc.exitcode is None:
                proc.kill()
        for proc in self.procs.values():
            proc.join(timeout=5)

    # ---------------------------------------------------------------- steps
    def execute(self, out: SchedulerOutput) -> StepResult:
        """Run one step on the workers; the sampled tokens (the engine's ModelRunner.execute contract)."""
        self.check_health()
        entries = []
        for request, n in out.scheduled:
            request_id = request.request_id
            new = None
            if request_id not in self._sent:
                new = NewRequest(request.prompt_token_ids, request.params, request.eos_token_ids)
                self._sent[request_id] = 0
            sent = self._sent[request_id]
            self._sent[request_id] = len(request.output_token_ids)
            entries.append(
                StepEntry(
                    request_id,
                    n,
                    request.num_computed_tokens,
                    request.output_token_ids[sent:],
                    list(request.spec_token_ids),
                    self.block_tables(request_id),
                    new,
                    request.token_bitmask,  # the grammar lives with the engine; rank 0's sampler applies it
                )
            )
        message = StepMessage(entries, self._released)
        self._released = []
        try:
            self.conn.send(message)
            wait([self.conn, *(p.sentinel for p in self.procs.values())])  # a reply, or a worker gone
            if not self.conn.poll():
                raise EOFError
            status, payload = self.conn.recv()
        except (EOFError, OSError):
            self._monitor.join(timeout=10)  # let the monitor name the rank that died
            self._fail(self.failure or "worker rank 0 closed its pipe")
            raise WorkerFailedError(self.failure) from None
        if status == "error":
            # A peer killed mid-collective shows on rank 0 first as a gloo "connection reset": when a worker
            # process is gone, that exit is the cause, and the monitor names it.
            if wait([p.sentinel for p in self.procs.values()], timeout=1.0):
                self._monitor.join(timeout=10)
            self._fail(self.failure or payload)
            raise WorkerFailedError(self.failure)
        return payload

    def release(self, request_id: str) -> None:
        """A request finished or was aborted: rank 0 drops its mirror with the next step."""
        if self._sent.pop(request_id, None) is not None:
            self._released.append(request_id)

    # ------------------------------------------------------------- shutdown
    def wait(self) -> int:
        """A headless node: block until its workers exit; non-zero when any failed."""
        self._closing = True  # the workers end on their own (node 0 stops them, or a peer's failure)
        for proc in self.procs.values():
            proc.join()
        return max((abs(p.exitcode or 0) for p in self.procs.values()), default=0)

    def shutdown(self, timeout: float = 10.0) -> None:
        if self._closing:
            return
        self._closing = True
        if self.conn is not None and self.failure is None:
            try:
                self.conn.send(None)
            except OSError:
                pass
        deadline = time.monotonic() + timeout
        for proc in self.procs.values():
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        self._kill()
        if self.conn is not None:
            self.conn.close()
