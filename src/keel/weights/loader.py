"""Open any model keel understands and fill a keel model's weights from it.

MODEL may be an HF directory (config.json + safetensors), a directory of safetensors without a
config (structure inferred from tensor shapes), a `.gguf` file, a `keel train` checkpoint or a
catalog name. Building the whole model, quantized or not, is keel.quant.loading's `load_model`: it
sits above keel.quant, which this module must not import.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import Tensor

from keel.catalog import CATALOG, resolve_catalog
from keel.config import MLLAMA_TEXT_ALONE, ModelConfig
from keel.errors import KeelError, WeightsError
from keel.families import checkpoint_layout, zero_when_absent
from keel.families.parts import Transposed
from keel.model.transformer import Transformer
from keel.tokenizer import Tokenizer
from keel.weights.checkpoint import Checkpoint, TensorReader
from keel.weights.names import TRANSPOSED_EXPERTS, hf_source
from keel.weights.parts import PartsReader
from keel.weights.quant_format import check_saved_quantization


def resolve_path(model: str | Path) -> Path:
    """A path on disk, or the file behind a catalog name."""
    path = Path(model)
    if path.exists():
        return path
    if str(model) in CATALOG:
        return resolve_catalog(str(model))
    known = ", ".join(CATALOG)
    raise KeelError(f"{model}: no such file or directory, and not a catalog name (catalog: {known})")


def open_checkpoint(model: str | Path, head_dim: int | None = None, num_heads: int | None = None) -> Checkpoint:
    path = resolve_path(model)
    if path.is_file():
        if path.suffix == ".gguf" or _has_gguf_magic(path):
            from keel.weights.gguf import open_gguf

            return open_gguf(path)
        raise KeelError(f"{path}: not a model (expected an HF directory, a .gguf file or a catalog name)")
    from keel.weights.dcp import DCPReader, is_dcp_checkpoint
    from keel.weights.safetensors import SafetensorsReader

    config_path = path / "config.json"
    if is_dcp_checkpoint(path):  # a `keel train` checkpoint directory
        if not config_path.exists():
            raise KeelError(f"{path}: a training checkpoint without config.json (not written by keel train?)")
        config = ModelConfig.from_json_file(config_path)
        reader = DCPReader(path, config)
        if config.architecture in TRANSPOSED_EXPERTS:  # its HF names hold the experts in the family's layout
            from keel.weights.gpt_oss import GptOssReader

            reader = GptOssReader(reader, interleaved=TRANSPOSED_EXPERTS[config.architecture])
        tokenizer = Tokenizer.from_hf_dir(path, eos_token_ids=config.eos_token_id)
        sizes = {}
        for name in reader.names():
            tensor = reader.get(name)
            sizes[reader.dtype(name)] = sizes.get(reader.dtype(name), 0) + tensor.numel() * tensor.element_size()
        return Checkpoint(path, "keel-dcp", config, reader, tokenizer, dict.fromkeys(_FIELDS, "read"), sizes)
    reader = _text_model(SafetensorsReader(path))
    quantization = None
    if config_path.exists():
        config, quantization = _read_config(config_path)
        if _outer_architectures(config_path) & TRANSPOSED_TEXT_EXPERTS:
            reader = _transposed_experts(reader, config)
        if _outer_architectures(config_path) & ERNIE_VL:
            reader = _ernie_vl_text_experts(reader)
        if _is_mllama(config_path):
            reader = _mllama_self_attention_layers(reader, config_path, config)
        layout = checkpoint_layout(config)
        if layout:
            reader = PartsReader(reader, layout)
        if config.architecture in TRANSPOSED_EXPERTS:  # experts transposed (GPT-OSS's interleaved, maybe MXFP4)
            from keel.weights.gpt_oss import GptOssReader

            reader = GptOssReader(reader, interleaved=TRANSPOSED_EXPERTS[config.architecture])
        provenance = dict.fromkeys(_FIELDS, "read")
        fmt = "hf"
    else:
        from keel.weights.infer import infer_config

        config, provenance = infer_config(reader, head_dim=head_dim, num_heads=num_heads, source=str(path))
        fmt = "hf-shapes"
    tokenizer = Tokenizer.from_hf_dir(path, eos_token_ids=config.eos_token_id)
    sizes: dict[str, int] = {}
    for name in reader.names():
        dtype = reader.dtype(name)
        numel = 1
        for d in reader.shape(name):
            numel *= d
        sizes[dtype] = sizes.get(dtype, 0) + numel * _SAFETENSORS_BYTES.get(dtype, 4)
    bitnet = _bitnet_quantization(config_path, config) if fmt == "hf" else None
    return Checkpoint(path, fmt, config, reader, tokenizer, provenance, sizes, quantization, bitnet)


TEXT_MODEL_PREFIX = "language_model."
# Where multimodal checkpoints keep their decoder: (the prefix of its tensors, that prefix in the text model's own
# names). Llama 4's nests the whole text model (`language_model.model.*`, `language_model.lm_head.*`: also LLaVA's,
# Gemma 3's and Mistral 3's files as transformers before 4.52 wrote them, and as transformers 5 still saves them);
# Qwen3.5's its decoder body only (`model.language_model.*`, the head as the text model's, `lm_head.*`), as do
# Qwen3-VL's and the others' files since 4.52; Idefics3's and SmolVLM's under `model.text_model.*`. (Qwen2-VL's and
# Qwen2.5-VL's files keep the text model's own names, `model.*`, the vision tower under `visual.*`.)
TEXT_MODEL_PREFIXES = (
    (TEXT_MODEL_PREFIX, ""),
    ("model.language_model.", "model."),
    ("model.text_model.", "model."),
)
# Multimodal releases whose decoder's experts are stored stacked and transposed ([E, H, 2I] gate columns then up,
# [E, I, H]: keel.weights.gpt_oss's layout without interleaving), by the config's `architectures`. transformers 5
# saves them in its own (keel's) layout, so, as transformers when loading, a tensor of keel's shape is read as it is.
TRANSPOSED_TEXT_EXPERTS = {"Qwen3VLMoeForConditionalGeneration"}


def _text_model(reader: TensorReader) -> TensorReader:
    """A multimodal checkpoint's decoder tensors under the text model's own names (keel.config.TEXT_MODEL_OF); the
    vision tower's stay unread. Any other checkpoint as it is."""
    names = reader.names()
    if "model.embed_tokens.weight" in names:
        return reader
    for prefix, own in TEXT_MODEL_PREFIXES:
        if f"{prefix}{'model.' if not own else ''}embed_tokens.weight" in names:
            layout = {n: {own + n[len(prefix) :]: None} for n in names if n.startswith(prefix)}
            layout.update({n: {n: None} for n in names if n.startswith("lm_head.")})
            return PartsReader(reader, layout)
    return reader


# ERNIE-4.5-VL's releases (as transformers 5 saves them too) keep the text model under its own names beside a second
# set of experts for image and video tokens: each router stored transposed ([H, E]; `gate.weight_1` the vision
# experts'), both routers' selection biases in one [2, E] tensor (the text experts' first), the experts numbered text
# then vision. Text reads the text experts alone (keel.config._ernie_vl_text: their count and width).
ERNIE_VL = {"Ernie4_5_VLMoeForConditionalGeneration", "Ernie4_5_VL_MoeForConditionalGeneration"}


def _ernie_vl_text_experts(reader: TensorReader) -> TensorReader:
    """`reader` with ERNIE-4.5-VL's text routers read untransposed and their biases alone (ERNIE_VL); the vision
    experts' tensors stay unread (keel reads experts 0 .. E - 1)."""
    layout = {}
    for name in reader.names():
        if name.endswith(".mlp.gate.weight"):
            layout[name] = {name: Transposed()}
        elif name.endswith(".mlp.moe_statics.e_score_correction_bias") and tuple(reader.shape(name))[0] == 2:
            layout[name] = {name: [(0, 1)]}
    return PartsReader(reader, layout)


# Llama 3.2 Vision (keel.config._mllama_text): on text, the Llama of its self-attention layers
MLLAMA = {"MllamaForConditionalGeneration", *MLLAMA_TEXT_ALONE}


def _is_mllama(config_path: Path) -> bool:
    """Whether config.json is Llama 3.2 Vision's (MLLAMA, or its text model's model_type, as keel.config reads it)."""
    if _outer_architectures(config_path) & MLLAMA:
        return True
    try:
        return json.loads(config_path.read_text()).get("model_type") == "mllama_text_model"
    except (OSError, ValueError, AttributeError):
        return False


def _mllama_self_attention_layers(reader: TensorReader, config_path: Path, config: ModelConfig) -> TensorReader:
    """`reader` with Llama 3.2 Vision's self-attention layers numbered as keel's Llama layers and the first
    vocab_size rows of its embedding (8 more rows hold the image tokens'); the cross-attention layers' tensors are
    listed under `cross_attention_layers.<i>.` (never read: transformers skips those layers on text)."""
    from keel.config import mllama_cross_attention_layers

    data = json.loads(config_path.read_text())
    text = data.get("text_config") if isinstance(data.get("text_config"), dict) else data
    cross = set(mllama_cross_attention_layers(text))
    kept = [i for i in range(int(text.get("num_hidden_layers", 40))) if i not in cross]
    number = {str(source): own for own, source in enumerate(kept)}
    layout: dict = {"model.embed_tokens.weight": {"model.embed_tokens.weight": [(0, config.vocab_size)]}}
    for name in reader.names():
        if not name.startswith("model.layers."):
            continue
        index, rest = name[len("model.layers.") :].split(".", 1)
        if index in number:
            layout[name] = {f"model.layers.{number[index]}.{rest}": None}
        else:
            layout[name] = {f"cross_attention_layers.{index}.{rest}": None}
    return PartsReader(reader, layout)


def _transposed_experts(reader: TensorReader, config: ModelConfig) -> TensorReader:
    """`reader` with the stacked experts stored transposed (TRANSPOSED_TEXT_EXPERTS) read in keel's layout; those of
    keel's shape as they are."""
    from keel.weights.gpt_oss import GptOssReader

    expected = {
        "gate_up_proj": (config.num_experts, 2 * config.moe_intermediate_size, config.hidden_size),
        "down_proj": (config.num_experts, config.hidden_size, config.moe_intermediate_size),
    }
    flipped = {
        name
        for name in reader.names()
        if name.startswith("model.layers.")
        and name.rsplit(".", 1)[-1] in expected
        and ".mlp.experts." in name
        and tuple(reader.shape(name)) != expected[name.rsplit(".", 1)[-1]]
    }
    return GptOssReader(reader, interleaved=False, only=flipped) if flipped else reader


def _bitnet_quantization(path: Path, config: ModelConfig) -> dict | None:
    """A BitNet release's checked bitnet `quantization_config` ({linear_class, quantization_mode,
    modules_to_not_convert}), or None (its float weights, or another family)."""
    if config.architecture != "bitnet":
        return None
    from keel.families.bitnet import check_quantization

    quant = json.loads(path.read_text()).get("quantization_config")
    return check_quantization(quant, str(path)) if quant else None


def _outer_architectures(path: Path) -> set[str]:
    """config.json's `architectures` as written (a multimodal release's, before keel.config reads its text model)."""
    try:
        archs = json.loads(path.read_text()).get("architectures")
    except (OSError, ValueError, AttributeError):
        return set()
    return {a for a in archs if isinstance(a, str)} if isinstance(archs, list) else set()


def _read_config(path: Path) -> tuple[ModelConfig, dict | None]:
    """config.json as a ModelConfig, plus keel's own quantization_config when present. Other
    quantization methods stay refused by ModelConfig (their tensors would load as wrong numbers)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return ModelConfig.from_json_file(path), None  # its one-line errors
    quant = data.get("quantization_config") if isinstance(data, dict) else None
    if not (isinstance(quant, dict) and quant.get("quant_method") == "keel"):
        return ModelConfig.from_json_file(path), None
    check_saved_quantization(quant, path)
    config = ModelConfig.from_hf({k: v for k, v in data.items() if k != "quantization_config"}, source=str(path))
    return config, quant


_FIELDS = [f for f in ModelConfig.__dataclass_fields__]
_SAFETENSORS_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "I8": 1, "U8": 1, "BOOL": 1}


def _has_gguf_magic(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def checked_tensors(model: Transformer, checkpoint: Checkpoint) -> Iterator[tuple[str, Tensor]]:
    """(keel name, tensor) for every parameter of `model`, read from the checkpoint (in its stored
    precision), with missing tensors and wrong shapes reported as one-line WeightsErrors."""
    config, reader = checkpoint.config, checkpoint.reader
    available = reader.names()
    for name, param in _stored_tensors(model):
        source = hf_source(config, name, available)
        missing = [n for n in source.names if n not in available]
        if missing and zero_when_absent(config, name):  # the family's releases omit it, transformers zeroes it
            yield name, torch.zeros(param.shape, dtype=torch.float32)
            continue
        if missing:
            hint = ""
            if checkpoint.quantization is not None:  # e.g. `keel convert` of a `keel quantize save` directory
                hint = (
                    f"; the checkpoint is quantized ({checkpoint.quantization.get('scheme')}): load it with keel itself"
                )
            raise WeightsError(f"{checkpoint.path}: tensor {missing[0]!r} is missing (needed for {name}){hint}")
        tensor = as_shape(source.combine([reader.get(n) for n in source.names]), param.shape)
        if tuple(tensor.shape) != tuple(param.shape):
            shown = source.names[0] if len(source.names) == 1 else f"{name} (from {source.names[0]}, ...)"
            raise WeightsError(
                f"{checkpoint.path}: tensor {shown} has shape {list(tensor.shape)}, "
                f"expected {list(param.shape)} for this config"
            )
        yield name, tensor


def as_shape(tensor: Tensor, shape: tuple[int, ...] | torch.Size) -> Tensor:
    """`tensor` viewed as `shape` where the two differ only by dimensions of size 1 (ERNIE 4.5 MoE stores its
    router's selection bias as [1, E]); else as it is, for the caller's shape check to report."""
    if tuple(tensor.shape) != tuple(shape) and [n for n in tensor.shape if n != 1] == [n for n in shape if n != 1]:
        return tensor.reshape(shape)
    return tensor


def _stored_tensors(model: Transformer) -> Iterator[tuple[str, Tensor]]:
    """Parameters, then persistent buffers (state that is not trained by gradients but is part of
    the checkpoint, e.g. DeepSeek's router selection bias), that are still on the meta device: a
    layer quantized while loading is already filled. A tied head appears once, as embed_tokens."""
    for name, param in model.named_parameters():
        if param.is_meta:
            yield name, param
    persistent = model.state_dict(keep_vars=True)
    for name, buffer in model.named_buffers():
        if name in persistent and buffer.is_meta:
            yield name, buffer


@torch.no_grad()
def load_weights(model: Transformer, checkpoint: Checkpoint, dtype: torch.dtype) -> None:
    """Fill a (meta-device) model from the checkpoint, checking every name and shape. Parameters take
    `dtype`; buffers keep the dtype their module declares (DeepSeek's router bias stays float32, as
    transformers keeps it: a bfloat16 bias would round the scores it is added to for selection)."""
    buffers = dict(model.named_buffers())
    state = {
        name: tensor.to(buffers[name].dtype if name in buffers else dtype)
        for name, tensor in checked_tensors(model, checkpoint)
    }
    model.load_state_dict(state, strict=False, assign=True)
    if isinstance(model.lm_head, torch.nn.Linear):  # a quantized head is its own copy, never tied
        model.tie_weights()
