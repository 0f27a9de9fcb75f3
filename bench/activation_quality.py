"""Perplexity of keel's integer kernels with int8 activations and with refined ones, against the float path.

    python bench/activation_quality.py [--gguf FILE ...] [--tokens 4096] [--window 512] [--threads 2]

For each weight format (SmolLM2-135M's packaged GGUF file and any --gguf file as stored, with its head on its
own blocks; keel's int4 g32 and int8 of the float weights, every layer) the same weights run three ways:
dequantized into float layers (the reference), on keel's kernels with int8 activations (one pass, the
default), and with refined activations (int8 and its int8 residual). The row thresholds above which a block
layer dequantizes for BLAS are lifted, so every product of a 512-token window runs the integer kernels.
Corpus: Shakespeare's works (keel.data.corpora), --tokens tokens from token 1000 on, in non-overlapping
windows of --window tokens (keel.model.perplexity.sliding_window_perplexity, stride = window, as `keel eval
ppl --context W --stride W` scores them).
"""

from __future__ import annotations

import argparse
import copy
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

MODEL = "smollm2-135m-instruct"


def perplexity(model: nn.Module, ids: list[int], window: int) -> float:
    from keel.model.perplexity import sliding_window_perplexity

    return sliding_window_perplexity(model, ids, context=window, stride=window).perplexity


def as_float_layers(model: nn.Module) -> nn.Module:
    """A copy of `model` whose quantized layers are float layers of their own dequantized weights."""
    from keel.quant.apply import replace_module
    from keel.quant.linear import QuantizedLinear

    copied = copy.deepcopy(model)
    for name, layer in [(n, m) for n, m in copied.named_modules() if isinstance(m, QuantizedLinear)]:
        dense = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None)
        dense.weight.data = layer.dequantized().float()
        if layer.bias is not None:
            dense.bias.data = layer.bias.float()
        replace_module(copied, name, dense)
    return copied


def lift_dequantize_thresholds() -> None:
    from keel.quant import linear

    linear.BLOCK_DEQUANTIZE_ROWS = 1 << 30
    linear.EIGHT_BIT_DEQUANTIZE_ROWS = dict.fromkeys(linear.EIGHT_BIT_DEQUANTIZE_ROWS, 1 << 30)
    linear.STORED_DEQUANTIZE_ROWS = dict.fromkeys(linear.STORED_DEQUANTIZE_ROWS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", nargs="*", default=[], help="more GGUF files of the same model (e.g. requantized)")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    lift_dequantize_thresholds()

    from keel.data.corpora import shakespeare_path
    from keel.quant import quantize_model
    from keel.quant.apply import set_activations
    from keel.quant.loading import load_model

    reference = load_model(MODEL, "float32", quantize="none")
    text = shakespeare_path().read_text(encoding="utf-8")
    ids = reference.tokenizer.encode(text[:200_000])[1000 : 1000 + args.tokens]

    def keel_scheme(scheme: str, group: int) -> Callable[[], nn.Module]:
        def build() -> nn.Module:
            model = copy.deepcopy(reference.model)
            quantize_model(model, scheme, group, keep=set())
            return model

        return build

    def stored(path: str) -> Callable[[], nn.Module]:
        return lambda: load_model(path, "float32", quantize="gguf", quant_keep=()).model

    formats: list[tuple[str, Callable[[], nn.Module]]] = [(f"{MODEL} GGUF (packaged)", stored(MODEL))]
    formats += [(Path(path).name, stored(path)) for path in args.gguf]
    formats += [("keel int4 g32, every layer", keel_scheme("int4", 32))]
    formats += [("keel int8, every layer", keel_scheme("int8", 128))]

    print(f"command: python bench/{Path(__file__).name} {shlex.join(sys.argv[1:])}")
    print(f"{len(ids)} Shakespeare tokens in windows of {args.window}; {args.threads} threads; float32 activations")
    print(f"{'weights':<34} {'float path':>10} {'int8 act.':>10} {'change':>8} {'refined':>10} {'change':>8} {'s':>4}")
    for name, build in formats:
        start = time.perf_counter()
        model = build()
        float_path = perplexity(as_float_layers(model), ids, args.window)
        result = {}
        for activations in ("int8", "refined"):
            set_activations(model, activations)
            result[activations] = perplexity(model, ids, args.window)
        change = {k: f"{100 * (v / float_path - 1):+.3f}%" for k, v in result.items()}
        print(
            f"{name:<34} {float_path:10.4f} {result['int8']:10.4f} {change['int8']:>8} "
            f"{result['refined']:10.4f} {change['refined']:>8} {time.perf_counter() - start:4.0f}"
        )


if __name__ == "__main__":
    main()
