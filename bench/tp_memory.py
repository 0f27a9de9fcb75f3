"""Per-rank weight and KV-cache memory of tensor-parallel serving (issue 11).

    python bench/tp_memory.py [--model smollm2-135m-instruct] [--tp 1,3] [--dtype bfloat16]

For each TP size, every rank's model is cut with keel.serve.parallel.tensor.shard_model (no
process group is needed to cut, only to run) and its parameter bytes are summed; KV bytes per
token per rank follow from the rank's KV heads (split, or replicated when there are fewer KV heads
than ranks). Compared with the full model: the sharded parameters divide by TP, the replicated ones
(norms) do not.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses

import torch

from keel.errors import KeelError
from keel.model.kv_size import kv_cache_bytes
from keel.quant.loading import load_model
from keel.serve.parallel.tensor import shard_model
from keel.weights.shard import TensorParallelLayout


def param_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())  # tied weights counted once


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--tp", default="1,3", help="comma-separated tensor-parallel sizes")
    p.add_argument("--dtype", default="bfloat16")
    args = p.parse_args()
    loaded = load_model(args.model, args.dtype)
    config, dtype = loaded.config, loaded.model.dtype
    full = param_bytes(loaded.model)
    print(
        f"{args.model} ({args.dtype}): {full / 2**20:.1f} MiB of parameters, "
        f"{kv_cache_bytes(config, dtype)} KV bytes per token"
    )
    print(f"{'tp':>3} {'rank':>4} {'weights MiB':>12} {'x full':>7} {'KV heads':>9} {'KV B/token':>11}")
    for tp in (int(x) for x in args.tp.split(",")):
        for rank in range(tp):
            try:
                layout = TensorParallelLayout(config, tp, rank)
            except KeelError as e:
                print(f"{tp:>3}: {e}")
                break
            model = copy.deepcopy(loaded.model)
            shard_model(model, layout)
            first, last = layout.kv_head_range()
            kv = kv_cache_bytes(dataclasses.replace(config, num_kv_heads=last - first), dtype)
            print(
                f"{tp:>3} {rank:>4} {param_bytes(model) / 2**20:>12.2f} {param_bytes(model) / full:>7.3f} "
                f"{last - first:>9} {kv:>11}"
            )


if __name__ == "__main__":
    main()
