"""`keel serve MODEL`: the OpenAI-compatible HTTP server (keel.serve.openai.server runs it)."""

from __future__ import annotations

import argparse

from keel.cli.common import add_model_args
from keel.cli.config_options import (
    add_dataclass_options,
    add_engine_options,
    dataclass_from_args,
    engine_config_from_args,
)
from keel.serve.openai.options import ModelSource, ServeOptions


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, metrics)")
    add_model_args(p)
    add_dataclass_options(p, ServeOptions)
    add_engine_options(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from keel.serve.openai.server import serve

    source = ModelSource(args.model, head_dim=args.head_dim, num_heads=args.num_heads)
    return serve(source, dataclass_from_args(ServeOptions, args), engine_config_from_args(args))
