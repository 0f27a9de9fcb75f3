"""Quality (and decode-attention speed) of the int8 paged KV cache against the float one.

    python bench/kv_int8.py [MODEL] [--dtype float32] [--tokens 2048] [--chunk 256] [--new-tokens 128] [--threads 1]

MODEL defaults to smollm2-135m-instruct. Everything goes through the paged caches the serving
engine uses (`make_paged_kv_cache(..., "auto" | "int8")`), driven one sequence at a time
without the scheduler:

1. Perplexity over --tokens tokens of the Shakespeare corpus (from character --offset), fed as
   prefill chunks of --chunk tokens on top of the cached prefix, so every chunk after the first
   reads the earlier chunks' keys and values back from the cache (int8 ones for the int8 cache).
   Both caches run in lockstep; per position, the relative logit error |l_int8 - l|/|l| (max,
   mean) and whether the argmax agrees.
2. Greedy generation of --new-tokens tokens after a --chunk-token prompt: the float cache
   generates; the int8 cache is fed the same tokens (teacher forcing) for a per-step logit
   error and argmax agreement, then generates on its own (identical tokens, first divergence).
   The decode loops are timed too: ms per token of the whole model at batch 1, float vs int8.
3. Why a scale per token and head: the reconstruction error of the model's actual K and V
   (captured from the float cache after 1.) quantized per token and head vs with one static
   scale per head (absmax over all the tokens: an oracle calibration on the very same text, and
   over the first chunk only, as a calibration set would be), and, for reference, one static
   scale per head and channel (oracle; the KIVI observation that keys have outlier channels).
4. Decode attention time (torch.utils.benchmark, 1 thread) of one layer for 8 sequences: the float
   cache, the int8 cache (scales folded into scores and probabilities), and the int8 cache
   dequantizing the gathered rows instead.
"""

from __future__ import annotations

import argparse
import math
import shlex
import sys
import time

import torch
from torch import Tensor


def rows_rel_error(got: Tensor, want: Tensor) -> Tensor:
    """Per row |got - want| / |want|."""
    return (got - want).norm(dim=-1) / want.norm(dim=-1)


def forward(model, cache, tokens: list[int], start: int) -> Tensor:
    from keel.serve.kv_quant import sequence_plan

    cache.plan = sequence_plan(list(range(cache.num_blocks)), start, len(tokens), cache.block_size)
    try:
        return model(torch.tensor([tokens]), positions=torch.arange(start, start + len(tokens))[None], cache=cache)[0]
    finally:
        cache.plan = None


@torch.inference_mode()
def perplexity_section(model, make, ids: list[int], chunk: int) -> tuple[dict, object]:
    """Both caches in lockstep over `ids` in chunks: perplexities, logit errors, argmax agreement."""
    caches = {"float": make("auto"), "int8": make("int8")}
    nll = {name: 0.0 for name in caches}
    errors, agree = [], 0
    for start in range(0, len(ids), chunk):
        piece = ids[start : start + chunk]
        logits = {name: forward(model, c, piece, start).float() for name, c in caches.items()}
        targets = torch.tensor(ids[start + 1 : start + chunk + 1])  # the last position has no target
        for name, lg in logits.items():
            nll[name] += torch.nn.functional.cross_entropy(lg[: len(targets)], targets, reduction="sum").item()
        errors.append(rows_rel_error(logits["int8"], logits["float"]))
        agree += (logits["int8"].argmax(-1) == logits["float"].argmax(-1)).sum().item()
    err = torch.cat(errors)
    n = len(ids) - 1
    return {
        "ppl_float": math.exp(nll["float"] / n),
        "ppl_int8": math.exp(nll["int8"] / n),
        "max_rel": err.max().item(),
        "mean_rel": err.mean().item(),
        "agree": agree / len(ids),
    }, caches["float"]


@torch.inference_mode()
def generation_section(model, make, prompt: list[int], new_tokens: int) -> dict:
    seconds: dict[str, float] = {}

    def run(cache, forced: list[int] | None, name: str) -> tuple[Tensor, list[int]]:
        last = forward(model, cache, prompt, 0)[-1].float()
        steps, out = [last], []
        start = time.perf_counter()
        for i in range(new_tokens):
            out.append(forced[i] if forced is not None else int(last.argmax()))
            last = forward(model, cache, out[-1:], len(prompt) + i)[-1].float()
            steps.append(last)
        seconds[name] = time.perf_counter() - start
        return torch.stack(steps[:-1]), out  # logits that chose each of the new tokens

    want, tokens = run(make("auto"), None, "float")
    forced, _ = run(make("int8"), tokens, "forced")
    _, free = run(make("int8"), None, "int8")
    err = rows_rel_error(forced, want)
    diverge = next((i for i, (a, b) in enumerate(zip(free, tokens, strict=True)) if a != b), new_tokens)
    return {
        "max_rel": err.max().item(),
        "mean_rel": err.mean().item(),
        "agree": (forced.argmax(-1) == want.argmax(-1)).float().mean().item(),
        "identical": sum(a == b for a, b in zip(free, tokens, strict=True)) / new_tokens,
        "diverge": diverge,
        "ms_float": seconds["float"] / new_tokens * 1e3,
        "ms_int8": seconds["int8"] / new_tokens * 1e3,
    }


def scale_section(cache, num_tokens: int, chunk: int) -> dict:
    """Mean over layers of the relative reconstruction error of K and V, per token-and-head vs static."""
    from keel.serve.kv_quant import QMAX, dequantize_kv, quantize_kv

    def static(x: Tensor, calib: Tensor, dims: tuple[int, ...] = (1, 2)) -> Tensor:  # per head: scales [H, 1, 1]
        scale = calib.abs().amax(dim=dims, keepdim=True).clamp_min(1e-30) / QMAX
        return (x / scale).round().clamp(-QMAX, QMAX) * scale

    def err(a: Tensor, b: Tensor) -> float:
        return ((a - b).norm() / b.norm()).item()

    result: dict[str, list[float]] = {}
    for kind, stores in (("K", cache.keys), ("V", cache.values)):
        for store in stores:
            x = store[:, :num_tokens].float()  # [H_kv, N, D]: slots 0..N-1 are positions 0..N-1 here
            per_token = dequantize_kv(*quantize_kv(x), torch.float32)
            for name, value in (
                ("token", err(per_token, x)),
                ("static_oracle", err(static(x, x), x)),
                ("static_first_chunk", err(static(x, x[:, :chunk]), x)),
                ("static_channel_oracle", err(static(x, x, (1,)), x)),  # [H, 1, D]: per head and channel
            ):
                result.setdefault(f"{kind}_{name}", []).append(value)
    return {k: sum(v) / len(v) for k, v in result.items()}


def speed_section(config, dtype: torch.dtype, lengths=(256, 1024), batch: int = 8, block_size: int = 16) -> list[dict]:
    """One layer's decode attention for `batch` sequences of each length: float, int8 folded, int8 dequantized."""
    from torch.utils import benchmark

    from keel.serve.kv_cache import DecodeGroup, PagedKVCache, StepPlan
    from keel.serve.kv_quant import Int8PagedKVCache

    class DequantizeOnGather(Int8PagedKVCache):
        _attend = PagedKVCache._attend  # the base class's decode path over dequantized rows

    h, hkv, d = config.num_heads, config.num_kv_heads, config.head_dim
    rows = []
    for length in lengths:
        nb = length // block_size
        num_blocks = batch * nb + 1  # the last block takes the step's new tokens
        torch.manual_seed(0)
        kv = torch.randn(1, num_blocks * block_size, hkv, d, dtype=dtype)
        q, new = torch.randn(1, h, batch, d, dtype=dtype), torch.randn(1, batch, hkv, d, dtype=dtype)
        fill = StepPlan(torch.arange(num_blocks * block_size), [], [])
        tables = torch.arange(batch * nb).view(batch, nb)
        step = StepPlan(
            torch.arange(batch) + (num_blocks - 1) * block_size,
            [DecodeGroup(torch.arange(batch), tables, torch.full((batch,), length - 1))],
            [],
        )
        row = {"length": length}
        variants = (("float", PagedKVCache), ("int8_fold", Int8PagedKVCache), ("int8_dequant", DequantizeOnGather))
        for name, cls in variants:
            cache = cls(config, num_blocks, block_size, dtype)
            cache.plan = fill
            cache.attend(0, q[:, :, :0], kv, kv, None, None)  # no queries: only writes every slot
            cache.plan = step
            timer = benchmark.Timer(
                "cache.attend(0, q, new, new, None, None)", globals=dict(cache=cache, q=q, new=new), num_threads=1
            )
            row[name] = timer.blocked_autorange(min_run_time=1.0).median * 1e3
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", nargs="?", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--tokens", type=int, default=2048, help="tokens of the corpus for the perplexity")
    p.add_argument("--offset", type=int, default=20000, help="character offset into the corpus")
    p.add_argument("--chunk", type=int, default=256, help="prefill chunk (and generation prompt) in tokens")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--no-speed", action="store_true", help="skip the decode attention timing")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    from keel.data.corpora import shakespeare_path
    from keel.model.kv_size import kv_cache_bytes
    from keel.quant.loading import load_model
    from keel.serve.kv_quant import make_paged_kv_cache

    t0 = time.perf_counter()
    loaded = load_model(args.model, args.dtype)
    model, config, dtype = loaded.model, loaded.model.config, loaded.model.dtype
    text = shakespeare_path().read_text(encoding="utf-8")[args.offset : args.offset + 8 * args.tokens]
    ids = loaded.tokenizer.encode(text, add_special_tokens=False)[: args.tokens]
    if len(ids) < args.tokens:
        sys.exit(f"only {len(ids)} tokens from the corpus slice; lower --tokens")
    num_blocks = -(-(max(args.tokens, args.chunk + args.new_tokens)) // args.block_size)

    def make(kind: str):
        return make_paged_kv_cache(config, num_blocks, args.block_size, dtype, "cpu", kind)

    ppl, float_cache = perplexity_section(model, make, ids, args.chunk)
    gen = generation_section(model, make, ids[: args.chunk], args.new_tokens)
    scales = scale_section(float_cache, args.tokens, args.chunk)
    speed = [] if args.no_speed else speed_section(config, torch.bfloat16)

    bf16, int8 = kv_cache_bytes(config, torch.bfloat16), kv_cache_bytes(config, dtype, "int8")
    print(f"$ python bench/kv_int8.py {shlex.join(argv if argv is not None else sys.argv[1:])}")
    print(f"model {args.model} ({args.dtype}), {args.threads} thread(s), block size {args.block_size}")
    print(f"KV bytes/token: bfloat16 {bf16}, int8 {int8} incl. scales ({int8 / bf16:.1%} of bfloat16)\n")
    print(f"1. perplexity, {args.tokens} Shakespeare tokens in prefill chunks of {args.chunk} over the cached prefix")
    print("| cache | perplexity | change | logit rel. err max | mean | argmax agreement |")
    print("|---|---|---|---|---|---|")
    print(f"| float | {ppl['ppl_float']:.4f} | | | | |")
    change = ppl["ppl_int8"] / ppl["ppl_float"] - 1
    print(
        f"| int8 | {ppl['ppl_int8']:.4f} | {change:+.3%} | {ppl['max_rel']:.2e} | {ppl['mean_rel']:.2e} | "
        f"{ppl['agree']:.2%} |\n"
    )
    print(f"2. greedy generation, {args.new_tokens} tokens after a {args.chunk}-token prompt")
    print("| logit rel. err max | mean (teacher-forced) | argmax agreement | identical tokens | first divergence |")
    print("|---|---|---|---|---|")
    diverge = "none" if gen["diverge"] == args.new_tokens else f"token {gen['diverge']}"
    print(f"| {gen['max_rel']:.2e} | {gen['mean_rel']:.2e} | {gen['agree']:.2%} | {gen['identical']:.2%} | {diverge} |")
    print(
        f"decode step (the whole model, batch 1): float cache {gen['ms_float']:.1f} ms, int8 cache "
        f"{gen['ms_int8']:.1f} ms\n"
    )
    print("3. K/V reconstruction rel. error (mean over layers)")
    print("| scales | K | V |")
    print("|---|---|---|")
    for name, label in (
        ("token", "per token and head (int8 cache)"),
        ("static_oracle", "static per head, absmax of all tokens (oracle)"),
        ("static_first_chunk", f"static per head, absmax of the first {args.chunk} tokens"),
        ("static_channel_oracle", "static per head and channel, absmax of all tokens (oracle)"),
    ):
        print(f"| {label} | {scales['K_' + name]:.2e} | {scales['V_' + name]:.2e} |")
    if speed:
        print("\n4. decode attention, one layer, 8 sequences, bfloat16, 1 thread (ms, median)")
        print("| keys per sequence | float cache | int8, scales folded | int8, dequantized on gather |")
        print("|---|---|---|---|")
        for row in speed:
            print(f"| {row['length']} | {row['float']:.3f} | {row['int8_fold']:.3f} | {row['int8_dequant']:.3f} |")
    print(f"\n({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
