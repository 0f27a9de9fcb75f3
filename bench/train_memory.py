"""Peak host memory per rank while an FSDP run starts and takes its first step, against ZeRO-3's share.

    python bench/train_memory.py [--worlds 2 4] [--seq-len 128] [--threads 2] [--set KEY=VALUE]...

A ~245M-parameter Llama (hidden 1024, 14 layers, 16 heads, FFN 2816, vocab 32000, untied) in float32,
trained for two steps by `keel train --nproc N` (FSDP2 over N gloo ranks, one sequence of 128 tokens
per rank). Each rank measures its resident set once the model's skeleton exists on the meta device
(the baseline: torch, keel, the process group, the tokenizer), then its high-water mark after
start-up (the model sharded and each rank's shards materialised) and after the first step (which
creates AdamW's states); the run records the largest rank's peaks above its baseline
(keel.train.trainer, `start_memory` in metrics.jsonl). The second step's peak is the steady state.

Compared with the ZeRO-3 prediction, 16 B x P / N (float32 weights, gradients and AdamW's two moments,
sharded) plus the step's activations (keel.plan.run's prediction of what a step keeps for backward,
the logits and their gradient), with 4 B x P / N (the weights alone) for start-up, and with the
whole model's float32 bytes (4 B x P), which no rank may reach during start-up; the steady state
against keel.plan.run's whole prediction (which adds FSDP's gathered units and reduce-scatter
buffers).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

CONFIG = dict(
    architectures=["LlamaForCausalLM"],
    vocab_size=32000,
    hidden_size=1024,
    intermediate_size=2816,
    num_hidden_layers=14,
    num_attention_heads=16,
    num_key_value_heads=16,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
    rms_norm_eps=1e-5,
    eos_token_id=2,
)
MIB = 2**20


def write_config(root: Path, seq_len: int, world: int) -> Path:
    model = "\n".join(f"{k} = {json.dumps(v)}" for k, v in CONFIG.items())
    text = f"""
[run]
name = "fsdp{world}"
dir = "{root}/runs/{{name}}"
[model]
tokenizer = "smollm2-135m-instruct"
dtype = "float32"
[model.config]
{model}
[data]
path = "{root}/data.bin"
seq_len = {seq_len}
[training]
steps = 2
global_batch_size = {world}
micro_batch_size = 1
precision = "fp32"
[checkpoint]
interval = 0
keep = 1
async_save = false
[guard]
spike = "off"
[log]
progress = false
"""
    path = root / f"fsdp{world}.toml"
    path.write_text(text)
    return path


def run(root: Path, seq_len: int, world: int, threads: int, overrides: list[str]) -> tuple[dict, object, object]:
    from keel.config import ModelConfig
    from keel.plan.run import predict_run_memory, predict_run_moments
    from keel.train.config import load_config, resolve_layout

    path = write_config(root, seq_len, world)
    cmd = [sys.executable, "-m", "keel.cli", "train", str(path), "--nproc", str(world)]
    cmd += [arg for override in overrides for arg in ("--set", override)]
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, threads // world))}
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        sys.exit(f"keel train failed:\n{r.stderr[-3000:]}")
    lines = (root / "runs" / f"fsdp{world}" / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines if '"loss"' in line]
    measured = dict(records[0]["start_memory"])
    measured["steady_peak_bytes"] = records[-1]["peak_memory_bytes"] - measured["baseline_bytes"]
    cfg = load_config(path, overrides)
    model, layout = ModelConfig.from_hf(CONFIG), resolve_layout(cfg, world)
    return measured, predict_run_memory(cfg, model, layout), predict_run_moments(cfg, model, layout)[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="a `keel train --set` override")
    args = parser.parse_args()
    from keel.config import ModelConfig
    from keel.train.data import write_token_file

    print("command: python bench/train_memory.py " + " ".join(sys.argv[1:]))
    print(f"CPU capability {torch.backends.cpu.get_cpu_capability()}, {args.threads} threads shared by the ranks")
    params = ModelConfig.from_hf(CONFIG).param_counts()["total"]
    print(f"model {params:,} parameters; whole model in float32 {4 * params / MIB:.1f} MiB\n")
    print(
        f"{'ranks':>5} {'start-up':>10} {'/ 4P/N':>7} {'/ 4P':>6} {'first step':>11} {'ZeRO-3+act':>11} "
        f"{'ratio':>6} {'steady':>9} {'planned':>9} {'ratio':>6}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        data = np.random.default_rng(0).integers(3, 32000, size=args.seq_len * 64 + 1).astype(np.uint16)
        write_token_file(root / "data.bin", data, vocab_size=32000, eos_id=2)
        for world in args.worlds:
            # first: "backward starts", every activation kept (the logits too)
            m, predicted, first = run(root, args.seq_len, world, args.threads, args.overrides)
            zero3 = 16 * params / world + first.activations
            startup, step, steady = m["startup_peak_bytes"], m["first_step_peak_bytes"], m["steady_peak_bytes"]
            print(
                f"{world:>5} {startup / MIB:>6.0f} MiB {startup / (4 * params / world):>6.2f}x "
                f"{startup / (4 * params):>5.2f}x {step / MIB:>7.0f} MiB {zero3 / MIB:>7.0f} MiB "
                f"{step / zero3:>5.2f}x {steady / MIB:>5.0f} MiB {predicted.peak / MIB:>5.0f} MiB "
                f"{steady / predicted.peak:>5.2f}x"
            )
            print(f"      (the plan's peak: {predicted.moment}; baseline RSS {m['baseline_bytes'] / MIB:.0f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
