"""Replace a model's linear layers and MoE experts with quantized ones, in place.

Two entry points share the rules below (what is quantized, what is kept):
- `quantize_model(model, ...)`: after loading, from the float weights in memory;
- `load_model(..., quantize=...)` (keel.quant.on_load): while loading, straight from the checkpoint,
  so that the quantized layers never exist in float all at once (and GGUF blocks never do at all).
"""

from __future__ import annotations

from collections.abc import Iterable
from fnmatch import fnmatchcase

from torch import nn

from keel.errors import KeelError
from keel.model import fused_layer
from keel.model.mla import WEIGHT_READ_LINEARS
from keel.model.moe import GroupedExperts, MoE, _local
from keel.quant.experts import QuantizedGroupedExperts, experts_fit, float_parts
from keel.quant.linear import INT4_GROUP_SIZES, SCHEMES, QuantizedLinear, int4_fits, int8_fits

GGUF = "gguf"  # run a GGUF file's own Q4_0 ... Q6_K and MXFP4 blocks on the integer kernels (load time only)
LOAD_SCHEMES = (*SCHEMES, GGUF)
# Linear layers whose weight is also read as a matrix elsewhere, so they must stay float (keel.model.mla)
ALWAYS_FLOAT = WEIGHT_READ_LINEARS


def check_scheme(scheme: str, group_size: int) -> None:
    if scheme not in LOAD_SCHEMES:
        raise KeelError(f"--quantize: unknown scheme {scheme!r}; choose from {', '.join(LOAD_SCHEMES)}")
    if scheme == "int4" and group_size not in INT4_GROUP_SIZES:
        raise KeelError(f"--quant-group-size: int4 groups of {', '.join(map(str, INT4_GROUP_SIZES))}, not {group_size}")


def is_kept(name: str, keep: set[str] | tuple[str, ...] | None) -> bool:
    """Whether module `name` stays float: it matches a --quant-keep entry (a name, or a shell pattern
    such as `*.experts`) or must stay float (ALWAYS_FLOAT)."""
    return any(fnmatchcase(name, pattern) for pattern in (*(keep or ()), *ALWAYS_FLOAT))


def check_keep(model: nn.Module, keep: Iterable[str]) -> None:
    """Refuse a --quant-keep entry that matches no layer of `model`, the whole model (a pipeline stage checks
    against a skeleton of all of it): a misspelt name would otherwise quietly quantize the layer it meant to keep."""
    names = [name for name, _ in quantizable(model)] + ["embed_tokens"]
    for pattern in keep:
        if not any(fnmatchcase(name, pattern) for name in names):
            raise KeelError(
                f"--quant-keep {pattern!r}: matches no layer of this model (keel names them as {names[0]} "
                "and lm_head, without HF's 'model.' prefix; patterns such as 'layers.*.mlp.down_proj' match several)"
            )


def linear_fits(scheme: str, in_features: int, out_features: int, group_size: int) -> bool:
    """Whether the kernels take this shape; other layers stay float."""
    if scheme == "int8":
        return int8_fits(in_features)
    return int4_fits(in_features, out_features, group_size)


def quantizable(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every nn.Linear and GroupedExperts of `model`, in module order."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear | GroupedExperts)]


def float_bytes(module: nn.Module) -> int:
    if isinstance(module, GroupedExperts):
        return sum(_local(p).numel() * p.element_size() for p in (module.gate_up_proj, module.down_proj))
    return module.weight.numel() * module.weight.element_size()


ACTIVATIONS = ("refined", "int8")


def set_activations(model: nn.Module, activations: str) -> int:
    """How keel's block kernels quantize the activations of every block-layout layer of `model`:
    "int8" (one pass, as llama.cpp does: the fastest) or "refined" (int8 and its int8 residual, ~15
    bits: the float product's accuracy at twice the integer products). The number of layers set."""
    if activations not in ACTIVATIONS:
        raise KeelError(f"quant activations must be one of {', '.join(ACTIVATIONS)}, got {activations!r}")
    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear) and m.layout == "blocks"]
    for layer in layers:
        layer.activation_passes = 2 if activations == "refined" else 1
    fused_layer.invalidate()  # the fused stacks hold each layer's passes
    return len(layers)


def replace_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)


def new_stats() -> dict[str, int]:
    return {"quantized": 0, "kept": 0, "experts": 0, "bytes_before": 0, "bytes_after": 0}


def quantize_model(
    model: nn.Module, scheme: str, group_size: int = 128, keep: set[str] | None = None
) -> dict[str, int]:
    """Quantize every nn.Linear and every MoE expert block (GroupedExperts) of `model` except those
    kept (`keep`: names or shell patterns, a mixed-precision plan) and those whose shape the kernels
    cannot take. Returns {"quantized": n (layers + expert blocks), "kept": m, "experts": expert blocks
    quantized, "bytes_before": b0, "bytes_after": b1}.

    Embeddings stay float. The lm_head is a linear layer and is quantized unless kept; with tied
    embeddings it becomes its own (quantized) copy. A model already quantized while loading
    (`load_model(..., quantize=...)` or a checkpoint saved by `keel quantize save`) is left as it is
    and its load-time statistics returned; asking for another scheme is an error.
    """
    loaded = getattr(model, "quantization", None)
    if loaded is not None:
        if scheme != loaded["scheme"]:
            raise KeelError(
                f"--quantize {scheme}: this model was already quantized to {loaded['scheme']} while loading "
                f"({loaded['source']}); drop --quantize or load the float checkpoint"
            )
        return dict(loaded["stats"])
    check_scheme(scheme, group_size)
    if scheme == GGUF:
        raise KeelError(
            "--quantize gguf repacks a GGUF file's integer blocks while loading; it cannot apply to a model "
            "already loaded in float (load it with load_model(..., quantize='gguf'))"
        )
    keep = set(keep or ())
    stats = new_stats()
    for name, module in quantizable(model):
        before = float_bytes(module)
        stats["bytes_before"] += before
        if isinstance(module, GroupedExperts):
            gate_up, down = _local(module.gate_up_proj), _local(module.down_proj)
            hidden, inter = down.shape[1], down.shape[2]
            if is_kept(name, keep) or not experts_fit(scheme, hidden, inter, group_size):
                stats["kept"] += 1
                stats["bytes_after"] += before
                continue
            _refuse_offloaded(model, name)
            quantized: nn.Module = QuantizedGroupedExperts(
                [QuantizedLinear.from_float(w, scheme, group_size) for w in gate_up.detach()],
                [QuantizedLinear.from_float(w, scheme, group_size) for w in down.detach()],
                module.num_experts,
                *float_parts(module),
            )
            stats["experts"] += 1
        else:
            if is_kept(name, keep) or not linear_fits(scheme, module.in_features, module.out_features, group_size):
                stats["kept"] += 1
                stats["bytes_after"] += before
                continue
            quantized = QuantizedLinear(module, scheme, group_size)
        replace_module(model, name, quantized)
        stats["quantized"] += 1
        stats["bytes_after"] += quantized.weight_bytes
    return stats


def _refuse_offloaded(model: nn.Module, experts_name: str) -> None:
    """Expert offloading swaps float expert weights in and out of slot buffers; quantized experts
    have none. Expert parallelism (AllToAllDispatcher) composes: its experts are a plain local slice.
    A dispatcher says it swaps weights with a true `swaps_expert_weights` attribute (keel.serve's
    OffloadDispatcher does), so this layer need not know the serving classes."""
    moe = model.get_submodule(experts_name.rpartition(".")[0])
    if isinstance(moe, MoE) and getattr(moe.dispatcher, "swaps_expert_weights", False):
        raise KeelError(
            "--quantize with --expert-cache: offloaded experts cannot be quantized (offloading swaps float "
            "expert weights); keep them in float with --quant-keep 'lm_head,*.experts'"
        )


__all__ = ["GGUF", "LOAD_SCHEMES", "QuantizedGroupedExperts", "quantize_model"]


def quantize_kept(model: nn.Module, keep: set[str] | tuple[str, ...], scheme: str, group_size: int = 128) -> int:
    """A second tier of a mixed-precision plan: the linear layers the main scheme kept (they match
    `keep`) are quantized to `scheme` instead of staying float, e.g. an int4 model whose most
    sensitive layers (the head first) run in int8. Layers that must stay float (ALWAYS_FLOAT), whose
    shape the kernels cannot take, or that are already quantized are left as they are. Returns the
    number of layers quantized."""
    if scheme not in SCHEMES:
        raise KeelError(f"--quant-keep-as: {scheme!r} is not one of {', '.join(SCHEMES)}")
    done = 0
    for name, module in [(n, m) for n, m in model.named_modules() if type(m) is nn.Linear]:
        if not any(fnmatchcase(name, pattern) for pattern in keep) or is_kept(name, ()):
            continue
        if not linear_fits(scheme, module.in_features, module.out_features, group_size):
            continue
        replace_module(model, name, QuantizedLinear(module, scheme, group_size))
        done += 1
    return done
