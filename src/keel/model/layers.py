"""Building blocks shared by every architecture: norms, rotary embeddings, the SwiGLU MLP."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from keel import kernels
from keel.config import ModelConfig, RopeScaling

# Registered through torch.library's low-level API (see keel.model.prepack for why not custom_op).
_lib = torch.library.Library("keel", "FRAGMENT")
_lib.define("rms_norm(Tensor x, Tensor? weight, float eps) -> Tensor")
_lib.impl("rms_norm", lambda x, weight, eps: F.rms_norm(x, (x.shape[-1],), weight, eps), "CompositeExplicitAutograd")


@torch.library.register_fake("keel::rms_norm")
def _(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    return torch.empty_like(x)


def rms_norm(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    """aten's fused RMS norm over the last dimension, also inside an inference graph of torch.compile:
    inductor's own reduction sums in another order, and on SmolLM2 that flipped a greedy token after
    69 steps; the compiled decode step (keel.serve.compiled_decode) must give eager's tokens."""
    if torch.compiler.is_compiling() and not torch.is_grad_enabled():
        return torch.ops.keel.rms_norm(x, weight, eps)
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


class RMSNorm(nn.Module):
    """Root-mean-square norm; statistics in float32 as the reference implementations do. With an
    `offset` (Gemma's 1), the scale is (offset + weight), applied in float32 before rounding once."""

    def __init__(self, dim: int, eps: float = 1e-6, offset: float = 0.0) -> None:
        super().__init__()
        self.eps = eps
        self.offset = offset
        self.weight = nn.Parameter(torch.full((dim,), 1.0 - offset))

    def forward(self, x: Tensor) -> Tensor:
        if self.offset:
            return (rms_norm(x.float(), None, self.eps) * (self.weight.float() + self.offset)).to(x.dtype)
        if kernels.fused_ops(x):  # one call instead of ~6 (serving on CPU; same formula)
            return torch.ops.keel.fused_rms_norm(x, self.weight, self.eps)
        if x.dtype == torch.float32:
            # One fused kernel: the common path in float32 and the cheapest at decode.
            return rms_norm(x, self.weight, self.eps)
        # Reduced precision: normalise in float32, round once, then scale (bit-compatible with HF).
        normed = rms_norm(x.float(), None, self.eps).to(x.dtype)
        return self.weight * normed


class GateMLP(nn.Module):
    """A.X-K2's gate: fc2(silu(fc1(y))), a low-rank pair without biases (transformers' names)."""

    def __init__(self, dim: int, rank: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, rank, bias=False)
        self.fc2 = nn.Linear(rank, dim, bias=False)

    def forward(self, y: Tensor) -> Tensor:
        return self.fc2(F.silu(self.fc1(y)))


class LowRankGatedRMSNorm(nn.Module):
    """A.X-K2's gated norm (Megatron's GatedNormWrapper): y = RMSNorm(x), then y * sigmoid(gate(y)), the product in
    float32 rounded once (as transformers computes it); `norm.*` and `mlp.fc1/fc2` as transformers names them."""

    def __init__(self, dim: int, eps: float, rank: int) -> None:
        super().__init__()
        self.norm = RMSNorm(dim, eps)
        self.mlp = GateMLP(dim, rank)

    def forward(self, x: Tensor) -> Tensor:
        y = self.norm(x)
        return (y * torch.sigmoid(self.mlp(y).float())).to(y.dtype)


class OffsetLayerNorm(nn.LayerNorm):
    """LayerNorm scaling by (offset + weight) (Nemotron's LayerNorm1P: offset 1), in the input's dtype as
    transformers computes it; the weight starts at 1 - offset, a scale of 1."""

    def __init__(self, dim: int, eps: float, bias: bool, offset: float) -> None:
        super().__init__(dim, eps=eps, bias=bias)
        self.offset = offset
        if not building_on_meta():
            with torch.no_grad():
                self.weight.fill_(1.0 - offset)

    def forward(self, x: Tensor) -> Tensor:
        return F.layer_norm(x, self.normalized_shape, self.weight + self.offset, self.bias, self.eps)


def l2_norm(x: Tensor, eps: float) -> Tensor:
    """x divided by its root mean square over the last dimension, in float32 (Llama 4's weightless q/k norm,
    NanoChat's norms: transformers' Llama4TextL2Norm, op for op)."""
    f = x.float()
    return (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + eps)).type_as(x)


class WeightlessNorm(nn.Module):
    """A norm with no weight or bias (`ModelConfig.norm_affine` False), in float32 and rounded once as the
    references compute it: LayerNorm (OLMo's OlmoLayerNorm) or RMSNorm (NanoChat's, `l2_norm`)."""

    def __init__(self, kind: str, eps: float) -> None:
        super().__init__()
        self.kind = kind
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        if self.kind == "layer":
            return F.layer_norm(x.float(), (x.shape[-1],), None, None, self.eps).to(x.dtype)
        return l2_norm(x, self.eps)

    def extra_repr(self) -> str:
        return f"{self.kind}, eps={self.eps}"


def block_norm(config: ModelConfig, dim: int, eps: float | None = None) -> nn.Module:
    """The norm the config's blocks and final layer use: RMSNorm, or LayerNorm with or without a bias (each scaling
    by offset + weight where the config has a `norm_weight_offset`), or either without a weight; at `eps` where
    given (the final norm's `final_norm_eps`), else rms_norm_eps."""
    eps = config.rms_norm_eps if eps is None else eps
    if not config.norm_affine:
        return WeightlessNorm(config.norm_type, eps)
    if config.norm_type == "layer":
        if config.norm_weight_offset:
            return OffsetLayerNorm(dim, eps, config.norm_bias, config.norm_weight_offset)
        return nn.LayerNorm(dim, eps=eps, bias=config.norm_bias)
    return RMSNorm(dim, eps, config.norm_weight_offset)


class HeadNorm(nn.Module):
    """A q or k norm over each head's channels with a weight of its own per head ([heads, head_dim]: Cohere's
    CohereLayerNorm of Command R+, StableLM 2's LayerNorm per head), LayerNorm (the mean subtracted) or RMSNorm,
    with an optional bias; in float32 and rounded once, as those references compute it. Reads x [..., heads,
    head_dim]."""

    def __init__(self, kind: str, heads: int, dim: int, eps: float, bias: bool) -> None:
        super().__init__()
        self.kind = kind
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(heads, dim))
        self.bias = nn.Parameter(torch.zeros(heads, dim)) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        f = x.float()
        if self.kind == "layer":
            normed = F.layer_norm(f, (f.shape[-1],), None, None, self.eps)
        else:
            normed = rms_norm(f, None, self.eps)
        out = normed * self.weight.float()
        if self.bias is not None:
            out = out + self.bias.float()
        return out.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.kind}, {tuple(self.weight.shape)}, eps={self.eps}, bias={self.bias is not None}"


def qk_norm(config: ModelConfig, heads: int, head_dim: int, width: int) -> nn.Module:
    """A q or k norm as the config says (`qk_norm_scope`, `qk_norm_type`, `qk_norm_bias`): over each head with one
    weight for all heads, over the whole projection (`width` channels), or over each head with a weight per head."""
    eps, offset = config.rms_norm_eps, config.norm_weight_offset
    if config.qk_norm_scope == "each_head":
        return HeadNorm(config.qk_norm_type, heads, head_dim, eps, config.qk_norm_bias)
    dim = width if config.qk_norm_scope == "all" else head_dim
    if config.qk_norm_type == "layer":
        return nn.LayerNorm(dim, eps=eps, bias=config.qk_norm_bias)
    return RMSNorm(dim, eps, offset)


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context stretched `scale` times (1 when not stretched)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_attention_factor(scaling: RopeScaling) -> float:
    """Factor on cos/sin (so on q.k through both): YaRN's and LongRoPE's, derived as transformers does; 1 otherwise."""
    if scaling.type not in ("yarn", "longrope"):
        return 1.0
    if scaling.attention_factor is not None:
        return scaling.attention_factor
    if scaling.type == "longrope":
        if scaling.factor <= 1.0:
            return 1.0
        return math.sqrt(1 + math.log(scaling.factor) / math.log(scaling.original_max_position_embeddings))
    if scaling.mscale and scaling.mscale_all_dim:
        return yarn_get_mscale(scaling.factor, scaling.mscale) / yarn_get_mscale(scaling.factor, scaling.mscale_all_dim)
    return yarn_get_mscale(scaling.factor)


def _yarn_inv_freq(dim: int, theta: float, scaling: RopeScaling) -> Tensor:
    """YaRN: high frequencies (many rotations within the original context) kept, low ones divided by
    `factor`, a linear ramp in between (transformers' _compute_yarn_parameters, same float32 ops)."""

    def correction_dim(rotations: float) -> float:
        old_len = scaling.original_max_position_embeddings
        return (dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid dividing by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    return 1.0 / (scaling.factor * pos_freqs) * (1 - extrapolation) + 1.0 / pos_freqs * extrapolation


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling, long: bool = False) -> Tensor:
    """Inverse frequencies of rotary embeddings over `head_dim` channels, with scaling applied (LongRoPE: its long
    factors where `long`, else its short ones)."""
    if scaling.type == "yarn":
        return _yarn_inv_freq(head_dim, theta, scaling)
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    if scaling.type == "proportional":
        # transformers' _compute_proportional_rope_parameters: the turning frequencies over all head_dim channels
        turning = int(scaling.rotated_share * head_dim // 2)
        inv_freq = 1.0 / theta ** (torch.arange(0, 2 * turning, 2, dtype=torch.int64).float() / head_dim)
        return torch.cat((inv_freq, torch.zeros(head_dim // 2 - turning))) / scaling.factor
    if scaling.type == "longrope":
        factors = torch.tensor(scaling.long_factor if long else scaling.short_factor, dtype=torch.float32)
        return 1.0 / (factors * theta**exponents)  # transformers' _compute_longrope_parameters, same float32 ops
    inv_freq = 1.0 / (theta**exponents)
    # "dynamic" (NTK by length) rescales only for sequences longer than max_position_embeddings, which keel does not
    # serve (keel.serve.model_len): within it, these default frequencies are what transformers computes
    if scaling.type == "linear":
        return inv_freq / scaling.factor
    if scaling.type == "llama3":
        # Llama 3.1: keep high frequencies, divide low ones by `factor`, interpolate in between.
        old_len = scaling.original_max_position_embeddings
        low_freq_wavelen = old_len / scaling.low_freq_factor
        high_freq_wavelen = old_len / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
        smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    return inv_freq


def building_on_meta() -> bool:
    """Whether modules are being built on the meta device (every checkpoint load and training start), where
    their initial values are skipped: meta tensors hold none, and arithmetic or init on them runs torch._refs
    decompositions, whose first use imports torch._dynamo (a second of each process's start-up)."""
    return torch.get_default_device().type == "meta"


class RotaryEmbedding(nn.Module):
    """Computes (cos, sin) for given positions once per forward; layers apply them."""

    def __init__(self, config: ModelConfig, sliding: bool = False) -> None:
        """`sliding`: the frequencies of the sliding-window layers' own RoPE (config.sliding_rope_theta)."""
        super().__init__()
        # MLA rotates only the qk_rope part of each head; the full-attention layers may have a head width of their own
        self.head_dim = config.sliding_rotary_dim if sliding else config.full_rotary_dim
        self.theta = config.sliding_rope_theta if sliding else config.rope_theta
        self.scaling = config.sliding_rope_scaling if sliding else config.rope_scaling
        self.attention_factor = rope_attention_factor(self.scaling)
        self.reversed = config.rope_reversed  # NanoChat: every pair turned the other way
        # On meta, a placeholder of the frequencies' shape (as many as arange(0, dim, 2)): reset_buffers computes
        # the values where the model lands.
        inv_freq = torch.empty((self.head_dim + 1) // 2) if building_on_meta() else self._inv_freq()
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        # LongRoPE's two sets: the short one is `inv_freq`. `long_context` says which applies: None, per forward as
        # transformers decides (the long set once a position reaches the pre-training context; one host read a
        # forward); True / False, always that set (the serving engine's choice by its max_model_len, so that every
        # key in its cache is rotated alike).
        self.longrope = self.scaling.type == "longrope"
        self.long_context: bool | None = None
        if self.longrope:
            long_freq = torch.empty_like(inv_freq) if building_on_meta() else self._inv_freq(long=True)
            self.register_buffer("long_inv_freq", long_freq, persistent=False)

    def _inv_freq(self, device: torch.device | None = None, long: bool = False) -> Tensor:
        return rope_inv_freq(self.head_dim, self.theta, self.scaling, long).to(device)

    def reset_buffers(self, device: torch.device) -> None:
        """Recompute the frequencies (after a model built on the meta device is materialised)."""
        self.inv_freq = self._inv_freq(device)
        if self.longrope:
            self.long_inv_freq = self._inv_freq(device, long=True)

    def _frequencies(self, positions: Tensor) -> Tensor:
        if not self.longrope:
            return self.inv_freq
        long = self.long_context
        if long is None:
            long = int(positions.max()) + 1 > self.scaling.original_max_position_embeddings
        return self.long_inv_freq if long else self.inv_freq

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """(cos, signed_sin), each [B, S, 1, D], for `apply_rotary`. The first half of sin is
        negated once here so that rotate_half costs one roll per use instead of four ops (the second half where
        the rotation is reversed: NanoChat's rotate_half, cat(x2, -x1), bit for bit, on every path that rotates)."""
        freqs = positions.to(torch.float32).unsqueeze(-1) * self._frequencies(positions)  # [B, S, D/2]
        cos, sin = freqs.cos(), freqs.sin()
        if self.attention_factor != 1.0:  # YaRN, LongRoPE; scaled in float32 before rounding, as transformers
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        cos, signed_sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, -sin) if self.reversed else (-sin, sin), -1)
        # [B, S, 1, D] broadcasts over heads in the [B, S, H, D] layout.
        return cos.to(dtype).unsqueeze(2), signed_sin.to(dtype).unsqueeze(2)


class SinusoidalPositions(nn.Module):
    """fairseq's fixed sinusoidal positions (XGLM; `position_embedding` "sinusoidal"): positions [B, S] (each plus
    position_offset already) -> [B, S, width] float32, computed from the positions each call (no table is stored,
    so none limits the context): sin(p * f_i) for i < width / 2, then cos(p * f_i), f_i = 10000^(-i / (width/2 - 1)),
    and a zero column for an odd width; row `padding_idx` is zeros. Float32 as transformers builds its table, which a
    model cast to bf16 holds (and adds) in bf16: the caller casts to the embedding's dtype."""

    def __init__(self, width: int, padding_idx: int | None = None) -> None:
        super().__init__()
        self.width = width
        self.padding_idx = padding_idx

    def forward(self, positions: Tensor) -> Tensor:
        half = self.width // 2
        # the same float32 operations as transformers' get_embedding, so that the values are the same bits
        freqs = torch.exp(
            torch.arange(half, dtype=torch.int64, device=positions.device).float() * -(math.log(10000) / (half - 1))
        )
        angles = positions.float().unsqueeze(-1) * freqs
        table = torch.cat([torch.sin(angles), torch.cos(angles)], dim=-1)
        if self.width % 2:
            table = F.pad(table, (0, 1))
        if self.padding_idx is not None:
            table = table.masked_fill((positions == self.padding_idx).unsqueeze(-1), 0.0)
        return table


def apply_partial_rotary(x: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor:
    """Rotary over the first cos.shape[-1] channels of each head, the rest passed as they are
    (partial_rotary_factor: GPT-NeoX, StableLM, Phi-4-mini); the whole head when they are as wide."""
    rotary = cos.shape[-1]
    if rotary == x.shape[-1]:
        return apply_rotary(x, cos, signed_sin)
    rotated = apply_rotary(x[..., :rotary].contiguous(), cos, signed_sin)
    return torch.cat((rotated, x[..., rotary:]), dim=-1)


def apply_rotary(x: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor:
    """Rotate-half rotary embedding (the HF weight layout): x * cos + rotate_half(x) * sin.

    rotate_half(x) = cat(-x2, x1) = roll(x, D/2) * [-1 .. -1, 1 .. 1]; the sign lives in
    `signed_sin`. Negation is exact, so the result is bit-identical to the reference formula.
    """
    if kernels.fused_ops(x) and cos.dtype == x.dtype and x.dim() == 4 and cos.shape[2] == 1:
        return torch.ops.keel.fused_rotary(x, cos, signed_sin)  # the same formula, one call
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


_ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,  # erf (GPT-NeoX's "gelu")
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),  # transformers' gelu_pytorch_tanh / gelu_new (Gemma)
    "relu2": lambda x: F.relu(x).square(),  # ReLU squared (Arcee's AFM)
    "relu": F.relu,
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
}


def activation(name: str) -> Callable[[Tensor], Tensor]:
    """keel's activation `name` (ModelConfig.hidden_act) as a function (xIELU, which has parameters, is `XIELU`)."""
    return _ACTIVATIONS[name]


def _inverse_softplus(y: float) -> float:
    return math.log(math.expm1(y))


class XIELU(nn.Module):
    """xIELU (Apertus): a_p x^2 + beta x where x > 0, else (expm1(min(x, eps)) - x) a_n + beta x, with
    a_p = softplus(alpha_p) and a_n = beta + softplus(alpha_n) learned per MLP, beta and eps stored beside them
    (transformers' XIELUActivation, its Python path; the checkpoint's `mlp.act_fn.*`)."""

    # The stored values that start a = 0.8 both sides, beta 0.5, eps -1e-6: the paper's, transformers' defaults.
    INITIAL = {"alpha_p": _inverse_softplus(0.8), "alpha_n": _inverse_softplus(0.8 - 0.5), "beta": 0.5, "eps": -1e-6}

    def __init__(self) -> None:
        super().__init__()
        self.alpha_p = nn.Parameter(torch.empty(1))
        self.alpha_n = nn.Parameter(torch.empty(1))
        self.register_buffer("beta", torch.empty(()))
        self.register_buffer("eps", torch.empty(()))
        if not building_on_meta():
            self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        for name, tensor in (*self.named_parameters(), *self.named_buffers()):
            tensor.fill_(self.INITIAL[name])

    def forward(self, x: Tensor) -> Tensor:
        # in the parameters' dtype, as transformers keeps them all in the model's; then in x's
        beta = self.beta.to(self.alpha_n.dtype)
        alpha_p = F.softplus(self.alpha_p).to(x.dtype)
        alpha_n = (beta + F.softplus(self.alpha_n)).to(x.dtype)
        beta, eps = beta.to(x.dtype), self.eps.to(x.dtype)
        negative = (torch.expm1(torch.minimum(x, eps)) - x) * alpha_n
        return torch.where(x > 0, alpha_p * x * x, negative) + beta * x


class SwiGLU(nn.Module):
    """The MLP of every block: gated, down(act(gate(x)) * up(x)) (SwiGLU with SiLU, the Llama family's;
    GeGLU with GELU), or ungated, down(act(up(x))) (GPT-NeoX's dense_h_to_4h / dense_4h_to_h)."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        bias: bool = False,
        act: str = "silu",
        gated: bool = True,
        gate_multiplier: float = 1.0,
        down_multiplier: float = 1.0,
        sparsity: float = 0.0,
        sub_norm_eps: float | None = None,
        adapter_rank: int = 0,
    ) -> None:
        """`adapter_rank`: Zamba 2's shared MLP, its gate and up as one projection (`gate_up_proj`, as stored) plus a
        low-rank adapter of the layer's own on it (`gate_up_adapter`)."""
        super().__init__()
        # BitNet's RMSNorm over act(gate) * up before down_proj (`ffn_sub_norm`; None: none)
        self.ffn_sub_norm = RMSNorm(intermediate_size, sub_norm_eps) if sub_norm_eps is not None else None
        # Falcon-H1's mlp_multipliers: the gate projection's output and the MLP's output times these
        self.gate_multiplier, self.down_multiplier = gate_multiplier, down_multiplier
        # Gemma 3n's activation sparsity: the gate's cut-off lies this many standard deviations above its mean
        # (Phi^-1 of the target sparsity, in float32 as transformers takes it); None: dense
        self.sparsity_std: float | None = None
        if sparsity:
            target = torch.tensor(sparsity, device="cpu")  # not on the meta device a model may be built on
            self.sparsity_std = (torch.erfinv(2 * target - 1) * math.sqrt(2)).item()  # Normal(0, 1).icdf
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias) if gated else None
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.act = act
        # xIELU's parameters are the module's (`mlp.act_fn.*`, as transformers names them)
        self.act_fn: XIELU | None = XIELU() if act == "xielu" else None
        self._act = self.act_fn if self.act_fn is not None else _ACTIVATIONS[act]
        # Serving fuses gate and up into one projection at load (keel.model.fuse); None otherwise.
        self.gate_up_proj: nn.Linear | None = None
        self.gate_up_adapter: nn.Sequential | None = None
        if adapter_rank:
            self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=bias)
            self.gate_proj = self.up_proj = None
            self.gate_up_adapter = nn.Sequential(
                nn.Linear(hidden_size, adapter_rank, bias=False),
                nn.Linear(adapter_rank, 2 * intermediate_size, bias=False),
            )

    def forward(self, x: Tensor) -> Tensor:
        out = self._forward(x)
        return out if self.down_multiplier == 1.0 else out * self.down_multiplier

    def _forward(self, x: Tensor) -> Tensor:
        if self.gate_up_adapter is not None:
            gate, up = (self.gate_up_proj(x) + self.gate_up_adapter(x)).chunk(2, dim=-1)
        elif self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        elif self.gate_proj is None:
            return self.down_proj(self._sub_norm(self._act(self.up_proj(x))))
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        if self.gate_multiplier != 1.0:
            gate = gate * self.gate_multiplier
        if self.sparsity_std is not None:  # keep what exceeds mean + std x Phi^-1(s), less the cut-off
            mean, std = gate.mean(-1, keepdim=True), gate.std(-1, keepdim=True, unbiased=False)
            gate = torch.relu(gate - (mean + std * self.sparsity_std))
        if self.act == "silu" and kernels.fused_ops(gate):  # one call; the same in fused and separate projections
            return self.down_proj(self._sub_norm(torch.ops.keel.fused_silu_mul(gate, up)))
        return self.down_proj(self._sub_norm(self._act(gate) * up))

    def _sub_norm(self, x: Tensor) -> Tensor:
        return x if self.ffn_sub_norm is None else self.ffn_sub_norm(x)
