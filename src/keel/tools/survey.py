"""`keel inspect` on a checkpoint of a family keel does not know: what keel could place and what not.

For an HF directory whose `architectures` no family claims, or a GGUF file whose `general.architecture`
keel does not read, the tensors are sorted by role (embedding, attention, MLP, experts and router,
norms, head) from their names, with layer and expert numbers folded to N, and the names no role
claims are listed; so are the metadata keys keel's common reading does not use (config.json keys, or
the GGUF keys under the architecture's prefix, named from the gguf package's constants). What is left
unplaced is what the family file has to translate (docs/ARCHITECTURE.md, "Adding a family").
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from keel.config import HF_ARCHITECTURES, MLLAMA_TEXT_ALONE, TEXT_MODEL_OF
from keel.weights.gguf import ARCHITECTURES as GGUF_ARCHITECTURES
from keel.weights.gguf import KEYS_READ as GGUF_KEYS_READ

# Role -> a pattern on a tensor name; the first role that matches takes it (norms before the
# sublayers they sit in, experts and the router before the dense MLP).
ROLES: list[tuple[str, re.Pattern[str]]] = [
    ("norm", re.compile(r"norm|(^|\.)ln_|layernorm")),
    ("embedding", re.compile(r"embed_tokens|embed_in|(^|\.)wte\.|word_embeddings|token_embd")),
    ("head", re.compile(r"^lm_head\.|^embed_out\.|^output\.weight")),
    ("experts", re.compile(r"experts|_exps\.|shared_expert|_shexp")),
    ("router", re.compile(r"\.gate\.weight$|router|ffn_gate_inp")),
    (
        "attention",
        re.compile(r"self_attn|attention|(^|\.)attn[._]|q_proj|k_proj|v_proj|o_proj|qkv|query_key_value|c_attn"),
    ),
    ("mlp", re.compile(r"mlp|ffn|feed_forward|dense_h_to_4h|dense_4h_to_h|(^|\.)fc\d|c_fc")),
]
# config.json keys keel's common reading uses, and keys that do not change the model's numbers.
_HF_READ = {
    "architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "rope_parameters",
    "rope_scaling", "max_position_embeddings", "tie_word_embeddings", "attention_bias", "mlp_bias", "sliding_window",
    "layer_types", "bos_token_id", "eos_token_id", "pad_token_id", "dtype", "torch_dtype", "hidden_act",
}  # fmt: skip
_HF_NEUTRAL = re.compile(
    r"dropout|pdrop|initializer_range|^use_cache$|^transformers_version$|^_name_or_path$|^output_|^return_dict$"
    r"|^is_encoder_decoder$|^is_decoder$|^tokenizer_class$|^chunk_size_feed_forward$|^problem_type$|^auto_map$"
)
_NUMBER = re.compile(r"(?<=\.)\d+(?=\.)")
# The HF names keel's Llama-style block reads as they are (other families rename through keel.families).
_KEEL_NAME = re.compile(
    r"^(model\.(embed_tokens|norm)|lm_head|model\.layers\.N\.(input_layernorm|post_attention_layernorm"
    r"|self_attn\.(q_proj|k_proj|v_proj|o_proj|q_norm|k_norm)|mlp\.(gate_proj|up_proj|down_proj)))\.(weight|bias)$"
)


def _gguf_keys_read(arch: str) -> set[str]:
    """The keys under the architecture's prefix that keel's GGUF reading uses (keel.weights.gguf.KEYS_READ)."""
    return {key.format(arch=arch) for key in GGUF_KEYS_READ}


def unknown_family(path: Path) -> dict[str, Any] | None:
    """The survey of a checkpoint whose family keel does not know; None when keel knows it (or when
    `path` is neither an HF directory with config.json nor a GGUF file: the loader says what it is)."""
    if path.is_dir() and (path / "config.json").is_file():
        try:
            hf = json.loads((path / "config.json").read_text())
        except (OSError, json.JSONDecodeError, UnicodeDecodeError):
            return None
        if not isinstance(hf, dict):
            return None
        archs = hf.get("architectures") or []
        if any(a in HF_ARCHITECTURES or a in TEXT_MODEL_OF or a in MLLAMA_TEXT_ALONE for a in archs):
            return None
        from keel.weights.safetensors import SafetensorsReader

        reader = SafetensorsReader(path)
        try:
            names = sorted(reader.names())
        finally:
            reader.close()
        label = ", ".join(archs) or f"model_type {hf.get('model_type')!r}"
        keys = sorted(k for k in hf if k not in _HF_READ and not _HF_NEUTRAL.search(k))
        return _survey(f"HF architecture {label}", names, keys, sorted(HF_ARCHITECTURES))
    if path.is_file() and path.suffix == ".gguf":
        from gguf import GGUFReader

        try:
            reader = GGUFReader(str(path))
        except Exception:  # empty, truncated or not GGUF at all: the loader names the problem in one line
            return None
        field = reader.fields.get("general.architecture")
        arch = bytes(field.parts[field.data[0]]).decode() if field is not None else "?"
        if arch in GGUF_ARCHITECTURES:
            return None
        read = _gguf_keys_read(arch)
        keys = sorted(k for k in reader.fields if k.startswith(f"{arch}.") and k not in read)
        return _survey(
            f"GGUF architecture {arch!r}", [t.name for t in reader.tensors], keys, sorted(GGUF_ARCHITECTURES)
        )
    return None


def _survey(label: str, names: list[str], keys: list[str], known: list[str]) -> dict[str, Any]:
    placed: dict[str, dict[str, int]] = {}
    unplaced: dict[str, int] = {}
    for name in names:
        pattern = _NUMBER.sub("N", name)
        role = next((role for role, rx in ROLES if rx.search(pattern)), None)
        bucket = unplaced if role is None else placed.setdefault(role, {})
        bucket[pattern] = bucket.get(pattern, 0) + 1
    return {"architecture": label, "known": known, "placed": placed, "unplaced": unplaced, "unread_keys": keys}


def format_survey(survey: dict[str, Any]) -> str:
    lines = [f"{survey['architecture']}: no keel family reads it (keel's: {', '.join(survey['known'])})", ""]
    lines.append("tensors keel could place, by role (N: a layer or expert number; xK: K such tensors;")
    lines.append("'new': a tensor of that role that keel's block does not have under that name):")
    for role, _ in ROLES:
        for pattern, count in survey["placed"].get(role, {}).items():
            tag = "" if _KEEL_NAME.match(pattern) else "  new"
            lines.append(f"  {role:<10} {pattern}" + (f"  x{count}" if count > 1 else "") + tag)
    lines.append("tensors keel could not place:" + ("" if survey["unplaced"] else " none"))
    for pattern, count in survey["unplaced"].items():
        lines.append(f"  {pattern}" + (f"  x{count}" if count > 1 else ""))
    lines.append("metadata keys keel does not read:" + ("" if survey["unread_keys"] else " none"))
    lines += [f"  {key}" for key in survey["unread_keys"]]
    lines += ["", "a family file turns these into keel's config and names: docs/ARCHITECTURE.md, 'Adding a family'"]
    return "\n".join(lines)
