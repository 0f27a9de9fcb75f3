"""A Transformer cut into pipeline stages by layers: which layers each stage holds, and the pruning.

Training (keel.train.pipeline) and pipeline-parallel serving (keel.serve.parallel) cut models the
same way, so a stage's layer keys stay global ("7" is layer 7 on whichever stage holds it) and the
first `num_layers % num_stages` stages get one extra layer.
"""

from __future__ import annotations

from keel.model.transformer import Transformer


def layer_ranges(num_layers: int, num_stages: int) -> list[range]:
    """Contiguous layer indices of each stage; the first `num_layers % num_stages` get one more."""
    if num_layers < num_stages:
        raise ValueError(f"cannot split {num_layers} layers into {num_stages} pipeline stages")
    base, extra = divmod(num_layers, num_stages)
    ranges, start = [], 0
    for stage in range(num_stages):
        end = start + base + (stage < extra)
        ranges.append(range(start, end))
        start = end
    return ranges


def split_stage(model: Transformer, stage: int, num_stages: int) -> Transformer:
    """Prune `model` in place to pipeline stage `stage` of `num_stages` and return it."""
    keep = {str(i) for i in layer_ranges(len(model.layers), num_stages)[stage]}
    for name in [n for n in model.layers.keys() if n not in keep]:
        del model.layers[name]
    if num_stages > 1 and model.embed_tokens_per_layer is not None:
        # every layer reads the per-layer inputs, which are made from the token ids the first stage alone has
        raise ValueError("pipeline stages: per-layer inputs (per_layer_input_size: Gemma 4) are not supported")
    if num_stages > 1 and model.altup_projections is not None:
        # the stream's copies [n, B, S, H] would cross the stages, which pass one [B, S, H]
        raise ValueError("pipeline stages: AltUp (altup_num_inputs: Gemma 3n) is not supported")
    config = model.config
    if any(config.kv_source(i) != i and str(config.kv_source(i)) not in keep for i in map(int, keep)):
        raise ValueError("pipeline stages: a layer sharing KV (kv_shared_layers) needs its source in its stage")
    if stage > 0:
        model.embed_tokens = None
        model.embed_positions = None  # learned positions go with the embedding
        model.project_in = None  # as OPT-350m's projection of it
        model.embedding_norm = None  # and so does the embedding's norm (Bloom's holds weights)
    if stage < num_stages - 1:
        model.norm = None
        model.lm_head = None
        model.project_out = None
    return model
