"""The engine: scheduler + KV-cache manager + runner, stepped until requests finish.

`LLMEngine.step()` schedules one batch, runs it, appends sampled tokens, detokenizes, checks
stops and returns what changed. `keel.LLM` (offline batches) and `AsyncEngine` (the HTTP
server) drive it.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from typing import TYPE_CHECKING

import torch

from keel.config import ModelConfig
from keel.errors import KeelError
from keel.model.kv_size import check_kv_cache_dtype, kv_cache_bytes
from keel.model.recurrent import RecurrentStates
from keel.model.transformer import Transformer
from keel.platform import resolve_device
from keel.quant.apply import GGUF
from keel.quant.config import AUTO
from keel.quant.loading import load_model
from keel.serve.backends import describe_backends
from keel.serve.compiled_decode import CompiledDecode, decide_compile
from keel.serve.config import EngineConfig
from keel.serve.constraints import bad_words_token_ids
from keel.serve.hybrid import check_recurrent_layers, prefix_caching, states_only
from keel.serve.kv_blocks import KVCacheManager
from keel.serve.kv_budget import DummyStep, blocks_in_budget, measured_peak
from keel.serve.kv_quant import make_paged_kv_cache
from keel.serve.launched import LaunchedStep
from keel.serve.model_len import check_model_len
from keel.serve.outputs import OutputTrack, RequestOutput, build_output
from keel.serve.request import Request, Status
from keel.serve.runner import ModelRunner
from keel.serve.sampling import (
    RequestOutputKind,
    SamplingParams,
    TokenLogprobs,
    request_generator,
    sample_dummy_rows,
)
from keel.serve.scheduler import Scheduler, step_budget
from keel.serve.speculative import SpeculativeConfig
from keel.serve.speculative.ngram import propose_ngram
from keel.serve.step_tokens import TokenHistogram
from keel.serve.structured.backend import GrammarBackend
from keel.serve.structured.state import GrammarState
from keel.serve.units import AUTO_LENGTH
from keel.tokenizer import Tokenizer
from keel.weights.checkpoint import LoadedModel

if TYPE_CHECKING:
    from keel.serve.offload import ExpertOffload
    from keel.serve.parallel.executor import ParallelExecutor
    from keel.serve.speculative.draft import DraftModelProposer

log = logging.getLogger("keel.serve")


def encode_prompt(
    prompt: str | list[int], tokenizer: Tokenizer | None, vocab_size: int
) -> tuple[list[int], str | None]:
    """(token ids, text or None): text is tokenized; token ids are checked against the vocabulary."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise KeelError("this model has no tokenizer: pass prompt token ids")
        return tokenizer.encode(prompt), prompt
    ids = list(prompt)
    if any(not 0 <= t < vocab_size for t in ids):
        raise KeelError(f"prompt token ids must be in [0, {vocab_size})")
    return ids, None


def eos_token_ids(config: ModelConfig, tokenizer: Tokenizer | None) -> list[int]:
    """The config's EOS ids, then the tokenizer's, without repeats."""
    return list(dict.fromkeys(config.eos_token_id + (tokenizer.eos_token_ids if tokenizer else [])))


class LLMEngine:
    def __init__(
        self,
        model: str | LoadedModel,
        config: EngineConfig | None = None,
        *,
        device: str | None = None,
        adapt: bool = False,
    ) -> None:
        """device: where the engine runs (default: the config's `device`, auto: CUDA where a GPU is visible;
        keel.platform.resolve_device); a caller's LoadedModel that the engine does not adapt stays where it
        is and the engine runs there. adapt: rewrite a caller's LoadedModel for serving (fused projections,
        pre-packed weights, moved to the device) as the engine does with a model it loads itself; for
        callers that loaded it only to serve it."""
        self.executor: ParallelExecutor | None = None
        self._grammar_backend: GrammarBackend | None = None
        self._grammar_lock = threading.Lock()
        try:
            self._init(model, config, device, adapt)
        except BaseException:
            self.shutdown()  # workers already started must not outlive a failed start
            raise

    def _init(self, model: str | LoadedModel, config: EngineConfig | None, device: str | None, adapt: bool) -> None:
        """Start-up in named steps: load, adapt, allocate the KV cache, scheduler and runner, speculation."""
        started = time.perf_counter()
        self.config = config = config or EngineConfig()
        device = self._device(model, device, adapt)
        self.loaded = loaded = self._load(model, device)
        owned = (adapt or not isinstance(model, LoadedModel)) and self.executor is None
        if owned and loaded.model.device != torch.device(device) and not config.offload.enabled:
            loaded.model.to(device)  # a caller's model to adapt, loaded elsewhere
        self._adapt(loaded, owned)
        self.model: Transformer = loaded.model  # on the meta device when workers hold the weights
        # CUDA's current device is the calling thread's: events, Triton's launches and the current stream all
        # take it, so it is the engine's device on every thread that builds or steps the engine (cuda:1 too).
        self._cuda = self.model.device if self.model.device.type == "cuda" else None
        self._enter_device()
        self.device_type = torch.device(device).type if self.executor is not None else self.model.device.type
        self.tokenizer: Tokenizer | None = loaded.tokenizer
        # Under --max-model-len auto the model's context until the KV cache is sized (_allocate_kv_cache).
        self.max_model_len = config.scheduler.model_len(self.model.config.max_position_embeddings)
        check_model_len(self.max_model_len, self.model.config)
        self.spec: SpeculativeConfig | None = config.speculative
        check_recurrent_layers(self.model.config, config)
        self.draft_model: Transformer | None = None
        if self.spec is not None and self.spec.method == "draft_model":
            self.draft_model = self._load_draft(model, device)
        num_blocks = self._allocate_kv_cache(device)
        for net in (self.model, self.draft_model):  # LongRoPE: one set of frequencies for the whole cache
            if net is not None:
                net.fix_rope_context(self.max_model_len)
        self._build_scheduler_and_runner()
        self._build_speculation(num_blocks, device)
        self.async_scheduling = self._decide_async_scheduling()
        self._pending: LaunchedStep | None = None  # the step queued and not yet read (asynchronous scheduling)
        self._reads_own_tokens: set[str] = set()  # requests whose steps wait for the previous one's tokens
        self.eos_token_ids = eos_token_ids(self.model.config, self.tokenizer)
        self._tracks: dict[str, OutputTrack] = {}
        self._ids = itertools.count()
        self.num_generated_tokens = 0
        self.num_prompt_tokens = 0  # of requests whose prefill finished (vLLM's prompt_tokens_total)
        self.iteration_tokens = TokenHistogram()  # prompt + generated tokens counted in each step
        decode = "compiled" if self.runner.compiled is not None else "eager"
        kv_dtype = config.cache.kv_cache_dtype
        if kv_dtype == "auto":
            kv_dtype = str(self.model.dtype).removeprefix("torch.")
        kv_line = f"paged {kv_dtype}"
        if self.cache is not None:
            kv_line += f", attention {self.cache.attention_backend()}"
        self.backends = describe_backends(
            self.model, loaded.dtype_reason, kv_line, decode, workers=self.executor is not None
        )
        log.info("backends: %s", self.backends)
        self.startup_seconds = time.perf_counter() - started
        log.info("engine ready in %.1f s (decode %s)", self.startup_seconds, decode)

    def _device(self, model: str | LoadedModel, device: str | None, adapt: bool) -> str:
        """The device the engine runs on: a caller's model it does not adapt decides; else `device`, or the
        config's (resolve_device: a one-line error where CUDA is asked for and absent)."""
        resolved = resolve_device(device if device is not None else self.config.load.device)
        if isinstance(model, LoadedModel) and not adapt:
            here = model.model.device
            asked = device is not None or self.config.load.device != "auto"
            if asked and resolved != here:
                raise KeelError(
                    f"--device {resolved}: the model given was loaded on {here} and is served as given; load it on "
                    f"{resolved}, or pass adapt=True to let the engine move it"
                )
            return str(here)
        if self.config.parallel.uses_workers and resolved.type == "cuda" and (resolved.index or 0) != 0:
            raise KeelError(
                f"--device {resolved}: tensor/pipeline-parallel workers take one GPU each, cuda:0 up on every "
                "node (--device cuda)"
            )
        return "cuda" if resolved.type == "cuda" and self.config.parallel.uses_workers else str(resolved)

    def _load(self, model: str | LoadedModel, device: str) -> LoadedModel:
        """The model: a caller's, this process's own load, or (parallel serving) a placeholder while the workers
        load their shards. With offloading only the resident experts may reach the device: load on the host."""
        config = self.config
        offloading = config.offload.enabled
        if config.parallel.uses_workers:
            loaded = self._start_workers(model, device)
        elif isinstance(model, LoadedModel):
            loaded = model
        else:
            host = "cpu" if offloading else device
            options = config.quant.load_options()
            if offloading and config.quant.quantize == AUTO:  # offloading moves float experts: auto keeps them so
                # (auto quantizes only to gguf, whose default keeps nothing else)
                options["quant_keep"] = (*config.quant.kept(GGUF), "*.experts")
            loaded = load_model(model, config.load.dtype, device=host, **options)
        self.offload: ExpertOffload | None = None
        if offloading:
            from keel.serve.offload import enable_expert_offload

            target = loaded.model.device if isinstance(model, LoadedModel) else torch.device(device)
            self.offload = enable_expert_offload(
                loaded,
                config.offload.expert_cache,
                policy=config.offload.expert_cache_policy,
                storage=config.offload.expert_storage,
                prefetch=config.offload.expert_prefetch,
                device=target,
            )
            loaded.model.to(target)
        return loaded

    def _adapt(self, loaded: LoadedModel, owned: bool) -> None:
        """Quantize (what a caller's model still has in float), fuse projections, pre-pack weights: only a model
        this engine loaded, or was told to adapt; a caller's LoadedModel otherwise keeps the modules it was given."""
        quant, load = self.config.quant, self.config.load
        if quant.scheme is not None:
            from keel.quant import quantize_model
            from keel.quant.apply import check_keep

            keep = set(quant.kept(quant.scheme))
            if quant.quant_keep is not None:
                check_keep(loaded.model, keep)
            q = quantize_model(loaded.model, quant.scheme, quant.quant_group_size, keep)
            log.info(
                "quantized %d linear layers to %s (%d kept): %.1f -> %.1f MiB",
                q["quantized"],
                quant.scheme,
                q["kept"],
                q["bytes_before"] / 2**20,
                q["bytes_after"] / 2**20,
            )
        if load.fuse_projections and owned:
            from keel.model.fuse import fuse_projections

            fuse_projections(loaded.model)
        if load.prepack_weights and owned:
            from keel.model.prepack import prepare_bf16_linears
            from keel.quant.panels import panels_pay, store_in_panels

            prepare_bf16_linears(loaded.model)
            if panels_pay():
                stored = store_in_panels(loaded.model)
                if stored:
                    log.info("block weights of %d layers re-stored in panels for the stored-panel kernel", stored)

    def _allocate_kv_cache(self, device: str) -> int:
        """The block manager and (one process) the paged cache tensors; the number of blocks."""
        cache = self.config.cache
        check_kv_cache_dtype(cache.kv_cache_dtype)  # before sizing: --num-blocks skips the byte count
        num_blocks = self.executor.num_blocks if self.executor is not None else self._num_blocks(device)
        # without attention layers a block holds nothing: one a sequence, over all of max_model_len (keel.serve.hybrid)
        block_size = self.max_model_len if states_only(self.model.config) else cache.block_size
        tokens = num_blocks * block_size
        if tokens < self.max_model_len and self.config.scheduler.max_model_len == AUTO_LENGTH:
            log.warning(
                "--max-model-len auto: %d tokens, what the KV cache holds (the model's context is %d)",
                tokens,
                self.max_model_len,
            )
            self.max_model_len = tokens
        elif tokens < self.max_model_len:
            raise KeelError(
                f"KV cache of {num_blocks} blocks x {block_size} tokens cannot hold one sequence of "
                f"max_model_len={self.max_model_len} tokens: raise --kv-cache-memory or lower --max-model-len"
            )
        self.kv = KVCacheManager(num_blocks, block_size, prefix_caching(self.model.config, self.config))
        if self.executor is not None:  # each worker holds its own heads' and layers' share of the blocks
            log.info("KV cache: %d blocks of %d tokens (%d tokens) on every rank", num_blocks, block_size, tokens)
            self.cache = None
            return num_blocks
        if states_only(self.model.config):
            log.info("no attention layers: recurrent states for %d sequences at once", num_blocks)
        else:
            mib = num_blocks * self._bytes_per_block() / 2**20
            log.info("KV cache: %d blocks of %d tokens (%d tokens, %.1f MiB)", num_blocks, block_size, tokens, mib)
        self.cache = make_paged_kv_cache(
            self.model.config,
            num_blocks,
            block_size,
            self.model.dtype,
            device,
            cache.kv_cache_dtype,
            # a running sequence holds a block at least: never more of them than blocks
            sequences=min(self.config.scheduler.max_num_seqs, num_blocks),
        )
        return num_blocks

    def _step_budget(self) -> int:
        """Tokens a step may hold: --max-num-batched-tokens, else the device's default."""
        return step_budget(self.config.scheduler, self.device_type, torch.get_num_threads(), self.max_model_len)

    def _activation_peak(self) -> int:
        """Bytes a full step allocates beyond what is held before it (CUDA): a dummy forward of the step
        budget's tokens with the logits of `max_num_seqs` rows, then the sampler over them with top-k/top-p
        (its sort is the widest tensor of a step). The cache is released after, so the KV pool can use it."""
        device = self.model.device
        tokens = self._step_budget()
        shape = DummyStep.of(tokens, self.max_model_len, self.config.scheduler.max_num_seqs)

        def step() -> None:
            ids = torch.zeros(shape.sequences, shape.length, dtype=torch.long, device=device)
            logits = self.model(ids, select=shape.select(device))
            sample_dummy_rows(logits)

        peak = measured_peak(step, device)
        log.info("activation peak of a %d-token step: %.1f MiB", tokens, peak / 2**20)
        return peak

    def _build_scheduler_and_runner(self) -> None:
        """The scheduler over the block manager, and the runner (this process's, or the workers' executor),
        compiled when `compile` asks or the model is worth it."""
        mc, sched = self.model.config, self.config.scheduler
        windows = {mc.layer_window(i) for i in range(mc.num_layers)}
        # Blocks behind the window can be freed only when every layer slides (a chunked layer's window is negative:
        # its chunk's start, not a fixed span back, so its blocks are kept).
        window = windows.pop() if len(windows) == 1 else None
        self.max_num_batched_tokens = budget = self._step_budget()
        self.scheduler = Scheduler(
            self.kv,
            budget,
            sched.max_num_seqs,
            self.max_model_len,
            sched.scheduling_policy,
            sliding_window=window if window is not None and window > 0 else None,
            chunked_prefill=sched.enable_chunked_prefill,
        )
        self.runner: ModelRunner | ParallelExecutor = (
            ModelRunner(self.model, self.cache, self.kv.block_table) if self.executor is None else self.executor
        )
        self.compile_seconds = 0.0
        offloading = self.config.offload.enabled
        if self.executor is None and decide_compile(self.config.load.compile, self.model, self.cache, offloading):
            self.runner.compiled = CompiledDecode(
                self.model,
                self.cache,
                max_batch=self.config.scheduler.max_num_seqs,
                max_blocks=-(-self.max_model_len // self.cache.block_size),
            )
            self.compile_seconds = self.runner.compiled.warm_up()
            log.info(
                "decode step compiled in %.1f s (inductor cache: %s)",
                self.compile_seconds,
                os.environ.get("TORCHINDUCTOR_CACHE_DIR"),
            )

    def _decide_async_scheduling(self) -> bool:
        """Asynchronous scheduling as asked, or by default where a device runs while the host works (CUDA)."""
        asked = self.config.scheduler.async_scheduling
        unsupported = "speculative decoding" if self.spec is not None else None
        if self.executor is not None:
            unsupported = "parallel workers"
        if asked and unsupported:
            raise KeelError(f"--async-scheduling does not run with {unsupported}")
        if asked is None:
            return self.device_type == "cuda" and unsupported is None
        return asked

    def _build_speculation(self, num_blocks: int, device: str) -> None:
        """The draft model's proposer (its own paged cache over the target's block tables) and the counters."""
        self.drafter: DraftModelProposer | None = None
        if self.draft_model is not None and self.scheduler.sliding_window is not None:
            # The target frees blocks behind its window; the draft's catch-up may still need them.
            raise KeelError("speculative method draft_model does not support sliding-window targets: use ngram")
        if self.draft_model is not None:
            from keel.serve.speculative.draft import DraftModelProposer

            draft, cache = self.draft_model, self.config.cache
            draft_cache = make_paged_kv_cache(
                draft.config, num_blocks, cache.block_size, draft.dtype, device, cache.kv_cache_dtype
            )
            self.drafter = DraftModelProposer(draft, draft_cache, self.kv.block_table)
        # Speculative decoding counters (vLLM's spec_decode_* metrics).
        self.spec_num_drafts = 0  # verification steps (one per request per step that had drafts)
        self.spec_num_draft_tokens = 0
        self.spec_num_accepted_tokens = 0
        self.spec_accepted_per_pos = [0] * (self.spec.num_speculative_tokens if self.spec else 0)

    def _start_workers(self, model: str | LoadedModel, device: str) -> LoadedModel:
        """Parallel serving: start this node's workers, each loading its own shard; the engine keeps only
        the config and tokenizer (a meta-device model stands for the weights)."""
        from keel.dtypes import parse_dtype
        from keel.serve.parallel.executor import ParallelExecutor
        from keel.serve.parallel.launch import worker_spec
        from keel.weights.compute_dtype import choose_dtype

        if isinstance(model, LoadedModel):
            raise KeelError("tensor/pipeline-parallel serving takes a model path: every worker loads its own shard")
        config = self.config
        spec, ranks, checkpoint = worker_spec(model, config, device)
        if 0 not in ranks:
            raise KeelError("the engine runs on node 0 (--node-rank 0); other nodes run their workers only")
        self.executor = ParallelExecutor(
            spec,
            ranks,
            lambda request_id: self.kv.block_table(request_id),
            startup_timeout=config.parallel.startup_timeout,
        )
        with torch.device("meta"):
            placeholder = Transformer(checkpoint.config).to(parse_dtype(spec.dtype))
        reason = choose_dtype(checkpoint, config.load.dtype, device, config.quant.scheme)[1]
        return LoadedModel(placeholder, checkpoint, reason)

    def check_health(self) -> None:
        """Raise when the engine can no longer make progress (a parallel worker died)."""
        if self.executor is not None:
            self.executor.check_health()

    def shutdown(self) -> None:
        """Stop the worker processes of parallel serving (nothing to do for a single process)."""
        if self.executor is not None:
            self.executor.shutdown()

    def _load_draft(self, model: str | LoadedModel, device: str) -> Transformer:
        """The draft model of method draft_model: `model` of the config, or the target's own checkpoint
        (then usually quantized, a cheaper copy); same vocabulary as the target."""
        spec, config = self.spec, self.config
        source = spec.model or (str(model.checkpoint.path) if isinstance(model, LoadedModel) else model)
        quant = config.quant
        draft = load_model(
            source,
            config.load.dtype,
            device=device,
            quantize=spec.quantization or AUTO,  # unset: as the target, a GGUF draft's blocks as stored
            quant_group_size=quant.quant_group_size,
            quant_keep=quant.quant_keep,
            check_kept=False,  # the target's names: a smaller draft may lack some of its layers
        ).model
        if draft.config.vocab_size != self.model.config.vocab_size:
            raise KeelError(
                f"speculative draft model {source}: vocabulary of {draft.config.vocab_size} tokens, the target's "
                f"has {self.model.config.vocab_size} (the draft must share the target's tokenizer)"
            )
        log.info(
            "speculative decoding: draft model %s%s, k=%d",
            source,
            f" ({spec.quantization})" if spec.quantization else "",
            spec.num_speculative_tokens,
        )
        return draft

    def _bytes_per_block(self) -> int:
        """Cache bytes of one block over all layers (and the draft model's, whose K/V share the blocks)."""
        cache = self.config.cache
        models = [self.model] + ([self.draft_model] if self.draft_model is not None else [])
        return sum(kv_cache_bytes(m.config, m.dtype, cache.kv_cache_dtype, tokens=cache.block_size) for m in models)

    def _num_blocks(self, device: str) -> int:
        """Blocks the budget holds beside the recurrent layers' states of max_num_seqs sequences; for a model
        without attention layers, the sequences whose states it holds (at most max_num_seqs: one block each)."""
        cache, seqs = self.config.cache, self.config.scheduler.max_num_seqs
        if cache.num_blocks is not None:
            return cache.num_blocks
        per_block = self._bytes_per_block()
        per_slot = RecurrentStates.bytes_per_slot(self.model.config, self.model.dtype)
        unit = per_slot if states_only(self.model.config) else per_block  # what the budget is counted in
        peak = self._activation_peak
        blocks = blocks_in_budget(unit, cache.kv_cache_memory, device, cache.gpu_memory_utilization, peak)
        if states_only(self.model.config):
            if blocks < 1:
                raise KeelError(
                    f"the recurrent layers' states of one sequence ({per_slot / 2**20:.0f} MiB) do not fit the budget"
                )
            if blocks < seqs:
                log.info("recurrent states for %d sequences fit the budget: fewer than --max-num-seqs %d", blocks, seqs)
            return min(blocks, seqs)
        # recurrent layers: their states for max_num_seqs sequences come out of the same budget
        states = per_slot * seqs
        if states and blocks - -(-states // per_block) < 1:
            raise KeelError(
                f"the recurrent layers' states of --max-num-seqs {seqs} sequences "
                f"({states / 2**20:.0f} MiB) leave no room for the KV cache: lower --max-num-seqs or raise the budget"
            )
        return blocks - -(-states // per_block) if states else blocks

    # ------------------------------------------------------------- requests
    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
    ) -> str:
        params = params or SamplingParams()
        params.validate()
        params.check_vocabulary(self.model.config.vocab_size)
        prompt_ids, text = encode_prompt(prompt, self.tokenizer, self.model.config.vocab_size)
        if params.bad_words and not params.bad_words_token_ids:
            params.bad_words_token_ids = bad_words_token_ids(params.bad_words, self.tokenizer)
        grammar = self._grammar_state(params)
        request_id = request_id if request_id is not None else str(next(self._ids))
        request = Request(request_id, prompt_ids, params, self.eos_token_ids, priority=priority, prompt=text)
        request.grammar = grammar
        if self.executor is None:  # with workers, rank 0 makes the request's generator on its device
            request.generator = request_generator(params, self.model.device)
        self.scheduler.add(request)
        self._tracks[request_id] = OutputTrack(request, self.tokenizer)
        if params.reads_own_tokens:
            self._reads_own_tokens.add(request_id)
        return request_id

    def grammar_backend(self) -> GrammarBackend:
        """The structured-output compiler over this model's vocabulary, built on first use (the server
        also compiles a request's grammar with it at admission, so a bad one is a 400 before queueing)."""
        if self._grammar_backend is None:
            with self._grammar_lock:
                if self._grammar_backend is None:
                    self._grammar_backend = GrammarBackend(
                        self.tokenizer, self.model.config.vocab_size, self.eos_token_ids
                    )
        return self._grammar_backend

    def _grammar_state(self, params: SamplingParams) -> GrammarState | None:
        if params.structured_outputs is None:
            return None
        return self.grammar_backend().new_state(params.structured_outputs)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        request = self.scheduler.abort(request_id)
        if request is None:
            return None
        track = self._tracks.pop(request_id)
        self._reads_own_tokens.discard(request_id)
        self.runner.release(request_id)
        track.stop.finish_reason = track.stop.finish_reason or "abort"
        return build_output(request, track, "", [])

    def reset_prefix_cache(self) -> bool:
        """Forget the prefix cache (vLLM's name): False while requests hold blocks."""
        return self.kv.reset_prefix_cache()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished or self._pending is not None

    # ----------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """One step: schedule, run, and the outputs of what changed. With asynchronous scheduling the outputs
        are those of the step before, read after this one was queued."""
        self._enter_device()
        if self.async_scheduling and not self._reads_own_tokens:
            return self._step_async()
        pending, self._pending = self._pending, None
        outputs = self._read(pending) if pending is not None else []
        return outputs + self._step_sync()

    def _enter_device(self) -> None:
        if self._cuda is not None:
            torch.cuda.set_device(self._cuda)

    def _step_async(self) -> list[RequestOutput]:
        """Schedule and queue this step with the previous step's tokens still in flight (the runner feeds them
        from the device), then read the previous step's tokens and emit them."""
        sched = self.scheduler.schedule()
        launched = None
        if sched.scheduled:
            launched = self.runner.launch(sched, self._pending)
            for request, n in sched.scheduled:
                draws = request.num_computed_tokens + n == request.num_tokens
                self.scheduler.computed(request, n)
                if draws:
                    request.in_flight += 1
                else:  # a prefill chunk: every token it fed is known
                    self.scheduler.commit(request)
        pending, self._pending = self._pending, launched
        return self._read(pending) if pending is not None else []

    def _read(self, launched: LaunchedStep) -> list[RequestOutput]:
        """Wait for a queued step's tokens and emit them (a request that finished or was aborted meanwhile
        drops its token)."""
        result = self.runner.collect(launched)
        now = time.perf_counter()
        counted = self.num_prompt_tokens + self.num_generated_tokens
        outputs = []
        for request in launched.samplers:
            request.in_flight -= 1
            if request.is_finished:
                continue
            rid = request.request_id
            track = self._tracks[rid]
            tokens, logprobs = result.token_ids[rid], result.logprobs.get(rid)
            emitted, released, finished = self._emit(request, track, tokens, logprobs, now)
            self.scheduler.commit(request)
            self._settle(request, track, released, emitted, finished, outputs)
        self.iteration_tokens.observe(self.num_prompt_tokens + self.num_generated_tokens - counted)
        return outputs

    def _settle(
        self,
        request: Request,
        track: OutputTrack,
        released: str,
        emitted: list[int],
        finished: bool,
        outputs: list[RequestOutput],
    ) -> None:
        """After a request's tokens were emitted: free it if it finished, and add its output where its kind
        wants one now."""
        if finished:
            self._finish(request)
        if finished or request.params.output_kind is not RequestOutputKind.FINAL_ONLY:
            outputs.append(build_output(request, track, released, emitted))

    def _finish(self, request: Request) -> None:
        self.scheduler.finish(request)
        self._tracks.pop(request.request_id)
        self._reads_own_tokens.discard(request.request_id)
        self.runner.release(request.request_id)

    def _step_sync(self) -> list[RequestOutput]:
        proposed = self._propose_before_schedule()
        sched = self.scheduler.schedule()
        if not sched.scheduled:
            self._clear_drafts(proposed)
            return []
        if self.drafter is not None:
            verifying = [r for r, _ in sched.scheduled if r.spec_token_ids]
            if verifying:
                self.drafter.propose(verifying)
        self._grammar_masks(sched.scheduled)
        try:
            result = self.runner.execute(sched)
        except BaseException:
            self._clear_drafts(proposed)
            raise
        now = time.perf_counter()
        counted = self.num_prompt_tokens + self.num_generated_tokens
        outputs = []
        for request, n in sched.scheduled:
            track = self._tracks[request.request_id]
            if request.request_id in result.prompt_logprobs and track.prompt_logprobs is not None:
                entries = result.prompt_logprobs[request.request_id]
                first_chunk = request.num_computed_tokens == 0
                track.prompt_logprobs = entries if first_chunk else track.prompt_logprobs + entries
            tokens = result.token_ids.get(request.request_id)
            if tokens is None:  # a prefill chunk: nothing sampled yet
                self.scheduler.advance(request, n)
                continue
            drafts = request.spec_token_ids
            if drafts:
                self._count_acceptance(request, len(drafts), len(tokens) - 1)
            logprobs = result.logprobs.get(request.request_id)
            emitted, released, finished = self._emit(request, track, tokens, logprobs, now)
            # In the cache now: what was fed but the rejected drafts, i.e. every emitted token but the
            # last (fed next step). The scheduler registers full blocks from the output, so it comes after.
            self.scheduler.advance(request, n - len(drafts) + len(emitted) - 1)
            if drafts:
                request.draft_computed = min(request.draft_computed, request.num_computed_tokens)
            self._settle(request, track, released, emitted, finished, outputs)
        self._clear_drafts(proposed)
        # vLLM's tokens of an iteration: the prompts whose prefill finished in it and the tokens it generated.
        self.iteration_tokens.observe(self.num_prompt_tokens + self.num_generated_tokens - counted)
        return outputs

    @staticmethod
    def _grammar_masks(scheduled: list[tuple[Request, int]]) -> None:
        """The bitmask rows of each structured request that samples this step (all of them in one pass
        before the forward; verification gets one row per draft position)."""
        for request, n in scheduled:
            grammar: GrammarState | None = request.grammar  # type: ignore[assignment]
            if grammar is None:
                continue
            if request.spec_token_ids:
                request.token_bitmask = grammar.draft_masks(request.spec_token_ids)
            elif request.num_computed_tokens + n == request.num_tokens:
                request.token_bitmask = grammar.next_mask()
            else:
                request.token_bitmask = None  # a prefill chunk that samples nothing

    def _emit(
        self, request: Request, track: OutputTrack, tokens: list[int], logprobs: list[TokenLogprobs] | None, now: float
    ) -> tuple[list[int], str, bool]:
        """Append a step's tokens to the request's output one by one, through the stop checks (stop
        tokens and strings, EOS, max_tokens); tokens after a stop are dropped.
        Returns (tokens emitted, text released, finished)."""
        released_text, emitted = "", []
        # A request preempted with its token in flight (asynchronous scheduling) stays protected until it
        # runs again.
        running = request.status is Status.RUNNING
        for i, token in enumerate(tokens):
            request.output_token_ids.append(token)
            request.protected = request.protected and not running
            if request.stats.first_token is None:
                request.stats.first_token = now
                self.num_prompt_tokens += len(request.prompt_token_ids)  # counted when its prefill ends, as vLLM
            request.stats.token_times.append(now)
            self.num_generated_tokens += 1
            emitted.append(token)
            if track.logprobs is not None and logprobs is not None:
                track.add_logprob(logprobs[i])
            delta = track.detok.add(token) if track.detok else ""
            released, finished = track.stop.add(token, delta)
            grammar: GrammarState | None = request.grammar  # type: ignore[assignment]
            if grammar is not None and not finished and (not grammar.accept(token) or grammar.terminated):
                # The grammar is complete (its stop token accepted under ignore_eos), or nothing it allows
                # could be sampled (min_tokens or allowed_token_ids excluding all of it): the output ends.
                more, finished = track.stop.finish("stop")
                released += more
            track.text += released
            released_text += released
            if finished:
                return emitted, released_text, True
        return emitted, released_text, False

    # ---------------------------------------------------------- speculation
    def _speculating(self) -> bool:
        """Speculation runs while the batch is small enough to be bound by weight streaming (see
        SpeculativeConfig.disable_by_batch_size)."""
        if self.spec is None:
            return False
        return 0 < len(self.scheduler.running) <= self.spec.max_batch(self.device_type)

    def _propose_before_schedule(self) -> list[Request]:
        """Drafts (n-gram) or reserved draft slots (draft model) for running requests about to decode.
        A request never drafts past its max_tokens: the verified step also emits one token of its own."""
        if not self._speculating():
            return []
        spec = self.spec
        proposed = []
        for request in self.scheduler.running:
            if request.num_remaining != 1 or request.params.prompt_logprobs is not None:
                continue
            k = min(spec.num_speculative_tokens, request.params.max_tokens - len(request.output_token_ids) - 1)
            if k < 1:
                continue
            if spec.method == "ngram":
                drafts = propose_ngram(request.all_token_ids, k, spec.prompt_lookup_min, spec.prompt_lookup_max)
            else:
                drafts = [0] * k  # placeholders: the draft model fills the slots the scheduler reserves
            if drafts:
                request.spec_token_ids = drafts
                proposed.append(request)
        return proposed

    @staticmethod
    def _clear_drafts(requests: list[Request]) -> None:
        for request in requests:
            request.spec_token_ids, request.spec_probs = [], None

    def _count_acceptance(self, request: Request, drafted: int, accepted: int) -> None:
        request.stats.spec_draft_tokens += drafted
        request.stats.spec_accepted_tokens += accepted
        request.stats.spec_verify_steps += 1
        self.spec_num_drafts += 1
        self.spec_num_draft_tokens += drafted
        self.spec_num_accepted_tokens += accepted
        for pos in range(accepted):
            self.spec_accepted_per_pos[pos] += 1

    # ---------------------------------------------------------------- stats
    def cache_config_info(self) -> dict[str, str]:
        """The KV cache's configuration as label values (vLLM's `vllm:cache_config_info` gauge, set to 1)."""
        cache = self.config.cache
        return {
            "block_size": str(self.kv.block_size),
            "num_gpu_blocks": str(self.kv.num_blocks),  # vLLM's name; the blocks wherever the cache lives
            "cache_dtype": cache.kv_cache_dtype,
            "enable_prefix_caching": str(self.kv.enable_prefix_caching),
            "gpu_memory_utilization": str(cache.gpu_memory_utilization),
        }

    def stats(self) -> dict[str, float]:
        """Gauges and counters for the metrics endpoint."""
        kv = self.kv
        stats = {
            "num_requests_running": len(self.scheduler.running),
            "num_requests_waiting": len(self.scheduler.waiting),
            "kv_cache_usage_perc": kv.usage(),
            "prefix_cache_queries": kv.prefix_queries,
            "prefix_cache_hits": kv.prefix_hits,
            "prefix_cache_hit_rate": kv.prefix_hits / kv.prefix_queries if kv.prefix_queries else 0.0,
            "num_preemptions_total": self.scheduler.num_preemptions,
            "prompt_tokens_total": self.num_prompt_tokens,
            "generation_tokens_total": self.num_generated_tokens,
            # Copies: the snapshot outlives this step while the engine goes on counting.
            "iteration_tokens_counts": list(self.iteration_tokens.counts),
            "iteration_tokens_sum": self.iteration_tokens.sum,
        }
        if self.spec is not None:
            stats.update(
                {
                    "spec_decode_num_drafts": self.spec_num_drafts,
                    "spec_decode_num_draft_tokens": self.spec_num_draft_tokens,
                    "spec_decode_num_accepted_tokens": self.spec_num_accepted_tokens,
                    "spec_decode_acceptance_rate": (
                        self.spec_num_accepted_tokens / self.spec_num_draft_tokens
                        if self.spec_num_draft_tokens
                        else 0.0
                    ),
                    "spec_decode_num_accepted_tokens_per_pos": list(self.spec_accepted_per_pos),
                }
            )
        if self.offload is not None:
            stats.update(self.offload.stats.as_engine_stats())
        return stats
