"""What a training run needs before any process starts: its data files and its run directory.

`keel train --nproc N` checks these in the launching process, so a missing or unprepared token file,
a sidecar that does not match its file, ids beyond the model's vocabulary, an unwritable run
directory or a resume path that is not a checkpoint is keel's one-line error, not N ranks' errors
followed by torchrun's failure report. The ranks check the same things again (the trainer uses the
same functions), which costs a stat and a sidecar read.
"""

from __future__ import annotations

import os
from pathlib import Path

from keel.errors import KeelError
from keel.train.config import TrainConfig, model_config_from
from keel.train.data import TokenFile, open_datasets


def check_vocabulary(train_file: TokenFile, vocab_size: int) -> None:
    """The token file's ids must fit the model's embedding."""
    if train_file.vocab_size > vocab_size:
        raise KeelError(
            f"{train_file.path}: token ids up to {train_file.vocab_size - 1}, but the model's vocabulary has "
            f"{vocab_size} entries"
        )


def model_vocab_size(cfg: TrainConfig) -> int:
    """The vocabulary of the model the config trains: its `[model.config]`, or its source checkpoint's."""
    if cfg.model.source is None:
        return model_config_from(cfg.model.config).vocab_size
    from keel.weights import open_checkpoint

    return open_checkpoint(cfg.model.source).config.vocab_size


def check_run_dir(cfg: TrainConfig) -> None:
    """The run directory can be created and written; a resume path names a complete checkpoint."""
    run_dir = cfg.run_dir
    if run_dir.exists() and not run_dir.is_dir():
        raise KeelError(f"run.dir {run_dir}: exists and is not a directory")
    existing = next(p for p in (run_dir, *run_dir.parents) if p.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise KeelError(f"run.dir {run_dir}: {existing} is not a writable directory")
    resume = cfg.checkpoint.resume
    if resume not in ("auto", "none") and not (Path(resume) / "COMPLETE").exists():
        raise KeelError(f"checkpoint.resume = {resume}: not a complete keel checkpoint directory")


def preflight(cfg: TrainConfig) -> None:
    """Every check a rank would fail at start-up on its data or run directory, once, in this process."""
    train, _ = open_datasets(cfg.data.path, cfg.data.val_path, cfg.data.val_tokens)
    check_vocabulary(train, model_vocab_size(cfg))
    check_run_dir(cfg)
