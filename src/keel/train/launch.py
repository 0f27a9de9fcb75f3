"""`keel train` (keel.cli.train parses it): validate the config, then run one process or torchrun N of them.

    keel train CONFIG.toml [--set section.key=value]... [--nproc N]
               [--nnodes N --node-rank R --rdzv-endpoint HOST:PORT --rdzv-id ID] [--max-restarts K]
    keel train CONFIG.toml --seed-checkpoint    (one process: the run's initial model as step 0)
    keel train plot RUN_DIR [--out FILE]

The config, the parallel layout (mesh sizes against the world size, batch divisibility), the data
files and the run directory (keel.train.preflight) are checked here, before any process group
starts, so a bad config, a missing or unprepared token file or an unwritable run directory is one
line and exit code 1, without torchrun's failure report.
With `--nproc 1` (and one node) training runs in this process; otherwise this process execs
`python -m torch.distributed.run` (torchrun), which starts the workers (`python -m
keel.cli.train_worker`), restarts them all up to `--max-restarts` times when one fails (they resume
from the last checkpoint), and spans nodes through its rendezvous options.
"""

from __future__ import annotations

import logging
import os
import sys

from keel.errors import KeelError


def launch(
    config: str,
    overrides: list[str],
    nproc: int = 1,
    nnodes: str = "1",
    node_rank: int | None = None,
    rdzv_endpoint: str | None = None,
    rdzv_id: str | None = None,
    max_restarts: int = 0,
    seed_checkpoint: bool = False,
) -> int:
    """Check everything that can be checked before a process group exists, then train in this process
    (one process) or exec torchrun (its exit status becomes ours)."""
    from keel.train.config import load_config, resolve_layout
    from keel.train.preflight import preflight

    if nproc < 1:
        raise KeelError(f"--nproc must be >= 1, got {nproc}")
    cfg = load_config(config, overrides)
    nodes = nnodes.split(":")[-1]
    if not nodes.isdigit() or int(nodes) < 1:
        raise KeelError(f"--nnodes {nnodes}: expected N or MIN:MAX")
    world = nproc * int(nodes)
    if seed_checkpoint:
        if world != 1:
            raise KeelError("--seed-checkpoint writes the initial model in one process: drop --nproc/--nnodes")
        from keel.train.seed_checkpoint import write_seed_checkpoint

        print(f"keel train: wrote the seed checkpoint {write_seed_checkpoint(cfg)}")
        return 0
    resolve_layout(cfg, world)  # mesh and batch checks before any process starts
    preflight(cfg)  # data files and the run directory, before any process starts
    if world == 1:
        return run_worker(config, overrides)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc}",
        f"--nnodes={nnodes}",
        f"--max-restarts={max_restarts}",
    ]
    if node_rank is not None:
        cmd.append(f"--node-rank={node_rank}")
    if rdzv_endpoint:
        cmd += ["--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}"]
        if rdzv_id:
            cmd.append(f"--rdzv-id={rdzv_id}")
    else:
        cmd.append("--standalone")  # one node: a local rendezvous on a free port
    cmd += ["-m", "keel.cli.train_worker", config]
    for override in overrides:
        cmd += ["--set", override]
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, cmd)  # torchrun's exit status becomes ours


def run_worker(config: str, overrides: list[str]) -> int:
    """One rank: build the trainer from the config and train."""
    from keel.train.config import load_config
    from keel.train.trainer import Trainer

    rank = int(os.environ.get("RANK", 0))
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    cfg = load_config(config, overrides)
    trainer = Trainer(cfg)
    try:
        result = trainer.run()
    finally:
        trainer.close()
    if rank == 0:
        last = f"{result.final_loss:.4f}" if result.final_loss is not None else "n/a"
        print(f"keel train: {result.steps_done} steps, final loss {last}, run directory {cfg.run_dir}")
    return 0
