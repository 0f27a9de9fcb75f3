"""`keel bench` (transitional)."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    from keel.tools import bench_serve

    p = sub.add_parser("bench", help="benchmarks")
    bench_sub = p.add_subparsers(dest="bench_command", required=True, metavar="BENCHMARK")
    bench_serve.register(bench_sub)
