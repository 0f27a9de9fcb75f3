"""`keel <command>`: the command-line entry point.

User errors (KeelError) print one line, `keel: error: ...`, and exit 1 without a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

from keel.errors import KeelError


def _add_model_args(p: argparse.ArgumentParser, dtype_default: str | None = "auto") -> None:
    p.add_argument("model", metavar="MODEL", help="HF directory, .gguf file, or catalog name")
    if dtype_default is not None:
        p.add_argument(
            "--dtype",
            default=dtype_default,
            choices=["auto", "float32", "bfloat16", "float16"],
            help="compute dtype (auto: the fastest correct one here: bf16 on CPUs with native bf16 matmul and for "
            "quantized weights, float32 on other CPUs, the checkpoint's dtype on CUDA)",
        )
    p.add_argument("--head-dim", type=int, default=None, help="head size, when config.json is missing")
    p.add_argument("--num-heads", type=int, default=None, help="attention heads, when config.json is missing")


def _set_threads(threads: int | None) -> None:
    if threads:
        import torch

        torch.set_num_threads(threads)


def cmd_generate(args: argparse.Namespace) -> int:
    from keel.quant.loading import load_model
    from keel.serve.engine import EngineConfig, LLMEngine
    from keel.serve.openai.server import expert_offload_config, quantize_config, speculative_config
    from keel.serve.sampling import SamplingParams

    _set_threads(args.threads)
    offload = expert_offload_config(args)
    speculative = speculative_config(args)
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
    )
    params.validate()
    quantization = quantize_config(args)  # read once: a plan file is parsed here
    loaded = load_model(args.model, args.dtype, head_dim=args.head_dim, num_heads=args.num_heads, **quantization)
    tokenizer = loaded.tokenizer
    if tokenizer is None:
        raise KeelError(f"{args.model}: no tokenizer found (tokenizer.json or GGUF tokenizer metadata)")
    if args.chat:
        messages = [{"role": "system", "content": args.system}] if args.system else []
        messages.append({"role": "user", "content": args.prompt})
        prompt_ids = tokenizer.encode_chat(messages)
    else:
        prompt_ids = tokenizer.encode(args.prompt)
    context = loaded.config.max_position_embeddings
    if len(prompt_ids) >= context:
        raise KeelError(f"prompt has {len(prompt_ids)} tokens; the model's context is {context} tokens")
    params.max_tokens = min(params.max_tokens, context - len(prompt_ids))
    # One request: a KV pool for exactly its length.
    length = len(prompt_ids) + params.max_tokens
    config = EngineConfig(
        num_blocks=-(-length // 16),
        block_size=16,
        max_model_len=length,
        compile=False,  # one request: compiling would take longer than it saves
        **offload,
        **quantization,
        **speculative,
    )
    engine = LLMEngine(loaded, config, adapt=True)
    print(f"[keel] backends: {engine.backends}", file=sys.stderr)
    engine.add_request(prompt_ids, params)
    out = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            sys.stdout.write(out.delta_text)
            sys.stdout.flush()
    sys.stdout.write("\n")
    stats, completion = out.metrics, out.outputs[0]
    generated = len(completion.token_ids)
    prefill_tps = len(prompt_ids) / (stats.first_token - stats.arrival)
    times = stats.token_times
    decode_tps = (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else 0.0
    dtype = str(loaded.model.dtype).removeprefix("torch.")
    print(
        f"[keel] {dtype}: prompt {len(prompt_ids)} tokens at {prefill_tps:.1f} tok/s; "
        f"generated {generated} tokens at {decode_tps:.1f} tok/s (finish: {completion.finish_reason})",
        file=sys.stderr,
    )
    if stats.spec_draft_tokens:
        print(
            f"[keel] speculative: {stats.spec_accepted_tokens}/{stats.spec_draft_tokens} drafts accepted "
            f"({stats.spec_acceptance_rate:.1%}) over {stats.spec_verify_steps} verifications",
            file=sys.stderr,
        )
    if engine.offload is not None:
        s = engine.offload.stats
        print(
            f"[keel] experts: {engine.offload.slots_per_layer} resident per MoE layer, hit rate {s.hit_rate:.1%}, "
            f"{s.bytes_loaded / 2**20:.1f} MiB loaded, stalled {s.stall_seconds:.3f} s, "
            f"prefetch accuracy {s.prefetch_accuracy:.1%}",
            file=sys.stderr,
        )
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from keel.tools.inspect import describe, format_text
    from keel.weights import open_checkpoint

    info = describe(open_checkpoint(args.model, head_dim=args.head_dim, num_heads=args.num_heads))
    print(json.dumps(info, indent=2, default=str) if args.json else format_text(info))
    return 0


def cmd_align(args: argparse.Namespace) -> int:
    from keel.tools.align import align

    _set_threads(args.threads)
    report = align(args.model, args.dtype, head_dim=args.head_dim, num_heads=args.num_heads)
    print(report.format())
    return 0 if report.passed else 1


def cmd_convert(args: argparse.Namespace) -> int:
    from keel.weights.convert import convert

    dst = convert(
        args.model,
        args.dst,
        dtype=args.dtype,
        head_dim=args.head_dim,
        num_heads=args.num_heads,
        overwrite=args.overwrite,
    )
    print(f"wrote {dst}")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from keel.serve.openai.server import serve

    return serve(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="keel", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("generate", help="generate text from a prompt (streams to stdout)")
    _add_model_args(p)
    p.add_argument("--prompt", required=True, help="prompt text")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--system", default=None, help="system message (with --chat)")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    from keel.serve.openai.server import add_expert_offload_args, add_quantize_args, add_speculative_args

    add_expert_offload_args(p)
    add_quantize_args(p)
    add_speculative_args(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("inspect", help="print a checkpoint's structure, parameters and provenance")
    _add_model_args(p, dtype_default=None)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("align", help="compare keel with transformers layer by layer")
    _add_model_args(p, dtype_default=None)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--threads", type=int, default=None)
    p.set_defaults(func=cmd_align)

    p = sub.add_parser("convert", help="write an HF-format directory (safetensors, config, tokenizer)")
    _add_model_args(p, dtype_default=None)
    p.add_argument("dst", metavar="DST", help="output directory (must not exist or be empty)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--overwrite", action="store_true", help="replace an existing DST")
    p.set_defaults(func=cmd_convert)

    from keel.tools import upcycle

    upcycle.register(sub)

    from keel.quant import analyze as quant_analyze

    quant_analyze.register(sub)

    from keel.plan import cli as plan_cli

    plan_cli.register(sub)

    from keel.profile import cli as profile_cli

    profile_cli.register(sub)

    from keel.serve.openai.server import add_serve_args

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, metrics)")
    _add_model_args(p)
    add_serve_args(p)
    p.set_defaults(func=cmd_serve)

    from keel.eval import cli as eval_cli

    eval_cli.register(sub)

    from keel.train.launch import add_train_args, cmd_train

    p = sub.add_parser("train", help="train (hybrid parallel via torchrun); `keel train plot RUN_DIR` draws curves")
    add_train_args(p)
    p.set_defaults(func=cmd_train)

    from keel.train import data as train_data

    p = sub.add_parser("data", help="training data")
    data_sub = p.add_subparsers(dest="data_command", required=True, metavar="COMMAND")
    train_data.register(data_sub)

    from keel.tools import bench_serve

    p = sub.add_parser("bench", help="benchmarks")
    bench_sub = p.add_subparsers(dest="bench_command", required=True, metavar="BENCHMARK")
    bench_serve.register(bench_sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except KeelError as e:
        print(f"keel: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("keel: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `keel generate ... | head`
        return 0


if __name__ == "__main__":
    sys.exit(main())
