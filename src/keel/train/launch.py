"""`keel train`: validate the config, then run one process or torchrun N of them.

    keel train CONFIG.toml [--set section.key=value]... [--nproc N]
               [--nnodes N --node-rank R --rdzv-endpoint HOST:PORT --rdzv-id ID] [--max-restarts K]
    keel train plot RUN_DIR [--out FILE]

The config, the parallel layout (mesh sizes against the world size, batch divisibility), the data
files and the run directory (keel.train.preflight) are checked here, before any process group
starts, so a bad config, a missing or unprepared token file or an unwritable run directory is one
line and exit code 1, without torchrun's failure report.
With `--nproc 1` (and one node) training runs in this process; otherwise this process execs
`python -m torch.distributed.run` (torchrun), which starts the workers (`python -m
keel.train.launch`), restarts them all up to `--max-restarts` times when one fails (they resume
from the last checkpoint), and spans nodes through its rendezvous options.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from keel.errors import KeelError


def add_train_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", metavar="CONFIG", help="TOML training config (or `plot`, then RUN_DIR)")
    p.add_argument("run_dir", metavar="RUN_DIR", nargs="?", help=argparse.SUPPRESS)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. training.steps=100 (repeatable)")  # fmt: skip
    p.add_argument("--nproc", type=int, default=1, help="processes on this node (torchrun --nproc-per-node)")
    p.add_argument("--nnodes", default="1", help="nodes (torchrun --nnodes; e.g. 2 or 1:4 for elastic)")
    p.add_argument("--node-rank", type=int, default=None, help="this node's rank (torchrun --node-rank)")
    p.add_argument("--rdzv-endpoint", default=None, help="HOST:PORT of the rendezvous (multi-node)")
    p.add_argument("--rdzv-id", default=None, help="job id shared by all nodes (multi-node)")
    p.add_argument("--max-restarts", type=int, default=0, help="restart all workers this many times on a failure")
    p.add_argument("--out", default=None, help="with `plot`: the PNG path (default RUN_DIR/curves.png)")


def cmd_train(args: argparse.Namespace) -> int:
    if args.config == "plot":
        from keel.train.plot import plot_run

        if not args.run_dir:
            raise KeelError("usage: keel train plot RUN_DIR [--out FILE]")
        print(f"wrote {plot_run(args.run_dir, args.out)}")
        return 0
    from keel.train.config import load_config, resolve_layout
    from keel.train.preflight import preflight

    if args.nproc < 1:
        raise KeelError(f"--nproc must be >= 1, got {args.nproc}")
    cfg = load_config(args.config, args.overrides)
    nnodes = args.nnodes.split(":")[-1]
    if not nnodes.isdigit() or int(nnodes) < 1:
        raise KeelError(f"--nnodes {args.nnodes}: expected N or MIN:MAX")
    world = args.nproc * int(nnodes)
    resolve_layout(cfg, world)  # mesh and batch checks before any process starts
    preflight(cfg)  # data files and the run directory, before any process starts
    if world == 1:
        return run_worker(args.config, args.overrides)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.nproc}", f"--nnodes={args.nnodes}",
           f"--max-restarts={args.max_restarts}"]  # fmt: skip
    if args.node_rank is not None:
        cmd.append(f"--node-rank={args.node_rank}")
    if args.rdzv_endpoint:
        cmd += ["--rdzv-backend=c10d", f"--rdzv-endpoint={args.rdzv_endpoint}"]
        if args.rdzv_id:
            cmd.append(f"--rdzv-id={args.rdzv_id}")
    else:
        cmd.append("--standalone")  # one node: a local rendezvous on a free port
    cmd += ["-m", "keel.train.launch", args.config]
    for override in args.overrides:
        cmd += ["--set", override]
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.nproc)))
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


def main(argv: list[str] | None = None) -> int:
    """Entry point of a torchrun worker (`python -m keel.train.launch CONFIG --set ...`)."""
    parser = argparse.ArgumentParser(prog="keel-train-worker")
    parser.add_argument("config")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args(argv)
    try:
        return run_worker(args.config, args.overrides)
    except KeelError as e:
        print(f"keel: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
