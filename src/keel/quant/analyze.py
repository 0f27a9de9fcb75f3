"""`keel quantize analyze` (sensitive-layer analysis, keel.quant.sensitivity) and the `quantize` command group.

`keel quantize analyze MODEL --corpus FILE [--scheme int4 --group-size 64] [--keep 4] [--out plan.json]`
runs the float model once over the corpus tokens, then, for every linear layer alone, swaps in its
quantized version and measures the logits' relative error and cosine similarity against the float
logits and the perplexity change; it prints the layers ranked by perplexity change and writes a
mixed-precision plan that keeps the N most sensitive layers in float. `--quant-plan plan.json` on
`keel serve`/`keel generate` applies it.
"""

from __future__ import annotations

import argparse

import torch

from keel.data.text_corpus import corpus_text
from keel.errors import KeelError
from keel.quant.linear import INT4_GROUP_SIZES, SCHEMES
from keel.quant.plan import write_plan
from keel.quant.sensitivity import analyze


def cmd_analyze(args: argparse.Namespace) -> int:
    from keel.quant.loading import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_model(args.model, "float32")
    if loaded.tokenizer is None:
        raise KeelError(f"{args.model}: no tokenizer to encode the corpus with")
    _, text = corpus_text(args.corpus)  # the corpora of `keel eval ppl`: a file, or a name such as shakespeare
    ids = loaded.tokenizer.encode(text, add_special_tokens=False)[: args.max_tokens]
    if len(ids) < 2:
        raise KeelError(f"--corpus {args.corpus}: fewer than 2 tokens")
    results = analyze(loaded.model, ids, args.scheme, args.group_size)
    print(f"{len(results)} linear layers, {args.scheme}" + (f" g{args.group_size}" if args.scheme == "int4" else "")
          + f", {len(ids)} corpus tokens; most sensitive first")  # fmt: skip
    print(f"{'layer':44} {'ppl change':>11} {'rel error':>10} {'cosine':>9}")
    for r in results[: args.show]:
        print(f"{r.name:44} {r.ppl_change:+10.3%} {r.rel_error:10.4f} {r.cosine:9.6f}")
    if args.out:
        write_plan(args.out, results, args.keep, args.scheme, args.group_size)
        print(f"plan: {args.out} keeps {min(args.keep, len(results))} layers in float")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("quantize", help="quantization tools (sensitive-layer analysis, saving quantized models)")
    qsub = p.add_subparsers(dest="quantize_command", required=True, metavar="COMMAND")
    a = qsub.add_parser("analyze", help="rank linear layers by the cost of quantizing each alone")
    a.add_argument("model")
    a.add_argument(
        "--corpus",
        required=True,
        help="a text file to measure perplexity on, or a corpus name (shakespeare, kjv: as `keel eval ppl`)",
    )
    a.add_argument("--scheme", default="int4", choices=list(SCHEMES))
    a.add_argument("--group-size", type=int, default=128, choices=list(INT4_GROUP_SIZES))
    a.add_argument("--max-tokens", type=int, default=512, help="corpus tokens used")
    a.add_argument("--keep", type=int, default=4, help="layers the plan keeps in float")
    a.add_argument("--out", default=None, help="write the mixed-precision plan (JSON) here")
    a.add_argument("--show", type=int, default=20, help="rows printed")
    a.add_argument("--threads", type=int, default=None)
    a.set_defaults(func=cmd_analyze)
    from keel.quant.save import register_save

    register_save(qsub)
