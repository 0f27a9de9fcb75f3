"""`keel serve`: load the model, start the engine thread, run uvicorn until SIGTERM/SIGINT.

The model is loaded before the port opens, so a bad model path is a one-line error and /health
answers only once the model is ready. On SIGTERM uvicorn stops accepting connections, lets
in-flight requests finish for up to `shutdown_timeout` seconds, then ends the rest with a 503 (a
stream with its error event; their engine requests are aborted); the engine thread stops and the process exits 0.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import sys
import threading

from keel.errors import KeelError
from keel.platform import resolve_device
from keel.serve.config import EngineConfig
from keel.serve.openai.options import ModelSource, ServeOptions, json_list

log = logging.getLogger("keel.serve")

# Seconds uvicorn waits, after --shutdown-timeout has ended the requests still running, for their handlers to
# send the answer before it cancels them.
DRAIN_BACKSTOP_S = 5.0


def check_options(options: ServeOptions, config: EngineConfig) -> None:
    """One-line errors for option values and combinations that cannot run, before the model loads."""
    for name in ("port", "max_queue", "max_body_bytes"):
        if getattr(options, name) < (0 if name == "port" else 1):
            raise KeelError(f"--{name.replace('_', '-')} must be positive, got {getattr(options, name)}")
    if options.port > 65535:
        raise KeelError(f"--port must be a TCP port (0-65535), got {options.port}")
    if options.threads is not None and options.threads < 1:
        raise KeelError(f"--threads must be a positive number of threads, got {options.threads}")
    if options.max_tokens_cap is not None and options.max_tokens_cap < 1:
        raise KeelError(f"--max-tokens-cap must be >= 1, got {options.max_tokens_cap}")
    if options.request_timeout < 0 or options.shutdown_timeout < 0:
        raise KeelError("--request-timeout and --shutdown-timeout must be >= 0")
    if options.seed is not None and not -(2**63) <= options.seed < 2**64:  # what torch.manual_seed takes
        raise KeelError(f"--seed must be a 64-bit integer, got {options.seed}")
    _check_parsers(options)
    for name in ("allowed_origins", "allowed_methods", "allowed_headers"):
        try:
            json_list(getattr(options, name))
        except KeelError as e:
            raise KeelError(f"--{name.replace('_', '-')}: {e}") from None
    if options.engine != "naive":
        return
    keel_only = [
        (config.offload.enabled, "--expert-cache needs"),
        (config.quant.scheme is not None, "--quantize needs"),
        (config.speculative is not None, "--speculative-config needs"),
        (config.parallel.uses_workers, "--tensor-parallel-size/--pipeline-parallel-size (worker processes) need"),
    ]
    for used, what in keel_only:
        if used:
            raise KeelError(f"{what} the keel engine (not --engine naive)")


def _check_parsers(options: ServeOptions) -> None:
    """The tool-call and reasoning parsers are known names, and auto tool choice has a parser (vLLM refuses it
    without one), checked before the model loads rather than at the first request that needs them."""
    from keel.serve.openai.reasoning_parsers import get_reasoning_parser
    from keel.serve.openai.tool_parsers import get_tool_parser

    if options.enable_auto_tool_choice and not options.tool_call_parser:
        raise KeelError("--enable-auto-tool-choice needs --tool-call-parser NAME")
    if options.tool_call_parser == "openai" and options.reasoning_parser not in (None, "openai_gptoss"):
        raise KeelError(
            "--tool-call-parser openai reads GPT-OSS's harmony calls as the openai_gptoss reasoning parser passes them "
            f"on: --reasoning-parser {options.reasoning_parser} cannot run with it"
        )
    for flag, name, lookup in (
        ("--tool-call-parser", options.tool_call_parser, get_tool_parser),
        ("--reasoning-parser", options.reasoning_parser, get_reasoning_parser),
    ):
        if name is not None:
            try:
                lookup(name)
            except ValueError as e:
                raise KeelError(f"{flag}: {e}") from None


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


def build_engine(source: ModelSource, options: ServeOptions, config: EngineConfig, chat_template: str | None = None):
    """The AsyncEngine over the chosen engine, the model loaded on the engine's own thread (AsyncEngine.build);
    `chat_template` (--chat-template's text) replaces the model's."""
    from keel.serve.async_engine import AsyncEngine

    return AsyncEngine.build(lambda: _load_engine(source, options, config, chat_template))


def _load_engine(source: ModelSource, options: ServeOptions, config: EngineConfig, chat_template: str | None):
    """The engine, then its start-up heap frozen: this process serves it until it exits (keel.serve.heap)."""
    from keel.serve.heap import freeze_startup_heap
    from keel.serve.openai.chat_template import use_chat_template

    engine = _load_engine_only(source, options, config)
    if chat_template is not None:
        try:
            use_chat_template(engine.tokenizer, chat_template)
        except BaseException:
            if hasattr(engine, "shutdown"):  # parallel workers must not outlive a failed start
                engine.shutdown()
            raise
    freeze_startup_heap()
    return engine


def _load_engine_only(source: ModelSource, options: ServeOptions, config: EngineConfig):
    from keel.quant.loading import load_model
    from keel.serve.engine import LLMEngine

    if config.parallel.uses_workers and options.engine == "keel":
        return LLMEngine(source.model, config)  # workers load the shards
    if options.engine == "naive":  # transformers' model takes float weights: a GGUF file's blocks are expanded
        config = config.replace(quantize="none")
    loaded = load_model(
        source.model,
        config.load.dtype,
        device=str(resolve_device(config.load.device)),
        head_dim=source.head_dim,
        num_heads=source.num_heads,
        **config.quant.load_options(),
    )
    if options.engine == "naive":
        from keel.serve.naive import NaiveEngine

        return NaiveEngine(loaded, config.scheduler.model_len(loaded.config.max_position_embeddings))  # no KV pool
    return LLMEngine(loaded, config, adapt=True)


def _server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn re-raises a handled SIGTERM after its graceful shutdown (the process then dies
        of the signal); a completed drain should exit 0, which is what orchestrators expect.

        When the drain's `drain_timeout` passes, `end_in_flight` ends the requests still generating with a
        503 (a stream with its error event), so that every client gets an answer; uvicorn's own graceful
        timeout, DRAIN_BACKSTOP_S later, then finds them done instead of cancelling their tasks (a 500 or a cut
        stream for the client, a traceback for each in the log)."""

        drain_timeout: float = 30.0
        end_in_flight = None  # (why: str) -> int
        _loop: asyncio.AbstractEventLoop | None = None  # set once the drain starts

        def handle_exit(self, sig: int, frame) -> None:
            super().handle_exit(sig, frame)
            if sig == signal.SIGTERM and sig in self._captured_signals:
                self._captured_signals.remove(sig)
            if self.force_exit and self._loop is not None:  # a second Ctrl+C: answer now what still runs
                # A signal handler runs between any two bytecodes: hand the work to the loop.
                self._loop.call_soon_threadsafe(self._end_in_flight, "server forced to quit during its drain")

        async def shutdown(self, sockets=None) -> None:
            self._loop = asyncio.get_running_loop()
            timer = None
            if self.end_in_flight is not None:
                why = "server shutting down: the request did not finish within --shutdown-timeout "
                why += f"{self.drain_timeout:g} s"
                timer = self._loop.call_later(self.drain_timeout, self._end_in_flight, why)
            try:
                await super().shutdown(sockets)
            finally:
                if timer is not None:
                    timer.cancel()

        def _end_in_flight(self, why: str) -> None:
            ended = self.end_in_flight(why) if self.end_in_flight is not None else 0
            if ended:
                log.warning("shutdown: ended %d request(s) still running (%s)", ended, why)

    return Server


def serve(source: ModelSource, options: ServeOptions, config: EngineConfig) -> int:
    import torch
    import uvicorn

    from keel.serve.generation_config import describe, sampling_defaults
    from keel.serve.openai.app import create_app
    from keel.serve.openai.chat_template import load_chat_template
    from keel.serve.openai.tenants import Tenants

    check_options(options, config)
    _setup_logging(options.audit_log)
    if options.threads:
        torch.set_num_threads(options.threads)
    if options.seed is not None:  # requests without a seed draw from torch's global generator
        torch.manual_seed(options.seed)
    # Read before loading, so that a bad keys file, generation config or template fails fast.
    tenants = Tenants.from_options(options.api_keys(), options.api_keys_file)
    default_sampling = sampling_defaults(source.model, options.generation_config)
    chat_template = load_chat_template(options.chat_template)
    config = resolve_auto_parallel(source.model, options.auto_parallel, config)
    if config.parallel.node_rank > 0:  # a workers-only node of multi-node serving: no engine, no port
        from keel.platform import resolve_device
        from keel.serve.parallel.launch import run_headless

        # The device node 0's engine resolves from the same option: NCCL and one GPU a rank, or gloo on CPUs.
        return run_headless(source.model, config, resolve_device(config.load.device).type)
    _check_port(options.host, options.port)
    engine = build_engine(source, options, config, chat_template)
    failure: list[BaseException] = []

    def on_engine_failure(error: BaseException) -> None:
        """The engine cannot go on (e.g. a worker died): /health already answers 503 and every client
        got its error; stop the server a moment later so that the process exits non-zero."""
        failure.append(error)
        threading.Timer(1.0, lambda: setattr(server, "should_exit", True)).start()

    engine.on_failure(on_engine_failure)
    settings = options.settings(source.model, default_sampling, engine.engine.model.config.architecture)
    if default_sampling:  # as vLLM logs the generation config's overrides
        auto = options.generation_config == "auto"
        where = "the model's generation_config.json" if auto else f"--generation-config {options.generation_config}"
        log.info(
            "default sampling params from %s: %s (a request's own values win; --generation-config vllm: none)",
            where,
            describe(default_sampling),
        )
    app = create_app(engine, settings, tenants)
    uvicorn_config = uvicorn.Config(
        app,
        host=options.host,
        port=options.port,
        log_level="info",
        access_log=False,  # the audit line covers every request
        timeout_graceful_shutdown=options.shutdown_timeout + DRAIN_BACKSTOP_S,
        log_config=None,
    )
    server = _server_class()(uvicorn_config)
    server.drain_timeout = options.shutdown_timeout
    server.end_in_flight = app.state.server.end_in_flight
    if failure:  # failed before the server existed: stop it as soon as it runs
        server.should_exit = True
    log.info(
        "serving %s as %s on http://%s:%d (%s engine, auth %s)",
        source.model,
        ", ".join(repr(name) for name in settings.served_model_names),
        options.host,
        options.port,
        options.engine,
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
        raise KeelError(f"could not listen on {options.host}:{options.port} (in use, or not allowed)")
    return 0


def resolve_auto_parallel(model: str, auto_parallel: str | None, config: EngineConfig) -> EngineConfig:
    """--auto-parallel: the config with --tensor-parallel-size and --pipeline-parallel-size from the serving
    planner (unchanged without it)."""
    if auto_parallel is None:
        return config
    par = config.parallel
    if par.tensor_parallel_size != 1 or par.pipeline_parallel_size != 1:
        raise KeelError(
            "--auto-parallel chooses --tensor-parallel-size and --pipeline-parallel-size: give one or the other"
        )
    from keel.plan.source import model_config
    from keel.serve.parallel.launch import auto_parallel as plan_layout

    model_cfg = model_config(model)
    context = config.scheduler.model_len(model_cfg.max_position_embeddings)
    gpus = None if auto_parallel == "local" else auto_parallel
    tp, pp, why = plan_layout(model_cfg, gpus, context, config.load.dtype)
    log.info("--auto-parallel: %s", why)
    return config.replace(tensor_parallel_size=tp, pipeline_parallel_size=pp)
