"""Offline throughput: keel's engine (continuous batching) against transformers' static batches.

    python bench/throughput.py MODEL [--dtype float32|bfloat16] [--threads 2] [--num-requests 256]
    python bench/throughput.py --random-llama [...]     # a random ~134M-parameter Llama, built offline
    python bench/throughput.py MODEL.gguf --dtype float32 --quantize gguf --quant-keep '' \
        --reference-dtype bfloat16      # keel on the file's blocks, transformers in its own fastest dtype

Workload: --num-requests requests with prompt and output lengths uniform in [--min-len, --max-len]
(random token-id prompts, fixed seed), greedy, EOS ignored, so every request generates exactly its
output length. Output tok/s = generated tokens / wall time of the whole run (from adding the
requests to the last token), the same for every configuration:

  (a) keel, continuous batching over all requests (`LLMEngine.add_request` + `step`);
  (b) transformers `generate` in static batches of 1, 8 and 32 (left padding, attention mask):
      a batch runs until its longest output, and only each request's own output length counts
      as useful output;
  (c) keel with batching off (max_num_seqs=1).

Batch-1 runs (b at batch 1, c) go at ~15-25 tok/s on 2 cores, so the baselines run on a fixed
subset: the first --baseline-requests requests for batched transformers, the first
--batch1-requests for the batch-1 runs. Throughput is a rate, so a rate measured on a subset is
compared to a rate; keel is also run on the same subsets so every ratio has a like-for-like
companion. KV fragmentation is measured during (a) at every step: for each running request,
allocated-but-unused token slots = blocks held x block_size - tokens whose K/V are stored.

`--kv-cache-dtype int8` stores keel's KV cache as int8 rows with a scale per token and head (the engine's
option; a quarter of float32's bytes, for a workload whose attention re-reads long contexts every step).
`--quantize` loads keel's model quantized (`gguf`: the file's own blocks on keel's kernels; `int8`,
`int4`), with `--quant-keep` and `--quant-activations` as `keel serve` takes them; transformers runs
the same weights dequantized, in `--reference-dtype` (default: `--dtype`), so each side can run in
the dtype it is fastest in.

bfloat16 is the default: since decode attention runs as batched matmuls (not SDPA's CPU kernel,
~9x slower in bfloat16 for one-token queries), bfloat16 is the faster dtype here (see
docs/BENCHMARKS.md: 122.4 tok/s in bfloat16 after that change, 47.2 in float32 before it).
"""

from __future__ import annotations

import argparse
import gc
import shlex
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from keel.cli.config_options import comma_list
from keel.model.kv_size import KV_CACHE_DTYPES
from keel.quant.config import keep_for


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    def subset(self, n: int) -> Workload:
        return Workload(self.prompts[:n], self.output_lens[:n])

    def __len__(self) -> int:
        return len(self.prompts)

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)


def make_workload(n: int, lo: int, hi: int, vocab: int, seed: int) -> Workload:
    g = torch.Generator().manual_seed(seed)
    prompt_lens = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    output_lens = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    prompts = [torch.randint(0, vocab, (p,), generator=g).tolist() for p in prompt_lens]
    return Workload(prompts, output_lens)


@dataclass
class Result:
    name: str
    requests: int
    output_tokens: int  # useful output tokens
    seconds: float
    note: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def tps(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def cpu(self) -> float:
        """Process CPU time / (wall time x threads): well under 1 means the machine was contended."""
        return self.extra.get("cpu_seconds", 0.0) / self.seconds / torch.get_num_threads()


# ------------------------------------------------------------------ models
def random_llama_dir(dst: Path, seed: int) -> Path:
    """A random-weight Llama of ~134M parameters (GPT-2-small shape, untied head), saved offline."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=12,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(dst)
    return dst


def hf_reference_dir(model: str, tmp: Path) -> Path:
    path = Path(model)
    if (path / "config.json").exists():
        return path
    from keel.weights.convert import convert

    return convert(model, tmp / "hf", dtype="float32")


# -------------------------------------------------------------------- keel
def engine_config(args, **overrides):
    from keel.serve import EngineConfig

    fields = dict(
        block_size=args.block_size,
        kv_cache_memory=args.kv_cache_memory,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        enable_prefix_caching=True,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    fields.update(overrides)
    return EngineConfig.of(**fields)


def keel_run(loaded, config, work: Workload, name: str, *, measure_kv: bool = False) -> Result:
    from keel.model.kv_size import kv_cache_bytes
    from keel.serve import LLMEngine, SamplingParams
    from keel.serve.sampling import RequestOutputKind

    final_only = RequestOutputKind.FINAL_ONLY
    engine = LLMEngine(loaded, config, adapt=True)  # fused projections and pre-packed weights, as served
    bs = config.cache.block_size
    slack_sum = slack_count = 0
    peak_blocks = peak_running = steps = 0
    probe_seconds = 0.0
    generated = 0
    cpu_start, start = time.process_time(), time.perf_counter()
    for prompt, out_len in zip(work.prompts, work.output_lens, strict=True):
        # Only finished outputs are read (as keel.LLM and vLLM's LLM ask): no per-step outputs.
        params = SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True, output_kind=final_only)
        engine.add_request(prompt, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                generated += len(out.outputs[0].token_ids)
        steps += 1
        if measure_kv:
            t0 = time.perf_counter()
            running = engine.scheduler.running
            for r in running:
                slack_sum += engine.kv.held_blocks(r.request_id) * bs - r.num_computed_tokens
            slack_count += len(running)
            peak_blocks = max(peak_blocks, engine.kv.num_blocks - engine.kv.num_free_blocks)
            peak_running = max(peak_running, len(running))
            probe_seconds += time.perf_counter() - t0
    seconds = time.perf_counter() - start - probe_seconds
    cpu_seconds = time.process_time() - cpu_start - probe_seconds
    assert generated == work.output_tokens, (generated, work.output_tokens)
    extra = {"cpu_seconds": cpu_seconds, "steps": steps, "preemptions": engine.scheduler.num_preemptions}
    if measure_kv:
        per_block = kv_cache_bytes(loaded.model.config, loaded.model.dtype, tokens=bs)
        extra.update(
            slack_tokens=slack_sum / max(slack_count, 1),
            slack_blocks=slack_sum / max(slack_count, 1) / bs,
            peak_blocks=peak_blocks,
            num_blocks=engine.kv.num_blocks,
            peak_kv_bytes=peak_blocks * per_block,
            peak_running=peak_running,
            probe_seconds=probe_seconds,
        )
    del engine
    gc.collect()
    return Result(name, len(work), work.output_tokens, seconds, extra=extra)


def keel_profile(loaded, config, work: Workload, warmup_steps: int, steps: int, top: int) -> str:
    from torch.profiler import ProfilerActivity, profile

    from keel.serve import LLMEngine, SamplingParams

    engine = LLMEngine(loaded, config, adapt=True)  # fused projections and pre-packed weights, as served
    for prompt, out_len in zip(work.prompts, work.output_lens, strict=True):
        engine.add_request(prompt, SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True))
    for _ in range(warmup_steps):
        engine.step()
    scheduled = []
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            running = len(engine.scheduler.running)
            engine.step()
            scheduled.append(running)
    seconds = time.perf_counter() - start
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top)
    del engine
    gc.collect()
    return (
        f"profile: steps {warmup_steps}..{warmup_steps + steps - 1} of a {len(work)}-request run, "
        f"{seconds / steps * 1e3:.0f} ms/step under the profiler, running requests per step: {scheduled}\n{table}"
    )


# ------------------------------------------------------------ transformers
def transformers_run(model, work: Workload, batch_size: int, pad_id: int, name: str) -> Result:
    cpu_start, start = time.process_time(), time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(work), batch_size):
            prompts = work.prompts[i : i + batch_size]
            new = max(work.output_lens[i : i + batch_size])
            width = max(len(p) for p in prompts)
            ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
            out = model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=pad_id,
            )
            assert out.shape[1] == width + new
    seconds = time.perf_counter() - start
    return Result(name, len(work), work.output_tokens, seconds, extra={"cpu_seconds": time.process_time() - cpu_start})


# -------------------------------------------------------------------- main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", help="catalog name, GGUF file or HF directory")
    parser.add_argument("--random-llama", action="store_true", help="benchmark a random ~134M Llama instead")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--quantize", default=None, choices=["gguf", "int8", "int4"], help="keel's weights")
    parser.add_argument(
        "--quant-keep", type=comma_list, help="comma-separated layers kept in --dtype (default: as keel serve)"
    )
    parser.add_argument("--quant-activations", default="refined", choices=["refined", "int8"])
    parser.add_argument("--reference-dtype", default=None, choices=["float32", "bfloat16"], help="transformers'")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--min-len", type=int, default=32)
    parser.add_argument("--max-len", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--baseline-requests", type=int, default=32, help="subset for batched transformers")
    parser.add_argument("--batch1-requests", type=int, default=4, help="subset for the batch-1 runs")
    parser.add_argument("--batch-sizes", default="1,8,32", help="transformers static batch sizes")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kv-cache-memory", default="4GiB")
    parser.add_argument("--max-num-batched-tokens", type=int, default=1024)
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES))
    parser.add_argument(
        "--sweep", default="", help="extra keel configs over all requests, e.g. '512x64,2048x256' (tokens x seqs)"
    )
    parser.add_argument("--skip-baselines", action="store_true", help="keel continuous batching only")
    parser.add_argument("--profile-steps", type=int, default=4, help="0: no profile")
    parser.add_argument("--profile-warmup", type=int, default=40)
    args = parser.parse_args()
    if not args.model and not args.random_llama:
        parser.error("give MODEL or --random-llama")
    torch.set_num_threads(args.threads)
    print(f"command: python bench/{Path(__file__).name} {shlex.join(sys.argv[1:])}", flush=True)

    from transformers import AutoModelForCausalLM

    from keel.quant.loading import load_model

    with tempfile.TemporaryDirectory(prefix="keel-bench-") as tmp:
        tmp = Path(tmp)
        if args.random_llama:
            model_name = "random Llama (hidden 768, 12 layers, 12 heads, FFN 2048, vocab 32000, untied)"
            source = random_llama_dir(tmp / "random-llama", args.seed)
        else:
            model_name, source = args.model, args.model
        loaded = load_model(
            str(source),
            args.dtype,
            quantize=args.quantize,
            quant_keep=args.quant_keep,
            quant_activations=args.quant_activations,
        )
        reference = None
        if not args.skip_baselines:
            ref_dir = hf_reference_dir(str(source), tmp)
            ref_dtype = getattr(torch, args.reference_dtype) if args.reference_dtype else loaded.model.dtype
            reference = AutoModelForCausalLM.from_pretrained(ref_dir, dtype=ref_dtype).eval()
            reference.generation_config.eos_token_id = None

    params = sum(p.numel() for p in {id(p): p for p in loaded.model.parameters()}.values())
    vocab = loaded.model.config.vocab_size
    work = make_workload(args.num_requests, args.min_len, args.max_len, vocab, args.seed)
    base = work.subset(args.baseline_requests)
    one = work.subset(args.batch1_requests)
    keep = keep_for(args.quant_keep, args.quantize)
    quantized = f" {args.quantize} (keep {','.join(keep)!r}, {args.quant_activations})" if args.quantize else ""
    print(
        f"model {model_name}: {params / 1e6:.1f}M float parameters, keel {args.dtype}{quantized}, "
        f"transformers {args.reference_dtype or args.dtype}, {args.threads} threads; "
        f"{len(work)} requests, prompt and output lengths uniform in [{args.min_len}, {args.max_len}] "
        f"({sum(map(len, work.prompts))} prompt + {work.output_tokens} output tokens), greedy, EOS ignored",
        flush=True,
    )

    # Warm-up (first-call costs: oneDNN kernel selection, allocator) on a small request.
    warm = Workload([work.prompts[0][:32]], [4])
    keel_run(loaded, engine_config(args), warm, "warm-up")
    if reference is not None:
        transformers_run(reference, warm, 1, 0, "warm-up")

    results: list[Result] = []

    def record(result: Result) -> Result:
        results.append(result)
        print(
            f"  {result.name}: {result.requests} requests, {result.output_tokens} tokens, "
            f"{result.seconds:.1f} s, {result.tps:.1f} tok/s, cpu {result.cpu:.2f} "
            f"{ {k: round(v, 3) for k, v in result.extra.items()} }",
            flush=True,
        )
        return result

    label = f"{args.max_num_batched_tokens} tok x {args.max_num_seqs} seqs"
    main_run = record(keel_run(loaded, engine_config(args), work, f"keel continuous ({label})", measure_kv=True))
    for spec in filter(None, args.sweep.split(",")):
        tokens, seqs = (int(x) for x in spec.split("x"))
        config = engine_config(args, max_num_batched_tokens=tokens, max_num_seqs=seqs)
        record(keel_run(loaded, config, work, f"keel continuous ({tokens} tok x {seqs} seqs)"))

    hf_best = None
    if reference is not None:
        record(keel_run(loaded, engine_config(args), base, f"keel continuous ({label}), subset"))
        for b in (int(x) for x in args.batch_sizes.split(",")):
            sub = one if b == 1 else base
            r = record(transformers_run(reference, sub, b, 0, f"transformers static batch {b}, subset"))
            if hf_best is None or r.tps > hf_best.tps:
                hf_best = r
        record(keel_run(loaded, engine_config(args), one, f"keel continuous ({label}), batch-1 subset"))
        record(keel_run(loaded, engine_config(args, max_num_seqs=1), one, "keel max_num_seqs=1, batch-1 subset"))

    print()
    header = f"{'configuration':<52} {'requests':>8} {'out tokens':>10} {'seconds':>8} {'out tok/s':>10}"
    print(f"{header} {'keel/this':>9} {'cpu':>5}")
    for r in results:
        print(
            f"{r.name:<52} {r.requests:>8} {r.output_tokens:>10} {r.seconds:>8.1f} {r.tps:>10.1f} "
            f"{main_run.tps / r.tps:>8.2f}x {r.cpu:>5.2f}"
        )
    print("keel/this = keel continuous batching over all requests (first row) / this row's rate")
    print("cpu = process CPU time / (wall x threads); well under 1.0 means the shared machine was contended")
    if hf_best is not None:
        ratio = main_run.tps / hf_best.tps
        verdict = "met" if ratio >= 5 else f"NOT met (short by {5 / ratio:.2f}x: needs {5 * hf_best.tps:.1f} tok/s)"
        print(f"floor keel >= 5x transformers' best ({hf_best.name}): {ratio:.2f}x, {verdict}")
        if len(base) < len(work) or len(one) < len(work):
            print(
                f"NOTE: baselines ran on subsets (first {len(base)} requests batched, first {len(one)} at "
                f"batch 1): their tok/s is a rate over that subset, not over all {len(work)} requests"
            )
    e = main_run.extra
    print(
        f"KV fragmentation during (a): mean {e['slack_tokens']:.2f} unused token slots = {e['slack_blocks']:.3f} "
        f"blocks per running sequence per step (floor < 1 block); peak KV {e['peak_blocks']}/{e['num_blocks']} "
        f"blocks = {e['peak_kv_bytes'] / 2**20:.0f} MiB, peak running {e['peak_running']}, "
        f"{e['steps']} steps, {e['preemptions']} preemptions (probe time {e['probe_seconds']:.2f} s, excluded)"
    )
    if args.profile_steps:
        print()
        print(keel_profile(loaded, engine_config(args), work, args.profile_warmup, args.profile_steps, top=15))


if __name__ == "__main__":
    main()
