"""Quantized MoE experts: the `GroupedExperts` forward contract over per-expert quantized layers.

`GroupedExperts` runs every expert in one grouped matmul over stacked float weights. The int8/int4
kernels take one [N, K] matrix each, so here every expert is a pair of `QuantizedLinear` (gate+up
rows [2I, H], down [H, I]) and the forward loops over the experts that received rows: decode
batches route a handful of token-slots to a few experts, so the loop runs few kernels and skips
the idle experts entirely (their weights are not read).
"""

from __future__ import annotations

from torch import Tensor, nn

from keel.errors import KeelError
from keel.model.moe import ExpertActivation
from keel.quant.linear import QuantizedLinear, int4_fits, int8_fits

_FLOAT_ONLY = (
    "quantized MoE experts hold no stacked float weights: expert offloading (--expert-cache), expert-parallel "
    "sharding and training need float experts; keep them in float with --quant-keep 'lm_head,*.experts'"
)


def experts_fit(scheme: str, hidden: int, intermediate: int, group_size: int) -> bool:
    """Whether the kernels take both projections of an expert: gate+up [2I, H] and down [H, I]."""
    if scheme == "int8":
        return int8_fits(hidden) and int8_fits(intermediate)
    return int4_fits(hidden, 2 * intermediate, group_size) and int4_fits(intermediate, hidden, group_size)


def float_parts(experts: nn.Module) -> tuple[ExpertActivation, Tensor | None, Tensor | None]:
    """What quantized experts keep of float `GroupedExperts` (activation, biases), in the constructor's order."""
    local = lambda b: None if b is None else getattr(b, "to_local", lambda: b)()  # noqa: E731
    down_bias = local(experts.down_proj_bias) if experts.adds_down_bias else None
    return experts.activation, local(experts.gate_up_proj_bias), down_bias


class QuantizedGroupedExperts(nn.Module):
    """Drop-in for `GroupedExperts` at inference: forward(x [N, H] rows sorted by local expert,
    offsets [E_local] int32 cumulative counts) -> [N, H]. Under expert parallelism it holds only
    this rank's experts (`num_experts` stays the global count, as `GroupedExperts.num_experts`)."""

    def __init__(
        self,
        gate_up: list[QuantizedLinear],
        down: list[QuantizedLinear],
        num_experts: int,
        activation: ExpertActivation | None = None,
        gate_up_bias: Tensor | None = None,
        down_bias: Tensor | None = None,
    ) -> None:
        """`activation` and the stacked float biases (GPT-OSS: [E, 2I], [E, H]; meta tensors while loading,
        filled from the checkpoint as other parameters) are the float experts' (`GroupedExperts`)."""
        super().__init__()
        if len(gate_up) != len(down) or not gate_up:
            raise ValueError(f"{len(gate_up)} gate/up and {len(down)} down projections")
        self.num_experts = num_experts
        self.gate_up = nn.ModuleList(gate_up)
        self.down = nn.ModuleList(down)
        self.activation = activation or ExpertActivation()
        as_param = lambda b: None if b is None else nn.Parameter(b.detach(), requires_grad=False)  # noqa: E731
        self.gate_up_proj_bias = as_param(gate_up_bias)
        self.down_proj_bias = as_param(down_bias)

    @property
    def scheme(self) -> str:
        return self.gate_up[0].scheme

    @property
    def weight_bytes(self) -> int:
        return sum(m.weight_bytes for m in (*self.gate_up, *self.down))

    # Code that reaches for the stacked float weights (offloading, EP sharding, init) gets a clear
    # error instead of an AttributeError from deep inside it.
    @property
    def gate_up_proj(self) -> Tensor:
        raise KeelError(_FLOAT_ONLY)

    @property
    def down_proj(self) -> Tensor:
        raise KeelError(_FLOAT_ONLY)

    def forward(self, x: Tensor, offsets: Tensor) -> Tensor:
        out = x.new_zeros(x.shape[0], self.down[0].out_features)
        start = 0
        for e, end in enumerate(offsets.tolist()):  # one host sync per layer; the loop needs the counts
            if end > start:
                hidden = self.gate_up[e](x[start:end])
                if self.gate_up_proj_bias is not None:
                    hidden = hidden + self.gate_up_proj_bias[e].to(hidden.dtype)
                projected = self.down[e](self.activation(hidden))
                if self.down_proj_bias is not None:
                    projected = projected + self.down_proj_bias[e].to(projected.dtype)
                out[start:end] = projected.to(out.dtype)
            start = end
        return out

    def extra_repr(self) -> str:
        first = self.gate_up[0]
        return f"experts={len(self.gate_up)} of {self.num_experts}, {first.scheme}" + (
            f", group_size={first.group_size}" if first.scheme == "int4" else ""
        )
