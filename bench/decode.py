"""Batch-1 decode: keel against transformers' `generate` on the same weights, dtype and threads.

    python bench/decode.py MODEL [--dtype float32|bfloat16] [--threads 2] [--prompt-tokens 32] [--new-tokens 256]

keel runs its model forward through the single-sequence reference generator (the tests' oracle,
tests/reference_generate.py: a contiguous KV cache, no serving engine), as transformers' `generate`
runs its own. Both run the same random prompt and generate exactly --new-tokens tokens (EOS ignored), in
alternation, --repeats times each; the median is reported. Decode tok/s counts the tokens after
the first (the first comes out of the prefill) over the time from the first token to the last,
the same way for both. Weight streaming bandwidth = bytes of weights read per token × tok/s,
shown against this machine's copy bandwidth measured here (STREAM convention: bytes read +
bytes written per second).
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from keel.profile.roofline import copy_bandwidth, streamed_weight_bytes

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the reference generator lives with the tests


def keel_decode(model, prompt: list[int], new_tokens: int) -> float:
    from keel.serve.sampling import SamplingParams
    from reference_generate import GenerationStats, stream_tokens

    stats = GenerationStats()
    for _ in stream_tokens(
        model, prompt, SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True), stats=stats
    ):
        pass
    assert stats.generated_tokens == new_tokens
    return stats.decode_tokens_per_second


class _TokenClock:
    """A transformers streamer that timestamps every generated token (the first put is the prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.calls = 0

    def put(self, _value) -> None:
        self.calls += 1
        if self.calls > 1:
            self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def transformers_decode(model, prompt: list[int], new_tokens: int) -> float:
    clock = _TokenClock()
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            streamer=clock,
            pad_token_id=0,
        )
    assert out.shape[1] - len(prompt) == new_tokens
    return (len(clock.times) - 1) / (clock.times[-1] - clock.times[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM

    from keel.quant.loading import load_model
    from keel.weights.convert import convert

    loaded = load_model(args.model, args.dtype)
    dtype = loaded.model.dtype
    with tempfile.TemporaryDirectory(prefix="keel-bench-") as tmp:
        path = Path(args.model)
        ref_dir = path if (path / "config.json").exists() else convert(args.model, Path(tmp) / "hf", dtype="float32")
        reference = AutoModelForCausalLM.from_pretrained(ref_dir, dtype=dtype).eval()
    reference.generation_config.eos_token_id = None

    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, loaded.config.vocab_size, (args.prompt_tokens,), generator=generator).tolist()
    keel_decode(loaded.model, prompt, 8)  # warm-up both
    transformers_decode(reference, prompt, 8)
    keel_runs, hf_runs = [], []
    for _ in range(args.repeats):
        keel_runs.append(keel_decode(loaded.model, prompt, args.new_tokens))
        hf_runs.append(transformers_decode(reference, prompt, args.new_tokens))
    keel_tps, hf_tps = statistics.median(keel_runs), statistics.median(hf_runs)

    weight_bytes = streamed_weight_bytes(loaded.model)
    bandwidth = copy_bandwidth()
    print(f"command: python bench/{Path(__file__).name} {shlex.join(sys.argv[1:])}")
    print(
        f"model {args.model}, {args.dtype}, {args.threads} threads, batch 1, "
        f"{args.prompt_tokens}-token prompt + {args.new_tokens} tokens, median of {args.repeats}"
    )
    print(f"weights streamed per token: {weight_bytes / 1e6:.1f} MB; machine copy bandwidth {bandwidth / 1e9:.1f} GB/s")
    print(f"{'implementation':<14} {'decode tok/s':>12} {'weight GB/s':>12} {'% of copy bw':>13}")
    for name, tps in (("transformers", hf_tps), ("keel", keel_tps)):
        gbs = weight_bytes * tps
        print(f"{name:<14} {tps:12.1f} {gbs / 1e9:12.2f} {100 * gbs / bandwidth:12.1f}%")
    print(f"keel / transformers: {keel_tps / hf_tps:.2f}x")


if __name__ == "__main__":
    main()
