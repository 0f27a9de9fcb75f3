"""`keel <command>`: the command-line entry point; one module per command, each with `register(subparsers)`.

User errors (KeelError, a path that cannot be read or written) print one line, `keel: error: ...`, and exit 1
without a traceback; a bad option prints one line too and exits 2 (argparse's code).
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
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


def _exit_on_sigterm(signum: int, frame: object) -> None:
    # SystemExit unwinds like Ctrl-C: atomic writers remove their temp files (the default action kills the
    # process where it stands, leaving a half-written temp file). serve and train install handlers of their own.
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm) if _main_thread() else None
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
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()
