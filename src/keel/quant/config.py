"""`QuantConfig`: weight-only quantization at load, as the engine, its workers and `keel generate` take it.

Each field's docstring is its command-line help (keel.cli derives the options from the fields).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

from keel.errors import KeelError

AUTO = "auto"  # the checkpoint's own storage: integer blocks (GGUF's, GPT-OSS's MXFP4) as stored, else float
FLOAT = "none"  # float weights (a GGUF file's blocks expanded at load)
QUANTIZE_CHOICES = (AUTO, FLOAT, "int8", "int4", "gguf")  # --quantize, as `QuantConfig.quantize` types it
# What keel's own int8/int4 leave in float unless told otherwise: the head, whose rounding costs the most accuracy.
# A GGUF file's blocks run as stored keep nothing by default: its head already has the type the file's producer
# chose for it (llama.cpp: Q6_K or Q8_0), and expanding it to float costs 4x its bytes for no change in the weights.
DEFAULT_KEEP = ("lm_head",)


@dataclass
class QuantConfig:
    """Weight-only quantization of the linear layers and MoE experts at load (keel.quant)"""

    quantize: Literal["auto", "none", "int8", "int4", "gguf"] = AUTO
    """weights of the linear layers and MoE experts: int8 per channel, int4 per group (quantized at load); gguf: a
    checkpoint's own integer blocks (a GGUF file's Q4_0 ... Q6_K and MXFP4, GPT-OSS's MXFP4 experts) run as stored
    on the integer kernels; none: float; auto: gguf for a checkpoint with integer blocks on CPU (as vLLM runs GGUF
    files), none otherwise"""

    quant_group_size: Literal[32, 64, 128, 256] = 128
    """int4 group size (input channels per scale); 32 reproduces GGUF Q4_0/Q4_1 blocks"""

    quant_keep: tuple[str, ...] | None = field(default=None, metadata={"metavar": "NAMES"})
    """comma-separated layers left in float, names or patterns such as '*.experts' ('' for none; default: lm_head
    under int8/int4 or with --quant-keep-as, none under gguf, whose file stores the head in the type it chose)"""

    quant_keep_as: Literal["int8", "int4"] | None = None
    """run the kept layers in this scheme, not float (e.g. int4 with an int8 head)"""

    quant_activations: Literal["refined", "int8"] = "refined"
    """keel's CPU kernels: activations as int8 blocks and their int8 residual (refined: the float product's accuracy)
    or as int8 blocks alone (llama.cpp's way: faster, +0.01-0.4% perplexity on SmolLM2, near ties settled as
    llama.cpp settles them)"""

    quant_plan: str | None = field(default=None, metadata={"metavar": "PLAN.json"})
    """a plan from `keel quantize analyze`: its scheme, group size and kept layers (over the three options above)"""

    quantization: str | None = field(default=None, metadata={"aliases": ("-q",), "metavar": "METHOD"})
    """vLLM's spelling: the methods keel runs map to --quantize (gguf); vLLM's others (awq, gptq, fp8, ...) are
    refused"""

    def __post_init__(self) -> None:
        if self.quant_keep is not None:
            self.quant_keep = tuple(self.quant_keep)
        if self.quantization is not None:  # resolved here: copies (workers, replace()) see only --quantize
            self.quantize = _from_vllm_method(self.quantization, self.quantize)
            self.quantization = None
        if self.quant_plan is not None:  # read here: a bad plan fails before any model loads
            from keel.quant.plan import read_plan

            plan = read_plan(self.quant_plan)
            self.quantize = plan["scheme"]
            self.quant_group_size = plan.get("group_size") or 128
            self.quant_keep = tuple(plan.get("keep", []))
            self.quant_plan = None  # resolved: copies (workers, replace()) do not read the file again
        if self.quant_keep_as is not None and self.quantize in (FLOAT, None):
            raise KeelError("--quant-keep-as needs a quantized model: --quantize int8|int4|gguf (or --quant-plan)")

    @property
    def scheme(self) -> str | None:
        """The scheme asked for by name (int8, int4, gguf); None for auto and none, which the checkpoint decides
        (`keel.quant.loading.resolve_scheme`)."""
        return None if self.quantize in (AUTO, FLOAT, None) else self.quantize

    def kept(self, scheme: str | None) -> tuple[str, ...]:
        """The layers kept out of `scheme` (the one asked for, or the one a checkpoint resolved to) under these
        options (`keep_for`)."""
        return keep_for(self.quant_keep, scheme, self.quant_keep_as)

    def load_options(self) -> dict:
        """The quantization keywords of `load_model`."""
        return dict(
            quantize=self.quantize,
            quant_group_size=self.quant_group_size,
            quant_keep=self.quant_keep,
            quant_keep_as=self.quant_keep_as,
            quant_activations=self.quant_activations,
        )


# vLLM's --quantization methods that keel runs, as keel's --quantize scheme. vLLM's awq, gptq, fp8, bitsandbytes,
# compressed-tensors ... read checkpoints keel does not load; keel's int8/int4 quantize float weights at load,
# which no vLLM method names.
VLLM_METHODS = {"gguf": "gguf"}


def _from_vllm_method(method: str, quantize: str | None) -> str:
    if method not in VLLM_METHODS:
        raise KeelError(
            f"--quantization {method}: keel does not run this method; it runs {', '.join(VLLM_METHODS)} "
            "(and quantizes float weights at load with --quantize int8|int4)"
        )
    scheme = VLLM_METHODS[method]
    if quantize not in (AUTO, None) and quantize != scheme:
        raise KeelError(f"--quantization {method} means --quantize {scheme}, not --quantize {quantize}: give one")
    return scheme


def keep_for(keep: Iterable[str] | None, scheme: str | None, keep_as: str | None = None) -> tuple[str, ...]:
    """The layers kept out of the scheme: `keep` as given, else the scheme's default: DEFAULT_KEEP, or none under
    gguf unless `keep_as` asks for a second tier (then the head, which that option is for)."""
    if keep is not None:
        return tuple(keep)
    return () if scheme == "gguf" and keep_as is None else DEFAULT_KEEP
