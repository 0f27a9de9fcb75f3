"""`keel inspect MODEL`: a checkpoint's structure, parameters and provenance."""

from __future__ import annotations

import argparse
import json

from keel.cli.common import add_model_args


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("inspect", help="print a checkpoint's structure, parameters and provenance")
    add_model_args(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from keel.tools.inspect import describe, format_text
    from keel.weights import open_checkpoint

    info = describe(open_checkpoint(args.model, head_dim=args.head_dim, num_heads=args.num_heads))
    print(json.dumps(info, indent=2, default=str) if args.json else format_text(info))
    return 0
