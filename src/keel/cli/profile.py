"""`keel profile decode MODEL`: the per-step time split of decode (and a prefill chunk), as a table or JSON."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from keel.atomic import write_json_atomic
from keel.cli.common import add_quantize_arg, positive_int
from keel.dtype_names import KV_CACHE_DTYPES

if TYPE_CHECKING:
    from keel.profile.decode import DecodeProfile, StepProfile


def _table(profile: DecodeProfile, step: StepProfile) -> list[str]:
    from keel.profile.decode import PARTS

    bw = profile.copy_bandwidth
    achieved = step.bytes_per_step / (step.step_ms / 1000)
    lines = [
        f"{step.kind}: batch {step.batch}, {step.tokens_per_step} token(s) per step, {step.step_ms:.2f} ms per step, "
        f"{step.tokens_per_s:.1f} tok/s",
        f"  {'part':<32} {'ms/step':>9} {'share':>7}",
    ]
    for part in PARTS:
        ms = step.parts_ms.get(part, 0.0)
        lines.append(f"  {part:<32} {ms:9.3f} {ms / step.step_ms:7.1%}")
    lines.append(f"  {'Python / dispatch overhead':<32} {step.overhead_ms:9.3f} {step.overhead_ms / step.step_ms:7.1%}")
    lines.append(
        f"  bytes per step: weights {step.weight_bytes / 1e6:.1f} MB + KV {step.kv_bytes / 1e6:.1f} MB; "
        f"{achieved / 1e9:.2f} GB/s = {achieved / bw:.1%} of the measured copy bandwidth {bw / 1e9:.1f} GB/s"
    )
    if step.kind == "decode":
        roofline = bw / step.bytes_per_step * step.tokens_per_step
        lines.append(f"  roofline at that bandwidth: {roofline:.0f} tok/s; reached {step.tokens_per_s / roofline:.1%}")
    return lines


def cmd_profile_decode(args: argparse.Namespace) -> int:
    import torch

    from keel.profile.decode import profile_decode

    if args.threads:
        torch.set_num_threads(args.threads)
    profile = profile_decode(
        args.model,
        batch=args.batch,
        dtype=args.dtype,
        quantize=args.quantize,
        steps=args.steps,
        prompt_tokens=args.prompt_tokens,
        prefill=args.prefill or None,
        trace=args.trace,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    print(
        f"{args.model}: {profile.dtype}, quantize {profile.quantize or 'none'}, {profile.device}, "
        f"{profile.threads} threads"
    )
    for step in (profile.decode, profile.prefill):
        if step is not None:
            print("\n".join(_table(profile, step)))
    if args.trace:
        print(f"Chrome trace of the profiled decode steps: {args.trace} (chrome://tracing, ui.perfetto.dev)")
    if args.json:
        write_json_atomic(Path(args.json), profile.as_dict())
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("profile", help="where the time of a decode step goes (torch.profiler)")
    psub = p.add_subparsers(dest="profile_command", required=True, metavar="COMMAND")
    d = psub.add_parser("decode", help="per-step time split of decode and of a prefill chunk, bytes and roofline")
    d.add_argument("model", help="a catalog name, an HF directory or a GGUF file")
    d.add_argument("--batch", type=int, default=1, help="sequences decoded together")
    d.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    add_quantize_arg(d, "weights as `keel serve --quantize` takes them (auto: a GGUF file's blocks as stored)")
    d.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES), help="the paged cache's storage")
    d.add_argument("--steps", type=int, default=32, help="decode steps timed, then as many profiled")
    d.add_argument("--prompt-tokens", type=int, default=32, help="each sequence's prompt")
    d.add_argument("--prefill", type=int, default=256, help="tokens of the prefill chunk profiled (0: none)")
    d.add_argument("--threads", type=positive_int, default=None, help="torch threads (default: torch's)")
    d.add_argument("--trace", default=None, help="write a Chrome trace of the profiled decode steps here")
    d.add_argument("--json", default=None, help="write the profile here (JSON)")
    d.set_defaults(func=cmd_profile_decode)
