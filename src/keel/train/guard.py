"""Training guards: NaN/Inf in the loss or gradients, loss spikes and gradient-norm spikes.

A spike is a z-score above a threshold against a running window of accepted steps (mean and
standard deviation of the last `window` losses, or gradient norms), checked once `warmup`
steps are in the window. Each event carries the action the configuration asks for:
- "skip": drop this step's update (no optimizer step; the batch is consumed);
- "rollback": restore the last good checkpoint and skip the next M batches (what PaLM did:
  restart ~100 steps before the spike and skip 200-500 batches);
- "stop": end the run with an error.
Only accepted steps enter the windows, so a spike does not raise the baseline it is judged by.

A run of `escalate_after` skipped steps in a row (no step applied between them: weights gone bad, or
a stretch of bad data) escalates: the first time to a rollback, after that to a stop whose message
names the skipped steps. Skipping forever would leave the run spending compute on no updates.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import asdict, dataclass


@dataclass
class GuardEvent:
    step: int
    kind: str  # "nan_loss" | "nan_grad" | "loss_spike" | "grad_spike"
    value: float
    zscore: float | None
    action: str  # "skip" | "rollback" | "stop"
    skipped: list[int] | None = None  # an escalated event: the run of skipped steps it ends

    def to_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        z = f" (z={self.zscore:.1f})" if self.zscore is not None else ""
        run = ""
        if self.skipped:
            run = f" after {len(self.skipped)} skipped steps in a row ({', '.join(map(str, self.skipped))})"
        return f"step {self.step}: {self.kind} {self.value:.4g}{z} -> {self.action}{run}"


def _zscore(window: deque, value: float) -> float:
    n = len(window)
    mean = sum(window) / n
    var = sum((x - mean) ** 2 for x in window) / max(1, n - 1)
    # A floor on the spread: a perfectly flat window would make every wiggle a spike.
    std = max(math.sqrt(var), 1e-3 * max(abs(mean), 1e-8))
    return (value - mean) / std


class TrainingGuard:
    def __init__(
        self,
        nan: str = "skip",
        spike: str = "skip",
        spike_zscore: float = 6.0,
        grad_norm_zscore: float = 6.0,
        window: int = 50,
        warmup: int = 20,
        escalate_after: int = 5,
    ) -> None:
        self.nan_action = nan
        self.spike_action = spike
        self.spike_zscore = spike_zscore
        self.grad_norm_zscore = grad_norm_zscore
        self.warmup = warmup
        self.losses: deque[float] = deque(maxlen=window)
        self.grad_norms: deque[float] = deque(maxlen=window)
        self.events: list[GuardEvent] = []
        self.escalate_after = escalate_after  # 0: never
        self.skipped: list[int] = []  # the current run of skipped steps
        self.escalations = 0  # kept across restores, as the trainer's rollback count is

    def check(self, step: int, loss: float, grad_norm: float | None) -> GuardEvent | None:
        """The event this step triggers, or None when it may be applied."""
        event = None
        if not math.isfinite(loss):
            event = GuardEvent(step, "nan_loss", loss, None, self.nan_action)
        elif grad_norm is not None and not math.isfinite(grad_norm):
            event = GuardEvent(step, "nan_grad", grad_norm, None, self.nan_action)
        elif self.spike_action != "off" and len(self.losses) >= self.warmup:
            z = _zscore(self.losses, loss)
            if z > self.spike_zscore:
                event = GuardEvent(step, "loss_spike", loss, z, self.spike_action)
            elif grad_norm is not None and len(self.grad_norms) >= self.warmup:
                zg = _zscore(self.grad_norms, grad_norm)
                if zg > self.grad_norm_zscore:
                    event = GuardEvent(step, "grad_spike", grad_norm, zg, self.spike_action)
        if event is not None and event.action == "skip":
            self.skipped.append(step)
            if self.escalate_after and len(self.skipped) >= self.escalate_after:
                self.escalations += 1
                event.action = "rollback" if self.escalations == 1 else "stop"
                event.skipped, self.skipped = self.skipped, []
        if event is not None:
            self.events.append(event)
        return event

    def accept(self, loss: float, grad_norm: float | None) -> None:
        self.skipped.clear()
        self.losses.append(loss)
        if grad_norm is not None:
            self.grad_norms.append(grad_norm)

    def state_dict(self) -> dict:
        return {"losses": list(self.losses), "grad_norms": list(self.grad_norms)}

    def load_state_dict(self, state: dict) -> None:
        self.skipped.clear()  # a restore ends the run of skips (the escalation count stays)
        self.losses.clear()
        self.losses.extend(state["losses"])
        self.grad_norms.clear()
        self.grad_norms.extend(state["grad_norms"])
