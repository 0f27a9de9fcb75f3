"""Mixed-precision quantization plans: the JSON file `keel quantize analyze` writes and
`--quant-plan` reads (`keel serve`, `keel generate`, `keel quantize save`).

{"scheme": "int8" | "int4", "group_size": g, "keep": [layers left in float, most sensitive first],
"layers": [every analysed layer's LayerSensitivity]}
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from keel.atomic import write_json_atomic
from keel.errors import KeelError
from keel.quant.linear import INT4_GROUP_SIZES, SCHEMES
from keel.quant.sensitivity import LayerSensitivity


def write_plan(path: str | Path, results: list[LayerSensitivity], keep: int, scheme: str, group_size: int) -> dict:
    plan = {
        "scheme": scheme,
        "group_size": group_size,
        "keep": [r.name for r in results[:keep]],
        "layers": [asdict(r) for r in results],
    }
    write_json_atomic(Path(path), plan)  # the old plan or the whole new one
    return plan


def read_plan(path: str | Path) -> dict:
    """A plan written by `keel quantize analyze`; one-line KeelError naming the file and field."""
    path = Path(path)
    try:
        plan = json.loads(path.read_text())
    except FileNotFoundError:
        raise KeelError(f"{path}: no such quantization plan") from None
    except json.JSONDecodeError as e:
        raise KeelError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(plan, dict):
        raise KeelError(f"{path}: expected a JSON object")
    if plan.get("scheme") not in SCHEMES:
        raise KeelError(f"{path}: scheme must be one of {', '.join(SCHEMES)}, got {plan.get('scheme')!r}")
    if plan["scheme"] == "int4" and plan.get("group_size") not in INT4_GROUP_SIZES:
        raise KeelError(f"{path}: group_size must be one of {INT4_GROUP_SIZES}, got {plan.get('group_size')!r}")
    keep = plan.get("keep", [])
    if not isinstance(keep, list) or not all(isinstance(k, str) for k in keep):
        raise KeelError(f"{path}: keep must be a list of layer names")
    return plan
