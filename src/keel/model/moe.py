"""Mixture-of-experts block: router, grouped experts, optional shared expert; balancing hooks for training.

Experts are stored stacked ([E, ...] parameters) so that expert parallelism can shard them on the
first dimension, and computed grouped: token-slots are sorted by expert and all experts run in one
grouped matmul per projection (`keel.model.grouped`), with no loop over experts.

Routers (`Router`):
- softmax (Mixtral, Qwen-MoE): softmax over the E logits, top-k, optionally renormalised; with a selection
  bias (ERNIE 4.5 MoE: `e_score_correction_bias`, as below) the router runs in float32 and chooses by the
  biased probabilities, weighting by the unbiased ones;
- topk_softmax (GPT-OSS, Granite MoE): top-k of the logits, then a softmax over those k (the same weights as
  softmax with renormalisation, computed in the model's dtype as transformers does); GPT-OSS's router has a
  bias of its linear layer (`router_linear_bias`), which moves the logits;
- sigmoid (DeepSeek-V3): per-expert sigmoid scores; a bias (`e_score_correction_bias`) is added
  for *selecting* experts only (aux-loss-free balancing moves it, see `update_routing_bias`);
  group-limited selection (the experts form n_group groups, a token may use the topk_group groups
  with the best sum of their top-2 scores); weights are the unbiased scores of the chosen experts,
  optionally renormalised, times routed_scaling_factor;
  Kolibri's adds the bias to the logits instead (`router_bias_on_logits`), its weights the same sigmoids;
- softmax in float32 with groups scored by their best expert (DeepSeek-V2's group_limited_greedy,
  `router_float32`, `router_group_score` max), weights times routed_scaling_factor.
Llama 4 routes each token to one expert by its best logit (topk_sigmoid: in the model's dtype), and that logit's
sigmoid scales the expert's input instead of its output (`router_scales_input`); Cohere 2 MoE's sigmoid router is
topk_sigmoid over k experts, their weights renormalised where norm_topk_prob. The shared expert's output is added
to the routed experts' (`shared_expert_combination` sum) or averaged with it (average: Cohere 2 MoE).
Phi-3.5-MoE's SparseMixer (sparsemixer) takes the best logit's expert, then the best of the others, each weighted by a
softmax over the logits close to its own (`sparsemixer`), in the model's dtype. transformers samples the experts
(Gumbel) and estimates the routing gradient its own way in training; keel's training forward routes as it serves,
its gradient that of the chosen experts' softmax weights.

Training (all off by default, set by the trainer from its [moe] config):
- capacity_factor: each expert takes at most ceil(cf * T * k / E) token-slots of a forward; the
  overflow is dropped in token order (first come, first served, as Switch/GShard): a dropped slot
  adds nothing and the token keeps its residual (and its other experts). None: dropless.
- aux_loss_coef: the Switch/Mixtral load-balancing loss E * sum_e f_e * P_e (f_e: fraction of
  token-slots sent to e, P_e: mean routing probability of e; 1.0 when balanced).
- z_loss_coef: the router z-loss mean(logsumexp(logits)^2) (ST-MoE).
The auxiliary losses enter through the block's output (`_AddAuxLoss`): their gradient is injected
in backward where the block runs, so they work under pipeline parallelism, where the last stage's
loss function never sees the other stages' routers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from keel.config import ModelConfig
from keel.model.grouped import grouped_matmul
from keel.model.layers import SwiGLU, activation, block_norm, l2_norm


@dataclass
class Routing:
    ids: Tensor  # [T, k] chosen experts
    weights: Tensor  # [T, k] float32 combine weights
    logits: Tensor  # [T, E] float32 router logits (z-loss)
    probs: Tensor  # [T, E] float32 per-token routing distribution (load-balancing loss)


class Router(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_tok
        self.scoring = config.router_scoring
        self.renormalize = config.norm_topk_prob
        self.n_group = config.n_group
        self.topk_group = config.topk_group
        self.group_score = config.router_group_score
        self.group_fill = 0.0 if config.router_group_mask_zero else float("-inf")  # A.X-K2's 0
        self.float32 = config.router_float32
        self.scaling = config.routed_scaling_factor
        self.jitter_eps = config.router_jitter_eps
        self.bias_on_logits = config.router_bias_on_logits
        self.logit_cap = config.router_logit_softcapping  # Laguna: the logits capped before their sigmoid
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))
        # Gemma 4: the input normed (no weight), times a learned scale per channel and hidden_size^-1/2; each chosen
        # expert's weight times its learned scale.
        self.eps, self.input_multiplier = config.rms_norm_eps, config.hidden_size**-0.5
        self.input_scale = nn.Parameter(torch.empty(config.hidden_size)) if config.router_input_norm else None
        self.expert_scale = nn.Parameter(torch.empty(config.num_experts)) if config.router_expert_scale else None
        # GPT-OSS: a bias of the router's linear layer, which moves the logits (not DeepSeek's selection bias).
        self.bias = nn.Parameter(torch.empty(config.num_experts)) if config.router_linear_bias else None
        self.e_score_correction_bias: Tensor | None
        if config.router_bias:
            # A buffer, not a parameter: moved by the load-balancing rule, never by gradients; saved in checkpoints.
            self.register_buffer("e_score_correction_bias", torch.zeros(config.num_experts, dtype=torch.float32))
        else:
            self.e_score_correction_bias = None

    def forward(self, x: Tensor) -> Routing:
        """x [T, H] -> Routing."""
        if self.input_scale is not None:  # Gemma 4's order: the norm rounded to x's dtype, then the two scales
            x = l2_norm(x, self.eps) * self.input_scale * self.input_multiplier
        routing = self._route(x)
        if self.expert_scale is not None:
            routing.weights = routing.weights * self.expert_scale[routing.ids].float()
        return routing

    def _route(self, x: Tensor) -> Routing:
        if self.scoring == "topk_softmax":
            # GPT-OSS: the top k of the logits in the model's dtype, then a softmax over those k in that dtype, as
            # transformers computes it (ties of low-precision logits decide as its top-k decides them).
            raw = F.linear(x, self.weight, self.bias)
            top, ids = torch.topk(raw, self.top_k, dim=-1)
            logits = raw.float()
            weights = torch.softmax(top, dim=-1, dtype=top.dtype).float()
            if self.scaling != 1.0:
                weights = weights * self.scaling
            return Routing(ids=ids, weights=weights, logits=logits, probs=torch.softmax(logits, dim=-1))
        if self.scoring == "topk_sigmoid":
            # Llama 4: the top k of the logits in the model's dtype, then their sigmoid in float32 rounded to that
            # dtype, as transformers computes it (near ties of low-precision logits decide as its top-k does).
            raw = F.linear(x, self.weight)
            top, ids = torch.topk(raw, self.top_k, dim=-1)
            logits = raw.float()
            weights = torch.sigmoid(top.float()).to(top.dtype).float()
            if self.renormalize:  # Cohere 2 MoE's sigmoid router (Llama 4's takes one expert, as it is)
                weights = weights / weights.sum(dim=-1, keepdim=True)
            scores = torch.sigmoid(logits)
            return Routing(ids=ids, weights=weights, logits=logits, probs=scores / scores.sum(dim=-1, keepdim=True))
        if self.scoring == "sparsemixer":
            raw = F.linear(x, self.weight, self.bias)
            weights, ids = sparsemixer(raw, self.top_k, self.jitter_eps)
            logits = raw.float()
            return Routing(ids=ids, weights=weights.float(), logits=logits, probs=torch.softmax(logits, dim=-1))
        if self.scoring == "softmax" and (self.float32 or self.e_score_correction_bias is not None):
            # DeepSeek-V2; ERNIE 4.5 (a biased choice): the router in float32
            logits = F.linear(x.float(), self.weight.float())
            scores = probs = torch.softmax(logits, dim=-1)
        elif self.scoring == "softmax":
            logits = F.linear(x, self.weight, self.bias).float()  # Mixtral/Qwen: the matmul in the model's dtype
            scores = torch.softmax(logits, dim=-1)
            probs = scores
        else:
            logits = F.linear(x.float(), self.weight.float())  # DeepSeek-V3: the router in float32
            if self.logit_cap is not None:
                logits = torch.tanh(logits / self.logit_cap) * self.logit_cap
            scores = torch.sigmoid(logits)
            probs = scores / scores.sum(dim=-1, keepdim=True)
        choice = scores
        if self.e_score_correction_bias is not None:  # Kolibri's bias goes on the logits, DeepSeek-V3's on the scores
            choice = (logits if self.bias_on_logits else scores) + self.e_score_correction_bias
        if self.n_group > 1:
            choice = self._limit_groups(choice)
        ids = torch.topk(choice, self.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        if self.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        if self.scaling != 1.0:
            weights = weights * self.scaling
        return Routing(ids=ids, weights=weights, logits=logits, probs=probs)

    def _limit_groups(self, choice: Tensor) -> Tensor:
        """Mask (-inf, or A.X-K2's 0) the experts outside each token's topk_group best groups (group score: the sum
        of its top-2 expert scores, or its best one's)."""
        t = choice.shape[0]
        grouped = choice.view(t, self.n_group, -1)
        if self.group_score == "max":
            group_scores = grouped.amax(dim=-1)
        else:
            group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)
        best = torch.topk(group_scores, self.topk_group, dim=-1).indices
        allowed = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        return grouped.masked_fill(~allowed.unsqueeze(-1), self.group_fill).view(t, -1)


def sparsemixer(logits: Tensor, top_k: int, jitter_eps: float) -> tuple[Tensor, Tensor]:
    """Phi-3.5-MoE's SparseMixer as transformers runs it in eval mode: (weights [T, k] in the logits' dtype, ids [T,
    k]). Each round takes the best logit among the experts not yet chosen; its weight is its softmax over those
    experts, less any whose logit is more than 2 x jitter_eps below it relative to |logit| (at least the best one):
    an expert far behind takes no share of it. transformers' form is for two rounds (config.validate holds k to 2)."""
    weights, ids = [], []
    remaining = logits
    for _ in range(top_k):
        best, index = remaining.max(dim=-1, keepdim=True)
        with torch.no_grad():  # as transformers: a mask, not a path for gradients
            far = (best - logits) / logits.abs().clamp(min=best) > 2 * jitter_eps
        probs = torch.softmax(remaining.masked_fill(far, float("-inf")), dim=-1)
        weights.append(probs.gather(-1, index))
        ids.append(index)
        remaining = remaining.scatter(-1, index, float("-inf"))
    return torch.cat(weights, dim=-1), torch.cat(ids, dim=-1)


@dataclass(frozen=True)
class ExpertActivation:
    """The experts' activation of their first projection's output (gate rows, then up rows): act(gate) * up with the
    model's `hidden_act` (silu for Mixtral and most; `kind` names it); or swiglu_clamped (GPT-OSS's
    ModelConfig.expert_activation), gate clamped above and up on both sides at `limit`, then
    gate * sigmoid(alpha * gate) * (up + 1); or, not `gated` (ModelConfig.mlp_gated False: Nemotron-H), act(up) of
    the up rows alone."""

    kind: str = "silu"
    alpha: float = 1.702
    limit: float = 7.0
    gated: bool = True

    @classmethod
    def of(cls, config: ModelConfig) -> ExpertActivation:
        kind = config.hidden_act if config.expert_activation == "silu" else config.expert_activation
        return cls(kind, config.swiglu_alpha, config.swiglu_limit, config.mlp_gated)

    def __call__(self, hidden: Tensor) -> Tensor:
        if not self.gated:
            return activation(self.kind)(hidden)
        gate, up = hidden.chunk(2, dim=-1)
        if self.kind == "silu":
            return F.silu(gate) * up
        if self.kind != "swiglu_clamped":
            return activation(self.kind)(gate) * up
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return gate * torch.sigmoid(gate * self.alpha) * (up + 1)


def row_experts(offsets: Tensor, rows: int) -> Tensor:
    """The (local) expert of each of `rows` rows sorted by expert, from the int32 cumulative counts `offsets`
    (rows past the last offset, never read, get the last expert). No host sync: a search, not a repeat."""
    index = torch.arange(rows, device=offsets.device, dtype=offsets.dtype)
    return torch.searchsorted(offsets, index, right=True).clamp_(max=offsets.numel() - 1)


class GroupedExperts(nn.Module):
    """E gated experts with stacked weights: gate_up_proj [E, 2I, H], down_proj [E, H, I] (HF layout), and
    with `bias` (GPT-OSS) gate_up_proj_bias [E, 2I], down_proj_bias [E, H]; ungated experts (the activation's
    `gated` False) hold the up rows alone in gate_up_proj [E, I, H] (and its bias [E, I]). Under expert parallelism a
    rank holds a contiguous slice of the experts."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        bias: bool = False,
        activation: ExpertActivation | None = None,
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.activation = activation or ExpertActivation()
        rows = (2 if self.activation.gated else 1) * intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, rows, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, rows)) if bias else None
        self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden_size)) if bias else None
        # Tensor parallelism without expert parallelism: each rank holds every expert cut by width, their partial
        # outputs are summed, so only one rank adds down's bias (keel.serve.parallel.tensor).
        self.adds_down_bias = True
        self.grad_scale = 1.0  # expert parallelism: a factor on the weights' gradients (see apply_ep)

    def _weights(self) -> list[Tensor | None]:
        """This rank's gate_up, down and their biases, with expert parallelism's gradient factor hooked on."""
        weights = [_local(w) if w is not None else None for w in self._stacked()]
        if self.grad_scale == 1.0 or not torch.is_grad_enabled():
            return weights
        scale = self.grad_scale
        hooked = []
        for w in weights:
            if w is not None:
                # A fresh autograd node to hook: the parameter's own grad accumulation must not see the hook twice.
                w = w.view_as(w)
                w.register_hook(lambda g: g * scale)
            hooked.append(w)
        return hooked

    def _stacked(self) -> tuple[Tensor | None, ...]:
        return self.gate_up_proj, self.down_proj, self.gate_up_proj_bias, self.down_proj_bias

    def forward(self, x: Tensor, offsets: Tensor) -> Tensor:
        """x [N, H] rows sorted by (local) expert; offsets [E_local] int32 cumulative counts -> [N, H]."""
        gate_up, down, gate_up_bias, down_bias = self._weights()
        hidden = grouped_matmul(x, gate_up.transpose(1, 2), offsets)
        experts = None if gate_up_bias is None else row_experts(offsets, x.shape[0])
        if gate_up_bias is not None:
            hidden = hidden + gate_up_bias.index_select(0, experts).to(hidden.dtype)
        out = grouped_matmul(self.activation(hidden), down.transpose(1, 2), offsets)
        if down_bias is not None and self.adds_down_bias:
            out = out + down_bias.index_select(0, experts).to(out.dtype)
        return out


def _local(weight: Tensor) -> Tensor:
    # Under expert parallelism the stacked weights are DTensors sharded on experts: this rank's slice.
    # (Asked by attribute: importing torch.distributed.tensor would add to every process's start-up;
    # docs/BENCHMARKS.md, "Mixture of experts".)
    to_local = getattr(weight, "to_local", None)
    return to_local() if to_local is not None else weight


def expert_counts(expert_ids: Tensor, num_experts: int) -> Tensor:
    """Rows per expert, int64 [num_experts]. On CUDA `bincount` sizes its output from the ids' maximum, read
    back to the host: a sync in every MoE layer of every step, which an asynchronously scheduled step
    cannot afford; comparing each id with every expert's reads nothing back."""
    if expert_ids.device.type == "cpu":
        return torch.bincount(expert_ids, minlength=num_experts)
    return counts_by_comparison(expert_ids, num_experts)


def counts_by_comparison(expert_ids: Tensor, num_experts: int) -> Tensor:
    """`expert_counts` off the CPU (also tested on it): ids against 0..num_experts-1, summed per expert."""
    experts = torch.arange(num_experts, device=expert_ids.device)
    return (expert_ids[:, None] == experts).sum(dim=0)


def group_by_expert(expert_ids: Tensor, num_experts: int) -> tuple[Tensor, Tensor]:
    """(order, offsets): the permutation that groups rows by expert (stable: each expert's rows keep
    their order) and the int32 cumulative row counts per expert that `grouped_matmul` takes."""
    order = torch.argsort(expert_ids, stable=True)
    offsets = expert_counts(expert_ids, num_experts).cumsum(0).to(torch.int32)
    return order, offsets


class LocalDispatcher:
    """All experts on this rank: sort the token-slots by expert, one grouped compute, weighted sum back."""

    def __call__(self, experts: GroupedExperts, x: Tensor, expert_ids: Tensor, slot_tokens: Tensor) -> Tensor:
        """x [T, H]; expert_ids, slot_tokens [S] (the expert and the token of each kept slot) ->
        expert outputs [S, H] in slot order."""
        order, offsets = group_by_expert(expert_ids, experts.num_experts)
        out_sorted = experts(x.index_select(0, slot_tokens.index_select(0, order)), offsets)
        return torch.empty_like(out_sorted).index_copy_(0, order, out_sorted)


class _AddAuxLoss(torch.autograd.Function):
    """Identity on `out`; in backward, gives `aux` the gradient `scale` (dL/d aux of L = main + scale * aux)."""

    @staticmethod
    def forward(ctx, out: Tensor, aux: Tensor, scale: float) -> Tensor:  # type: ignore[override]
        ctx.scale = scale
        ctx.aux_meta = (aux.shape, aux.dtype, aux.device)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor, None]:  # type: ignore[override]
        shape, dtype, device = ctx.aux_meta
        return grad, torch.full(shape, ctx.scale, dtype=dtype, device=device), None


class MoE(nn.Module):
    """Routed experts plus an optional shared expert: sigmoid-gated (Qwen2-MoE) or plain (DeepSeek)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h = config.hidden_size
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_tok
        self.router = Router(config)
        self.experts = GroupedExperts(
            config.num_experts, h, config.moe_intermediate_size, config.expert_bias, ExpertActivation.of(config)
        )
        self.shared_expert: SwiGLU | None = None
        self.shared_expert_gate: nn.Linear | None = None
        if config.shared_expert_intermediate_size:
            self.shared_expert = SwiGLU(
                h, config.shared_expert_intermediate_size, config.mlp_bias, config.hidden_act, config.mlp_gated
            )
            if config.shared_expert_gated:
                self.shared_expert_gate = nn.Linear(h, 1, bias=False)
        # Gemma 4: a norm before and after the shared expert (its dense MLP) and the routed experts each; the block
        # then reads the layer's un-normed residual, as its router does.
        branch_norm = (lambda: block_norm(config, h)) if config.moe_branch_norms else (lambda: None)
        self.shared_input_norm, self.shared_output_norm = branch_norm(), branch_norm()
        self.expert_input_norm, self.expert_output_norm = branch_norm(), branch_norm()
        # A.X-K1: a norm of the block's whole output (routed plus shared experts)
        self.output_norm = block_norm(config, h) if config.moe_output_norm else None
        # JetMoE: one bias on the summed expert outputs
        self.output_bias = nn.Parameter(torch.empty(h)) if config.moe_output_bias else None
        self.dispatcher = LocalDispatcher()  # expert parallelism swaps in an all-to-all dispatcher
        self.scales_input = config.router_scales_input  # Llama 4: the weight scales the expert's input
        self.averages_shared = config.shared_expert_combination == "average"  # Cohere 2 MoE: (routed + shared) / 2
        # Training knobs (see the module docstring); the trainer sets them.
        self.capacity_factor: float | None = None
        self.aux_loss_coef = 0.0
        self.z_loss_coef = 0.0
        self.aux_grad_scale = 1.0  # the factor the main loss gets (1/accumulation, fp16 loss scale)
        # Statistics since the last reset_stats(): token-slots routed per expert, and dropped.
        self.track_stats = False
        self.routed: Tensor | None = None
        self.dropped: Tensor | None = None
        self.aux_losses: dict[str, Tensor] = {}  # the last forward's loss values (detached)

    def reset_stats(self) -> None:
        self.routed = self.dropped = None
        self.aux_losses = {}

    def capacity(self, num_tokens: int) -> int | None:
        if not (self.training and self.capacity_factor):
            return None
        return math.ceil(self.capacity_factor * num_tokens * self.top_k / self.num_experts)

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        t = flat.shape[0]
        routing = self.router(flat)
        expert_ids = routing.ids.reshape(-1)
        slot_weights = routing.weights.reshape(-1)
        slot_tokens = torch.arange(t, device=flat.device).repeat_interleave(self.top_k)
        counts = expert_counts(expert_ids, self.num_experts)
        limit = self.capacity(t)
        kept = None
        if limit is not None:
            kept = _within_capacity(expert_ids, counts, limit)
            expert_ids, slot_weights, slot_tokens = expert_ids[kept], slot_weights[kept], slot_tokens[kept]
        expert_in = flat if self.expert_input_norm is None else self.expert_input_norm(flat)
        if self.scales_input:  # Llama 4 (one expert a token): the expert takes its input scaled by the weight
            routed = (expert_in * routing.weights.to(flat.dtype)).to(flat.dtype)
            outputs = self.dispatcher(self.experts, routed, expert_ids, slot_tokens)
            weighted = outputs.to(flat.dtype)
        else:
            outputs = self.dispatcher(self.experts, expert_in, expert_ids, slot_tokens)
            weighted = (outputs * slot_weights.unsqueeze(-1)).to(flat.dtype)
        out = torch.zeros_like(flat).index_add_(0, slot_tokens, weighted)
        if self.expert_output_norm is not None:
            out = self.expert_output_norm(out)
        if self.track_stats and self.training:  # training steps only: not validation forwards
            self._record(counts, 0 if kept is None else kept.numel() - int(kept.sum()))
        if self.training and torch.is_grad_enabled() and (self.aux_loss_coef or self.z_loss_coef):
            out = _AddAuxLoss.apply(out, self._aux_loss(routing, counts, t), self.aux_grad_scale)
        if self.shared_expert is not None:
            shared = self.shared_expert(flat if self.shared_input_norm is None else self.shared_input_norm(flat))
            if self.shared_output_norm is not None:
                shared = self.shared_output_norm(shared)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(flat)) * shared
            out = out + shared
            if self.averages_shared:  # linear: tensor parallelism's sum of the ranks' partial outputs is unchanged
                out = out * 0.5
        if self.output_norm is not None:
            out = self.output_norm(out)
        if self.output_bias is not None:
            out = out + self.output_bias
        return out.view(shape)

    def _aux_loss(self, routing: Routing, counts: Tensor, num_tokens: int) -> Tensor:
        total = routing.logits.new_zeros(())
        if self.aux_loss_coef:
            fraction = counts.float() / (num_tokens * self.top_k)
            balance = self.num_experts * (fraction * routing.probs.mean(dim=0)).sum()
            self.aux_losses["load_balance"] = balance.detach()
            total = total + self.aux_loss_coef * balance
        if self.z_loss_coef:
            z = torch.logsumexp(routing.logits, dim=-1).pow(2).mean()
            self.aux_losses["router_z"] = z.detach()
            total = total + self.z_loss_coef * z
        return total

    @torch.no_grad()
    def _record(self, counts: Tensor, dropped: int) -> None:
        counts = counts.to(torch.float64)
        self.routed = counts if self.routed is None else self.routed + counts
        d = torch.tensor(float(dropped), dtype=torch.float64, device=counts.device)
        self.dropped = d if self.dropped is None else self.dropped + d


def _within_capacity(expert_ids: Tensor, counts: Tensor, limit: int) -> Tensor:
    """Mask [S] of the slots each expert keeps: its first `limit` slots in token order."""
    order = torch.argsort(expert_ids, stable=True)  # by expert, then by slot (= token) order
    starts = counts.cumsum(0) - counts
    rank_sorted = torch.arange(expert_ids.numel(), device=expert_ids.device) - starts.repeat_interleave(counts)
    rank = torch.empty_like(rank_sorted).index_copy_(0, order, rank_sorted)
    return rank < limit


@torch.no_grad()
def update_routing_bias(router: Router, load: Tensor, rate: float) -> None:
    """Aux-loss-free balancing (DeepSeek-V3): raise the selection bias of under-loaded experts and
    lower it for over-loaded ones by `rate` (sign of the deviation from the mean load)."""
    if router.e_score_correction_bias is None or rate == 0:
        return
    load = load.to(router.e_score_correction_bias)
    router.e_score_correction_bias.add_(torch.sign(load.mean() - load) * rate)
