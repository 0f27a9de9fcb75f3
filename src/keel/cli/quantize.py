"""`keel quantize` (transitional: delegates to keel.quant.analyze)."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    from keel.quant.analyze import register as _register

    _register(sub)
