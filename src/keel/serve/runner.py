"""The model runner: turns a scheduled step into tensors, runs the model, samples.

All scheduled tokens are packed into one row [1, T] (no padding in the linear layers); the
paged cache's `StepPlan` tells attention which tokens are single-token decodes (attended as
one batch) and which are prefill chunks. Logits are computed only where a token is sampled
(or where prompt logprobs were asked for).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from keel.model.transformer import Transformer
from keel.serve.kv_cache import NULL_BLOCK, DecodeGroup, PagedKVCache, StepPlan
from keel.serve.request import Request
from keel.serve.sampling import RowState, Sampler, TokenLogprobs, prompt_logprobs
from keel.serve.scheduler import SchedulerOutput


@dataclass
class StepResult:
    """Per scheduled request that reached the end of its known tokens: the sampled token."""

    token_ids: dict[str, int]
    logprobs: dict[str, TokenLogprobs]
    prompt_logprobs: dict[str, list[TokenLogprobs | None]]


class ModelRunner:
    def __init__(self, model: Transformer, cache: PagedKVCache, block_tables) -> None:
        self.model = model
        self.cache = cache
        self.block_size = cache.block_size
        self.block_tables = block_tables  # seq id -> list of block ids (the KV manager's tables)
        self.device = model.device
        self.sampler = Sampler()

    def _plan(self, out: SchedulerOutput) -> tuple[Tensor, Tensor, StepPlan, list[int], list[Request]]:
        bs = self.block_size
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        decode_index, decode_tables, decode_positions = [], [], []
        prefills = []
        select: list[int] = []  # rows of T whose logits are needed
        samplers: list[Request] = []  # requests that sample a token this step, in `select` order
        for request, n in out.scheduled:
            start = request.num_computed_tokens
            table = self.block_tables(request.request_id)
            offset = len(tokens)
            tokens += request.token_ids_between(start, start + n)
            span = range(start, start + n)
            positions += span
            slots += [table[p // bs] * bs + p % bs for p in span]
            nb = -(-(start + n) // bs)
            blocks = [b if b != NULL_BLOCK else 0 for b in table[:nb]]  # freed blocks are masked by the window
            if n == 1:
                decode_index.append(offset)
                decode_tables.append(blocks)
                decode_positions.append(start)
            else:
                prefills.append((offset, offset + n, blocks, list(span)))
            wants_prompt_logprobs = request.params.prompt_logprobs is not None and start < len(request.prompt_token_ids)
            if wants_prompt_logprobs:
                select += range(offset, offset + n)
            if start + n == request.num_tokens:  # all known tokens fed: sample the next one
                if not wants_prompt_logprobs:
                    select.append(offset + n - 1)
                samplers.append(request)

        device = self.device
        plan = StepPlan(
            slot_mapping=torch.tensor(slots, device=device),
            decodes=_decode_groups(decode_index, decode_tables, decode_positions, device),
            prefills=[
                (s, e, torch.tensor(b, device=device), torch.tensor(p, device=device)) for s, e, b, p in prefills
            ],
        )
        return (
            torch.tensor([tokens], device=device),
            torch.tensor([positions], device=device),
            plan,
            select,
            samplers,
        )

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> StepResult:
        tokens, positions, plan, select, samplers = self._plan(out)
        self.cache.plan = plan
        try:
            logits = self.model(
                tokens, positions=positions, cache=self.cache, select=torch.tensor(select, dtype=torch.long)
            )
        finally:
            self.cache.plan = None
        result = StepResult({}, {}, {})
        # Split the selected rows: prompt-logprob requests took all their rows, the others one.
        row = 0
        sample_rows: list[int] = []
        for request, n in out.scheduled:
            start = request.num_computed_tokens
            if request.params.prompt_logprobs is not None and start < len(request.prompt_token_ids):
                chunk = logits[row : row + n]
                self._prompt_logprobs(request, start, chunk, result)
                row += n
                if start + n == request.num_tokens:
                    sample_rows.append(row - 1)
            elif start + n == request.num_tokens:
                sample_rows.append(row)
                row += 1
        if not samplers:
            return result
        states = [
            RowState(r.params, r.generator, r.prompt_token_ids, r.output_token_ids, r.eos_token_ids) for r in samplers
        ]
        sampled = self.sampler(logits[sample_rows], states)
        ids = sampled.token_ids.tolist()
        lps = sampled.logprobs.to_lists(sampled.token_ids) if sampled.logprobs is not None else [None] * len(ids)
        for request, token, lp in zip(samplers, ids, lps, strict=True):
            result.token_ids[request.request_id] = token
            if lp is not None:
                result.logprobs[request.request_id] = lp
        return result

    def _prompt_logprobs(self, request: Request, start: int, chunk: Tensor, result: StepResult) -> None:
        """Prompt logprobs of the tokens this chunk predicts: row j (position start + j) predicts
        prompt token start + j + 1. The first prompt token has no prefix (None)."""
        ids = request.prompt_token_ids[start : start + chunk.shape[0] + 1]
        entries = prompt_logprobs(chunk, ids, request.params.prompt_logprobs)
        result.prompt_logprobs[request.request_id] = entries if start == 0 else entries[1:]


def _decode_groups(index: list[int], tables: list[list[int]], positions: list[int], device) -> list[DecodeGroup]:
    """Decode rows grouped by length: each group is padded to its longest table only. Sorted by
    block count, a new group starts when a table is over 1.25x the group's first (or past 4 groups)."""
    order = sorted(range(len(index)), key=lambda i: len(tables[i]))
    groups: list[list[int]] = []
    for i in order:
        if groups and (len(tables[i]) <= 1.25 * len(tables[groups[-1][0]]) or len(groups) == 4):
            groups[-1].append(i)
        else:
            groups.append([i])
    result = []
    for rows in groups:
        width = max(len(tables[i]) for i in rows)
        result.append(
            DecodeGroup(
                index=torch.tensor([index[i] for i in rows], device=device),
                tables=torch.tensor([tables[i] + [0] * (width - len(tables[i])) for i in rows], device=device),
                positions=torch.tensor([positions[i] for i in rows], device=device),
            )
        )
    return result
