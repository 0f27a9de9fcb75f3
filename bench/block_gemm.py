"""keel::block_linear against float32 BLAS on SmolLM2's layer shapes, by activation rows.

    python bench/block_gemm.py [--rows 1,4,16,64,256,512] [--threads 1] [--levels avx2,avx512_vnni]
                               [--shapes 1536x576,576x1536]

For each shape: GOP/s of the 4-bit kernel (one int8 pass, and refined: two), the 8-bit kernel (the
same two), and `x @ W.T` in float32 on the same weights dequantized (2 * M * N * K operations per
product). The kernels are timed at each level named (default: every level above the portable one
that this machine runs, keel.kernels.levels_here), so one run compares them. Times are the calling
thread's CPU time (`time.thread_time`), so a machine shared with other work skews them less than
wall time would; with --threads above 1 use a quiet machine (then wall time is what counts, and
thread time undercounts).

From the VNNI level the weights are also timed in panels of 16 rows (`vnni panels`, `amx panels`:
keel::block_panels, what the serving engine stores there; the `amx` level adds tile products of 16
activation rows at a time to the VNNI kernels, on the panel layout only), and in panels as Q4_0 (the
same codes and scales, mins -8 x the scales, which the VNNI kernel runs as integer offsets from 8 rows).
`Q6_K` is the 8-bit kernel with a scale per 16 values (half-block scales, GGUF Q6_K's form).
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable

import torch

from keel import kernels

PANELS = ("avx2", "avx512_vnni", "amx")  # the levels with a kernel over the panel layout
SHAPES = "1536x576,576x1536"  # gate/up and down of SmolLM2-135M


def cpu_seconds(fn: Callable[[], object], repeats: int = 10) -> float:
    fn()
    start = time.thread_time()
    for _ in range(repeats):
        fn()
    return (time.thread_time() - start) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,4,16,64,256,512")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--levels", default=None, help="comma-separated kernel levels (default: all above scalar)")
    parser.add_argument("--shapes", default=SHAPES, help="comma-separated NxK weight shapes")
    args = parser.parse_args()
    if not kernels.enabled():
        raise SystemExit(f"keel kernels: {kernels.status()}")
    levels = args.levels.split(",") if args.levels else [lv for lv in kernels.levels_here() if lv != "scalar"]
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    for n, k in (tuple(int(v) for v in shape.split("x")) for shape in args.shapes.split(",")):
        codes4 = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
        codes8 = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
        scales = (torch.rand(n, k // 32, generator=g) * 0.01).half()
        mins = (-torch.rand(n, k // 32, generator=g) * 0.08).half()
        weight = torch.ops.keel.block_dequantize(codes4, scales, mins, 4)
        panels4 = torch.ops.keel.block_panels(codes4, scales, mins, 4)
        # Q4_0 (w = (q - 8) d: mins -8 x scales), which the VNNI kernel runs without its mins.
        panels_q4_0 = torch.ops.keel.block_panels(codes4, scales, (-8 * scales.float()).half(), 4)
        panels8 = torch.ops.keel.block_panels(codes8, scales, None, 8)
        half_scales = (torch.rand(n, k // 16, generator=g) * 0.01).half()  # Q6_K: a scale per 16 values
        panels_q6_k = torch.ops.keel.block_panels(codes8, half_scales, None, 8)
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k, generator=g)
            ops = 2 * m * n * k / 1e9
            linear = torch.ops.keel.block_linear
            f32 = cpu_seconds(functools.partial(torch.matmul, x, weight.T))
            # The row layout where a level has its own row kernels; the panel layout from the VNNI level.
            timed = [(level, level, None) for level in levels if level != "amx"]
            timed += [(level, f"{level.removeprefix('avx512_')} panels", 16) for level in levels if level in PANELS]
            for level, label, panel_rows in timed:
                c4, s4, m4 = panels4 if panel_rows else (codes4, scales, mins)
                c8, s8 = panels8 if panel_rows else (codes8, scales)
                c6, s6 = panels_q6_k if panel_rows else (codes8, half_scales)
                rows = panel_rows or 0
                with kernels.using_level(level):
                    q4 = cpu_seconds(functools.partial(linear, x, c4, s4, m4, 4, None, 1, rows))
                    q4x2 = cpu_seconds(functools.partial(linear, x, c4, s4, m4, 4, None, 2, rows))
                    q8 = cpu_seconds(functools.partial(linear, x, c8, s8, None, 8, None, 1, rows))
                    q8x2 = cpu_seconds(functools.partial(linear, x, c8, s8, None, 8, None, 2, rows))
                    q6_k = cpu_seconds(functools.partial(linear, x, c6, s6, None, 8, None, 1, rows))
                    q4_0 = ""
                    if panel_rows:
                        seconds = cpu_seconds(functools.partial(linear, x, *panels_q4_0, 4, None, 1, rows))
                        q4_0 = f"  Q4_0 {ops / seconds:6.1f}"
                print(
                    f"{n}x{k} rows {m:4d} {label:>11}: 4-bit {ops / q4:6.1f}  4-bit refined {ops / q4x2:6.1f}  "
                    f"8-bit {ops / q8:6.1f}  8-bit refined {ops / q8x2:6.1f}  Q6_K {ops / q6_k:6.1f}{q4_0}  "
                    f"float32 BLAS {ops / f32:6.1f}  "
                    f"GOP/s ({args.threads} thread(s))",
                    flush=True,
                )


if __name__ == "__main__":
    main()
