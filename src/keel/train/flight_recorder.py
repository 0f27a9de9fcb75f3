"""NCCL's flight recorder for training runs on GPUs: the last collectives of every rank, kept in a ring
buffer and written out when a collective times out or keel's step watchdog fires, so a hang can be
traced to the rank and collective that diverged (torch's `torch.distributed.flight_recorder` tool
reads the dumps).

The process group reads its settings from the environment when it is created: `environment` gives
them (the current names and the older ones torch still reads), and the trainer sets each one not
already set before it creates an NCCL group. Dumps go to RUN/flight_recorder/rank_R.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from keel.atomic import write_atomic

log = logging.getLogger("keel.train")


def environment(run_dir: Path, events: int) -> dict[str, str]:
    """The variables that turn the recorder on with `events` entries a rank and dump it on a timeout; makes
    the directory the dumps go to (NCCL's writer opens the file and, where its directory is missing, logs an
    error and drops the trace of the hang)."""
    directory = run_dir / "flight_recorder"
    directory.mkdir(parents=True, exist_ok=True)
    prefix = str(directory / "rank_")
    return {
        "TORCH_FR_BUFFER_SIZE": str(events),
        "TORCH_NCCL_TRACE_BUFFER_SIZE": str(events),
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_FR_DUMP_TEMP_FILE": prefix,
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": prefix,
    }


def dump(run_dir: Path, rank: int) -> Path | None:
    """This rank's recorder now (keel's watchdog fired: no collective timed out to trigger NCCL's own
    dump), to RUN/flight_recorder/rank_R.watchdog; the path, or None where this torch build has no
    NCCL recorder to read."""
    reader = getattr(torch._C._distributed_c10d, "_dump_nccl_trace", None)
    if reader is None:
        return None
    path = run_dir / "flight_recorder" / f"rank_{rank}.watchdog"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, reader())
    return path
