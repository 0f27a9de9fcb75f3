"""Prefetch: while MoE layer L computes, a background thread loads the experts layer L+1 is
predicted to need.

The predictor applies layer L+1's router to layer L's MoE input (the residual stream changes
little between layers, and the router is one small matmul) and ranks experts by how many tokens
it sends to each; the top ones, as many as layer L+1 has slots, are loaded, evicting only experts
it did not name. Layer L+1's forward then waits for that load (the wait counts as stall) and
scores the prediction: the fraction of its token-slots whose expert the predictor had picked for
that same token (`OffloadStats.prefetch_accuracy`).

The plan (which slots to overwrite) is made on the forward's thread; one worker thread does the
copies, in submission order. A layer's slots are written by the worker only between the
submission and the wait, while the forward is busy with earlier layers; when every predicted
expert is already resident nothing is submitted.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch
from torch import Tensor

from keel.model.moe import Router
from keel.serve.offload.resident import ResidentExperts
from keel.serve.offload.stats import OffloadStats


class Prefetcher:
    def __init__(self, stats: OffloadStats, device: torch.device) -> None:
        self.stats = stats
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="keel-expert-prefetch")
        self._pending: dict[int, Future] = {}
        self._predicted: dict[int, Tensor] = {}  # layer -> predicted expert ids [T, k]
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def predict(self, router: Router, target: ResidentExperts, x: Tensor) -> None:
        """x [T, H]: the current layer's MoE input; `router` and `target`: the next MoE layer's.
        The plan is made here (bookkeeping only); the thread does the copies, if any."""
        ids = router(x).ids
        self._predicted[target.layer] = ids
        counts = torch.bincount(ids.flatten(), minlength=target.cache.num_experts)
        ranked = torch.argsort(counts, descending=True, stable=True)[: int((counts > 0).sum())].tolist()
        loads = target.cache.plan_prefetch(ranked)
        if loads:
            self._pending[target.layer] = self._pool.submit(self._load, target, loads)

    def _load(self, target: ResidentExperts, loads: list[tuple[int, int]]) -> None:
        target.load(loads, self._stream)
        self.stats.add(prefetch_loads=len(loads))

    def wait(self, layer: int) -> None:
        """Block until the layer's prefetch is done (re-raising its error, e.g. a failed read)."""
        future = self._pending.pop(layer, None)
        if future is not None:
            future.result()

    def score(self, layer: int, expert_ids: Tensor) -> None:
        """expert_ids [T * k]: the experts the layer's router chose, token by token."""
        predicted = self._predicted.pop(layer, None)
        if predicted is None or predicted.numel() != expert_ids.numel():
            return
        actual = expert_ids.view(predicted.shape)
        right = (actual.unsqueeze(-1) == predicted.unsqueeze(-2)).any(-1).sum()
        self.stats.add(predicted_slots=actual.numel(), predicted_right=int(right))

    def close(self) -> None:
        self._pool.shutdown(wait=True)
