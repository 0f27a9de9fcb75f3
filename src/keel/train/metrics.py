"""Training observability: FLOPs per token and MFU, the machine's peak, peak memory, the metrics file.

MFU (model FLOPs utilisation) as torchtitan and the PaLM paper define it: model FLOPs per token x
tokens per second / peak FLOP/s, with model FLOPs per token = 6 x (active non-embedding
parameters + the LM head) + 12 x layers x heads x head_dim x seq_len (attention scores and
values, forward + backward; causal masking not discounted, as PaLM counts it). Recomputation
(activation checkpointing) is not counted: MFU, not HFU.

The peak: on CPU it is measured (square matmuls in the training dtype on the threads torch uses; what
"the measured matmul peak" of the benchmark means) once per machine, dtype and thread count, and kept
(keel.train.peak_cache); on GPU it comes from the table below (dense, no sparsity).
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path

import torch

from keel.config import ModelConfig
from keel.train.peak_cache import cached_cpu_peak, peak_cache_path

# Dense peak FLOP/s per GPU from the vendors' datasheets: bf16/fp16 on the tensor cores; fp32 as IEEE float32,
# not TF32 (keel leaves torch's default: float32 products in full precision, so TF32's peak is not what an
# fp32 run can reach). A GPU without an fp32 figure here gets no fp32 MFU.
GPU_PEAK_FLOPS = {
    "A100": {"bf16": 312e12, "fp32": 19.5e12},
    "H100": {"bf16": 989e12, "fp32": 67e12},
    "H200": {"bf16": 989e12, "fp32": 67e12},
    "B200": {"bf16": 2250e12},
    "MI300X": {"bf16": 1307e12, "fp32": 163.4e12},
}


def flops_per_token(config: ModelConfig, seq_len: int) -> float:
    """Training FLOPs (forward + backward) per token."""
    dense = config.param_counts()["active_matmul"]  # the input embedding is a lookup, no FLOPs
    attention = 12 * sum(config.layer_q_size(i) for i in range(config.num_layers)) * seq_len  # each layer's width
    return 6.0 * dense + attention


def measure_cpu_peak(dtype: torch.dtype, max_size: int = 2048, seconds: float = 1.0) -> float:
    """FLOP/s of square matmuls in `dtype` on this process's threads (best of a short run).

    The size grows from 256 while a multiply stays fast, so a dtype without a fast kernel on this
    CPU (float16 on most x86 parts; docs/BENCHMARKS.md, "Training") is measured in milliseconds, not minutes.
    """
    size = 256
    while True:
        a = torch.randn(size, size, dtype=dtype)
        b = torch.randn(size, size, dtype=dtype)
        torch.mm(a, b)  # warm-up (kernel selection)
        start = time.perf_counter()
        torch.mm(a, b)
        if size >= max_size or time.perf_counter() - start > 0.02:
            break
        size *= 2
    best, end = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        start = time.perf_counter()
        torch.mm(a, b)
        best = max(best, 2 * size**3 / (time.perf_counter() - start))
    return best


def peak_flops(device: torch.device, precision: str) -> tuple[float, str]:
    """(peak FLOP/s, how it was obtained) for MFU."""
    key = "fp32" if precision == "fp32" else "bf16"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for gpu, peaks in GPU_PEAK_FLOPS.items():
            if gpu in name:
                if key not in peaks:
                    return 0.0, f"{gpu}: no {key} datasheet peak here, MFU not computed"
                return peaks[key], f"{gpu} datasheet ({key}, dense)"
        return 0.0, f"unknown GPU {name!r}: MFU not computed"
    dtype = torch.float32 if precision == "fp32" else (torch.bfloat16 if precision == "bf16" else torch.float16)
    threads = torch.get_num_threads()
    peak, kept = cached_cpu_peak(dtype, threads, lambda: measure_cpu_peak(dtype))
    source = f"measured: {dtype} matmul on {threads} threads"
    return peak, source + (f", kept in {peak_cache_path()}" if kept else "")


def peak_memory_bytes(device: torch.device) -> int:
    """GPU: max_memory_allocated; CPU: the process's RSS high-water mark."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # Linux reports KiB


def current_memory_bytes(device: torch.device) -> int:
    """GPU: memory_allocated; CPU: the process's resident set now (Linux; elsewhere its high-water mark)."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return peak_memory_bytes(device)


class MetricsFile:
    """Append-only JSONL, one object per logged step (rank 0 only), flushed each line so a crash
    loses at most the line being written."""

    def __init__(self, path: Path, enabled: bool = True) -> None:
        self.path = Path(path)
        self.enabled = enabled
        self._file = None
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a", buffering=1)  # noqa: SIM115 - lives as long as the run

    def write(self, record: dict) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
            os.fsync(self._file.fileno())

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_metrics(path: Path) -> list[dict]:
    records = []
    for line in Path(path).read_text().splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue  # a torn last line after a crash
    return records
