"""`keel align MODEL`: keel against transformers, layer by layer."""

from __future__ import annotations

import argparse

from keel.cli.common import add_dtype_arg, add_model_args, add_threads_arg, set_threads
from keel.dtype_names import DTYPE_NAMES


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("align", help="compare keel with transformers layer by layer")
    add_model_args(p)
    add_dtype_arg(p, "float32", DTYPE_NAMES, help="compute dtype of both models")
    add_threads_arg(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from keel.tools.align import align

    set_threads(args.threads)
    report = align(args.model, args.dtype, head_dim=args.head_dim, num_heads=args.num_heads)
    print(report.format())
    return 0 if report.passed else 1
