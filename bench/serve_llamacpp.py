"""Serving: `keel serve` against llama.cpp's `llama-server` on one workload, one server at a time.

    make bench-deps   # builds .bench-deps/llama-server (and llama-cpp-python)
    python bench/serve_llamacpp.py [MODEL] [--num-prompts 64] [--threads 2] [--keel-args "..."] [--llama-args "..."]

Workload (seeded): --num-prompts requests sent at once, each "Continue the following text:" and a
window of Shakespeare's works cut to a uniform 44-250 tokens (SmolLM2's tokenizer), asking for a
uniform 64-128 tokens with EOS ignored (`ignore_eos`, which both servers honour); streaming
/v1/completions, greedy. keel serves the GGUF file in its default serving setup (`--quantize auto`: the
file's blocks on keel's kernels, compiled decode, continuous batching); llama-server serves the same file with
`-t THREADS -np 16 -cb` (16 slots, continuous batching) and a context of 16 x 512 tokens. Both are
measured by `keel bench serve` (vLLM's metric names); the table shows output tok/s and inter-token
latency (p50, p99) of every run and the ratios keel / llama-server of the medians. --rounds N
alternates the servers N times (a shared machine's throughput drifts by +-10% between runs). The
servers never run at the same time.
--llama-args adds llama-server options: on an AMX CPU this build's repacked weights crash llama-server
on its first prompt batch (SIGSEGV), so there it runs with `--no-repack` (docs/BENCHMARKS.md, fifth part).
Results (the full JSON of each run) go to --result-dir.
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from keel.data.corpora import shakespeare_path
from keel.net import free_port
from keel.quant.loading import load_model
from keel.serve.openai.child import ServerProcess
from keel.weights.loader import resolve_path

PREFIX = "Continue the following text:\n\n"


def build_dataset(model: str, path: Path, n: int, seed: int) -> None:
    tokenizer = load_model(model, "bfloat16").tokenizer
    words = shakespeare_path().read_text().split()
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            want = rng.randint(44, 250)
            start = rng.randrange(len(words) - 400)
            ids = tokenizer.encode(PREFIX + " ".join(words[start : start + 300]))[:want]
            f.write(json.dumps({"prompt": tokenizer.decode(ids), "output_len": rng.randint(64, 128)}) + "\n")


def run_bench(base_url: str, model: str, dataset: Path, result: Path, label: str) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "keel.cli",
        "bench",
        "serve",
        "--base-url",
        base_url,
        "--model",
        model,
        "--dataset",
        str(dataset),
        "--num-prompts",
        str(sum(1 for _ in open(dataset))),
        "--ignore-eos",
        "--result-file",
        str(result),
        "--label",
        label,
        "--disable-tqdm",
    ]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads(result.read_text())


def wait_health(url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise SystemExit(f"llama-server exited with code {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit("llama-server not ready")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="smollm2-135m-instruct")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--llama-server", default=".bench-deps/llama-server")
    parser.add_argument("--keel-args", default="", help="extra `keel serve` options, e.g. '--no-compile'")
    parser.add_argument("--llama-args", default="", help="extra llama-server options, e.g. '--no-repack'")
    parser.add_argument("--result-dir", default="out/serve-llamacpp")
    parser.add_argument("--rounds", type=int, default=1, help="alternate the servers this many times; medians")
    args = parser.parse_args()
    out = Path(args.result_dir)
    out.mkdir(parents=True, exist_ok=True)
    dataset = out / "prompts.jsonl"
    build_dataset(args.model, dataset, args.num_prompts, args.seed)
    gguf = resolve_path(args.model)
    keel_args = ["--threads", str(args.threads), "--kv-cache-memory", "1GiB", *shlex.split(args.keel_args)]
    llama_cmd = [
        args.llama_server,
        "-m",
        str(gguf),
        "-t",
        str(args.threads),
        "-tb",
        str(args.threads),
        "-np",
        "16",
        "-cb",
        "-c",
        str(16 * 512),
        "--host",
        "127.0.0.1",
        *shlex.split(args.llama_args),
    ]
    # Rounds alternate the servers, each started fresh (no prefix cache carried over), so that a slow
    # spell of a shared machine falls on both; the ratio is of the medians.
    runs: dict[str, list[dict]] = {"keel": [], "llama-server": []}
    for i in range(args.rounds):
        runs["keel"].append(run_keel(args.model, keel_args, dataset, out, i))
        runs["llama-server"].append(run_llama(args.model, llama_cmd, dataset, out, i))

    print(f"command: python bench/{Path(__file__).name} {shlex.join(sys.argv[1:])}")
    print(
        f"{args.num_prompts} requests at once, prompts 44-250 tokens, outputs 64-128 (EOS ignored), "
        f"{args.threads} threads, {gguf.name}, {args.rounds} round(s)"
    )
    print(
        f"{'server':<14} {'round':>5} {'done':>5} {'duration s':>10} {'output tok/s':>12} {'ITL p50 ms':>10} "
        f"{'ITL p99 ms':>10} {'p99/p50':>8} {'TTFT p50 ms':>11}"
    )
    for name, rs in runs.items():
        for i, r in enumerate(rs):
            print(
                f"{name:<14} {i + 1:>5} {r['completed']:>5} {r['duration']:10.1f} {r['output_throughput']:12.1f} "
                f"{r['median_itl_ms']:10.1f} {r['p99_itl_ms']:10.1f} {r['p99_itl_ms'] / r['median_itl_ms']:8.2f} "
                f"{r['median_ttft_ms']:11.0f}"
            )
    keel_tps = statistics.median(r["output_throughput"] for r in runs["keel"])
    llama_tps = statistics.median(r["output_throughput"] for r in runs["llama-server"])
    spread = statistics.median(r["p99_itl_ms"] / r["median_itl_ms"] for r in runs["keel"])
    print(
        f"medians: keel {keel_tps:.1f}, llama-server {llama_tps:.1f} output tok/s; keel / llama-server "
        f"{keel_tps / llama_tps:.2f}x (floor 2x); keel p99 ITL / p50 ITL {spread:.2f} (floor <= 3)"
    )


def run_keel(model: str, keel_args: list[str], dataset: Path, out: Path, i: int) -> dict:
    server = ServerProcess(model, *keel_args, log_path=out / f"server-keel-{i}.log").wait_ready(timeout=600)
    try:
        return run_bench(server.base_url, model, dataset, out / f"keel-{i}.json", "keel serve " + " ".join(keel_args))
    finally:
        server.terminate()


def run_llama(model: str, cmd: list[str], dataset: Path, out: Path, i: int) -> dict:
    port = free_port()
    cmd = [*cmd, "--port", str(port)]
    with open(out / f"server-llama-{i}.log", "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_health(f"http://127.0.0.1:{port}", proc)
            return run_bench(f"http://127.0.0.1:{port}", model, dataset, out / f"llama-{i}.json", " ".join(cmd))
        finally:
            proc.terminate()
            proc.wait(30)


if __name__ == "__main__":
    main()
