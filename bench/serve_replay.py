"""The serving benchmark's workload replayed offline: the engine `keel serve` builds, stepped directly.

    python bench/serve_replay.py [MODEL] [--num-prompts 64] [--threads 2] [--repeats 1]
        [--temperature 0] [--top-k 0] [--top-p 1] [keel serve options]

The same seeded requests as bench/serve_llamacpp.py (its `build_dataset`), all added at once, greedy
unless sampling is asked for (seeded per request, so a replay draws the same tokens), EOS ignored,
stepped by `LLMEngine.step()` on the thread that built the engine (as the server's engine thread
does) with no HTTP, tokenizer streaming or event loop around it. Prints the whole run, its
prefill phase (the steps until the last prompt is in) and its decode phase, output tok/s, and the
median step of each kind. Why: a server run's figure mixes the engine with the HTTP side and drifts
with the machine; a replay isolates the step, so a change to the engine is measured on the serving
workload's exact steps (and can be profiled: `perf record -g -- python bench/serve_replay.py ...`).
Any `keel serve` engine option is accepted (`--quantize gguf --kv-cache-dtype bfloat16`, ...).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from keel.cli.common import add_model_args
from keel.cli.config_options import add_engine_options, engine_config_from_args
from keel.quant.loading import load_model
from keel.serve.engine import LLMEngine
from keel.serve.heap import freeze_startup_heap
from keel.serve.sampling import RequestOutputKind, SamplingParams

sys.path.insert(0, str(Path(__file__).parent))
from serve_llamacpp import build_dataset  # noqa: E402  (the same workload, seeded the same)

DELTA = RequestOutputKind.DELTA


def replay(engine: LLMEngine, requests: list[dict], sampling: dict) -> dict:
    assert engine.reset_prefix_cache()  # a repeat computes every prompt again, as the first run did
    for i, r in enumerate(requests):
        # DELTA outputs, as the server asks for its streams
        params = SamplingParams(max_tokens=r["output_len"], ignore_eos=True, seed=i, output_kind=DELTA, **sampling)
        engine.add_request(r["prompt"], params, str(i))
    steps: list[tuple[float, bool]] = []  # (seconds, whether a prompt was still waiting or in prefill)
    output_tokens = 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        sched = engine.scheduler
        prefill = bool(sched.waiting) or any(r.num_remaining > 1 for r in sched.running)
        t = time.perf_counter()
        outputs = engine.step()
        steps.append((time.perf_counter() - t, prefill))
        output_tokens += sum(1 for o in outputs if o.outputs and o.outputs[0].token_ids)
    total = time.perf_counter() - start
    prefill_steps = [s for s, p in steps if p]
    decode_steps = [s for s, p in steps if not p]
    return {
        "seconds": total,
        "prefill_s": sum(prefill_steps),
        "decode_s": sum(decode_steps),
        "steps": len(steps),
        "prefill_step_ms": 1000 * statistics.median(prefill_steps) if prefill_steps else 0.0,
        "decode_step_ms": 1000 * statistics.median(decode_steps) if decode_steps else 0.0,
        "output_tokens": output_tokens,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser)
    add_engine_options(parser)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=1, help="replays on one engine, prefix cache reset before each")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    if len(sys.argv) == 1 or sys.argv[1].startswith("-"):
        sys.argv.insert(1, "smollm2-135m-instruct")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config = engine_config_from_args(args)
    loaded = load_model(args.model, config.load.dtype, **config.quant.load_options())
    engine = LLMEngine(loaded, config, adapt=True)
    freeze_startup_heap()  # as `keel serve` does once its engine is built
    with tempfile.TemporaryDirectory() as tmp:
        dataset = Path(tmp) / "requests.jsonl"
        build_dataset(args.model, dataset, args.num_prompts, args.seed)
        requests = [json.loads(line) for line in dataset.read_text().splitlines()]
    print(
        f"{len(requests)} requests, {sum(r['output_len'] for r in requests)} output tokens, "
        f"{torch.get_num_threads()} threads; temperature {args.temperature}, top-k {args.top_k}, top-p {args.top_p}"
    )
    sampling = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    print("run | seconds | prefill phase s | decode phase s | steps | prefill step ms | decode step ms | output tok/s")
    for i in range(args.repeats):
        r = replay(engine, requests, sampling)
        print(
            f"{i} | {r['seconds']:.2f} | {r['prefill_s']:.2f} | {r['decode_s']:.2f} | {r['steps']} | "
            f"{r['prefill_step_ms']:.1f} | {r['decode_step_ms']:.1f} | {r['output_tokens'] / r['seconds']:.1f}"
        )


if __name__ == "__main__":
    main()
