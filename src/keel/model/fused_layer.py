"""A serving step's decoder layers in one call of keel's C++ kernels (`torch.ops.keel.decoder_layers`):
the whole stack where every layer qualifies (`fused_layers`), else layer by layer (`fused_forward`).

Why: at decode sizes a layer is a few hundred microseconds of weight streaming, and the ~20 torch
calls around its products (norms, the q/k/v split, rotary, the K/V writes, attention's glue, residual
adds), each through a Python module and the dispatcher, cost about as much again (docs/BENCHMARKS.md,
"keel's kernels"). The operator runs the same C++ functions those modules call, in the same order, so
its output is bit for bit theirs (tests/test_kernels.py compares); it is an implementation of
`DecoderLayer.forward`, not a second model.

It runs where all of these hold, else the modules do (`fused_forward` returns None):
- keel's kernels are active, float32 activations, no autograd, not under torch.compile, not switched
  off by `modules_only` (keel profile decode times the modules);
- a dense layer without Granite's scalars (residual and softmax multipliers), attention-score
  soft-capping (Gemma 2) or clamped q/k/v (OLMo), that rotates q and k (not SmolLM3's NoPE layers) and
  does not scale queries by position (Ministral 3): grouped-query attention with fused q/k/v
  (keel.model.fuse) and a SwiGLU MLP with fused gate/up, every projection float32 `nn.Linear` or a
  block-layout QuantizedLinear that would run keel::block_linear on this many rows (`kernel_args`), no
  tensor-parallel wrapper;
- a cache whose layer keel's paged-attention kernel reads in place (`in_place`: the serving engine's
  float32/bf16 paged cache, or its int8 cache, whose rows the operator quantizes as
  keel.serve.kv_quant.quantize_kv does, value for value).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator

import torch
from torch import Tensor, nn

from keel import kernels
from keel.model.attention import Attention, AttentionMetadata
from keel.model.layers import RMSNorm, SwiGLU

_enabled = True


@contextlib.contextmanager
def modules_only() -> Iterator[None]:
    """Run every layer through its modules (for hooks on them: keel profile decode's scopes)."""
    global _enabled
    previous, _enabled = _enabled, False
    try:
        yield
    finally:
        _enabled = previous


def _projection(module: nn.Module | None, rows: int) -> tuple | None:
    """(weight or codes, scales, mins, bias, bits, passes, panel rows) of one projection, bits 0 for float32
    weights."""
    if type(module) is nn.Linear:
        params = module._parameters
        weight = params["weight"]
        return (weight, None, None, params["bias"], 0, 1, 0) if weight.dtype == torch.float32 else None
    args = getattr(module, "kernel_args", None)
    return args(rows) if args is not None else None


def _weight(norm: nn.Module | None) -> Tensor | None:
    return None if norm is None else norm._parameters["weight"]


def _ready(x: Tensor, meta: AttentionMetadata) -> bool:
    """The step-wide conditions (see the module doc)."""
    if not _enabled or meta.cache is None or x.dim() != 3 or x.shape[0] != 1 or not x.is_contiguous():
        return False
    return kernels.fused_ops(x) and not torch.compiler.is_compiling()


def decode_runs_fused(model: nn.Module, cache: object) -> bool:
    """Whether a decode step of `model` (one token a sequence) over `cache` runs through keel::decoder_layers:
    the step-wide conditions for the model's dtype and device, and every layer and its stores."""
    with torch.inference_mode():
        probe = torch.empty(0, dtype=model.dtype, device=model.device)
        if not _enabled or not kernels.fused_ops(probe):
            return False
    attends = getattr(cache, "attends_in_place", None)
    for layer in model.layers.values():
        parts = _layer_parts(layer, 1)
        if parts is None or attends is None or not attends(parts[0].layer):
            return False
    return True


def _layer_parts(layer: nn.Module, tokens: int) -> tuple | None:
    """(attention, its submodules, the projections' kernel arguments) of a layer whose block the operator runs on
    `tokens` rows, or None."""
    children = layer._modules
    attn, mlp = children.get("self_attn"), children.get("mlp")  # None where a layer lacks one (not a child)
    if type(attn) is not Attention or type(mlp) is not SwiGLU:  # a layer without one of the two (None) too
        return None
    if attn.q_multiplier is not None or layer.residual_multiplier != 1.0 or layer.normed_residual is not None:
        return None  # Granite's scalars: the modules run them
    if children.get("mamba") is not None or (mlp.gate_multiplier, mlp.down_multiplier) != (1.0, 1.0):
        return None  # Falcon-H1's mixer beside the attention and its MLP multipliers: the modules'
    if attn.softcap is not None or attn.sinks is not None or attn.alibi is not None:
        return None  # Gemma 2's score soft-capping, GPT-OSS's sinks, ALiBi: keel::decoder_layers does none
    if attn.v_head_dim != attn.head_dim or attn.value_scale != 1.0:
        return None  # MiMo-V2-Flash's narrower, scaled values: the operator's are as wide as the keys
    # The kernel's block is Llama's: RMSNorms before the sublayers, sequential residuals, SwiGLU, rotary over
    # whole heads, q/k norms per head; the modules run the other blocks.
    if layer.parallel_residual or layer.attn_output_norm is not None or not isinstance(layer.input_layernorm, RMSNorm):
        return None
    if layer.norm_after_residual:  # OPT-350m's norms after the residual adds
        return None
    if mlp.act != "silu" or attn.rotary_dim != attn.head_dim or attn.qk_norm_whole or attn.sliding_rope:
        return None
    if attn.clip_qkv is not None:  # OLMo's clamp of q, k and v: the operator has none
        return None
    if attn.q_norm is not None and not attn.qk_norm_plain:  # LayerNorms, or a weight per head: the modules'
        return None
    if attn.qk_norm_after_rope:  # HunYuan's q/k norms after the rotary embedding: the operator norms before it
        return None
    if not attn.rotates:  # a NoPE layer (SmolLM3): the operator always rotates
        return None
    if attn.scales_queries or attn.qk_l2_eps is not None:  # Llama 4's temperature and q/k norm: the modules' own
        return None
    if attn.output_gate is not None:  # Qwen3.5's gated output: the modules'
        return None
    if attn.attn_sub_norm is not None or mlp.ffn_sub_norm is not None:  # BitNet's sub-norms: the modules'
        return None
    if attn.k_eq_v or attn.v_norm_eps is not None or layer.layer_scalar is not None:  # Gemma 4's: the modules'
        return None
    if layer.per_layer_input_gate is not None or attn.kv_source != attn.layer:  # Gemma 4's PLE, KV sharing
        return None
    if layer.altup is not None or layer.laurel is not None or mlp.sparsity_std is not None:  # Gemma 3n's: the modules'
        return None
    if layer.input_layernorm.offset:  # Gemma's (1 + w) scale
        return None
    parts, mlp_parts = attn._modules, mlp._modules
    qkv, gate_up = parts.get("qkv_proj"), mlp_parts.get("gate_up_proj")
    if qkv is None or gate_up is None:
        return None
    projections = [_projection(m, tokens) for m in (qkv, parts["o_proj"], gate_up, mlp_parts["down_proj"])]
    return None if None in projections else (attn, parts, projections)


def _layer_args(layer: nn.Module, tokens: int, cache: object) -> tuple | None:
    """(tensors, ints, floats, stores) of one layer as keel::decoder_layers takes them, or None where
    the layer or its cache is not one the operator runs.

    Submodules and tensors are read from the modules' `_modules` / `_parameters` dicts: nn.Module's
    attribute lookup costs ~1 us a read, ~25 reads a layer, on every layer of every step."""
    found = _layer_parts(layer, tokens)
    if found is None:
        return None
    attn, parts, projections = found
    children = layer._modules
    in_place = getattr(cache, "in_place", None)
    stores = in_place(attn.layer, tokens) if in_place is not None else None
    if stores is None:
        return None
    head_dim = attn.head_dim
    q_size, kv_size = attn.qkv_sizes[0], attn.qkv_sizes[1]
    norms = (
        children["input_layernorm"],
        children["post_attention_layernorm"],
        parts.get("q_norm"),
        parts.get("k_norm"),
    )
    tensors = [t for p in projections for t in p[:4]] + [_weight(n) for n in norms]
    ints = [p[i] for i in (4, 5, 6) for p in projections]
    ints += [q_size // head_dim, kv_size // head_dim, head_dim, stores.block_size, attn.window or 0]
    floats = [n.eps if n is not None else 0.0 for n in norms] + [head_dim**-0.5]
    return tensors, ints, floats, stores, attn.layer


def _run(x: Tensor, meta: AttentionMetadata, args: list[tuple]) -> Tensor | None:
    """keel::decoder_layers over the layers whose `_layer_args` are `args`, or None when their stores
    do not share the step's slots and rows (one plan for every layer)."""
    stack = _Stack.of(args)
    return None if stack is None else stack.run(x, meta, args[0][3])


class _Stack:
    """The flat argument lists of keel::decoder_layers for some layers, less the step's slots and rows."""

    def __init__(
        self, tensors: list, ints: list[int], floats: list[float], stores: list[list[Tensor]], first: int
    ) -> None:
        self.tensors, self.ints, self.floats = tensors, ints, floats
        # Each layer's K and V stores, then (int8 stores) their scales, or no scales: lists of tensors.
        self.keys, self.values, self.key_scales, self.value_scales = stores
        self.first = first  # the first layer's index in the cache: its `in_place` hands over a step's rows
        self.held: object | None = None  # the lists on the C++ side (`hold`)

    def hold(self) -> None:
        """Convert the lists once into a keel.DecoderStack for the steps to come: passed on each call,
        their ~20 entries a layer cost ~0.25 us each to convert (docs/BENCHMARKS.md, seventh part)."""
        self.held = torch.classes.keel.DecoderStack(
            self.tensors, self.ints, self.floats, self.keys, self.values, self.key_scales, self.value_scales
        )

    @classmethod
    def of(cls, args: list[tuple]) -> _Stack | None:
        first = args[0][3]
        if any(a[3].slots is not first.slots or a[3].rows is not first.rows for a in args[1:]):
            return None
        scaled = [a[3].key_scales is not None for a in args]
        if any(scaled) and not all(scaled):
            return None
        stores = [[a[3].keys for a in args], [a[3].values for a in args]]
        stores += [[a[3].key_scales for a in args], [a[3].value_scales for a in args]] if all(scaled) else [[], []]
        return cls(
            [t for a in args for t in a[0]],
            [i for a in args for i in a[1]],
            [f for a in args for f in a[2]],
            stores,
            args[0][4],
        )

    def run(self, x: Tensor, meta: AttentionMetadata, stores: object) -> Tensor:
        cos, sin = meta.rope
        rows = stores.rows
        if self.held is not None:
            return self.held.run(x, cos, sin, stores.slots, rows.tables, rows.table_of, rows.positions)
        return torch.ops.keel.decoder_layers(
            x, self.tensors, self.ints, self.floats, cos, sin, self.keys, self.values, self.key_scales,
            self.value_scales, stores.slots, rows.tables, rows.table_of, rows.positions,
        )  # fmt: skip


# Building a stack's lists costs ~45 us a layer inside a step (module and dict reads on caches the
# weights have swept): they are kept per layers container, cache and step size, and dropped when any
# module, parameter or buffer anywhere is assigned (torch's global registration hooks bump
# `_generation`) or `invalidate()` is called (keel.quant.apply.set_activations: activation passes are
# plain attributes).
_generation = 0
_MAX_SIZES = 16  # step sizes kept per container (decode batches, prefill chunks)


def invalidate(*_args: object) -> None:
    """Forget every kept stack (the layers' modules or settings changed)."""
    global _generation
    _generation += 1


torch.nn.modules.module.register_module_module_registration_hook(invalidate)
torch.nn.modules.module.register_module_parameter_registration_hook(invalidate)
torch.nn.modules.module.register_module_buffer_registration_hook(invalidate)


def fused_forward(layer: nn.Module, x: Tensor, meta: AttentionMetadata) -> Tensor | None:
    """`layer(x, meta)` through keel::decoder_layers, or None where that cannot run (see the module doc)."""
    if not _ready(x, meta):
        return None
    args = _layer_args(layer, x.shape[1], meta.cache)
    return None if args is None else _run(x, meta, [args])


def fused_layers(layers: nn.ModuleDict, x: Tensor, meta: AttentionMetadata) -> Tensor | None:
    """Every layer of `layers` in turn through one keel::decoder_layers call (one Python call for the
    whole stack: a call a layer runs on caches that the layer's weights have just swept), or None
    where any of them cannot run there (then each layer takes `fused_forward` or its modules)."""
    if not _ready(x, meta) or not len(layers):
        return None
    cache, tokens = meta.cache, x.shape[1]
    kept = layers.__dict__.get("_keel_stacks")
    # The container's id too: a deep copy of the model carries the attribute with its own tensors.
    if kept is None or kept[0] != _generation or kept[1]() is not cache or kept[2] != id(layers):
        kept = (_generation, weakref.ref(cache), id(layers), {})
        layers.__dict__["_keel_stacks"] = kept  # a plain attribute: not a registered module or tensor
    sizes = kept[3]
    if tokens in sizes:
        stack = sizes[tokens]
        if stack is None:
            return None
        stores = cache.in_place(stack.first, tokens)  # this step's slots and rows
        return None if stores is None else stack.run(x, meta, stores)
    args = []
    for layer in layers.values():
        one = _layer_args(layer, tokens, cache)
        if one is None:
            break
        args.append(one)
    stack = _Stack.of(args) if len(args) == len(layers) else None
    if stack is not None:
        stack.hold()  # kept for the steps to come
    if len(sizes) >= _MAX_SIZES:
        sizes.clear()
    sizes[tokens] = stack
    return None if stack is None else stack.run(x, meta, args[0][3])
