"""Peak memory of one keel training run, per rank, predicted from its config before it starts.

`keel plan train --config run.toml [--nproc N]` prints it, and `keel train` records it next to what
it measures (`[log] memory_breakdown = true`). The cluster planner (keel.plan.train) sums the same
kinds of state for layouts it cannot run; here the recipe is keel's own, exactly:

- model states: weights, gradients and AdamW's two moments, all in the weights' dtype, sharded over
  `dp_shard` by FSDP2 (ZeRO-3; `dp_replicate` ranks hold copies), split by `tp` and `pp`;
- FSDP2 gathers each block's weights in the compute dtype for its forward and backward (and
  prefetches the next block's); the head and final norm (one unit) stay gathered from forward through
  their backward, the embedding (another) only while it computes; a tied embedding and head are
  one unit, the root's, gathered from forward until the end of backward; each unit's gradients are
  reduce-scattered in float32;
- without FSDP, bf16 compute over float32 weights runs under autocast, whose cast (bf16) copy of every
  matmul weight is saved for backward;
- activations: `layer_activation_bytes` per block in the run's recipe, or only the block's input
  where activation checkpointing wraps it (`full`, or every k-th block with `selective`), the final
  norm's, the logits (compute dtype) and the loss's float32 log-sum-exp; the logits' gradient and
  the loss's float32 row chunks when backward starts.

The peak is the largest of these moments: backward starts, every activation alive (gradients exist
from the second micro-batch of an accumulation on); the backward of each block, from the last, with
the gradients of the blocks above it, the activations of those below and all of its own (recomputed
from its input when checkpointed); under FSDP the reduce-scatters of the head's gradients (first in
backward, every activation kept) and of the embedding's (last), or of a tied root's (last), each
unsharded, cast to float32, copied into the collective's buffer, with its output shard; the
optimizer step, every gradient present.
tests/test_plan_run.py compares the prediction with the peak torch's MemTracker measures in real
runs (one process and FSDP over 2, with and without checkpointing). Pipeline stages (1F1B: `pp`
micro-batches in flight on the first stage) and tensor parallelism (sequence-parallel activations
split by `tp`) are modelled, not yet measured.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Protocol

from keel.config import ModelConfig
from keel.dtypes import DTYPES
from keel.model.loss import CHUNK_BYTES
from keel.plan.activations import ActivationPrecision, layer_activation_bytes, norm_bytes


# What the prediction reads of a run. keel.train.config's TrainConfig and Layout have these fields;
# the planner sits below keel.train, so it names the fields it needs instead of importing the classes.
class _ModelSettings(Protocol):
    @property
    def dtype(self) -> str: ...  # the weights' dtype name (keel.dtypes.DTYPES)


class _TrainingSettings(Protocol):
    @property
    def precision(self) -> str: ...  # "fp32" | "bf16" | "fp16"


class _DataSettings(Protocol):
    @property
    def seq_len(self) -> int: ...


class _CheckpointSettings(Protocol):
    @property
    def mode(self) -> str: ...  # "none" | "full" | "selective"

    @property
    def every(self) -> int: ...


class RunSettings(Protocol):
    """A run's config as the prediction reads it (keel.train.config.TrainConfig)."""

    @property
    def model(self) -> _ModelSettings: ...

    @property
    def training(self) -> _TrainingSettings: ...

    @property
    def data(self) -> _DataSettings: ...

    @property
    def activation_checkpoint(self) -> _CheckpointSettings: ...


class RunLayout(Protocol):
    """How a run is laid out over its ranks (keel.train.config.Layout, from resolve_layout)."""

    @property
    def dp(self) -> int: ...

    @property
    def dp_shard(self) -> int: ...

    @property
    def tp(self) -> int: ...

    @property
    def pp(self) -> int: ...

    @property
    def micro_batch_size(self) -> int: ...

    @property
    def pp_microbatches(self) -> int: ...

    @property
    def grad_accum(self) -> int: ...


@dataclass
class RunMemory:
    """Bytes on one rank at the predicted peak, by kind, and which moment it is."""

    weights: float  # the rank's (sharded) weights plus gathered or autocast copies alive at the peak
    grads: float
    optimizer: float
    activations: float  # saved for backward, including the logits
    temporary: float  # the logits' gradient and the loss's chunks, or a recomputed block's gradients
    moment: str

    @property
    def peak(self) -> float:
        return self.weights + self.grads + self.optimizer + self.activations + self.temporary

    def as_dict(self) -> dict[str, float | str]:
        return {**asdict(self), "peak": self.peak}


def predict_run_memory(cfg: RunSettings, config: ModelConfig, layout: RunLayout) -> RunMemory:
    """The predicted peak of one rank of the run `cfg` (model `config`, layout from
    keel.train.config.resolve_layout)."""
    return max(predict_run_moments(cfg, config, layout), key=lambda m: m.peak)


def predict_run_moments(cfg: RunSettings, config: ModelConfig, layout: RunLayout) -> list[RunMemory]:
    """Every candidate peak of one rank, in step order ("backward starts" first)."""
    return _moments(cfg, config, layout, _rank_sizes(cfg, config, layout))


@dataclass(frozen=True)
class _RankSizes:
    """What every moment of one rank's step shares: dtypes, parameter counts and the states' bytes."""

    w: int  # bytes per value of the weights' dtype
    compute: int  # bytes per value of the compute dtype
    fsdp: bool
    precision: ActivationPrecision
    tokens: int  # per forward (per pipeline microbatch with pp > 1)
    root: float  # parameters of the embedding, head (when untied) and final norm
    block: float  # parameters of one block
    layers: int  # blocks on this stage
    params: float  # parameters on this rank before FSDP's sharding
    shard: int  # ranks the states are sharded over (1 without FSDP)
    weights: float  # the rank's sharded weights
    gathered: float  # gathered (FSDP) or autocast copies of weights alive through backward


def _rank_sizes(cfg: RunSettings, config: ModelConfig, layout: RunLayout) -> _RankSizes:
    h, vocab = config.hidden_size, config.vocab_size
    w = DTYPES[cfg.model.dtype].itemsize
    compute = w if cfg.training.precision == "fp32" else 2
    fsdp = layout.dp > 1
    # FSDP's mixed precision hands the blocks weights already in the compute dtype.
    precision = ActivationPrecision.of(compute if fsdp else w, compute)
    tp, pp = layout.tp, layout.pp
    tokens = layout.micro_batch_size * cfg.data.seq_len // max(1, layout.pp_microbatches if pp > 1 else 1)
    counts = config.param_counts()
    root = counts["embedding"] + h  # embedding, head (when untied), final norm
    block = (counts["total"] - root) / config.num_layers
    layers = -(-config.num_layers // pp)
    params = (root + block * layers) / tp if pp > 1 else counts["total"] / tp
    shard = layout.dp_shard if fsdp else 1
    weights = params * w / shard
    gathered = 0.0
    if fsdp:  # two blocks' gathered copies (the one computing, the prefetched one), and the head's
        # (untied: its own unit with the final norm, gathered from forward through its backward) or the
        # root's (tied: embedding, head and norm in one unit)
        kept_root = _head_unit(config) if not config.tie_word_embeddings else root
        gathered = (kept_root / tp) * compute + 2 * block / tp * compute
    elif precision.autocast:  # the bf16 copies of every matmul weight (the embedding is a lookup)
        gathered = 2 * (params - (0 if config.tie_word_embeddings else vocab * h / tp))
    return _RankSizes(w, compute, fsdp, precision, tokens, root, block, layers, params, shard, weights, gathered)


def _head_unit(config: ModelConfig) -> int:
    """Parameters of an untied model's head unit under FSDP: the LM head and the final norm."""
    return config.vocab_size * config.hidden_size + config.hidden_size


def _kept_activations(cfg: RunSettings, config: ModelConfig, layout: RunLayout, sizes: _RankSizes) -> list[float]:
    """Activations each block of the stage keeps for backward (checkpointed ones their input), top (last) first."""
    ac, pp, tp = cfg.activation_checkpoint, layout.pp, layout.tp
    in_flight = min(pp, layout.pp_microbatches) if pp > 1 else 1
    kept = []
    for i in reversed(range(sizes.layers)):
        wrapped = ac.mode == "full" or (ac.mode == "selective" and i % ac.every == 0)
        recipe = "full" if wrapped else "none"
        kept.append(layer_activation_bytes(config, sizes.tokens, 1, tp, recipe, sizes.precision) * in_flight)
    return kept


def _moments(cfg: RunSettings, config: ModelConfig, layout: RunLayout, sizes: _RankSizes) -> list[RunMemory]:
    """The rank's memory at each candidate peak: backward starts, each block's backward, the root's
    reduce-scatter under FSDP, the optimizer step."""
    h, vocab, tp, layers = config.hidden_size, config.vocab_size, layout.tp, sizes.layers
    w, compute, fsdp, shard, block, root = sizes.w, sizes.compute, sizes.fsdp, sizes.shard, sizes.block, sizes.root
    tokens, weights = sizes.tokens, sizes.weights
    grads_all = weights  # gradients and AdamW's two moments in the weights' dtype, sharded alike
    optimizer = 2 * weights
    # Activations of the stage: blocks (checkpointed ones keep their input), the final norm and logits.
    in_flight = min(layout.pp, layout.pp_microbatches) if layout.pp > 1 else 1
    full_block = layer_activation_bytes(config, tokens, 1, tp, "none", sizes.precision) * in_flight
    kept = _kept_activations(cfg, config, layout, sizes)
    head = tokens * (norm_bytes(h, sizes.precision) + compute * h + compute * vocab / tp + 4)
    logits_grad = tokens * compute * vocab / tp + min(CHUNK_BYTES, tokens * 4 * vocab / tp)
    # The head weight's gradient: accumulated in float32 into a float32 parameter; under FSDP the
    # unsharded gradient of the gathered (compute dtype) weight.
    head_grad = (compute if fsdp else 4) * vocab * h / tp
    accumulating = layout.grad_accum > 1
    # FSDP2 keeps unsharded gradients (compute dtype) while gradient sync is off between micro-batches.
    grads_during = (sizes.params * compute if fsdp else grads_all) if accumulating else 0.0
    # A block's backward: the gradients flowing in and out (h wide) and of its widest tensors (the
    # MLP's gate, up, SiLU and product); under FSDP its unsharded gradients before the reduce-scatter.
    width = config.widest_intermediate_size
    if config.num_experts:
        width = config.num_experts_per_tok * config.moe_intermediate_size + config.shared_expert_intermediate_size
    # FSDP2's reduce-scatter of a unit's gradients: the unsharded gradients (compute dtype), their
    # float32 cast (the reduce dtype), the collective's float32 input buffer and its output shard.
    reduce_scatter = compute + (4 if compute != 4 else 0) + 4 + (4 / shard if fsdp else 0)
    # The reduce-scatter follows the block's backward, whose temporaries are gone by then: the larger counts.
    block_temp = max(tokens * compute * (2 * h + 4 * width / tp), block / tp * reduce_scatter if fsdp else 0.0)
    block_grads = block / tp * w / shard
    head_params = (vocab * h if not config.tie_word_embeddings else 0) + h
    head_grads = head_params / tp * (compute if fsdp else w)
    held = weights + sizes.gathered
    moments = [RunMemory(held, grads_during, optimizer, sum(kept) + head, logits_grad + head_grad, "backward starts")]
    # Backward block by block, from the last: the gradients of the blocks above exist, the
    # activations of the blocks below are still kept, the current one's are all there (recomputed
    # from its input when it is checkpointed).
    for j in range(layers):
        grads = max(grads_during, head_grads + j * block_grads)
        alive = sum(kept[j + 1 :]) + full_block
        moments.append(RunMemory(held, grads, optimizer, alive, block_temp, f"backward of block {layers - 1 - j}"))
    if fsdp and not config.tie_word_embeddings:
        # The head's unit reduce-scatters first in backward, every activation still kept; the embedding's
        # last, every other gradient present (keel.train.parallel.apply_fsdp).
        head_unit, embedding = _head_unit(config) / tp, vocab * h / tp
        moments.append(
            RunMemory(
                held,
                grads_during,
                optimizer,
                sum(kept) + head,
                head_unit * reduce_scatter,
                "reduce-scatter of the head's gradients",
            )
        )
        moments.append(
            RunMemory(
                weights + embedding * compute,
                grads_all - embedding * w / shard,
                optimizer,
                0.0,
                embedding * reduce_scatter,
                "reduce-scatter of the embedding's gradients",
            )
        )
    elif fsdp:  # the root's gradients reduce-scattered last, every block's sharded gradient present
        moments.append(
            RunMemory(
                weights + root / tp * compute,
                grads_all - root / tp * w / shard,
                optimizer,
                0.0,
                root / tp * reduce_scatter,
                "reduce-scatter of the root's gradients",
            )
        )
    moments.append(RunMemory(weights, grads_all, optimizer, 0.0, 0.0, "optimizer step"))
    return moments
