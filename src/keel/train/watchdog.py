"""A per-step watchdog: if a step does not finish within the timeout (a hung collective, a dead
peer, a stuck data read), dump every thread's stack to stderr and exit non-zero, so that torchrun
(`--max-restarts`) restarts the job and it resumes from the last checkpoint."""

from __future__ import annotations

import faulthandler
import logging
import os
import sys
import threading
import time
from collections.abc import Callable

log = logging.getLogger("keel.train")

EXIT_CODE = 3


class StepWatchdog:
    def __init__(self, timeout_s: float, on_fire: Callable[[], None] | None = None) -> None:
        """on_fire: called once the stacks are dumped, before the exit (the NCCL flight recorder's dump)."""
        self.timeout_s = timeout_s
        self.on_fire = on_fire
        self._deadline: float | None = None
        self._step = -1
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if timeout_s > 0:
            self._thread = threading.Thread(target=self._watch, name="keel-watchdog", daemon=True)
            self._thread.start()

    def step_started(self, step: int) -> None:
        self._step = step
        self._deadline = time.monotonic() + self.timeout_s

    def pause(self) -> None:
        """Between steps (checkpoint commits, evaluation): not watched."""
        self._deadline = None

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        while not self._stop.wait(min(1.0, self.timeout_s / 4)):
            deadline = self._deadline
            if deadline is not None and time.monotonic() > deadline:
                print(
                    f"keel train: watchdog: step {self._step} exceeded {self.timeout_s:g} s; stacks of all threads:",
                    file=sys.stderr,
                    flush=True,
                )
                faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
                sys.stderr.flush()
                if self.on_fire is not None:
                    try:
                        self.on_fire()
                    except Exception as e:  # noqa: BLE001 - the exit below must happen whatever the dump does
                        print(f"keel train: watchdog: the dump failed: {e}", file=sys.stderr, flush=True)
                os._exit(EXIT_CODE)  # no cleanup: a hung collective would block it
