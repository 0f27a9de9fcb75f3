#!/usr/bin/env bash
# keel's aarch64 kernels (NEON, and SDOT's block products) checked on an x86-64 machine: the library
# cross-compiled for aarch64 against an aarch64 torch wheel, then the kernel tests run under qemu's
# user-mode emulation on a Neoverse N1 (every level: portable, NEON, NEON with SDOT; no SVE, whose
# emulation made torch's own float matmuls 16x slower on qemu's `max` CPU), and the level probe on a CPU
# without SDOT (Cortex-A57).
# Correctness only: emulated time says nothing about speed.
#
# Needs (Debian): qemu-user, g++-aarch64-linux-gnu, and an aarch64 CPython 3.11 with torch and keel's
# test dependencies, run through a wrapper:
#   ARM_PYTHON   a command that runs that Python under qemu (default /opt/arm64/python; it honours QEMU_CPU)
#   ARM_ROOT     the aarch64 root holding Python's headers (default /opt/arm64/root: Debian's
#                libpython3.11-dev:arm64, unpacked with dpkg -x)
# docs/ARCHITECTURE.md ("Kernels on aarch64") says how that environment was made.
#
# Usage: bench/aarch64_check.sh [pytest arguments]   (default: the kernel and fused-layer tests)
set -euo pipefail
cd "$(dirname "$0")/.."

ARM_PYTHON=${ARM_PYTHON:-/opt/arm64/python}
ARM_ROOT=${ARM_ROOT:-/opt/arm64/root}
CXX=${ARM_CXX:-aarch64-linux-gnu-g++}
OUT=${ARM_BUILD:-build/aarch64}

torch_dir=$("$ARM_PYTHON" -c 'import os, torch; print(os.path.dirname(torch.__file__))')
abi=$("$ARM_PYTHON" -c 'import torch; print(int(torch._C._GLIBCXX_USE_CXX11_ABI))')
echo "aarch64 torch: $torch_dir (C++11 ABI $abi)"

# The flags setup.py's build gives each unit on aarch64 (torch's CppExtension: C++20, the extension
# defines), no -march.
flags=(-O3 -g0 -std=c++20 -fPIC -fopenmp -fno-math-errno -Wall -Wno-unknown-pragmas -ffp-contract=off
       -DTORCH_ASSERT_ONLY_METHOD_OPERATORS
       "-D_GLIBCXX_USE_CXX11_ABI=$abi" -DTORCH_API_INCLUDE_EXTENSION_H -DTORCH_EXTENSION_NAME=_C
       -isystem "$torch_dir/include" -isystem "$torch_dir/include/torch/csrc/api/include"
       -isystem "$ARM_ROOT/usr/include/python3.11" -idirafter "$ARM_ROOT/usr/include")
mkdir -p "$OUT/keel/kernels"
objects=()
for src in src/keel/kernels/csrc/*.cpp; do
  obj="$OUT/$(basename "${src%.cpp}").o"
  if [[ ! -f "$obj" || "$src" -nt "$obj" || -n "$(find src/keel/kernels/csrc -name '*.h' -newer "$obj")" ]]; then
    echo "  compile $src"
    "$CXX" "${flags[@]}" -c "$src" -o "$obj"
  fi
  objects+=("$obj")
done
lib="$OUT/keel/kernels/_C.cpython-311-aarch64-linux-gnu.so"
"$CXX" -shared -fopenmp "${objects[@]}" -L "$torch_dir/lib" -lc10 -ltorch -ltorch_cpu -o "$lib"
echo "built $lib"

# The source tree's Python with the aarch64 library beside it: a copy of src/keel whose kernels
# directory holds the cross-built module (the x86-64 one stays where it is).
rm -rf "$OUT/src" && mkdir -p "$OUT/src" && cp -r src/keel "$OUT/src/keel"
rm -f "$OUT"/src/keel/kernels/_C.cpython-311-x86_64-linux-gnu.so
cp "$lib" "$OUT/src/keel/kernels/"
# Bytecode compiled here (the same CPython minor version): the emulated interpreter would compile every
# module again on each start, and PYTHONDONTWRITEBYTECODE keeps it from caching them.
python3.11 -m compileall -q "$OUT/src" tests >/dev/null || true

args=("$@")
[[ ${#args[@]} -gt 0 ]] || args=(tests/test_kernels.py tests/test_fused_layer.py)
# A CPU without SDOT (Cortex-A57): the library must report no `neon_dotprod` level. (torch's aarch64 wheel
# itself stops there with an illegal instruction in some of its own kernels, so the tests run on the N1,
# whose every level, plain NEON included, the tests run in turn.)
QEMU_CPU=cortex-a57 PYTHONPATH="$OUT/src" "$ARM_PYTHON" -c '
from keel import kernels
levels = kernels.levels_here()
print("QEMU_CPU=cortex-a57: levels", levels)
assert levels == ("scalar", "neon"), levels'
echo "== QEMU_CPU=neoverse-n1"
QEMU_CPU=neoverse-n1 PYTHONPATH="$OUT/src:tests" "$ARM_PYTHON" -c \
  'from keel import kernels; print("arch", kernels.host().arch, "levels", kernels.levels_here())'
QEMU_CPU=neoverse-n1 PYTHONPATH="$OUT/src:tests" exec "$ARM_PYTHON" -m pytest -q -p no:cacheprovider -p no:xdist -o timeout=3600 "${args[@]}"
