"""keel plan's predicted peak memory of keel training runs against the peak they measure.

Each case is a real `keel train` run (one process in-process, or FSDP2 over gloo ranks through
`keel train --nproc N`) with `[log] memory_breakdown = true`: step 2 (the first with optimizer
states) runs under torch's MemTracker and the metrics record holds the measured peak beside the
planner's prediction (keel.plan.run). Prints one row per case and the ratio predicted / measured.

    python bench/plan_memory.py            # the small cases (about 2 minutes on 2 cores)
    python bench/plan_memory.py --smollm2  # also the SmolLM2-135M shape, random init (about 4 more)
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from keel.train.config import load_config
from keel.train.data import write_token_file
from keel.train.metrics import read_metrics
from keel.train.trainer import Trainer

TINY = dict(hidden=256, intermediate=688, layers=4, heads=8, kv_heads=4, vocab=4096, seq=256, micro=4)
SMOLLM2 = dict(hidden=576, intermediate=1536, layers=30, heads=9, kv_heads=3, vocab=49152, seq=512, micro=2)


def config_text(
    root: Path,
    name: str,
    shape: dict,
    world: int,
    dtype="float32",
    precision="bf16",
    ac="none",
    every=1,
    moe=False,
    tie=False,
    accumulate=1,
) -> str:
    arch = "MixtralForCausalLM" if moe else "LlamaForCausalLM"
    experts = "num_local_experts = 4\nnum_experts_per_tok = 2\n" if moe else ""
    return f"""
[model]
tokenizer = "smollm2-135m-instruct"
dtype = "{dtype}"
[model.config]
architectures = ["{arch}"]
vocab_size = {shape["vocab"]}
hidden_size = {shape["hidden"]}
intermediate_size = {shape["intermediate"]}
num_hidden_layers = {shape["layers"]}
num_attention_heads = {shape["heads"]}
num_key_value_heads = {shape["kv_heads"]}
max_position_embeddings = 2048
tie_word_embeddings = {str(tie).lower()}
eos_token_id = 2
{experts}
[run]
name = "{name}"
dir = "{root}/runs/{{name}}"
[data]
path = "{root / "data.bin"}"
seq_len = {shape["seq"]}
[training]
steps = 2
global_batch_size = {shape["micro"] * world * accumulate}
micro_batch_size = {shape["micro"]}
precision = "{precision}"
[activation_checkpoint]
mode = "{ac}"
every = {every}
[checkpoint]
async_save = false
resume = "none"
[log]
progress = false
memory_breakdown = true
"""


def run_case(root: Path, name: str, world: int, text: str) -> dict:
    path = root / f"{name}.toml"
    path.write_text(text)
    if world == 1:
        trainer = Trainer(load_config(path, []))
        trainer.train_step()
        return trainer.train_step()["memory"]
    done = subprocess.run(
        [sys.executable, "-m", "keel", "train", str(path), "--nproc", str(world)], capture_output=True, text=True
    )
    if done.returncode:
        raise SystemExit(f"{name}: keel train failed\n{done.stderr[-2000:]}")
    return next(r["memory"] for r in read_metrics(root / "runs" / name / "metrics.jsonl") if "memory" in r)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smollm2", action="store_true", help="also the SmolLM2-135M shape (slower)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cases = [
        ("tiny", 1, dict()),
        ("tiny", 1, dict(ac="full")),
        ("tiny", 1, dict(precision="fp32")),
        ("tiny", 1, dict(precision="fp32", ac="full")),
        ("tiny", 1, dict(dtype="bfloat16", ac="selective", every=2)),
        ("tiny", 1, dict(tie=True, accumulate=2)),
        ("tiny", 1, dict(moe=True)),
        ("tiny", 1, dict(moe=True, ac="full")),
        ("tiny", 2, dict()),
        ("tiny", 2, dict(ac="full")),
        ("tiny", 2, dict(accumulate=2)),
        ("tiny", 2, dict(moe=True, ac="full")),
        ("tiny-32k", 2, dict(ac="full")),
        ("tiny-32k", 2, dict(ac="full", tie=True)),
    ]
    if args.smollm2:
        cases += [
            ("smollm2", 1, dict()),
            ("smollm2", 1, dict(ac="full")),
            ("smollm2", 2, dict()),
            ("smollm2", 2, dict(ac="full")),
        ]
    shapes = {"tiny": TINY, "tiny-32k": dict(TINY, vocab=32768), "smollm2": SMOLLM2}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        rng = np.random.default_rng(0)
        write_token_file(root / "data.bin", rng.integers(3, 4000, size=200_000), vocab_size=4096, eos_id=2)
        print(f"torch {torch.__version__}, {args.threads} threads; MiB of tensor memory per rank")
        print(
            f"{'model':<8} {'ranks':>5} {'recipe':<34} {'measured':>9} {'predicted':>9} {'ratio':>6}  predicted peak at"
        )
        for i, (shape, world, recipe) in enumerate(cases):
            text = config_text(root, f"case{i}", shapes[shape], world, **recipe)
            memory = run_case(root, f"case{i}", world, text)
            label = ", ".join(f"{k}={v}" for k, v in recipe.items()) or "bf16 autocast, float32 weights"
            measured, predicted = memory["measured_peak"], memory["predicted_peak"]
            print(
                f"{shape:<8} {world:>5} {label:<38} {measured / 2**20:9.1f} {predicted / 2**20:9.1f} "
                f"{predicted / measured:6.3f}  {memory['predicted']['moment']}",
                flush=True,
            )


if __name__ == "__main__":
    main()
