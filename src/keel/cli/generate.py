"""`keel generate MODEL --prompt ...`: one request on the engine, streamed to stdout, speeds on stderr."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from keel.cli.common import add_model_args, add_threads_arg, set_threads
from keel.cli.config_options import add_engine_options, engine_config_from_args
from keel.errors import KeelError
from keel.platform import resolve_device
from keel.serve.config import CacheConfig, SchedulerConfig

# The engine options that matter to one request; its KV cache is sized to the request.
ENGINE_PARTS = ("load", "quant", "offload", "speculative")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text from a prompt (streams to stdout)")
    add_model_args(p)
    p.add_argument("--prompt", required=True, help="prompt text")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--system", default=None, help="system message (with --chat)")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence")
    add_threads_arg(p)
    add_engine_options(p, ENGINE_PARTS)
    p.set_defaults(func=run)


def _prompt_ids(args: argparse.Namespace, tokenizer) -> list[int]:
    if tokenizer is None:
        raise KeelError(f"{args.model}: no tokenizer found (tokenizer.json or GGUF tokenizer metadata)")
    if not args.chat:
        return tokenizer.encode(args.prompt)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    messages.append({"role": "user", "content": args.prompt})
    return tokenizer.encode_chat(messages)


def run(args: argparse.Namespace) -> int:
    from keel.quant.loading import load_model
    from keel.serve.engine import LLMEngine
    from keel.serve.sampling import SamplingParams

    set_threads(args.threads)
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
    )
    params.validate()
    config = engine_config_from_args(args)  # option errors (and the quantization plan) before the model loads
    device = str(resolve_device(config.load.device))
    loaded = load_model(
        args.model,
        config.load.dtype,
        head_dim=args.head_dim,
        num_heads=args.num_heads,
        device=device,
        **config.quant.load_options(),
    )
    prompt_ids = _prompt_ids(args, loaded.tokenizer)
    context = loaded.config.max_position_embeddings
    if len(prompt_ids) >= context:
        raise KeelError(f"prompt has {len(prompt_ids)} tokens; the model's context is {context} tokens")
    params.max_tokens = min(params.max_tokens, context - len(prompt_ids))
    # One request: a KV pool for exactly its length, and no compiling unless asked (it would take longer
    # than it saves).
    length = len(prompt_ids) + params.max_tokens
    config = dataclasses.replace(
        config,
        load=dataclasses.replace(config.load, compile=bool(config.load.compile)),
        cache=CacheConfig(num_blocks=-(-length // 16), block_size=16),
        scheduler=SchedulerConfig(max_model_len=length, max_num_seqs=1),  # and one state slot (recurrent layers)
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
    _report(out, len(prompt_ids), str(loaded.model.dtype).removeprefix("torch."), engine)
    return 0


def _report(out, prompt_tokens: int, dtype: str, engine) -> None:
    """The speeds (and speculation and offloading counters) on stderr."""
    stats, completion = out.metrics, out.outputs[0]
    prefill_tps = prompt_tokens / (stats.first_token - stats.arrival)
    times = stats.token_times
    decode_tps = (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else 0.0
    print(
        f"[keel] {dtype}: prompt {prompt_tokens} tokens at {prefill_tps:.1f} tok/s; "
        f"generated {len(completion.token_ids)} tokens at {decode_tps:.1f} tok/s (finish: {completion.finish_reason})",
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
