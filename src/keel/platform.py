"""What this host can do, asked once per process, and the backends keel picks from it.

Every fast path asks `host()` (or a helper below) instead of probing the CPU itself, and no path
detects a feature by catching a kernel's exception: oneDNN's bf16 pre-packing, the compute dtype
that `--dtype auto` picks and the activation dtype of the integer weight-only kernels are decided
here, from torch's own probes (ATen's CPU capability, `torch.cpu._is_*_supported`, oneDNN's bf16
check) and CUDA's device count.

The levels keel distinguishes, lowest first: on x86-64 `default` (no AVX2), `avx2` (AVX2 + FMA),
`avx512`, `avx512_vnni`, `avx512_bf16`, `amx`; on aarch64 `default`, `neon`, `sve`. `KEEL_CPU_ISA`
caps the level (it can lower it, never raise it above what the CPU has), so any machine can run
the lowest one in tests. When it is set, importing keel also sets torch's and oneDNN's own caps
(`ATEN_CPU_CAPABILITY`, `ONEDNN_MAX_CPU_ISA`, `MKL_ENABLE_INSTRUCTIONS`) unless they are set
already; those are read when torch runs its first operator, so the probe reports a torch that
already runs above the cap (imported and used before keel) in `Platform.warnings`.
"""

from __future__ import annotations

import functools
import logging
import os
import platform as _platform
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from keel.errors import KeelError

if TYPE_CHECKING:
    import torch

ISA_ENV = "KEEL_CPU_ISA"
X86_LEVELS = ("default", "avx2", "avx512", "avx512_vnni", "avx512_bf16", "amx")
ARM_LEVELS = ("default", "neon", "sve")
# Each keel level as torch's and oneDNN's own caps (ATen has only default/avx2/avx512 on x86).
_ATEN_CAP = {"default": "default", "avx2": "avx2", "neon": "default"}
_ONEDNN_CAP = {
    "default": "SSE41",
    "avx2": "AVX2",
    "avx512": "AVX512_CORE",
    "avx512_vnni": "AVX512_CORE_VNNI",
    "avx512_bf16": "AVX512_CORE_BF16",
    "amx": "AVX512_CORE_AMX",
}
_MKL_CAP = {"avx2": "AVX2", "avx512": "AVX512", "avx512_vnni": "AVX512", "avx512_bf16": "AVX512"}


def _arch() -> str:
    machine = _platform.machine().lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(machine, machine)


def _levels(arch: str) -> tuple[str, ...]:
    return X86_LEVELS if arch == "x86_64" else ARM_LEVELS if arch == "aarch64" else ("default",)


def requested_isa() -> str | None:
    """The level `KEEL_CPU_ISA` asks for (lower case), or None when unset; an unknown name is a KeelError."""
    value = os.environ.get(ISA_ENV, "").strip().lower()
    if not value or value == "native":
        return None
    levels = _levels(_arch())
    if value not in levels:
        raise KeelError(f"{ISA_ENV}={value!r}: choose from native, {', '.join(levels)} on {_arch()}")
    return value


def export_isa_caps() -> None:
    """With `KEEL_CPU_ISA` set, cap torch (ATen's kernels, oneDNN, MKL) at the same level unless the
    user capped them already. Effective only before torch runs its first operator."""
    try:
        level = requested_isa()
    except KeelError:
        return  # reported, as one line, when the probe runs
    if level is None:
        return
    for var, table in (
        ("ATEN_CPU_CAPABILITY", _ATEN_CAP),
        ("ONEDNN_MAX_CPU_ISA", _ONEDNN_CAP),
        ("MKL_ENABLE_INSTRUCTIONS", _MKL_CAP),
    ):
        if level in table:
            os.environ.setdefault(var, table[level])


@dataclass(frozen=True)
class Platform:
    """The host as keel's fast paths see it (after `KEEL_CPU_ISA`)."""

    arch: str  # "x86_64", "aarch64", ...
    native_isa: str  # the CPU's own level
    isa: str  # the level keel runs at: native_isa, or lower when KEEL_CPU_ISA caps it
    aten_capability: str  # ATen's CPU kernels: "AVX2", "AVX512", "DEFAULT", "SVE256", ...
    avx2: bool
    avx512: bool
    vnni: bool  # AVX512-VNNI int8 dot products
    avx512_bf16: bool
    amx: bool
    neon: bool
    sve: bool
    onednn_bf16: bool  # oneDNN has a bf16 path here (AVX-512 BW/VL/DQ, AVX-NE-CONVERT, or aarch64 BF16)
    cuda_devices: tuple[str, ...]  # device names, one per visible GPU
    cpp_compiler: str | None  # the C++ compiler torch.compile's CPU code needs ($CXX or g++), if installed
    warnings: tuple[str, ...] = field(default=())

    @property
    def forced(self) -> bool:
        return self.isa != self.native_isa

    @property
    def generated_code_key(self) -> str:
        """Names the native code generated for this host, e.g. "x86_64-amx-avx512": the CPU's own level and
        the vector ISA torch vectorises for (its ATen capability, which ATEN_CPU_CAPABILITY lowers).
        Caches of generated code are kept apart by it (keel.paths.inductor_cache_dir)."""
        return f"{self.arch}-{self.native_isa}-{self.aten_capability.lower()}"

    @property
    def native_bf16_matmul(self) -> bool:
        """bf16 matrix products in hardware (AVX512-BF16, AMX, aarch64 BF16): faster than float32 there
        (docs/BENCHMARKS.md, batch scaling); elsewhere bf16 is converted to float32 in software and no
        faster than float32."""
        return self.avx512_bf16 or self.amx or (self.arch == "aarch64" and self.onednn_bf16)

    def describe(self) -> str:
        """One phrase: the ISA keel runs at, what forced it, and the GPUs."""
        text = f"{self.arch} {self.isa}"
        if self.forced:
            text += f" (forced by {ISA_ENV}; the CPU has {self.native_isa})"
        text += f", ATen {self.aten_capability}"
        if self.cuda_devices:
            text += f", {len(self.cuda_devices)} CUDA device(s): {self.cuda_devices[0]}"
        return text


def _native_level(arch: str) -> str:
    import torch

    if arch == "x86_64":
        cpu = torch.cpu
        if cpu._is_amx_tile_supported() and cpu._is_avx512_bf16_supported():
            return "amx"
        if cpu._is_avx512_bf16_supported():
            return "avx512_bf16"
        if cpu._is_avx512_supported():
            return "avx512_vnni" if cpu._is_vnni_supported() else "avx512"
        return "avx2" if cpu._is_avx2_supported() else "default"
    if arch == "aarch64":
        return "sve" if torch.backends.cpu.get_cpu_capability().startswith("SVE") else "neon"
    return "default"


def probe() -> Platform:
    """Read the host now (tests call this after changing KEEL_CPU_ISA; everything else uses `host()`)."""
    import torch

    arch = _arch()
    levels = _levels(arch)
    native = _native_level(arch)
    forced = requested_isa()
    if forced is not None and levels.index(forced) > levels.index(native):
        raise KeelError(f"{ISA_ENV}={forced}: this CPU's highest level is {native}; it can only be lowered")
    isa = forced or native
    rank = levels.index(isa)

    def at_least(level: str) -> bool:
        return level in levels and rank >= levels.index(level)

    aten = torch.backends.cpu.get_cpu_capability()
    warnings = []
    if forced is not None and arch == "x86_64" and aten == "AVX512" and not at_least("avx512"):
        warnings.append(
            f"{ISA_ENV}={forced} but torch already runs AVX512 kernels: set ATEN_CPU_CAPABILITY={_ATEN_CAP[forced]} "
            "and ONEDNN_MAX_CPU_ISA before torch runs an operator (keel sets them when it is imported first)"
        )
    mkldnn_bf16 = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    # oneDNN's bf16 check reads the CPU, not ONEDNN_MAX_CPU_ISA: under a cap below AVX-512 (or below
    # NEON on aarch64) it is off.
    onednn_bf16 = mkldnn_bf16 and (forced is None or at_least("avx512") or at_least("neon"))
    cuda = torch.cuda.is_available()
    names = tuple(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())) if cuda else ()
    return Platform(
        arch=arch,
        native_isa=native,
        isa=isa,
        aten_capability=aten,
        avx2=at_least("avx2"),
        avx512=at_least("avx512"),
        vnni=at_least("avx512_vnni"),
        avx512_bf16=at_least("avx512_bf16"),
        amx=at_least("amx"),
        neon=at_least("neon"),
        sve=at_least("sve"),
        onednn_bf16=onednn_bf16,
        cuda_devices=names,
        cpp_compiler=shutil.which(os.environ.get("CXX") or "g++"),
        warnings=tuple(warnings),
    )


@functools.cache
def host() -> Platform:
    """The host, probed once per process (its warnings logged once)."""
    platform = probe()
    for warning in platform.warnings:
        logging.getLogger("keel").warning(warning)
    return platform


@functools.cache
def cpu_model() -> str:
    """The CPU's name as the OS gives it (Linux's /proc/cpuinfo "model name"), else the platform's processor."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return _platform.processor() or _platform.machine()


DEVICE_FORMS = "auto, cpu, cuda or cuda:N"


def resolve_device(spec: str | None, platform: Platform | None = None) -> torch.device:
    """`--device`: auto (the first CUDA device where one is visible, else the CPU), cpu, cuda (cuda:0) or
    cuda:N; a KeelError naming what is missing where CUDA is asked for and absent."""
    import torch

    platform = platform or host()
    text = (spec or "auto").strip().lower()
    if text == "auto":
        return torch.device("cuda", 0) if platform.cuda_devices else torch.device("cpu")
    if text == "cpu":
        return torch.device("cpu")
    kind, colon, index = text.partition(":")
    if kind != "cuda" or (colon and not index.isdigit()):
        raise KeelError(f"--device {spec!r}: expected {DEVICE_FORMS}")
    if not platform.cuda_devices:
        raise KeelError(f"--device {spec}: {cuda_missing()}")
    number = int(index or 0)
    if number >= len(platform.cuda_devices):
        count = len(platform.cuda_devices)
        raise KeelError(f"--device {spec}: {count} CUDA device(s) visible here (cuda:0..cuda:{count - 1})")
    return torch.device("cuda", number)


def local_rank_cuda(local_rank: int, hint: str = "") -> torch.device:
    """cuda:LOCAL_RANK, one GPU per local rank of a node (a training rank, a serving worker); a KeelError
    naming the node's count where it has fewer GPUs than local ranks (`hint`: what to change, appended)."""
    import torch

    count = torch.cuda.device_count()
    if local_rank >= count:
        raise KeelError(
            f"local rank {local_rank} has no GPU: {count} CUDA device(s) visible on this node, one per local rank"
            + hint
        )
    return torch.device("cuda", local_rank)


def cuda_missing() -> str:
    """Why no CUDA device is usable here, in one phrase."""
    import torch

    if torch.version.cuda is None:
        return f"this torch ({torch.__version__}) is a CPU build, without CUDA"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    hidden = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
    return (
        f"torch {torch.__version__} is built for CUDA {torch.version.cuda} but sees no GPU{hidden}: "
        "no NVIDIA driver or device"
    )


FLOAT_DTYPES = ("float32", "bfloat16", "float16")


def auto_dtype(
    stored: str | None, device: str = "cpu", quantized: bool = False, platform: Platform | None = None
) -> tuple[str, str]:
    """`--dtype auto`: the fastest correct compute dtype for weights stored in `stored` (a float dtype
    name; None for block-quantized files such as GGUF) on `device`, and why, for the start-up log.

    On CPUs, bf16 where matrix products run in it natively (and for the int8/int4 weight-only
    kernels, which are fast only with bf16 activations); float32 elsewhere, where bf16 is converted in
    software and a bf16 product is several times float32's (docs/BENCHMARKS.md, the AVX2 path). float16 has no fast
    CPU path at all. A float32 checkpoint stays float32 (bf16 would round it)."""
    p = platform or host()
    if str(device).startswith("cuda"):
        if stored in FLOAT_DTYPES:
            return stored, "the checkpoint's dtype"
        return "bfloat16", "block-quantized weights: bf16 compute on CUDA"
    if quantized:
        return "bfloat16", "the int8/int4 kernels are fast with bf16 activations only"
    if stored == "float32":
        return "float32", "the checkpoint's dtype"
    if p.native_bf16_matmul:
        return "bfloat16", f"bf16 matmul is native here ({p.isa})"
    return "float32", f"bf16 matmul is emulated on {p.arch} {p.isa}"


# From this many rows, an int8 product on a CPU without native bf16 matmul is faster as float32 weights
# (dequantized per call) times float32 rows through MKL (the crossover measured on an AVX2 CPU:
# docs/BENCHMARKS.md, the AVX2 path).
INT8_DEQUANTIZE_ROWS = 128


def int8_dequantize_rows(device_type: str = "cpu", platform: Platform | None = None) -> int | None:
    """Rows from which an int8 weight-only product takes the dequantized float32 path (prefill chunks);
    None where the int8 kernel stays fastest (CUDA, CPUs with native bf16 matmul)."""
    if device_type != "cpu" or (platform or host()).native_bf16_matmul:
        return None
    return INT8_DEQUANTIZE_ROWS


# From this many rows, a bf16 product on a CPU where oneDNN has no bf16 path (aten converts to float32 in
# software) is faster on the weights upcast to float32 per call, a block at a time, through BLAS (the
# crossover measured on an AVX2 CPU: docs/BENCHMARKS.md, the AVX2 path); below, the bf16 product (half
# the bytes read) wins.
BF16_UPCAST_ROWS = 16


def bf16_upcast_rows(device_type: str = "cpu", platform: Platform | None = None) -> int | None:
    """Rows from which a bf16 dense product takes the float32 path; None where bf16 has a real kernel
    (CUDA, CPUs whose oneDNN has a bf16 path)."""
    if device_type != "cpu" or (platform or host()).onednn_bf16:
        return None
    return BF16_UPCAST_ROWS


def dense_linear_backend(dtype: torch.dtype, device_type: str = "cpu", platform: Platform | None = None) -> str:
    """What runs a plain `nn.Linear` of `dtype` here, as the start-up log names it."""
    import torch

    if device_type == "cuda":
        return "cuBLAS"
    p = platform or host()
    if dtype == torch.float32:
        return "MKL sgemm" if torch.backends.mkl.is_available() else "aten sgemm"
    if dtype == torch.bfloat16 and p.onednn_bf16:
        return "oneDNN bf16" + ("" if p.native_bf16_matmul else " (no native bf16 matmul)")
    return "aten, emulated in float32 (no native path on this CPU)"
