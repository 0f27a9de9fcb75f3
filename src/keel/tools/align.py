"""Precision alignment: keel against transformers' implementation of the same architecture.

Both models run the same fixed token ids; the hidden state after every decoder layer and the
final logits are compared. Definitions (all computed in float64):
- cosine: cosine similarity of the flattened hidden states of the whole batch;
- max_abs: largest absolute elementwise difference;
- rel_err: ||keel - ref|| / ||ref|| (Frobenius norms);
- logits max_rel: max |keel - ref| / max |ref|, the figure the tolerance applies to.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from keel.dtypes import parse_dtype
from keel.errors import KeelError
from keel.quant.loading import load_model

# dtype -> (minimum cosine at every layer, maximum logits max_rel).
# bfloat16: both sides round every op to 8 mantissa bits, in slightly different places
# (fused kernels, accumulation order), so errors of a few 1e-3 per op compound over layers.
TOLERANCES: dict[str, tuple[float, float]] = {
    "float32": (0.99999, 1e-4),
    "bfloat16": (0.999, 3e-2),
    "float16": (0.9999, 1e-2),
}


@dataclass
class Row:
    name: str
    cosine: float
    max_abs: float
    rel_err: float


@dataclass
class AlignReport:
    dtype: str
    rows: list[Row]  # one per layer, then "logits"
    logits_max_rel: float
    min_cosine: float
    max_rel: float
    first_divergent: str | None  # first row that breaks the tolerance, or None

    @property
    def passed(self) -> bool:
        return self.first_divergent is None

    def format(self) -> str:
        lines = [f"{'layer':>8} {'cosine':>12} {'max_abs':>11} {'rel_err':>11}"]
        for row in self.rows:
            lines.append(f"{row.name:>8} {row.cosine:12.9f} {row.max_abs:11.3e} {row.rel_err:11.3e}")
        verdict = "PASS" if self.passed else f"FAIL: first divergence at {self.first_divergent}"
        lines.append(
            f"{verdict} ({self.dtype}: logits max_rel {self.logits_max_rel:.3e} <= {self.max_rel:g}, "
            f"cosine >= {self.min_cosine} at every layer)"
        )
        return "\n".join(lines)


def compare(name: str, ours: Tensor, ref: Tensor) -> Row:
    a, b = ours.double().flatten(), ref.double().flatten()
    cosine = torch.nn.functional.cosine_similarity(a, b, dim=0).item()
    diff = (a - b).abs()
    return Row(name, cosine, diff.max().item(), (diff.norm() / b.norm().clamp_min(1e-30)).item())


def alignment_input(config, batch: int = 2, seed: int = 0) -> Tensor:
    """Fixed token ids: `batch` sequences, longer than twice any sliding window or attention chunk."""
    windows = [abs(config.layer_window(i) or 0) for i in range(config.num_layers)]
    length = max(64, 2 * max(windows) + 16)
    length = min(length, config.max_position_embeddings)
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, config.vocab_size, (batch, length), generator=generator)


def transformers_model(path: Path, **options: Any) -> Any:
    """transformers' model of the HF directory `path`: AutoModelForCausalLM's, or the class its config.json names
    where the auto mapping lists none for causal LM (Mistral 4's)."""
    import transformers

    try:
        return transformers.AutoModelForCausalLM.from_pretrained(path, **options)
    except ValueError:
        name = json.loads((Path(path) / "config.json").read_text())["architectures"][0]
        return getattr(transformers, name).from_pretrained(path, **options)


def _reference_dir(model: str, tmp: Path) -> Path:
    """An HF directory transformers can load: the model itself, or an export of it."""
    path = Path(model)
    if path.is_dir() and (path / "config.json").exists():
        return path
    from keel.weights.convert import convert

    return convert(model, tmp / "hf", dtype="float32")


def _layer_outputs(layers, run) -> list[Tensor]:
    outputs: list[Tensor] = []

    def hook(_module, _inputs, out):
        outputs.append(out[0] if isinstance(out, tuple) else out)

    handles = [layer.register_forward_hook(hook) for layer in layers]
    try:
        logits = run()
    finally:
        for handle in handles:
            handle.remove()
    return [*outputs, logits]


@torch.no_grad()
def align(model: str, dtype: str = "float32", head_dim: int | None = None, num_heads: int | None = None) -> AlignReport:
    if dtype not in TOLERANCES:
        raise KeelError(f"--dtype {dtype!r} is not supported for align (choose from {', '.join(TOLERANCES)})")
    try:
        import transformers
    except ImportError:
        raise KeelError("keel align needs transformers: pip install 'keel[align]'") from None
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    torch_dtype = parse_dtype(dtype)
    loaded = load_model(model, torch_dtype, head_dim=head_dim, num_heads=num_heads)
    tokens = alignment_input(loaded.config)
    with tempfile.TemporaryDirectory(prefix="keel-align-") as tmp:
        ref_dir = _reference_dir(model, Path(tmp))
        options = loaded.config.transformers_attention()
        reference = transformers_model(ref_dir, dtype=torch_dtype, **options).eval()
        # The decoder is `model.`, `gpt_neox.` or `transformer.` (base_model), or `model.` where base_model names
        # another (Llama 4's text model, whose prefix is its multimodal model's `language_model`); its blocks are
        # `layers`, or `h` (GPT-2's names), or `blocks` (MPT's, DBRX's), or its `decoder`'s `layers` (OPT's).
        own = getattr(reference.base_model, "decoder", reference.base_model)
        found = [name for name in ("layers", "h", "blocks") if hasattr(own, name)]
        base = own if found else reference.model
        blocks = getattr(base, found[0] if found else "layers")
        ref_out = _layer_outputs(blocks, lambda: reference(tokens).logits)
    ours = _layer_outputs(list(loaded.model.layers.values()), lambda: loaded.model(tokens))

    min_cosine, max_rel = TOLERANCES[dtype]
    rows = [compare(str(i), a, b) for i, (a, b) in enumerate(zip(ours[:-1], ref_out[:-1], strict=True))]
    rows.append(compare("logits", ours[-1], ref_out[-1]))
    logits_max_rel = ((ours[-1].double() - ref_out[-1].double()).abs().max() / ref_out[-1].double().abs().max()).item()
    first = next((r.name for r in rows if r.cosine < min_cosine or r.cosine != r.cosine), None)
    if first is None and not logits_max_rel <= max_rel:
        first = "logits"
    return AlignReport(dtype, rows, logits_max_rel, min_cosine, max_rel, first)
