"""The longest context a model may be served at, as vLLM derives it: `max_position_embeddings`, stretched by a
linear or YaRN rope scaling's factor (YaRN's from its original context); llama3 and LongRoPE configs already give
the stretched length. Dynamic NTK scaling is not stretched (vLLM stretches it by its factor): it changes the
frequencies by each step's sequence length past max_position_embeddings, which keel's cache does not follow. A
`--max-model-len` beyond it is refused unless KEEL_ALLOW_LONG_MAX_MODEL_LEN=1 (vLLM's VLLM_ALLOW_LONG_MAX_MODEL_LEN):
positions past what the model was trained on give output, just not good output.
"""

from __future__ import annotations

import os

from keel.config import ModelConfig
from keel.errors import KeelError

ALLOW_ENV = "KEEL_ALLOW_LONG_MAX_MODEL_LEN"


def derived_max_model_len(config: ModelConfig) -> int:
    """The model's own context length (the module docstring)."""
    length = config.max_position_embeddings
    scaling = config.rope_scaling
    if scaling.type in ("linear", "yarn") and scaling.factor > 1:
        base = scaling.original_max_position_embeddings if scaling.type == "yarn" else length
        length = max(length, int(base * scaling.factor))
    return length


def check_model_len(max_model_len: int, config: ModelConfig) -> None:
    """Refuse a `max_model_len` longer than the model's context, unless the environment allows it."""
    derived = derived_max_model_len(config)
    if config.position_embedding == "learned" and max_model_len > config.max_position_embeddings:
        # no environment allows this: a learned position table has no row past its last
        raise KeelError(
            f"--max-model-len {max_model_len} is longer than the model's {config.max_position_embeddings} learned "
            "positions (position_embedding learned: there is no embedding for a later position)"
        )
    if max_model_len > derived and os.environ.get(ALLOW_ENV, "0") not in ("1", "true", "True"):
        raise KeelError(
            f"--max-model-len {max_model_len} is longer than the model's context of {derived} tokens "
            f"(max_position_embeddings {config.max_position_embeddings}, rope scaling {config.rope_scaling.type}); "
            f"set {ALLOW_ENV}=1 to serve it anyway"
        )
