"""The host's share of an engine step: a model too small to cost anything, SmolLM2's tokenizer, many rows.

    python bench/host_step.py [--rows 256] [--tokens 1024] [--output-kind CUMULATIVE|DELTA|FINAL_ONLY]
                              [--temperature 0] [--top-p 1] [--threads 2] [--async-scheduling]
    python bench/host_step.py --pack-step [--rows 256] [--tokens 1024]
    python bench/host_step.py --detokenize

A random Llama of hidden size 64 (2 layers, 2,048-token vocabulary) with SmolLM2-135M's tokenizer, so the step's
time is what surrounds the forward: scheduling, packing the step's inputs, the draw, detokenizing, stop checks and
the outputs. --rows requests of 32 prompt tokens each generate --tokens tokens (EOS ignored); the median step time
is printed for each quarter of the generation (the contexts, block tables and outputs grow) and the total. What
a GPU step spends on the host is this work, at the same rows (docs/BENCHMARKS.md, issue 23). --async-scheduling
queues each step before reading the last: on a CPU nothing overlaps, so this measures what the pipeline itself
adds to the host's work.

--pack-step times `keel.serve.runner.pack_step` alone for --rows decode rows whose block tables hold --tokens
tokens, with its int64 tensors built through numpy (`keel.serve.staging.host_int64`) and through torch.tensor.
--detokenize times keel's IncrementalDetokenizer (tokenizers' DecodeStream) against the same scheme decoding both
windows in Python, over 6,000 Shakespeare tokens with SmolLM2's tokenizer, and checks the texts agree.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

SHAPE = dict(
    vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=8192, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
)  # fmt: skip


def pack_step_ms(rows: int, tokens: int, repeats: int = 200) -> dict[str, float]:
    """pack_step's milliseconds for `rows` one-token decodes at position ~`tokens`, both ways of building tensors."""
    from keel.serve import runner
    from keel.serve.runner import Chunk, pack_step

    blocks = -(-tokens // 16) + 1
    chunks = [Chunk(list(range(i * blocks, (i + 1) * blocks)), tokens + i % 16, [5], "last") for i in range(rows)]
    cpu = torch.device("cpu")
    result = {}
    numpy_way = runner.host_int64
    for name, build in (("numpy", numpy_way), ("torch.tensor", torch.tensor), ("numpy again", numpy_way)):
        runner.host_int64 = build
        try:
            pack_step(chunks, 16, cpu)
            start = time.perf_counter()
            for _ in range(repeats):
                pack_step(chunks, 16, cpu)
            result[name] = (time.perf_counter() - start) / repeats * 1e3
        finally:
            runner.host_int64 = numpy_way
    return result


def two_window_text(tokenizer, ids: list[int]) -> str:  # noqa: ANN001
    """The incremental scheme in Python: decode the window before and after each token, emit the suffix."""
    text, prefix_at, read_at = "", 0, 0
    for n in range(1, len(ids) + 1):
        prefix = tokenizer.decode(ids[prefix_at:read_at])
        full = tokenizer.decode(ids[prefix_at:n])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            text += full[len(prefix) :]
            prefix_at, read_at = read_at, n
    return text + tokenizer.decode(ids[prefix_at:])[len(tokenizer.decode(ids[prefix_at:read_at])) :]


def detokenize_us() -> dict[str, float]:
    from keel.data.corpora import shakespeare_path
    from keel.quant.loading import load_model

    tokenizer = load_model("smollm2-135m-instruct", "float32", quantize="none").tokenizer
    ids = tokenizer.encode(shakespeare_path().read_text(encoding="utf-8")[:40_000])[:6000]
    start = time.perf_counter()
    detok = tokenizer.detokenizer()
    streamed = "".join(detok.add(i) for i in ids) + detok.flush()
    keel_us = (time.perf_counter() - start) / len(ids) * 1e6
    start = time.perf_counter()
    reference = two_window_text(tokenizer, ids)
    python_us = (time.perf_counter() - start) / len(ids) * 1e6
    assert streamed == reference == tokenizer.decode(ids)
    return {"keel (DecodeStream)": keel_us, "two windows in Python": python_us}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--output-kind", default="CUMULATIVE", choices=["CUMULATIVE", "DELTA", "FINAL_ONLY"])
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--async-scheduling", action="store_true", help="queue each step before reading the last (on a CPU: its cost)"
    )
    parser.add_argument("--pack-step", action="store_true", help="time pack_step alone (see above)")
    parser.add_argument("--detokenize", action="store_true", help="time the incremental detokenizer (see above)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.detokenize:
        print("detokenizing, us a token: " + ", ".join(f"{k} {v:.2f}" for k, v in detokenize_us().items()))
        return
    if args.pack_step:
        times = pack_step_ms(args.rows, args.tokens)
        print(f"pack_step, {args.rows} decode rows at ~{args.tokens} tokens: " + ", ".join(
            f"{name} {ms:.2f} ms" for name, ms in times.items()))  # fmt: skip
        return

    from transformers import LlamaConfig, LlamaForCausalLM

    from keel.quant.loading import load_model
    from keel.serve import EngineConfig, LLMEngine, SamplingParams
    from keel.serve.sampling import RequestOutputKind

    with tempfile.TemporaryDirectory(prefix="keel-host-step-") as tmp:
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(**SHAPE)).save_pretrained(tmp)
        load_model("smollm2-135m-instruct", "float32", quantize="none").tokenizer.save_hf(tmp)
        loaded = load_model(tmp, "float32")
    config = EngineConfig.of(
        max_num_seqs=args.rows,
        max_model_len=args.tokens + 64,
        max_num_batched_tokens=8192,
        kv_cache_memory="4GiB",
        async_scheduling=args.async_scheduling,
    )
    engine = LLMEngine(loaded, config, adapt=True)
    kind = RequestOutputKind[args.output_kind]
    for i in range(args.rows):
        params = SamplingParams(
            max_tokens=args.tokens, temperature=args.temperature, top_p=args.top_p, seed=i, ignore_eos=True,
            output_kind=kind,
        )  # fmt: skip
        engine.add_request(list(range(10 + i % 7, 42 + i % 7)), params)
    print(
        f"{args.rows} rows x {args.tokens} tokens, {kind.name}, temperature {args.temperature}, top-p {args.top_p}, "
        f"{'asynchronous' if engine.async_scheduling else 'synchronous'} scheduling, "
        f"{torch.get_num_threads()} threads; {engine.backends}"
    )
    engine.step()  # every prefill
    quarter, steps, window = max(args.tokens // 4, 1), 0, []
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        engine.step()
        window.append(time.perf_counter() - t)
        steps += 1
        if steps % quarter == 0 and window:
            print(f"tokens {steps - len(window) + 1}-{steps}: median step {1e3 * statistics.median(window):.2f} ms")
            window = []
    if window:
        print(f"tokens {steps - len(window) + 1}-{steps}: median step {1e3 * statistics.median(window):.2f} ms")
    print(f"total {time.perf_counter() - start:.2f} s for {steps} steps")


if __name__ == "__main__":
    main()
