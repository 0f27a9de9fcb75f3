"""`keel eval ppl MODEL --corpus FILE|NAME [--context 1024] [--stride 512] [--max-tokens N]`,
`keel eval run MODEL [--suite NAME|FILE]... --out RESULTS.json`, `keel eval suites` and
`keel eval compare BASELINE.json CANDIDATE.json` (the regression gate)."""

from __future__ import annotations

import argparse
import sys

from keel.cli.common import add_dtype_arg, add_model_args, add_quantize_arg, positive_int
from keel.cli.config_options import add_engine_options, engine_config_from_args
from keel.data.text_corpus import CORPORA, corpus_text
from keel.errors import KeelError
from keel.platform import resolve_device


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("eval", help="evaluate a model: perplexity, capability suites, regression gate")
    eval_sub = p.add_subparsers(dest="eval_command", required=True, metavar="EVAL")
    q = eval_sub.add_parser("ppl", help="sliding-window perplexity over a text corpus")
    q.add_argument("model", metavar="MODEL", help="HF directory, .gguf file, or catalog name")
    q.add_argument("--corpus", required=True, help=f"a UTF-8 text file, or one of: {', '.join(CORPORA)}")
    q.add_argument("--context", type=int, default=1024, help="tokens per window (default 1024)")
    q.add_argument(
        "--stride", type=int, default=None, help="tokens between window starts (default: 512, or --context if less)"
    )
    q.add_argument("--max-tokens", type=int, default=None, help="score only the corpus's first N tokens")
    add_dtype_arg(q)
    add_quantize_arg(
        q,
        "weights as `keel serve --quantize` takes them (auto: a GGUF file's integer blocks as stored, as "
        "llama.cpp's perplexity runs them; none: float)",
    )
    q.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads")
    q.add_argument("--json", default=None, metavar="PATH", help="also write the result as JSON")
    q.set_defaults(func=cmd_ppl)
    _register_run(eval_sub)
    _register_compare(eval_sub)


def _csv_ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _csv_floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(",") if x)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def _register_run(eval_sub: argparse._SubParsersAction) -> None:
    r = eval_sub.add_parser("run", help="capability suites, golden greedy outputs and perplexity, with a manifest")
    add_model_args(r)
    r.add_argument(
        "--suite",
        action="append",
        default=None,
        metavar="NAME|FILE",
        help="a built-in suite name (see `keel eval suites`), 'needle', or a suite JSONL file; repeatable "
        "(default: every built-in suite and the needle suite)",
    )
    r.add_argument("--limit", type=int, default=None, metavar="N", help="only the first N items of each suite")
    r.add_argument(
        "--needle-lengths",
        type=_csv_ints,
        default=None,
        metavar="L,L",
        help="needle suite context lengths in tokens (default 512,1024,2048,4096)",
    )
    r.add_argument(
        "--needle-depths",
        type=_csv_floats,
        default=None,
        metavar="D,D",
        help="needle depths in [0, 1] (default 0.1,0.3,0.5,0.7,0.9)",
    )
    r.add_argument(
        "--golden",
        type=int,
        default=None,
        metavar="N",
        help="greedy outputs of the first N golden prompts (default all 16; 0: none)",
    )
    r.add_argument("--golden-tokens", type=int, default=64, help="greedy tokens per golden prompt")
    r.add_argument("--ppl-corpus", default="shakespeare", help="perplexity corpus: a name or file; 'none' to skip")
    r.add_argument("--ppl-max-tokens", type=int, default=4096, help="score the corpus's first N tokens")
    r.add_argument("--ppl-context", type=int, default=1024)
    r.add_argument("--ppl-stride", type=int, default=512)
    r.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads")
    r.add_argument("--out", default=None, metavar="RESULTS.json", help="write the results and manifest here")
    add_engine_options(r)
    r.set_defaults(func=cmd_run)
    s = eval_sub.add_parser("suites", help="list the built-in capability suites")
    s.set_defaults(func=cmd_suites)


def _register_compare(eval_sub: argparse._SubParsersAction) -> None:
    from keel.eval.compare import Thresholds

    t = Thresholds()
    c = eval_sub.add_parser("compare", help="the regression gate: candidate results against a baseline")
    c.add_argument("baseline", metavar="BASELINE.json")
    c.add_argument("candidate", metavar="CANDIDATE.json")
    c.add_argument(
        "--max-drop",
        type=float,
        default=t.max_drop,
        help=f"largest allowed drop of a suite's primary metric (default {t.max_drop})",
    )
    c.add_argument(
        "--alpha",
        type=float,
        default=t.alpha,
        help=f"a drop fails only when McNemar's p is below this (default {t.alpha})",
    )
    c.add_argument(
        "--min-greedy-stability",
        type=float,
        default=t.min_greedy_stability,
        help="smallest share of golden prompts with identical greedy tokens (default 0)",
    )
    c.add_argument(
        "--max-ppl-increase",
        type=float,
        default=t.max_ppl_increase,
        help=f"largest allowed relative perplexity increase (default {t.max_ppl_increase})",
    )
    c.add_argument("--json", default=None, metavar="PATH", help="also write the comparison as JSON")
    c.set_defaults(func=cmd_compare)


def check_writable(path: str, option: str) -> None:
    """Before a long run: its results must have somewhere to go."""
    import os
    from pathlib import Path

    parent = Path(path).resolve().parent
    if not parent.is_dir() or not os.access(parent, os.W_OK):
        raise KeelError(f"{option} {path}: {parent} is not a writable directory")


def check_lengths(args: argparse.Namespace, suites: list, max_model_len: int, ppl_tokens: list[int] | None) -> None:
    """What only the engine's model length decides, checked before any suite runs."""
    from keel.eval.needle import ANSWER_TOKENS, DEFAULT_LENGTHS

    if any(s.kind == "needle" for s in suites):
        longest = max(args.needle_lengths or DEFAULT_LENGTHS)
        if longest + ANSWER_TOKENS > max_model_len:
            raise KeelError(
                f"--needle-lengths: {longest} tokens + {ANSWER_TOKENS} for the answer exceed the model "
                f"length {max_model_len}"
            )
    if ppl_tokens is not None:
        if len(ppl_tokens) < 2:
            raise KeelError(f"--ppl-corpus {args.ppl_corpus}: fewer than 2 tokens")
        if args.ppl_context + 1 > max_model_len:
            raise KeelError(
                f"--ppl-context {args.ppl_context} exceeds the model length {max_model_len} (minus one "
                "token the engine samples)"
            )


def cmd_suites(args: argparse.Namespace) -> int:
    from keel.eval.suites import builtin_suite_paths, load_suite

    for path in builtin_suite_paths():
        s = load_suite(path)
        print(f"{s.name:<24} {s.kind:<16} {s.dimension:<24} {len(s.items):>4} items  {s.description}")
    print(f"{'needle':<24} {'needle':<16} {'long_context_retrieval':<24}   (generated by context length)")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from keel.model.perplexity import check_window_options, leading_tokens

    minimums = [
        ("--limit", args.limit, 1),
        ("--golden", args.golden, 0),
        ("--golden-tokens", args.golden_tokens, 1),
        ("--threads", args.threads, 1),
    ]
    for option, value, least in minimums:
        if value is not None and value < least:
            raise KeelError(f"{option} must be >= {least}, got {value}")
    if args.out:
        check_writable(args.out, "--out")
    if any(not 0 <= d <= 1 for d in args.needle_depths or ()):
        raise KeelError(f"--needle-depths: each depth must be in [0, 1], got {list(args.needle_depths)}")
    if any(n < 1 for n in args.needle_lengths or ()):
        raise KeelError(f"--needle-lengths: each length must be >= 1, got {list(args.needle_lengths)}")
    if args.ppl_corpus != "none":
        check_window_options(args.ppl_context, args.ppl_stride)
        if args.ppl_max_tokens < 2:
            raise KeelError(f"--ppl-max-tokens must be >= 2, got {args.ppl_max_tokens}")
    config = engine_config_from_args(args)  # option errors before the model loads
    import torch

    from keel.eval.manifest import build_manifest
    from keel.eval.report import summary_table
    from keel.eval.run import run_eval, write_json
    from keel.eval.select import resolve_suites
    from keel.quant.loading import load_model
    from keel.serve.llm import LLM

    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_model(
        args.model,
        config.load.dtype,
        head_dim=args.head_dim,
        num_heads=args.num_heads,
        device=str(resolve_device(config.load.device)),
        **config.quant.load_options(),
    )
    if loaded.tokenizer is None:
        raise KeelError(f"{args.model}: no tokenizer found (tokenizer.json or GGUF tokenizer metadata)")
    suites = resolve_suites(args.suite, loaded.tokenizer, args.limit, args.needle_lengths, args.needle_depths)
    ppl_tokens, corpus = None, None
    if args.ppl_corpus != "none":
        corpus, text = corpus_text(args.ppl_corpus, "--ppl-corpus")
        ppl_tokens = leading_tokens(loaded.tokenizer, text, args.ppl_max_tokens)
    llm = LLM(loaded, config, adapt=True)
    check_lengths(args, suites, llm.engine.max_model_len, ppl_tokens)
    manifest = build_manifest(str(args.model), llm.engine)
    record = run_eval(
        llm,
        suites,
        golden=args.golden,
        golden_tokens=args.golden_tokens,
        ppl_tokens=ppl_tokens,
        ppl_context=args.ppl_context,
        ppl_stride=args.ppl_stride,
        ppl_corpus=corpus,
        manifest=manifest,
    )
    print(summary_table(record))
    if args.out:
        write_json(args.out, record)
        print(f"results and manifest written to {args.out}")
    sys.stdout.flush()
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from keel.eval.compare import Thresholds, compare, report
    from keel.eval.run import read_results, write_json

    if args.json:
        check_writable(args.json, "--json")
    thresholds = Thresholds(args.max_drop, args.alpha, args.min_greedy_stability, args.max_ppl_increase)
    result = compare(read_results(args.baseline), read_results(args.candidate), thresholds)
    print(report(result))
    if args.json:
        write_json(args.json, result.as_dict())  # (checked writable before comparing)
    sys.stdout.flush()
    return 0 if result.passed else 1


def cmd_ppl(args: argparse.Namespace) -> int:
    from keel.model.perplexity import check_window_options, leading_tokens, sliding_window_perplexity

    if args.stride is None:  # the default stride, within a shorter --context
        args.stride = min(512, args.context) if args.context > 0 else 512
    check_window_options(args.context, args.stride)  # option errors before any loading
    if args.max_tokens is not None and args.max_tokens < 2:
        raise KeelError(f"--max-tokens must be >= 2, got {args.max_tokens}")
    import torch

    from keel.quant.loading import load_model, loaded_scheme

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    name, text = corpus_text(args.corpus)
    loaded = load_model(args.model, args.dtype, quantize=args.quantize)
    if loaded.tokenizer is None:
        raise KeelError(f"{args.model}: no tokenizer found (tokenizer.json or GGUF tokenizer metadata)")
    ids = leading_tokens(loaded.tokenizer, text, args.max_tokens)
    result = sliding_window_perplexity(loaded.model, ids, args.context, args.stride)
    dtype = str(loaded.model.dtype).removeprefix("torch.")
    scheme = loaded_scheme(loaded.model)
    weights = f"{dtype}, {scheme}" if scheme else dtype
    print(
        f"{args.model} ({weights}) on {name}: perplexity {result.perplexity:.4f} over {result.tokens_scored} tokens "
        f"({result.windows} windows of {args.context}, stride {args.stride}; {result.tokens_per_s:.0f} tok/s)"
    )
    if args.json:
        record = {"model": str(args.model), "dtype": dtype, "quantize": scheme, "corpus": name, **result.as_dict()}
        from keel.eval.run import write_json

        write_json(args.json, record)
    sys.stdout.flush()
    return 0
