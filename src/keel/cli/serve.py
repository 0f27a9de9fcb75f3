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
    _add_vllm_flags_without_effect(p)
    p.set_defaults(func=run)


# vLLM's flags that change nothing in keel, taken so that a `vllm serve` command line runs as `keel serve`:
# logging switches (keel writes an audit line per request, never the prompt unless --audit-prompts), remote
# code (keel runs no model code from the checkpoint: its families are its own), API docs (keel serves none),
# prompt-token details (keel always reports the cached tokens).
_VLLM_SWITCHES = (
    "--trust-remote-code",
    "--disable-log-requests",
    "--enable-log-requests",
    "--disable-log-stats",
    "--disable-uvicorn-access-log",
    "--disable-fastapi-docs",
    "--enable-prompt-tokens-details",
)
_VLLM_VALUED = ("--max-log-len", "--uvicorn-log-level")


def _add_vllm_flags_without_effect(p: argparse.ArgumentParser) -> None:
    group = p.add_argument_group("vLLM's flags that change nothing here (accepted, ignored)")
    for flag in _VLLM_SWITCHES:
        group.add_argument(flag, action="store_true", help=argparse.SUPPRESS)
    for flag in _VLLM_VALUED:
        group.add_argument(flag, metavar="X", help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    from keel.serve.openai.server import serve

    source = ModelSource(args.model, head_dim=args.head_dim, num_heads=args.num_heads)
    return serve(source, dataclass_from_args(ServeOptions, args), engine_config_from_args(args))
