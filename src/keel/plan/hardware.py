"""Accelerators the planner knows: memory, dense peak FLOP/s, HBM and interconnect bandwidth.

Vendor datasheet figures for the SXM/OAM parts, dense (no 2:4 sparsity), in SI units (bytes, FLOP/s,
bytes/s). `link` is the per-GPU scale-up bandwidth inside a node, one direction (NVLink / Infinity
Fabric); `network` the per-GPU scale-out bandwidth between nodes, one direction (one 400 Gb/s NIC
per GPU, the common layout). A cluster spec `8xH200` or `2048xH800` names a count and a type.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from keel.errors import KeelError

GB, TB, TFLOPS = 1e9, 1e12, 1e12


@dataclass(frozen=True)
class GPU:
    name: str
    memory: float  # bytes of HBM
    bf16_flops: float  # dense peak
    fp8_flops: float | None  # dense peak; None: no fp8 tensor cores
    hbm_bandwidth: float  # bytes/s
    link: float  # bytes/s per GPU inside a node, one direction
    network: float = 50 * GB  # bytes/s per GPU between nodes, one direction (400 Gb/s)
    per_node: int = 8


GPUS = {
    gpu.name.lower(): gpu
    for gpu in (
        GPU("A100-80G", 80 * GB, 312 * TFLOPS, None, 2.039 * TB, 300 * GB, network=25 * GB),
        GPU("H100-SXM", 80 * GB, 989 * TFLOPS, 1979 * TFLOPS, 3.35 * TB, 450 * GB),
        GPU("H800", 80 * GB, 989 * TFLOPS, 1979 * TFLOPS, 3.35 * TB, 200 * GB),  # NVLink cut to 400 GB/s both ways
        GPU("H200", 141 * GB, 989 * TFLOPS, 1979 * TFLOPS, 4.8 * TB, 450 * GB),
        GPU("B200", 192 * GB, 2250 * TFLOPS, 4500 * TFLOPS, 8.0 * TB, 900 * GB),
        GPU("MI300X", 192 * GB, 1307 * TFLOPS, 2615 * TFLOPS, 5.3 * TB, 448 * GB),
    )
}
ALIASES = {"a100": "a100-80g", "h100": "h100-sxm"}


@dataclass(frozen=True)
class Cluster:
    gpu: GPU
    count: int

    @property
    def nodes(self) -> int:
        return -(-self.count // self.gpu.per_node)


def get_gpu(name: str) -> GPU:
    key = ALIASES.get(name.lower(), name.lower())
    if key not in GPUS:
        known = ", ".join(g.name for g in GPUS.values())
        raise KeelError(f"unknown GPU {name!r} (known: {known})")
    return GPUS[key]


def parse_cluster(spec: str) -> Cluster:
    """'8xH200' -> 8 H200s; a bare type is one GPU."""
    match = re.fullmatch(r"\s*(?:(\d+)\s*[xX*]\s*)?([\w.-]+)\s*", spec)
    if match is None:
        raise KeelError(f"--gpus {spec!r}: expected COUNTxTYPE, e.g. 8xH200")
    count = int(match.group(1) or 1)
    if count < 1:
        raise KeelError(f"--gpus {spec!r}: the count must be >= 1")
    return Cluster(get_gpu(match.group(2)), count)


# Command-line overrides of a GPU's figures (a part not in the table, or a cluster's own network):
# option -> (field, unit multiplier).
OVERRIDES = {
    "gpu_memory": ("memory", GB),
    "bf16_tflops": ("bf16_flops", TFLOPS),
    "fp8_tflops": ("fp8_flops", TFLOPS),
    "hbm_tbs": ("hbm_bandwidth", TB),
    "link_gbs": ("link", GB),
    "network_gbs": ("network", GB),
    "gpus_per_node": ("per_node", 1),
}


def cluster_with_overrides(gpus: str, overrides: dict[str, float | None]) -> Cluster:
    """COUNTxTYPE with the custom-hardware figures (OVERRIDES' option names; None: the table's) applied."""
    cluster = parse_cluster(gpus)
    changes = {}
    for option, (field, unit) in OVERRIDES.items():
        value = overrides.get(option)
        if value is None:
            continue
        if value <= 0:
            raise KeelError(f"--{option.replace('_', '-')} {value}: must be > 0")
        changes[field] = int(value) if field == "per_node" else value * unit
    if not changes:
        return cluster
    gpu = dataclasses.replace(cluster.gpu, name=f"{cluster.gpu.name} (custom)", **changes)
    return Cluster(gpu, cluster.count)
