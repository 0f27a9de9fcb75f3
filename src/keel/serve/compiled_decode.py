"""The compiled decode step: steps made only of one-token decodes run one `torch.compile`d graph.

Why: at SmolLM2's size a decode step is ~450 operator calls and much of its time is spent between
them (Python, module calls, the dispatcher, one kernel per pointwise op). Compiled, inductor fuses
the norms, rotary embedding, SiLU-and-multiply and residual adds into a few C++ loops and the step
runs as one call. Attention over the paged cache stays one opaque op per layer
(`keel::paged_decode_attention`): its KV writes mutate the cache in place, and its shapes depend
on the block-table width, which changes every `block_size` tokens; outside the graph's traced
shapes, that width never causes a recompile. The op calls the same code as the eager paged cache
(the backend keel.serve.attention_backends picks: keel's C++ kernel on CPU, the Triton kernel on CUDA,
else `attend_decode_rows`), so attention is the same arithmetic either way; inductor runs with
`emulate_precision_casts`, rounding fused bf16 intermediates where eager rounds them, so greedy
outputs are the same with and without compilation (tests/test_compiled_decode.py).

Shapes: one graph for every batch of 2 or more (the batch dimension is dynamic), compiled at
start-up by a warm-up step, so serving never stalls on a compile. On CPU batch-1 steps stay eager
(measured no faster compiled: see `min_batch`); on CUDA batch 1 has its own graph (torch
specialises size 1). On CUDA the graph is compiled with inductor's CUDA graphs (what
mode="reduce-overhead" sets), captured per batch bucket. Inductor's on-disk caches (FX graph and
AOTAutograd caches) live under `$KEEL_CACHE/inductor` (default ~/.cache/keel/inductor), so a second
start reuses the compiled code.

Not compiled (the engine runs them eagerly): prefill chunks and mixed steps, speculative
verification, MoE and multi-head latent attention models, int8 KV caches and expert offloading.
"""

from __future__ import annotations

import logging
import os
import time
import types

import torch
from torch import Tensor

from keel import kernels
from keel.config import RECURRENT_LAYERS
from keel.errors import KeelError
from keel.kernels import triton_paged
from keel.model.attention import AttentionMetadata
from keel.model.fused_layer import decode_runs_fused
from keel.model.transformer import Transformer
from keel.paths import use_inductor_cache_dir
from keel.platform import host
from keel.serve.attention_backends import attention_backend
from keel.serve.kv_cache import (
    PagedKVCache,
    attend_decode_rows,
    decode_mask,
    gather_blocks,
    length_groups,
    write_rows,
)
from keel.serve.launched import TokenFill
from keel.serve.staging import host_int64, staging_for

log = logging.getLogger("keel.serve")

# Below this many parameters a decode step is too short for compilation (tens of seconds at first
# start) to pay back; tiny test models run eagerly unless asked.
AUTO_COMPILE_MIN_PARAMS = 50_000_000


# Registered through torch.library's low-level API (see keel.model.prepack for why not custom_op).
_lib = torch.library.Library("keel", "FRAGMENT")
_lib.define(
    "paged_decode_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) k_store, Tensor(b!) v_store, Tensor slots, "
    "Tensor tables, Tensor widths, Tensor mask, Tensor positions, int window, int block_size, float scale, "
    "float softcap=0.0, Tensor? sinks=None, Tensor? alibi=None) -> Tensor"
)


def paged_decode_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    k_store: Tensor,
    v_store: Tensor,
    slots: Tensor,
    tables: Tensor,
    widths: Tensor,
    mask: Tensor,
    positions: Tensor,
    window: int,
    block_size: int,
    scale: float,
    softcap: float = 0.0,
    sinks: Tensor | None = None,
    alibi: Tensor | None = None,
) -> Tensor:
    """Write the step's k, v ([1, B, H_kv, D]) into their slots, then attend the one-token queries
    q ([1, H, B, D]) over each sequence's blocks (tables [B, nb], the first widths[b] of row b in use)
    -> [1, H, B, D], the scores soft-capped at `softcap` when > 0 (Gemma 2), each head's softmax sink counted
    where `sinks` [H] is given (GPT-OSS), each score biased by ALiBi where `alibi` [H] (slopes) is given. Rows are
    attended in groups
    of similar width (`length_groups`, as the eager cache does), so a batch of short and long sequences
    does not gather every row at the longest width."""
    write_rows(k_store, slots, k)
    write_rows(v_store, slots, v)
    backend = attention_backend(k_store, k_store.shape[-1], block_size)
    if backend != "torch":
        # keel's C++ kernel (CPU) or the Triton one (CUDA) walks each row's own table where the blocks lie:
        # no gather, no grouping, no host sync (so the step can be replayed as a CUDA graph).
        if backend == "kernels":
            out = torch.ops.keel.paged_attention(
                q[0].transpose(0, 1), k_store, v_store, None, None, tables.int(), None, positions, block_size,
                window, scale, v_store.shape[-1], softcap, sinks, alibi,
            )  # fmt: skip
        else:
            # written straight into the [1, H, B, Dv] layout the graph was traced with; row b reads table row b
            out = q.new_empty(1, q.shape[1], q.shape[2], v_store.shape[-1])
            triton_paged.paged_attention(
                q[0].transpose(0, 1), k_store, v_store, tables, None, positions, block_size, window, scale,
                v_store.shape[-1], softcap=softcap, sinks=sinks, alibi=alibi, out=out[0].transpose(0, 1),
            )  # fmt: skip
            return out
        return out.transpose(0, 1).contiguous().unsqueeze(0)  # the layout the graph was traced with
    # On CUDA the step is replayed as a CUDA graph, which cannot follow data-dependent grouping: one group.
    lengths = widths.tolist() if widths.device.type == "cpu" else None
    groups = length_groups(lengths) if lengths is not None else [None]
    if len(groups) == 1:
        keys, values = gather_blocks(k_store, tables, block_size), gather_blocks(v_store, tables, block_size)
        return attend_decode_rows(q[0], keys, values, mask, scale, softcap, sinks, alibi, positions).unsqueeze(0)
    out = q.new_empty(q.shape[1], q.shape[2], v_store.shape[-1])
    for rows in groups:
        index = torch.tensor(rows, device=q.device)
        width = max(lengths[i] for i in rows)
        group_tables = tables.index_select(0, index)[:, :width]
        keys, values = (
            gather_blocks(k_store, group_tables, block_size),
            gather_blocks(v_store, group_tables, block_size),
        )
        group_mask = mask.index_select(0, index)[:, : width * block_size]
        rows_q = q[0].index_select(1, index)
        group_positions = positions.index_select(0, index)
        attended = attend_decode_rows(rows_q, keys, values, group_mask, scale, softcap, sinks, alibi, group_positions)
        out.index_copy_(1, index, attended)
    return out.unsqueeze(0)


_lib.impl("paged_decode_attention", paged_decode_attention, "CompositeExplicitAutograd")


@torch.library.register_fake("keel::paged_decode_attention")
def _(
    q,
    k,
    v,
    k_store,
    v_store,
    slots,
    tables,
    widths,
    mask,
    positions,
    window,
    block_size,
    scale,
    softcap=0.0,
    sinks=None,
    alibi=None,
):  # noqa: ANN001, ANN202, E501
    return q.new_empty(q.shape[0], q.shape[1], q.shape[2], v_store.shape[-1])


class _StepCache:
    """The `KVCache` the compiled graph sees: this step's slots and tables over the paged stores."""

    def __init__(self, paged: PagedKVCache, slots: Tensor, tables: Tensor, widths: Tensor, positions: Tensor) -> None:
        self.paged, self.slots, self.tables, self.widths, self.positions = paged, slots, tables, widths, positions
        self.masks: dict[int | None, Tensor] = {}  # per window size, built once per step (traced)

    def attend(
        self,
        layer: int,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        meta: AttentionMetadata,
        window: int | None,
        sinks: Tensor | None = None,
        alibi: Tensor | None = None,
    ) -> Tensor:
        paged = self.paged
        if window not in self.masks:
            self.masks[window] = decode_mask(self.positions, self.tables.shape[1] * paged.block_size, window)
        return torch.ops.keel.paged_decode_attention(
            q,
            k,
            v,
            paged.keys[layer],
            paged.values[layer],
            self.slots,
            self.tables,
            self.widths,
            self.masks[window],
            self.positions,
            window or 0,
            paged.block_size,
            paged.head_dims[layer] ** -0.5,
            paged.softcap or 0.0,
            sinks,
            alibi,
        )


def compile_unsupported(model: Transformer, cache: PagedKVCache) -> str | None:
    """Why this model and cache cannot run the compiled decode step (None: they can)."""
    config = model.config
    if config.is_mla:
        return "multi-head latent attention"
    if config.has_recurrent_layers:
        return RECURRENT_LAYERS
    if any(config.is_moe_layer(i) for i in range(config.num_layers)):
        return "mixture-of-experts layers"
    if config.kv_shared_layers:  # the compiled step writes and attends in one operator, every layer
        return "KV sharing across layers"
    if config.altup_num_inputs:  # the compiled step carries one residual stream, not AltUp's copies
        return "AltUp (altup_num_inputs)"
    if any(config.layer_v_head_dim(i) != config.layer_head_dim(i) for i in config.kv_layers()):
        return "values of another width than the keys (v_head_dim)"  # keel's paged kernels read them as wide
    if type(cache) is not PagedKVCache:
        return "a quantized KV cache"
    if model.device.type not in ("cpu", "cuda"):
        return f"device {model.device.type}"
    return None


def decide_compile(requested: bool | None, model: Transformer, cache: PagedKVCache, offloading: bool) -> bool:
    """The engine's `compile` option: True / False as asked (True where the model is unsupported falls
    back to eager with a warning; on a CPU host without a C++ compiler it is a KeelError); None
    (auto): the environment's KEEL_COMPILE=0/1 when set, else on for supported models of
    AUTO_COMPILE_MIN_PARAMS or more (never without a C++ compiler on CPU), except where every decoder layer
    runs through keel::decoder_layers (float32 or block weights on keel's CPU kernels: the compiled step,
    which runs the modules, measured no faster at batch 1 and slower at 16, after ~20 s of compiling)."""
    if requested is None and os.environ.get("KEEL_COMPILE") in ("0", "1"):
        requested = os.environ["KEEL_COMPILE"] == "1"
    reason = compile_unsupported(model, cache) or ("expert offloading" if offloading else None)
    if requested is False:
        return False
    if model.device.type == "cpu" and host().cpp_compiler is None:  # inductor writes C++ for CPU graphs
        if requested:
            raise KeelError("--compile: no C++ compiler found (g++, or $CXX) for torch.compile's CPU code")
        return False
    if reason is not None:
        if requested:
            log.warning("decode compilation off: not supported with %s", reason)
        return False
    if requested is None:
        if decode_runs_fused(model, cache):  # keel's C++ layers: a compiled step would run the modules instead
            return False
        # The architecture's count, not parameters(): quantized weights are buffers (codes and scales).
        return model.config.param_counts()["total"] >= AUTO_COMPILE_MIN_PARAMS
    return True


def batch_buckets(max_batch: int) -> tuple[int, ...]:
    """Batch sizes graphs are captured for, as vLLM's: 1, 2, 4, 8, then every 8 up to max_batch."""
    sizes = [b for b in (1, 2, 4) if b < max_batch] + list(range(8, max_batch, 8))
    return (*sizes, max_batch)


class CompiledDecode:
    """Runs decode-only steps through one compiled forward of the model (see the module docstring)."""

    def __init__(
        self,
        model: Transformer,
        cache: PagedKVCache,
        *,
        max_batch: int = 256,
        max_blocks: int = 0,
        pad_batches: bool | None = None,
    ) -> None:
        """max_batch: the most sequences a step holds (the largest bucket); max_blocks: the most blocks a
        sequence holds (the fixed table width); pad_batches: pad to buckets (default: on CUDA)."""
        kernels.active()  # read before tracing: the graph takes the kernels eager steps take
        self.model, self.cache = model, cache
        self.device = model.device
        use_inductor_cache_dir()
        options = {
            "emulate_precision_casts": True,
            # The served model's modules never change: checking their ~300 tensors on every call
            # (dynamo's guards) is a cost of every step (docs/BENCHMARKS.md); the step's inputs stay guarded.
            "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe,
        }
        # torch.compile caches graphs per code object, and the guards above no longer tell two engines'
        # models apart: each instance compiles its own copy of `_forward`'s code.
        code = CompiledDecode._forward.__code__.replace()
        forward = types.MethodType(types.FunctionType(code, globals(), "_forward"), self)
        if self.device.type == "cuda":
            # mode="reduce-overhead" is this option, and torch.compile refuses a mode beside options.
            options["triton.cudagraphs"] = True
            # The graph writes each step's K/V into the cache's stores: CUDA graphs replay writes into
            # inputs only at fixed addresses (else torch skips the graphs), and the stores never move.
            for store in (*cache.keys, *cache.values):
                torch._dynamo.mark_static_address(store)
        self._compiled = torch.compile(forward, fullgraph=True, options=options)
        self.compile_seconds = 0.0
        self.steps = 0
        # On CPU a batch-1 step is its weights' matrix-vector products, which compiling does not
        # change: measured no faster compiled, while batches of 8-64 gained (docs/BENCHMARKS.md, "The
        # decode fast path"). So on CPU only batches of 2 or more run compiled (one graph); on CUDA
        # every batch does (CUDA graphs remove per-kernel launches at any size).
        self.min_batch = 1 if self.device.type == "cuda" else 2
        # CUDA graphs are captured per input shape: batches padded to a few sizes, and, where the Triton
        # kernel reads each row to its own length (padding costs nothing), tables to the longest a
        # sequence can have, bound the graphs to one per bucket. On CPU nothing is captured: no padding.
        pad = self.device.type == "cuda" if pad_batches is None else pad_batches
        self.batch_buckets = batch_buckets(max_batch) if pad else ()
        self.fixed_width = max_blocks if pad and cache.attention_backend() != "torch" else 0

    def _forward(self, tokens: Tensor, positions: Tensor, slots: Tensor, tables: Tensor, widths: Tensor) -> Tensor:
        cache = _StepCache(self.cache, slots, tables, widths, positions[0])
        return self.model(tokens, positions=positions, cache=cache)

    @torch.inference_mode()
    def __call__(
        self,
        tokens: list[int],
        positions: list[int],
        slots: list[int],
        tables: list[list[int]],
        fill: TokenFill | None = None,
    ) -> Tensor:
        """One decode token per sequence -> logits [B, V]. Tables are padded with block 0 to a common
        width of at least 2 blocks (masked by position); with `batch_buckets`, the batch is padded to the
        next bucket with copies of its first row, and tables to `fixed_width`. `fill`: tokens still in
        flight (asynchronous scheduling), filled in on the device."""
        batch = len(tokens)
        padded = next((b for b in self.batch_buckets if b >= batch), batch)
        if padded > batch:
            # Copies of row 0: they write row 0's own K/V into its own slot (the same values) and their
            # logits are dropped.
            extra = padded - batch
            tokens, positions = tokens + tokens[:1] * extra, positions + positions[:1] * extra
            slots, tables = slots + slots[:1] * extra, tables + tables[:1] * extra
        width = max(2, max(len(t) for t in tables), self.fixed_width)
        # Read by the op to group rows on CPU (a host tensor); on CUDA it stays on the device, unread.
        widths = [len(t) for t in tables]
        host = [
            host_int64([tokens]),
            host_int64([positions]),
            host_int64(slots),
            host_int64([t + [0] * (width - len(t)) for t in tables]),
            host_int64(widths),
        ]
        if fill is not None:
            host += fill.host()
        tok, pos, slot, table, widths_t, *fill_index = staging_for(self.device).move(host)
        if fill is not None:
            fill.apply(tok.view(-1), *fill_index)
            if padded > batch:  # the padding rows copy row 0, whose token may have been in flight
                tok[0, batch:] = tok[0, 0]
        if padded > 1:  # size 1 is specialised by torch: batch 1 has its own graph
            for t, dim in ((tok, 1), (pos, 1), (slot, 0), (table, 0), (widths_t, 0)):
                torch._dynamo.mark_dynamic(t, dim)
        if not self.fixed_width:
            torch._dynamo.mark_dynamic(table, 1)
        self.steps += 1
        return self._compiled(tok, pos, slot, table, widths_t).view(padded, -1)[:batch]

    def warm_up(self) -> float:
        """Compile the graphs (batch 1 on CUDA, batch 2+) and, with buckets, capture every bucket's before
        serving; seconds taken. Writes garbage K/V into block 0's first slot, which no sequence holds yet (a
        sequence reads only positions it has written)."""
        start = time.perf_counter()
        # Every row writes slot 0 (a cache smaller than the largest bucket has no slot per row); on CUDA
        # each shape runs twice: CUDA graph trees run a new shape eagerly once and record it the next time.
        calls = 2 if self.device.type == "cuda" else 1
        for batch in sorted({self.min_batch, 2, *self.batch_buckets}):
            for _ in range(calls):
                self([0] * batch, [0] * batch, [0] * batch, [[0]] * batch)
        self.steps = 0
        self.compile_seconds = time.perf_counter() - start
        return self.compile_seconds
