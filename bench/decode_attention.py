"""Decode attention alone: keel's paged-attention kernel against the gather-and-matmul path, beside the
time to stream the same K/V bytes once.

    python bench/decode_attention.py [--sequences 64] [--tokens 320] [--threads 2] [--softcap 50]

SmolLM2-135M's attention shape (9 query heads over 3 KV heads of 64 channels), blocks of 16 tokens,
every sequence's blocks scattered over the store (a shuffled block table, as a long-running server
has them). One layer's decode step: each sequence's one query over its --tokens positions. "stream"
is the K/V bytes of those positions over the copy bandwidth measured in the same run
(keel.profile.roofline: bytes read + written per second of a large copy); the floor is kernel time
<= 1.5x stream time. --softcap caps the scores as Gemma 2 does (its attn_logit_softcapping is 50), in both
paths: the gather path is what a capped model ran on CPU before keel's kernel took the cap.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

import torch

from keel import kernels
from keel.platform import host
from keel.profile.roofline import copy_bandwidth
from keel.serve.kv_cache import attend_decode_rows, decode_mask, gather_blocks

HEADS, KV_HEADS, DIM, BLOCK = 9, 3, 64, 16


def best_of(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=320)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--softcap", type=float, default=0.0, help="attention-score soft-cap (0: none)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not kernels.enabled():
        raise SystemExit(f"keel kernels: {kernels.status()}")
    per_seq = -(-args.tokens // BLOCK)
    blocks = args.sequences * per_seq + 8
    g = torch.Generator().manual_seed(0)
    tables = torch.randperm(blocks, generator=g)[: args.sequences * per_seq].view(args.sequences, per_seq)
    positions = torch.full((args.sequences,), args.tokens - 1)
    q = torch.randn(args.sequences, HEADS, DIM, generator=g)
    bandwidth = copy_bandwidth()
    print(f"command: python bench/{Path(__file__).name} {shlex.join(sys.argv[1:])}")
    print(
        f"{args.sequences} sequences x {args.tokens} tokens, {HEADS} heads / {KV_HEADS} KV heads x {DIM}, blocks of "
        f"{BLOCK}; softcap {args.softcap or 'none'}; {args.threads} threads; copy bandwidth "
        f"{bandwidth / 1e9:.1f} GB/s; platform {host().describe()}"
    )
    header = ("store", "K/V MB", "stream ms", "keel ms", "x stream", "gather ms", "speed-up")
    print(f"{header[0]:<9} " + " ".join(f"{h:>9}" for h in header[1:]))
    for name in ("float32", "bfloat16", "int8"):
        dtype = getattr(torch, name)
        if name == "int8":
            keys = torch.randint(-127, 128, (KV_HEADS, blocks * BLOCK, DIM), generator=g, dtype=torch.int8)
            values = torch.randint_like(keys, -127, 128)
            k_scales = (torch.rand(KV_HEADS, blocks * BLOCK, 1, generator=g) * 0.02).half()
            v_scales = (torch.rand(KV_HEADS, blocks * BLOCK, 1, generator=g) * 0.02).half()
        else:
            keys = torch.randn(KV_HEADS, blocks * BLOCK, DIM, generator=g).to(dtype)
            values = torch.randn(KV_HEADS, blocks * BLOCK, DIM, generator=g).to(dtype)
            k_scales = v_scales = None
        table32 = tables.int()
        in_place = best_of(
            lambda k=keys, v=values, ks=k_scales, vs=v_scales, t=table32: torch.ops.keel.paged_attention(
                q, k, v, ks, vs, t, None, positions, BLOCK, 0, DIM**-0.5, DIM, args.softcap
            ),
            args.repeats,
        )
        kv_bytes = 2 * KV_HEADS * args.sequences * args.tokens * DIM * keys.element_size()
        stream = kv_bytes / bandwidth
        gather = "-"
        if k_scales is None:
            mask = decode_mask(positions, per_seq * BLOCK, None)
            rows = q.transpose(0, 1).to(dtype)

            def gathered(k=keys, v=values, rows=rows, mask=mask) -> torch.Tensor:
                return attend_decode_rows(
                    rows,
                    gather_blocks(k, tables, BLOCK),
                    gather_blocks(v, tables, BLOCK),
                    mask,
                    DIM**-0.5,
                    args.softcap or None,
                )

            gather_s = best_of(gathered, args.repeats)
            gather = f"{gather_s * 1e3:10.2f} {gather_s / in_place:8.1f}x"
        print(
            f"{name:<9} {kv_bytes / 1e6:7.1f} {stream * 1e3:10.2f} {in_place * 1e3:8.2f} {in_place / stream:8.2f}x "
            f"{gather}"
        )


if __name__ == "__main__":
    main()
