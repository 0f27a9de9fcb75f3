"""Batch-1 decode by weight format: float32, bfloat16, int8, int4 and the GGUF file's own blocks, beside llama.cpp.

    python bench/quant_decode.py [MODEL] [--threads 2] [--prompt-tokens 32] [--new-tokens 256] [--repeats 3]

MODEL is a GGUF file or catalog name (default: the packaged SmolLM2-135M-Instruct Q4_1 GGUF). Every
keel variant loads the same file; "gguf" runs its Q4_0/Q4_1/Q8_0 blocks on the integer kernels
(`--quantize gguf`), the others dequantize it and (re)quantize. llama.cpp (llama-cpp-python, when
installed: `make bench-deps`) runs in a child process (see LLAMA_CHILD) on the same GGUF file with the same thread
count, the same prompt token ids and the same number of generated tokens, greedy, EOS ignored.
"auto" loads with `--dtype auto` (the host's choice, keel.platform). The table ends with the platform
and every variant's linear backends as the engine's start-up line names them. Runs alternate between
variants, --repeats times each; the median is reported. Decode tok/s counts the tokens after the
first over the time from the first token to the last, the same way for all.
Weight GB/s = bytes of weights read per token (quantized buffers at their stored size) × tok/s.
A suffix runs the variant through keel's serving engine (LLMEngine: paged cache, fused projections,
pre-packed bf16 weights) instead of the single-sequence generator: "@eager" with eager decode steps,
"@compiled" with the compiled decode step (keel.serve.compiled_decode; compiled before timing).
"+h8": the kept head in int8 (`--quant-keep-as int8`) instead of bfloat16; "gguf-fp32": the GGUF
blocks with float32 activations (exact fp16 scales, but torch's slow int4 path on CPU).
"""

from __future__ import annotations

import argparse
import importlib.util
import shlex
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from decode import keel_decode  # noqa: E402
from keel.platform import host  # noqa: E402
from keel.profile.roofline import copy_bandwidth, streamed_weight_bytes  # noqa: E402
from keel.serve.backends import linear_backends  # noqa: E402

# name -> (compute dtype, quantize scheme, int4 group size, layers kept, scheme of the kept layers)
VARIANTS = {
    "auto": ("auto", None, 0, (), None),  # the host's choice (keel.platform): bf16 where native, else float32
    "float32": ("float32", None, 0, (), None),
    "bfloat16": ("bfloat16", None, 0, (), None),
    "int8": ("bfloat16", "int8", 0, ("lm_head",), None),
    "int4-g32": ("bfloat16", "int4", 32, ("lm_head",), None),
    "int4-g64": ("bfloat16", "int4", 64, ("lm_head",), None),
    "int4-g32+h8": ("bfloat16", "int4", 32, ("lm_head",), "int8"),
    "gguf": ("bfloat16", "gguf", 0, ("lm_head",), None),
    "gguf+h8": ("bfloat16", "gguf", 0, ("lm_head",), "int8"),
    "gguf-fp32": ("float32", "gguf", 0, ("lm_head",), None),
    # Every block of the file as stored, the tied head on the embedding's Q8_0 blocks: keel's kernels,
    # activations refined (the default) or int8 alone ("-i8", as llama.cpp runs them).
    "gguf-all": ("float32", "gguf", 0, (), None),
    "gguf-all-i8": ("float32", "gguf", 0, (), None),
    "gguf-all-bf16": ("bfloat16", "gguf", 0, (), None),
}


def build(model: str, variant: str, max_len: int):
    from keel.quant.loading import load_model

    base, _, mode = variant.partition("@")
    dtype, scheme, group, keep, keep_as = VARIANTS[base]
    activations = "int8" if base.endswith("-i8") else "refined"
    if mode:
        from keel.serve.engine import EngineConfig, LLMEngine

        config = EngineConfig.of(
            dtype=dtype,
            quantize=scheme,
            quant_group_size=group or 128,
            quant_keep=keep,
            quant_keep_as=keep_as,
            num_blocks=-(-max_len // 16) + 2,
            max_model_len=max_len,
            enable_prefix_caching=False,
            compile=mode == "compiled",
            quant_activations=activations,
        )
        return LLMEngine(model, config)
    loaded = load_model(
        model,
        dtype,
        quantize=scheme,
        quant_group_size=group or 128,
        quant_keep=keep,
        quant_keep_as=keep_as,
        quant_activations=activations,
    )
    return loaded.model


def engine_decode(engine, prompt: list[int], new_tokens: int) -> float:
    from keel.serve.sampling import SamplingParams

    engine.add_request(prompt, SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    times = outputs[-1].metrics.token_times
    assert len(times) == new_tokens
    return (len(times) - 1) / (times[-1] - times[0])


# llama.cpp runs in a child process per run: loaded beside torch (or left idle in a second process),
# ggml's threads and torch's shared the 2 cores, and keel's compiled step ran 25-35% slower than alone.
# The prompt goes in one token at a time (n_batch 1): only decode is timed, and llama-cpp-python 0.3.36's
# build crashes (SIGSEGV) on a prompt batch over its repacked weights on an AMX CPU, while its repacked
# one-row path is its fastest decode there (docs/BENCHMARKS.md, fifth part).
LLAMA_CHILD = """
import json, sys, time
from llama_cpp import Llama
path, threads, prompt, n = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3]), int(sys.argv[4])
llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=1024, n_batch=1, verbose=False)
def decode(count):
    times = []
    for _ in llm.generate(prompt, top_k=1, temp=0.0, reset=True):
        times.append(time.perf_counter())
        if len(times) == count:
            break
    return (len(times) - 1) / (times[-1] - times[0])
decode(8)
print(decode(n), flush=True)
"""


def llama_cpp_decode(path: Path, threads: int, prompt: list[int], new_tokens: int) -> float:
    """One decode in a fresh child process (it exits after, so no ggml thread outlives its run)."""
    import json
    import subprocess

    args = [sys.executable, "-c", LLAMA_CHILD, str(path), str(threads), json.dumps(prompt), str(new_tokens)]
    return float(subprocess.run(args, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="smollm2-135m-instruct")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from keel.weights.loader import resolve_path

    gguf_path = resolve_path(args.model)
    variants = args.variants.split(",")
    built = {name: build(args.model, name, args.prompt_tokens + args.new_tokens + 16) for name in variants}
    engines = {name: b for name, b in built.items() if "@" in name}
    models = {name: (b.model if name in engines else b) for name, b in built.items()}
    vocab = next(iter(models.values())).config.vocab_size
    prompt = torch.randint(0, vocab, (args.prompt_tokens,), generator=torch.Generator().manual_seed(0)).tolist()

    runners = {
        name: (
            lambda m=m, n=args.new_tokens: (
                engine_decode(m, prompt, n) if m in engines.values() else keel_decode(m, prompt, n)
            )
        )
        for name, m in built.items()
    }
    llama_note = ""
    if importlib.util.find_spec("llama_cpp") is not None:
        runners["llama.cpp"] = lambda: llama_cpp_decode(gguf_path, args.threads, prompt, args.new_tokens)
    else:
        llama_note = "llama.cpp: not run (llama-cpp-python is not installed)"
    for name, run in runners.items():  # warm-up
        if name != "llama.cpp":
            run()
    results: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(args.repeats):
        for name, run in runners.items():
            results[name].append(run())
    bandwidth = copy_bandwidth()
    file_bytes = gguf_path.stat().st_size
    print(f"command: python bench/{Path(__file__).name} {shlex.join(sys.argv[1:])}")
    print(
        f"model {gguf_path.name}, {args.threads} threads, batch 1, {args.prompt_tokens}-token prompt + "
        f"{args.new_tokens} tokens, median of {args.repeats}; copy bandwidth {bandwidth / 1e9:.1f} GB/s"
    )
    print(
        f"{'variant':<17} {'compute':>9} {'weights MB':>11} {'decode tok/s':>13} {'weight GB/s':>12} "
        f"{'% copy bw':>10} {'vs bfloat16':>12}"
    )
    base = statistics.median(results["bfloat16"]) if "bfloat16" in results else None
    for name, runs in results.items():
        tps = statistics.median(runs)
        nbytes = streamed_weight_bytes(models[name]) if name in models else file_bytes
        compute = str(models[name].dtype).removeprefix("torch.") if name in models else "ggml"
        gbs = nbytes * tps
        ratio = f"{tps / base:.2f}x" if base else "-"
        share = 100 * gbs / bandwidth
        print(f"{name:<17} {compute:>9} {nbytes / 1e6:11.1f} {tps:13.1f} {gbs / 1e9:12.2f} {share:9.1f}% {ratio:>12}")
    if llama_note:
        print(llama_note)
    print(f"platform: {host().describe()}; backends (keel.serve.backends):")
    for name, model in models.items():
        print(f"  {name}: {str(model.dtype).removeprefix('torch.')} compute; {linear_backends(model)}")


if __name__ == "__main__":
    main()
