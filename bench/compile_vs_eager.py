"""Decode throughput of the compiled decode step against the eager one, side by side in one run.

    python bench/compile_vs_eager.py [MODEL] [--quantize auto|none|...] [--dtype auto|float32|bfloat16]
                                     [--threads 2] [--batches 1,16] [--tokens 64]

Each engine (eager: `--no-compile`; compiled: `--compile`) generates `--tokens` greedy tokens for each batch
size from 4-token prompts (EOS ignored), best of 3 after a warm-up; the start-up column is the engine's build,
compilation included. The table gives output tok/s and the ratio compiled / eager. Where every decoder layer
runs through keel::decoder_layers (float32 or block weights on keel's CPU kernels), the eager step is that
fused C++ layer and the compiled one runs the modules (keel.serve.compiled_decode.decide_compile).
"""

from __future__ import annotations

import argparse
import time

import torch

from keel.platform import host
from keel.serve import LLM, SamplingParams


def tokens_per_s(llm: LLM, batch: int, tokens: int, repeats: int = 3) -> float:
    params = [SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True) for _ in range(batch)]
    prompts = [[100 + i, 200, 300, 400] for i in range(batch)]
    llm.generate(prompts, params, use_tqdm=False)  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        best = min(best, time.perf_counter() - start)
    return batch * tokens / best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="smollm2-135m-instruct")
    parser.add_argument("--quantize", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    results = {}
    for mode in ("eager", "compiled"):
        start = time.perf_counter()
        llm = LLM(
            args.model,
            quantize=args.quantize,
            dtype=args.dtype,
            compile=mode == "compiled",
            max_model_len=512,
            max_num_seqs=max(batches),
        )
        startup = time.perf_counter() - start
        results[mode] = (startup, [tokens_per_s(llm, b, args.tokens) for b in batches], str(llm.engine.model.dtype))
        del llm
    dtype = results["eager"][2]
    print(f"{args.model}, --quantize {args.quantize}, {dtype}, {args.threads} threads, {host().describe()}")
    print(f"{'':10s} {'start-up s':>10s} " + " ".join(f"{f'b={b} tok/s':>12s}" for b in batches))
    for mode, (startup, rates, _) in results.items():
        print(f"{mode:10s} {startup:10.1f} " + " ".join(f"{r:12.1f}" for r in rates))
    ratios = [c / e for c, e in zip(results["compiled"][1], results["eager"][1], strict=True)]
    print(f"{'compiled/eager':14s} {'':6s} " + " ".join(f"{r:12.2f}" for r in ratios))


if __name__ == "__main__":
    main()
