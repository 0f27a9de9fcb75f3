"""Apertus 1.5, text (`Apertus1p5TextForCausalLM`, model_type apertus1p5_text; and the released
`Apertus1p5ForConditionalGeneration` checkpoints on text: the decoder under `model.language_model.`, the vision and
audio tokenizers unread): Apertus's block (keel.families.apertus) over a vocabulary extended by the image and audio
codes, whose LM head may be pruned to the first `output_vocab_size` ids (the releases').

keel's one vocabulary is the head's: with `output_vocab_size`, keel's vocab_size is it and only the embedding's first
rows are read (keel.weights.parts), those of the ids the head can give; the ids beyond, the image and audio codes,
are refused in a prompt as out of the vocabulary (images and audio are not supported). Export writes that text model
(vocab_size the head's, no pruning). A pruned head tied to the embedding (`tie_word_embeddings`, which transformers
cannot build either) is refused by name.
"""

from __future__ import annotations

from typing import Any

from keel.errors import ConfigError
from keel.families import apertus

FAMILY = "apertus1p5"
HF_ARCHITECTURE = "Apertus1p5TextForCausalLM"
# transformers' Apertus1p5TextConfig defaults: ApertusConfig's (its vocabulary a required key here)
DEFAULTS: dict[str, Any] = dict(apertus.DEFAULTS)
DEFAULT_ROPE = apertus.DEFAULT_ROPE
VOCAB_SIZE = 266752  # text, then the image and audio code ranges


def config_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    vocab = int(hf.get("vocab_size") or VOCAB_SIZE)
    head = int(hf.get("output_vocab_size") or vocab)
    if not 1 <= head <= vocab:
        raise ConfigError(f"{source}: output_vocab_size {head} must be in [1, vocab_size {vocab}]")
    if head < vocab and hf.get("tie_word_embeddings"):
        raise ConfigError(f"{source}: output_vocab_size with tie_word_embeddings (a pruned head tied) is not supported")
    return {**apertus.config_fields(hf, source), "vocab_size": head}


def hf_fields(config: Any, hf: dict[str, Any]) -> dict[str, Any]:
    return {**apertus.hf_fields(config, hf), "model_type": "apertus1p5_text", "output_vocab_size": None}


def checkpoint_layout(config: Any) -> dict[str, dict[str, Any]]:
    """Apertus's norm names; the embedding's first vocab_size rows (all of them where the head is not pruned)."""
    embed = "model.embed_tokens.weight"
    return {**apertus.checkpoint_layout(config), embed: {embed: [(0, config.vocab_size)]}}
