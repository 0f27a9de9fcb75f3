"""`keel train` (transitional)."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    from keel.train.launch import add_train_args, cmd_train

    p = sub.add_parser("train", help="train (hybrid parallel via torchrun); `keel train plot RUN_DIR` draws curves")
    add_train_args(p)
    p.set_defaults(func=cmd_train)
