"""`keel train CONFIG.toml [--nproc N] ...` and `keel train plot RUN_DIR` (keel.train.launch runs it)."""

from __future__ import annotations

import argparse

from keel.errors import KeelError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train (hybrid parallel via torchrun); `keel train plot RUN_DIR` draws curves")
    p.add_argument("config", metavar="CONFIG", help="TOML training config (or `plot`, then RUN_DIR)")
    p.add_argument("run_dir", metavar="RUN_DIR", nargs="?", help=argparse.SUPPRESS)
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config value, e.g. training.steps=100 (repeatable)",
    )
    p.add_argument("--nproc", type=int, default=1, help="processes on this node (torchrun --nproc-per-node)")
    p.add_argument("--nnodes", default="1", help="nodes (torchrun --nnodes; e.g. 2 or 1:4 for elastic)")
    p.add_argument("--node-rank", type=int, default=None, help="this node's rank (torchrun --node-rank)")
    p.add_argument("--rdzv-endpoint", default=None, help="HOST:PORT of the rendezvous (multi-node)")
    p.add_argument("--rdzv-id", default=None, help="job id shared by all nodes (multi-node)")
    p.add_argument("--max-restarts", type=int, default=0, help="restart all workers this many times on a failure")
    p.add_argument(
        "--seed-checkpoint",
        action="store_true",
        help="write the run's initial model as its step-0 checkpoint (one process) and exit; runs start from it",
    )
    p.add_argument("--out", default=None, help="with `plot`: the PNG path (default RUN_DIR/curves.png)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.config == "plot":
        from keel.train.plot import plot_run

        if not args.run_dir:
            raise KeelError("usage: keel train plot RUN_DIR [--out FILE]")
        print(f"wrote {plot_run(args.run_dir, args.out)}")
        return 0
    from keel.train.launch import launch

    return launch(
        args.config,
        args.overrides,
        args.nproc,
        args.nnodes,
        args.node_rank,
        args.rdzv_endpoint,
        args.rdzv_id,
        args.max_restarts,
        args.seed_checkpoint,
    )
