"""keel's C++ CPU kernels (src/keel/kernels/csrc), built by this file at install.

The metadata lives in pyproject.toml; this file only adds the extension. torch's headers and its
BuildExtension come from the environment being installed into, so the install runs without build
isolation (`pip install --no-build-isolation -e .`, as the Makefile does): an isolated build would
resolve a torch of its own, a multi-GB CUDA build on these machines.
"""

import importlib.util
import os
import platform
import sys

from setuptools import setup

try:
    from torch.utils.cpp_extension import BuildExtension, CppExtension
except ImportError:
    sys.exit(
        "keel builds its C++ kernels against the installed torch: install torch first (pip install torch==2.13.0), "
        "then pip install --no-build-isolation -e ."
    )

CSRC = os.path.join("src", "keel", "kernels", "csrc")
SOURCES = sorted(os.path.join(CSRC, f) for f in os.listdir(CSRC) if f.endswith(".cpp"))
HEADERS = sorted(os.path.join(CSRC, f) for f in os.listdir(CSRC) if f.endswith(".h"))  # a change rebuilds all

# -fopenmp: ATen's parallel_for is OpenMP in torch's CPU wheels, and its header runs serially without it;
# the library links libgomp.so.1, which resolves to the copy torch has already loaded.
# No -march: the library must run on any CPU of its architecture; the ISA-specific units raise their own
# level (block_gemm_avx2.cpp) and run only when keel.platform reports that level.
# TORCH_ASSERT_ONLY_METHOD_OPERATORS: the units include ATen's tensor class and the ops they call
# (ATen/ops/*.h), not ATen/ATen.h, whose every-operator header cost each unit seconds; the macro turns an
# include of it into an error.
COMPILE_ARGS = [
    "-O3",
    "-fopenmp",
    "-fno-math-errno",
    "-Wall",
    "-Wno-unknown-pragmas",
    "-DTORCH_ASSERT_ONLY_METHOD_OPERATORS",
]
# -g0: Python's own CFLAGS (sysconfig) ask for debug information, which doubles each unit's compile time at
# install; KEEL_KERNELS_DEBUG=1 keeps it, for gdb.
if os.environ.get("KEEL_KERNELS_DEBUG") != "1":
    COMPILE_ARGS.append("-g0")
# GCC fuses a * b + c into one multiply-add wherever the target has one, and every aarch64 CPU has it: the
# portable loops' values (a product rounded, then the sum: the torch formulas' roundings) would differ
# there from x86-64's, whose baseline has no FMA. The vector kernels ask for fused ones by name.
if platform.machine() in ("aarch64", "arm64"):
    COMPILE_ARGS.append("-ffp-contract=off")

setup(
    ext_modules=[
        CppExtension(
            "keel.kernels._C",
            SOURCES,
            depends=HEADERS,
            extra_compile_args=COMPILE_ARGS,
            extra_link_args=["-fopenmp"],
        )
    ],
    # ninja (when installed: `pip install ninja`) compiles the units in parallel and only what changed;
    # without it setuptools compiles every unit, one after the other.
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=importlib.util.find_spec("ninja") is not None)},
)
