"""Parallel serving, measured: per-rank memory and offline tok/s of tp x pp layouts (issue 11).

    python bench/tp_serve.py [--model smollm2-135m-instruct] [--layouts 1x1,3x1,1x2] [--dtype bfloat16]

Every layout serves the same requests (random prompt ids of 64-256 tokens, `--max-tokens` greedy
tokens each, EOS ignored) through keel.LLM; layouts with more than one rank run worker processes
(keel.serve.parallel). Reported per rank: weight bytes as loaded, KV-cache bytes per token, peak
resident memory while loading (VmHWM; the single process's includes everything it loaded). Then
output tok/s and the ratio to the 1x1 layout. Decode is eager everywhere (workers do not compile),
so the comparison is like for like. On a CPU the ranks share the same cores: no speed-up is expected;
the figures say what the communication costs.
"""

from __future__ import annotations

import argparse
import os
import random
import time

import torch


def parse_layouts(text: str) -> list[tuple[int, int]]:
    return [tuple(int(x) for x in item.split("x")) for item in text.split(",")]  # type: ignore[misc]


def vm_hwm() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def run(args: argparse.Namespace, tp: int, pp: int, prompts: list[list[int]]) -> dict:
    from keel.model.kv_size import kv_cache_bytes
    from keel.serve import LLM, EngineConfig, SamplingParams

    config = EngineConfig.of(
        kv_cache_memory=args.kv_cache_memory,
        max_model_len=1024,
        compile=False,
        dtype=args.dtype,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
    )
    started = time.perf_counter()
    llm = LLM(args.model, config)
    startup = time.perf_counter() - started
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
        llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up
        started = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - started
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        engine = llm.engine
        if engine.executor is None:  # weights as loaded (pre-packing re-stores them as buffers): from the shapes
            from keel.model.transformer import Transformer

            model = engine.model
            with torch.device("meta"):
                shapes = Transformer(model.config).parameters()  # a tied head counted once
            weights = sum(p.numel() for p in shapes) * model.dtype.itemsize
            ranks = [
                dict(rank=0, weights=weights, kv_per_token=kv_cache_bytes(model.config, model.dtype), peak=vm_hwm())
            ]
        else:
            block = engine.config.cache.block_size
            ranks = [
                dict(
                    rank=r.rank,
                    weights=r.weight_bytes,
                    kv_per_token=r.kv_bytes // (r.num_blocks * block),
                    peak=r.peak_at_load,
                )
                for r in sorted(engine.executor.reports.values(), key=lambda r: r.rank)
            ]
        return dict(
            tp=tp,
            pp=pp,
            startup=startup,
            seconds=seconds,
            tokens=tokens,
            tok_s=tokens / seconds,
            ranks=ranks,
            outputs=[o.outputs[0].token_ids for o in outs],
        )
    finally:
        llm.engine.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--layouts", default="1x1,3x1,1x2", help="tp x pp, comma-separated")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--kv-cache-memory", default="256MiB", help="per rank")
    p.add_argument("--threads", type=int, default=2, help="torch threads of the single process")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randint(64, 256))] for _ in range(args.num_requests)]
    print(
        f"{args.model}, {args.dtype}, {args.num_requests} requests x {args.max_tokens} tokens, "
        f"{os.cpu_count()} cores; single process {args.threads} threads, workers share the cores"
    )
    results = [run(args, tp, pp, prompts) for tp, pp in parse_layouts(args.layouts)]
    base = results[0]
    print(f"{'tp x pp':>7} {'rank':>4} {'weights MiB':>12} {'KV B/token':>11} {'peak at load MiB':>17}")
    for res in results:
        for rank in res["ranks"]:
            print(
                f"{res['tp']:>3} x {res['pp']:<1} {rank['rank']:>4} {rank['weights'] / 2**20:>12.2f} "
                f"{rank['kv_per_token']:>11,} {rank['peak'] / 2**20:>17.1f}"
            )
    print(
        f"\n{'tp x pp':>7} {'start s':>8} {'tokens':>7} {'seconds':>8} {'tok/s':>7} {'vs 1x1':>7} {'same tokens':>12}"
    )
    for res in results:
        same = "yes" if res["outputs"] == base["outputs"] else "no"
        print(
            f"{res['tp']:>3} x {res['pp']:<1} {res['startup']:>8.1f} {res['tokens']:>7} {res['seconds']:>8.1f} "
            f"{res['tok_s']:>7.1f} {res['tok_s'] / base['tok_s']:>6.2f}x {same:>12}"
        )


if __name__ == "__main__":
    main()
