"""Decode throughput by batch size through the engine, beside the planner's roofline for this machine.

For B in 1, 8, 32, 64 sequences decoding together (32-token prompts, greedy, EOS ignored): the
engine's decode tok/s (all sequences) over `--steps` steps after the prefill and a warm-up, and
keel.plan.serve.decode_roofline's prediction for the same model, batch and context, with this
machine described the way the planner describes a GPU: the copy bandwidth and the bf16 (or float32)
matmul peak measured in the same run (keel.profile.roofline.copy_bandwidth,
keel.train.metrics.measure_cpu_peak), mfu 1 (the measured peak is already what a matmul reaches).
The roofline says where decode turns from reading weights (bandwidth-bound) to multiplying them
(compute-bound); the measured column says how far the kernels are from it.

    python bench/decode_batch.py smollm2-135m-instruct --dtype bfloat16
"""

from __future__ import annotations

import argparse
import time

import torch

from keel.plan.hardware import GPU
from keel.plan.serve import decode_roofline
from keel.profile.roofline import copy_bandwidth
from keel.serve.engine import EngineConfig, LLMEngine
from keel.serve.sampling import SamplingParams
from keel.train.metrics import measure_cpu_peak


def engine_decode_tps(engine: LLMEngine, batch: int, prompt_tokens: int, steps: int, warmup: int = 4) -> float:
    params = SamplingParams(max_tokens=steps + warmup + 2, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request([(7 * i + j) % 1000 + 100 for j in range(prompt_tokens)], params)
    for _ in range(warmup + 1):  # the prefill of every prompt (one step), then warm-up decodes
        engine.step()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    elapsed = time.perf_counter() - start
    while engine.has_unfinished_requests():
        engine.step()
    return batch * steps / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--batches", default="1,8,32,64")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-compile", action="store_true", help="eager decode steps (default: the engine's choice)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    bandwidth = copy_bandwidth()
    peak = measure_cpu_peak(dtype)
    machine = GPU("this CPU", 24e9, peak, None, bandwidth, bandwidth)
    blocks = max(batches) * (-(-(args.prompt_tokens + args.steps + 8) // 16) + 1) + 8
    config = EngineConfig.of(
        dtype=args.dtype,
        quantize="none",  # float weights, as the roofline counts them (a GGUF file's blocks expanded)
        num_blocks=blocks,
        enable_prefix_caching=False,
        max_model_len=args.prompt_tokens + args.steps + 64,
        max_num_seqs=max(batches),
        compile=False if args.no_compile else None,
    )
    engine = LLMEngine(args.model, config)
    config = engine.model.config
    weights = "bf16" if args.dtype == "bfloat16" else "fp32"
    print(
        f"{args.model} {args.dtype}, {args.threads} threads; copy bandwidth {bandwidth / 1e9:.1f} GB/s, "
        f"{args.dtype} matmul peak {peak / 1e9:.0f} GFLOP/s (measured); "
        f"context {args.prompt_tokens}+{args.steps}"
    )
    print(f"{'batch':>5} {'measured tok/s':>14} {'roofline tok/s':>14} {'measured/roofline':>17}  roofline bound")
    for batch in batches:
        measured = engine_decode_tps(engine, batch, args.prompt_tokens, args.steps)
        ms, compute_bound = decode_roofline(
            config, machine, batch, args.prompt_tokens + args.steps // 2, weights=weights, kv_dtype=weights, mfu=1.0
        )
        predicted = batch * 1000 / ms
        print(
            f"{batch:5d} {measured:14.1f} {predicted:14.1f} {measured / predicted:17.1%}  "
            f"{'compute' if compute_bound else 'bandwidth'}",
            flush=True,
        )


if __name__ == "__main__":
    main()
