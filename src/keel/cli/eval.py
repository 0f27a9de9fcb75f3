"""`keel eval` (transitional: delegates to keel.eval.cli)."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    from keel.eval.cli import register as _register

    _register(sub)
