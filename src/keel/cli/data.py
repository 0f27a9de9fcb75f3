"""`keel data` (transitional)."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    from keel.train import data as train_data

    p = sub.add_parser("data", help="training data")
    data_sub = p.add_subparsers(dest="data_command", required=True, metavar="COMMAND")
    train_data.register(data_sub)
