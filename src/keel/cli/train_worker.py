"""Entry point of a torchrun worker of `keel train`: `python -m keel.cli.train_worker CONFIG --set ...`."""

from __future__ import annotations

import argparse
import sys

from keel.errors import KeelError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="keel-train-worker")
    parser.add_argument("config")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args(argv)
    from keel.train.launch import run_worker

    try:
        return run_worker(args.config, args.overrides)
    except KeelError as e:
        print(f"keel: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
