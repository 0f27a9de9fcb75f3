"""`keel eval run MODEL [--suite NAME|FILE]... --out RESULTS.json` and
`keel eval compare BASELINE.json CANDIDATE.json` (the regression gate)."""

from __future__ import annotations

import argparse
import sys

from keel.errors import KeelError


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


def register_run(eval_sub: argparse._SubParsersAction) -> None:
    from keel.cli.common import add_model_args
    from keel.cli.config_options import add_engine_options

    r = eval_sub.add_parser("run", help="capability suites, golden greedy outputs and perplexity, with a manifest")
    add_model_args(r)
    r.add_argument("--suite", action="append", default=None, metavar="NAME|FILE",
                   help="a built-in suite name (see `keel eval suites`), 'needle', or a suite JSONL file; repeatable "
                        "(default: every built-in suite and the needle suite)")  # fmt: skip
    r.add_argument("--limit", type=int, default=None, metavar="N", help="only the first N items of each suite")
    r.add_argument("--needle-lengths", type=_csv_ints, default=None, metavar="L,L",
                   help="needle suite context lengths in tokens (default 512,1024,2048,4096)")  # fmt: skip
    r.add_argument("--needle-depths", type=_csv_floats, default=None, metavar="D,D",
                   help="needle depths in [0, 1] (default 0.1,0.3,0.5,0.7,0.9)")  # fmt: skip
    r.add_argument("--golden", type=int, default=None, metavar="N",
                   help="greedy outputs of the first N golden prompts (default all 16; 0: none)")  # fmt: skip
    r.add_argument("--golden-tokens", type=int, default=64, help="greedy tokens per golden prompt")
    r.add_argument("--ppl-corpus", default="shakespeare", help="perplexity corpus: a name or file; 'none' to skip")
    r.add_argument("--ppl-max-tokens", type=int, default=4096, help="score the corpus's first N tokens")
    r.add_argument("--ppl-context", type=int, default=1024)
    r.add_argument("--ppl-stride", type=int, default=512)
    r.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    r.add_argument("--out", default=None, metavar="RESULTS.json", help="write the results and manifest here")
    add_engine_options(r)
    r.set_defaults(func=cmd_run)
    s = eval_sub.add_parser("suites", help="list the built-in capability suites")
    s.set_defaults(func=cmd_suites)


def register_compare(eval_sub: argparse._SubParsersAction) -> None:
    from keel.eval.compare import Thresholds

    t = Thresholds()
    c = eval_sub.add_parser("compare", help="the regression gate: candidate results against a baseline")
    c.add_argument("baseline", metavar="BASELINE.json")
    c.add_argument("candidate", metavar="CANDIDATE.json")
    c.add_argument("--max-drop", type=float, default=t.max_drop,
                   help=f"largest allowed drop of a suite's primary metric (default {t.max_drop})")  # fmt: skip
    c.add_argument("--alpha", type=float, default=t.alpha,
                   help=f"a drop fails only when McNemar's p is below this (default {t.alpha})")  # fmt: skip
    c.add_argument("--min-greedy-stability", type=float, default=t.min_greedy_stability,
                   help="smallest share of golden prompts with identical greedy tokens (default 0)")  # fmt: skip
    c.add_argument("--max-ppl-increase", type=float, default=t.max_ppl_increase,
                   help=f"largest allowed relative perplexity increase (default {t.max_ppl_increase})")  # fmt: skip
    c.add_argument("--json", default=None, metavar="PATH", help="also write the comparison as JSON")
    c.set_defaults(func=cmd_compare)


def resolve_suites(names: list[str] | None, tokenizer, limit: int | None, needle_lengths, needle_depths) -> list:
    """The Suite objects of --suite values (built-in names, 'needle', or files)."""
    from pathlib import Path

    from keel.eval.needle import DEFAULT_DEPTHS, DEFAULT_LENGTHS, needle_suite
    from keel.eval.suites import builtin_suite_paths, load_suite

    builtin = {p.stem: p for p in builtin_suite_paths()}
    suites = []
    for name in names or [*builtin, "needle"]:
        if name == "needle":
            from keel.data.corpora import shakespeare_path

            haystack = shakespeare_path().read_text(encoding="utf-8")
            lengths, depths = needle_lengths or DEFAULT_LENGTHS, needle_depths or DEFAULT_DEPTHS
            suite = needle_suite(tokenizer, haystack, lengths, depths)
        elif name in builtin:
            suite = load_suite(builtin[name])
        elif Path(name).is_file():
            suite = load_suite(name)
        else:
            raise KeelError(f"--suite {name}: not a built-in suite ({', '.join([*builtin, 'needle'])}) nor a file")
        if limit is not None:
            suite.items = suite.items[:limit]
        if (suite.template.chat or suite.kind == "multi_turn") and not tokenizer.chat_template:
            raise KeelError(f"suite {suite.name} renders its prompts with a chat template, and this model has "
                            "none: choose other suites with --suite")  # fmt: skip
        if any(s.name == suite.name for s in suites):
            raise KeelError(f"--suite {name}: a suite named {suite.name!r} is already selected")
        suites.append(suite)
    return suites


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
            raise KeelError(f"--needle-lengths: {longest} tokens + {ANSWER_TOKENS} for the answer exceed the model "
                            f"length {max_model_len}")  # fmt: skip
    if ppl_tokens is not None:
        if len(ppl_tokens) < 2:
            raise KeelError(f"--ppl-corpus {args.ppl_corpus}: fewer than 2 tokens")
        if args.ppl_context + 1 > max_model_len:
            raise KeelError(f"--ppl-context {args.ppl_context} exceeds the model length {max_model_len} (minus one "
                            "token the engine samples)")  # fmt: skip


def cmd_suites(args: argparse.Namespace) -> int:
    from keel.eval.suites import builtin_suite_paths, load_suite

    for path in builtin_suite_paths():
        s = load_suite(path)
        print(f"{s.name:<24} {s.kind:<16} {s.dimension:<24} {len(s.items):>4} items  {s.description}")
    print(f"{'needle':<24} {'needle':<16} {'long_context_retrieval':<24}   (generated by context length)")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from keel.cli.config_options import engine_config_from_args
    from keel.data.text_corpus import corpus_text
    from keel.model.perplexity import check_window_options, leading_tokens

    minimums = [("--limit", args.limit, 1), ("--golden", args.golden, 0), ("--golden-tokens", args.golden_tokens, 1),
                ("--threads", args.threads, 1)]  # fmt: skip
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
    from keel.eval.run import run_eval, write_json
    from keel.quant.loading import load_model
    from keel.serve.llm import LLM

    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_model(args.model, config.load.dtype, head_dim=args.head_dim, num_heads=args.num_heads,
                        **config.quant.load_options())  # fmt: skip
    if loaded.tokenizer is None:
        raise KeelError(f"{args.model}: no tokenizer found (tokenizer.json or GGUF tokenizer metadata)")
    suites = resolve_suites(args.suite, loaded.tokenizer, args.limit, args.needle_lengths, args.needle_depths)
    ppl_tokens, corpus = None, None
    if args.ppl_corpus != "none":
        corpus, text = corpus_text(args.ppl_corpus)
        ppl_tokens = leading_tokens(loaded.tokenizer, text, args.ppl_max_tokens)
    llm = LLM(loaded, config, adapt=True)
    check_lengths(args, suites, llm.engine.max_model_len, ppl_tokens)
    manifest = build_manifest(str(args.model), llm.engine)
    record = run_eval(llm, suites, golden=args.golden, golden_tokens=args.golden_tokens, ppl_tokens=ppl_tokens,
                      ppl_context=args.ppl_context, ppl_stride=args.ppl_stride, ppl_corpus=corpus,
                      manifest=manifest)  # fmt: skip
    print(summary_table(record))
    if args.out:
        write_json(args.out, record)
        print(f"results and manifest written to {args.out}")
    sys.stdout.flush()
    return 0


def summary_table(record: dict) -> str:
    lines = [f"{'suite':<24} {'dimension':<24} {'n':>4} {'metric':<12} {'score':>6} {'95% CI':>15} {'chance':>7}"]
    for name, s in record["suites"].items():
        for metric, m in s["metrics"].items():
            chance = f"{s['chance']:.3f}" if s["chance"] is not None and metric.startswith("acc") else ""
            lines.append(f"{name:<24} {s['dimension']:<24} {m['n']:>4} {metric:<12} {m['value']:>6.3f} "
                         f"[{m['ci95'][0]:.3f}, {m['ci95'][1]:.3f}] {chance:>7}")  # fmt: skip
        for group, m in s.get("groups", {}).items():
            lines.append(f"  {name} @ {group:<18} {'':<19} {m['n']:>4} {'':<12} {m['value']:>6.3f} "
                         f"[{m['ci95'][0]:.3f}, {m['ci95'][1]:.3f}]")  # fmt: skip
    lines.append("dimensions:")
    for name, m in record["dimensions"].items():
        lines.append(f"  {name:<28} {m['n']:>4} items  {m['value']:.3f} [{m['ci95'][0]:.3f}, {m['ci95'][1]:.3f}]")
    if "perplexity" in record:
        p = record["perplexity"]
        lines.append(f"perplexity on {p['corpus']}: {p['perplexity']:.4f} ({p['tokens_scored']} tokens, "
                     f"context {p['context']}, stride {p['stride']})")  # fmt: skip
    if "golden" in record:
        lines.append(f"golden greedy outputs: {len(record['golden']['outputs'])} prompts x "
                     f"{record['golden']['max_tokens']} tokens")  # fmt: skip
    return "\n".join(lines)


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
