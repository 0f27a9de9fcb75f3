"""Seed checkpoints (torchtitan's `create_seed_checkpoint`): a run's initial model written once, in one
process, as RUN/checkpoints/step-00000000, which every later `keel train` of that run starts from.

keel's initial weights already depend only on the seed and the parameter names, not on the layout
(keel.model.seeded_init), so a seed checkpoint is not needed for parallel runs to agree. It is for
starting runs on other machines from the very same values (generators differ between CPU and CUDA,
so a GPU run initialised on its GPUs draws other numbers than a CPU run), for starting several runs
(ablations, other layouts) from one initial model, and for skipping initialisation at start-up.
Ranks read only their shards of it (DCP reshards on load). Writing it materialises the whole model
in this process's memory: run it where the whole model fits.
"""

from __future__ import annotations

from pathlib import Path

import torch

from keel.dtypes import DTYPES
from keel.errors import KeelError
from keel.model.seeded_init import init_weights_seeded, materialize
from keel.model.transformer import Transformer
from keel.train.checkpoint import CheckpointManager, ModelParts, latest_checkpoint
from keel.train.config import TrainConfig, model_config_from


def write_seed_checkpoint(cfg: TrainConfig) -> Path:
    """The run's initial model (the same values `keel train` would start from) as its step-0 checkpoint."""
    from keel.train.trainer import write_model_files
    from keel.weights import open_checkpoint

    if cfg.model.source is not None:
        raise KeelError("model.source: the run starts from that checkpoint; a seed checkpoint needs model.config")
    existing = latest_checkpoint(cfg.run_dir / "checkpoints")
    if existing is not None:
        raise KeelError(f"{existing}: the run already has a checkpoint; a seed checkpoint starts a new run")
    config = model_config_from(cfg.model.config)
    tokenizer = open_checkpoint(cfg.model.tokenizer_ref).tokenizer
    with torch.device("meta"):
        model = Transformer(config)
    model.to(DTYPES[cfg.model.dtype])
    materialize(model, "cpu", lambda m: init_weights_seeded(m, cfg.run.seed))
    manager = CheckpointManager(
        cfg.run_dir,
        keep=0,
        async_save=False,
        write_model_files=lambda directory: write_model_files(directory, config, cfg, tokenizer, untied=False),
    )
    return manager.save_seed(ModelParts([model], []))
