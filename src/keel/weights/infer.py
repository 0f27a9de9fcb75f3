"""A ModelConfig recovered from the tensor names and shapes of an HF checkpoint without config.json.

Shapes fix the structure: layer count, widths, vocabulary, experts, which layers are sparse, biases,
q/k norm, a tied head and the stored dtype. They do not fix the numbers that only scale activations
(rms_norm_eps, rope_theta and scaling, sliding window, top-k of the router, ...): those take the
defaults of the transformers config class of the detected family and are marked "default" in the
provenance, so that `keel inspect` can say which values are guesses.

Head count is the one structural value shapes leave open: q_proj is [heads * head_dim, hidden] and
any split of that width fits. Qwen3-style q_norm weights have length head_dim and settle it;
otherwise the user passes --head-dim or --num-heads.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

from keel.config import FAMILY_DEFAULTS, ModelConfig, RopeScaling
from keel.errors import ConfigError

EMBED = "model.embed_tokens.weight"
LM_HEAD = "lm_head.weight"
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_EXPERT = re.compile(r"^(model\.layers\.\d+\.(?:mlp|block_sparse_moe))\.experts\.(\d+)\.")

# safetensors storage type -> keel dtype name (the checkpoint's own dtype).
_STORED_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float32"}


# Fields shapes never determine: always the family default.
UNRECOVERABLE = (
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "max_position_embeddings",
    "sliding_window",
    "layer_types",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
)


class ShapeReader(Protocol):
    """What inference needs of a checkpoint: HF tensor names, shapes and storage types."""

    def names(self) -> set[str]: ...

    def shape(self, name: str) -> tuple[int, ...]: ...

    def dtype(self, name: str) -> str: ...


def infer_config(
    reader: ShapeReader,
    head_dim: int | None = None,
    num_heads: int | None = None,
    source: str = "",
) -> tuple[ModelConfig, dict[str, str]]:
    """ModelConfig from tensor shapes, and the provenance of each field: "inferred" | "hint" | "default"."""
    tensors = _Tensors(reader, source or str(getattr(reader, "directory", "checkpoint")))
    layers = _layer_indices(tensors)
    vocab, hidden, tie = _embedding(tensors)
    attention = _attention(tensors, layers)
    provenance: dict[str, str] = {}
    head_dim, num_heads, num_kv_heads = _head_counts(tensors, attention, head_dim, num_heads, provenance)
    mlp = _mlp(tensors, layers)
    family, family_known = _family(
        mlp.moe, attention.qk_norm, attention.qkv_bias, attention.o_bias, mlp.bias, tensors.fail
    )
    provenance["architecture"] = "inferred" if family_known else "default"
    defaults = FAMILY_DEFAULTS[family]
    intermediate = _intermediate_size(tensors, mlp, family, defaults, provenance)
    config = ModelConfig(
        architecture=family,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_layers=len(layers),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=defaults["rms_norm_eps"],
        rope_theta=defaults["rope_theta"],
        rope_scaling=RopeScaling(),
        max_position_embeddings=defaults["max_position_embeddings"],
        tie_word_embeddings=tie,
        qkv_bias=attention.qkv_bias,
        o_bias=attention.o_bias,
        mlp_bias=mlp.bias,
        qk_norm=attention.qk_norm,
        # Mistral's sliding window (and Qwen's opt-in one) leaves no trace in the weights.
        sliding_window=None,
        bos_token_id=defaults["bos_token_id"],
        eos_token_id=list(defaults["eos_token_id"]),
        dtype=_STORED_DTYPES.get(reader.dtype(EMBED), "float32"),
        **_moe_fields(mlp.moe, defaults, len(layers), provenance),
    )
    _refuse_unplaced(tensors, config)
    for name in UNRECOVERABLE:
        provenance[name] = "default"
    for name in ModelConfig.__dataclass_fields__:
        provenance.setdefault(name, "inferred")
    return config, provenance


def _refuse_unplaced(tensors: _Tensors, config: ModelConfig) -> None:
    """Tensors the inferred structure has no place for (a LayerNorm's bias, a norm after a sublayer: another
    family's block) mean the shapes alone do not tell the model: refuse rather than load it without them."""
    import torch

    from keel.model.transformer import Transformer
    from keel.weights.names import hf_source

    names = tensors.names
    with torch.device("meta"):
        expected = {n for key in Transformer(config).state_dict() for n in hf_source(config, key, names).names}
    unplaced = sorted(n for n in names if n not in expected and not n.endswith("rotary_emb.inv_freq"))
    if unplaced:
        more = f" and {len(unplaced) - 3} more" if len(unplaced) > 3 else ""
        raise tensors.fail(
            f"tensors {', '.join(unplaced[:3])}{more} have no place in the {config.architecture} block inferred from "
            "shapes; add the checkpoint's config.json"
        )


class _Tensors:
    """The checkpoint's tensor names and shapes, with errors that name the checkpoint."""

    def __init__(self, reader: ShapeReader, source: str) -> None:
        self.reader = reader
        self.source = source
        self.names = reader.names()

    def fail(self, message: str) -> ConfigError:
        return ConfigError(f"{self.source}: {message}")

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self.names:
            raise self.fail(f"tensor {name!r} is missing; cannot infer the model structure")
        return tuple(self.reader.shape(name))

    def same_in_every_layer(self, what: str, values: list[Any]) -> Any:
        # keel builds every layer alike; a checkpoint that varies per layer is not one it can run.
        if any(v != values[0] for v in values):
            raise self.fail(f"{what} differs between layers ({values}); keel needs the same in every layer")
        return values[0]


class _Attention(NamedTuple):
    q_width: int
    kv_width: int
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool


class _Mlp(NamedTuple):
    moe: dict[str, Any]  # what _experts found
    dense_layers: list[int]
    dense_widths: list[int]
    bias: bool


def _layer_indices(tensors: _Tensors) -> list[int]:
    """The decoder layers 0..N-1, checked to be a decoder with no gap in its layers."""
    layers = sorted({int(m.group(1)) for n in tensors.names if (m := _LAYER.match(n))})
    if EMBED not in tensors.names or not layers:
        raise tensors.fail(
            "no config.json, and the tensors do not look like a decoder "
            f"(expected {EMBED} and model.layers.N.*); cannot infer the model structure"
        )
    if layers != list(range(len(layers))):
        missing = sorted(set(range(layers[-1] + 1)) - set(layers))
        raise tensors.fail(f"layer {missing[0]} has no tensors (layers 0..{layers[-1]} expected)")
    return layers


def _embedding(tensors: _Tensors) -> tuple[int, int, bool]:
    """(vocab, hidden, tied head) from the embedding, checked against lm_head where there is one."""
    vocab, hidden = tensors.shape(EMBED)
    tie = LM_HEAD not in tensors.names
    if not tie and tensors.shape(LM_HEAD) != (vocab, hidden):
        raise tensors.fail(
            f"{LM_HEAD} has shape {list(tensors.shape(LM_HEAD))}, expected {[vocab, hidden]} from {EMBED}"
        )
    return vocab, hidden, tie


def _attn(layer: int, part: str) -> str:
    return f"model.layers.{layer}.self_attn.{part}"


def _attention(tensors: _Tensors, layers: list[int]) -> _Attention:
    """Projection widths, biases and q/k norm of the attention, the same in every layer."""
    if _attn(0, "kv_a_proj_with_mqa.weight") in tensors.names:
        # The rope/nope split of each head, YaRN and the router's groups and scaling are not in the shapes.
        raise tensors.fail(
            "multi-head latent attention tensors (DeepSeek, self_attn.kv_a_proj_with_mqa): this architecture "
            "needs its config.json; structure from shapes alone is not supported"
        )
    same = tensors.same_in_every_layer
    q_width = same("q_proj width", [tensors.shape(_attn(i, "q_proj.weight"))[0] for i in layers])
    kv_width = same("k_proj width", [tensors.shape(_attn(i, "k_proj.weight"))[0] for i in layers])
    if (v_width := tensors.shape(_attn(0, "v_proj.weight"))[0]) != kv_width:
        raise tensors.fail(f"v_proj width {v_width} differs from k_proj width {kv_width}")

    def present(part: str) -> bool:
        found = [_attn(i, part) in tensors.names for i in layers]
        return bool(same(f"presence of self_attn.{part}", found))

    qkv_bias = present("q_proj.bias")
    o_bias = present("o_proj.bias")
    qk_norm = present("q_norm.weight")
    if qk_norm and not present("k_norm.weight"):
        raise tensors.fail("self_attn.q_norm.weight is present but self_attn.k_norm.weight is not")
    return _Attention(q_width, kv_width, qkv_bias, o_bias, qk_norm)


def _head_counts(
    tensors: _Tensors,
    attention: _Attention,
    head_dim: int | None,
    num_heads: int | None,
    provenance: dict[str, str],
) -> tuple[int, int, int]:
    """(head_dim, num_heads, num_kv_heads), the query heads checked to share the key/value heads evenly."""
    q_width, kv_width = attention.q_width, attention.kv_width
    head_dim, num_heads = _heads(
        q_width, kv_width, head_dim, num_heads, attention.qk_norm, tensors.shape, provenance, tensors.fail
    )
    num_kv_heads = kv_width // head_dim
    provenance["num_kv_heads"] = "inferred"
    if num_heads % num_kv_heads:
        raise tensors.fail(
            f"{num_heads} query heads cannot share {num_kv_heads} key/value heads evenly "
            f"(head_dim {head_dim}, q width {q_width}, k/v width {kv_width})"
        )
    return head_dim, num_heads, num_kv_heads


def _mlp(tensors: _Tensors, layers: list[int]) -> _Mlp:
    """The experts, the dense layers and their widths, and whether the dense MLP has biases."""
    moe = _experts(tensors.names, layers, tensors.shape, tensors.fail)
    dense_layers = [i for i in layers if i not in moe["sparse_layers"]]
    dense_widths = [tensors.shape(f"model.layers.{i}.mlp.gate_proj.weight")[0] for i in dense_layers]
    bias = bool(dense_layers) and f"model.layers.{dense_layers[0]}.mlp.gate_proj.bias" in tensors.names
    return _Mlp(moe, dense_layers, dense_widths, bias)


def _intermediate_size(
    tensors: _Tensors, mlp: _Mlp, family: str, defaults: dict[str, Any], provenance: dict[str, str]
) -> int:
    """The dense MLP width; Mixtral's is its expert width, and an all-sparse model takes the family default."""
    intermediate = tensors.same_in_every_layer("mlp width", mlp.dense_widths) if mlp.dense_widths else 0
    provenance["intermediate_size"] = "inferred"
    if mlp.moe["num_experts"] and family == "mixtral":
        if mlp.dense_layers:
            raise tensors.fail(
                f"Mixtral-style experts, but layers {mlp.dense_layers} are dense; Mixtral has no dense layers"
            )
        intermediate = mlp.moe["width"]  # Mixtral's config has one width, used by every expert
    elif mlp.moe["num_experts"] and not mlp.dense_layers:
        intermediate = defaults["intermediate_size"]
        provenance["intermediate_size"] = "default"
    return intermediate


def _moe_fields(
    moe: dict[str, Any], defaults: dict[str, Any], num_layers: int, provenance: dict[str, str]
) -> dict[str, Any]:
    """The ModelConfig fields of the experts (none for a dense model)."""
    if not moe["num_experts"]:
        return {}
    step, mlp_only = _sparse_pattern(moe["sparse_layers"], num_layers)
    provenance["num_experts_per_tok"] = provenance["norm_topk_prob"] = "default"
    return {
        "num_experts": moe["num_experts"],
        # The router's top-k is in no tensor: the family default, capped by the expert count.
        "num_experts_per_tok": min(defaults["num_experts_per_tok"], moe["num_experts"]),
        "moe_intermediate_size": moe["width"],
        "norm_topk_prob": defaults["norm_topk_prob"],
        "shared_expert_intermediate_size": moe["shared_width"],
        "decoder_sparse_step": step,
        "mlp_only_layers": mlp_only,
    }


def _heads(
    q_width: int,
    kv_width: int,
    head_dim: int | None,
    num_heads: int | None,
    qk_norm: bool,
    shape: Callable[[str], tuple[int, ...]],
    provenance: dict[str, str],
    fail: Callable[[str], ConfigError],
) -> tuple[int, int]:
    """(head_dim, num_heads) from q_norm's length or the hints, checked against the projection widths."""
    widths = f"q_proj width {q_width}, k/v_proj width {kv_width}"
    for flag, value in (("--head-dim", head_dim), ("--num-heads", num_heads)):
        if value is not None and value <= 0:
            raise fail(f"{flag} must be positive, got {value}")
    if qk_norm:
        norm_shape = shape("model.layers.0.self_attn.q_norm.weight")
        if len(norm_shape) != 1:  # Command R+'s [heads, head_dim]: LayerNorm or RMSNorm, the shapes cannot tell
            raise fail(f"q_norm weight {list(norm_shape)} (a weight per head) is not inferred from shapes")
        norm_dim = norm_shape[0]
        if head_dim is not None and head_dim != norm_dim:
            raise fail(f"--head-dim {head_dim} contradicts q_norm, whose length gives head_dim {norm_dim}")
        if num_heads is not None and num_heads * norm_dim != q_width:
            raise fail(f"--num-heads {num_heads} contradicts q_norm (head_dim {norm_dim}) and {widths}")
        if q_width % norm_dim or kv_width % norm_dim:
            raise fail(f"q_norm length {norm_dim} does not divide the projection widths ({widths})")
        head_dim, source = norm_dim, "inferred"
    elif head_dim is not None:
        if q_width % head_dim or kv_width % head_dim:
            raise fail(f"--head-dim {head_dim} does not divide the projection widths ({widths})")
        if num_heads is not None and num_heads * head_dim != q_width:
            raise fail(f"--num-heads {num_heads} x --head-dim {head_dim} != q_proj width {q_width}")
        source = "hint"
    elif num_heads is not None:
        if q_width % num_heads or kv_width % (q_width // num_heads):
            raise fail(f"--num-heads {num_heads} does not divide the projection widths ({widths})")
        head_dim, source = q_width // num_heads, "inferred"
    else:
        candidates = ", ".join(map(str, _head_dim_candidates(q_width, kv_width))) or "none"
        raise fail(
            f"no config.json, and the head count is ambiguous from tensor shapes ({widths}); "
            f"pass --head-dim (values that divide both: {candidates}) or --num-heads"
        )
    if head_dim % 2:
        raise fail(f"head_dim {head_dim} is odd; rotary embeddings need an even head_dim ({widths})")
    provenance["head_dim"] = source
    # Hints are recorded as such; with q_norm the count follows from the weights alone.
    provenance["num_heads"] = "hint" if num_heads is not None and not qk_norm else "inferred"
    return head_dim, q_width // head_dim


def _head_dim_candidates(q_width: int, kv_width: int) -> list[int]:
    """Even head sizes that split both widths (rotary embeddings need an even head_dim)."""
    if q_width % kv_width:
        return []
    return [d for d in range(2, kv_width + 1, 2) if kv_width % d == 0]


def _experts(
    names: set[str],
    layers: list[int],
    shape: Callable[[str], tuple[int, ...]],
    fail: Callable[[str], ConfigError],
) -> dict[str, Any]:
    """Experts of each layer: count, width, shared expert, naming style, which layers are sparse."""
    experts_of: dict[str, set[int]] = {}  # MoE block prefix -> expert indices with tensors (one pass)
    for name in names:
        if m := _EXPERT.match(name):
            experts_of.setdefault(m.group(1), set()).add(int(m.group(2)))
    sparse: list[int] = []
    counts, widths, shared_widths, styles = [], [], [], set()
    for i in layers:
        block = next((b for b in ("block_sparse_moe", "mlp") if f"model.layers.{i}.{b}.gate.weight" in names), None)
        if block is None:
            continue
        prefix = f"model.layers.{i}.{block}"
        num_experts = shape(f"{prefix}.gate.weight")[0]
        if f"{prefix}.experts.gate_up_proj" in names:  # stacked: [E, 2I, H]
            stacked = shape(f"{prefix}.experts.gate_up_proj")
            if stacked[0] != num_experts:
                raise fail(f"{prefix}.experts.gate_up_proj holds {stacked[0]} experts, the router {num_experts}")
            width = stacked[1] // 2
            styles.add("mixtral" if block == "block_sparse_moe" else "qwen")
        else:
            found = experts_of.get(prefix, set())
            if found != set(range(num_experts)):
                raise fail(f"{prefix}: the router has {num_experts} experts but expert tensors {sorted(found)} exist")
            if f"{prefix}.experts.0.w1.weight" in names:
                style, gate = "mixtral", "w1"
            else:
                style, gate = ("mixtral" if block == "block_sparse_moe" else "qwen"), "gate_proj"
            styles.add(style)
            width = shape(f"{prefix}.experts.0.{gate}.weight")[0]
        shared = 0
        if f"{prefix}.shared_expert.gate_proj.weight" in names:
            shared = shape(f"{prefix}.shared_expert.gate_proj.weight")[0]
            # keel (like Qwen2-MoE) scales the shared expert by a sigmoid gate; it must be there.
            if f"{prefix}.shared_expert_gate.weight" not in names:
                raise fail(f"{prefix}.shared_expert has no shared_expert_gate.weight")
        sparse.append(i)
        counts.append(num_experts)
        widths.append(width)
        shared_widths.append(shared)
    if not sparse:
        return {"num_experts": 0, "width": 0, "shared_width": 0, "style": None, "sparse_layers": []}
    for what, values in (
        ("expert count", counts),
        ("expert width", widths),
        ("shared expert width", shared_widths),
    ):
        if any(v != values[0] for v in values):
            raise fail(f"{what} differs between layers ({values}); keel needs the same in every sparse layer")
    if len(styles) > 1:
        raise fail("expert tensors mix Mixtral (block_sparse_moe / w1,w2,w3) and Qwen (mlp / gate_proj) naming")
    return {
        "num_experts": counts[0],
        "width": widths[0],
        "shared_width": shared_widths[0],
        "style": styles.pop(),
        "sparse_layers": sparse,
    }


def _family(
    moe: dict[str, Any],
    qk_norm: bool,
    qkv_bias: bool,
    o_bias: bool,
    mlp_bias: bool,
    fail: Callable[[str], ConfigError],
) -> tuple[str, bool]:
    """The keel family the features point to, and whether anything actually pointed there.

    A dense model without biases or q/k norm is Llama or Mistral; nothing in the weights tells them
    apart (only Mistral's sliding window does), so it is "llama", marked as a default.
    """
    features = (
        f"experts={moe['num_experts']}, shared expert={bool(moe['shared_width'])}, q_norm={qk_norm}, "
        f"q/k/v bias={qkv_bias}, o bias={o_bias}, mlp bias={mlp_bias}"
    )

    def unsupported() -> ConfigError:
        return fail(f"no supported architecture has this combination of tensors ({features})")

    if mlp_bias and (moe["num_experts"] or qk_norm or qkv_bias != o_bias):
        raise unsupported()
    if moe["num_experts"]:
        if moe["style"] == "mixtral":
            if qk_norm or qkv_bias or o_bias or moe["shared_width"]:
                raise unsupported()
            return "mixtral", True
        if moe["shared_width"]:
            if qk_norm or o_bias:
                raise unsupported()
            return "qwen2_moe", True
        if qk_norm and qkv_bias == o_bias:
            return "qwen3_moe", True
        raise unsupported()
    if qk_norm:
        if qkv_bias != o_bias:
            raise unsupported()
        return "qwen3", True
    if qkv_bias and not o_bias:
        return "qwen2", True
    if qkv_bias != o_bias:
        raise unsupported()
    # Biases on q/k/v/o or on the MLP exist only in Llama (attention_bias / mlp_bias).
    return "llama", qkv_bias or mlp_bias


def _sparse_pattern(sparse: list[int], num_layers: int) -> tuple[int, list[int]]:
    """(decoder_sparse_step, mlp_only_layers) that make exactly `sparse` the MoE layers.

    Several pairs can; take the one with the fewest mlp_only_layers (then the smallest step), which
    is how the Qwen MoE configs are written in practice (step 1, or a regular step, plus exceptions).
    """
    wanted = set(sparse)
    best: tuple[int, list[int]] | None = None
    for step in range(1, num_layers + 1):
        by_step = {i for i in range(num_layers) if (i + 1) % step == 0}
        if not wanted <= by_step:
            continue
        extra = sorted(by_step - wanted)
        if best is None or len(extra) < len(best[1]):
            best = (step, extra)
    assert best is not None  # step 1 covers every layer
    return best
