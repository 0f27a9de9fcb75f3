"""Experiment trackers beside metrics.jsonl: TensorBoard (`[log] tensorboard = true`) and Weights & Biases
(`[log] wandb = true`), written by rank 0 from the same records as the JSONL file.

Each record's numbers become scalars at its step: top-level fields by their names (`loss`, `grad_norm`,
`lr`, `tokens_per_s`, `mfu`, `val_loss`, ...), numbers one level down in a dict as `field/key`
(`start_memory/peak_bytes`); flags, strings and lists are left to the JSONL file. TensorBoard is an
optional dependency (`pip install 'keel[tensorboard]'`); W&B is not a dependency of keel at all: either
missing is refused when the config is checked, before any rank starts.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from typing import Any, Protocol

# The import name of each tracker's package, and how to get it.
PACKAGES = {
    "tensorboard": ("tensorboard", "pip install 'keel[tensorboard]'"),
    "wandb": ("wandb", "pip install wandb"),
}


def missing_package(tracker: str) -> str | None:
    """A one-line reason why `tracker` cannot run here, or None when its package is installed."""
    module, how = PACKAGES[tracker]
    if importlib.util.find_spec(module) is None:
        return f"the {module} package is not installed ({how})"
    return None


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The numbers of a metrics record by tracker tag (flags are not numbers here; NaN and inf are kept)."""
    out: dict[str, float] = {}
    for key, value in record.items():
        if key == "step":
            continue
        if isinstance(value, dict):
            for sub, inner in value.items():
                if _is_number(inner):
                    out[f"{key}/{sub}"] = float(inner)
        elif _is_number(value):
            out[key] = float(value)
    return out


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


class Tracker(Protocol):
    def log(self, step: int, values: dict[str, float]) -> None: ...

    def close(self) -> None: ...


class TensorBoardTracker:
    """torch.utils.tensorboard's SummaryWriter: event files under `directory`, flushed every record so that
    a running TensorBoard shows each step as it is logged and a crash loses nothing written."""

    def __init__(self, directory: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(directory))

    def log(self, step: int, values: dict[str, float]) -> None:
        for tag, value in values.items():
            if math.isfinite(value):  # TensorBoard's charts cannot place NaN/inf; the JSONL keeps them
                self.writer.add_scalar(tag, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    """One W&B run per training run: project from WANDB_PROJECT (W&B's own variable; default "keel"), the
    run's name, the validated config; WANDB_MODE=offline and the rest of W&B's variables apply as usual.
    A resumed run continues the same W&B run (its id is the run directory's name and path)."""

    def __init__(self, run_dir: Path, name: str, config: dict[str, Any]) -> None:
        import os

        import wandb

        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "keel"),
            name=name,
            dir=str(run_dir),
            config=config,
            id=_wandb_id(run_dir, name),
            resume="allow",
        )

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


def _wandb_id(run_dir: Path, name: str) -> str:
    """A stable W&B run id for a run directory (W&B ids: letters, digits, - and _, at most 64 characters)."""
    import hashlib

    digest = hashlib.sha1(str(Path(run_dir).resolve()).encode()).hexdigest()[:12]
    safe = "".join(c if c.isalnum() or c in "-_" else "-" for c in name)[:48]
    return f"{safe}-{digest}"


class Trackers:
    """The trackers a run's config asks for (none on ranks other than 0)."""

    def __init__(self, trackers: list[Tracker]) -> None:
        self.trackers = trackers

    def write(self, record: dict[str, Any]) -> None:
        if not self.trackers or "step" not in record:
            return
        values = scalars(record)
        for tracker in self.trackers:
            tracker.log(int(record["step"]), values)

    def close(self) -> None:
        for tracker in self.trackers:
            tracker.close()
        self.trackers = []
