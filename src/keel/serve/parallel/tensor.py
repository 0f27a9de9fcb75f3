"""Tensor parallelism for the serving model: `shard_model` cuts a loaded keel Transformer down to one
rank's slices (keel.weights.shard) and swaps in the three modules that communicate.

- Column-parallel layers (q/k/v, gate/up) keep their class: only their rows change, and attention
  already views q/k/v with -1 heads, so each rank attends over its own heads.
- `RowParallelLinear` (o_proj, down_proj): a partial product, all-reduced, then the bias once.
- `VocabParallelEmbedding`: each rank looks up the ids in its vocabulary range, zeros the rest, and
  the all-reduce assembles the rows.
- `GatheredLMHead`: each rank's vocabulary slice of the logits, all-gathered (logits are needed
  whole only for sampling).

Collectives go through torch.distributed on the given process group (gloo on CPU, NCCL on GPU).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from keel.model.moe import LocalDispatcher, MoE
from keel.model.transformer import Transformer
from keel.weights.shard import Shard, TensorParallelLayout, narrow


def _cut(tensor: Tensor, shard: Shard | None) -> Tensor:
    if shard is None:
        return tensor.detach().clone()
    return narrow(tensor.detach(), shard)


class RowParallelLinear(nn.Module):
    def __init__(self, weight: Tensor, bias: Tensor | None, group: dist.ProcessGroup | None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.group = group
        self.quantized: nn.Module | None = None  # the weight as a QuantizedLinear (quantize_shard)

    def forward(self, x: Tensor) -> Tensor:
        partial = self.quantized(x) if self.quantized is not None else F.linear(x, self.weight)
        y = sum_partials(partial, self.group)
        return y if self.bias is None else y + self.bias


def sum_partials(y: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """All-reduce the ranks' partial results; half-precision partials are summed in float32, so each is
    rounded once, not again at every addition of the reduce."""
    if y.dtype in (torch.bfloat16, torch.float16):
        total = y.float()
        dist.all_reduce(total, group=group)
        return total.to(y.dtype)
    dist.all_reduce(y, group=group)
    return y


def _reduce_block_output(group: dist.ProcessGroup | None):
    """A forward hook: a MoE block's output (its experts cut along their width) summed over the ranks."""

    def hook(module: nn.Module, inputs: tuple, output: Tensor) -> Tensor:
        return sum_partials(output.contiguous(), group)

    return hook


class VocabParallelEmbedding(nn.Module):
    def __init__(self, weight: Tensor, start: int, group: dist.ProcessGroup | None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.start = start
        self.group = group

    def forward(self, ids: Tensor) -> Tensor:
        local = ids - self.start
        inside = (local >= 0) & (local < self.weight.shape[0])
        out = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight) * inside.unsqueeze(-1)
        dist.all_reduce(out, group=self.group)
        return out


class GatheredLMHead(nn.Module):
    def __init__(
        self,
        weight: Tensor,
        vocab_size: int,
        rows_per_rank: int,
        group: dist.ProcessGroup | None,
        bias: Tensor | None = None,
    ) -> None:
        super().__init__()
        # A tied head shares the embedding's Parameter object itself (one tensor, counted once).
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)  # Phi's: this rank's rows
        self.vocab_size = vocab_size
        self.rows_per_rank = rows_per_rank  # all_gather needs equal pieces: the last rank's is padded
        self.group = group

    def forward(self, x: Tensor) -> Tensor:
        local = F.linear(x, self.weight, self.bias)
        pad = self.rows_per_rank - local.shape[-1]
        if pad:
            local = F.pad(local, (0, pad))
        pieces = [torch.empty_like(local) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(pieces, local.contiguous(), group=self.group)
        return torch.cat(pieces, dim=-1)[..., : self.vocab_size]


class ExpertSliceDispatcher:
    """Expert parallelism inside the tensor-parallel group: this rank holds experts [first, first + count)
    and computes only the token-slots routed to them (the others' outputs are zero here); the MoE block's
    all-reduce adds every rank's share. No all-to-all: every rank already has every token's hidden state."""

    def __init__(self, first: int, count: int) -> None:
        self.first, self.count = first, count
        self.local = LocalDispatcher()

    def __call__(self, experts: nn.Module, x: Tensor, expert_ids: Tensor, slot_tokens: Tensor) -> Tensor:
        mine = ((expert_ids >= self.first) & (expert_ids < self.first + self.count)).nonzero().squeeze(1)
        out = x.new_zeros(expert_ids.shape[0], x.shape[1])
        if mine.numel():
            local = self.local(
                experts, x, expert_ids.index_select(0, mine) - self.first, slot_tokens.index_select(0, mine)
            )
            out.index_copy_(0, mine, local.to(out.dtype))
        return out


class PartialSumLinear(nn.Module):
    """A row-parallel linear whose partial outputs another module sums (a shared expert's down projection, summed
    by the MoE block's one all-reduce): rank 0 alone adds the bias, so that it is counted once."""

    def __init__(self, weight: Tensor, bias: Tensor, adds_bias: bool) -> None:
        super().__init__()
        self.weight, self.bias, self.adds_bias = weight, bias, adds_bias
        self.out_features, self.in_features = weight.shape

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight, self.bias if self.adds_bias else None)


@torch.no_grad()
def shard_model(model: Transformer, layout: TensorParallelLayout, group: dist.ProcessGroup | None = None) -> None:
    """Cut `model` (a full dense keel Transformer, not yet fused) down to `layout`'s rank, in place."""
    config = model.config
    tied = config.tie_word_embeddings and model.lm_head is not None and model.embed_tokens is not None
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear) or name == "lm_head":
            continue
        weight_shard = layout.shard_of(f"{name}.weight")
        if weight_shard is None:
            continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        bias = module.bias
        # Row-parallel: the bias is added once, after the all-reduce. A shared expert's down projection
        # is summed with the routed experts' output instead, by the MoE block's single all-reduce.
        if weight_shard.dim == 1 and ".shared_expert." not in name:
            row = RowParallelLinear(
                _cut(module.weight, weight_shard), None if bias is None else _cut(bias, None), group
            )
            setattr(parent, child, row)
        else:
            module.weight = nn.Parameter(_cut(module.weight, weight_shard), requires_grad=False)
            if bias is not None:
                module.bias = nn.Parameter(_cut(bias, layout.shard_of(f"{name}.bias")), requires_grad=False)
            if weight_shard.dim == 1 and bias is not None:  # a shared expert's down projection, with a bias
                setattr(parent, child, PartialSumLinear(module.weight, module.bias, adds_bias=layout.rank == 0))
            module.out_features, module.in_features = module.weight.shape
    for name, module in model.named_modules():
        if isinstance(module, MoE):
            experts = module.experts
            for param in ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias"):
                if getattr(experts, param) is None:
                    continue
                cut = _cut(getattr(experts, param), layout.shard_of(f"{name}.experts.{param}"))
                setattr(experts, param, nn.Parameter(cut, requires_grad=False))
            # Ranks that hold every expert cut by width sum partial outputs: one of them adds down's bias.
            experts.adds_down_bias = layout.expert_parallel or layout.rank == 0
            if layout.expert_parallel:
                shard = layout.shard_of(f"{name}.experts.down_proj")
                experts.num_experts = shard.stop - shard.start
                module.dispatcher = ExpertSliceDispatcher(shard.start, experts.num_experts)
            module.register_forward_hook(_reduce_block_output(group))
    start, stop = layout.vocab_range()
    rows_per_rank = -(-config.vocab_size // layout.tp)
    if model.embed_tokens is not None:
        weight = _cut(model.embed_tokens.weight, layout.shard_of("embed_tokens.weight"))
        model.embed_tokens = VocabParallelEmbedding(weight, start, group)
    if model.lm_head is not None:
        weight = model.embed_tokens.weight if tied else _cut(model.lm_head.weight, layout.shard_of("lm_head.weight"))
        head_bias = model.lm_head.bias
        bias = None if head_bias is None else _cut(head_bias, layout.shard_of("lm_head.bias"))
        model.lm_head = GatheredLMHead(weight, config.vocab_size, rows_per_rank, group, bias)
    for index, layer in model.layers.items():  # for code that reads head counts (the cache is sized by them)
        attn = layer.self_attn
        if getattr(attn, "sinks", None) is not None:  # GPT-OSS: this rank's heads' sinks
            attn.sinks = nn.Parameter(_cut(attn.sinks, layout.shard_of(f"layers.{index}.self_attn.sinks")), False)
        if getattr(attn, "alibi", None) is not None:  # ALiBi: this rank's heads' slopes (the sinks' rows)
            attn.alibi = _cut(attn.alibi, layout.shard_of(f"layers.{index}.self_attn.sinks"))
        layer.self_attn.num_heads = layout.local_heads
        first, last = layout.kv_head_range()
        layer.self_attn.num_kv_heads = last - first


def quantize_shard(model: Transformer, scheme: str, group_size: int, keep: tuple[str, ...]) -> dict[str, int]:
    """Weight-only int8/int4 quantization of one rank's cut (keel.quant), after sharding: column-parallel
    layers and experts as in one process (a row's scales cover its whole input, so they are the same);
    row-parallel layers per rank (their scales cover the rank's slice of the input, so they differ from
    one process's, and an int4 group must fit in the slice). The vocabulary-parallel head and the
    embedding stay float. Returns keel.quant's statistics."""
    from keel.quant.apply import is_kept, linear_fits, quantize_model
    from keel.quant.linear import QuantizedLinear

    rows = 0
    for name, module in model.named_modules():
        if not isinstance(module, RowParallelLinear) or module.quantized is not None or is_kept(name, keep):
            continue
        out_features, in_features = module.weight.shape
        if not linear_fits(scheme, in_features, out_features, group_size):
            continue
        plain = nn.Linear(in_features, out_features, bias=False, device=module.weight.device, dtype=module.weight.dtype)
        plain.weight = module.weight
        module.quantized = QuantizedLinear(plain, scheme, group_size)
        module.weight = None
        rows += 1
    stats = quantize_model(model, scheme, group_size, set(keep))
    stats["quantized"] += rows
    return stats


def weight_bytes(model: nn.Module) -> int:
    """Bytes of a rank's weights: float parameters plus quantized layers' integer weights and scales."""
    from keel.quant.linear import QuantizedLinear  # quantized experts are made of these too

    total = sum(p.numel() * p.element_size() for p in model.parameters())
    return total + sum(m.weight_bytes for m in model.modules() if isinstance(m, QuantizedLinear))
