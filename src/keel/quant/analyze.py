"""Sensitive-layer analysis: quantize one linear layer at a time and measure what it costs.

`keel quantize analyze MODEL --corpus FILE [--scheme int4 --group-size 64] [--keep 4] [--out plan.json]`
runs the float model once over the corpus tokens, then, for every linear layer alone, swaps in its
quantized version and measures the logits' relative error and cosine similarity against the float
logits and the perplexity change; it prints the layers ranked by perplexity change and writes a
mixed-precision plan that keeps the N most sensitive layers in float. `--quant-plan plan.json` on
`keel serve`/`keel generate` applies it.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from keel.errors import KeelError
from keel.model.perplexity import perplexity_of_logits
from keel.quant.linear import INT4_GROUP_SIZES, SCHEMES, QuantizedLinear


@dataclass
class LayerSensitivity:
    name: str
    ppl_change: float  # quantized perplexity / float perplexity - 1
    rel_error: float  # ||logits_q - logits|| / ||logits||
    cosine: float  # cosine similarity of the flattened logits


@torch.no_grad()
def analyze(model: nn.Module, ids: list[int], scheme: str, group_size: int = 128) -> list[LayerSensitivity]:
    """Every quantizable linear layer of `model`, most sensitive first."""
    tokens = torch.tensor([ids])
    base = model(tokens).float()
    base_ppl = perplexity_of_logits(base, tokens)
    results = []
    for name, linear in [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]:
        if scheme == "int4" and linear.in_features % group_size:
            continue  # stays in float anyway
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, QuantizedLinear(linear, scheme, group_size))
        try:
            logits = model(tokens).float()
        finally:
            setattr(parent, child, linear)
        results.append(
            LayerSensitivity(
                name=name,
                ppl_change=perplexity_of_logits(logits, tokens) / base_ppl - 1,
                rel_error=((logits - base).norm() / base.norm()).item(),
                # float64: millions of logits summed in float32 drift past 1.0
                cosine=F.cosine_similarity(logits.flatten().double(), base.flatten().double(), dim=0).item(),
            )
        )
    results.sort(key=lambda r: (r.ppl_change, r.rel_error), reverse=True)
    return results


def write_plan(path: str | Path, results: list[LayerSensitivity], keep: int, scheme: str, group_size: int) -> dict:
    plan = {
        "scheme": scheme,
        "group_size": group_size,
        "keep": [r.name for r in results[:keep]],
        "layers": [asdict(r) for r in results],
    }
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(plan, indent=2) + "\n")
    os.replace(tmp, path)  # atomic: a plan is either the old one or the whole new one
    return plan


def read_plan(path: str | Path) -> dict:
    """A plan written by `keel quantize analyze`; one-line KeelError naming the file and field."""
    path = Path(path)
    try:
        plan = json.loads(path.read_text())
    except FileNotFoundError:
        raise KeelError(f"{path}: no such quantization plan") from None
    except json.JSONDecodeError as e:
        raise KeelError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(plan, dict):
        raise KeelError(f"{path}: expected a JSON object")
    if plan.get("scheme") not in SCHEMES:
        raise KeelError(f"{path}: scheme must be one of {', '.join(SCHEMES)}, got {plan.get('scheme')!r}")
    if plan["scheme"] == "int4" and plan.get("group_size") not in INT4_GROUP_SIZES:
        raise KeelError(f"{path}: group_size must be one of {INT4_GROUP_SIZES}, got {plan.get('group_size')!r}")
    keep = plan.get("keep", [])
    if not isinstance(keep, list) or not all(isinstance(k, str) for k in keep):
        raise KeelError(f"{path}: keep must be a list of layer names")
    return plan


def cmd_analyze(args: argparse.Namespace) -> int:
    from keel.weights import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_model(args.model, "float32")
    if loaded.tokenizer is None:
        raise KeelError(f"{args.model}: no tokenizer to encode the corpus with")
    from keel.eval.cli import corpus_text  # the corpora of `keel eval ppl`: a file, or a name such as shakespeare

    _, text = corpus_text(args.corpus)
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
