"""Serving plan: weights and KV cache per GPU, concurrency at a context length, roofline step times.

For each layout of the GPUs into tp (tensor parallel, inside a node), pp (pipeline stages) and
replicas, with experts spread over every GPU of a replica (ep = tp; vLLM's expert parallelism):

- weights per GPU: attention, dense MLPs, embedding and head split by tp, routed experts by ep, all
  split by pp; bytes per parameter from the weight precision (int4/int8 with their scales);
- KV per token per GPU: the KV heads over tp (replicated when there are fewer heads than ranks, as
  vLLM does), MLA's latent replicated on every tp rank (it has one "head"); over pp by layers;
- KV memory = memory x utilization - weights - an activation reserve; tokens and sequences of
  `context` tokens that fit (whole blocks);
- decode step at batch B (every sequence at `context` tokens): the larger of the memory time
  (weights read once per step - for MoE the experts the batch touches, E (1 - (1 - k/E)^B) per
  layer - plus every sequence's KV, and its recurrent layers' state read and written) over HBM
  bandwidth and the compute time (2 x active parameters x B, plus attention) over peak FLOP/s x
  `mfu`; plus tp all-reduces (2 per layer of B x hidden
  activations, ring: 2 (tp - 1)/tp of the bytes over the scale-up link), not overlapped; with pp a
  token passes every stage in turn (latency is the sum of the stages) and throughput assumes no
  pipelining of micro-batches across stages (conservative for pp);
- the batch at which decode turns compute-bound: the smallest power of two B whose weight matmuls'
  compute time reaches the time to read the weights they touch (KV reads excluded: they grow with
  B as the attention compute does; at long contexts decode stays bound by KV bandwidth);
- prefill of one `context`-token prompt: 2 x active parameters x tokens + causal attention, over
  peak x `mfu` x tp;
- when the weights do not fit: the share of routed experts that can stay resident (expert
  offloading keeps the rest in host memory);
- a request rate (`request_rate` req/s, prompts of `context - output_tokens` tokens, `output_tokens`
  generated): a replica at batch B spends r x prefill seconds per second on prefills and the rest
  decoding, so it sustains r = B / (t(B) x output_tokens + B x prefill) requests/s (t(B): the step
  time); the smallest batch that sustains the replica's share of the rate is the one it runs at
  (Little's law), its TPOT t(B) / (1 - r x prefill) (decode steps wait for the prefills between
  them); queueing delay is not modelled (TTFT is the prefill alone).

Assumptions, stated so they can be argued with: `mfu` 0.6 of dense peak for large matmuls, HBM at
the datasheet figure (measured decode reaches ~80-90% of it on GPUs), an activation reserve of 5%
of memory, no overlap of communication with compute.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from keel.config import ModelConfig
from keel.errors import KeelError
from keel.plan.hardware import GPU, Cluster
from keel.plan.params import ParamSplit, split_params

# Bytes per weight, scales included: int8 per channel (negligible), int4 per group of 128 (a
# bf16 scale and zero per 128 values).
WEIGHT_BYTES = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "int8": 1.0, "int4": 0.5 + 4 / 128}
KV_BYTES = {
    "fp32": 4.0,
    "bf16": 2.0,
    "fp16": 2.0,
    "fp8": 1.0,
    "int8": 1.0 + 2 / 128,
}  # int8: a float16 scale per head (D ~ 128)


@dataclass
class ServeLayout:
    tp: int
    pp: int
    ep: int
    replicas: int
    weights_gb: float  # per GPU
    kv_gb: float  # per GPU, what is left for the cache
    kv_bytes_per_token: float  # per GPU
    tokens: int  # per replica
    sequences: int  # of `context` tokens, per replica
    fits: bool
    resident_expert_share: float  # 1.0 when every expert fits
    decode_ms_batch1: float
    decode_ms: float  # at `batch`
    batch: int
    tokens_per_s: float  # all replicas, at `batch` per replica
    compute_bound_batch: int
    prefill_s: float
    ttft_ok: bool | None = None
    tpot_ok: bool | None = None
    max_request_rate: float | None = None  # requests/s all replicas sustain at most (with a request rate)
    rate_ok: bool | None = None


def kv_bytes_per_token_per_gpu(config: ModelConfig, tp: int, pp: int, kv_dtype: str) -> float:
    per_value = KV_BYTES[kv_dtype]
    layers = config.kv_layers()  # the layers with stores of their own (kv_shared_layers reuse another's)
    if config.is_mla:  # one latent + rope key per token, replicated on every tp rank (and DSA's index keys)
        index = len(config.dsa_index_layers()) * config.index_head_dim
        return ((config.kv_lora_rank + config.qk_rope_head_dim) * len(layers) + index) * per_value / pp
    # each layer's KV heads (a rank's share, at least one) at its head width
    return (
        sum(2 * max(1, config.layer_num_kv_heads(i) // tp) * config.layer_head_dim(i) for i in layers) * per_value / pp
    )


def _state_bytes(config: ModelConfig) -> int:
    """One sequence's recurrent states (bfloat16 convolution inputs, float32 matrices), as the engine sizes them.
    Imported here only: the training launcher checks a run through keel.plan without importing torch."""
    import torch

    from keel.model.recurrent import RecurrentStates

    return RecurrentStates.bytes_per_slot(config, torch.bfloat16)


def _attention_flops_per_token(config: ModelConfig, context: int) -> float:
    """Score and value matmuls of one query over `context` keys, all layers."""
    layers = config.attention_layers()
    if config.is_mla:  # absorbed: every head attends over the latent (R + P) and reads R values
        widths = len(layers) * (2 * config.kv_lora_rank + config.qk_rope_head_dim)
    else:
        widths = sum(2 * config.layer_head_dim(i) for i in layers)
    return 2 * config.num_heads * widths * context


@dataclass
class _Shape:
    """One layout's decode-step roofline."""

    config: ModelConfig
    gpu: object
    sharded: float
    routed: float
    active: float
    wbytes: float
    tp: int
    pp: int
    ep: int
    kv_token: float
    context: int
    mfu: float
    state: float = 0.0  # recurrent layers' state bytes per sequence on this stage, read and written every step

    def _times(self, n: int, with_kv: bool = True) -> tuple[float, float, float]:
        """(memory s, compute s, communication s) of one stage for a batch of n sequences."""
        c = self.config
        touched = c.num_experts * (1 - (1 - c.num_experts_per_tok / c.num_experts) ** n) if c.num_experts else 0
        expert_read = self.routed * (touched / c.num_experts) if c.num_experts else 0.0
        # The input embedding is a lookup: a step reads n of its rows, not the table.
        lookup = 0 if c.tie_word_embeddings else c.vocab_size * c.hidden_size
        weight_read = ((self.sharded - lookup) / self.tp + expert_read / self.ep) * self.wbytes / self.pp
        kv_read = n * (self.context * self.kv_token + 2 * self.state) if with_kv else 0.0
        memory_s = (weight_read + kv_read) / self.gpu.hbm_bandwidth
        attention = _attention_flops_per_token(c, self.context) if with_kv else 0.0
        flops = n * (2 * self.active + attention) / (self.tp * self.pp)
        compute_s = flops / (self.gpu.bf16_flops * self.mfu)
        comm_s = 0.0
        if self.tp > 1:  # 2 all-reduces per layer of n x hidden bf16 values, ring: 2 (tp - 1)/tp of the bytes
            per_layer = 2 * n * c.hidden_size * 2 * 2 * (self.tp - 1) / self.tp
            comm_s = per_layer * c.num_layers / self.pp / self.gpu.link
        return memory_s, compute_s, comm_s

    def step(self, n: int) -> tuple[float, float, float]:
        """(ms per decode step through every stage, memory s, compute s of one stage)."""
        memory_s, compute_s, comm_s = self._times(n)
        return 1000 * (max(memory_s, compute_s) + comm_s) * self.pp, memory_s, compute_s

    def compute_bound(self, n: int) -> bool:
        memory_s, compute_s, _ = self._times(n, with_kv=False)
        return compute_s >= memory_s


def decode_roofline(
    config: ModelConfig,
    gpu: GPU,
    batch: int,
    context: int,
    weights: str = "bf16",
    kv_dtype: str = "bf16",
    tp: int = 1,
    pp: int = 1,
    mfu: float = 0.6,
) -> tuple[float, bool]:
    """(ms per decode step, compute-bound?) of `batch` sequences at `context` tokens: the serving
    plan's roofline for one layout (see the module docstring), for benchmarks to set beside what
    they measure."""
    split = split_params(config)
    kv_token = kv_bytes_per_token_per_gpu(config, tp, pp, kv_dtype)
    shape = _Shape(
        config,
        gpu,
        split.dense,
        split.routed,
        split.active_matmul,
        WEIGHT_BYTES[weights],
        tp,
        pp,
        tp,
        kv_token,
        context,
        mfu,
        _state_bytes(config) / pp if config.has_recurrent_layers else 0.0,
    )
    ms, memory_s, compute_s = shape.step(batch)
    return ms, compute_s >= memory_s


def plan_serving(
    config: ModelConfig,
    cluster: Cluster,
    context: int,
    weights: str = "bf16",
    kv_dtype: str = "bf16",
    batch: int | None = None,
    block_size: int = 16,
    utilization: float = 0.9,
    mfu: float = 0.6,
    ttft_s: float | None = None,
    tpot_ms: float | None = None,
    request_rate: float | None = None,
    output_tokens: int = 256,
) -> list[ServeLayout]:
    """Every layout of the cluster's GPUs (tp within a node, pp, replicas), best first: those that
    fit, by tokens/s at `batch` sequences per replica (default: as many as fit, at most 256); with a
    `request_rate`, those that sustain it first, at the batch the rate needs."""
    _check_serving_args(context, weights, kv_dtype, request_rate, output_tokens)
    gpu = cluster.gpu
    split = split_params(config)
    layouts = []
    for tp in [d for d in (1, 2, 4, 8, 16) if d <= gpu.per_node and cluster.count % d == 0]:
        for pp in [d for d in range(1, cluster.count // tp + 1) if (cluster.count // tp) % d == 0]:
            if pp > config.num_layers:
                break
            layout, shape = _serve_layout(
                config, cluster, split, tp, pp, context, weights, kv_dtype, batch, block_size, utilization, mfu
            )
            # tpot_ok judges decode_ms at the layout's own batch, before _apply_rate replaces it with the rate's TPOT.
            if ttft_s is not None:
                layout.ttft_ok = layout.prefill_s <= ttft_s
            if tpot_ms is not None:
                layout.tpot_ok = layout.decode_ms <= tpot_ms
            if request_rate is not None and layout.fits:
                _apply_rate(
                    layout,
                    shape,
                    request_rate / layout.replicas,
                    output_tokens,
                    _prefill_s(config, split.active_matmul, context - output_tokens, tp, gpu.bf16_flops * mfu),
                )
            layouts.append(layout)
    _rank(layouts, request_rate)
    return layouts


def _check_serving_args(
    context: int, weights: str, kv_dtype: str, request_rate: float | None, output_tokens: int
) -> None:
    """The plan's arguments, checked with the messages the CLI flags are named in."""
    if request_rate is not None and request_rate <= 0:
        raise KeelError(f"--request-rate must be > 0, got {request_rate}")
    if request_rate is not None and not 1 <= output_tokens < context:
        raise KeelError(f"--output-tokens must be between 1 and the context - 1, got {output_tokens}")
    if weights not in WEIGHT_BYTES:
        raise KeelError(f"--weights {weights!r}: choose from {', '.join(WEIGHT_BYTES)}")
    if kv_dtype not in KV_BYTES:
        raise KeelError(f"--kv-cache-dtype {kv_dtype!r}: choose from {', '.join(KV_BYTES)}")
    if context < 1:
        raise KeelError(f"--context must be >= 1, got {context}")


def _serve_layout(
    config: ModelConfig,
    cluster: Cluster,
    split: ParamSplit,
    tp: int,
    pp: int,
    context: int,
    weights: str,
    kv_dtype: str,
    batch: int | None,
    block_size: int,
    utilization: float,
    mfu: float,
) -> tuple[ServeLayout, _Shape]:
    """One tp x pp layout: its memory, KV capacity and roofline times (ep = tp), and the roofline itself."""
    gpu, wbytes = cluster.gpu, WEIGHT_BYTES[weights]
    sharded, routed, active = split.dense, split.routed, split.active_matmul
    replicas = cluster.count // (tp * pp)
    ep = tp
    weights_gpu = (sharded / tp + routed / ep) * wbytes / pp
    free = gpu.memory * utilization - gpu.memory * 0.05 - weights_gpu
    fits = free > 0
    share = 1.0
    if not fits and routed:
        # Offloading: keep the non-expert part and a KV reserve of one sequence, fill the rest with experts.
        kv_one = kv_bytes_per_token_per_gpu(config, tp, pp, kv_dtype) * context
        room = gpu.memory * (utilization - 0.05) - sharded / tp * wbytes / pp - kv_one
        share = max(0.0, min(1.0, room / (routed / ep * wbytes / pp)))
    kv_token = kv_bytes_per_token_per_gpu(config, tp, pp, kv_dtype)
    kv_free = max(free, 0.0)
    # Recurrent layers: each sequence's state beside its blocks (the engine sizes its slots the same way)
    state = _state_bytes(config) / pp if config.has_recurrent_layers else 0.0
    per_sequence = kv_token * block_size * -(-context // block_size) + state
    sequences = int(kv_free // per_sequence) if per_sequence else 0
    blocks = int((kv_free - sequences * state) // (kv_token * block_size)) if kv_token else 0
    # without attention layers (Mamba) nothing is kept per token: the sequences' own tokens are all they hold
    tokens = blocks * block_size if kv_token else sequences * context
    b = batch or max(1, min(sequences, 256))
    # keel serves recurrent layers in one process only (keel.serve.hybrid)
    servable = not config.has_recurrent_layers or tp * pp == 1

    shape = _Shape(config, gpu, sharded, routed, active, wbytes, tp, pp, ep, kv_token, context, mfu, state)
    decode1, *_ = shape.step(1)
    decode_b, *_ = shape.step(b)
    bound = 1  # weights only: the KV reads grow with the batch as the compute does
    while bound < 1 << 16 and not shape.compute_bound(bound):
        bound *= 2
    prefill = _prefill_s(config, active, context, tp, gpu.bf16_flops * mfu)
    layout = ServeLayout(
        tp=tp,
        pp=pp,
        ep=ep,
        replicas=replicas,
        weights_gb=weights_gpu / 1e9,
        kv_gb=kv_free / 1e9,
        kv_bytes_per_token=kv_token,
        tokens=tokens,
        sequences=sequences,
        fits=fits and sequences > 0 and servable,
        resident_expert_share=share if not fits else 1.0,
        decode_ms_batch1=decode1,
        decode_ms=decode_b,
        batch=b,
        tokens_per_s=replicas * b * 1000 / decode_b,
        compute_bound_batch=bound if shape.compute_bound(bound) else 0,
        prefill_s=prefill,
    )
    return layout, shape


def _rank(layouts: list[ServeLayout], request_rate: float | None) -> None:
    """Sort best first: with a request rate, those that sustain it by time per output token, then by capacity;
    otherwise those that fit by tokens/s, then the rest by the share of experts that stays resident."""
    if request_rate is not None:
        layouts.sort(
            key=lambda lay: (
                not lay.fits,
                not lay.rate_ok,
                lay.decode_ms if lay.rate_ok else -(lay.max_request_rate or 0.0),
            )
        )
        return
    layouts.sort(key=lambda lay: (not lay.fits, -(lay.tokens_per_s if lay.fits else lay.resident_expert_share)))


def _prefill_s(config: ModelConfig, active: float, tokens: int, tp: int, flops: float) -> float:
    """Seconds to prefill one prompt of `tokens` tokens on a tp group (causal attention: half the square)."""
    return (2 * active * tokens + _attention_flops_per_token(config, tokens) * tokens / 2) / (tp * flops)


def _apply_rate(layout: ServeLayout, shape: _Shape, rate: float, output_tokens: int, prefill: float) -> None:
    """Little's law for one replica taking `rate` requests/s (see the module docstring)."""

    def sustained(b: int) -> tuple[float, float]:
        step_s = shape.step(b)[0] / 1000
        return b / (step_s * output_tokens + b * prefill), step_s

    most, _ = sustained(layout.sequences)
    layout.max_request_rate = most * layout.replicas
    layout.rate_ok = most >= rate
    if not layout.rate_ok:
        return
    lo, hi = 1, layout.sequences  # the smallest batch that sustains the rate (sustained grows with b)
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if sustained(mid)[0] < rate else (lo, mid)
    step_s = sustained(lo)[1]
    layout.batch = lo
    layout.decode_ms = 1000 * step_s / max(1e-9, 1 - rate * prefill)
    layout.tokens_per_s = rate * layout.replicas * output_tokens


def as_dicts(layouts: list[ServeLayout]) -> list[dict]:
    return [asdict(layout) for layout in layouts]
