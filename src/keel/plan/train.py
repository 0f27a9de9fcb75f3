"""Training plan: memory per GPU and a roofline step time for every layout of a cluster.

A layout is tp (inside a node) x pp x dp data-parallel ranks = GPUs, with ep expert-parallel ranks
taken from the data-parallel ones (ep divides dp and the expert count), a ZeRO stage for the model
states (1: optimizer sharded, as DeepSeek-V3; 3: everything sharded, keel's FSDP2), a micro-batch of
`micro_batch` sequences and activation checkpointing (none or full).

Memory per GPU (bytes):
- model states: the dense part (attention, dense MLPs, shared experts, embeddings, norms, routers)
  split by tp and pp and ZeRO-sharded over dp; routed experts split by ep and pp and ZeRO-sharded
  over dp / ep (their data-parallel group); mixed-precision Adam: 2 + 2 + 12 bytes per parameter;
- activations: layers per stage x `layer_activation_bytes` x micro-batches in flight (pp on the
  first stage under 1F1B), plus the last stage's logits (float32, split by tp);
- buffers: two layers' gathered weights under ZeRO-3 (prefetch), the largest layer's gradients.

Step time (seconds): compute = 6 x active parameters x tokens (+ causal attention) per GPU over
peak x `mfu` (x 4/3 with full recomputation), stretched by the 1F1B bubble (pp - 1)/(m + pp - 1);
tp all-reduces (4 per layer per micro-batch of mb x s x h, ring) and the EP all-to-alls (dispatch
and combine, forward and backward, of tokens x k x h) are not overlapped; the ZeRO collectives
(weights all-gathered in forward and backward under ZeRO-3, gradients reduce-scattered, or
all-reduced under ZeRO-1) overlap compute, so only their excess over compute counts; a ring
collective also pays group - 1 latency steps of 10 us (what makes ZeRO over thousands of ranks
slow). A group inside a node uses the scale-up link, across nodes the network. The pipeline
schedule is plain 1F1B (no interleaving). tokens/s per GPU and MFU follow.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from keel.config import ModelConfig
from keel.errors import KeelError
from keel.plan.activations import layer_activation_bytes
from keel.plan.hardware import GPU, Cluster
from keel.plan.params import split_params
from keel.plan.zero import zero_bytes_per_gpu


@dataclass
class TrainLayout:
    tp: int
    pp: int
    dp: int
    ep: int
    zero: int
    micro_batch: int
    microbatches: int  # per step per pipeline
    recompute: str
    params_gb: float  # model states per GPU (weights + grads + optimizer)
    activations_gb: float
    buffers_gb: float
    total_gb: float
    fits: bool
    step_s: float
    compute_s: float
    bubble: float  # share of the step idle in the pipeline bubble
    comm_s: float  # exposed communication
    tokens_per_s_per_gpu: float
    mfu: float


def _bandwidth(gpu: GPU, group: int, stride: int) -> float:
    """Per-GPU bandwidth of a collective over `group` ranks placed `stride` GPUs apart."""
    return gpu.link if group * stride <= gpu.per_node else gpu.network


LATENCY = 10e-6  # seconds per ring step (NCCL over NVLink ~ a few us, over the network ~10 us)


def _ring(bytes_: float, group: int, bandwidth: float, collectives: int = 1) -> float:
    """Seconds of `collectives` ring all-gathers or reduce-scatters moving `bytes_` in total (full
    tensors) over `group` ranks: bandwidth term plus group - 1 latency steps each."""
    if group <= 1:
        return 0.0
    return bytes_ * (group - 1) / group / bandwidth + collectives * (group - 1) * LATENCY


def evaluate(
    config: ModelConfig,
    cluster: Cluster,
    seq: int,
    global_batch_tokens: int,
    tp: int,
    pp: int,
    ep: int,
    zero: int,
    micro_batch: int,
    recompute: str,
    mfu: float = 0.5,
    utilization: float = 0.9,
) -> TrainLayout | None:
    """One layout's memory and step time; None when it is not a layout of this cluster/model."""
    gpu, n = cluster.gpu, cluster.count
    if n % (tp * pp) or tp > gpu.per_node:
        return None
    dp = n // (tp * pp)
    if ep > 1 and (dp % ep or not config.num_experts or config.num_experts % ep):
        return None
    sequences = global_batch_tokens // seq
    if sequences % (dp * micro_batch):
        return None
    m = sequences // (dp * micro_batch)  # micro-batches per pipeline per step
    if pp > 1 and m < pp:
        return None
    split = split_params(config)
    dense, routed, active = split.dense, split.routed, split.active_matmul
    dense_gpu = dense / (tp * pp)
    routed_gpu = routed / (ep * pp)
    states = zero_bytes_per_gpu(dense_gpu, dp, zero) + zero_bytes_per_gpu(routed_gpu, dp // ep, zero)
    layers = -(-config.num_layers // pp)
    in_flight = min(pp, m) if pp > 1 else 1
    act_layer = layer_activation_bytes(config, seq, micro_batch, tp, recompute)
    logits = micro_batch * seq * config.vocab_size * 4 / tp
    activations = layers * act_layer * in_flight + logits
    layer_params = (dense_gpu + routed_gpu) / max(1, layers)
    buffers = (2 * 2 * layer_params if zero == 3 else 0) + 2 * layer_params
    total = states + activations + buffers
    fits = total <= gpu.memory * utilization

    tokens_gpu = global_batch_tokens / n
    attention = 6 * config.num_layers * seq * config.num_heads * config.head_dim  # causal QK and PV, fwd + bwd
    flops = tokens_gpu * (6 * active + attention)  # the step's FLOPs spread evenly over the GPUs
    compute = flops / (gpu.bf16_flops * mfu) * (4 / 3 if recompute == "full" else 1.0)
    bubble = (pp - 1) / (m + pp - 1) if pp > 1 else 0.0
    pipeline = compute / (1 - bubble)
    comm = 0.0
    if tp > 1:  # 4 all-reduces per layer per micro-batch (2 forward, 2 backward), ring
        per = micro_batch * seq * config.hidden_size * 2
        comm += 4 * layers * m * 2 * per * (tp - 1) / tp / gpu.link
    if ep > 1:  # dispatch + combine, forward + backward, of each token's k slots
        slots = tokens_gpu * config.num_experts_per_tok * config.hidden_size * 2
        comm += 4 * split.moe_layers / pp * slots * (ep - 1) / ep / _bandwidth(gpu, ep, tp)
    weights_bytes = 2 * (dense_gpu + routed_gpu)
    zero_volume = (3 if zero == 3 else 2) * weights_bytes  # AG fwd + AG bwd + RS, or RS + AG of ZeRO-1
    # One collective per layer and kind (FSDP's per-layer units; ZeRO-1's buckets about as many).
    zero_s = _ring(zero_volume, dp, _bandwidth(gpu, dp, tp * pp), collectives=(3 if zero == 3 else 2) * layers)
    exposed = comm + max(0.0, zero_s - pipeline)
    step = pipeline + exposed
    return TrainLayout(
        tp=tp, pp=pp, dp=dp, ep=ep, zero=zero, micro_batch=micro_batch, microbatches=m, recompute=recompute,
        params_gb=states / 1e9, activations_gb=activations / 1e9, buffers_gb=buffers / 1e9, total_gb=total / 1e9,
        fits=fits, step_s=step, compute_s=compute, bubble=bubble, comm_s=exposed,
        tokens_per_s_per_gpu=tokens_gpu / step, mfu=6 * active * tokens_gpu / step / gpu.bf16_flops,
    )  # fmt: skip


def _divisors(n: int, limit: int | None = None) -> list[int]:
    return [d for d in range(1, (limit or n) + 1) if n % d == 0]


def plan_training(
    config: ModelConfig,
    cluster: Cluster,
    seq: int,
    global_batch_tokens: int,
    micro_batches: tuple[int, ...] = (1, 2, 4),
    zero_stages: tuple[int, ...] = (1, 3),
    recompute: tuple[str, ...] = ("none", "full"),
    mfu: float = 0.5,
) -> list[TrainLayout]:
    """Every layout (tp, pp, ep, ZeRO stage, micro-batch, recomputation) of the cluster, those that
    fit first, by predicted tokens/s per GPU."""
    if seq < 1 or global_batch_tokens < seq:
        raise KeelError("the global batch must hold at least one sequence")
    powers = [1 << i for i in range(16)]
    tps = [t for t in powers if t <= cluster.gpu.per_node and cluster.count % t == 0]
    pps = [p for p in powers if p <= config.num_layers and cluster.count % p == 0]
    eps = [e for e in powers if config.num_experts and config.num_experts % e == 0] if config.num_experts else [1]
    layouts = []
    for tp in tps:
        for pp in pps:
            for ep in eps:
                for zero in zero_stages:
                    for mb in micro_batches:
                        for rc in recompute:
                            layout = evaluate(config, cluster, seq, global_batch_tokens, tp, pp, ep, zero, mb, rc, mfu)
                            if layout is not None:
                                layouts.append(layout)
    layouts.sort(key=lambda lay: (not lay.fits, -lay.tokens_per_s_per_gpu))
    return layouts


def as_dicts(layouts: list[TrainLayout]) -> list[dict]:
    return [asdict(layout) for layout in layouts]
