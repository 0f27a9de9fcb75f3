"""`keel plan serve MODEL --gpus 8xH200 --context 32768` and `keel plan train`: the plans as tables or JSON."""

from __future__ import annotations

import argparse
from pathlib import Path

from keel.atomic import write_json_atomic
from keel.cli.common import positive_int
from keel.errors import KeelError
from keel.plan.hardware import OVERRIDES, Cluster, cluster_with_overrides
from keel.plan.serve import KV_BYTES, WEIGHT_BYTES, as_dicts, plan_serving
from keel.plan.source import model_config
from keel.plan.train import plan_training


def _fraction(text: str) -> float:
    """An argparse type: a number in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number: {text!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
    return value


def cmd_serve(args: argparse.Namespace) -> int:
    if args.batch is not None and args.request_rate is not None:  # the rate sets the batch: one would be dropped
        raise KeelError("--batch and --request-rate both set the batch; give one of them")
    config = model_config(args.model)
    cluster = cluster_from_args(args)
    layouts = plan_serving(
        config,
        cluster,
        args.context,
        args.weights,
        args.kv_cache_dtype,
        args.batch,
        ttft_s=args.ttft,
        tpot_ms=args.tpot,
        request_rate=args.request_rate,
        output_tokens=args.output_tokens,
    )
    counts = config.param_counts()
    print(
        f"{args.model}: {counts['total'] / 1e9:.1f}B parameters ({counts['active_matmul'] / 1e9:.1f}B active); "
        f"{cluster.count}x {cluster.gpu.name} ({cluster.gpu.memory / 1e9:.0f} GB, "
        f"{cluster.gpu.hbm_bandwidth / 1e12:.1f} TB/s); weights {args.weights}, KV {args.kv_cache_dtype}, "
        f"context {args.context}"
    )
    header = (
        f"{'tp':>3} {'pp':>3} {'rep':>4} {'weights GB':>10} {'KV GB':>7} {'KV B/tok':>9} {'seqs':>6} "
        f"{'batch':>6} {'ms/tok b=1':>10} {'ms/tok':>8} {'tok/s':>10} {'compute-bound b':>15} "
        f"{'prefill s':>9}  note"
    )
    print(header)
    for lay in layouts[: args.top]:
        note = (
            ""
            if lay.fits
            else (
                f"does not fit; {lay.resident_expert_share:.0%} of experts resident with offloading"
                if lay.resident_expert_share < 1.0
                else "does not fit"
            )
        )
        if lay.rate_ok is not None:
            note += f" sustains {lay.max_request_rate:.2f} req/s" + ("" if lay.rate_ok else " (misses the rate)")
        if lay.ttft_ok is False or lay.tpot_ok is False:
            note += " misses " + " and ".join(
                n for n, ok in (("TTFT", lay.ttft_ok), ("TPOT", lay.tpot_ok)) if ok is False
            )
        print(
            f"{lay.tp:3d} {lay.pp:3d} {lay.replicas:4d} {lay.weights_gb:10.1f} {lay.kv_gb:7.1f} "
            f"{lay.kv_bytes_per_token:9.0f} {lay.sequences:6d} {lay.batch:6d} {lay.decode_ms_batch1:10.2f} "
            f"{lay.decode_ms:8.2f} {lay.tokens_per_s:10.0f} {lay.compute_bound_batch:15d} {lay.prefill_s:9.2f}  "
            f"{note}"
        )
    if args.json:
        _write_json(
            args.json, {"model": args.model, "gpus": args.gpus, "context": args.context, "layouts": as_dicts(layouts)}
        )
    if not any(lay.fits for lay in layouts):
        raise KeelError(f"{args.model} does not fit {args.gpus} at context {args.context} in any layout")
    return 0


def parse_tokens(text: str) -> int:
    """'16M', '4k', '62914560' -> tokens."""
    units = {"k": 2**10, "m": 2**20, "g": 2**30}
    value = text.strip().lower()
    try:
        return int(float(value[:-1]) * units[value[-1]]) if value[-1] in units else int(value)
    except (ValueError, IndexError):
        raise KeelError(f"--global-batch {text!r}: expected tokens such as 16M or 4194304") from None


def _write_json(path: str, payload: dict) -> None:
    write_json_atomic(Path(path), payload)


def cmd_train_run(args: argparse.Namespace) -> int:
    """`keel plan train --config run.toml --nproc N`: one keel run's peak memory per rank."""
    from keel.plan.run import predict_run_memory
    from keel.train.config import load_config, model_config_from, resolve_layout
    from keel.weights.loader import open_checkpoint

    cfg = load_config(args.config, [])
    if cfg.model.config is not None:
        config = model_config_from(cfg.model.config)
    else:
        config = open_checkpoint(cfg.model.source).config
    layout = resolve_layout(cfg, args.nproc, config)
    mem = predict_run_memory(cfg, config, layout)
    print(
        f"{args.config}: {config.param_counts()['total']:,} parameters; {args.nproc} rank(s): pp={layout.pp} "
        f"dp_replicate={layout.dp_replicate} dp_shard={layout.dp_shard} tp={layout.tp}, micro-batch "
        f"{layout.micro_batch_size} x {cfg.data.seq_len} tokens, grad_accum {layout.grad_accum}, "
        f"{cfg.model.dtype} weights, precision {cfg.training.precision}, activation checkpointing "
        f"{cfg.activation_checkpoint.mode}"
    )
    print(f"predicted tensor memory peak per rank: {mem.peak / 2**20:.1f} MiB, at {mem.moment}")
    for kind in ("weights", "grads", "optimizer", "activations", "temporary"):
        print(f"  {kind:<12} {getattr(mem, kind) / 2**20:10.1f} MiB")
    if args.json:
        _write_json(args.json, {"config": args.config, "nproc": args.nproc, "memory": mem.as_dict()})
    return 0


def _choices(text: str, option: str) -> tuple[str, ...]:
    values = tuple(v.strip() for v in text.split(",") if v.strip())
    if not values:
        raise KeelError(f"{option}: give at least one value")
    return values


def cmd_train(args: argparse.Namespace) -> int:
    from keel.plan.train import as_dicts as train_dicts

    if args.config is not None:
        if args.model is not None or args.gpus is not None:
            raise KeelError("keel plan train: give either MODEL --gpus (a cluster plan) or --config (one keel run)")
        return cmd_train_run(args)
    if args.model is None or args.gpus is None:
        raise KeelError("keel plan train: MODEL and --gpus are required (or --config RUN.toml for one keel run)")
    config = model_config(args.model)
    cluster = cluster_from_args(args)
    tokens = parse_tokens(args.global_batch)
    layouts = plan_training(
        config,
        cluster,
        args.seq,
        tokens,
        mfu=args.mfu,
        precision=args.precision,
        optimizer=args.optimizer,
        recompute=_choices(args.recompute, "--recompute"),
        schedules=_choices(args.schedule, "--schedule"),
    )
    counts = config.param_counts()
    print(
        f"{args.model}: {counts['total'] / 1e9:.1f}B parameters ({counts['active_matmul'] / 1e9:.1f}B active); "
        f"{cluster.count}x {cluster.gpu.name}; sequences of {args.seq}, {tokens} tokens per step; "
        f"{args.precision}, {args.optimizer}; {len(layouts)} layouts, "
        f"{sum(lay.fits for lay in layouts)} fit"
    )
    print(
        f"{'tp':>3} {'pp':>3} {'dp':>5} {'ep':>3} {'zero':>4} {'shard':>5} {'mb':>3} {'recompute':>9} "
        f"{'schedule':>11} {'states GB':>9} "
        f"{'act GB':>7} {'total GB':>8} {'step s':>7} {'bubble':>6} {'comm s':>7} {'tok/s/GPU':>9} "
        f"{'MFU':>6}"
    )
    for lay in layouts[: args.top]:
        print(
            f"{lay.tp:3d} {lay.pp:3d} {lay.dp:5d} {lay.ep:3d} {lay.zero:4d} {lay.dp_shard:5d} {lay.micro_batch:3d} "
            f"{lay.recompute:>9} {lay.schedule:>11} "
            f"{lay.states_gb:9.1f} {lay.activations_gb:7.1f} {lay.total_gb:8.1f} {lay.step_s:7.2f} "
            f"{lay.bubble:6.1%} {lay.comm_s:7.2f} {lay.tokens_per_s_per_gpu:9.0f} {lay.mfu:6.1%}"
            + ("" if lay.fits else "  does not fit")
        )
    if args.json:
        _write_json(
            args.json,
            {
                "model": args.model,
                "gpus": args.gpus,
                "seq": args.seq,
                "global_batch_tokens": tokens,
                "layouts": train_dicts(layouts),
            },
        )
    if not any(lay.fits for lay in layouts):
        raise KeelError(f"{args.model} does not fit {args.gpus} for training in any layout")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="memory and time planning for training and serving")
    psub = p.add_subparsers(dest="plan_command", required=True, metavar="COMMAND")
    t = psub.add_parser("train", help="memory per GPU and step time of every parallel layout")
    t.add_argument("model", nargs="?", help="a config.json, an HF directory, a GGUF file or a catalog name")
    t.add_argument("--gpus", help="COUNTxTYPE, e.g. 2048xH800")
    t.add_argument("--config", help="instead: a keel training config (TOML); predicts that run's peak per rank")
    t.add_argument("--nproc", type=int, default=1, help="with --config: processes (the world size)")
    t.add_argument("--seq", type=int, default=4096, help="sequence length")
    t.add_argument("--global-batch", default="4M", help="tokens per optimizer step (e.g. 16M)")
    t.add_argument("--mfu", type=_fraction, default=0.5, help="fraction of dense peak the matmuls reach")
    t.add_argument("--precision", default="bf16", choices=["bf16", "fp8"], help="matmul precision (fp8: its peak)")
    t.add_argument("--optimizer", default="adamw", choices=["adamw", "muon", "sgd"], help="optimizer state kept")
    t.add_argument("--recompute", default="none,selective,full", help="activation checkpointing policies to try")
    t.add_argument("--schedule", default="1f1b,interleaved,zbv", help="pipeline schedules to try")
    add_cluster_arguments(t)
    t.add_argument("--top", type=int, default=15, help="layouts printed")
    t.add_argument("--json", default=None, help="write every layout here (JSON)")
    t.set_defaults(func=cmd_train)
    s = psub.add_parser("serve", help="weights, KV capacity and roofline step times per layout")
    s.add_argument("model", help="a config.json, an HF directory, a GGUF file or a catalog name")
    s.add_argument(
        "--gpus", required=True, help="COUNTxTYPE, e.g. 8xH200 (types: A100-80G H100-SXM H800 H200 B200 MI300X)"
    )
    s.add_argument("--context", type=int, required=True, help="tokens per sequence")
    s.add_argument("--weights", default="bf16", choices=list(WEIGHT_BYTES))
    s.add_argument("--kv-cache-dtype", default="bf16", choices=list(KV_BYTES))
    s.add_argument(
        "--batch", type=positive_int, default=None, help="sequences per replica (default: as many as fit, <= 256)"
    )
    s.add_argument("--request-rate", type=float, default=None, help="requests/s to sustain (sets the batch)")
    s.add_argument("--output-tokens", type=int, default=256, help="with --request-rate: tokens generated each")
    s.add_argument("--ttft", type=float, default=None, help="target time to first token, seconds")
    s.add_argument("--tpot", type=float, default=None, help="target time per output token, ms")
    s.add_argument("--top", type=int, default=10, help="layouts printed")
    add_cluster_arguments(s)
    s.add_argument("--json", default=None, help="write every layout here (JSON)")
    s.set_defaults(func=cmd_serve)


def add_cluster_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("custom hardware (override the GPU table's figures)")
    g.add_argument("--gpu-memory", type=float, metavar="GB", help="HBM per GPU")
    g.add_argument("--bf16-tflops", type=float, metavar="TFLOPS", help="dense bf16 peak")
    g.add_argument("--fp8-tflops", type=float, metavar="TFLOPS", help="dense fp8 peak")
    g.add_argument("--hbm-tbs", type=float, metavar="TB/s", help="HBM bandwidth")
    g.add_argument("--link-gbs", type=float, metavar="GB/s", help="per-GPU bandwidth inside a node, one direction")
    g.add_argument("--network-gbs", type=float, metavar="GB/s", help="per-GPU bandwidth between nodes, one direction")
    g.add_argument("--gpus-per-node", type=int, metavar="N", help="GPUs sharing the scale-up link")


def cluster_from_args(args: argparse.Namespace) -> Cluster:
    """--gpus COUNTxTYPE with any custom-hardware options applied."""
    return cluster_with_overrides(args.gpus, {option: getattr(args, option, None) for option in OVERRIDES})
