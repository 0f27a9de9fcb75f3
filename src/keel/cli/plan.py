"""`keel plan` (transitional: delegates to keel.plan.cli)."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    from keel.plan.cli import register as _register

    _register(sub)
