"""`keel upcycle` (transitional: delegates to keel.tools.upcycle)."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    from keel.tools.upcycle import register as _register

    _register(sub)
