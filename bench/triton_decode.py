"""Variants of keel's Triton paged decode attention (keel.kernels.triton_paged) at decode shapes, timed side by
side on one CUDA device: keys per iteration (`tile_keys`), float32 products at IEEE precision against bf16
products on the tensor cores (`half_dot`), with the context split (flash-decoding) as the wrapper chooses.

    python bench/triton_decode.py [--out FILE]          # on a GPU (bench/gpu_check.sh runs it)
    TRITON_INTERPRET=1 python bench/triton_decode.py --tiny --device cpu   # the code path, anywhere

Shapes: Llama-3.2-1B's attention (8 KV heads of 64, groups of 4), bf16 stores of 16-token blocks, tables 64
blocks wide (max_model_len 1024), contexts drawn from 200-500 tokens; batches of 1, 16, 64 and 256 one-token
queries. For each variant: microseconds per call (CUDA events, median of 50), the K/V bytes it must read over
that time (GB/s), and its largest difference from the float32 variant's output.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent.parent / "src"))
from keel.kernels import triton_paged  # noqa: E402


def case(batch: int, device: torch.device, tiny: bool) -> tuple:
    gen = torch.Generator().manual_seed(batch)
    kv_heads, group, dim, block, width = (2, 2, 32, 16, 8) if tiny else (8, 4, 64, 16, 64)
    blocks = batch * width + 1
    k = torch.randn(kv_heads, blocks * block, dim, generator=gen).to(device, torch.bfloat16)
    v = torch.randn(kv_heads, blocks * block, dim, generator=gen).to(device, torch.bfloat16)
    tables = (1 + torch.randperm(blocks - 1, generator=gen)[: batch * width]).view(batch, width)
    low, high = (20, 100) if tiny else (200, 500)
    positions = torch.randint(low, high, (batch,), generator=gen)
    queries = torch.randn(batch, kv_heads * group, dim, generator=gen).to(device, torch.bfloat16)
    kv_bytes = int((positions + 1).sum()) * kv_heads * dim * 2 * 2
    return queries, k, v, tables.to(device), positions.to(device), block, kv_bytes


def time_call(fn, device: torch.device, reps: int) -> float:  # noqa: ANN001
    """Median microseconds of one call."""
    for _ in range(3):
        fn()
    if device.type != "cuda":
        return float("nan")
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    batches = (1, 4) if args.tiny else (1, 16, 64, 256)
    variants = [(16, False), (32, False), (64, False), (16, True), (32, True), (64, True)]
    rows = []
    for batch in batches:
        queries, k, v, tables, positions, block, kv_bytes = case(batch, device, args.tiny)
        scale = queries.shape[-1] ** -0.5
        reference = None
        for tile, half in variants:

            def call(tile=tile, half=half, inputs=(queries, k, v, tables, positions, block, scale)):  # noqa: ANN202
                q, keys, values, table, position, size, factor = inputs
                return triton_paged.paged_attention(q, keys, values, table, None, position, size, 0, factor,
                                                    q.shape[-1], tile_keys=tile, half_dot=half)  # fmt: skip

            out = call().float()
            reference = out if reference is None else reference
            micros = time_call(call, device, 5 if args.tiny else 50)
            row = {"batch": batch, "tile_keys": tile, "half_dot": half, "us": micros,
                   "GB_s": kv_bytes / micros / 1e3, "max_diff": float((out - reference).abs().max())}  # fmt: skip
            rows.append(row)
            print(f"batch {batch:4d}  tile {tile:3d}  {'bf16 tensor cores' if half else 'fp32 ieee        '}  "
                  f"{micros:8.1f} us  {row['GB_s']:7.0f} GB/s  max diff {row['max_diff']:.2e}", flush=True)  # fmt: skip
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
