"""The model runner: turns a scheduled step into tensors, runs the model, samples.

All scheduled tokens are packed into one row [1, T] (no padding in the linear layers); the
paged cache's `StepPlan` tells attention which tokens are single-token decodes (attended as
one batch) and which are multi-token chunks (prefill chunks, or a last token plus speculative
drafts to verify). Logits are computed only where they are needed: the last token of a request
that samples, every token of a request that verifies drafts or asked for prompt logprobs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from keel.model.transformer import Transformer
from keel.serve.compiled_decode import CompiledDecode
from keel.serve.kv_blocks import slot_of, visible_blocks
from keel.serve.kv_cache import DecodeGroup, PagedKVCache, PrefillChunk, RecurrentPlan, StepPlan, length_groups
from keel.serve.launched import LaunchedStep, StepResult, TokenFill
from keel.serve.request import Request
from keel.serve.sampling import RowState, Sampler, prompt_logprobs
from keel.serve.scheduler import SchedulerOutput
from keel.serve.speculative.verify import verify_drafts
from keel.serve.staging import HostCopy, host_int64, staging_for


@dataclass
class Chunk:
    """Tokens of one sequence fed in one forward, from position `start`, and which logits rows it needs."""

    table: list[int]  # the sequence's block table
    start: int
    tokens: list[int]
    logits: str = "last"  # "last" | "all" | "none"
    state: int = -1  # the sequence's state slot for recurrent layers (-1: the model has none)


@dataclass
class PackedStep:
    tokens: Tensor  # [1, T]
    positions: Tensor  # [1, T]
    plan: StepPlan
    select: Tensor  # rows of T whose logits are computed
    rows: list[range]  # per chunk: its rows in the selected logits (empty for "none")


def pack_step(chunks: list[Chunk], block_size: int, device: torch.device, fill: TokenFill | None = None) -> PackedStep:
    """Pack chunks of several sequences into one row, with the paged cache's plan: where each token's
    K/V goes, which tokens are one-token decodes (attended as a batch) and which are chunks. Built on the
    host and moved in one copy (keel.serve.staging); tokens still in flight are then filled in on the device."""
    bs = block_size
    tokens: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    decode_index, decode_tables, decode_positions = [], [], []
    prefills = []
    # recurrent layers' state slots (Chunk.state): of the decodes, of the prefill chunks, of the sequences starting
    decode_states: list[int] = []
    prefill_states: list[int] = []
    fresh: list[int] = []
    select: list[int] = []
    rows: list[range] = []
    for chunk in chunks:
        n, start, table = len(chunk.tokens), chunk.start, chunk.table
        offset = len(tokens)
        tokens += chunk.tokens
        span = range(start, start + n)
        positions += span
        slots += [slot_of(table, p, bs) for p in span]
        blocks = visible_blocks(table, start + n, bs)
        if n == 1:
            decode_index.append(offset)
            decode_tables.append(blocks)
            decode_positions.append(start)
            decode_states.append(chunk.state)
        else:
            prefills.append((offset, offset + n, blocks, list(span)))
            prefill_states.append(chunk.state)
        if start == 0:
            fresh.append(chunk.state)
        first = len(select)
        if chunk.logits == "all":
            select += range(offset, offset + n)
        elif chunk.logits == "last":
            select.append(offset + n - 1)
        rows.append(range(first, len(select)))
    stateful = bool(chunks) and chunks[0].state >= 0
    groups = _decode_groups(decode_index, decode_tables, decode_positions, total=len(tokens))
    host = [host_int64([tokens]), host_int64([positions]), host_int64(slots), host_int64(select)]
    for g in groups:
        host += [g.index, g.tables, g.positions]
    for _, _, blocks, span in prefills:
        host += [host_int64(blocks), host_int64(span)]
    if stateful and decode_index:
        host += [host_int64(decode_index), host_int64(decode_states)]
    if fill is not None:
        host += fill.host()
    moved = iter(staging_for(torch.device(device)).move(host))
    tokens_t, positions_t, slots_t, select_t = (next(moved) for _ in range(4))
    plan = StepPlan(
        slot_mapping=slots_t,
        decodes=[DecodeGroup(next(moved), next(moved), next(moved), g.whole_step) for g in groups],
        prefills=[PrefillChunk(s, e, next(moved), next(moved), span[-1] + 1) for s, e, _, span in prefills],
    )
    if stateful:
        decode_rows, decode_slots = (next(moved), next(moved)) if decode_index else (None, None)
        spans = [(s, e, state) for (s, e, _, _), state in zip(prefills, prefill_states, strict=True)]
        plan.recurrent = RecurrentPlan(spans, decode_rows, decode_slots, fresh)
    if fill is not None:
        fill.apply(tokens_t.view(-1), next(moved), next(moved))
    return PackedStep(tokens_t, positions_t, plan, select_t, rows)


@torch.inference_mode()
def forward_step(model: Transformer, cache: PagedKVCache, step: PackedStep) -> Tensor:
    """Run the model over a packed step, writing its K/V into `cache`; the selected rows' logits."""
    cache.plan = step.plan
    cache.start_sequences()
    try:
        return model(step.tokens, positions=step.positions, cache=cache, select=step.select)
    finally:
        cache.plan = None


def rows_of(logits: Tensor, rows: list[int]) -> Tensor:
    """logits[rows]: a slice where the rows run consecutively (every decode step): indexing by a Python
    list goes through torch's advanced indexing, a measurable share of a batch-1 step on a CPU
    (docs/BENCHMARKS.md, sixth part)."""
    if rows == list(range(rows[0], rows[0] + len(rows))):
        return logits[rows[0] : rows[0] + len(rows)]
    return logits[torch.tensor(rows, device=logits.device)]


class ModelRunner:
    def __init__(self, model: Transformer, cache: PagedKVCache, block_tables: Callable[[str], list[int]]) -> None:
        self.model = model
        self.cache = cache
        self.block_size = cache.block_size
        self.block_tables = block_tables  # seq id -> list of block ids (the KV manager's tables)
        self.device = model.device
        self.sampler = Sampler()
        self.compiled: CompiledDecode | None = None  # set by the engine when decode steps run compiled
        # recurrent layers: a state slot per running request, from the cache's (max_num_seqs)
        states = cache.recurrent.conv if cache is not None and cache.recurrent is not None else None
        self.free_states: list[int] | None = None
        if states:
            self.free_states = list(range(next(iter(states.values())).shape[0]))[::-1]
        self.state_of: dict[str, int] = {}

    def release(self, request_id: str) -> None:
        """A request finished or was aborted: its state slot, if any, is free again (parallel workers drop their
        mirror)."""
        slot = self.state_of.pop(request_id, None)
        if slot is not None:
            self.free_states.append(slot)

    def _state_slot(self, request: Request) -> int:
        """The request's state slot for recurrent layers (-1 for a model without them)."""
        if self.free_states is None:
            return -1
        if request.request_id not in self.state_of:
            if not self.free_states:
                raise RuntimeError("more running sequences than the recurrent layers' state slots (max_num_seqs)")
            self.state_of[request.request_id] = self.free_states.pop()
        return self.state_of[request.request_id]

    def _chunks(self, out: SchedulerOutput) -> tuple[list[Chunk], list[tuple[int, str]]]:
        """The step's chunks, and the tokens still in flight (asynchronous scheduling: drawn by the previous
        step, not yet read back; a placeholder here, filled on the device) as (position among the step's
        packed tokens, request id)."""
        chunks, placeholders, offset = [], [], 0
        for request, n in out.scheduled:
            start = request.num_computed_tokens
            known = min(n, request.num_tokens - start)  # the rest of n are speculative drafts
            tokens = request.token_ids_between(start, start + known) + request.spec_token_ids[: n - known]
            if len(tokens) < n:  # only a decode's one token can be in flight
                placeholders.append((offset + n - 1, request.request_id))
                tokens.append(0)
            offset += n
            wants_prompt_logprobs = request.params.prompt_logprobs is not None and start < len(request.prompt_token_ids)
            if wants_prompt_logprobs or request.spec_token_ids:
                logits = "all"
            elif start + n == request.num_tokens:  # all known tokens fed: sample the next one
                logits = "last"
            else:
                logits = "none"  # a prefill chunk that does not reach the end of the prompt
            chunks.append(
                Chunk(self.block_tables(request.request_id), start, tokens, logits, self._state_slot(request))
            )
        return chunks, placeholders

    def _forward(self, chunks: list[Chunk], fill: TokenFill | None) -> tuple[Tensor, list[range]]:
        """The chunks' selected logits and each chunk's rows in them: a step of one-token decodes
        through the compiled graph when there is one, anything else eagerly."""
        compiled = self.compiled
        if (
            compiled is not None
            and len(chunks) >= compiled.min_batch
            and all(len(c.tokens) == 1 and c.logits == "last" for c in chunks)
        ):
            bs = self.block_size
            logits = compiled(
                [c.tokens[0] for c in chunks],
                [c.start for c in chunks],
                [slot_of(c.table, c.start, bs) for c in chunks],
                [visible_blocks(c.table, c.start + 1, bs) for c in chunks],
                fill=fill,
            )
            return logits, [range(i, i + 1) for i in range(len(chunks))]
        step = pack_step(chunks, self.block_size, self.device, fill)
        return forward_step(self.model, self.cache, step), step.rows

    def execute(self, out: SchedulerOutput) -> StepResult:
        """Run a step and read its tokens back (the synchronous engine's step)."""
        return self.collect(self.launch(out))

    def launch(self, out: SchedulerOutput, previous: LaunchedStep | None = None) -> LaunchedStep:
        """Queue a step's forward and draw on the device and start reading the drawn tokens back, without
        waiting for them. Tokens still in flight from `previous` (asynchronous scheduling) are taken from
        its device tensor of drawn tokens."""
        for request in out.preempted:  # recomputed from its first token when it runs again: its state slot is free
            self.release(request.request_id)
        chunks, placeholders = self._chunks(out)
        fill = None
        if placeholders:
            if previous is None:
                raise RuntimeError("a step feeds a token in flight, but no previous step was given")
            row_of = previous.row_of()
            fill = TokenFill(previous.token_ids, [at for at, _ in placeholders], [row_of[r] for _, r in placeholders])
        logits, step_rows = self._forward(chunks, fill)
        launched = LaunchedStep()
        result = launched.result
        samplers: list[Request] = []
        sample_rows: list[int] = []
        verifiers: list[tuple[Request, range]] = []
        for (request, n), rows in zip(out.scheduled, step_rows, strict=True):
            start = request.num_computed_tokens
            if request.spec_token_ids:
                verifiers.append((request, rows))
                continue
            if request.params.prompt_logprobs is not None and start < len(request.prompt_token_ids):
                self._prompt_logprobs(request, start, logits[rows.start : rows.stop], result)
            if start + n == request.num_tokens:
                samplers.append(request)
                sample_rows.append(rows[-1])
        if verifiers:
            for request, tokens, lps in verify_drafts(self.sampler, logits, verifiers):
                result.token_ids[request.request_id] = tokens
                if lps is not None:
                    result.logprobs[request.request_id] = lps
        if not samplers:
            return launched
        states = [
            RowState(
                r.params,
                r.generator,
                r.prompt_token_ids,
                r.output_token_ids,
                r.eos_token_ids,
                None if r.token_bitmask is None else r.token_bitmask[0],
            )
            for r in samplers
        ]
        sampled = self.sampler(rows_of(logits, sample_rows), states)
        launched.samplers = samplers
        launched.token_ids = sampled.token_ids
        logprobs = [] if sampled.logprobs is None else sampled.logprobs.tensors()
        launched.readback = HostCopy([sampled.token_ids, *logprobs])
        launched.logprobs = sampled.logprobs
        return launched

    def collect(self, launched: LaunchedStep) -> StepResult:
        """Wait for a launched step's drawn tokens (and logprobs) and return them by request."""
        result = launched.result
        if not launched.samplers:
            return result
        host = launched.readback.wait()
        ids = host[0].tolist()
        lps = launched.logprobs.to_lists(host[0], *host[1:]) if launched.logprobs is not None else [None] * len(ids)
        for request, token, lp in zip(launched.samplers, ids, lps, strict=True):
            result.token_ids[request.request_id] = [token]
            if lp is not None:
                result.logprobs[request.request_id] = [lp]
        return result

    def _prompt_logprobs(self, request: Request, start: int, chunk: Tensor, result: StepResult) -> None:
        """Prompt logprobs of the tokens this chunk predicts: row j (position start + j) predicts
        prompt token start + j + 1. The first prompt token has no prefix (None)."""
        ids = request.prompt_token_ids[start : start + chunk.shape[0] + 1]
        entries = prompt_logprobs(chunk, ids, request.params.prompt_logprobs)
        result.prompt_logprobs[request.request_id] = entries if start == 0 else entries[1:]


def _decode_groups(
    index: list[int], tables: list[list[int]], positions: list[int], total: int = -1
) -> list[DecodeGroup]:
    """Decode rows grouped by length (`length_groups`): each group is padded to its longest table only. Host
    tensors (pack_step moves them with the step's other inputs)."""
    groups = length_groups([len(t) for t in tables])
    result = []
    for rows in groups:
        width = max(len(tables[i]) for i in rows)
        group_index = [index[i] for i in rows]
        result.append(
            DecodeGroup(
                index=host_int64(group_index),
                tables=host_int64([tables[i] + [0] * (width - len(tables[i])) for i in rows]),
                positions=host_int64([positions[i] for i in rows]),
                whole_step=len(groups) == 1 and group_index == list(range(total)),
            )
        )
    return result
