"""Prefix caching: TTFT with a cached shared prefix, and what caching costs when nothing hits.

    python bench/prefix.py MODEL [--dtype float32|bfloat16] [--threads 2] [--num-requests 64]

1. TTFT cold vs warm. --num-requests requests share a --prefix-tokens system prompt (random ids,
   fixed seed) followed by a unique suffix of --suffix-min..--suffix-max tokens, --max-tokens
   generated (greedy, EOS ignored). Cold = TTFT of a request on an empty cache, run alone (the
   first request of the shared prefix, plus --cold-repeats - 1 more, each with a prefix of its
   own, so each is cold; the median is reported). Warm = median TTFT of the other requests,
   submitted one at a time after the prefix is cached. TTFT = time of the first generated token
   - time the request was added (`RequestOutput.metrics.ttft`). The engine is warmed up first on
   an unrelated prompt so that "cold" measures the cache, not first-call costs.
2. Cost at a 0% hit rate. --unique-requests requests with fully unique prompts of
   --unique-tokens tokens, all submitted at once, on an engine with `enable_prefix_caching=True`
   and one with False (same weights), in alternation, --repeats times each, fresh prompts every
   repeat (so the cached engine never hits). Throughput = (prompt + output tokens) / wall time;
   medians. The time spent inside the prefix-cache bookkeeping (`find_prefix`, `commit`) is
   also measured directly, a figure that the machine's noise does not blur.
"""

from __future__ import annotations

import argparse
import gc
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch


def random_ids(n: int, vocab: int, g: torch.Generator) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def run_alone(engine, prompt: list[int], max_tokens: int):
    """Add one request, step until it finishes; its final RequestOutput."""
    from keel.serve import SamplingParams

    rid = engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == rid and out.finished:
                final = out
    return final


class _Timed:
    """Wraps a bound method, accumulating the seconds spent in it."""

    def __init__(self, fn) -> None:
        self.fn, self.seconds = fn, 0.0

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - start


def throughput_run(engine, prompts: list[list[int]], max_tokens: int) -> tuple[float, float, int]:
    """All prompts at once; (tokens/s over prompt + output, bookkeeping seconds, prefix-hit tokens)."""
    from keel.serve import SamplingParams

    kv = engine.kv
    find, commit = _Timed(kv.find_prefix), _Timed(kv.commit)
    kv.find_prefix, kv.commit = find, commit
    hits_before = kv.prefix_hits
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    for p in prompts:
        engine.add_request(p, params)
    generated = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                generated += len(out.outputs[0].token_ids)
    seconds = time.perf_counter() - start
    del kv.find_prefix, kv.commit  # back to the class methods
    assert generated == max_tokens * len(prompts)
    tokens = sum(map(len, prompts)) + generated
    return tokens / seconds, (find.seconds + commit.seconds) / seconds, kv.prefix_hits - hits_before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="catalog name, GGUF file or HF directory")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prefix-tokens", type=int, default=1024)
    parser.add_argument("--suffix-min", type=int, default=16)
    parser.add_argument("--suffix-max", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--cold-repeats", type=int, default=3)
    parser.add_argument("--unique-requests", type=int, default=64)
    parser.add_argument("--unique-tokens", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kv-cache-memory", default="4GiB")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-num-seqs", type=int, default=128)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"command: python bench/{Path(__file__).name} {shlex.join(sys.argv[1:])}", flush=True)

    from keel.quant.loading import load_model
    from keel.serve import EngineConfig, LLMEngine

    loaded = load_model(args.model, args.dtype)
    vocab = loaded.model.config.vocab_size
    g = torch.Generator().manual_seed(args.seed)

    def engine(caching: bool) -> LLMEngine:
        config = EngineConfig.of(
            block_size=args.block_size,
            kv_cache_memory=args.kv_cache_memory,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=args.max_num_seqs,
            enable_prefix_caching=caching,
        )
        return LLMEngine(loaded, config)

    print(
        f"model {args.model}, {args.dtype}, {args.threads} threads, block size {args.block_size}, "
        f"max_num_batched_tokens {args.max_num_batched_tokens}",
        flush=True,
    )

    # ---------------------------------------------------------------- TTFT
    cached = engine(True)
    run_alone(cached, random_ids(64, vocab, g), 4)  # warm-up: first-call costs, not the cache
    prefix = random_ids(args.prefix_tokens, vocab, g)

    def suffix() -> list[int]:
        n = int(torch.randint(args.suffix_min, args.suffix_max + 1, (1,), generator=g))
        return random_ids(n, vocab, g)

    colds = []
    first = run_alone(cached, prefix + suffix(), args.max_tokens)
    assert first.num_cached_tokens == 0
    colds.append(first.metrics.ttft)
    for _ in range(args.cold_repeats - 1):  # other prefixes, each cold too
        out = run_alone(cached, random_ids(args.prefix_tokens, vocab, g) + suffix(), args.max_tokens)
        assert out.num_cached_tokens == 0
        colds.append(out.metrics.ttft)
    warms, cached_tokens = [], set()
    for _ in range(args.num_requests - 1):
        out = run_alone(cached, prefix + suffix(), args.max_tokens)
        warms.append(out.metrics.ttft)
        cached_tokens.add(out.num_cached_tokens)
    del cached
    gc.collect()
    cold, warm = statistics.median(colds), statistics.median(warms)
    print(
        f"\nTTFT, {args.prefix_tokens}-token shared prefix + {args.suffix_min}-{args.suffix_max}-token suffix, "
        f"{args.max_tokens} output tokens, one request at a time"
    )
    print(f"{'measure':<44} {'requests':>8} {'TTFT ms':>9} {'/ cold':>7}")
    print(f"{'cold (empty cache), first request':<44} {1:>8} {colds[0] * 1e3:>9.1f} {colds[0] / cold:>6.2f}x")
    print(f"{'cold (empty cache), median':<44} {len(colds):>8} {cold * 1e3:>9.1f} {1:>6.2f}x")
    print(f"{'warm (prefix cached), median':<44} {len(warms):>8} {warm * 1e3:>9.1f} {warm / cold:>6.2f}x")
    print(
        f"{'warm, p90':<44} {len(warms):>8} "
        f"{statistics.quantiles(warms, n=10)[-1] * 1e3:>9.1f} {statistics.quantiles(warms, n=10)[-1] / cold:>6.2f}x"
    )
    print(f"prefix tokens served from the cache per warm request: {sorted(cached_tokens)}")
    verdict = "met" if warm <= 0.2 * cold else "NOT met"
    print(f"floor warm <= 0.2x cold: {warm / cold:.3f}x, {verdict}", flush=True)

    # ---------------------------------------------------- cost at 0% hits
    engines = {True: engine(True), False: engine(False)}
    rates: dict[bool, list[float]] = {True: [], False: []}
    overheads, hits = [], 0
    for rep in range(args.repeats):
        prompts = [random_ids(args.unique_tokens, vocab, g) for _ in range(args.unique_requests)]
        for caching in (True, False) if rep % 2 == 0 else (False, True):
            rate, overhead, hit = throughput_run(engines[caching], prompts, args.max_tokens)
            rates[caching].append(rate)
            if caching:
                overheads.append(overhead)
                hits += hit
            print(f"  repeat {rep}, prefix caching {'on ' if caching else 'off'}: {rate:.1f} tok/s", flush=True)
    on, off = statistics.median(rates[True]), statistics.median(rates[False])
    cost = 1 - on / off
    print(
        f"\nCost of prefix caching at a 0% hit rate: {args.unique_requests} unique {args.unique_tokens}-token "
        f"prompts + {args.max_tokens} output tokens each, all at once, median of {args.repeats} alternating runs"
    )
    print(f"{'engine':<32} {'(prompt+output) tok/s':>22} {'/ off':>7}")
    print(f"{'enable_prefix_caching=False':<32} {off:>22.1f} {1:>6.3f}x")
    print(f"{'enable_prefix_caching=True':<32} {on:>22.1f} {on / off:>6.3f}x")
    print(f"prefix-cache hits during these runs: {hits} tokens (0% hit rate: {hits == 0})")
    print(
        f"time inside find_prefix + commit with caching on: {100 * statistics.median(overheads):.2f}% of the run "
        f"(runs: {', '.join(f'{100 * o:.2f}%' for o in overheads)})"
    )
    verdict = "met" if cost <= 0.03 else "NOT met"
    print(f"floor cost <= 3%: {100 * cost:+.1f}% (throughput lost with caching on), {verdict}")


if __name__ == "__main__":
    main()
