"""Prefill and batched decode by compute path through the engine: float32, bf16 as the host prepares
it (pre-packed for oneDNN, or `UpcastLinear` where oneDNN has no bf16 path), and bf16 through plain
`nn.Linear` (`prepack_weights=False`: aten's own product, emulated in float32 on AVX2), side by side.

    python bench/cpu_paths.py [MODEL] [--threads 2] [--prompt-tokens 512] [--batches 1,4,8,16]

Prefill tok/s: one prompt of --prompt-tokens tokens, the engine's first step (median of 3, after a
warm-up). Decode tok/s: all sequences of a batch, over --steps steps after the prefill and a warm-up
(bench/decode_batch.py's measure), eager steps. The table ends with the platform and each path's
linear backends as the engine's start-up line names them.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from decode_batch import engine_decode_tps  # noqa: E402
from keel.platform import host  # noqa: E402
from keel.serve.backends import linear_backends  # noqa: E402
from keel.serve.engine import EngineConfig, LLMEngine  # noqa: E402
from keel.serve.sampling import SamplingParams  # noqa: E402

PATHS = {"float32": ("float32", True), "bfloat16": ("bfloat16", True), "bfloat16 plain": ("bfloat16", False)}


def prefill_tps(engine: LLMEngine, prompt_tokens: int, repeats: int = 3) -> float:
    prompt = [(11 * j) % 1000 + 100 for j in range(prompt_tokens)]
    times = []
    for _ in range(repeats + 1):  # the first is a warm-up
        engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        times.append(time.perf_counter() - start)
    return prompt_tokens / statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="smollm2-135m-instruct")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--batches", default="1,4,8,16")
    parser.add_argument("--steps", type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    print(f"model {args.model}, {args.threads} threads, platform {host().describe()}")
    print(f"{'path':16s} {'prefill tok/s':>14s} " + " ".join(f"{f'decode b={b}':>12s}" for b in batches))
    backends = {}
    blocks = max(batches) * 8 + args.prompt_tokens // 16 + 8
    for name, (dtype, prepare) in PATHS.items():
        config = EngineConfig.of(
            dtype=dtype,
            quantize="none",  # the float paths, also for a GGUF file (whose blocks --quantize auto would run)
            prepack_weights=prepare,
            compile=False,
            enable_prefix_caching=False,
            num_blocks=blocks,
            max_model_len=1024,
        )
        engine = LLMEngine(args.model, config)
        backends[name] = linear_backends(engine.model)
        prefill = prefill_tps(engine, args.prompt_tokens)
        decode = [engine_decode_tps(engine, b, 32, args.steps) for b in batches]
        print(f"{name:16s} {prefill:14.1f} " + " ".join(f"{d:12.1f}" for d in decode), flush=True)
    for name, text in backends.items():
        print(f"  {name}: {text}")


if __name__ == "__main__":
    main()
