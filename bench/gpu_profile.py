"""Where a keel step's time goes on one CUDA device: the host (cProfile) and the device (torch.profiler).

    python bench/gpu_profile.py [--device cuda] [--out DIR]
    python bench/gpu_profile.py --tiny --device cpu            # a smoke test of the same code

On bench/gpu_bench.py's model (a random Llama of Llama-3.2-1B's shape, bf16, the engine as served:
compiled decode with CUDA graphs, the probe's attention backend), two phases:

1. Batch-1 decode: 60 steps after warm-up, each step's wall time; cProfile over 40 of them and
   torch.profiler over 20.
2. Offline: 256 requests as in gpu_bench's offline run: torch.profiler over the first 4 steps (admission:
   prefill chunks beside the decodes), then every step's wall time with the requests that gained a token;
   cProfile and torch.profiler over 30 steps once the first prefills are in.

Every timed step is synchronised, so under asynchronous scheduling (CUDA's default) a timed step is its
host and device work one after the other; the untimed loops overlap them.

Writes under --out: steps.txt (per-step times and the summaries), host-*.txt (cProfile, by cumulative and
own time), device-*.txt (torch.profiler's operator table by device time and by host time; device-admission.txt
for the first offline steps).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from gpu_bench import LLAMA_1B, TINY, keel_engine, save_random_llama, synchronize  # noqa: E402
from throughput import make_workload  # noqa: E402


def timed_steps(engine, device: torch.device, steps: int) -> list[tuple[float, int]]:  # noqa: ANN001
    """(seconds, requests that gained a token) of each of up to `steps` engine steps."""
    rows = []
    for _ in range(steps):
        if not engine.has_unfinished_requests():
            break
        synchronize(device)
        start = time.perf_counter()
        outputs = engine.step()
        synchronize(device)
        rows.append((time.perf_counter() - start, len(outputs)))
    return rows


def host_profile(engine, steps: int, out: Path, name: str) -> None:  # noqa: ANN001
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(steps):
        if engine.has_unfinished_requests():
            engine.step()
    profile.disable()
    for key in ("cumulative", "tottime"):
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats(key).print_stats(45)
        (out / f"host-{name}-{key}.txt").write_text(text.getvalue())


def device_profile(engine, device: torch.device, steps: int, out: Path, name: str) -> None:  # noqa: ANN001
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            if engine.has_unfinished_requests():
                engine.step()
        synchronize(device)
    averages = prof.key_averages()
    by_device = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    (out / f"device-{name}.txt").write_text(
        averages.table(sort_by=by_device, row_limit=40, max_name_column_width=90)
        + "\n\nby host time\n"
        + averages.table(sort_by="cpu_time_total", row_limit=30, max_name_column_width=90)
    )


def summary(label: str, rows: list[tuple[float, int]]) -> str:
    if not rows:
        return f"{label}: no steps\n"
    times = [r[0] * 1e3 for r in rows]
    median, mean = statistics.median(times), statistics.mean(times)
    return f"{label}: {len(rows)} steps, median {median:.2f} ms, mean {mean:.2f} ms, max {max(times):.2f} ms\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--out", default="/tmp/gpu_profile")
    args = parser.parse_args()
    device = torch.device(args.device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = io.StringIO()

    def say(line: str) -> None:
        print(line, end="", flush=True)
        report.write(line)

    with tempfile.TemporaryDirectory(prefix="keel-gpu-profile-") as tmp:
        path = save_random_llama(Path(tmp) / "llama", TINY if args.tiny else LLAMA_1B, 0)
        start = time.perf_counter()
        engine = keel_engine(path, "bfloat16", device, max_num_seqs=256, max_model_len=1024,
                             max_num_batched_tokens=4096, gpu_memory_utilization=0.5)  # fmt: skip
        say(f"engine ready in {time.perf_counter() - start:.1f} s: {engine.backends}\n")
        vocab = engine.model.config.vocab_size
        from keel.serve import SamplingParams

        prompt = torch.randint(0, vocab, (128,), generator=torch.Generator().manual_seed(1)).tolist()
        engine.add_request(prompt, SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))
        rows = timed_steps(engine, device, 1)
        say(summary("batch-1 prefill step", rows))
        timed_steps(engine, device, 10)
        rows = timed_steps(engine, device, 60)
        say(summary("batch-1 decode steps (synchronised each)", rows))
        host_profile(engine, 40, out, "batch1")
        device_profile(engine, device, 20, out, "batch1")
        while engine.has_unfinished_requests():
            engine.step()

        work = make_workload(16 if args.tiny else 256, 8 if args.tiny else 64, 32 if args.tiny else 256, vocab, 0)
        for p, n in zip(work.prompts, work.output_lens, strict=True):
            engine.add_request(p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
        offline_start = time.perf_counter()
        # The admission steps (prefill chunks of new requests beside the running decodes: 135-175 ms each on
        # an H200 in the first session, never broken down since): torch.profiler over the first few.
        device_profile(engine, device, 4, out, "admission")
        rows = timed_steps(engine, device, 36)
        say(summary("offline: steps 5-40 (prefill-heavy)", rows))
        say("  per step ms / outputs: " + " ".join(f"{t * 1e3:.1f}/{d}" for t, d in rows) + "\n")
        host_profile(engine, 30, out, "offline")
        device_profile(engine, device, 30, out, "offline")
        rows = timed_steps(engine, device, 100000)
        seconds = time.perf_counter() - offline_start
        say(summary("offline: the rest", rows))
        say(
            f"offline: {len(work)} requests, {work.output_tokens} tokens in {seconds:.1f} s (the profiled "
            f"windows included): {work.output_tokens / seconds:.0f} tok/s\n"
        )
        say("  per step ms / outputs (every 10th): "
            + " ".join(f"{t * 1e3:.1f}/{d}" for t, d in rows[::10]) + "\n")  # fmt: skip
    (out / "steps.txt").write_text(report.getvalue())


if __name__ == "__main__":
    main()
