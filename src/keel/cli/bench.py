"""`keel bench serve`: load-test an OpenAI-compatible server (keel.tools.bench_serve runs it)."""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import sys

from keel.tools.bench_serve import (
    ENDPOINTS,
    MAX_ERRORS_SHOWN,
    BenchServeConfig,
    format_table,
    parse_goodput,
    parse_percentiles,
    run_benchmark,
    write_result_file,
)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmarks")
    bench_sub = p.add_subparsers(dest="bench_command", required=True, metavar="BENCHMARK")
    _register_serve(bench_sub)


def config_from_args(args: argparse.Namespace) -> BenchServeConfig:
    """Build and validate the run configuration from the `keel bench serve` arguments."""
    config = BenchServeConfig(
        base_url=args.base_url,
        model=args.model,
        endpoint=args.endpoint,
        num_prompts=args.num_prompts,
        request_rate=args.request_rate,
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        input_len=args.input_len,
        output_len=args.output_len,
        range_ratio=args.range_ratio,
        dataset=args.dataset,
        seed=args.seed,
        api_key=args.api_key or os.environ.get("OPENAI_API_KEY") or None,
        ignore_eos=args.ignore_eos,
        temperature=args.temperature,
        goodput=parse_goodput(args.goodput or []),
        percentiles=parse_percentiles(args.percentiles),
        timeout=args.timeout,
        disable_tqdm=args.disable_tqdm,
        label=args.label,
        result_file=args.result_file,
    )
    config.validate()
    return config


def run_serve(args: argparse.Namespace) -> int:
    """`keel bench serve`: run, print the table, write the JSON; 1 if no request completed."""
    config = config_from_args(args)
    distribution = "Poisson process" if config.burstiness == 1.0 else "Gamma distribution"
    print(f"Traffic request rate: {config.request_rate}", file=sys.stderr)
    print(f"Burstiness factor: {config.burstiness} ({distribution})", file=sys.stderr)
    print(f"Maximum request concurrency: {config.max_concurrency}", file=sys.stderr)
    result = asyncio.run(run_benchmark(config))
    print(format_table(result))
    errors = [e for e in result.errors if e]
    for error in errors[:MAX_ERRORS_SHOWN]:
        print(f"keel: failed request: {error}", file=sys.stderr)
    if len(errors) > MAX_ERRORS_SHOWN:
        print(f"keel: ... and {len(errors) - MAX_ERRORS_SHOWN} more failed requests", file=sys.stderr)
    if config.result_file:
        print(f"wrote {write_result_file(result, config.result_file)}", file=sys.stderr)
    if result.completed == 0:
        print("keel: error: every request failed", file=sys.stderr)
        return 1
    return 0


def _register_serve(subparsers: argparse._SubParsersAction) -> None:
    """`keel bench serve`."""
    p = subparsers.add_parser(
        "serve",
        help="load-test an OpenAI-compatible server (vLLM's serving metrics)",
        description="Load-test an OpenAI-compatible server and report vLLM's serving-benchmark metrics.",
    )
    p.add_argument("--base-url", required=True, metavar="URL", help="server root, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", required=True, help="model name sent in every request")
    p.add_argument("--endpoint", choices=list(ENDPOINTS), default="completions", help="default: completions")
    p.add_argument("--num-prompts", type=int, default=200, metavar="N", help="requests to send (default 200)")
    p.add_argument(
        "--request-rate", type=float, default=math.inf, metavar="R", help="requests/s, or inf = all at once (default)"
    )
    p.add_argument(
        "--burstiness", type=float, default=1.0, metavar="B", help="gamma shape of the arrivals; 1 = Poisson (default)"
    )
    p.add_argument("--max-concurrency", type=int, default=None, metavar="C", help="cap on requests in flight")
    p.add_argument("--input-len", type=int, default=256, metavar="L", help="prompt tokens (default 256)")
    p.add_argument("--output-len", type=int, default=128, metavar="L", help="max_tokens per request (default 128)")
    p.add_argument(
        "--range-ratio",
        type=float,
        default=0.0,
        metavar="F",
        help="lengths uniform in [L*(1-F), L*(1+F)] (default 0)",
    )
    p.add_argument(
        "--dataset",
        default=None,
        metavar="FILE",
        help='.jsonl of {"prompt", "output_len"?} objects, or a plain-text corpus to cut prompts from; '
        "default: random words (approximate lengths)",
    )
    p.add_argument("--seed", type=int, default=0, help="seeds prompts, lengths and arrivals (default 0)")
    p.add_argument("--api-key", default=None, help="Bearer token (default: $OPENAI_API_KEY if set)")
    p.add_argument("--ignore-eos", action="store_true", help="send ignore_eos: true so output lengths are exact")
    p.add_argument("--temperature", type=float, default=0.0, help="default 0 (greedy)")
    p.add_argument(
        "--goodput", nargs="+", default=None, metavar="KEY:VALUE", help="SLOs in ms, e.g. ttft:500 tpot:50 e2el:10000"
    )
    p.add_argument("--percentiles", default="50,90,99", help="comma-separated (default 50,90,99)")
    p.add_argument("--result-file", default=None, metavar="PATH", help="write the full result as JSON")
    p.add_argument("--label", default=None, help="free text stored in the JSON")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request (default 600)")
    p.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    p.set_defaults(func=run_serve)
