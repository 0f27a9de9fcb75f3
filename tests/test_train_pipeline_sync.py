"""Under a pipeline with gradient accumulation, FSDP reduce-scatters each unit's gradients once per
optimizer step: the trainer runs the step's accumulation micro-batches as one schedule step (torch's
stages reduce-scatter at the end of every schedule step). GPipe keeps one schedule step per micro-batch
(it would hold every micro-batch's activations otherwise), so it reduce-scatters once per micro-batch.
pp = 2 x dp_shard = 2 over 4 gloo ranks, the real Trainer, FSDP's reduce calls counted."""

from __future__ import annotations

import json
import os
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from keel.train.data import write_token_file
from test_train_run import config
from tiny_models import save_byte_tokenizer, save_hf_model

ACCUM = 2


def _worker(rank: int, root: str, schedule: str, out: str) -> None:
    import torch.distributed.fsdp._fully_shard._fsdp_param_group as param_group

    from keel.train.config import load_config
    from keel.train.trainer import Trainer

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE="4", LOCAL_RANK=str(rank))
    dist.init_process_group(
        "gloo", init_method=f"file://{root}/store-{schedule}", rank=rank, world_size=4, timeout=timedelta(seconds=120)
    )
    calls = []
    original = param_group.foreach_reduce

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    param_group.foreach_reduce = counted
    path = Path(root) / f"{schedule}.toml"
    batch = 2 * 2 * ACCUM  # micro-batch 2 rows x dp 2 x accumulation
    overrides = [f"training.global_batch_size={batch}", "training.micro_batch_size=2", "training.steps=2"]
    trainer = Trainer(load_config(path, overrides))
    per_step = []
    for _ in range(2):
        before = len(calls)
        trainer.train_step()
        per_step.append(len(calls) - before)
    from torch.distributed.fsdp import FSDPModule

    # FSDP units that hold parameters (a stage's root may have none left of its own; the final norm and
    # the head are one unit of two modules)
    groups = {
        id(sub._get_fsdp_state()._fsdp_param_group)
        for m in trainer.modules
        for sub in m.modules()
        if isinstance(sub, FSDPModule) and sub._get_fsdp_state()._fsdp_param_group is not None
    }
    units = len(groups)
    Path(f"{out}.{rank}").write_text(json.dumps({"per_step": per_step, "units": units}))
    trainer.close()


# GPipe's contrast (one reduce-scatter per micro-batch) runs in `make test-slow`.
@pytest.mark.parametrize("schedule", ["1f1b", pytest.param("gpipe", marks=pytest.mark.slow)])
def test_fsdp_reduce_scatters_once_per_optimizer_step_under_a_pipeline(tmp_path: Path, schedule: str):
    save_hf_model("llama", tmp_path / "tok")
    save_byte_tokenizer(tmp_path / "tok")
    rng = np.random.default_rng(0)
    write_token_file(tmp_path / "data.bin", rng.integers(3, 250, size=4000), vocab_size=256, eos_id=2)
    config(tmp_path, schedule, f'[parallel]\npp = 2\npp_schedule = "{schedule}"\n')  # writes tmp_path/SCHEDULE.toml
    out = str(tmp_path / "calls")
    mp.spawn(_worker, args=(str(tmp_path), schedule, out), nprocs=4, join=True)
    for rank in range(4):
        got = json.loads(Path(f"{out}.{rank}").read_text())
        assert got["units"] >= 2  # the stage's blocks and its embedding or head
        expected = got["units"] * (1 if schedule == "1f1b" else ACCUM)
        assert got["per_step"] == [expected, expected], (rank, got)
