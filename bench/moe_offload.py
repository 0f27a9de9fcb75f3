"""Expert offloading: serving throughput, hit rate, bytes loaded and stall time by resident share.

    python bench/moe_offload.py [--threads 2] [--num-requests 16] [--prompt-tokens 64] [--max-tokens 64]
                                [--budgets 25%,50%,100%] [--policy lru] [--storage host] [--dtype bfloat16]

Model: SmolLM2-135M-Instruct upcycled to an 8-expert top-2 Mixtral,
`keel upcycle smollm2-135m-instruct DST --experts 8 --top-k 2 --noise 0.01 --dtype bfloat16`
(30 MoE layers; the noise makes the experts differ, the random router spreads tokens over them),
built once under --cache-dir. Workload: --num-requests prompts of --prompt-tokens random token ids
(fixed seed) and --max-tokens greedy output tokens each (EOS ignored), all submitted at once to
LLMEngine. Each row loads the model afresh (offloading rewires it in place), serves one short
warm-up request, then the workload; counters are the workload's own. Rows: each --budgets value
(`--expert-cache`), and "off" (offloading disabled, the plain resident path). Ratios are against
the 100% row (the "off" row when 100% is not run); every row's tokens are checked against the
"off" row (identical outputs).

On a CPU, "resident" and "cold" are both host memory: the figures show what the mechanism costs
(copies, passes, bookkeeping), not PCIe transfers. Stall % = stall seconds / wall seconds.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

import torch


def build_model(cache_dir: Path, experts: int, top_k: int, noise: float) -> Path:
    """The upcycled checkpoint, built once (a few GB of RAM for a minute; reused afterwards)."""
    dst = cache_dir / f"smollm2-135m-{experts}x-top{top_k}-noise{noise:g}-bf16"
    if (dst / "config.json").exists():
        return dst
    from keel.cli import main as keel_main

    cmd = [
        "upcycle",
        "smollm2-135m-instruct",
        str(dst),
        "--experts",
        str(experts),
        "--top-k",
        str(top_k),
        "--noise",
        str(noise),
        "--dtype",
        "bfloat16",
        "--overwrite",
    ]
    print(f"building the model: keel {shlex.join(cmd)}", flush=True)
    if keel_main(cmd) != 0:
        sys.exit("keel upcycle failed")
    return dst


def run(model: Path, args: argparse.Namespace, budget: str | None, prompts: list[list[int]]) -> dict:
    from keel.quant.loading import load_model
    from keel.serve import EngineConfig, LLMEngine, SamplingParams

    config = EngineConfig.of(
        kv_cache_memory=args.kv_cache_memory,
        max_num_seqs=args.num_requests,
        max_model_len=args.prompt_tokens + args.max_tokens + 16,
        expert_cache=budget,
        expert_cache_policy=args.policy,
        expert_storage=args.storage,
        expert_prefetch=not args.no_prefetch,
    )
    engine = LLMEngine(load_model(model, args.dtype), config)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    engine.add_request(prompts[0][:8], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))  # warm-up
    while engine.has_unfinished_requests():
        engine.step()
    before = engine.offload.stats.snapshot() if engine.offload else None
    start = time.perf_counter()
    ids = [engine.add_request(p, params) for p in prompts]
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
    seconds = time.perf_counter() - start
    row = {
        "budget": budget or "off",
        "seconds": seconds,
        "tokens": [outputs[i] for i in ids],
        "output_tps": sum(len(outputs[i]) for i in ids) / seconds,
        "total_tps": (sum(map(len, prompts)) + sum(len(outputs[i]) for i in ids)) / seconds,
    }
    if engine.offload is not None:
        after, off = engine.offload.stats.snapshot(), engine.offload
        uses, hits = after.uses - before.uses, after.hits - before.hits
        predicted = after.predicted_slots - before.predicted_slots
        row.update(
            slots=off.slots_per_layer,
            resident_mib=off.resident_bytes / 2**20,
            hit_rate=hits / uses if uses else 0.0,
            loaded_mib=(after.bytes_loaded - before.bytes_loaded) / 2**20,
            stall=after.stall_seconds - before.stall_seconds,
            passes=after.extra_passes - before.extra_passes,
            accuracy=(after.predicted_right - before.predicted_right) / predicted if predicted else float("nan"),
        )
        off.close()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--budgets", default="25%,50%,100%", help="--expert-cache values, comma-separated")
    parser.add_argument("--policy", default="lru", choices=["lru", "lfu"])
    parser.add_argument("--storage", default="host", choices=["host", "disk"])
    parser.add_argument("--no-prefetch", action="store_true")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--kv-cache-memory", default="1GiB")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--noise", type=float, default=0.01)
    parser.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "keel" / "moe-offload")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(f"command: python bench/{Path(__file__).name} {shlex.join(sys.argv[1:])}", flush=True)
    torch.set_num_threads(args.threads)

    model = build_model(args.cache_dir, args.experts, args.top_k, args.noise)
    g = torch.Generator().manual_seed(args.seed)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    prompts = [torch.randint(0, vocab, (args.prompt_tokens,), generator=g).tolist() for _ in range(args.num_requests)]
    print(
        f"model {model.name} ({args.dtype}), torch threads {torch.get_num_threads()}, {args.num_requests} requests x "
        f"{args.prompt_tokens} prompt + {args.max_tokens} output tokens (greedy), policy {args.policy}, "
        f"storage {args.storage}, prefetch {'off' if args.no_prefetch else 'on'}",
        flush=True,
    )
    rows = []
    for budget in [None, *args.budgets.split(",")]:
        rows.append(run(model, args, budget, prompts))
        r = rows[-1]
        print(f"  {r['budget']}: {r['output_tps']:.1f} output tok/s in {r['seconds']:.1f} s", flush=True)
    reference = next((r for r in rows if r["budget"] == "100%"), rows[0])
    print()
    label = f"/ {reference['budget']}"
    head = (
        f"{'resident':<9} {'experts/layer':>13} {'MiB resident':>12} {'out tok/s':>9} {label:>7} "
        f"{'tok/s all':>9} {'hit rate':>8} {'MiB loaded':>10} {'stall s':>8} {'stall %':>7} "
        f"{'extra passes':>12} {'prefetch acc':>12} {'same tokens':>11}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        same = "yes" if r["tokens"] == rows[0]["tokens"] else "NO"
        ratio = r["output_tps"] / reference["output_tps"]
        if "slots" in r:
            detail = (
                f"{r['slots']:>13} {r['resident_mib']:>12.1f} {r['output_tps']:>9.1f} {ratio:>6.2f}x "
                f"{r['total_tps']:>9.1f} {r['hit_rate']:>8.1%} {r['loaded_mib']:>10.1f} {r['stall']:>8.3f} "
                f"{r['stall'] / r['seconds']:>7.1%} {r['passes']:>12} {r['accuracy']:>12.1%}"
            )
        else:
            detail = (
                f"{'all':>13} {'-':>12} {r['output_tps']:>9.1f} {ratio:>6.2f}x {r['total_tps']:>9.1f} "
                f"{'-':>8} {'-':>10} {'-':>8} {'-':>7} {'-':>12} {'-':>12}"
            )
        print(f"{r['budget']:<9} {detail} {same:>11}")


if __name__ == "__main__":
    main()
