"""Training plan: memory per GPU and a roofline step time for every layout of a cluster.

A layout is tp (inside a node) x pp x dp data-parallel ranks = GPUs, with ep expert-parallel ranks
taken from the data-parallel ones (ep divides dp and the expert count), a ZeRO stage for the model
states (1: optimizer sharded, as DeepSeek-V3; 3: everything sharded, keel's FSDP2) over `dp_shard`
of the dp ranks (HSDP when fewer: dp / dp_shard replicas all-reduce the gradient shards), a
micro-batch of `micro_batch` sequences, activation checkpointing (none; selective: every other
block, keel's `selective` with every = 2; full) and a pipeline schedule (1F1B; interleaved 1F1B
with 2 stages per rank; ZB-V, zero-bubble with 2 stages per rank).

Memory per GPU (bytes):
- model states: the dense part (attention, dense MLPs, shared experts, embeddings, norms, routers)
  split by tp and pp and ZeRO-sharded over dp; routed experts split by ep and pp and ZeRO-sharded
  over dp / ep (their data-parallel group); 2 + 2 bytes of 16-bit weights and gradients per
  parameter plus the optimizer's float32 state: AdamW 12 (master, two moments), Muon or SGD with
  momentum 8 (master, one buffer);
- activations: layers per stage x `layer_activation_bytes` x micro-batches in flight (pp on the
  first stage under 1F1B and ZB-V; interleaving adds (pp - 1) / 2 more, Narayanan et al. 2021),
  plus the last stage's logits (float32, split by tp);
- buffers: two layers' gathered weights under ZeRO-3 (prefetch), the largest layer's gradients.

Step time (seconds): compute = 6 x active parameters x tokens (+ causal attention) per GPU over
peak x `mfu` (the fp8 peak for the matmuls with precision fp8, attention staying bf16; x 4/3 with
full recomputation, x 7/6 with selective), stretched by the pipeline bubble: 1F1B
(pp - 1)/(m + pp - 1); interleaved (pp - 1)/(2m + pp - 1); ZB-V a third of 1F1B's (ZB-H1's bound with
equal forward, input-gradient and weight-gradient times, Qi et al. 2024; ZB-V gets closer to zero
only when they balance exactly, so this is the conservative figure);
tp all-reduces (4 per layer per micro-batch of mb x s x h, ring) and the EP all-to-alls (dispatch
and combine, forward and backward, of tokens x k x h) are not overlapped; the ZeRO collectives
(weights all-gathered in forward and backward under ZeRO-3, gradients reduce-scattered, or
all-reduced under ZeRO-1) overlap compute, so only their excess over compute counts; a ring
collective also pays group - 1 latency steps of 10 us (what makes ZeRO over thousands of ranks
slow). A group inside a node uses the scale-up link, across nodes the network. Expert all-to-alls
are not overlapped with compute (DeepSeek's DualPipe hides them; this planner does not assume it).
tokens/s per GPU and MFU (against the peak of the precision used) follow.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from keel.config import ModelConfig
from keel.errors import KeelError
from keel.plan.activations import layer_activation_bytes
from keel.plan.hardware import GPU, Cluster
from keel.plan.params import ParamSplit, split_params
from keel.plan.zero import StateBytes, zero_breakdown

OPTIMIZERS = {
    "adamw": StateBytes(optimizer=12.0),  # float32 master weights, two moments
    "muon": StateBytes(optimizer=8.0),  # float32 master weights, one momentum buffer (Kimi-K2's MuonClip)
    "sgd": StateBytes(optimizer=8.0),  # float32 master weights, momentum
}
SCHEDULES = ("1f1b", "interleaved", "zbv")
RECOMPUTE_COST = {"none": 1.0, "selective": 7 / 6, "full": 4 / 3}  # forward is a third of forward + backward


@dataclass
class TrainLayout:
    tp: int
    pp: int
    dp: int
    ep: int
    zero: int
    dp_shard: int  # ranks the ZeRO states are sharded over (dp: plain; fewer: HSDP replicas)
    micro_batch: int
    microbatches: int  # per step per pipeline
    recompute: str
    schedule: str  # pipeline schedule ("-" without pipeline parallelism)
    weights_gb: float  # per GPU
    grads_gb: float
    optimizer_gb: float
    states_gb: float  # weights + grads + optimizer
    layer_activations_gb: float  # one layer, one micro-batch, without recomputation
    layer_activations_recompute_gb: float  # the same layer checkpointed (its input only)
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


def _bubble(schedule: str, pp: int, m: int) -> float:
    if pp == 1:
        return 0.0
    if schedule == "interleaved":
        return (pp - 1) / (2 * m + pp - 1)
    one_f_one_b = (pp - 1) / (m + pp - 1)
    return one_f_one_b / 3 if schedule == "zbv" else one_f_one_b


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
    schedule: str = "1f1b",
    dp_shard: int | None = None,
    precision: str = "bf16",
    optimizer: str = "adamw",
) -> TrainLayout | None:
    """One layout's memory and step time; None when it is not a layout of this cluster/model."""
    shape = _layout_shape(
        config, cluster, seq, global_batch_tokens, tp, pp, ep, zero, micro_batch, recompute, schedule, dp_shard
    )
    if shape is None or (precision == "fp8" and cluster.gpu.fp8_flops is None):
        return None
    split = split_params(config)
    memory = _memory(config, split, shape, OPTIMIZERS[optimizer])
    time = _step_time(config, cluster, global_batch_tokens, split, shape, memory, mfu, precision)
    parts, active = memory.parts, split.active_matmul
    return TrainLayout(
        tp=tp,
        pp=pp,
        dp=shape.dp,
        ep=ep,
        zero=zero,
        dp_shard=shape.shard,
        micro_batch=micro_batch,
        microbatches=shape.m,
        recompute=recompute,
        schedule=schedule if pp > 1 else "-",
        weights_gb=parts[0] / 1e9,
        grads_gb=parts[1] / 1e9,
        optimizer_gb=parts[2] / 1e9,
        states_gb=memory.states / 1e9,
        layer_activations_gb=memory.full_layer / 1e9,
        layer_activations_recompute_gb=memory.kept_layer / 1e9,
        activations_gb=memory.activations / 1e9,
        buffers_gb=memory.buffers / 1e9,
        total_gb=memory.total / 1e9,
        fits=memory.total <= cluster.gpu.memory * utilization,
        step_s=time.step,
        compute_s=time.compute,
        bubble=time.bubble,
        comm_s=time.exposed,
        tokens_per_s_per_gpu=time.tokens_gpu / time.step,
        mfu=6 * active * time.tokens_gpu / time.step / time.peak,
    )


@dataclass(frozen=True)
class _Shape:
    """A layout that fits the cluster and the model: its ranks and how the global batch splits."""

    seq: int
    tp: int
    pp: int
    dp: int
    ep: int
    zero: int
    shard: int  # ranks the ZeRO states are sharded over
    micro_batch: int
    m: int  # micro-batches per pipeline per step
    chunks: int  # pipeline stages per rank
    recompute: str
    schedule: str


def _layout_shape(
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
    schedule: str,
    dp_shard: int | None,
) -> _Shape | None:
    """The layout's dp, ZeRO shard and micro-batch count; None when the degrees do not fit the cluster/model."""
    gpu, n = cluster.gpu, cluster.count
    if n % (tp * pp) or tp > gpu.per_node:
        return None
    dp = n // (tp * pp)
    shard = dp if dp_shard is None else dp_shard
    if dp % shard or (shard != dp and zero != 3):
        return None
    if ep > 1 and (dp % ep or not config.num_experts or config.num_experts % ep):
        return None
    if ep > 1 and shard % ep:
        return None
    sequences = global_batch_tokens // seq
    if sequences % (dp * micro_batch):
        return None
    m = sequences // (dp * micro_batch)  # micro-batches per pipeline per step
    if pp > 1 and m < pp:
        return None
    chunks = 2 if pp > 1 and schedule in ("interleaved", "zbv") else 1
    if pp > 1 and config.num_layers < pp * chunks:
        return None
    return _Shape(seq, tp, pp, dp, ep, zero, shard, micro_batch, m, chunks, recompute, schedule)


@dataclass(frozen=True)
class _Memory:
    """Bytes per GPU of one layout."""

    params_gpu: float  # parameters held per GPU before ZeRO sharding (dense / (tp pp) + routed / (ep pp))
    layers: int  # per pipeline stage
    parts: list[float]  # weights, grads, optimizer
    states: float
    full_layer: float
    kept_layer: float
    activations: float
    buffers: float
    total: float


def _memory(config: ModelConfig, split: ParamSplit, shape: _Shape, state: StateBytes) -> _Memory:
    """Model states, activations and buffers per GPU (the module docstring gives the model)."""
    tp, pp, m, micro_batch, seq = shape.tp, shape.pp, shape.m, shape.micro_batch, shape.seq
    dense_gpu = split.dense / (tp * pp)
    routed_gpu = split.routed / (shape.ep * pp)
    dense_parts = zero_breakdown(dense_gpu, shape.shard, shape.zero, state)
    routed_parts = zero_breakdown(routed_gpu, shape.shard // shape.ep, shape.zero, state)
    parts = [a + b for a, b in zip(dense_parts, routed_parts, strict=True)]  # weights, grads, optimizer
    states = sum(parts)
    layers = -(-config.num_layers // pp)
    in_flight = 1.0
    if pp > 1:
        in_flight = min(pp, m) * (1 + (pp - 1) / (pp * shape.chunks) if shape.schedule == "interleaved" else 1)
    full_layer = layer_activation_bytes(config, seq, micro_batch, tp, "none")
    kept_layer = layer_activation_bytes(config, seq, micro_batch, tp, "full")
    checkpointed = {"none": 0, "selective": layers // 2, "full": layers}[shape.recompute]
    per_microbatch = (layers - checkpointed) * full_layer + checkpointed * kept_layer
    recomputing = full_layer if checkpointed else 0.0  # the one block being recomputed in backward
    logits = micro_batch * seq * config.vocab_size * 4 / tp
    activations = per_microbatch * in_flight + recomputing + logits
    params_gpu = dense_gpu + routed_gpu
    layer_params = params_gpu / max(1, layers)
    buffers = (2 * 2 * layer_params if shape.zero == 3 else 0) + 2 * layer_params
    total = states + activations + buffers
    return _Memory(params_gpu, layers, parts, states, full_layer, kept_layer, activations, buffers, total)


@dataclass(frozen=True)
class _StepTime:
    tokens_gpu: float
    peak: float  # FLOP/s of the precision used
    compute: float
    bubble: float
    exposed: float  # communication not hidden behind compute
    step: float


def _step_time(
    config: ModelConfig,
    cluster: Cluster,
    global_batch_tokens: int,
    split: ParamSplit,
    shape: _Shape,
    memory: _Memory,
    mfu: float,
    precision: str,
) -> _StepTime:
    """Roofline compute stretched by the pipeline bubble, plus the communication it does not hide."""
    gpu, tp, pp, ep, seq, layers = cluster.gpu, shape.tp, shape.pp, shape.ep, shape.seq, memory.layers
    tokens_gpu = global_batch_tokens / cluster.count
    # causal QK and PV, fwd + bwd, at each layer's head width
    attention = 6 * seq * sum(config.layer_q_size(i) for i in range(config.num_layers))
    peak = gpu.fp8_flops if precision == "fp8" else gpu.bf16_flops
    active = split.active_matmul
    compute = tokens_gpu * (6 * active / peak + attention / gpu.bf16_flops) / mfu * RECOMPUTE_COST[shape.recompute]
    bubble = _bubble(shape.schedule, pp, shape.m)
    pipeline = compute / (1 - bubble)
    comm = 0.0
    if tp > 1:  # 4 all-reduces per layer per micro-batch (2 forward, 2 backward), ring
        per = shape.micro_batch * seq * config.hidden_size * 2
        comm += 4 * layers * shape.m * 2 * per * (tp - 1) / tp / gpu.link
    if ep > 1:  # dispatch + combine, forward + backward, of each token's k slots
        slots = tokens_gpu * config.num_experts_per_tok * config.hidden_size * 2
        comm += 4 * split.moe_layers / pp * slots * (ep - 1) / ep / _bandwidth(gpu, ep, tp)
    weights_bytes = 2 * memory.params_gpu
    zero3, shard = shape.zero == 3, shape.shard
    zero_volume = (3 if zero3 else 2) * weights_bytes  # AG fwd + AG bwd + RS, or RS + AG of ZeRO-1
    # One collective per layer and kind (FSDP's per-layer units; ZeRO-1's buckets about as many).
    zero_s = _ring(zero_volume, shard, _bandwidth(gpu, shard, tp * pp), collectives=(3 if zero3 else 2) * layers)
    replicas = shape.dp // shard
    if replicas > 1:  # HSDP: the replicas all-reduce their gradient shard (2x a ring's volume)
        stride = tp * pp * shard
        zero_s += _ring(2 * weights_bytes / shard, replicas, _bandwidth(gpu, replicas, stride), collectives=2 * layers)
    exposed = comm + max(0.0, zero_s - pipeline)
    return _StepTime(tokens_gpu, peak, compute, bubble, exposed, pipeline + exposed)


def _divisors(n: int, limit: int | None = None) -> list[int]:
    return [d for d in range(1, (limit or n) + 1) if n % d == 0]


def plan_training(
    config: ModelConfig,
    cluster: Cluster,
    seq: int,
    global_batch_tokens: int,
    micro_batches: tuple[int, ...] = (1, 2, 4),
    zero_stages: tuple[int, ...] = (1, 3),
    recompute: tuple[str, ...] = tuple(RECOMPUTE_COST),
    mfu: float = 0.5,
    schedules: tuple[str, ...] = SCHEDULES,
    precision: str = "bf16",
    optimizer: str = "adamw",
) -> list[TrainLayout]:
    """Every layout (tp, pp, ep, ZeRO stage and sharding group, micro-batch, recomputation, pipeline
    schedule) of the cluster, those that fit first, by predicted tokens/s per GPU."""
    if seq < 1 or global_batch_tokens < seq:
        raise KeelError("the global batch must hold at least one sequence")
    if precision not in ("bf16", "fp8"):
        raise KeelError(f"precision {precision!r}: expected bf16 or fp8")
    if precision == "fp8" and cluster.gpu.fp8_flops is None:
        raise KeelError(f"precision fp8: {cluster.gpu.name} has no fp8 tensor cores")
    if optimizer not in OPTIMIZERS:
        raise KeelError(f"optimizer {optimizer!r}: expected one of {', '.join(OPTIMIZERS)}")
    for policy in recompute:
        if policy not in RECOMPUTE_COST:
            raise KeelError(f"recomputation {policy!r}: expected {', '.join(RECOMPUTE_COST)}")
    for schedule in schedules:
        if schedule not in SCHEDULES:
            raise KeelError(f"pipeline schedule {schedule!r}: expected {', '.join(SCHEDULES)}")
    powers = [1 << i for i in range(16)]
    tps = [t for t in powers if t <= cluster.gpu.per_node and cluster.count % t == 0]
    pps = [p for p in powers if p <= config.num_layers and cluster.count % p == 0]
    eps = [e for e in powers if config.num_experts and config.num_experts % e == 0] if config.num_experts else [1]
    layouts = []
    for tp in tps:
        for pp in pps:
            dp = cluster.count // (tp * pp)
            node = cluster.gpu.per_node // tp  # a shard group inside a node (HSDP), when smaller than dp
            for ep in eps:
                for zero in zero_stages:
                    shards = [dp] + ([node] if zero == 3 and 1 < node < dp and dp % node == 0 else [])
                    for shard in shards:
                        for mb in micro_batches:
                            for rc in recompute:
                                for schedule in schedules if pp > 1 else schedules[:1]:
                                    layout = evaluate(
                                        config,
                                        cluster,
                                        seq,
                                        global_batch_tokens,
                                        tp,
                                        pp,
                                        ep,
                                        zero,
                                        mb,
                                        rc,
                                        mfu,
                                        schedule=schedule,
                                        dp_shard=shard,
                                        precision=precision,
                                        optimizer=optimizer,
                                    )
                                    if layout is not None:
                                        layouts.append(layout)
    layouts.sort(key=lambda lay: (not lay.fits, -lay.tokens_per_s_per_gpu))
    return layouts


def as_dicts(layouts: list[TrainLayout]) -> list[dict]:
    return [asdict(layout) for layout in layouts]
