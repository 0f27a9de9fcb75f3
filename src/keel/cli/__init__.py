"""`keel <command>`: the command-line entry point; one module per command, each with `register(subparsers)`.

User errors (KeelError, a path that cannot be read or written) print one line, `keel: error: ...`, and exit 1
without a traceback; a bad option prints one line too and exits 2 (argparse's code).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import NoReturn

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


class _Parser(argparse.ArgumentParser):
    """argparse's parser with keel's one-line errors (argparse prints its usage block first); the subcommands'
    parsers are of this class too (add_subparsers takes the parent's)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"keel: error: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="keel", description=__doc__.splitlines()[0])
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
    except OSError as e:  # a path the command cannot read or write (a file where a directory goes, no permission)
        if e.filename is None:
            raise
        print(f"keel: error: {e.filename}: {e.strerror or e}", file=sys.stderr)
        return 1
