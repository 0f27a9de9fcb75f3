"""Next-token cross-entropy, computed in float32 a few rows at a time.

Why not `F.cross_entropy(logits.float(), targets)`: with a 32k-50k vocabulary the logits of a
training batch are the largest tensors of the step, and that formula materialises four of them
in float32 (the upcast, log-softmax, its gradient, the downcast of the gradient), each a fresh
allocation of hundreds of MB. On a 2-core CPU those copies, fills and page faults cost about a
quarter of the forward + backward time of a ~134M Llama (torch.profiler: aten::copy_/fill_/
_log_softmax on [2048, 32000]). Here the float32 work happens on row chunks that stay in cache;
forward keeps only the per-row log-sum-exp, backward recomputes the softmax chunk by chunk and
writes the gradient directly in the logits' dtype. The arithmetic is the reference's (float32
log-sum-exp, gradient softmax - onehot), so losses agree to float32 rounding.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

# Float32 bytes per chunk on CPUs: a few MiB fits their L2/L3 caches, and a chunk's arithmetic costs
# far more than the Python of its iteration, even at a 128k vocabulary (8 rows).
CHUNK_BYTES = 4 << 20
# On GPUs a chunk is bounded by memory, not by a cache, while each iteration is a few kernel launches
# from Python: at a 128k vocabulary 4 MiB chunks would mean thousands of iterations a micro-batch.
# There a call makes at most MAX_CHUNKS iterations, of at least GPU_CHUNK_BYTES each.
GPU_CHUNK_BYTES = 256 << 20
MAX_CHUNKS = 64


def chunk_rows(rows: int, vocab: int, device: torch.device) -> int:
    """Rows of logits per chunk of the loss."""
    if device.type == "cpu":
        return max(1, CHUNK_BYTES // (4 * vocab))
    return max(1, GPU_CHUNK_BYTES // (4 * vocab), -(-rows // MAX_CHUNKS))


def chunked_log_sum_exp_and_target(logits: Tensor, safe: Tensor) -> tuple[Tensor, Tensor]:
    """Per row of logits [N, V] (V > 0): the float32 log-sum-exp and the logit at column safe[N], a chunk of
    rows at a time (keel.train.vocab_parallel calls it on a vocabulary slice)."""
    n, vocab = logits.shape
    rows = chunk_rows(n, vocab, logits.device)
    lse = torch.empty(n, dtype=torch.float32, device=logits.device)
    picked = torch.empty(n, dtype=torch.float32, device=logits.device)
    for i in range(0, n, rows):
        chunk = logits[i : i + rows].float()
        lse[i : i + rows] = torch.logsumexp(chunk, dim=-1)
        picked[i : i + rows] = chunk.gather(1, safe[i : i + rows, None]).squeeze(1)
    return lse, picked


def chunked_softmax_gradient(logits: Tensor, lse: Tensor, safe: Tensor, onehot: Tensor, scale: Tensor) -> Tensor:
    """(exp(logits - lse) + onehot at column safe) * scale per row, in the logits' dtype, a chunk of rows
    at a time: the cross-entropy gradient where onehot is -1 on the rows whose target column is here
    (0 elsewhere) and scale the loss's gradient (0 on ignored rows)."""
    n, vocab = logits.shape
    rows = chunk_rows(n, vocab, logits.device)
    grad = torch.empty_like(logits)
    for i in range(0, n, rows):
        p = logits[i : i + rows].float().sub_(lse[i : i + rows, None]).exp_()
        p.scatter_add_(1, safe[i : i + rows, None], onehot[i : i + rows, None])
        grad[i : i + rows].copy_(p.mul_(scale[i : i + rows, None]))
    return grad


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, ignore_index: int) -> Tensor:  # type: ignore[override]
        valid = targets != ignore_index
        safe = torch.where(valid, targets, 0)
        lse, picked = chunked_log_sum_exp_and_target(logits, safe)
        ctx.save_for_backward(logits, lse, safe, valid)
        return torch.where(valid, lse - picked, 0.0).sum()  # the caller divides for a mean

    @staticmethod
    def backward(ctx, grad_loss: Tensor) -> tuple[Tensor, None, None]:  # type: ignore[override]
        logits, lse, safe, valid = ctx.saved_tensors
        # d loss / d logit = (softmax - onehot(target)) * grad_loss on valid rows, 0 on ignored ones.
        scale = torch.where(valid, grad_loss.float(), 0.0)
        onehot = torch.full_like(lse, -1.0)
        return chunked_softmax_gradient(logits, lse, safe, onehot, scale), None, None


def cross_entropy_loss(
    logits: Tensor, targets: Tensor, ignore_index: int = -100, reduction: Literal["mean", "sum"] = "mean"
) -> Tensor:
    """Cross-entropy of logits [..., V] against targets [...] (float32 arithmetic, any logits dtype):
    the mean over the targets that are not `ignore_index` (nan if there are none, as F.cross_entropy),
    or their sum (0 if there are none)."""
    flat, flat_targets = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
    if type(logits) is not Tensor:  # a DTensor or other subclass: the stock op knows its sharding
        return F.cross_entropy(flat.float(), flat_targets, ignore_index=ignore_index, reduction=reduction)
    total = _ChunkedCrossEntropy.apply(flat, flat_targets, ignore_index)
    return total if reduction == "sum" else total / (flat_targets != ignore_index).sum()
