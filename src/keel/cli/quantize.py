"""`keel quantize analyze` (sensitive-layer analysis, keel.quant.sensitivity) and `keel quantize save`
(keel.quant.save).

`keel quantize analyze MODEL --corpus FILE [--scheme int4 --group-size 64] [--keep 4] [--out plan.json]`
runs the float model once over the corpus tokens, then, for every linear layer alone, swaps in its
quantized version and measures the logits' relative error and cosine similarity against the float
logits and the perplexity change; it prints the layers ranked by perplexity change and writes a
mixed-precision plan that keeps the N most sensitive layers in float. `--quant-plan plan.json` on
`keel serve`/`keel generate` applies it.
"""

from __future__ import annotations

import argparse

from keel.cli.common import positive_int
from keel.cli.config_options import comma_list
from keel.data.text_corpus import corpus_text
from keel.dtype_names import DTYPE_CHOICES
from keel.errors import KeelError
from keel.quant.config import QuantConfig
from keel.weights.quant_format import INT4_GROUP_SIZES, SCHEMES


def cmd_analyze(args: argparse.Namespace) -> int:
    import torch

    from keel.quant.loading import load_model
    from keel.quant.plan import write_plan
    from keel.quant.sensitivity import analyze

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
    print(
        f"{len(results)} linear layers, {args.scheme}"
        + (f" g{args.group_size}" if args.scheme == "int4" else "")
        + f", {len(ids)} corpus tokens; most sensitive first"
    )
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
    a.add_argument("--threads", type=positive_int, default=None)
    a.set_defaults(func=cmd_analyze)
    _register_save(qsub)


def cmd_save(args: argparse.Namespace) -> int:
    import torch

    from keel.quant.save import save_quantized

    if args.threads:
        torch.set_num_threads(args.threads)
    # A plan file resolves as it does for the engine (keel.quant.config): it overrides the three options.
    options = QuantConfig(
        quantize=args.quantize,
        quant_group_size=args.quant_group_size,
        quant_keep=args.quant_keep,
        quant_plan=args.quant_plan,
    )
    scheme, group_size, keep = options.scheme, options.quant_group_size, options.quant_keep
    if scheme is None:
        raise KeelError("keel quantize save: pass --quantize int8|int4 or --quant-plan PLAN.json")
    if getattr(args, "quant_keep_as", None) is not None:
        raise KeelError("keel quantize save: --quant-keep-as is not supported (a saved model has one scheme)")
    quant = save_quantized(args.model, args.out, scheme, group_size, keep, args.dtype, overwrite=args.overwrite)
    kept = len(quant["modules_not_converted"])
    print(f"{args.out}: {scheme}" + (f" g{group_size}" if scheme == "int4" else "") + f", {kept} modules kept in float")
    return 0


def _register_save(qsub: argparse._SubParsersAction) -> None:
    s = qsub.add_parser("save", help="quantize a model and write it (portable integer safetensors) to a directory")
    s.add_argument("model", metavar="MODEL", help="HF directory, .gguf file, or catalog name")
    s.add_argument("--quantize", default=None, choices=list(SCHEMES), help="int8 per channel or int4 per group")
    s.add_argument("--quant-group-size", type=int, default=128, choices=list(INT4_GROUP_SIZES))
    s.add_argument(
        "--quant-keep",
        default="lm_head",
        type=comma_list,
        metavar="NAMES",
        help="comma-separated modules (names or patterns like '*.experts') left in float",
    )
    s.add_argument("--quant-plan", default=None, metavar="PLAN.json", help="a plan from `keel quantize analyze`")
    s.add_argument(
        "--dtype",
        default="auto",
        choices=list(DTYPE_CHOICES),
        help="dtype of the float tensors and of the weights before quantization",
    )
    s.add_argument("--out", required=True, metavar="DIR", help="output directory (must not exist or be empty)")
    s.add_argument("--overwrite", action="store_true", help="replace an existing DIR")
    s.add_argument("--threads", type=positive_int, default=None)
    s.set_defaults(func=cmd_save)
