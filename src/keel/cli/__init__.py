"""`keel <command>`: the command-line entry point; one module per command, each with `register(subparsers)`.

User errors (KeelError) print one line, `keel: error: ...`, and exit 1 without a traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from keel.cli import (
    align,
    bench,
    convert,
    data,
    eval,
    generate,
    inspect,
    plan,
    profile,
    quantize,
    serve,
    train,
    upcycle,
)
from keel.errors import KeelError

# In `keel --help` order.
COMMANDS = (generate, inspect, align, convert, upcycle, quantize, plan, profile, serve, eval, train, data, bench)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="keel", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except KeelError as e:
        print(f"keel: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("keel: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `keel generate ... | head`
        return 0
