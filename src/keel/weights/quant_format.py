"""The integer formats of keel's quantized checkpoints, as a reader checks them when it opens one.

A directory written by `keel quantize save` declares its format in config.json's
`quantization_config` (quant_method "keel"; keel.quant.save documents the tensors). The schemes and
int4 group sizes are defined here, below keel.quant, because opening a checkpoint validates them
before any quantized layer exists; keel.quant's kernels take the same ones.
"""

from __future__ import annotations

from pathlib import Path

from keel.errors import WeightsError

SCHEMES = ("int8", "int4")
INT4_GROUP_SIZES = (32, 64, 128, 256)


def check_saved_quantization(quant: dict, path: Path) -> None:
    """The `quantization_config` of a `keel quantize save` directory; a one-line WeightsError otherwise."""
    scheme = quant.get("scheme")
    if scheme not in SCHEMES:
        raise WeightsError(f"{path}: quantization_config scheme must be one of {', '.join(SCHEMES)}, got {scheme!r}")
    if scheme == "int4" and quant.get("group_size") not in INT4_GROUP_SIZES:
        raise WeightsError(
            f"{path}: quantization_config group_size must be one of {INT4_GROUP_SIZES}, got {quant.get('group_size')!r}"
        )
    kept = quant.get("modules_not_converted", [])
    if not isinstance(kept, list) or not all(isinstance(m, str) for m in kept):
        raise WeightsError(f"{path}: quantization_config modules_not_converted must be a list of module names")
