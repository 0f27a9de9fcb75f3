"""keel's C++ CPU kernels, registered as torch operators (`torch.ops.keel.*`) by `keel.kernels._C`.

The library is compiled by the project's own build at install (setup.py; g++ and torch's headers,
nothing downloaded) and dispatches at run time on the level keel.platform reports: AMX tile products
of many rows from `amx` (where Linux grants the process the tile state), AVX-512 VNNI kernels for the
block products from `avx512_vnni` up (BF16 and AMX machines included),
AVX2 + FMA kernels from `avx2` up for everything else; on aarch64 NEON kernels from `neon` up (the block
products with ARMv8.2's SDOT where the CPU has it); the portable ones elsewhere (`default` x86-64 or
aarch64, other architectures). Every kernel splits its work with ATen's `parallel_for`, so
`torch.set_num_threads` governs it.

`KEEL_KERNELS=0` turns them off: every caller takes its pure-torch path instead (for debugging and
comparison); so does a source tree whose library was not built (`enabled()` says which and why).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
import os
from collections.abc import Iterator

import torch

from keel.platform import Platform, host

ENV = "KEEL_KERNELS"
# The levels the library has kernels for, by architecture, lowest first.
X86_LEVELS = ("scalar", "avx2", "avx512_vnni", "amx")
ARM_LEVELS = ("scalar", "neon", "neon_dotprod")
# Their values in keel::Isa (csrc/kernels.h).
ISA_VALUES = {"scalar": 0, "avx2": 1, "avx512_vnni": 2, "amx": 3, "neon": 4, "neon_dotprod": 5}


def levels_of(arch: str) -> tuple[str, ...]:
    """The kernel levels of an architecture, lowest first."""
    return X86_LEVELS if arch == "x86_64" else ARM_LEVELS if arch == "aarch64" else ("scalar",)


def kernel_level(platform: Platform) -> str:
    """The library's level for a host: AMX tiles on keel.platform's `amx`, the VNNI kernels from
    `avx512_vnni` up, AVX2 ones from `avx2`; NEON ones from `neon` (SDOT's where the CPU has it); portable
    ones elsewhere (the tiles and SDOT are also asked of the library: `levels_here`)."""
    if platform.arch == "aarch64":
        return "neon_dotprod" if platform.neon else "scalar"
    if platform.arch != "x86_64":
        return "scalar"
    if platform.vnni:
        return "amx" if platform.amx else "avx512_vnni"
    return "avx2" if platform.avx2 else "scalar"


def _granted(level: str) -> str:
    """`level`, or the level below it where the library finds it cannot run: the VNNI level where the
    AMX tile state is not granted to this process, plain NEON where the CPU has no SDOT."""
    if level == "amx" and not torch.ops.keel.amx_ready():
        return "avx512_vnni"
    if level == "neon_dotprod" and not torch.ops.keel.neon_dotprod_ready():
        return "neon"
    return level


def panels_here() -> bool:
    """Whether 4-bit products of many rows run a panel kernel (csrc/block_gemm_packed_avx2.cpp, and
    block_gemm_packed_avx512.cpp at the VNNI level): they beat dequantizing to float32 for BLAS at
    every row count measured when the activations take one int8 pass."""
    return _load() is not None and _LEVEL_NOW[0] in ("avx2", "avx512_vnni", "amx")


def vnni_panels_here() -> bool:
    """Whether products of many rows run the VNNI panel kernel (csrc/block_gemm_packed_avx512.cpp, 4-bit
    and 8-bit codes): it beats dequantizing to float32 for BLAS at every row count measured, with one
    int8 pass or two (docs/BENCHMARKS.md, "keel's kernels (issue 22, fifth part)")."""
    return _load() is not None and _LEVEL_NOW[0] in ("avx512_vnni", "amx")


def stored_panels_here() -> bool:
    """Whether block weights stored in panels of 16 rows (keel.quant.panels) run as stored: the AVX2 kernel
    (csrc/block_gemm_stored_avx2.cpp) from `avx2`, the VNNI one (and AMX tiles) from `avx512_vnni`; the
    portable level converts them back to rows per call."""
    return _load() is not None and _LEVEL_NOW[0] in ("avx2", "avx512_vnni", "amx")


def levels_here(platform: Platform | None = None) -> tuple[str, ...]:
    """Every kernel level this machine can run (tests run each of them)."""
    platform = platform or host()
    top = kernel_level(platform)
    if _load() is not None:
        top = _granted(top)
    levels = levels_of(platform.arch)
    return levels[: levels.index(top) + 1]


def built() -> bool:
    """Whether the compiled library is present (the install builds it; a bare source tree may lack it)."""
    return importlib.util.find_spec("keel.kernels._C") is not None


def switched_off() -> bool:
    return os.environ.get(ENV, "1").strip() == "0"


_LEVEL_NOW = [""]  # the level the library runs at now (`using_level` changes it)


@functools.cache
def _load() -> str | None:
    """Load the library once and set its level from the platform probe; the level, or None when not built."""
    if not built():
        return None
    importlib.import_module("keel.kernels._C")
    from keel.kernels import fake

    fake.register()

    level = _granted(kernel_level(host()))
    torch.ops.keel.set_kernel_isa(ISA_VALUES[level])
    _LEVEL_NOW[0] = level
    logging.getLogger("keel").debug("keel kernels: %s level", level)
    return level


def enabled(device_type: str = "cpu") -> bool:
    """Whether keel's kernels run on this device type here (CPU only; not under KEEL_KERNELS=0, read on
    every call: layers choose their kernels when they are built)."""
    return device_type == "cpu" and not switched_off() and _load() is not None


_ACTIVE: bool | None = None  # `active()`, once read


def active() -> bool:
    """`enabled("cpu")`, read once per process: for the checks made on every call (norms, rotary,
    attention), where reading the environment would cost more than the kernel saves. (Quantized
    layers read KEEL_KERNELS again whenever one is built.)"""
    global _ACTIVE
    if _ACTIVE is None:
        _ACTIVE = enabled("cpu")
    return _ACTIVE


def fused_ops(x: torch.Tensor) -> bool:
    """Whether the model's small ops on `x` (RMSNorm, rotary, SiLU-and-multiply) take keel's fused
    kernels: inference (no autograd) on a CPU where the kernels run, in float32 (bf16 keeps torch's
    ops, whose roundings transformers' bf16 reference shares). Under torch.compile the answer is
    the one eager steps read (a constant of the graph: compiled and eager steps call the same
    kernels; keel.serve.compiled_decode reads it before compiling)."""
    if x.device.type != "cpu" or torch.is_grad_enabled() or x.dtype != torch.float32:
        return False
    return bool(_ACTIVE) if torch.compiler.is_compiling() else active()


def status() -> str:
    """One phrase for the start-up log: the level the kernels run at, or why they do not run."""
    if switched_off():
        return f"off ({ENV}=0)"
    if not built():
        return "not built (reinstall keel: pip install --no-build-isolation -e .)"
    _load()
    return f"keel {_LEVEL_NOW[0]}"  # the level running now (`using_level` changes it)


@contextlib.contextmanager
def using_level(level: str) -> Iterator[None]:
    """Run the kernels at `level` (one of `levels_here()`) inside the block: tests compare every level."""
    if _load() is None:
        raise RuntimeError("keel kernels are not loaded")
    if level not in levels_here():
        raise ValueError(f"kernel level {level!r} does not run here; choose from {', '.join(levels_here())}")
    previous = torch.ops.keel.set_kernel_isa(ISA_VALUES[level])
    previous_name, _LEVEL_NOW[0] = _LEVEL_NOW[0], level
    try:
        yield
    finally:
        torch.ops.keel.set_kernel_isa(previous)
        _LEVEL_NOW[0] = previous_name
