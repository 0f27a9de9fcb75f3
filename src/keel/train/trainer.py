"""The training loop of one rank (`keel train` runs it under torchrun, or in-process for one rank).

One step: `grad_accum` micro-batches forward + backward (through the pipeline schedule when
pp > 1), the loss averaged over data-parallel ranks and pipeline stages, gradients unscaled (fp16)
and clipped by their global norm over every mesh dimension and stage, the guard's verdict (NaN,
spikes), then the optimizer and schedule step. Metrics go to the run's JSONL file; checkpoints to
RUN/checkpoints (see keel.train.checkpoint). The model module is the one serving uses:
parallelism is applied from outside (keel.train.parallel, keel.train.pipeline).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import math
import os
import random
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor, nn

from keel.atomic import write_json_atomic, write_text_atomic
from keel.config import ModelConfig
from keel.dtypes import DTYPES
from keel.errors import KeelError
from keel.families import stored_names
from keel.model.loss import cross_entropy_loss
from keel.model.seeded_init import init_weights_seeded, materialize
from keel.model.transformer import Transformer
from keel.plan.run import predict_run_memory
from keel.platform import local_rank_cuda
from keel.train import flight_recorder, moe_stats
from keel.train.checkpoint import CheckpointManager, ModelParts, latest_checkpoint, load_model_only
from keel.train.config import Layout, TrainConfig, config_json, dump_config, model_config_from, resolve_layout
from keel.train.data import BatchLoader, iter_eval_batches, open_datasets
from keel.train.determinism import deterministic_kernels
from keel.train.faults import Faults
from keel.train.guard import TrainingGuard
from keel.train.hf_export import export_hf
from keel.train.host_memory import HeapTrimmer, set_mmap_threshold, trim_heap_wanted
from keel.train.memory import StepMemory, track_step_memory
from keel.train.metrics import (
    MetricsFile,
    current_memory_bytes,
    flops_per_token,
    peak_flops,
    peak_memory_bytes,
)
from keel.train.optim import apply_schedule, build_optimizer, build_scheduler
from keel.train.precision import DynamicLossScaler, clip_grad_norm_
from keel.train.preflight import check_vocabulary
from keel.train.profiling import StepProfiler
from keel.train.sharded_load import check_loadable, load_shards
from keel.train.trackers import TensorBoardTracker, Trackers, WandbTracker
from keel.train.watchdog import StepWatchdog

log = logging.getLogger("keel.train")

COMPUTE = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}


class GuardStop(KeelError):
    """The guard's policy ended the run."""


@dataclass
class TrainResult:
    steps_done: int
    final_loss: float | None
    losses: dict[int, float] = field(default_factory=dict)
    events: list[dict] = field(default_factory=list)
    stopped_by_signal: bool = False


def _rank_device(asked: str, local_rank: int) -> torch.device:
    """`run.device` for the rank with this LOCAL_RANK: one GPU per local rank, or the CPU."""
    if asked == "cpu" or (asked == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise KeelError('run.device = "cuda": torch sees no CUDA device here (a CPU build, or no GPU visible)')
    return local_rank_cuda(local_rank, ' (use --nproc at most that, or run.device = "cpu")')


def _env_world() -> tuple[int, int, int]:
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("LOCAL_RANK", 0))


class Trainer:
    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg
        self.rank, self.world, local_rank = _env_world()
        self._restore_kernels = deterministic_kernels(cfg.run.deterministic)  # before any product runs
        self.device = _rank_device(cfg.run.device, local_rank)
        if self.world > 1 and not dist.is_initialized():
            backend = "nccl" if self.device.type == "cuda" else "gloo"
            events = cfg.parallel.flight_recorder_events
            if backend == "nccl" and events > 0:  # read when the group is created; a user's own settings win
                for name, value in flight_recorder.environment(cfg.run_dir, events).items():
                    os.environ.setdefault(name, value)
            _init_process_group(backend, self.rank, self.world, timedelta(seconds=cfg.parallel.timeout_s))
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        set_mmap_threshold(cfg.run.mmap_threshold_kib)
        self.faults = Faults.from_env()
        self._fault_scale = 1.0
        self._evaluating = False  # the pipeline loss function returns the plain loss while validating
        self._stop_requested = False
        self.model_config, self.tokenizer, model = self._build_model()
        if cfg.checkpoint.export_hf and self.model_config.is_moe:
            raise KeelError(
                "checkpoint.export_hf: HF stores a mixture-of-experts model's experts one tensor each; "
                "write it with `keel convert CHECKPOINT OUT` after the run"
            )
        if cfg.checkpoint.export_hf and stored_names(self.model_config) is None:
            raise KeelError(
                f"checkpoint.export_hf: {self.model_config.architecture} checkpoints store tensors fused, which a "
                "rank's shards are not written as; write it with `keel convert CHECKPOINT OUT` after the run"
            )
        self.layout: Layout = resolve_layout(cfg, self.world, self.model_config)
        self.mesh = None
        self.pipeline = None
        self._stage_cross_entropy: Callable[..., Tensor] = cross_entropy_loss  # a pipeline's last stage
        self._build_parallel(model)
        # The rank's memory with the model's skeleton built and parallelised, no weight in it yet (torch, keel
        # and the libraries its modules and parallelisms load, the process group, the tokenizer): start-up
        # and first-step peaks are reported above it. After the parallelisms: FSDP's first use imports
        # torch._dynamo (~100 MB of resident memory), which is not the model's.
        self._memory_base = current_memory_bytes(self.device)
        if self.device.type == "cuda":  # peaks from here: not a high-water mark left by earlier work in the process
            torch.cuda.reset_peak_memory_stats(self.device)
        self._materialize()
        self.heap = self._heap_trimmer()
        self.moe = moe_stats.moe_layers(self.modules)
        moe_stats.configure(self.moe, cfg.moe)
        opt = cfg.optimizer
        self.optimizers = [
            build_optimizer([m], opt.lr, tuple(opt.betas), opt.eps, opt.weight_decay, opt.fused) for m in self.modules
        ]
        sch = cfg.schedule
        self.schedulers = [
            build_scheduler(o, sch.warmup_steps, cfg.training.steps, sch.decay, sch.min_lr_ratio)
            for o in self.optimizers
        ]
        tr = cfg.training
        self.scaler = DynamicLossScaler(
            tr.init_scale, tr.growth_factor, tr.backoff_factor, tr.growth_interval, enabled=tr.precision == "fp16"
        )
        g = cfg.guard
        self.guard = TrainingGuard(
            g.nan, g.spike, g.spike_zscore, g.grad_norm_zscore, g.window, g.warmup, g.escalate_after
        )
        self.train_file, self.val_file = open_datasets(cfg.data.path, cfg.data.val_path, cfg.data.val_tokens)
        check_vocabulary(self.train_file, self.model_config.vocab_size)
        dp_rank, dp_size = self._dp_rank_size()
        self.loader = BatchLoader(
            self.train_file,
            cfg.data.seq_len,
            tr.micro_batch_size,
            dp_rank,
            dp_size,
            cfg.run.seed,
            self.layout.grad_accum,
        )
        self.run_dir = cfg.run_dir
        check_resumable_shape(cfg, self.model_config)  # before config.toml is rewritten for a model it cannot load
        if self.rank == 0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            write_text_atomic(self.run_dir / "config.toml", dump_config(cfg))
        self.checkpoints = CheckpointManager(
            self.run_dir,
            cfg.checkpoint.keep,
            cfg.checkpoint.async_save,
            write_model_files=self._write_model_files,
            before_commit=lambda step: self.faults.before_commit(step, self.rank),
        )
        self.metrics = MetricsFile(cfg.metrics_path, enabled=self.rank == 0)
        self.trackers = Trackers([])  # opened by run(), on rank 0
        self.step = 0
        self.rollbacks = 0
        self.state_bytes: dict[str, int] | None = None  # measured after the first update
        self.flops_per_token = flops_per_token(self.model_config, cfg.data.seq_len)
        self.peak_flops, self.peak_source = peak_flops(self.device, tr.precision)
        recorded = self.world > 1 and self.device.type == "cuda" and cfg.parallel.flight_recorder_events > 0
        on_fire = (lambda: flight_recorder.dump(cfg.run_dir, self.rank)) if recorded else None
        self.watchdog = StepWatchdog(cfg.watchdog.timeout_s, on_fire)
        self.profiler = StepProfiler(cfg.profile, cfg.run_dir, self.rank, self.device)
        self.predicted_memory = predict_run_memory(cfg, self.model_config, self.layout)
        self.memory_record: dict[str, Any] | None = None  # [log] memory_breakdown: the measured step
        self._step_memory: StepMemory | None = None
        self._startup_peak: int | None = peak_memory_bytes(self.device) - self._memory_base
        # What a seed checkpoint restores besides the model (its RNG streams go on).
        self._initial_state = copy.deepcopy({k: v for k, v in self.trainer_state().items() if k != "rng"})

    # ------------------------------------------------------------------ setup
    def _build_model(self) -> tuple[ModelConfig, Any, Transformer]:
        """The model, built on the meta device: it holds no memory until each rank materialises its own
        shards (`_materialize`, after the parallelisms are applied), initialised from the seed or read
        from `model.source` (keel.train.sharded_load)."""
        from keel.tokenizer import Tokenizer
        from keel.weights import open_checkpoint
        from keel.weights.dcp import is_dcp_checkpoint
        from keel.weights.loader import resolve_path

        cfg = self.cfg
        torch.manual_seed(cfg.run.seed)
        self._source = None  # a checkpoint whose tensors each rank reads its shards of
        self._source_dcp: Path | None = None  # a keel training checkpoint: DCP reads and reshards its model
        if cfg.model.source is not None:
            path = resolve_path(cfg.model.source)
            if is_dcp_checkpoint(path):
                config = ModelConfig.from_json_file(path / "config.json")
                tokenizer = Tokenizer.from_hf_dir(path, eos_token_ids=config.eos_token_id)
                self._source_dcp = path
            else:
                checkpoint = open_checkpoint(path)
                check_loadable(checkpoint, cfg.model.source)
                config, tokenizer, self._source = checkpoint.config, checkpoint.tokenizer, checkpoint
        else:
            config = model_config_from(cfg.model.config)
            tokenizer = open_checkpoint(cfg.model.tokenizer_ref).tokenizer
        with torch.device("meta"):
            model = Transformer(config)
        model.to(DTYPES[cfg.model.dtype])
        model.train()
        return config, tokenizer, model

    def _materialize(self) -> None:
        """Give each meta-device module this rank's shards and their values: the checkpoint's (each rank
        reading its own part), or initial values that depend on the run's seed and each parameter's name
        only, so that every layout (and one process) starts from the same model (keel.model.seeded_init)."""
        seed = self.cfg.run.seed
        for module in self.modules:
            if self._source is not None:
                materialize(module, self.device, lambda m, source=self._source: load_shards(m, source))
            elif self._source_dcp is not None:
                materialize(module, self.device, lambda m: None)
            else:
                materialize(module, self.device, lambda m: init_weights_seeded(m, seed))
        if self._source_dcp is not None:
            load_model_only(self._source_dcp, ModelParts(self.modules, []))
        if self._source is not None:
            self._source.reader.close()
            self._source = None

    def _heap_trimmer(self) -> HeapTrimmer | None:
        """`run.trim_heap`: glibc's free pages returned as each block's backward begins and after each
        backward and update. Under `training.compile` only the latter two: dynamo would trace the block
        hooks into the compiled blocks. By default on for CPU runs of more than one rank only
        (keel.train.host_memory.trim_heap_wanted)."""
        heap = HeapTrimmer()
        if not trim_heap_wanted(self.cfg.run.trim_heap, self.world, self.device.type, heap.available):
            return None
        if not heap.available:
            raise KeelError("run.trim_heap: needs glibc's malloc_trim (Linux with glibc); this C library has none")
        if not self.cfg.training.compile:
            for module in self.modules:
                heap.attach(getattr(module, "layers", {}).values())
        return heap

    def _build_parallel(self, model: Transformer) -> None:
        from keel.train import parallel

        cfg, lay = self.cfg, self.layout
        par = cfg.parallel
        compute = COMPUTE[cfg.training.precision]
        # FSDP's mixed precision casts the gathered copies when there is a dp dimension; otherwise autocast.
        self.use_autocast = compute is not None and lay.dp == 1 and DTYPES[cfg.model.dtype] == torch.float32
        self.loss_parallel = par.loss_parallel and lay.tp > 1
        if self.world == 1:  # no mesh; activation checkpointing and compilation still apply
            ac = cfg.activation_checkpoint
            parallel.apply_activation_checkpointing(model, ac.mode, ac.every)
            if cfg.training.compile:
                parallel.apply_compile(model)
            self.modules: list[nn.Module] = [model]
            return
        self.mesh = parallel.build_mesh(lay.pp, lay.dp_replicate, lay.dp_shard, lay.tp, self.device.type, ep=lay.ep)

        def parallelize(module: Transformer) -> Transformer:
            return parallel.parallelize(
                module,
                self.mesh,
                sequence_parallel=par.sequence_parallel,
                ac_mode=cfg.activation_checkpoint.mode,
                ac_every=cfg.activation_checkpoint.every,
                param_dtype=compute if lay.dp > 1 else None,
                reshard_after_forward=par.reshard_after_forward,
                loss_parallel=self.loss_parallel,
                compile_blocks=cfg.training.compile,
            )

        if lay.pp > 1:
            from keel.train.pipeline import build_pipeline

            if self.loss_parallel:  # the last stage's logits are its tp rank's vocabulary slice
                from keel.train.vocab_parallel import vocab_parallel_loss

                self._stage_cross_entropy = vocab_parallel_loss(self.mesh["tp"].get_group(), model.config.vocab_size)

            self.pipeline = build_pipeline(
                model,
                self.mesh["pp"],
                par.pp_schedule,
                lay.pp_microbatches * (lay.grad_accum if self._fold_accumulation else 1),
                lay.pp_stages_per_rank,
                self._pipeline_loss,
                parallelize_fn=parallelize,
                untie_embeddings=True,
                device=self.device,
            )
            self.modules = list(self.pipeline.modules)
        else:
            self.modules = [parallelize(model)]

    @property
    def _fold_accumulation(self) -> bool:
        """Under a pipeline, a step's accumulation micro-batches run as one schedule step of
        pp_microbatches x grad_accum pipeline microbatches: torch's stages reduce-scatter FSDP gradients
        at the end of every schedule step, so one step per optimizer step reduce-scatters once. Not
        under GPipe, whose forwards all run before any backward: it would keep every micro-batch's
        activations of the step at once (one schedule step per accumulation micro-batch instead)."""
        return self.layout.pp > 1 and self.cfg.parallel.pp_schedule != "gpipe"

    def _dp_rank_size(self) -> tuple[int, int]:
        if self.mesh is None:
            return 0, 1
        from keel.train.parallel import dp_rank_and_size

        return dp_rank_and_size(self.mesh)

    def _write_model_files(self, directory: Path) -> None:
        untied = self.pipeline is not None  # the pipeline trained two copies of a tied embedding
        write_model_files(directory, self.model_config, self.cfg, self.tokenizer, untied=untied)

    # ------------------------------------------------------------------ state
    def _parts(self) -> ModelParts:
        return ModelParts(self.modules, self.optimizers)

    def trainer_state(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "schedulers": [s.state_dict() for s in self.schedulers],
            "scaler": self.scaler.state_dict(),
            "loader": self.loader.state_dict(),
            "guard": self.guard.state_dict(),
            "rollbacks": self.rollbacks,
            "rng": _rng_states(self.device.type == "cuda"),
        }

    def _restore(self, path: Path) -> None:
        state = self.checkpoints.load(path, self._parts())
        if state is None:  # a seed checkpoint: its model, with the state every run starts from
            for optimizer in self.optimizers:
                optimizer.state.clear()
            self._set_trainer_state(self._initial_state)
            log.info("started from the seed checkpoint %s", path)
            return
        self._set_trainer_state(state)
        log.info("resumed from %s at step %d", path, self.step)

    def _set_trainer_state(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        for sched, s in zip(self.schedulers, state["schedulers"], strict=False):
            sched.load_state_dict(s)
            apply_schedule(sched)
        self.scaler.load_state_dict(state["scaler"])
        self.loader.load_state_dict(state["loader"])
        self.guard.load_state_dict(state["guard"])
        self.rollbacks = int(state.get("rollbacks", 0))
        if "rng" in state:
            _set_rng_states(state["rng"], self.device.type == "cuda")

    def save(self, blocking: bool = False) -> None:
        self.watchdog.pause()
        self.checkpoints.save(self.step, self._parts(), self.trainer_state(), blocking=blocking)

    # ------------------------------------------------------------------ step
    def _pipeline_loss(self, logits: Tensor, targets: Tensor) -> Tensor:
        if self._evaluating:  # summed: validate() divides by the token count, padding rows add nothing
            return self._stage_cross_entropy(logits, targets, reduction="sum")
        # The schedule averages microbatch losses itself (folded accumulation included); here: accumulation
        # over schedule steps and fp16 scaling.
        accumulation = 1 if self._fold_accumulation else self.layout.grad_accum
        loss = self._stage_cross_entropy(logits, targets) / accumulation
        loss = loss * self._fault_scale
        return self.scaler.scale_loss(loss)

    def _loss_parallel(self):
        """torch's loss_parallel() context when the logits are vocab-sharded (keel.train.parallel); not
        under a pipeline, whose last stage's loss reduces the vocabulary slices itself."""
        if not self.loss_parallel or self.pipeline is not None:
            return contextlib.nullcontext()
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()

    def _autocast(self):
        compute = COMPUTE[self.cfg.training.precision]
        if not self.use_autocast:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=compute)

    def _forward_backward(self) -> Tensor:
        """All micro-batches of one step; returns this rank's summed (unscaled) loss contribution."""
        accum = self.layout.grad_accum
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        self._data_time = 0.0
        if self._fold_accumulation:  # the whole local batch in one schedule step (see _fold_accumulation)
            t = time.perf_counter()
            batches = [self.loader.next_microbatch() for _ in range(accum)]
            self._data_time += time.perf_counter() - t
            inputs = self._to_device(torch.cat([b[0] for b in batches]))
            labels = self._to_device(torch.cat([b[1] for b in batches]))
            with self._autocast():
                loss = self.pipeline.step(inputs, labels)
            if loss is not None:
                total += loss.float() / self.scaler.scale
            return total
        for micro in range(accum):
            t = time.perf_counter()
            inputs, labels = self.loader.next_microbatch()
            self._data_time += time.perf_counter() - t
            inputs, labels = self._to_device(inputs), self._to_device(labels)
            last = micro == accum - 1
            if micro and self._step_memory is not None:
                self._step_memory.next_micro_batch()
            for module in self.modules:  # reduce-scatter gradients once, after the last micro-batch
                if hasattr(module, "set_requires_gradient_sync"):
                    module.set_requires_gradient_sync(last)
            if self.pipeline is not None:
                with self._autocast():  # the schedule runs forward and backward in this thread
                    loss = self.pipeline.step(inputs, labels)
                if loss is not None:  # the last stage: the schedule's mean of the scaled losses
                    total += loss.float() / self.scaler.scale
                continue
            with self._loss_parallel(), self._autocast():
                logits = self.modules[0](inputs)
            with self._loss_parallel():
                loss = cross_entropy_loss(logits, labels) / accum * self._fault_scale
                self.scaler.scale_loss(loss).backward()
            if self.heap is not None:
                self.heap.trim()
            total += _plain(loss.detach()).float()
        return total

    def _global_loss(self, local: Tensor) -> float:
        """The step's mean loss over every data-parallel rank (from the last pipeline stage)."""
        if self.mesh is None:
            return local.item()
        from keel.train.parallel import loss_mesh

        if self.layout.pp > 1:  # only the last stage has it: sum over the pp group spreads it to all
            if self.pipeline is None or not self.pipeline.has_last:
                local = torch.zeros_like(local)
            dist.all_reduce(local, group=self.mesh["pp"].get_group())
        dp = loss_mesh(self.mesh)
        if dp.size() > 1:
            dist.all_reduce(local, group=dp.get_group())
            local = local / dp.size()
        return local.item()

    def _params(self) -> list[Tensor]:
        return [p for m in self.modules for p in m.parameters() if p.requires_grad]

    def _state_bytes(self) -> dict[str, int]:
        """This rank's bytes of parameters, gradients and optimizer states (local shards only)."""

        def local(t: Tensor) -> int:
            t = t.to_local() if hasattr(t, "to_local") else t
            return t.numel() * t.element_size()

        params = self._params()
        out = {
            "params": sum(local(p) for p in params),
            "grads": sum(local(p.grad) for p in params if p.grad is not None),
            "optimizer": sum(
                local(v)
                for o in self.optimizers
                for st in o.state.values()
                for v in st.values()
                if isinstance(v, Tensor) and v.ndim > 0
            ),
        }
        out["total"] = out["params"] + out["grads"] + out["optimizer"]
        return out

    def _zero_grad(self) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=True)

    def _moe_groups(self) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
        if self.mesh is None:
            return None, None
        from keel.train.parallel import loss_mesh

        pp = self.mesh["pp"].get_group() if self.layout.pp > 1 else None
        return loss_mesh(self.mesh).get_group(), pp

    def train_step(self) -> dict[str, Any]:
        # The step measured: the first with optimizer states (the steady state), or the last one.
        track = (
            self.cfg.log.memory_breakdown
            and self.memory_record is None
            and (any(o.state for o in self.optimizers) or self.step + 1 >= self.cfg.training.steps)
        )
        if not track:
            return self._train_step()
        with track_step_memory(self.modules, self.optimizers) as memory:
            self._step_memory = memory
            try:
                record = self._train_step()
            finally:
                self._step_memory = None
        predicted = self.predicted_memory
        self.memory_record = {
            "measured_peak": memory.peak,
            "measured": memory.by_kind,
            "predicted_peak": predicted.peak,
            "predicted": predicted.as_dict(),
        }
        record["memory"] = self.memory_record
        log.info(
            "rank %d step %d: tensor memory peak %.1f MiB measured, %.1f MiB predicted (%+.1f%%, at %s)",
            self.rank,
            record["step"],
            memory.peak / 2**20,
            predicted.peak / 2**20,
            100 * (predicted.peak / max(1, memory.peak) - 1),
            predicted.moment,
        )
        return record

    def _train_step(self) -> dict[str, Any]:
        step = self.step + 1
        position = self.loader.state_dict()["samples_consumed"]
        self._fault_scale = self.faults.loss_scale(step) * self.faults.batch_scale(step, position)
        if self.moe:
            self._set_aux_grad_scale()
        t0 = time.perf_counter()
        local = self._forward_backward()
        if self.device.type == "cuda":  # its kernels are only queued: wait, so their time is not the optimizer's
            torch.cuda.synchronize(self.device)
        t_fb = time.perf_counter()
        loss = self._global_loss(local)
        params = self._params()
        self.scaler.unscale_(params)
        pp_group = self.mesh["pp"].get_group() if self.mesh is not None and self.layout.pp > 1 else None
        norm = clip_grad_norm_(params, self.cfg.training.max_norm, pp_group).item()
        record: dict[str, Any] = {
            "step": step,
            "loss": loss,
            "grad_norm": norm,
            "lr": self.schedulers[0].get_last_lr()[0],
        }
        applied = self._judge_step(step, loss, norm, record)
        if "rolled_back_to" in record:
            return record
        if applied:
            self._apply_update(loss, norm, record)
        self._zero_grad()
        if self.moe:
            record.update(moe_stats.finish_step(self.moe, self.cfg.moe.bias_update_rate, applied, *self._moe_groups()))
        for s in self.schedulers:
            s.step()
        self.step = step
        self._record_throughput(record, applied, t0, t_fb)
        return record

    def _set_aux_grad_scale(self) -> None:
        """Auxiliary losses get the main loss's factor: 1/accumulation, 1/microbatches, fp16 scale."""
        microbatches = self.pipeline.microbatches if self.pipeline is not None else 1
        accumulation = 1 if self._fold_accumulation else self.layout.grad_accum  # folded: in the microbatches
        scale = self.scaler.scale if self.scaler.enabled else 1.0
        moe_stats.set_aux_grad_scale(self.moe, scale / (accumulation * microbatches))

    def _judge_step(self, step: int, loss: float, norm: float, record: dict[str, Any]) -> bool:
        """Whether the step's update is applied: an fp16 overflow or the guard skips it; the guard may
        also stop the run (GuardStop) or roll it back (the record then says `rolled_back_to`)."""
        if self.scaler.enabled and not math.isfinite(norm) and math.isfinite(loss):
            self.scaler.update(found_inf=True)  # fp16 overflow: skip, back off; not a data problem
            record["overflow"] = True
            return False
        event = self.guard.check(step, loss, norm)
        if event is None:
            self.scaler.update(found_inf=False)
            return True
        record["guard"] = event.to_dict()
        log.warning("guard: %s", event.describe())
        if event.action == "stop":
            raise GuardStop(f"guard: {event.describe()}")
        if event.action == "rollback":
            self._zero_grad()
            for moe in self.moe.values():
                moe.reset_stats()
            self._rollback(event.describe(), step)
            record["rolled_back_to"] = self.step
        return False

    def _apply_update(self, loss: float, norm: float, record: dict[str, Any]) -> None:
        for o in self.optimizers:
            o.step()
        if self.heap is not None:
            self.heap.trim()
        self.guard.accept(loss, norm)
        if self.state_bytes is None:
            self.state_bytes = self._state_bytes()  # after the first update: optimizer states exist
            record["state_bytes"] = self.state_bytes

    def _record_throughput(self, record: dict[str, Any], applied: bool, t0: float, t_fb: float) -> None:
        """Tokens/s, MFU, the step's time split and the memory peak, into the step's record."""
        t_end = time.perf_counter()
        tokens = self.cfg.training.global_batch_size * self.cfg.data.seq_len
        tps = tokens / (t_end - t0)
        record.update(
            applied=applied,
            loss_scale=self.scaler.scale if self.scaler.enabled else None,
            tokens=tokens,
            tokens_per_s=tps,
            mfu=self.flops_per_token * tps / (self.peak_flops * self.world) if self.peak_flops else None,
            time_data_s=self._data_time,
            time_forward_backward_s=t_fb - t0 - self._data_time,
            time_optimizer_s=t_end - t_fb,
            time_step_s=t_end - t0,
            peak_memory_bytes=peak_memory_bytes(self.device),
        )
        if self._startup_peak is not None:  # this process's first step: the start-up record
            record["start_memory"] = self._start_memory()
            self._startup_peak = None

    def _to_device(self, batch: Tensor) -> Tensor:
        """A host batch on the device. On CUDA through page-locked memory without blocking: a copy out of
        ordinary memory waits for every kernel queued before it, so the host could never queue ahead."""
        if self.device.type != "cuda":
            return batch.to(self.device)
        return batch.pin_memory().to(self.device, non_blocking=True)

    def _start_memory(self) -> dict[str, int]:
        """The largest rank's peaks above its own baseline (RSS on CPU, allocated bytes on GPU) during
        start-up (model built and sharded) and through the first step, and its baseline."""
        values = [self._startup_peak, peak_memory_bytes(self.device) - self._memory_base, self._memory_base]
        if self.world > 1:
            flags = torch.tensor(values, dtype=torch.int64, device=self.device)
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
            values = flags.tolist()
        return {"startup_peak_bytes": values[0], "first_step_peak_bytes": values[1], "baseline_bytes": values[2]}

    def _rollback(self, reason: str, step: int) -> None:
        """Back to the latest checkpoint, then past the batches `guard.skip_batches_after_rollback` names
        (by default every batch since that checkpoint through `step`, the one that triggered this)."""
        self.rollbacks += 1
        if self.rollbacks > self.cfg.guard.max_rollbacks:
            raise GuardStop(
                f"guard: {reason}; more than guard.max_rollbacks = {self.cfg.guard.max_rollbacks} rollbacks"
            )
        self.checkpoints.finalize()
        path = latest_checkpoint(self.checkpoints.dir)
        if path is None:
            raise GuardStop(f"guard: {reason}; no checkpoint to roll back to")
        rollbacks = self.rollbacks
        self._restore(path)
        self.rollbacks = rollbacks  # the count survives the restore
        skip = self.cfg.guard.skip_batches_after_rollback
        if skip == "window":
            skip = step - self.step
        if skip:
            self.loader.skip(skip)
        log.warning("rolled back to step %d, skipping the next %d batches", self.step, skip)

    @torch.no_grad()
    def validate(self) -> float | None:
        """Mean loss per token on the validation file, over every data-parallel rank (None without
        one). With a pipeline, the batches go through the schedule forward-only; its stages exchange
        fixed shapes, so a short last batch is padded to the full batch with rows of ignored targets."""
        if self.val_file is None:
            return None
        dp_rank, dp_size = self._dp_rank_size()
        rows = self.cfg.training.micro_batch_size * (self.layout.grad_accum if self._fold_accumulation else 1)
        total = torch.zeros(2, dtype=torch.float64, device=self.device)  # loss sum, token count
        for module in self.modules:
            module.eval()
        self._evaluating = True
        try:
            for inputs, labels in iter_eval_batches(self.val_file, self.cfg.data.seq_len, rows, dp_rank, dp_size):
                inputs, labels = self._to_device(inputs), self._to_device(labels)
                if self.pipeline is not None:
                    pad = rows - len(inputs)
                    if pad:
                        inputs = torch.cat([inputs, inputs.new_zeros(pad, inputs.shape[1])])
                        labels = torch.cat([labels, labels.new_full((pad, labels.shape[1]), -100)])
                    with self._autocast():
                        loss_sum = self.pipeline.evaluate(inputs, labels)
                else:
                    with self._loss_parallel(), self._autocast():
                        logits = self.modules[0](inputs)
                        loss_sum = _plain(cross_entropy_loss(logits, labels, reduction="sum"))
                if loss_sum is not None:  # with a pipeline: only on the last stage's ranks
                    total[0] += loss_sum.double()
                    total[1] += (labels != -100).sum()
        finally:
            self._evaluating = False
            for module in self.modules:
                module.train()
        if self.mesh is not None:
            from keel.train.parallel import loss_mesh

            if self.layout.pp > 1:  # only the last stage has sums: spread them over the pp group
                dist.all_reduce(total, group=self.mesh["pp"].get_group())
            dp = loss_mesh(self.mesh)
            if dp.size() > 1:
                dist.all_reduce(total, group=dp.get_group())
        return (total[0] / total[1]).item()

    # ------------------------------------------------------------------ loop
    def _on_sigterm(self, signum, frame) -> None:
        self._stop_requested = True

    def _agree_at_boundary(self) -> tuple[bool, bool]:
        """(stop, written), agreed by every rank at this step boundary in one two-element all-reduce:
        - stop: whether any rank was asked to stop (SIGTERM, or KEEL_FAULTS' `stop`). A signal reaches
          ranks at different times, and a rank that left the loop alone would enter the final save's
          collectives while the others entered the next step's;
        - written: whether every rank has written its files of the async save in flight (or has none),
          so that the save is committed now, not when the next one starts (a crash in between would
          lose two intervals)."""
        local = [self._stop_requested or self.faults.stop_after(self.step, self.rank), not self.checkpoints.written()]
        if self.world > 1:
            flags = torch.tensor(local, dtype=torch.int32, device=self.device)
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
            local = [bool(v) for v in flags.tolist()]
        return local[0], not local[1]

    def run(self) -> TrainResult:
        cfg = self.cfg
        resume = cfg.checkpoint.resume
        path = None
        if resume == "auto":
            path = latest_checkpoint(self.checkpoints.dir)
        elif resume != "none":
            path = Path(resume)
            if not (path / "COMPLETE").exists():
                raise KeelError(f"checkpoint.resume = {resume}: not a complete keel checkpoint directory")
        if path is not None:
            self._restore(path)
        previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        result = TrainResult(steps_done=self.step, final_loss=None)
        bar = None
        if cfg.log.progress and self.rank == 0:
            from tqdm import tqdm

            bar = tqdm(total=cfg.training.steps, initial=self.step, desc="train", unit="step", dynamic_ncols=True)
        if self.rank == 0:
            log.info(
                "training %s: %s parameters, layout pp=%d dp_replicate=%d dp_shard=%d tp=%d, grad_accum=%d; "
                "peak %.3g FLOP/s (%s); predicted tensor memory peak per rank %.1f MiB (at %s)",
                cfg.run.name,
                f"{self.model_config.param_counts()['total']:,}",
                self.layout.pp,
                self.layout.dp_replicate,
                self.layout.dp_shard,
                self.layout.tp,
                self.layout.grad_accum,
                self.peak_flops,
                self.peak_source,
                self.predicted_memory.peak / 2**20,
                self.predicted_memory.moment,
            )
        try:
            self.trackers = self._open_trackers()
            while self.step < cfg.training.steps:
                self.watchdog.step_started(self.step + 1)
                self.faults.before_step(self.step + 1, self.rank)
                with self.profiler.step(self.step + 1):
                    record = self.train_step()
                self.watchdog.pause()
                result.losses[record["step"]] = record["loss"]
                if "guard" in record:
                    result.events.append(record["guard"])
                interval = cfg.checkpoint.interval
                at_end = self.step >= cfg.training.steps
                # On a stop the final save below stands for this step's checkpoint. An async save whose files
                # every rank has written is committed now.
                stop, written = self._agree_at_boundary()
                if written:
                    self.checkpoints.finalize()
                checkpoint_due = interval and self.step % interval == 0 and not at_end and not stop
                if "rolled_back_to" not in record and checkpoint_due:
                    t = time.perf_counter()
                    self.save()
                    val = self.validate()
                    record["time_checkpoint_s"] = time.perf_counter() - t
                    if val is not None:
                        record["val_loss"] = val
                if self.rank == 0 and (record["step"] % cfg.log.interval == 0 or "guard" in record):
                    self._log(record)
                if bar is not None:
                    bar.n = self.step
                    bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record.get('tokens_per_s', 0):.0f}")
                    bar.refresh()
                if stop:
                    log.warning("stop requested (SIGTERM): saving a checkpoint at step %d, then stopping", self.step)
                    result.stopped_by_signal = True
                    break
            # The final checkpoint first, committed, then validation: a preempted run's grace period may end
            # before the held-out pass does, and nothing is lost if it does.
            self.save(blocking=True)
            self.checkpoints.finalize()
            if cfg.checkpoint.export_hf and self.step >= cfg.training.steps:
                exported = export_hf(self._parts(), self.model_config, self.run_dir, self._write_model_files)
                log.info("exported the model as an HF directory: %s", exported)
            val = self.validate()
            if val is not None and self.rank == 0:
                self._log({"step": self.step, "val_loss": val})
        finally:
            signal.signal(signal.SIGTERM, previous)
            self.watchdog.stop()
            if bar is not None:
                bar.close()
            self.metrics.close()
            self.trackers.close()
        result.steps_done = self.step
        result.final_loss = result.losses.get(self.step)
        return result

    def _open_trackers(self) -> Trackers:
        log_cfg, trackers = self.cfg.log, []
        if self.rank == 0 and log_cfg.tensorboard:
            trackers.append(TensorBoardTracker(self.run_dir / log_cfg.tensorboard_dir))
        if self.rank == 0 and log_cfg.wandb:
            trackers.append(WandbTracker(self.run_dir, self.cfg.run.name, self.cfg.model_dump(mode="json")))
        return Trackers(trackers)

    def _log(self, record: dict[str, Any]) -> None:
        """A record to metrics.jsonl and to the trackers the config asks for (rank 0)."""
        self.metrics.write(record)
        self.trackers.write(record)

    def close(self) -> None:
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
        self._restore_kernels()


def _plain(tensor: Tensor) -> Tensor:
    """A loss as a plain tensor (loss-parallel returns a replicated DTensor)."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


# The fields that decide the shapes of a model's tensors: a checkpoint of another value cannot be resumed.
_SHAPE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "num_experts",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
)


def check_resumable_shape(cfg: TrainConfig, config: ModelConfig) -> None:
    """A one-line error where the checkpoint the run would resume from (`checkpoint.resume`: auto's latest, or the
    named one) holds a model of another shape than the config builds, raised before anything is written (the
    run's config.toml would otherwise describe a model its checkpoints do not hold)."""
    resume = cfg.checkpoint.resume
    if resume == "none":
        return
    path = latest_checkpoint(cfg.run_dir / "checkpoints") if resume == "auto" else Path(resume)
    if path is None or not (path / "config.json").is_file():
        return
    stored = ModelConfig.from_json_file(path / "config.json")
    for name in _SHAPE_FIELDS:
        theirs, ours = getattr(stored, name), getattr(config, name)
        if theirs != ours:
            raise KeelError(
                f"{path}: the run's checkpoint holds a model with {name} {theirs}, the config builds {ours}; "
                "resume with the model settings it was trained with, or start another run (run.name, or "
                'checkpoint.resume = "none")'
            )


def write_model_files(directory: Path, config: ModelConfig, cfg: TrainConfig, tokenizer: Any, untied: bool) -> None:
    """Make a checkpoint directory a model keel can load: HF config.json and the tokenizer."""
    if untied and config.tie_word_embeddings:
        config = dataclasses.replace(config, tie_word_embeddings=False)
    hf = config.to_hf()
    hf["dtype"] = cfg.model.dtype
    write_json_atomic(directory / "config.json", hf)
    write_text_atomic(directory / "train_config.json", config_json(cfg))
    if tokenizer is not None:
        tokenizer.save_hf(directory)


def _rng_states(cuda: bool) -> dict[str, Any]:
    """Every generator a step may draw from: torch's CPU one and the rank's CUDA one (on a GPU), NumPy's and
    Python's global ones."""
    states = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if cuda:
        # The rank's own device (the trainer made it current), not every visible one: a resume may see
        # another number of devices (one per rank under a scheduler's CUDA_VISIBLE_DEVICES).
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def _set_rng_states(states: dict[str, Any], cuda: bool) -> None:
    """`_rng_states()` restored (a checkpoint from before NumPy's and Python's were saved has torch's only)."""
    torch.set_rng_state(states["torch"])
    if "numpy" in states:
        np.random.set_state(states["numpy"])
    if "python" in states:
        random.setstate(states["python"])
    if not cuda:
        return
    state = states.get("cuda")
    if isinstance(state, list):  # saved by an earlier keel: every visible device's, in device order
        here = torch.cuda.current_device()
        state = state[here] if here < len(state) else None
    if state is not None:
        torch.cuda.set_rng_state(state)
    else:
        log.warning("the checkpoint holds no CUDA generator state for this device: its draws start afresh")


def _init_process_group(backend: str, rank: int, world: int, timeout: timedelta) -> None:
    """The default group, its keys under a per-attempt prefix of the launcher's store.

    After a torchrun restart (`--max-restarts`) the agent's store still holds the previous
    attempt's keys; without a fresh prefix a new worker can read a dead peer's address and gloo's
    connectFullMesh fails with "Connection refused".
    """
    store, _, _ = next(dist.rendezvous("env://"))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(f"keel/attempt-{attempt}", store),
        rank=rank,
        world_size=world,
        timeout=timeout,
    )
