"""Which slice of every dense-model parameter a tensor-parallel rank holds, as vLLM shards them.

- Column-parallel (output features split): q/k/v by attention heads, gate/up by the MLP width, the
  LM head and the embedding by vocabulary rows (vocab-parallel; the last rank may hold fewer rows
  when the vocabulary does not divide). Their biases follow their rows.
- Row-parallel (input features split): o_proj by heads, down_proj by the MLP width. Their biases
  are replicated (added once, after the all-reduce).
- Replicated: norms (including per-head q/k norms), anything unnamed here.

KV heads: with at least as many KV heads as ranks, each rank holds num_kv_heads / tp of them. With
fewer (tp a multiple of num_kv_heads), each rank holds one KV head and every KV head is replicated
tp / num_kv_heads times, the head that rank's query heads attend to (vLLM's rule).

A `Shard` names a dimension and a [start, stop) range; `read_shard` reads only that range from a
safetensors file (never the whole tensor). MoE experts are not handled here yet.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from keel.config import ModelConfig
from keel.errors import KeelError

_COLUMN = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
_ROW = ("self_attn.o_proj", "mlp.down_proj")
_LAYER = re.compile(r"^layers\.\d+\.(.+)\.(weight|bias)$")


@dataclass(frozen=True)
class Shard:
    dim: int
    start: int
    stop: int


@dataclass(frozen=True)
class TensorParallelLayout:
    config: ModelConfig
    tp: int
    rank: int

    def __post_init__(self) -> None:
        c, tp = self.config, self.tp
        if not 0 <= self.rank < tp:
            raise KeelError(f"tensor-parallel rank {self.rank} outside [0, {tp})")
        if c.num_heads % tp:
            raise KeelError(f"--tensor-parallel-size {tp}: the model's {c.num_heads} attention heads do not divide "
                            f"into {tp} ranks")  # fmt: skip
        if c.num_kv_heads % tp and tp % c.num_kv_heads:
            raise KeelError(f"--tensor-parallel-size {tp}: {c.num_kv_heads} KV heads neither divide into {tp} ranks "
                            "nor replicate evenly over them")  # fmt: skip
        if c.intermediate_size % tp:
            raise KeelError(f"--tensor-parallel-size {tp}: the MLP width {c.intermediate_size} does not divide "
                            f"into {tp} ranks")  # fmt: skip

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
        if name in ("embed_tokens.weight", "lm_head.weight"):
            return Shard(0, *self.vocab_range())
        match = _LAYER.match(name)
        if match is None:
            return None
        module, kind = match.groups()
        d = c.head_dim
        if module == "self_attn.q_proj":
            return Shard(0, self.rank * self.local_heads * d, (self.rank + 1) * self.local_heads * d)
        if module in ("self_attn.k_proj", "self_attn.v_proj"):
            first, last = self.kv_head_range()
            return Shard(0, first * d, last * d)
        if module in ("mlp.gate_proj", "mlp.up_proj"):
            return Shard(0, *self._split(c.intermediate_size))
        if module in _ROW and kind == "weight":
            width = c.num_heads * d if module == "self_attn.o_proj" else c.intermediate_size
            return Shard(1, *self._split(width))
        return None  # norms, row-parallel biases


def slice_of(shape: tuple[int, ...], shard: Shard | None) -> tuple[int, ...]:
    """The shape of a shard of a tensor of `shape`."""
    if shard is None:
        return tuple(shape)
    return tuple(shard.stop - shard.start if i == shard.dim else n for i, n in enumerate(shape))


def read_shard(handle, name: str, shard: Shard | None):
    """A rank's slice of tensor `name` from an open safetensors handle (safe_open): only those bytes."""
    view = handle.get_slice(name)
    if shard is None:
        return view[:]
    index = tuple(slice(shard.start, shard.stop) if i == shard.dim else slice(None) for i in range(shard.dim + 1))
    return view[index]
