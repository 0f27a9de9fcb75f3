"""Training throughput: keel's trainer against a plain transformers loop, and FSDP memory per rank.

    python bench/train.py [--steps 10] [--seq-len 256] [--batch 8] [--threads 2] [--precision bf16]
                          [--compile] [--trim-heap-rounds N] [--device auto|cpu|cuda] [--model small|1b]

Same Llama config (`small`: ~134M parameters, hidden 768, 12 layers, 12 heads, FFN 2048, vocab 32000,
untied; `1b`: TinyLlama-1.1B's shape, for a GPU), same random-token data, same AdamW settings and threads,
one process each, one after the other, on the CPU or on one CUDA device (`--device`; keel's trainer takes
the GPU wherever torch sees one, and MFU is then against the device's datasheet peak):
1. a plain loop over transformers' `LlamaForCausalLM` (forward with labels, backward, clip,
   AdamW step), the baseline;
2. keel's `Trainer` (the same model through keel's module, its loader, clipping, guard, metrics);
3. keel's `Trainer` with FSDP over 2 ranks (torchrun, gloo; NCCL on 2 GPUs, left out with one), for the
   per-rank parameter + gradient + optimizer bytes against single-process (the ZeRO-3 prediction:
   1/dp_shard of 16 B per parameter, plus the unsharded remainder).
With --trim-heap-rounds N, keel's one-process and FSDP x2 runs also with `run.trim_heap`, alternated with
the default N times each (its step-time cost).
Tokens/s is the median over the steps after the first (warm-up); MFU uses the measured matmul peak
in the training dtype on the same threads (keel.train.metrics). Prints a table and the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

CONFIG = dict(
    architectures=["LlamaForCausalLM"],
    vocab_size=32000,
    hidden_size=768,
    intermediate_size=2048,
    num_hidden_layers=12,
    num_attention_heads=12,
    num_key_value_heads=12,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
    rms_norm_eps=1e-5,
    eos_token_id=2,
)
# TinyLlama-1.1B's shape (grouped-query attention, 4 KV heads): ~1.1B parameters, for one GPU.
SIZES = {
    "small": {},
    "1b": dict(
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=22,
        num_attention_heads=32,
        num_key_value_heads=4,
    ),
}


def transformers_loop(args, data: np.ndarray) -> list[float]:
    from transformers import LlamaConfig, LlamaForCausalLM

    hf = {k: v for k, v in CONFIG.items() if k != "architectures"}
    torch.manual_seed(0)
    device = torch.device(args.device)
    model = LlamaForCausalLM(LlamaConfig(**hf)).to(device)
    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    times, s = [], args.seq_len
    for step in range(args.steps):
        first = step * args.batch
        rows = np.stack([data[(first + i) * s : (first + i) * s + s] for i in range(args.batch)])
        ids = torch.from_numpy(rows.astype(np.int64)).to(device)
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    if device.type == "cuda":
        print(f"transformers loop: peak {torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB allocated")
        del model, opt
        torch.cuda.empty_cache()  # keel's runs are processes of their own: give them the device's memory
    return times


def write_config(root: Path, args, name: str, extra: str = "", dp: int = 1) -> Path:
    model = "\n".join(f"{k} = {json.dumps(v)}" for k, v in CONFIG.items())
    text = f"""
[run]
name = "{name}"
dir = "{root}/runs/{{name}}"
[model]
tokenizer = "{args.tokenizer}"
[model.config]
{model}
[data]
path = "{root}/data.bin"
seq_len = {args.seq_len}
[training]
steps = {args.steps}
global_batch_size = {args.batch}
micro_batch_size = {min(args.micro, args.batch // dp)}
precision = "{args.precision}"
[optimizer]
lr = 3e-4
[checkpoint]
interval = 0
keep = 1
async_save = false
[guard]
spike = "off"
[log]
progress = false
{extra}
"""
    path = root / f"{name}.toml"
    path.write_text(text)
    return path


def keel_run(root: Path, args, name: str, nproc: int, overrides: tuple[str, ...] = ()) -> list[dict]:
    config = write_config(root, args, name, dp=nproc)
    cmd = [sys.executable, "-m", "keel.cli", "train", str(config), "--nproc", str(nproc)]
    cmd += [a for override in overrides for a in ("--set", override)]
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, args.threads // nproc)), "KEEL_BENCH_MEMORY": "1"}
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        sys.exit(f"keel train failed:\n{r.stderr[-3000:]}")
    lines = (root / "runs" / name / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if '"loss"' in line]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--precision", default="bf16", choices=["fp32", "bf16"])
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto: CUDA if torch sees it")
    parser.add_argument(
        "--tokenizer",
        default="smollm2-135m-instruct",
        help="the runs' tokenizer: a catalog name or a model directory (only saved with checkpoints)",
    )
    parser.add_argument("--model", default="small", choices=sorted(SIZES), help="the Llama shape (1b: for a GPU)")
    parser.add_argument("--compile", action="store_true", help="also keel with torch.compile per block")
    parser.add_argument(
        "--trim-heap-rounds",
        type=int,
        default=0,
        help="also one process with run.trim_heap, alternated with the default this many times each",
    )
    args = parser.parse_args()
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    CONFIG.update(SIZES[args.model])
    torch.set_num_threads(args.threads)
    print("command: python bench/train.py " + " ".join(sys.argv[1:]))
    from keel.config import ModelConfig
    from keel.train.metrics import flops_per_token, measure_cpu_peak, peak_flops

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        rng = np.random.default_rng(0)
        data = rng.integers(3, 32000, size=args.seq_len * args.batch * (args.steps + 2) + 1).astype(np.uint16)
        from keel.train.data import write_token_file

        write_token_file(root / "data.bin", data, vocab_size=32000, eos_id=2)
        tokens = args.batch * args.seq_len
        base = transformers_loop(args, data)
        base_tps = tokens / statistics.median(base[1:])
        single = keel_run(root, args, "single", 1)
        compiled = keel_run(root, args, "compiled", 1, ("training.compile=true",)) if args.compile else None
        keel_tps = statistics.median(r["tokens_per_s"] for r in single[1:])
        dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
        if args.device == "cuda":
            peak, source = peak_flops(torch.device("cuda"), args.precision)
            where = f"{torch.cuda.get_device_name()}, {source} {dtype} peak {peak / 1e12:.0f} TFLOP/s"
            memory = single[-1]["peak_memory_bytes"] / 2**30
            print(f"keel train, 1 process: peak {memory:.2f} GiB allocated")
        else:
            peak = measure_cpu_peak(dtype)
            where = f"{args.threads} threads, measured {dtype} matmul peak {peak / 1e9:.1f} GFLOP/s"
        fpt = flops_per_token(ModelConfig.from_hf(CONFIG), args.seq_len)
        rows = [
            ("transformers loop (LlamaForCausalLM + AdamW)", base_tps),
            ("keel train, 1 process", keel_tps),
        ]
        if compiled is not None:  # the first steps compile: the median of the last half
            rows.append(
                (
                    "keel train, 1 process, training.compile",
                    statistics.median(r["tokens_per_s"] for r in compiled[len(compiled) // 2 :]),
                )
            )
        total = ModelConfig.from_hf(CONFIG).param_counts()["total"]
        print(f"\nmodel {total:,} parameters, {args.precision}, {tokens} tokens/step; {where}")

        def mfu(tps: float) -> str:
            return f"{fpt * tps / peak:.1%}" if peak else "-"  # an unknown GPU has no datasheet peak

        print(f"{'run':48} {'tokens/s':>10} {'MFU':>7}")
        for name, tps in rows:
            print(f"{name:48} {tps:10.1f} {mfu(tps):>7}")
        print(
            f"\nkeel / transformers: {keel_tps / base_tps:.2f}x (floor >= 1.0); "
            f"keel MFU {mfu(keel_tps)} of the peak above (floor >= 30%)"
        )
        for nproc in (1, 2) if args.trim_heap_rounds else ():  # run.trim_heap's step cost, alternated
            speeds: dict[bool, list[float]] = {False: [], True: []}
            for i in range(args.trim_heap_rounds):
                for trim in (False, True):
                    name, override = f"trim{int(trim)}-{nproc}-{i}", f"run.trim_heap={str(trim).lower()}"
                    runs = keel_run(root, args, name, nproc, (override,))
                    speeds[trim].append(statistics.median(r["tokens_per_s"] for r in runs[1:]))
            off, on = statistics.median(speeds[False]), statistics.median(speeds[True])
            print(
                f"\nrun.trim_heap, {'1 process' if nproc == 1 else 'FSDP x2'}, alternated: {on:.1f} against "
                f"{off:.1f} tokens/s ({on / off:.3f}x); each run's median: "
                f"off {[round(v, 1) for v in speeds[False]]}, on {[round(v, 1) for v in speeds[True]]}"
            )
        if args.device == "cuda" and torch.cuda.device_count() < 2:
            print("\nFSDP x2: left out (one GPU; two NCCL ranks cannot share it)")
            return 0
        # FSDP over 2 ranks: per-rank parameter + gradient + AdamW bytes against one process.
        fsdp = keel_run(root, args, "fsdp2", 2)
        one = single[0]["state_bytes"]
        two = fsdp[0]["state_bytes"]
        params = ModelConfig.from_hf(CONFIG).param_counts()["total"]
        predicted = 16 * params / 2  # ZeRO-3: (4 param + 4 grad + 8 AdamW) bytes / dp_shard, fp32 master
        fsdp_tps = statistics.median(r["tokens_per_s"] for r in fsdp[1:])
        print(
            f"\nper-rank parameter + gradient + optimizer bytes: 1 process {one['total'] / 2**20:.1f} MiB; "
            f"FSDP x2 rank 0 {two['total'] / 2**20:.1f} MiB = {two['total'] / one['total']:.3f}x (floor <= 0.6); "
            f"ZeRO-3 prediction 16 B x {params:,} / 2 = {predicted / 2**20:.1f} MiB"
        )
        print(f"FSDP x2 tokens/s (both ranks, 1 thread each): {fsdp_tps:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
