"""Speculative decoding: n-gram drafting against plain decoding on copy-heavy prompts, batch 1 and 32.

    python bench/speculative.py [MODEL] [--threads 2] [--dtype bfloat16] [--k 4] [--max-tokens 160]

Workload: chat prompts whose answers copy from the prompt (edit a function and return it whole;
summarise a passage quoting it; fix one word of a paragraph and rewrite it). Batch 1: each prompt
alone, plain then speculative, in alternation; tok/s = generated tokens / wall time of the request
(prefill included, the same for both); greedy outputs must be identical (the script checks). Batch 32:
32 requests (the prompts with varied instructions) submitted at once, output tok/s of the whole run,
plain vs speculation forced on vs the default rule (speculation off above disable_by_batch_size
running requests). `--sweep` times one forward over T packed tokens of T sequences, the cost a
verification of B requests x (k + 1) tokens pays, to show where the step stops being bound by
streaming the weights.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

FUNCTION = '''def moving_average(values, window):
    """Average of each run of `window` consecutive values."""
    if window <= 0:
        raise ValueError("window must be positive")
    total = sum(values[:window])
    averages = [total / window]
    for i in range(window, len(values)):
        total += values[i] - values[i - window]
        averages.append(total / window)
    return averages


def normalise(values):
    lowest, highest = min(values), max(values)
    span = highest - lowest
    return [(v - lowest) / span for v in values]
'''

PASSAGE = (
    "The lighthouse at the end of the harbour was built in 1843 by the town's fishermen, who paid for it "
    "with a tax on every barrel of herring landed at the quay. Its lamp burned whale oil until 1880, when "
    "paraffin replaced it, and electricity arrived only in 1931. The keeper lived in the small stone house "
    "beside the tower and climbed its ninety-six steps four times every night. In the great storm of 1887 "
    "the light stayed lit for three days while the sea broke over the gallery. Today the tower is a museum, "
    "and the lamp is switched on once a year, on the anniversary of that storm."
)

PROMPTS = [
    f"Rename the variable `total` to `running_sum` in this code and return the complete code:\n\n{FUNCTION}",
    f"Summarise this passage in three sentences, quoting its exact words where you can:\n\n{PASSAGE}",
    f"Rewrite this paragraph exactly, changing only 'paraffin' to 'kerosene':\n\n{PASSAGE}",
    f"Add a docstring to the function `normalise` and return the complete code:\n\n{FUNCTION}",
]


def run_batch(engine, prompts: list[list[int]], max_tokens: int) -> tuple[dict[str, list[int]], float, int]:
    from keel.serve import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(p, params, request_id=f"r{engine.num_prompt_tokens}-{i}")
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id.split("-")[1]] = out.outputs[0].token_ids
    wall = time.perf_counter() - start
    return outputs, wall, sum(len(t) for t in outputs.values())


def sweep(loaded, threads: int) -> None:
    """One forward over T single-token rows of T sequences (context 256 each), T = 1 .. 128."""
    from keel.serve.kv_cache import PagedKVCache
    from keel.serve.runner import Chunk, forward_step, pack_step

    model = loaded.model
    bs, context = 16, 256
    print(f"forward over T packed tokens (T sequences, context {context}), {threads} threads:")
    print(f"{'T':>5} {'ms':>8} {'ms / T=1':>9}")
    base = None
    for t in (1, 2, 4, 8, 16, 32, 64, 128):
        nb = context // bs + 1
        cache = PagedKVCache(model.config, t * nb, bs, model.dtype)
        chunks = [Chunk(list(range(i * nb, (i + 1) * nb)), context, [1]) for i in range(t)]
        step = pack_step(chunks, bs, model.device)
        forward_step(model, cache, step)
        times = []
        for _ in range(5):
            start = time.perf_counter()
            forward_step(model, cache, step)
            times.append(time.perf_counter() - start)
        ms = 1000 * statistics.median(times)
        base = base or ms
        print(f"{t:5d} {ms:8.1f} {ms / base:9.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="smollm2-135m-instruct")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--sweep", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from keel.quant.loading import load_model
    from keel.serve import EngineConfig, LLMEngine

    loaded = load_model(args.model, args.dtype)
    print(f"command: python bench/{Path(__file__).name} {shlex.join(sys.argv[1:])}")
    if args.sweep:
        sweep(loaded, args.threads)
        return
    tok = loaded.tokenizer
    prompts = [tok.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    base = dict(kv_cache_memory="1GiB", max_model_len=2048)
    spec = {"method": "ngram", "num_speculative_tokens": args.k}
    plain = LLMEngine(loaded, EngineConfig.of(**base))
    fast = LLMEngine(loaded, EngineConfig.of(**base, speculative_config=spec))
    run_batch(plain, prompts[:1], 8)  # warm-up
    run_batch(fast, prompts[:1], 8)

    print(
        f"model {args.model}, {args.dtype}, {args.threads} threads, n-gram k={args.k}, greedy, "
        f"max_tokens {args.max_tokens}, median of {args.repeats}"
    )
    print("batch 1:")
    print(
        f"{'prompt':<8} {'tokens':>6} {'plain tok/s':>11} {'spec tok/s':>10} {'speedup':>8} {'accepted':>9} "
        f"{'identical':>9}"
    )
    speedups = []
    for i, prompt in enumerate(prompts):
        plain_runs, fast_runs = [], []
        for _ in range(args.repeats):
            want, wall, n = run_batch(plain, [prompt], args.max_tokens)
            plain_runs.append(n / wall)
            before = (fast.spec_num_accepted_tokens, fast.spec_num_draft_tokens)
            got, wall, n = run_batch(fast, [prompt], args.max_tokens)
            fast_runs.append(n / wall)
        accepted = fast.spec_num_accepted_tokens - before[0]
        drafted = fast.spec_num_draft_tokens - before[1]
        p, f = statistics.median(plain_runs), statistics.median(fast_runs)
        speedups.append(f / p)
        same = got == want
        print(f"{i:<8} {n:6d} {p:11.1f} {f:10.1f} {f / p:7.2f}x {accepted:>4}/{drafted:<4} {str(same):>9}")
        if not same:
            print("  outputs differ!")
    print(f"batch-1 speedup, geometric mean: {statistics.geometric_mean(speedups):.2f}x")

    batch = [prompts[i % len(prompts)] + [] for i in range(args.batch)]
    forced = LLMEngine(loaded, EngineConfig.of(**base, speculative_config={**spec, "disable_by_batch_size": 10**6}))
    print(f"batch {args.batch} (output tok/s of the whole run):")
    rows = []
    for name, engine in (("plain", plain), ("spec forced on", forced), ("spec default rule", fast)):
        _, wall, n = run_batch(engine, batch, args.max_tokens)
        rows.append((name, n / wall))
    for name, tps in rows:
        print(f"  {name:<18} {tps:8.1f} tok/s  {tps / rows[0][1]:.2f}x")


if __name__ == "__main__":
    main()
