"""`keel convert MODEL DST`: an HF-format directory (safetensors, config, tokenizer)."""

from __future__ import annotations

import argparse

from keel.cli.common import add_dtype_arg, add_model_args


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("convert", help="write an HF-format directory (safetensors, config, tokenizer)")
    add_model_args(p)
    p.add_argument("dst", metavar="DST", help="output directory (must not exist or be empty)")
    add_dtype_arg(p, help="dtype of the weights written (auto: the checkpoint's)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing DST")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from keel.weights.convert import convert

    dst = convert(
        args.model,
        args.dst,
        dtype=args.dtype,
        head_dim=args.head_dim,
        num_heads=args.num_heads,
        overwrite=args.overwrite,
    )
    print(f"wrote {dst}")
    return 0
