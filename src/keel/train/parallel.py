"""Parallelism passes applied from outside the model: tensor/sequence parallel, activation checkpointing, FSDP2.

## The device mesh

Every rank sits on one `DeviceMesh` with four named dims, outermost first:

    ("pp", "dp_replicate", "dp_shard", "tp")      world = pp * dp_replicate * dp_shard * tp

Size-1 dims are allowed and cost nothing. `tp` is innermost so that tensor-parallel groups (the most
talkative) are neighbouring ranks, i.e. one node; `pp` is outermost (point-to-point only). The two
data-parallel dims are also flattened into `"dp"`: the ranks that see different data, over which
the loss is averaged and batches are split.

| sub-mesh                          | used by                                                     |
|-----------------------------------|-------------------------------------------------------------|
| `mesh["tp"]`                      | `apply_tp` (DTensor placements, collectives inside a block) |
| `mesh["dp_shard"]`                | FSDP (ZeRO-3) when `dp_replicate == 1`                      |
| `mesh["dp_replicate", "dp_shard"]`| HSDP when `dp_replicate > 1`: replicate x shard (2-D)       |
| `loss_mesh(mesh)` ("dp", flat)    | data loading rank/size, loss and metric all-reduce          |
| `mesh["pp"]`                      | `keel.train.pipeline.build_pipeline` (send/recv)            |

## Order of passes (torchtitan's)

    split into pipeline stages -> TP (+SP) -> activation checkpointing -> FSDP per block, then root

TP first, because FSDP shards the DTensor parameters TP produced a second time on the dp mesh (2-D
`(Shard(0) on dp, Shard(k) on tp)` placements); AC before FSDP, so that FSDP's all-gather hooks sit
outside the checkpointed region and the recomputation re-gathers nothing it still holds.

## The TP plan (`apply_tp`), per architecture family

| module                                   | style                                                       |
|------------------------------------------|-------------------------------------------------------------|
| `embed_tokens`                           | RowwiseParallel (vocab-parallel), output Shard(1) with SP   |
| `embed_positions` (learned positions)    | replicated, output Shard(1) with SP                         |
| `layers.N.input_layernorm`, `post_...`   | SequenceParallel (SP only): activations Shard(1) on seq     |
| `layers.N.self_attn`                     | PrepareModuleInput Shard(1) -> Replicate (SP all-gather)    |
| `self_attn.q_proj/k_proj/v_proj`         | ColwiseParallel: each rank owns num_heads/tp heads          |
| `self_attn.output_gate` (Laguna)         | ColwiseParallel: the gates of the rank's heads              |
| `self_attn.q_norm/k_norm` (Qwen3)        | SequenceParallel on the heads dim (weight grads all-reduced)|
| `self_attn.o_proj`                       | RowwiseParallel, output reduce-scattered to Shard(1) (SP)   |
| `layers.N.mlp` (dense SwiGLU)            | gate_proj/up_proj Colwise, down_proj Rowwise                |
| `layers.N.mlp` (MoE)                     | replicated: gathered in, computed on every tp rank, re-split|
| `norm`, `embedding_norm` with weights    | SequenceParallel (SP only)                                  |
| `lm_head`                                | ColwiseParallel; logits vocab-sharded (loss-parallel) or gathered |

Multi-head latent attention (DeepSeek): q_proj / q_b_proj (A.X-K2: q_gate_proj) and kv_b_proj Colwise (by heads),
o_proj Rowwise; the latent projections (q_a_proj, kv_a_proj_with_mqa) and their norms replicated, fed a plain tensor
(under SP the gathered sequence enters the attention as a local tensor). The rope key, which every head uses, gets
each rank's heads' share of its gradient: a hook sums it over tp (`_rope_key_gradient_summed`).

Qwen2's q/k/v biases are sharded with their weights; Mistral's sliding window and Qwen3's q/k norm
need nothing else. Requirements: `num_heads % tp == 0`, `num_kv_heads % tp == 0` (checked, ValueError),
`intermediate_size % tp == 0`, and with SP the sequence length `% tp == 0`.

Loss-parallel (`parallel.loss_parallel`, on by default): the head's logits stay sharded on the
vocabulary and the cross-entropy reduces the log-sum-exp and the target logit over the tp ranks: no
rank holds `B*S*V` logits and no all-gather over the vocab runs. Without a pipeline the logits are a
`Shard(-1)` DTensor and the loss runs under torch's `loss_parallel()` (the trainer enters the context
around forward, loss and backward). Under a pipeline torch's stages pass plain tensors: the last
stage returns each tp rank's slice `[B, S, V/tp]`, and the pipeline's loss function is
keel.train.vocab_parallel's, which does the same reductions over the tp group.

With SP the residual stream between blocks is a DTensor sharded on the sequence, which keeps the
model's own shape logic correct: `Transformer.forward` reads `B, S` from it (the global shape), so
the positions and the rotary tables cover the whole sequence while each rank stores `S/tp` of the
activations. At a pipeline-stage boundary the stage hands over the local shard (`[B, S/tp, H]`), and
the next stage wraps it back into a DTensor. MoE blocks are not tensor-parallel (experts replicated
over tp): under SP their input is all-gathered so every tp rank computes identical expert gradients.

## What is sharded where, and memory per rank

FSDP2 (`fully_shard`) groups each decoder block, then the root (embedding, final norm, head). Between
uses, every parameter, its gradient and the AdamW states live only as `1/(dp_shard*tp)` shards
(`Shard(0)` on dp_shard, and on tp as the TP plan says; replicated over dp_replicate with HSDP). A
block's full parameters exist only while it runs (all-gathered in forward, re-gathered in backward
when `reshard_after_forward=True`, kept between forward and backward otherwise).

Persistent memory per rank for a model of P parameters, `pp` stages, N = dp_shard * tp (dp_replicate
does not divide: HSDP replicas hold the same shards):

    float32 training (this test suite): (4 param + 4 grad + 8 AdamW m, v) * P / (pp * N) = 16 P / (pp N) bytes
    bf16 compute (MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)): the same 16 P / (pp N),
      because FSDP2 keeps the sharded parameters and gradients in fp32 (they are the master weights); it
      equals the ZeRO-3 paper's (2 + 2 + 12) P / N (bf16 param + bf16 grad + fp32 master, m, v).

Transient on top: the gathered copies of the block computing and the one prefetched (parameters, then
gradients before their reduce-scatter: 2 x 4 bytes, or 2 bytes in bf16, x block params / tp); with
`reshard_after_forward=False` every block of the stage stays gathered from its forward to its backward.
Activations: per block input `B*S*H` (divided by tp under SP) with full AC, all block internals without.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.distributed.tensor.parallel.style import ParallelStyle

from keel.model.layers import SwiGLU
from keel.model.mla import MLAttention
from keel.model.moe import MoE
from keel.model.transformer import Transformer
from keel.paths import use_inductor_cache_dir

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")
MESH_DIMS_EP = ("pp", "dp_replicate", "dp_shard_mod_ep", "ep", "tp")
ACMode = Literal["none", "full", "selective"]


# ----------------------------------------------------------------------------- mesh


def build_mesh(
    pp: int = 1, dp_replicate: int = 1, dp_shard: int = 1, tp: int = 1, device_type: str = "cpu", ep: int = 1
) -> DeviceMesh:
    """The mesh ("pp", "dp_replicate", "dp_shard", "tp"), plus the flattened "dp" dim.

    Expert parallelism borrows its ranks from dp_shard (as torchtitan does): with ep > 1 the root
    dims are ("pp", "dp_replicate", "dp_shard_mod_ep", "ep", "tp") and "dp_shard" is the flattened
    (dp_shard_mod_ep, ep). Dense parameters are FSDP-sharded over all of dp_shard; experts are split
    over "ep" and FSDP-sharded over the rest (dp_shard_mod_ep). The data layout does not change.
    Needs an initialised default process group whose world size is the product of the dims.
    """
    sizes = (pp, dp_replicate, dp_shard, tp)
    if any(n < 1 for n in sizes) or ep < 1:
        raise ValueError(
            f"mesh dims must be >= 1, got pp={pp} dp_replicate={dp_replicate} dp_shard={dp_shard} tp={tp} ep={ep}"
        )
    world = dist.get_world_size()
    if pp * dp_replicate * dp_shard * tp != world:
        raise ValueError(
            f"pp*dp_replicate*dp_shard*tp = {pp}*{dp_replicate}*{dp_shard}*{tp} must equal the world size {world}"
        )
    if ep == 1:
        mesh = init_device_mesh(device_type, sizes, mesh_dim_names=MESH_DIMS)
    else:
        if dp_shard % ep:
            raise ValueError(f"ep = {ep} must divide dp_shard = {dp_shard} (experts borrow data-parallel ranks)")
        mesh = init_device_mesh(device_type, (pp, dp_replicate, dp_shard // ep, ep, tp), mesh_dim_names=MESH_DIMS_EP)
        mesh["dp_shard_mod_ep", "ep"]._flatten("dp_shard")
    mesh[_dp_dims(mesh)]._flatten("dp")
    return mesh


def _dp_dims(mesh: DeviceMesh) -> tuple[str, ...]:
    if "ep" in (mesh.mesh_dim_names or ()):
        return ("dp_replicate", "dp_shard_mod_ep", "ep")
    return ("dp_replicate", "dp_shard")


def ep_size(mesh: DeviceMesh) -> int:
    return mesh["ep"].size() if "ep" in (mesh.mesh_dim_names or ()) else 1


def tp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    return mesh["tp"]


def pp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    return mesh["pp"]


def _shard_mesh(mesh: DeviceMesh) -> DeviceMesh:
    if "ep" in (mesh.mesh_dim_names or ()):
        return mesh["dp_shard_mod_ep", "ep"]._flatten("dp_shard")  # the cached flattened mesh
    return mesh["dp_shard"]


def dp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh FSDP shards over: 1-D dp_shard (FSDP), or 2-D (dp_replicate, dp_shard) for HSDP."""
    if mesh["dp_replicate"].size() > 1:
        return mesh["dp_replicate", "dp_shard"]
    return _shard_mesh(mesh)


def expert_dp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh FSDP shards experts over under expert parallelism: the data-parallel ranks outside "ep"."""
    if mesh["dp_replicate"].size() > 1:
        return mesh["dp_replicate", "dp_shard_mod_ep"]
    return mesh["dp_shard_mod_ep"]


def loss_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The ranks holding different data ("dp" = dp_replicate x dp_shard): average losses and metrics here."""
    # _flatten returns the mesh build_mesh cached; slicing mesh["dp"] is deprecated for flattened dims.
    return mesh[_dp_dims(mesh)]._flatten("dp")


def dp_rank_and_size(mesh: DeviceMesh) -> tuple[int, int]:
    """(index, count) of this rank's slice of the global batch."""
    dp = loss_mesh(mesh)
    return dp.get_local_rank(), dp.size()


# ----------------------------------------------------------------------------- tensor parallel


def check_tp_divisible(model: Transformer, tp: int) -> None:
    """ValueError unless every rank can own whole attention heads (and an equal MLP slice)."""
    c = model.config
    for name, value in (("num_heads", c.num_heads), ("num_kv_heads", c.num_kv_heads)):
        if value % tp:
            raise ValueError(f"tensor parallel size {tp} must divide {name} ({value}): each rank owns whole heads")
    if any(isinstance(layer.mlp, SwiGLU) for layer in model.layers.values()) and c.intermediate_size % tp:
        raise ValueError(f"tensor parallel size {tp} must divide intermediate_size ({c.intermediate_size})")


def _layer_plan(layer: nn.Module, sp: bool) -> dict[str, ParallelStyle]:
    # With SP the residual stream is a Shard(1) DTensor; rowwise outputs stay DTensors to add to it.
    seq, out = (Shard(1), False) if sp else (Replicate(), True)
    mla = isinstance(layer.self_attn, MLAttention)
    plan: dict[str, ParallelStyle] = {"self_attn.o_proj": RowwiseParallel(output_layouts=seq, use_local_output=out)}
    if mla:  # the query and the latent's per-head expansion by heads; the latent projections replicated
        # (A.X-K2's q_gate_proj: each head's query and gate rows side by side, so a cut by heads as q_b_proj's)
        query = next(
            f"self_attn.{name}"
            for name in ("q_proj", "q_gate_proj", "q_b_proj")
            if getattr(layer.self_attn, name) is not None
        )
        plan |= {query: ColwiseParallel(), "self_attn.kv_b_proj": ColwiseParallel()}
    else:
        plan |= {proj: ColwiseParallel() for proj in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")}
        if getattr(layer.self_attn, "output_gate", None) is not None:
            # the gate of this rank's heads (a row per channel, or one per head: Laguna), as its q rows
            plan["self_attn.output_gate"] = ColwiseParallel()
    if sp:
        for norm in ("input_layernorm", "post_attention_layernorm", "attn_output_norm", "mlp_output_norm"):
            if getattr(layer, norm) is not None:
                plan[norm] = SequenceParallel()
        # Gather the sequence once per block half; the meta argument is not a tensor.
        # Latent attention's replicated projections take plain tensors: the gathered sequence enters as one.
        plan["self_attn"] = PrepareModuleInput(
            input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None), use_local_output=mla
        )
    if getattr(layer.self_attn, "q_norm", None) is not None:
        # q/k are [B, S, heads/tp, D] local tensors: shard the norm on the heads dim, so that its
        # replicated weight's gradient (a partial sum over this rank's heads) is all-reduced.
        plan["self_attn.q_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        plan["self_attn.k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
    if isinstance(layer.mlp, SwiGLU):
        if layer.mlp.gate_proj is not None:
            plan["mlp.gate_proj"] = ColwiseParallel()
        plan["mlp.up_proj"] = ColwiseParallel()
        plan["mlp.down_proj"] = RowwiseParallel(output_layouts=seq, use_local_output=out)
        if sp:
            plan["mlp"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    elif sp:
        # MoE, not tensor parallel: run it on the whole sequence with replicated experts on every tp
        # rank (identical gradients, no reduction needed), then take this rank's sequence shard.
        plan["mlp"] = PrepareModuleInputOutput(
            input_layouts=(Shard(1),),
            desired_input_layouts=(Replicate(),),
            use_local_input=True,
            output_layouts=(Replicate(),),
            desired_output_layouts=(Shard(1),),
            use_local_output=False,
        )
    return plan


class _SumGradient(torch.autograd.Function):
    """The identity forward; backward, the gradient summed over the group (Megatron's copy to the TP region)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # noqa: ANN001
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # noqa: ANN001
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def _rope_key_gradient_summed(latent_rank: int, mesh: DeviceMesh):
    """A forward hook on latent attention's kv_a_proj_with_mqa under TP: its rope key, which every head uses, gets
    from each rank only its heads' share of the gradient, so that share is summed over the ranks. The latent's
    gradient is whole already (kv_b_proj's column-parallel input sums it)."""
    group = mesh.get_group()

    def hook(module: nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
        latent, rope_key = output.split([latent_rank, output.shape[-1] - latent_rank], dim=-1)
        return torch.cat((latent, _SumGradient.apply(rope_key, group)), dim=-1)

    return hook


def _seq_divisible_hook(tp: int):
    def hook(module: nn.Module, args: tuple) -> None:
        tokens = args[0]
        if tokens.dim() == 2 and tokens.shape[1] % tp:
            raise ValueError(f"sequence parallel needs the sequence length ({tokens.shape[1]}) divisible by tp ({tp})")

    return hook


def apply_tp(
    model: Transformer,
    tp_mesh: DeviceMesh,
    sequence_parallel: bool = True,
    loss_parallel: bool = False,
    local_logits: bool = False,
) -> Transformer:
    """Tensor parallel (Megatron layout) with optional sequence parallel norms, in place.

    `model` may be a pipeline stage: missing embed_tokens / norm / lm_head are skipped, and under
    sequence parallel the stage's input (when it has no embedding) and output (when it has no head)
    are the local sequence shards [B, S/tp, H]. With loss_parallel the logits stay sharded on the
    vocabulary: a `Shard(-1)` DTensor, or with local_logits (a pipeline's last stage, whose outputs are
    plain tensors) this rank's slice [B, S, V/tp] for keel.train.vocab_parallel's loss.
    """
    tp = tp_mesh.size()
    check_tp_divisible(model, tp)
    sp = sequence_parallel
    c = model.config
    if sp and (c.embedding_size or c.norm_placement == "post_residual" or not c.final_norm):
        # plain modules between the sequence-sharded residual and the parallel styles
        raise ValueError(
            "sequence parallel: embedding_size, norm_placement 'post_residual' or no final norm (OPT-350m)"
        )
    for layer in model.layers.values():
        parallelize_module(layer, tp_mesh, _layer_plan(layer, sp))
        attn = layer.self_attn
        if getattr(attn, "sinks", None) is not None:  # GPT-OSS: a rank's heads' sinks, as its q rows
            attn.sinks = nn.Parameter(distribute_tensor(attn.sinks.data, tp_mesh, [Shard(0)]))
        if getattr(attn, "alibi", None) is not None:  # ALiBi: a rank's heads' slopes, as its q rows (Shard(0))
            per_rank = attn.alibi.shape[0] // tp_mesh.size()
            attn.alibi = attn.alibi[tp_mesh.get_local_rank() * per_rank :][:per_rank].clone()
        if isinstance(attn, MLAttention):
            attn.kv_a_proj_with_mqa.register_forward_hook(_rope_key_gradient_summed(attn.kv_lora_rank, tp_mesh))
    top: dict[str, ParallelStyle] = {}
    if model.embed_tokens is not None:
        top["embed_tokens"] = RowwiseParallel(
            input_layouts=Replicate(), output_layouts=Shard(1) if sp else Replicate(), use_local_output=not sp
        )
    if model.embed_positions is not None and sp:
        # GPT-2's learned positions: a replicated table whose output joins the sequence-sharded token embedding as
        # this rank's shard (its gradient gathered over the sequence, whole on every rank, as a norm's without SP).
        top["embed_positions"] = PrepareModuleOutput(
            output_layouts=Replicate(), desired_output_layouts=Shard(1), use_local_output=False
        )
    if model.embedding_norm is not None and sp and list(model.embedding_norm.parameters()):
        # BLOOM's embedding LayerNorm (weights of its own) on the sequence-sharded embedding, as `norm`
        top["embedding_norm"] = SequenceParallel()
    if model.norm is not None and sp:
        top["norm"] = SequenceParallel()
    if model.lm_head is not None:
        top["lm_head"] = ColwiseParallel(
            input_layouts=Shard(1) if sp else Replicate(),
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            # a vocab-sharded DTensor for torch's loss_parallel(), or under a pipeline the local slice
            use_local_output=local_logits or not loss_parallel,
        )
    if top:
        parallelize_module(model, tp_mesh, top)
    if sp:
        _apply_stage_boundaries(model, tp_mesh)
        if model.embed_tokens is not None:
            model.register_forward_pre_hook(_seq_divisible_hook(tp))
    # Both styles sharded the shared weight on the vocab (Shard(0)) but each made its own parameter.
    model.tie_weights()
    return model


def _apply_stage_boundaries(model: Transformer, mesh: DeviceMesh) -> None:
    """A stage without embedding receives, and one without norm returns, the local sequence shard."""
    wrap_in = model.embed_tokens is None
    unwrap_out = model.norm is None
    if wrap_in and unwrap_out:
        style: ParallelStyle = PrepareModuleInputOutput(
            input_layouts=(Shard(1),),
            desired_input_layouts=(Shard(1),),
            output_layouts=(Shard(1),),
            desired_output_layouts=(Shard(1),),
            use_local_output=True,
        )
    elif wrap_in:
        style = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),))
    elif unwrap_out:
        style = PrepareModuleOutput(output_layouts=Shard(1), desired_output_layouts=Shard(1), use_local_output=True)
    else:
        return
    parallelize_module(model, mesh, style)


# ----------------------------------------------------------------------------- activation checkpointing


def apply_activation_checkpointing(model: Transformer, mode: ACMode = "full", every: int = 1) -> Transformer:
    """Recompute blocks in backward instead of storing their activations, in place.

    full: every block. selective: blocks whose global index is a multiple of `every` (keys of
    `model.layers` are global indices, so a pipeline stage checkpoints the same blocks as the whole
    model would). Wrapped blocks keep their state-dict keys.
    """
    if mode == "none":
        return model
    if mode not in ("full", "selective"):
        raise ValueError(f"activation checkpointing mode must be none, full or selective, got {mode!r}")
    if every < 1:
        raise ValueError(f"activation checkpointing every must be >= 1, got {every}")
    for name in list(model.layers.keys()):
        if mode == "full" or int(name) % every == 0:
            model.layers[name] = checkpoint_wrapper(model.layers[name], preserve_rng_state=False)
    return model


# ----------------------------------------------------------------------------- torch.compile


def apply_compile(model: Transformer) -> Transformer:
    """Compile each decoder block (after activation checkpointing wraps it, before FSDP shards it), in
    place: `Module.compile` keeps the module and its parameter names, and since dynamo treats a
    block's parameters as inputs, the blocks of one architecture share one compiled graph (one
    compilation for forward, one for backward). Compiling block by block rather than the whole model
    keeps FSDP's per-block hooks outside the graphs and the compile time of one block. Inductor's caches go
    to keel's per-ISA directory (keel.paths.inductor_cache_dir) unless TORCHINDUCTOR_CACHE_DIR is set."""
    use_inductor_cache_dir()
    for layer in model.layers.values():
        layer.compile()
    return model


# ----------------------------------------------------------------------------- FSDP2


def apply_fsdp(
    model: Transformer,
    dp_mesh: DeviceMesh,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype = torch.float32,
    reshard_after_forward: bool = True,
    expert_mesh: DeviceMesh | None = None,
) -> Transformer:
    """FSDP2 (ZeRO-3) per decoder block, then the root (embedding, norm, head), in place.

    A 2-D `dp_mesh` (dp_replicate, dp_shard) gives HSDP. With `param_dtype` bf16/fp16 the sharded
    (master) parameters and optimizer states stay in their own dtype (fp32) and only the gathered
    compute copies are cast; gradients are reduced in `reduce_dtype`.
    """
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for layer in model.layers.values():
        if expert_mesh is not None and isinstance(layer.mlp, MoE):
            # Expert-parallel experts (DTensors on "ep") get their own FSDP group over the other
            # data-parallel ranks (apply_ep scales their gradients by 1/ep, see there).
            fully_shard(layer.mlp.experts, mesh=expert_mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
        fully_shard(layer, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    # The embedding and the head are units of their own (as torchtitan has them): each is gathered, and
    # its gradients reduce-scattered, while it computes, rather than the two together from the start of
    # forward to the end of backward (at a large vocabulary they are the largest tensors of the model).
    # A tied pair shares one parameter, so it stays one unit: the root's.
    if not model.config.tie_word_embeddings:
        if model.embed_tokens is not None:
            fully_shard(model.embed_tokens, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
        if model.lm_head is not None:
            # The first needed in backward: kept gathered after forward. The final norm goes with it.
            head = [model.norm, model.lm_head] if model.norm is not None else [model.lm_head]
            fully_shard(head, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=False)
    # The root's parameters (a tied embedding and head, the norm) are the first needed in backward.
    fully_shard(model, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=False)
    return model


# ----------------------------------------------------------------------------- composition


def parallelize(
    model: Transformer,
    mesh: DeviceMesh,
    *,
    sequence_parallel: bool = True,
    ac_mode: ACMode = "none",
    ac_every: int = 1,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype = torch.float32,
    reshard_after_forward: bool = True,
    loss_parallel: bool = False,
    compile_blocks: bool = False,
) -> Transformer:
    """TP (when tp > 1), activation checkpointing, torch.compile per block, then FSDP/HSDP (when dp > 1),
    in that order (torchtitan's), in place.

    `model` is the whole model or one pipeline stage module (see keel.train.pipeline). With
    loss_parallel under a pipeline (pp > 1) the last stage returns its vocabulary slice of the logits:
    pass keel.train.vocab_parallel's `vocab_parallel_loss` to build_pipeline as its loss function.
    """
    if mesh["tp"].size() > 1:
        apply_tp(model, mesh["tp"], sequence_parallel, loss_parallel, local_logits=mesh["pp"].size() > 1)
    ep = ep_size(mesh)
    if ep > 1:
        apply_ep(model, mesh["ep"])
    apply_activation_checkpointing(model, ac_mode, ac_every)
    if compile_blocks:
        apply_compile(model)
    if loss_mesh(mesh).size() > 1:
        apply_fsdp(
            model,
            dp_mesh(mesh),
            param_dtype,
            reduce_dtype,
            reshard_after_forward,
            expert_mesh=expert_dp_mesh(mesh) if ep > 1 else None,
        )
    return model


# ----------------------------------------------------------------------------- expert parallel


def apply_ep(model: Transformer, ep_mesh: DeviceMesh) -> Transformer:
    """Split every MoE block's experts over `ep_mesh` (contiguous ranges, Shard(0) DTensors, so
    checkpoints reshard to any other ep) and route their tokens with all-to-all, in place."""
    from keel.model.expert_parallel import AllToAllDispatcher

    for module in model.modules():
        if isinstance(module, MoE):
            experts = module.experts
            for name in ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias"):
                full = getattr(experts, name)
                if full is None:  # biases: GPT-OSS's experts only
                    continue
                setattr(experts, name, nn.Parameter(distribute_tensor(full.data, ep_mesh, [Shard(0)])))
            module.dispatcher = AllToAllDispatcher(ep_mesh.get_group(), module.num_experts)
            # An expert's gradient sums the tokens of all ep ranks (the all-to-all's backward), while
            # FSDP averages it only over the expert's own dp group: 1/ep makes it the mean over all
            # data-parallel ranks, as for dense weights. (FSDP's set_gradient_divide_factor would do
            # this with a PREMUL_SUM reduction, which gloo lacks.)
            experts.grad_scale = 1.0 / ep_mesh.size()
    return model
