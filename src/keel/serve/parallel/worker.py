"""Engine worker processes for tensor- and pipeline-parallel serving.

Ranks are laid out stage-major: rank = pp_rank * tp + tp_rank. Each worker joins the process group
(gloo on CPU, NCCL on CUDA, with a gloo group for control messages), loads only its shard
(keel.serve.parallel.load), allocates a KV-cache pool for its own KV heads and layers (every rank
the same number of blocks: the minimum over ranks of what its budget holds), and reports ready.

Global rank 0 talks to the engine over a pipe. For every step the engine sends what changed (new
requests, the scheduled requests' progress, block tables and new tokens); rank 0 keeps a mirror of
each request (parameters, tokens, its seeded generator), turns the step into chunks, broadcasts
them to every rank (`broadcast_object_list`), runs its stage, samples on the logits and sends back
only the sampled token ids (and logprobs when asked). The other ranks loop on the broadcast.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import resource
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from keel.dtypes import parse_dtype
from keel.model.fuse import fuse_projections
from keel.model.kv_size import kv_cache_bytes
from keel.model.prepack import prepare_bf16_linears
from keel.model.stages import layer_ranges
from keel.model.transformer import Transformer
from keel.platform import local_rank_cuda
from keel.quant.apply import check_keep, quantize_kept, set_activations
from keel.quant.config import QuantConfig
from keel.quant.panels import panels_pay, store_in_panels
from keel.serve.config import CacheConfig, LoadConfig, ParallelConfig
from keel.serve.kv_budget import DummyStep, blocks_in_budget, measured_peak
from keel.serve.kv_quant import make_paged_kv_cache
from keel.serve.launched import TokenFill
from keel.serve.parallel.load import load_tensor_parallel
from keel.serve.parallel.stage import StageRunner
from keel.serve.parallel.tensor import quantize_shard
from keel.serve.parallel.tensor import weight_bytes as rank_weight_bytes
from keel.serve.request import Request
from keel.serve.runner import Chunk, ModelRunner
from keel.serve.sampling import SamplingParams, request_generator, sample_dummy_rows
from keel.serve.scheduler import SchedulerOutput
from keel.weights.shard import TensorParallelLayout

log = logging.getLogger("keel.serve")
# Rank 0 to the followers while the engine sends no step (a step is a list of chunks; None stops them).
PING = "ping"


@dataclass
class WorkerSpec:
    """What every worker needs to start: the model, the engine's load, quant, cache and parallel options,
    and where this node's ranks meet."""

    model: str
    dtype: str  # resolved by the engine ("bfloat16", ...): no worker opens the checkpoint twice
    init_method: str  # "tcp://ADDR:PORT"
    local_world: int  # ranks on this node
    load: LoadConfig
    quant: QuantConfig
    cache: CacheConfig
    parallel: ParallelConfig
    device: str = "cpu"  # "cpu" | "cuda"
    # The full step every rank runs once before its KV pool is sized (the activation peak it measures on CUDA).
    dummy_step: DummyStep = DummyStep(1, 1, 1)
    # The engine's max_model_len as asked (LongRoPE's set of frequencies: Transformer.fix_rope_context); 0: none.
    max_model_len: int = 0

    @property
    def tp(self) -> int:
        return self.parallel.tensor_parallel_size

    @property
    def pp(self) -> int:
        return self.parallel.pipeline_parallel_size

    @property
    def world_size(self) -> int:
        return self.parallel.world_size


@dataclass
class NewRequest:
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: list[int]


@dataclass
class StepEntry:
    """One scheduled request's state as the engine sees it this step."""

    request_id: str
    num_scheduled: int
    num_computed_tokens: int
    new_output_ids: list[int]  # output tokens the mirror has not seen yet
    spec_token_ids: list[int]
    block_table: list[int]
    new: NewRequest | None = None  # the first time the request is scheduled
    token_bitmask: torch.Tensor | None = None  # structured outputs: the engine's grammar masks for this step


@dataclass
class StepMessage:
    entries: list[StepEntry]
    released: list[str] = field(default_factory=list)  # finished or aborted: drop the mirrors


@dataclass
class WorkerReport:
    rank: int
    num_blocks: int
    weight_bytes: int
    kv_bytes: int
    load_seconds: float
    rss_before_load: int  # bytes (CPU), or device bytes allocated (CUDA)
    peak_at_load: int
    activation_peak: int = 0  # bytes of a full step beyond the weights (CUDA; 0 on CPU, not measured)


def _peak_rss() -> int:
    """This process's peak resident bytes (VmHWM: unlike getrusage's maxrss, not inherited from the
    process that spawned us)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _watch_parent() -> None:
    """Exit when the engine process is gone (killed without closing our pipe)."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, daemon=True, name="keel-parent-watch").start()


def worker_main(spec: WorkerSpec, rank: int, conn, events) -> None:
    """Entry point of a spawned worker: start, report on `events`, then serve steps until told to stop."""
    _watch_parent()
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s rank{rank} %(name)s: %(message)s")
    try:
        worker = Worker(spec, rank)
    except BaseException as e:  # noqa: BLE001 - any start-up failure is reported, then the process exits
        events.put(("error", rank, f"{type(e).__name__}: {e}"))
        sys.exit(1)
    events.put(("ready", rank, worker.report))
    try:
        if rank == 0:
            worker.serve_engine(conn)
        else:
            worker.follow()
        # A clean stop: every rank leaves its loop before any tears gloo down (a peer closing its pairs
        # while another rank's gloo threads still use them aborts that process).
        dist.barrier(group=worker.control)
    except BaseException as e:  # noqa: BLE001
        log.error("rank %d failed: %s: %s", rank, type(e).__name__, e)
        events.put(("error", rank, f"{type(e).__name__}: {e}"))
        # Without tearing the process groups down: under NCCL that waits for the failed step's collectives,
        # which the peers (stopped by the engine on this report) never finish.
        sys.exit(1)
    dist.destroy_process_group()


class Worker:
    def __init__(self, spec: WorkerSpec, rank: int) -> None:
        """Join the process groups, load this rank's shard, allocate its share of the KV cache."""
        self.spec, self.rank = spec, rank
        tp_group = self._join(spec, rank)
        stage, tp_rank = divmod(rank, spec.tp)
        before = torch.cuda.memory_allocated(self.device) if spec.device == "cuda" else _peak_rss()
        started = time.perf_counter()
        model, weight_bytes = self._load_shard(spec, stage, tp_rank, tp_group)
        load_seconds = time.perf_counter() - started
        peak = torch.cuda.max_memory_allocated(self.device) if spec.device == "cuda" else _peak_rss()
        activation_peak = self._dummy_step(model, stage)
        cache = self._allocate_cache(model, stage, tp_rank, activation_peak)
        config = model.config
        self.stage = StageRunner(
            model,
            cache,
            rank=rank,
            tp=spec.tp,
            pp=spec.pp,
            hidden_size=config.hidden_size,
            vocab_size=config.vocab_size,
        )
        self.report = WorkerReport(
            rank, cache.num_blocks, weight_bytes, cache.nbytes(), load_seconds, before, peak, activation_peak
        )
        self._mirrors: dict[str, Request] = {}
        self._tables: dict[str, list[int]] = {}
        self.runner = _SamplingRunner(self) if rank == 0 else None

    def _join(self, spec: WorkerSpec, rank: int):
        """Pick the device, join the world (gloo on CPU, NCCL on CUDA) and return this rank's tensor-parallel group."""
        tp, pp = spec.tp, spec.pp
        local_rank = rank - spec.parallel.node_rank * spec.local_world
        if spec.device == "cuda":
            self.device = local_rank_cuda(local_rank)  # a start-up failure: the engine names the rank
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
            threads = spec.parallel.worker_threads
            torch.set_num_threads(threads or max(1, (os.cpu_count() or 1) // spec.local_world))
        backend = "nccl" if spec.device == "cuda" else "gloo"
        timeout = timedelta(seconds=spec.parallel.distributed_timeout)
        dist.init_process_group(
            backend, init_method=spec.init_method, rank=rank, world_size=spec.world_size, timeout=timeout
        )
        # Control messages (pickled objects) travel over a gloo group of their own, on the host. The followers wait
        # there for the next step however long the server stays idle: rank 0 renews their wait (`PING`) well
        # inside the timeout. Start-up's one collective has its own group: ranks finish loading apart.
        self.control = dist.new_group(backend="gloo", timeout=timeout)
        self._ping_every = spec.parallel.distributed_timeout / 4
        startup = timedelta(seconds=max(spec.parallel.startup_timeout, spec.parallel.distributed_timeout))
        self.startup_group = dist.new_group(backend="gloo", timeout=startup)
        tp_groups = [dist.new_group(list(range(s * tp, (s + 1) * tp)), timeout=timeout) for s in range(pp)]
        return tp_groups[rank // tp]

    def _load_shard(self, spec: WorkerSpec, stage: int, tp_rank: int, tp_group) -> tuple[torch.nn.Module, int]:
        """This rank's shard, quantized, fused and pre-packed as the engine's options say; and its weight bytes."""
        loaded = load_tensor_parallel(
            spec.model,
            parse_dtype(spec.dtype),
            spec.tp,
            tp_rank,
            tp_group,
            self.device,
            stage=stage,
            num_stages=spec.pp,
            expert_parallel=spec.parallel.enable_expert_parallel,
        )
        model, quant = loaded.model, spec.quant
        if quant.scheme is not None:
            keep = quant.kept(quant.scheme)
            if quant.quant_keep is not None:  # against the whole model's names: a stage holds only some
                with torch.device("meta"):
                    check_keep(Transformer(loaded.checkpoint.config), keep)
            stats = quantize_shard(model, quant.scheme, quant.quant_group_size, keep)
            if quant.quant_keep_as is not None:
                stats["quantized"] += quantize_kept(model, keep, quant.quant_keep_as, quant.quant_group_size)
            set_activations(model, quant.quant_activations)
            log.info(
                "rank %d: %d layers quantized to %s, %d kept",
                self.rank,
                stats["quantized"],
                quant.scheme,
                stats["kept"],
            )
        if spec.max_model_len:
            model.fix_rope_context(spec.max_model_len)
        # This rank's weights (a tied head counted once), before fusing and packing re-store them.
        weight_bytes = rank_weight_bytes(model)
        if spec.load.fuse_projections:
            fuse_projections(model)
        if spec.load.prepack_weights:
            prepare_bf16_linears(model)
            if panels_pay():
                store_in_panels(model)
        return model, weight_bytes

    def _dummy_step(self, model: torch.nn.Module, stage: int) -> int:
        """This rank's share of a full step (spec.dummy_step), run in step with the peers of its stage (their
        tensor-parallel collectives) before any KV cache exists: the first stage embeds token ids, a later one
        takes hidden states, the last computes the sampled rows' logits, and rank 0 samples them. On CUDA the
        bytes it allocates at its peak (what the KV pool must leave free); on CPU it runs (warming the
        kernels) and 0 is returned."""
        shape, device, pp = self.spec.dummy_step, self.device, self.spec.pp
        last = stage == pp - 1

        def step() -> None:
            size = (shape.sequences, shape.length)
            if stage == 0:
                x = torch.zeros(size, dtype=torch.long, device=device)
            else:
                x = torch.zeros(*size, model.config.hidden_size, dtype=model.dtype, device=device)
            out = model(x, select=shape.select(device) if last else None)
            if self.rank == 0:  # the sampler's rank: its logits come from the last stage
                logits = out if last else torch.zeros(shape.rows, model.config.vocab_size, device=device)
                sample_dummy_rows(logits.to(model.dtype))

        if self.spec.device != "cuda":
            with torch.inference_mode():
                step()
            return 0
        return measured_peak(step, device)

    def _allocate_cache(self, model: torch.nn.Module, stage: int, tp_rank: int, activation_peak: int):
        """This rank's KV heads and layers of every block; every rank the same number of blocks (the minimum
        over ranks of what each budget holds, each after its own activation peak)."""
        spec, cache = self.spec, self.spec.cache
        config = model.config
        layout = TensorParallelLayout(config, spec.tp, tp_rank)
        first, last = layout.kv_head_range()
        local = dataclasses.replace(config, num_heads=layout.local_heads, num_kv_heads=last - first)
        layers = layer_ranges(config.num_layers, spec.pp)[stage]
        per_block = kv_cache_bytes(local, model.dtype, cache.kv_cache_dtype, tokens=cache.block_size)
        per_block = per_block * len(layers) // config.num_layers
        budget = cache.num_blocks
        if budget is None:
            budget = blocks_in_budget(
                per_block,
                cache.kv_cache_memory,
                self.device,
                cache.gpu_memory_utilization,
                lambda: activation_peak,
            )
        blocks = torch.tensor([budget], dtype=torch.long)
        dist.all_reduce(blocks, op=dist.ReduceOp.MIN, group=self.startup_group)  # every rank the same blocks
        return make_paged_kv_cache(
            local, int(blocks.item()), cache.block_size, model.dtype, self.device, cache.kv_cache_dtype, layers=layers
        )

    # ------------------------------------------------------------------ loops
    def follow(self) -> None:
        """Ranks other than 0: run every broadcast step until the stop message (None)."""
        while True:
            chunks = self._broadcast(None)
            if chunks is None:
                return
            if chunks == PING:
                continue
            self.stage.run(chunks)

    def serve_engine(self, conn) -> None:
        """Rank 0: apply each step message from the engine, run it, answer with the sampled tokens."""
        while True:
            try:
                while not conn.poll(self._ping_every):  # idle: the followers' wait for a step starts over
                    self._broadcast(PING)
                message = conn.recv()
            except EOFError:  # the engine is gone
                message = None
            if message is None:
                self._broadcast(None)
                return
            try:
                result = self.runner.execute(self._apply(message))
            except BaseException as e:
                conn.send(("error", f"rank 0: {type(e).__name__}: {e}"))
                raise
            conn.send(("ok", result))

    def _broadcast(self, chunks: list[Chunk] | str | None) -> list[Chunk] | str | None:
        """Rank 0's chunks to every rank (None: stop; PING: nothing to run yet)."""
        box = [chunks]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def _apply(self, message: StepMessage) -> SchedulerOutput:
        """The engine's step as a SchedulerOutput over this rank's request mirrors."""
        for request_id in message.released:
            self._mirrors.pop(request_id, None)
            self._tables.pop(request_id, None)
        out = SchedulerOutput()
        for entry in message.entries:
            if entry.new is not None:
                new = entry.new
                mirror = Request(entry.request_id, new.prompt_token_ids, new.params, new.eos_token_ids)
                mirror.generator = request_generator(new.params, self.device)
                self._mirrors[entry.request_id] = mirror
            mirror = self._mirrors[entry.request_id]
            mirror.output_token_ids.extend(entry.new_output_ids)
            mirror.num_computed_tokens = entry.num_computed_tokens
            mirror.spec_token_ids = entry.spec_token_ids
            mirror.token_bitmask = entry.token_bitmask
            self._tables[entry.request_id] = entry.block_table
            out.scheduled.append((mirror, entry.num_scheduled))
        return out


class _SamplingRunner(ModelRunner):
    """Rank 0's runner: the engine's sampling and logprobs over logits from the parallel forward."""

    def __init__(self, worker: Worker) -> None:
        super().__init__(worker.stage.model, worker.stage.cache, worker._tables.__getitem__)
        self.worker = worker

    def _forward(self, chunks: list[Chunk], fill: TokenFill | None):
        """The parallel forward; `fill` is always None: the engine schedules synchronously with workers."""
        from keel.serve.parallel.stage import selected_rows

        self.worker._broadcast(chunks)
        return self.worker.stage.run(chunks), selected_rows(chunks)
