"""Engine start-up with the compiled decode step: a cold compile cache, then a warm one.

    python bench/startup.py [MODEL] [--dtype bfloat16] [--threads 2]

Starts `LLMEngine(MODEL, compile=True)` in a fresh Python process twice, with `KEEL_CACHE` pointing
at a new empty directory: the first start compiles from nothing (inductor writes its FX-graph and
AOTAutograd caches there), the second reuses them, as a server restart would. For each it prints the
process wall time from launch until the engine is ready (interpreter and imports included), the
engine's own `startup_seconds` (load, fuse, pack, KV cache, compile) and `compile_seconds`, and
checks that one greedy request gives the same tokens both times. The floor of issue 9: a warm start
within 20 s.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = """
import json, sys, time, torch
torch.set_num_threads({threads})
from keel.serve.engine import EngineConfig, LLMEngine
from keel.serve.sampling import SamplingParams
engine = LLMEngine({model!r}, EngineConfig.of(dtype={dtype!r}, compile=True, kv_cache_memory="256MiB"))
ready = time.time()
engine.add_request("The capital of France is", SamplingParams(max_tokens=24, temperature=0.0))
out = []
while engine.has_unfinished_requests():
    out += engine.step()
print(json.dumps(dict(ready=ready, startup=engine.startup_seconds, compile=engine.compile_seconds,
                      tokens=out[-1].outputs[0].token_ids)))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    code = CHILD.format(model=args.model, dtype=args.dtype, threads=args.threads)
    runs = []
    with tempfile.TemporaryDirectory(prefix="keel-cache-") as cache:
        env = {**os.environ, "KEEL_CACHE": cache}
        env.pop("TORCHINDUCTOR_CACHE_DIR", None)
        for label in ("cold cache", "warm cache"):
            launch = time.time()
            done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
            result = json.loads(done.stdout.strip().splitlines()[-1])
            wall = result["ready"] - launch
            runs.append((label, wall, result))
        cache_mb = sum(f.stat().st_size for f in Path(cache).rglob("*") if f.is_file()) / 2**20
    print(f"command: python bench/{Path(__file__).name} {shlex.join(sys.argv[1:])}")
    print(f"{args.model} {args.dtype}, {args.threads} threads; inductor cache after the runs: {cache_mb:.0f} MiB")
    print(f"{'start':<11} {'process s':>9} {'engine s':>9} {'compile s':>9}  (process: launch to ready, incl. imports)")
    for label, wall, r in runs:
        print(f"{label:<11} {wall:9.1f} {r['startup']:9.1f} {r['compile']:9.1f}")
    same = runs[0][2]["tokens"] == runs[1][2]["tokens"]
    print(f"warm start {runs[1][1]:.1f} s (floor 20 s); same greedy tokens from both starts: {same}")


if __name__ == "__main__":
    main()
