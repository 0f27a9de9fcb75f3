"""Distributed checkpoints (torch.distributed.checkpoint) with exact resume.

Layout of a run directory:

    RUN/checkpoints/step-00000100/        a complete checkpoint (never partially written)
        .metadata, __0_0.distcp, ...      DCP: model and optimizer, each rank its own shards
        trainer-rank-0.pt ...             per rank: step, LR schedule, loss scaler, data loader,
                                          guard windows, RNG states (torch.save)
        config.json, tokenizer files      the model's HF config and tokenizer: the directory is a
                                          model keel loads (`keel convert/serve/generate`)
        COMPLETE                          written last
    RUN/checkpoints/step-00000000/        a seed checkpoint (`keel train CONFIG --seed-checkpoint`):
        .metadata, __0_0.distcp, SEED     the initial model only (keel.train.seed_checkpoint)
    RUN/checkpoints/step-00000200.tmp/    a save in progress (or one that crashed): ignored

Every save goes to `step-N.tmp`; only after every rank has finished writing (a barrier) does rank
0 write COMPLETE and rename the directory, so a crash mid-save never touches the last good
checkpoint. Async saves stage the state to CPU memory and write in a background thread, over
their own gloo process group (checkpoint collectives must not interleave with training ones);
the next save, or `finalize()`, waits for the previous one before committing it.

Resume on another world size or layout: DCP reshards model and optimizer state on load
(DTensor placements are recorded in the metadata); the trainer state of rank 0 is global
(step, schedule, loader position) and is what every rank restores.
"""

from __future__ import annotations

import logging
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from keel.atomic import atomic_file, replace_dir

log = logging.getLogger("keel.train")

STEP_DIR = re.compile(r"^step-(\d+)$")
COMPLETE = "COMPLETE"
SEED = "SEED"  # marks a checkpoint that holds only a run's initial model


def process_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def barrier(group: dist.ProcessGroup | None) -> None:
    if dist.is_initialized():
        dist.barrier(group=group)


def latest_checkpoint(checkpoints: Path) -> Path | None:
    """The newest complete checkpoint directory, or None."""
    if not checkpoints.is_dir():
        return None
    found = []
    for entry in checkpoints.iterdir():
        match = STEP_DIR.match(entry.name)
        if match and (entry / COMPLETE).exists():
            found.append((int(match.group(1)), entry))
    return max(found)[1] if found else None


class ModelParts:
    """The model parts this rank holds (one module, or its pipeline stages) with their optimizers,
    seen as one state dict of fully-qualified names (stages keep the whole model's names)."""

    def __init__(self, modules: list[nn.Module], optimizers: list[torch.optim.Optimizer]) -> None:
        self.modules = modules
        self.optimizers = optimizers

    def model_state(self) -> dict[str, Any]:
        state: dict[str, Any] = {}
        for module in self.modules:
            state.update(get_model_state_dict(module))
        return state

    def optim_state(self) -> dict[str, Any]:
        state: dict[str, Any] = {}
        for module, optimizer in zip(self.modules, self.optimizers, strict=True):
            part = get_optimizer_state_dict(
                module, optimizer, options=StateDictOptions(flatten_optimizer_state_dict=True)
            )
            state.update(part)
        return state

    def load(self, model_state: dict[str, Any], optim_state: dict[str, Any]) -> None:
        for module, optimizer in zip(self.modules, self.optimizers, strict=True):
            set_model_state_dict(module, model_state, options=StateDictOptions(strict=False))
            set_optimizer_state_dict(
                module, optimizer, optim_state, options=StateDictOptions(flatten_optimizer_state_dict=True)
            )


def load_model_only(path: Path, parts: ModelParts) -> None:
    """The model of checkpoint `path` into `parts` (each rank reading its shards, resharded by DCP); the
    optimizer states and trainer state stay as they are."""
    model = {"model": parts.model_state()}
    dcp.load(model, checkpoint_id=str(path), no_dist=not dist.is_initialized())
    for module in parts.modules:
        set_model_state_dict(module, model["model"], options=StateDictOptions(strict=False))


class CheckpointManager:
    def __init__(
        self,
        run_dir: Path,
        keep: int = 3,
        async_save: bool = True,
        write_model_files: Callable[[Path], None] | None = None,
        before_commit: Callable[[int], None] | None = None,
    ) -> None:
        self.dir = Path(run_dir) / "checkpoints"
        self.keep = keep
        self.write_model_files = write_model_files  # config.json + tokenizer into a step dir (rank 0)
        self.before_commit = before_commit  # fault injection: called on every rank once its files are written
        self.async_save = async_save and dist.is_initialized()
        # Async saves talk over their own group, so they never interleave with training collectives.
        self._group = dist.new_group(backend="gloo") if self.async_save else None
        self._pending: tuple[Any, Path, Path, int] | None = None  # (future, tmp dir, final dir, step)
        if process_rank() == 0:
            self.dir.mkdir(parents=True, exist_ok=True)
        barrier(None)

    # ------------------------------------------------------------------ save
    def save(self, step: int, parts: ModelParts, trainer_state: dict[str, Any], *, blocking: bool = False) -> None:
        """Save the state at `step` (after its optimizer step). Async unless `blocking`."""
        self.finalize()  # at most one save in flight: commit the previous one first
        final = self.dir / f"step-{step:08d}"
        tmp = self.dir / f"step-{step:08d}.tmp"
        if process_rank() == 0:
            if tmp.exists():
                shutil.rmtree(tmp)  # a crashed earlier attempt at this step
            tmp.mkdir(parents=True)
        barrier(None)
        start = time.perf_counter()
        state = {"model": parts.model_state(), "optim": parts.optim_state()}
        with atomic_file(tmp / f"trainer-rank-{process_rank()}.pt") as f:
            torch.save(trainer_state, f)
        if self.async_save and not blocking:
            future = dcp.async_save(state, checkpoint_id=str(tmp), process_group=self._group)
            self._pending = (future, tmp, final, step)
            log.info(
                "checkpoint step %d: staged in %.2f s, writing in the background", step, time.perf_counter() - start
            )
            return
        dcp.save(state, checkpoint_id=str(tmp), no_dist=not dist.is_initialized())
        self._commit(tmp, final, step)
        log.info("checkpoint step %d saved in %.2f s", step, time.perf_counter() - start)

    def save_seed(self, parts: ModelParts) -> Path:
        """Write the model alone as the step-0 checkpoint (one process; see keel.train.seed_checkpoint)."""
        final, tmp = self.dir / f"step-{0:08d}", self.dir / f"step-{0:08d}.tmp"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        dcp.save({"model": parts.model_state()}, checkpoint_id=str(tmp), no_dist=True)
        (tmp / SEED).write_text("the initial model of a run: no optimizer or trainer state\n")
        self._commit(tmp, final, 0)
        return final

    def written(self) -> bool:
        """Whether this rank has no save in flight, or has written all of its files (committing then
        waits for no write; the ranks agree before they commit: `_commit` is collective)."""
        if self._pending is None:
            return True
        future = self._pending[0]
        return (future if hasattr(future, "done") else future.upload_completion).done()

    def finalize(self) -> None:
        """Wait for the save in flight, if any, and commit it."""
        if self._pending is None:
            return
        future, tmp, final, step = self._pending
        self._pending = None
        result = future.result() if hasattr(future, "result") else future.upload_completion.result()
        del result
        self._commit(tmp, final, step)

    def _commit(self, tmp: Path, final: Path, step: int) -> None:
        if self.before_commit is not None:
            self.before_commit(step)
        barrier(self._group)  # every rank has written its files
        if process_rank() == 0:
            if self.write_model_files is not None:
                self.write_model_files(tmp)
            (tmp / COMPLETE).write_text(f"{step}\n")
            if final.exists():
                shutil.rmtree(final)
            replace_dir(tmp, final)  # the files on disk before the rename publishes them
            self._prune()
        barrier(self._group)

    def _prune(self) -> None:
        if self.keep <= 0:
            return
        complete = sorted(
            (int(m.group(1)), e)
            for e in self.dir.iterdir()
            if (m := STEP_DIR.match(e.name)) and (e / COMPLETE).exists()
        )
        for _, path in complete[: -self.keep]:
            shutil.rmtree(path, ignore_errors=True)

    # ------------------------------------------------------------------ load
    def load(self, path: Path, parts: ModelParts) -> dict[str, Any] | None:
        """Restore model and optimizer shards from `path` (resharding as needed); returns the
        trainer state of rank 0 (global) with this rank's RNG state when it has one, or None for a
        seed checkpoint (only the model is restored; the optimizer keeps its state)."""
        if (path / SEED).exists():
            load_model_only(path, parts)
            return None
        state = {"model": parts.model_state(), "optim": parts.optim_state()}
        dcp.load(state, checkpoint_id=str(path), no_dist=not dist.is_initialized())
        parts.load(state["model"], state["optim"])
        trainer = torch.load(path / "trainer-rank-0.pt", weights_only=False)
        own = path / f"trainer-rank-{process_rank()}.pt"
        if process_rank() != 0 and own.exists():
            trainer["rng"] = torch.load(own, weights_only=False).get("rng", trainer.get("rng"))
        return trainer
