"""Structured outputs' cost per decode step: 32 requests under a JSON schema against the same 32 unconstrained.

    python bench/structured_outputs.py [--batch 32] [--steps 48] [--rounds 3] [--threads 2] [--compile]

Both decode the same batch for the same number of steps (the schema forces a long array, so no
constrained request ends early; the free ones ignore EOS). The figure is the median wall time of an engine
step made only of decodes, and the constrained run's extra time as a share of the free run's; the grammar's
own host time (filling the bitmasks, accepting tokens) is timed separately. Ratio, not absolute time, is the
target (issue 26: overhead <= 10% at batch 32).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from keel.platform import host
from keel.serve import LLM, SamplingParams
from keel.serve.structured import StructuredOutputsParams

# An object whose one field is an array of at least 200 small objects: no request can finish within the run.
SCHEMA = {
    "type": "object",
    "properties": {
        "rows": {
            "type": "array",
            "minItems": 200,
            "items": {
                "type": "object",
                "properties": {"id": {"type": "integer"}, "tag": {"type": "string", "maxLength": 12}},
                "required": ["id", "tag"],
                "additionalProperties": False,
            },
        }
    },
    "required": ["rows"],
    "additionalProperties": False,
}


def decode_steps(llm: LLM, prompt: str, params: list[SamplingParams], steps: int) -> tuple[list[float], float]:
    """Wall seconds of each all-decode step, and the mean host seconds a step spends filling bitmasks."""
    engine = llm.engine
    for i, p in enumerate(params):
        engine.add_request(prompt, p, f"r{i}")
    grammar_seconds = 0.0
    fill = engine._grammar_masks

    def timed_fill(*a, **k):
        nonlocal grammar_seconds
        t = time.perf_counter()
        try:
            return fill(*a, **k)
        finally:
            grammar_seconds += time.perf_counter() - t

    engine._grammar_masks = timed_fill
    times = []
    try:
        while engine.has_unfinished_requests() and len(times) < steps:
            prefilling = any(r.num_computed_tokens < len(r.prompt_token_ids) for r in engine.scheduler.running)
            waiting = bool(engine.scheduler.waiting)
            start = time.perf_counter()
            engine.step()
            if not prefilling and not waiting:
                times.append(time.perf_counter() - start)
    finally:
        engine._grammar_masks = fill
        for i in range(len(params)):
            engine.abort_request(f"r{i}")
    return times, grammar_seconds / max(len(times), 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3, help="free and constrained runs, alternated")
    parser.add_argument("--compile", action="store_true", help="the compiled decode step (default: eager)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM("smollm2-135m-instruct", max_model_len=1024, max_num_seqs=args.batch, compile=args.compile)
    prompt = llm.engine.tokenizer.apply_chat_template([{"role": "user", "content": "List many rows as JSON."}])
    constraint = StructuredOutputsParams.of(json=SCHEMA)
    free = [
        SamplingParams(max_tokens=args.steps + 8, temperature=0.8, seed=i, ignore_eos=True) for i in range(args.batch)
    ]
    constrained = [
        SamplingParams(max_tokens=args.steps + 8, temperature=0.8, seed=i, structured_outputs=constraint)
        for i in range(args.batch)
    ]
    llm.engine.grammar_backend().compile(constraint)  # compiled at admission in the server, not in a step
    decode_steps(llm, prompt, free[:2], 4)  # warm-up
    free_times, constrained_times, fills = [], [], []
    for _ in range(args.rounds):  # interleaved, so that a slow spell of the machine hits both
        free_times += decode_steps(llm, prompt, free, args.steps)[0]
        times, grammar = decode_steps(llm, prompt, constrained, args.steps)
        constrained_times += times
        fills.append(grammar)
    grammar = statistics.mean(fills)
    a, b = statistics.median(free_times), statistics.median(constrained_times)
    print(
        f"machine: {host().native_isa}, torch threads {args.threads}, batch {args.batch}, "
        f"decode {'compiled' if args.compile else 'eager'}, {len(free_times)}/{len(constrained_times)} steps"
    )
    print(f"free step         {a * 1e3:8.2f} ms (median)")
    print(f"constrained step  {b * 1e3:8.2f} ms (median); bitmasks filled in {grammar * 1e3:.2f} ms of it")
    print(f"overhead          {(b / a - 1) * 100:+.1f}%  (target <= 10%)")


if __name__ == "__main__":
    main()
