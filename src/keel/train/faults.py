"""Fault injection for tests and drills, from the environment variable KEEL_FAULTS.

    KEEL_FAULTS="nan@5,spike@12:50,crash@8:1,crash_in_save@10:0,hang@7:0"

- `nan@S`: step S's loss (hence its gradients) becomes NaN;
- `spike@S:F`: step S's loss is multiplied by F (a loss spike with consistent gradients);
- `bad_batch@S:F`: the loss of step S's batch is multiplied by F whenever that batch is trained on,
  replays after a rollback included (a spike caused by the data: it comes back unless the batch is
  skipped);
- `crash@S:R`: rank R exits with code 1 before step S;
- `crash_in_save@S:R`: rank R exits with code 1 after writing checkpoint S's files, before the commit;
- `hang@S:R`: rank R sleeps forever before step S (the watchdog's case);
- `sleep@S:T`: every rank sleeps T seconds before step S (a slow step: background work gets that long);
- `stop@S` / `stop@S:R`: behave as if SIGTERM arrived during step S, on every rank or on rank R alone
  (the ranks agree to stop after step S: checkpoint, then stop).
Loss faults fire once per process (a rollback that comes back to step S does not re-inject);
process faults only on the first attempt (TORCHELASTIC_RESTART_COUNT = 0), so a torchrun restart
recovers instead of crashing again.
"""

from __future__ import annotations

import math
import os
import signal
import time

from keel.errors import KeelError


class Faults:
    def __init__(self, spec: str = "") -> None:
        self.loss: dict[int, float] = {}
        self.process: dict[tuple[str, int], int] = {}  # (kind, step) -> rank
        self._fired: set[int] = set()
        self.stop_step: int | None = None
        self.stop_rank: int | None = None  # None: every rank
        self.bad_batch: tuple[int, float] | None = None  # (step, factor)
        self.sleep: dict[int, float] = {}  # step -> seconds
        self._bad_position: int | None = None  # where in the data the bad batch lies, once seen
        for item in filter(None, (part.strip() for part in spec.split(","))):
            kind, _, rest = item.partition("@")
            step_text, _, arg = rest.partition(":")
            try:
                step = int(step_text)
                if kind == "nan":
                    self.loss[step] = math.nan
                elif kind == "spike":
                    self.loss[step] = float(arg or 100.0)
                elif kind == "bad_batch":
                    self.bad_batch = (step, float(arg or 100.0))
                elif kind == "sleep":
                    self.sleep[step] = float(arg or 1.0)
                elif kind == "stop":
                    self.stop_step = step
                    self.stop_rank = int(arg) if arg else None
                elif kind in ("crash", "crash_in_save", "hang"):
                    self.process[(kind, step)] = int(arg or 0)
                else:
                    raise ValueError(kind)
            except ValueError:
                raise KeelError(f"KEEL_FAULTS: cannot parse {item!r} (see keel.train.faults)") from None

    @classmethod
    def from_env(cls) -> Faults:
        return cls(os.environ.get("KEEL_FAULTS", ""))

    @staticmethod
    def _first_attempt() -> bool:
        return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0

    def loss_scale(self, step: int) -> float:
        if step in self.loss and step not in self._fired:
            self._fired.add(step)
            return self.loss[step]
        return 1.0

    def batch_scale(self, step: int, position: int) -> float:
        """The loss factor of the batch at data `position` (samples consumed before it), trained as `step`."""
        if self.bad_batch is None:
            return 1.0
        if step == self.bad_batch[0] and self._bad_position is None:
            self._bad_position = position
        return self.bad_batch[1] if position == self._bad_position else 1.0

    def before_step(self, step: int, rank: int) -> None:
        if not self._first_attempt():
            return
        if step in self.sleep:
            time.sleep(self.sleep[step])
        if self.process.get(("crash", step)) == rank:
            print(f"KEEL_FAULTS: rank {rank} crashes before step {step}", flush=True)
            os._exit(1)
        if self.process.get(("hang", step)) == rank:
            print(f"KEEL_FAULTS: rank {rank} hangs before step {step}", flush=True)
            # The launcher's SIGTERM (once a peer failed) ends it at once, not after torchrun's 30 s grace:
            # the trainer's handler only sets a flag that this loop never reads.
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            while True:
                time.sleep(3600)

    def stop_after(self, step: int, rank: int) -> bool:
        return self.stop_step == step and self.stop_rank in (None, rank) and self._first_attempt()

    def before_commit(self, step: int, rank: int) -> None:
        if self._first_attempt() and self.process.get(("crash_in_save", step)) == rank:
            print(f"KEEL_FAULTS: rank {rank} crashes while saving checkpoint {step}", flush=True)
            os._exit(1)
