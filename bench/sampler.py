"""The serving sampler's cost per call: keel::sample_rows against torch's path, 64 rows of SmolLM2's vocabulary.

    python bench/sampler.py [--rows 64] [--vocab 49152] [--threads 1] [--logits random|smollm2]

Times are the calling thread's CPU time per call (`time.thread_time`), for greedy rows, temperature
alone, top-k, top-p and both; "torch" is the same Sampler with keel's kernels switched off. Logits:
Gaussian (standard deviation 3, every row alike in spread) or SmolLM2-135M's own over consecutive
positions of Shakespeare (rows from confident to uncertain, as a serving step's are).
"""

from __future__ import annotations

import argparse
import time

import torch

from keel import kernels
from keel.serve.sampling import RowState, Sampler, SamplingParams

CASES = {
    "greedy": SamplingParams(temperature=0),
    "temperature 0.8": SamplingParams(temperature=0.8),
    "top-k 50": SamplingParams(temperature=0.8, top_k=50),
    "top-p 0.9": SamplingParams(temperature=0.8, top_p=0.9),
    "top-k 50 + top-p 0.9": SamplingParams(temperature=0.8, top_k=50, top_p=0.9),
}


def cpu_ms(sampler: Sampler, logits: torch.Tensor, states: list[RowState], repeats: int = 5) -> float:
    sampler(logits, states)
    start = time.thread_time()
    for _ in range(repeats):
        sampler(logits, states)
    return (time.thread_time() - start) / repeats * 1e3


def random_logits(rows: int, vocab: int) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0)) * 3


def model_logits(rows: int) -> torch.Tensor:
    from keel.data.corpora import shakespeare_path
    from keel.quant.loading import load_model

    loaded = load_model("smollm2-135m-instruct", "float32", quantize="none")
    ids = loaded.tokenizer.encode(shakespeare_path().read_text(encoding="utf-8")[:20_000])[1000 : 1000 + rows]
    with torch.inference_mode():
        return loaded.model(torch.tensor([ids])).float()[0].contiguous()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--logits", choices=["random", "smollm2"], default="random")
    args = parser.parse_args()
    if not kernels.active():
        raise SystemExit(f"keel kernels: {kernels.status()}")
    torch.set_num_threads(args.threads)
    logits = model_logits(args.rows) if args.logits == "smollm2" else random_logits(args.rows, args.vocab)
    sampler = Sampler()
    for name, params in CASES.items():
        states = [RowState(params) for _ in range(args.rows)]
        fused = cpu_ms(sampler, logits, states)
        kernels._ACTIVE = False  # the torch path (keel.kernels.active() reads this)
        try:
            reference = cpu_ms(sampler, logits, states)
        finally:
            kernels._ACTIVE = None
        print(f"{name:22s} keel {fused:7.1f} ms   torch {reference:7.1f} ms   {reference / fused:5.1f}x", flush=True)


if __name__ == "__main__":
    main()
