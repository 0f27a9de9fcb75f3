"""`keel profile` (transitional: delegates to keel.profile.cli)."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    from keel.profile.cli import register as _register

    _register(sub)
