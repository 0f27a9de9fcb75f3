"""Pipeline parallelism: split a Transformer into stages by layers, schedule microbatches over them.

## Stages

With `pp` ranks and `stages_per_rank` stages each there are `S = pp * stages_per_rank` stages. Stage
`i` is the same `Transformer` class holding layers `layer_ranges(num_layers, S)[i]` (keel.model.stages: a
contiguous slice; the first `num_layers % S` stages get one extra layer). The first stage also keeps
`embed_tokens`, the last keeps `norm` and `lm_head`; the others have them set to None, and the model's
forward then takes / returns hidden states `[B, S, H]`. Layer keys stay global ("7" is layer 7 on
whichever stage holds it), so checkpoints and selective activation checkpointing line up.

Stage placement: "loop" (rank r holds stages r, r+pp, ...) for GPipe, 1F1B and Interleaved1F1B;
"v" (rank r holds r and 2*pp-1-r) for ZBV zero-bubble, which requires 2 stages per rank.

Tied embeddings (`tie_word_embeddings`) cannot stay tied when the embedding and the head live on
different ranks. `build_pipeline` refuses a tied model unless `untie_embeddings=True`: then the last
stage's head starts as a copy of the embedding and the two train independently (as Megatron would
without its embedding-group all-reduce). The loss curve then differs from tied single-process training.

## Composition with TP and FSDP

Split first, then parallelize each local stage module (`keel.train.parallel.parallelize`) on the
same mesh: pass `parallelize_fn` here, or apply it to the returned `modules` before the first step
(stages infer their input/output shapes at the first step, so either works). Every stage module is
an FSDP root of its own; the schedule then skips gradient reduce-scatters until the last microbatch.
Under sequence parallel, the activations sent between stages are the local sequence shards. With
FSDP, `reshard_after_forward=False` saves one all-gather per block per microbatch for the memory of
keeping the stage's blocks gathered through the step.

## Schedules (torch.distributed.pipelining)

| name              | class                         | stages/rank | notes                                 |
|-------------------|-------------------------------|-------------|---------------------------------------|
| `gpipe`           | ScheduleGPipe                 | 1           | all forwards, then all backwards      |
| `1f1b`            | Schedule1F1B                  | 1           | activations of <= pp microbatches     |
| `interleaved1f1b` | ScheduleInterleaved1F1B       | >= 1        | bubble / stages_per_rank              |
| `interleavedzb`   | ScheduleInterleavedZeroBubble | >= 1        | splits backward into input and weight |
| `zbv`             | ScheduleZBVZeroBubble         | 2           | zero-bubble, V placement              |

Losses are per microbatch (`loss_fn(logits, targets)`, a mean), and gradients are scaled by
1/microbatches, so a step equals one step on the whole local batch when microbatches are equal-sized.

Memory: a stage holds ~1/S of the blocks (plus embedding or head); the first rank's activations are
the peak: GPipe stores all `microbatches` microbatch activations, 1F1B at most `pp` of them.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle

from keel.model.loss import cross_entropy_loss
from keel.model.stages import split_stage
from keel.model.transformer import Transformer

ScheduleName = Literal["gpipe", "1f1b", "interleaved1f1b", "interleavedzb", "zbv"]
_SINGLE = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
_MULTI = {
    "interleaved1f1b": ScheduleInterleaved1F1B,
    "interleavedzb": ScheduleInterleavedZeroBubble,
    "zbv": ScheduleZBVZeroBubble,
}


def stage_ids(pp_rank: int, pp_size: int, stages_per_rank: int, style: Literal["loop", "v"] = "loop") -> list[int]:
    """The stage indices rank `pp_rank` holds, in the order the schedules expect."""
    if style == "v":
        if stages_per_rank != 2:
            raise ValueError(f"V-shaped schedules need exactly 2 stages per rank, got {stages_per_rank}")
        return [pp_rank, 2 * pp_size - 1 - pp_rank]
    return [pp_rank + i * pp_size for i in range(stages_per_rank)]


@dataclass
class Pipeline:
    """The schedule plus this rank's stages; `step` runs one training step's forward and backward."""

    schedule: PipelineScheduleSingle | PipelineScheduleMulti
    stages: list[PipelineStage]
    modules: list[Transformer]
    has_first: bool
    has_last: bool
    microbatches: int  # per step() call: its batch is split into this many

    def step(self, tokens: Tensor, targets: Tensor) -> Tensor | None:
        """Forward+backward of this rank's part of the local batch, adding to the gradients (so
        calls accumulate); the mean microbatch loss on the rank holding the last stage, None
        elsewhere. Every rank of the pp group must call it."""
        losses: list[Tensor] | None = [] if self.has_last else None
        args, kwargs = self._inputs(tokens, targets, losses)
        self.schedule.step(*args, return_outputs=False, **kwargs)
        return _mean_of_scaled(losses)

    def _inputs(self, tokens: Tensor, targets: Tensor, losses: list[Tensor] | None) -> tuple[tuple, dict]:
        """The schedule's arguments on this rank. Contiguous: torch 2.11's stages check each micro-batch's
        strides against the ones they were built for, and a slice such as chunk[:, :-1] has its parent's."""
        args = (tokens.contiguous(),) if self.has_first else ()
        kwargs = {"target": targets.contiguous(), "losses": losses} if self.has_last else {}
        return args, kwargs

    @torch.no_grad()
    def evaluate(self, tokens: Tensor, targets: Tensor) -> Tensor | None:
        """Forward only (the schedule's eval mode: no activations kept, no backward); the sum of
        the loss function's values over the microbatches on the rank holding the last stage, None
        elsewhere. The batch size must be a multiple of `microbatches`. Every rank of the pp group
        must call it."""
        losses: list[Tensor] | None = [] if self.has_last else None
        args, kwargs = self._inputs(tokens, targets, losses)
        self.schedule.eval(*args, **kwargs)
        mean = _mean_of_scaled(losses)
        return None if mean is None else mean * self.microbatches


def _mean_of_scaled(losses: list[Tensor] | None) -> Tensor | None:
    # Each microbatch loss is already divided by the microbatch count (see build_pipeline): the sum is the mean.
    return torch.stack([loss.detach() for loss in losses]).sum() if losses is not None else None


def build_pipeline(
    model: Transformer | Callable[[], Transformer],
    pp_mesh: DeviceMesh,
    schedule: ScheduleName = "1f1b",
    microbatches: int = 4,
    stages_per_rank: int = 1,
    loss_fn: Callable[[Tensor, Tensor], Tensor] = cross_entropy_loss,
    *,
    parallelize_fn: Callable[[Transformer], nn.Module | None] | None = None,
    untie_embeddings: bool = False,
    device: torch.device | None = None,
) -> Pipeline:
    """Split `model` (or what `model()` builds, once per local stage) over `pp_mesh` and schedule it.

    A model is deep-copied per local stage (it stays untouched); a factory avoids that copy and may
    build on the meta device (materialise the returned modules before training).
    """
    if schedule in _SINGLE and stages_per_rank != 1:
        raise ValueError(f"schedule {schedule!r} runs one stage per rank; use interleaved1f1b for {stages_per_rank}")
    if schedule not in _SINGLE and schedule not in _MULTI:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; choose from {', '.join([*_SINGLE, *_MULTI])}")
    pp_size, pp_rank = pp_mesh.size(), pp_mesh.get_local_rank()
    num_stages = pp_size * stages_per_rank
    if microbatches < 1:
        raise ValueError(f"microbatches must be >= 1, got {microbatches}")
    if device is None:
        device = torch.device(pp_mesh.device_type)
        if device.type != "cpu":
            device = torch.device(device.type, torch.get_device_module(device.type).current_device())

    ids = stage_ids(pp_rank, pp_size, stages_per_rank, "v" if schedule == "zbv" else "loop")
    modules: list[Transformer] = []
    for stage in ids:
        whole = model() if callable(model) and not isinstance(model, nn.Module) else copy.deepcopy(model)
        if whole.config.tie_word_embeddings and num_stages > 1 and not untie_embeddings:
            raise ValueError(
                "the model ties lm_head to embed_tokens, which sit on different pipeline stages; "
                "pass untie_embeddings=True to train them as two copies"
            )
        module = split_stage(whole, stage, num_stages)
        if parallelize_fn is not None:
            module = parallelize_fn(module) or module
        modules.append(module)

    # Why scale_grads=False: the schedules' default divides *all* of a stage's .grad by the
    # microbatch count at the end of every step, so gradients accumulated over several steps (one
    # per gradient-accumulation micro-batch) were divided again and again. Dividing each
    # microbatch's loss instead gives the same mean and composes with accumulation.
    def mean_loss_fn(output: Tensor, target: Tensor) -> Tensor:
        return loss_fn(output, target) / microbatches

    group = pp_mesh.get_group()
    stages = [PipelineStage(m, stage, num_stages, device, group=group) for m, stage in zip(modules, ids, strict=True)]
    if schedule in _SINGLE:
        sched = _SINGLE[schedule](stages[0], n_microbatches=microbatches, loss_fn=mean_loss_fn, scale_grads=False)
    else:
        sched = _MULTI[schedule](stages, n_microbatches=microbatches, loss_fn=mean_loss_fn, scale_grads=False)
    return Pipeline(
        schedule=sched,
        stages=stages,
        modules=modules,
        has_first=0 in ids,
        has_last=num_stages - 1 in ids,
        microbatches=microbatches,
    )
