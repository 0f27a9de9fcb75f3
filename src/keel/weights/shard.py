"""Which slice of every dense-model parameter a tensor-parallel rank holds, as vLLM shards them.

- Column-parallel (output features split): q/k/v and the attention output gate (Qwen3.5's, AFMoE's, Laguna's: a row
  per channel, or per head) by attention heads, gate/up by the MLP width, the
  LM head and the embedding by vocabulary rows (vocab-parallel; the last rank may hold fewer rows
  when the vocabulary does not divide). Their biases follow their rows.
- Row-parallel (input features split): o_proj by heads, down_proj by the MLP width. Their biases
  are replicated (added once, after the all-reduce).
- Replicated: norms (including per-head q/k norms), anything unnamed here.

Multi-head latent attention (DeepSeek): q_proj / q_b_proj and kv_b_proj by heads, o_proj's input by heads (of
v_head_dim), the latent projections (q_a_proj, kv_a_proj_with_mqa) and their norms replicated; every rank caches the
whole latent (it has no heads to split), as vLLM does.

KV heads: with at least as many KV heads as ranks, each rank holds num_kv_heads / tp of them. With
fewer (tp a multiple of num_kv_heads), each rank holds one KV head and every KV head is replicated
tp / num_kv_heads times, the head that rank's query heads attend to (vLLM's rule). Softmax sinks (GPT-OSS)
follow their query heads.

MoE layers (vLLM's default for experts under TP): every rank holds every expert, cut along the
expert width: gate_up_proj [E, 2I, H] keeps rows [a, b) of its gate half and of its up half, down_proj
[E, H, I] columns [a, b); a shared expert is cut like a dense MLP. Expert biases (GPT-OSS): gate_up's follow
its rows, down's are replicated and added by one rank only (`GroupedExperts.adds_down_bias`). The router is
replicated, and the block's output (routed plus shared) is all-reduced once. With `expert_parallel`, each rank holds
E / tp whole experts instead (every rank sees every token, so it computes its experts' slots and the
same all-reduce adds the ranks' shares).

A `Shard` names a dimension and a [start, stop) range (in each of `parts` equal parts of that
dimension); `read_shard` reads only that range from a safetensors file (never the whole tensor).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from keel.config import ModelConfig
from keel.errors import KeelError

_COLUMN = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
_ROW = ("self_attn.o_proj", "mlp.down_proj")
_LAYER = re.compile(r"^layers\.\d+\.(.+)\.(weight|bias|gate_up_proj|down_proj|gate_up_proj_bias|down_proj_bias|sinks)$")


@dataclass(frozen=True)
class Shard:
    dim: int
    start: int
    stop: int
    parts: int = 1  # the dimension is `parts` equal blocks (gate and up), each cut to [start, stop)

    @property
    def size(self) -> int:
        return self.parts * (self.stop - self.start)

    def ranges(self, full: int) -> list[tuple[int, int]]:
        """[start, stop) ranges of the full dimension (of size `full`) this shard keeps."""
        part = full // self.parts
        return [(i * part + self.start, i * part + self.stop) for i in range(self.parts)]


def narrow(tensor, shard: Shard | None):
    """The shard of a whole tensor (a copy when cut)."""
    if shard is None:
        return tensor
    full = tensor.shape[shard.dim]
    pieces = [tensor.narrow(shard.dim, a, b - a) for a, b in shard.ranges(full)]
    return pieces[0].clone() if len(pieces) == 1 else torch.cat(pieces, dim=shard.dim)


@dataclass(frozen=True)
class TensorParallelLayout:
    config: ModelConfig
    tp: int
    rank: int
    # MoE experts split by expert across the tensor-parallel ranks (vLLM's --enable-expert-parallel)
    # instead of each cut along its width; attention and shared experts stay tensor-parallel.
    expert_parallel: bool = False

    def __post_init__(self) -> None:
        c, tp = self.config, self.tp
        if not 0 <= self.rank < tp:
            raise KeelError(f"tensor-parallel rank {self.rank} outside [0, {tp})")
        if not c.uniform_attention:
            raise KeelError(
                f"--tensor-parallel-size {tp}: full-attention layers of their own head width or KV heads "
                "(global_head_dim, global_num_kv_heads: Gemma 4) are not cut by tensor parallelism yet"
            )
        if c.kv_shared_layers:
            raise KeelError(
                f"--tensor-parallel-size {tp}: layers attending over another's K/V (kv_shared_layers: Gemma 4) are "
                "not cut by tensor parallelism yet"
            )
        if c.per_layer_input_size:
            raise KeelError(
                f"--tensor-parallel-size {tp}: per-layer inputs (per_layer_input_size: Gemma 4) are not cut by tensor "
                "parallelism yet"
            )
        if c.altup_num_inputs or c.laurel_rank:
            raise KeelError(
                f"--tensor-parallel-size {tp}: AltUp and LAuReL (altup_num_inputs, laurel_rank: Gemma 3n) are not cut "
                "by tensor parallelism yet"
            )
        if any(c.activation_sparsity):
            raise KeelError(
                f"--tensor-parallel-size {tp}: the MLP gate's activation sparsity (activation_sparsity: Gemma 3n)"
                " needs the mean and spread of the gate's whole width, which tensor parallelism splits over the ranks"
            )
        if c.moe_branch_norms:
            raise KeelError(
                f"--tensor-parallel-size {tp}: the MoE block's branch norms (Gemma 4) need a branch's whole output, "
                "which tensor parallelism splits over the ranks"
            )
        if c.attn_sub_norm or c.ffn_sub_norm:
            raise KeelError(
                f"--tensor-parallel-size {tp}: BitNet's sub-norms (attn_sub_norm, ffn_sub_norm) need the whole input "
                "of o_proj / down_proj, which tensor parallelism splits over the ranks"
            )
        if c.mixture_of_attention or c.moe_output_bias:
            raise KeelError(
                f"--tensor-parallel-size {tp}: JetMoE's attention experts and output biases (mixture_of_attention, "
                "moe_output_bias) are not cut by tensor parallelism yet"
            )
        if c.moe_output_norm:
            raise KeelError(
                f"--tensor-parallel-size {tp}: the MoE block's output norm (moe_output_norm: A.X-K1) needs its whole "
                "output, which tensor parallelism splits over the ranks"
            )
        if c.num_heads % tp:
            raise KeelError(
                f"--tensor-parallel-size {tp}: the model's {c.num_heads} attention heads do not divide into {tp} ranks"
            )
        if c.num_kv_heads % tp and tp % c.num_kv_heads:
            raise KeelError(
                f"--tensor-parallel-size {tp}: {c.num_kv_heads} KV heads neither divide into {tp} ranks "
                "nor replicate evenly over them"
            )
        if self.expert_parallel and c.is_moe and c.num_experts % tp:
            raise KeelError(f"--enable-expert-parallel over {tp} ranks: {c.num_experts} experts do not divide")
        widths = {"MLP": c.intermediate_size}
        if c.is_moe and self.expert_parallel:
            widths["shared-expert"] = c.shared_expert_intermediate_size or 0
        elif c.is_moe:
            widths |= {"expert": c.moe_intermediate_size, "shared-expert": c.shared_expert_intermediate_size or 0}
        for what, width in widths.items():
            if width % tp:
                raise KeelError(
                    f"--tensor-parallel-size {tp}: the {what} width {width} does not divide into {tp} ranks"
                )

    @property
    def kv_replicas(self) -> int:
        """How many ranks hold each KV head (1: KV heads are split, not replicated)."""
        return max(1, self.tp // self.config.num_kv_heads)

    @property
    def local_heads(self) -> int:
        return self.config.num_heads // self.tp

    def kv_head_range(self) -> tuple[int, int]:
        c = self.config
        if self.kv_replicas > 1:  # one KV head per rank: the one this rank's query heads share
            head = self.rank * c.num_kv_heads // self.tp
            return head, head + 1
        per = c.num_kv_heads // self.tp
        return self.rank * per, (self.rank + 1) * per

    def vocab_range(self) -> tuple[int, int]:
        per = -(-self.config.vocab_size // self.tp)  # ceil: the last rank may hold fewer rows
        return min(self.rank * per, self.config.vocab_size), min((self.rank + 1) * per, self.config.vocab_size)

    def _split(self, size: int) -> tuple[int, int]:
        per = size // self.tp
        return self.rank * per, (self.rank + 1) * per

    def shard_of(self, name: str) -> Shard | None:
        """This rank's slice of parameter `name` (keel's names), or None when it is replicated."""
        c = self.config
        if name in ("embed_tokens.weight", "lm_head.weight", "lm_head.bias"):
            return Shard(0, *self.vocab_range())
        match = _LAYER.match(name)
        if match is None:
            return None
        module, kind = match.groups()
        d = c.head_dim
        if module in ("self_attn.q_proj", "self_attn.q_b_proj"):  # q_b_proj: latent attention's low-rank query
            return Shard(0, self.rank * self.local_heads * d, (self.rank + 1) * self.local_heads * d)
        if module == "self_attn.q_gate_proj":  # A.X-K2's gated latent query: each head's query and gate rows, by head
            per_head = d + c.v_head_dim
            return Shard(0, self.rank * self.local_heads * per_head, (self.rank + 1) * self.local_heads * per_head)
        if module == "self_attn.kv_b_proj":  # latent attention: each head's key and value rows, by head
            per_head = c.qk_nope_head_dim + c.v_head_dim
            return Shard(0, self.rank * self.local_heads * per_head, (self.rank + 1) * self.local_heads * per_head)
        if module == "self_attn.output_gate":  # the gate of this rank's heads: a row per channel, or per head
            width = 1 if c.attention_gate_per_head else d
            return Shard(0, self.rank * self.local_heads * width, (self.rank + 1) * self.local_heads * width)
        if module == "self_attn" and kind == "sinks":  # GPT-OSS: one per query head
            return Shard(0, self.rank * self.local_heads, (self.rank + 1) * self.local_heads)
        if module in ("self_attn.k_proj", "self_attn.v_proj"):
            first, last = self.kv_head_range()
            return Shard(0, first * d, last * d)
        if module in ("mlp.gate_proj", "mlp.up_proj"):
            return Shard(0, *self._split(c.intermediate_size))
        if module == "mlp.experts" and self.expert_parallel:
            return Shard(0, *self._split(c.num_experts))
        if module == "mlp.experts" and kind in ("gate_up_proj", "gate_up_proj_bias"):  # bias: GPT-OSS's, as its rows
            return Shard(1, *self._split(c.moe_intermediate_size), parts=2 if c.mlp_gated else 1)
        if module == "mlp.experts" and kind == "down_proj":
            return Shard(2, *self._split(c.moe_intermediate_size))
        if module in ("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj"):
            return Shard(0, *self._split(c.shared_expert_intermediate_size))
        if module == "mlp.shared_expert.down_proj" and kind == "weight":
            return Shard(1, *self._split(c.shared_expert_intermediate_size))
        if module in _ROW and kind == "weight":
            head_width = c.v_head_dim if c.is_mla else d
            width = c.num_heads * head_width if module == "self_attn.o_proj" else c.intermediate_size
            return Shard(1, *self._split(width))
        return None  # norms, row-parallel biases


def slice_of(shape: tuple[int, ...], shard: Shard | None) -> tuple[int, ...]:
    """The shape of a shard of a tensor of `shape`."""
    if shard is None:
        return tuple(shape)
    return tuple(shard.size if i == shard.dim else n for i, n in enumerate(shape))


def read_shard(handle, name: str, shard: Shard | None):
    """A rank's slice of tensor `name` from an open safetensors handle (safe_open): only those bytes."""
    view = handle.get_slice(name)
    if shard is None:
        return view[:]
    full = view.get_shape()[shard.dim]
    pieces = [
        view[tuple(slice(a, b) if i == shard.dim else slice(None) for i in range(shard.dim + 1))]
        for a, b in shard.ranges(full)
    ]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=shard.dim)
