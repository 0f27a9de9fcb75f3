"""Cross-entropy over logits sharded on the vocabulary, for loss-parallel under a pipeline.

Without a pipeline, loss-parallel is torch's (`loss_parallel()` over a `Shard(-1)` DTensor, see
keel.train.parallel). Under one, torch's pipeline stages pass plain tensors, so the last stage hands its
loss function each tp rank's own slice of the vocabulary ([..., V/tp], a plain tensor): this module
reduces that slice's log-sum-exp and target logit over the tp group, so that no rank gathers the
[B, S, V] logits. It runs keel.model.loss's row-chunk loops (float32 arithmetic on a few rows at a time,
the gradient written in the logits' dtype) on the slice; only the reductions between them are its own.

Every tp rank of the last stage computes the same loss and calls backward on it, so the gradient of
each rank's slice is local (softmax - onehot on its own columns): the backward pass runs no collective.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Literal

import torch
import torch.distributed as dist
from torch import Tensor

from keel.model.loss import chunked_log_sum_exp_and_target, chunked_softmax_gradient


def shard_offset(vocab: int, rank: int, size: int) -> int:
    """First vocabulary column of tp rank `rank`'s slice: `Shard` splits as torch.chunk does."""
    return min(vocab, rank * -(-vocab // size))


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx, logits: Tensor, targets: Tensor, ignore_index: int, offset: int, group: dist.ProcessGroup
    ) -> Tensor:
        n, width = logits.shape
        valid = targets != ignore_index
        local = targets - offset
        mine = valid & (local >= 0) & (local < width)  # the target's column lies in this slice
        safe = torch.where(mine, local, 0)
        if width > 0:
            lse, picked = chunked_log_sum_exp_and_target(logits, safe)
        else:
            lse = torch.full((n,), float("-inf"), dtype=torch.float32, device=logits.device)
            picked = torch.zeros(n, dtype=torch.float32, device=logits.device)
        picked = torch.where(mine, picked, 0.0)
        # The slices' log-sum-exps combine as log(sum(exp(lse_r - max))) + max: one MAX, then one SUM that
        # also carries the target logit (non-zero on the one rank holding each row's target).
        top = lse.clone()
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        top = torch.where(torch.isfinite(top), top, 0.0)
        both = torch.stack([(lse - top).exp(), picked])
        dist.all_reduce(both, op=dist.ReduceOp.SUM, group=group)
        total = both[0].log() + top
        ctx.save_for_backward(logits, total, safe, mine, valid)
        return torch.where(valid, total - both[1], 0.0).sum()  # the caller divides for a mean

    @staticmethod
    def backward(ctx, grad_loss: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        logits, total, safe, mine, valid = ctx.saved_tensors
        if logits.shape[1] == 0:
            return torch.empty_like(logits), None, None, None, None
        scale = torch.where(valid, grad_loss.float(), 0.0)
        onehot = torch.where(mine, -1.0, 0.0)
        return chunked_softmax_gradient(logits, total, safe, onehot, scale), None, None, None, None


def vocab_parallel_cross_entropy(
    logits: Tensor,
    targets: Tensor,
    vocab: int,
    group: dist.ProcessGroup,
    ignore_index: int = -100,
    reduction: Literal["mean", "sum"] = "mean",
) -> Tensor:
    """Cross-entropy of this rank's vocabulary slice of the logits ([..., V/tp], columns from
    `shard_offset`) against the global targets [...], over the tp `group`: the value
    keel.model.loss.cross_entropy_loss gives on the whole logits, on every rank of the group."""
    offset = shard_offset(vocab, dist.get_rank(group), dist.get_world_size(group))
    flat_targets = targets.reshape(-1)
    flat = logits.reshape(flat_targets.numel(), logits.shape[-1])
    total = _VocabParallelCrossEntropy.apply(flat, flat_targets, ignore_index, offset, group)
    return total if reduction == "sum" else total / (flat_targets != ignore_index).sum()


def vocab_parallel_loss(tp_group: dist.ProcessGroup, vocab: int) -> Callable[..., Tensor]:
    """The loss function of a pipeline whose last stage returns vocabulary slices (keel.train.parallel's
    loss_parallel under pp > 1): `loss(logits, targets, reduction="mean")` over `tp_group`."""
    return functools.partial(vocab_parallel_cross_entropy, vocab=vocab, group=tp_group)
