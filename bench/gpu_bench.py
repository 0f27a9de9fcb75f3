"""keel against transformers on one CUDA device (issue 23's proof; bench/gpu_check.sh runs it).

    python bench/gpu_bench.py [--device cuda] [--out results.json]
    python bench/gpu_bench.py --tiny --device cpu      # the same code on a tiny model, as a smoke test

One random-weight model of Llama-3.2-1B's shape (1.24B parameters, tied head; built offline, saved once
in float32), three measurements, each side by side with transformers on the same weights:

1. Greedy agreement in float32: 8 prompts, the first 32 generated tokens of each, keel's engine against
   transformers' `generate` (the floor: all equal).
2. Batch-1 decode in bfloat16: decode tokens per second after the prefill (a 128-token prompt, 256 new
   tokens); bytes a step reads (every weight once, plus the K/V it attends over) times steps per second,
   against the device's measured copy bandwidth (bytes read + written by a 1 GiB device-to-device copy)
   as the roofline (the floor: 60%); transformers' `generate` at batch 1 beside it.
3. Offline throughput in bfloat16: 256 requests, prompt and output lengths uniform in [64, 256], random
   token ids, greedy, EOS ignored: keel's continuous batching against transformers' static batches
   (left padding; a batch runs to its longest output and only each request's own output counts); the
   best batch size is the comparison (the floor: 10x).

keel runs as served: `LLMEngine(..., adapt=True)`, compiled decode (CUDA graphs per batch bucket) and the
attention backend the probe picks (docs/ARCHITECTURE.md, "Attention backends"). Prints one line per run
and the ratios; `--out` writes them as JSON.
"""

from __future__ import annotations

import argparse
import gc
import json
import shlex
import sys
import tempfile
import time
from pathlib import Path

import torch

from throughput import Workload, make_workload

LLAMA_1B = dict(
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    rope_theta=500000.0,
)
TINY = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, rope_theta=10000.0,
)  # fmt: skip


def save_random_llama(dst: Path, shape: dict, seed: int) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**shape, max_position_embeddings=4096, tie_word_embeddings=True, bos_token_id=1,
                         eos_token_id=2)  # fmt: skip
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(dst)
    return dst


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes read + written per second by a device-to-device copy (the median of 5)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(7):
        synchronize(device)
        start = time.perf_counter()
        dst.copy_(src)
        synchronize(device)
        times.append(time.perf_counter() - start)
    return 2 * nbytes / sorted(times[2:])[2]


def hf_model(path: Path, dtype: torch.dtype, device: torch.device):  # noqa: ANN201
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    model.generation_config.eos_token_id = None
    return model


def hf_generate(model, prompts: list[list[int]], new_tokens: int, device: torch.device) -> torch.Tensor:  # noqa: ANN001
    """Greedy, left-padded static batch; the generated ids [B, new_tokens]."""
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=0)  # fmt: skip
    return out[:, width:]


def keel_engine(path: Path, dtype: str, device: torch.device, **options):  # noqa: ANN201
    from keel.quant.loading import load_model
    from keel.serve import EngineConfig, LLMEngine

    loaded = load_model(str(path), dtype, device=str(device))
    if device.type == "cpu":  # on CUDA the budget is --gpu-memory-utilization's share (transformers' beside it)
        options.pop("gpu_memory_utilization", None)
        options.setdefault("kv_cache_memory", "1GiB")
    config = EngineConfig.of(device=str(device), **options)
    return LLMEngine(loaded, config, adapt=True)


def keel_generate(engine, prompts: list[list[int]], lengths: list[int]) -> tuple[dict[str, list[int]], float]:  # noqa: ANN001
    """Every prompt at once through continuous batching: the tokens by request, and the wall seconds. Only
    finished outputs are asked for (as keel.LLM and vLLM's LLM ask)."""
    from keel.serve import SamplingParams
    from keel.serve.sampling import RequestOutputKind

    final = RequestOutputKind.FINAL_ONLY

    start = time.perf_counter()
    ids = [
        engine.add_request(p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, output_kind=final))
        for p, n in zip(prompts, lengths, strict=True)
    ]
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = out.outputs[0].token_ids
    return {i: tokens[i] for i in ids}, time.perf_counter() - start


def agreement(path: Path, device: torch.device, prompts: int, new_tokens: int, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    work = [torch.randint(0, vocab, (int(n),), generator=gen).tolist() for n in torch.randint(8, 64, (prompts,))]
    reference = hf_model(path, torch.float32, device)
    expected = [hf_generate(reference, [p], new_tokens, device)[0].tolist() for p in work]
    del reference
    gc.collect()
    # Eager: the floor is about the numbers (tests/test_cuda.py checks the compiled graphs give the same).
    engine = keel_engine(path, "float32", device, max_num_seqs=8, max_model_len=256, kv_cache_memory="1GiB",
                         compile=False)  # fmt: skip
    got, _ = keel_generate(engine, work, [new_tokens] * len(work))
    del engine
    gc.collect()
    first_differences = []
    for want, have in zip(expected, got.values(), strict=True):
        first_differences.append(next((i for i, (a, b) in enumerate(zip(want, have, strict=True)) if a != b), None))
    equal = sum(d is None for d in first_differences)
    print(f"greedy float32: {equal}/{len(work)} prompts equal for {new_tokens} tokens "
          f"(first differing token per prompt: {first_differences})", flush=True)  # fmt: skip
    return {"prompts": len(work), "tokens": new_tokens, "equal": equal, "first_differences": first_differences}


def decode_alone(engine, prompt: list[int], new_tokens: int, device: torch.device) -> float:  # noqa: ANN001
    """One request's decode tok/s: timed from the step that emitted its first token (asynchronous scheduling
    emits it a step later) to the last, counting the tokens emitted in between."""
    from keel.serve import SamplingParams

    engine.add_request(prompt, SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True))
    while not any(o.delta_token_ids for o in engine.step()):  # the prefill and the first token
        pass
    synchronize(device)
    start, tokens = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        tokens += sum(len(o.delta_token_ids) for o in engine.step())
    synchronize(device)
    return tokens / (time.perf_counter() - start)


def batch1(engine, reference, device: torch.device, vocab: int, new_tokens: int, roofline: float) -> dict:  # noqa: ANN001
    prompt = torch.randint(0, vocab, (128,), generator=torch.Generator().manual_seed(1)).tolist()
    keel_tps = decode_alone(engine, prompt, new_tokens, device)
    scheduling = engine.async_scheduling
    engine.async_scheduling = not scheduling  # the other way on the same engine, for comparison
    other_tps = decode_alone(engine, prompt, new_tokens, device)
    engine.async_scheduling = scheduling
    print(f"batch-1 bfloat16: keel {'async' if scheduling else 'sync'} scheduling {keel_tps:.1f} tok/s, "
          f"{'sync' if scheduling else 'async'} {other_tps:.1f} tok/s", flush=True)  # fmt: skip
    model = engine.model
    weight_bytes = sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
    config = model.config
    kv_bytes = 2 * config.num_layers * config.num_kv_heads * config.head_dim * model.dtype.itemsize
    mean_context = 128 + new_tokens / 2
    step_bytes = weight_bytes + kv_bytes * mean_context
    hf_generate(reference, [prompt], 8, device)  # warm-up
    synchronize(device)
    start = time.perf_counter()
    hf_generate(reference, [prompt], new_tokens, device)
    synchronize(device)
    hf_tps = new_tokens / (time.perf_counter() - start)  # its prefill included: one step of new_tokens
    row = {"keel_tok_s": keel_tps, "keel_other_scheduling_tok_s": other_tps, "async_scheduling": scheduling,
           "transformers_tok_s": hf_tps, "step_bytes": step_bytes,
           "keel_GB_s": keel_tps * step_bytes / 1e9, "roofline_GB_s": roofline / 1e9,
           "of_roofline": keel_tps * step_bytes / roofline}  # fmt: skip
    print(f"batch-1 bfloat16: keel {keel_tps:.1f} tok/s ({row['keel_GB_s']:.0f} GB/s, "
          f"{100 * row['of_roofline']:.0f}% of the {row['roofline_GB_s']:.0f} GB/s copy roofline), "
          f"transformers {hf_tps:.1f} tok/s: {keel_tps / hf_tps:.2f}x", flush=True)  # fmt: skip
    return row


def offline(engine, reference, device: torch.device, work: Workload, batch_sizes: list[int]) -> dict:  # noqa: ANN001
    _, warm = keel_generate(engine, work.prompts[:4], [4] * 4)
    synchronize(device)
    tokens, seconds = keel_generate(engine, work.prompts, work.output_lens)
    synchronize(device)
    assert sum(map(len, tokens.values())) == work.output_tokens
    keel_tps = work.output_tokens / seconds
    print(f"offline bfloat16: keel {len(work)} requests, {work.output_tokens} tokens, {seconds:.1f} s, "
          f"{keel_tps:.0f} tok/s", flush=True)  # fmt: skip
    hf = {}
    hf_generate(reference, work.prompts[:2], 4, device)  # warm-up
    for size in batch_sizes:
        synchronize(device)
        start = time.perf_counter()
        for i in range(0, len(work), size):
            hf_generate(reference, work.prompts[i : i + size], max(work.output_lens[i : i + size]), device)
        synchronize(device)
        hf[size] = work.output_tokens / (time.perf_counter() - start)
        print(f"offline bfloat16: transformers static batch {size}: {hf[size]:.0f} tok/s", flush=True)
    best = max(hf, key=hf.get)
    print(f"offline bfloat16: keel / transformers' best (batch {best}): {keel_tps / hf[best]:.2f}x", flush=True)
    return {"keel_tok_s": keel_tps, "transformers_tok_s": hf, "best_batch": best, "ratio": keel_tps / hf[best]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a tiny model and workload (a smoke test)")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--min-len", type=int, default=64)
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--batch-sizes", default="64,256", help="transformers' static batch sizes")
    parser.add_argument("--new-tokens", type=int, default=256, help="batch-1 decode length")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    if args.tiny:
        args.num_requests, args.min_len, args.max_len, args.new_tokens = 16, 8, 32, 32
        args.batch_sizes = "4,16"
    device = torch.device(args.device)
    print(f"command: python bench/{Path(__file__).name} {shlex.join(sys.argv[1:])}", flush=True)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device {name}, torch {torch.__version__}", flush=True)
    results: dict = {"device": name, "torch": torch.__version__, "command": sys.argv[1:]}
    with tempfile.TemporaryDirectory(prefix="keel-gpu-bench-") as tmp:
        path = save_random_llama(Path(tmp) / "llama", TINY if args.tiny else LLAMA_1B, args.seed)
        results["agreement"] = agreement(path, device, 8, 32, args.seed)
        roofline = copy_bandwidth(device, 2**30 if device.type == "cuda" else 2**26)
        reference = hf_model(path, torch.bfloat16, device)
        engine = keel_engine(path, "bfloat16", device, max_num_seqs=256, max_model_len=1024,
                             max_num_batched_tokens=4096, gpu_memory_utilization=0.5)  # fmt: skip
        print(f"keel: {engine.backends}", flush=True)
        vocab = engine.model.config.vocab_size
        results["batch1"] = batch1(engine, reference, device, vocab, args.new_tokens, roofline)
        work = make_workload(args.num_requests, args.min_len, args.max_len, vocab, args.seed)
        sizes = [int(s) for s in args.batch_sizes.split(",")]
        results["offline"] = offline(engine, reference, device, work, sizes)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
