"""`keel serve`: load the model, start the engine thread, run uvicorn until SIGTERM/SIGINT.

The model is loaded before the port opens, so a bad model path is a one-line error and /health
answers only once the model is ready. On SIGTERM uvicorn stops accepting connections, lets
in-flight requests finish for up to `--shutdown-timeout` seconds, then cancels the rest (which
aborts their engine requests); the engine thread stops and the process exits 0.
"""

from __future__ import annotations

import argparse
import logging
import signal
import socket
import sys
import threading

from keel.errors import KeelError

log = logging.getLogger("keel.serve")


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="bind address (loopback by default)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None, help="the model id clients send (default: MODEL)")
    p.add_argument("--api-key", action="append", default=[], metavar="KEY",
                   help="accept this Bearer key (tenant 'default', no limits); repeatable")  # fmt: skip
    p.add_argument("--api-keys-file", default=None, metavar="F", help="TOML/JSON keys with tenants and limits")
    p.add_argument("--max-queue", type=int, default=256,
                   help="accepted requests waiting to run, over all tenants; beyond it: 503")  # fmt: skip
    p.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds a request may spend queued + generating (0: no deadline)")  # fmt: skip
    p.add_argument("--max-tokens-cap", type=int, default=None, help="largest max_tokens a request may ask for")
    p.add_argument("--max-body-bytes", type=int, default=4 * 2**20, help="request body size limit")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds to let in-flight requests finish before aborting them")  # fmt: skip
    p.add_argument("--audit-log", default=None, metavar="FILE", help="append audit lines here (default: stderr)")
    p.add_argument("--audit-prompts", action="store_true", help="include prompt token ids in audit lines")
    p.add_argument("--engine", default="keel", choices=["keel", "naive"],
                   help="naive: transformers, one request at a time (a benchmark baseline)")  # fmt: skip
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    add_engine_args(p)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-memory", default="2GiB", help="KV-cache budget, e.g. 2GiB")
    p.add_argument("--num-blocks", type=int, default=None, help="KV blocks (overrides --kv-cache-memory)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8"],
                   help="KV-cache storage: the model's dtype, or int8 with a scale per token and head")  # fmt: skip
    p.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"])
    p.add_argument("--no-compile", dest="compile", action="store_const", const=False, default=None,
                   help="decode steps eagerly (default: compiled for dense models of 50M+ parameters)")  # fmt: skip
    p.add_argument("--compile", dest="compile", action="store_const", const=True,
                   help="compile the decode step whatever the model's size")  # fmt: skip
    add_expert_offload_args(p)
    add_quantize_args(p)
    add_speculative_args(p)
    add_parallel_args(p)


def add_parallel_args(p: argparse.ArgumentParser) -> None:
    """Tensor/pipeline-parallel worker processes (keel.serve.parallel), vLLM's and torchrun's option names."""
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, metavar="N",
                   help="shard every layer over N worker processes (one per GPU)")  # fmt: skip
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1, metavar="M",
                   help="split the layers into M stages, each its own worker processes")  # fmt: skip
    p.add_argument("--enable-expert-parallel", action="store_true",
                   help="MoE: split the experts over the tensor-parallel ranks, not each one by width")  # fmt: skip
    p.add_argument("--auto-parallel", nargs="?", const="local", default=None, metavar="COUNTxTYPE",
                   help="take tp and pp from `keel plan serve` for this machine's GPUs (or the given cluster, "
                        "e.g. 8xH200)")  # fmt: skip
    p.add_argument("--nnodes", type=int, default=1, help="nodes the N x M workers span (torchrun's term)")
    p.add_argument("--node-rank", type=int, default=0,
                   help="this node's index: node 0 runs the engine and server, the others only workers")  # fmt: skip
    p.add_argument("--master-addr", default="127.0.0.1", help="node 0's address for the workers' rendezvous")
    p.add_argument("--master-port", type=int, default=None, help="rendezvous port (default: a free one, 1 node)")
    p.add_argument("--distributed-timeout", type=float, default=60.0,
                   help="seconds a collective may wait for a peer before the workers fail")  # fmt: skip
    p.add_argument("--startup-timeout", type=float, default=600.0,
                   help="seconds for every worker to load its shard and report ready")  # fmt: skip


def add_speculative_args(p: argparse.ArgumentParser) -> None:
    """Speculative decoding, shared by `keel serve` and `keel generate` (vLLM's option and keys)."""
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\' or \'{"method": "draft_model", '
                        '"model": "DRAFT", "num_speculative_tokens": 3}\'; keys: method, num_speculative_tokens, '
                        'prompt_lookup_min, prompt_lookup_max, model, quantization, disable_by_batch_size')  # fmt: skip


def speculative_config(args: argparse.Namespace) -> dict:
    """The EngineConfig field of --speculative-config, validated before the model loads."""
    if args.speculative_config is None:
        return {}
    import json

    from keel.serve.speculative import SpeculativeConfig

    try:
        values = json.loads(args.speculative_config)
    except json.JSONDecodeError as e:
        raise KeelError(f"--speculative-config: not valid JSON ({e.msg} at character {e.pos})") from None
    if not isinstance(values, dict):
        raise KeelError("--speculative-config: expected a JSON object")
    return dict(speculative_config=SpeculativeConfig.from_dict(values))


def add_quantize_args(p: argparse.ArgumentParser) -> None:
    """Weight-only quantization at load, shared by `keel serve` and `keel generate`."""
    p.add_argument("--quantize", default=None, choices=["int8", "int4", "gguf"],
                   help="quantize linear layers and MoE experts at load: int8 per channel, int4 per group; "
                        "gguf: run the file's own Q4_0/Q4_1/Q8_0 blocks on the integer kernels")  # fmt: skip
    p.add_argument("--quant-group-size", type=int, default=128, choices=[32, 64, 128, 256],
                   help="int4 group size (input channels per scale); 32 reproduces GGUF Q4_0/Q4_1 blocks")  # fmt: skip
    p.add_argument("--quant-keep", default="lm_head", metavar="NAMES",
                   help="comma-separated layers left in float, names or patterns such as '*.experts' "
                        "(default: lm_head; '' for none)")  # fmt: skip
    p.add_argument("--quant-keep-as", default=None, choices=["int8", "int4"],
                   help="run the kept layers in this scheme, not float (e.g. int4 with an int8 head)")  # fmt: skip
    p.add_argument("--quant-plan", default=None, metavar="PLAN.json",
                   help="a plan from `keel quantize analyze`: its scheme, group size and kept layers")  # fmt: skip


def quantize_config(args: argparse.Namespace) -> dict:
    """EngineConfig fields of the quantization options; a bad plan fails here, before the model loads."""
    if args.quant_plan is not None:
        from keel.quant.plan import read_plan

        plan = read_plan(args.quant_plan)
        return dict(quantize=plan["scheme"], quant_group_size=plan.get("group_size") or 128,
                    quant_keep=tuple(plan.get("keep", [])), quant_keep_as=args.quant_keep_as)  # fmt: skip
    if args.quant_keep_as is not None and args.quantize is None:
        raise KeelError("--quant-keep-as needs --quantize (or --quant-plan)")
    return dict(
        quantize=args.quantize,
        quant_group_size=args.quant_group_size,
        quant_keep=tuple(name for name in args.quant_keep.split(",") if name),
        quant_keep_as=args.quant_keep_as,
    )


def add_expert_offload_args(p: argparse.ArgumentParser) -> None:
    """Expert offloading (MoE models), shared by `keel serve` and `keel generate`."""
    p.add_argument("--expert-cache", default=None, metavar="N|P%|SIZE",
                   help="offload experts: N experts per MoE layer stay resident, or P%% of them, "
                        "or SIZE bytes over all MoE layers (e.g. 512MiB); default: all resident")  # fmt: skip
    p.add_argument("--expert-cache-policy", default="lru", choices=["lru", "lfu"], help="which expert to evict")
    p.add_argument("--expert-storage", default="host", choices=["host", "disk"],
                   help="where non-resident experts live: host memory, or the safetensors file (mmap)")  # fmt: skip
    p.add_argument("--no-expert-prefetch", dest="expert_prefetch", action="store_false",
                   help="do not load the next MoE layer's predicted experts in the background")  # fmt: skip


def expert_offload_config(args: argparse.Namespace) -> dict:
    """The EngineConfig fields of the expert-offloading options; a bad --expert-cache fails here,
    before the model is loaded."""
    if args.expert_cache is not None:
        from keel.serve.offload.budget import parse_expert_cache

        parse_expert_cache(args.expert_cache)
    return dict(
        expert_cache=args.expert_cache,
        expert_cache_policy=args.expert_cache_policy,
        expert_storage=args.expert_storage,
        expert_prefetch=args.expert_prefetch,
    )


def _check(args: argparse.Namespace) -> None:
    for name in ("port", "max_queue", "max_body_bytes"):
        if getattr(args, name) < (0 if name == "port" else 1):
            raise KeelError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.max_tokens_cap is not None and args.max_tokens_cap < 1:
        raise KeelError(f"--max-tokens-cap must be >= 1, got {args.max_tokens_cap}")
    if args.request_timeout < 0 or args.shutdown_timeout < 0:
        raise KeelError("--request-timeout and --shutdown-timeout must be >= 0")
    if args.expert_cache is not None and args.engine == "naive":
        raise KeelError("--expert-cache needs the keel engine (not --engine naive)")
    if (args.quantize is not None or args.quant_plan is not None) and args.engine == "naive":
        raise KeelError("--quantize needs the keel engine (not --engine naive)")
    if args.speculative_config is not None and args.engine == "naive":
        raise KeelError("--speculative-config needs the keel engine (not --engine naive)")
    if args.tensor_parallel_size * args.pipeline_parallel_size > 1 and args.engine == "naive":
        raise KeelError("--tensor-parallel-size/--pipeline-parallel-size need the keel engine (not --engine naive)")
    quantize_config(args)
    expert_offload_config(args)
    speculative_config(args)


def _check_port(host: str, port: int) -> None:
    """Fail before the (slow) model load when the address cannot be bound."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise KeelError(f"--host {host}: {e.strerror}") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            s.bind(address)
        except OSError as e:
            raise KeelError(f"cannot listen on {host}:{port}: {e.strerror}") from None


def _setup_logging(audit_path: str | None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    audit = logging.getLogger("keel.audit")
    if audit_path:
        handler = logging.FileHandler(audit_path)
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
        audit.addHandler(handler)
        audit.propagate = False


def engine_config(args: argparse.Namespace, quantization: dict | None = None):
    """The EngineConfig of the options `add_engine_args` adds (`quantization`: quantize_config's
    result when the caller has already read it)."""
    from keel.serve.engine import EngineConfig

    return EngineConfig(
        block_size=args.block_size,
        kv_cache_memory=args.kv_cache_memory,
        num_blocks=args.num_blocks,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        enable_prefix_caching=args.enable_prefix_caching,
        kv_cache_dtype=args.kv_cache_dtype,
        scheduling_policy=args.scheduling_policy,
        compile=args.compile,
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        master_addr=args.master_addr,
        master_port=args.master_port,
        distributed_timeout=args.distributed_timeout,
        startup_timeout=args.startup_timeout,
        enable_expert_parallel=args.enable_expert_parallel,
        **expert_offload_config(args),
        **(quantization if quantization is not None else quantize_config(args)),
        **speculative_config(args),
    )


def build_engine(args: argparse.Namespace):
    """The AsyncEngine over the chosen engine, with the model loaded."""
    from keel.quant.loading import load_model
    from keel.serve.async_engine import AsyncEngine
    from keel.serve.engine import LLMEngine

    quantization = quantize_config(args)  # read once: a plan file is parsed here
    if args.tensor_parallel_size * args.pipeline_parallel_size > 1 and args.engine == "keel":
        return AsyncEngine(LLMEngine(args.model, _parallel_config(args, quantization)))  # workers load the shards
    loaded = load_model(args.model, args.dtype, head_dim=args.head_dim, num_heads=args.num_heads, **quantization)
    if args.engine == "naive":
        from keel.serve.naive import NaiveEngine

        return AsyncEngine(NaiveEngine(loaded, args.max_model_len))
    return AsyncEngine(LLMEngine(loaded, engine_config(args, quantization), adapt=True))


def _server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn re-raises a handled SIGTERM after its graceful shutdown (the process then dies
        of the signal); a completed drain should exit 0, which is what orchestrators expect."""

        def handle_exit(self, sig: int, frame) -> None:
            super().handle_exit(sig, frame)
            if sig == signal.SIGTERM and sig in self._captured_signals:
                self._captured_signals.remove(sig)

    return Server


def serve(args: argparse.Namespace) -> int:
    import torch
    import uvicorn

    from keel.serve.openai.app import ServerSettings, create_app
    from keel.serve.openai.tenants import Tenants

    _check(args)
    _setup_logging(args.audit_log)
    if args.threads:
        torch.set_num_threads(args.threads)
    tenants = Tenants.from_options(args.api_key, args.api_keys_file)  # before loading: a bad file fails fast
    resolve_auto_parallel(args)
    if args.node_rank > 0:  # a workers-only node of multi-node serving: no engine, no port
        from keel.serve.parallel.launch import run_headless

        return run_headless(args.model, _parallel_config(args))
    _check_port(args.host, args.port)
    engine = build_engine(args)
    failure: list[BaseException] = []

    def on_engine_failure(error: BaseException) -> None:
        """The engine cannot go on (e.g. a worker died): /health already answers 503 and every client
        got its error; stop the server a moment later so that the process exits non-zero."""
        failure.append(error)
        threading.Timer(1.0, lambda: setattr(server, "should_exit", True)).start()

    engine.on_failure(on_engine_failure)
    settings = ServerSettings(
        served_model_name=args.served_model_name or str(args.model),
        max_queue=args.max_queue,
        request_timeout=args.request_timeout or None,
        max_tokens_cap=args.max_tokens_cap,
        max_body_bytes=args.max_body_bytes,
        audit_prompts=args.audit_prompts,
    )
    app = create_app(engine, settings, tenants)
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level="info",
        access_log=False,  # the audit line covers every request
        timeout_graceful_shutdown=args.shutdown_timeout,
        log_config=None,
    )
    server = _server_class()(config)
    if failure:  # failed before the server existed: stop it as soon as it runs
        server.should_exit = True
    log.info(
        "serving %s as %r on http://%s:%d (%s engine, auth %s)",
        args.model,
        settings.served_model_name,
        args.host,
        args.port,
        args.engine,
        "on" if tenants.auth_required else "off",
    )
    try:
        server.run()
    finally:
        engine.shutdown()
    if failure:
        log.error("exiting: the engine failed (%s)", failure[0])
        return 1
    if not server.started:
        raise KeelError(f"could not listen on {args.host}:{args.port} (in use, or not allowed)")
    return 0


def resolve_auto_parallel(args: argparse.Namespace) -> None:
    """--auto-parallel: set --tensor-parallel-size and --pipeline-parallel-size from the serving planner."""
    if args.auto_parallel is None:
        return
    if args.tensor_parallel_size != 1 or args.pipeline_parallel_size != 1:
        raise KeelError(
            "--auto-parallel chooses --tensor-parallel-size and --pipeline-parallel-size: give one or the other"
        )
    from keel.plan.cli import model_config
    from keel.serve.parallel.launch import auto_parallel

    config = model_config(args.model)
    context = args.max_model_len or config.max_position_embeddings
    gpus = None if args.auto_parallel == "local" else args.auto_parallel
    args.tensor_parallel_size, args.pipeline_parallel_size, why = auto_parallel(config, gpus, context, args.dtype)
    log.info("--auto-parallel: %s", why)


def _parallel_config(args: argparse.Namespace, quantization: dict | None = None):
    """The EngineConfig of parallel serving: the workers load the model, so it carries --dtype too."""
    config = engine_config(args, quantization)
    config.dtype = args.dtype
    return config
