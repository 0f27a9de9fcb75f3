"""`checkpoint.export_hf`: the trained model as an HF safetensors directory, RUN/hf, written shard-wise.

Every rank writes its own shards of the model under HF tensor names through DCP's HuggingFaceStorageWriter
(no rank gathers the model); rank 0 then consolidates them into HF's `model-0000i-of-0000N.safetensors`
files of at most 2 GiB each with their index, adds config.json and the tokenizer, and publishes the
directory by a rename (RUN/hf.tmp until then). transformers' `from_pretrained`, `keel serve` and
`keel convert` read it. A family whose checkpoints rename tensors (OLMo 2, the Gemmas) is written under
its stored names. Refused here, `keel convert CHECKPOINT OUT` writes them: mixture-of-experts models (HF
stores their experts one tensor each, which a rank's stacked expert shard is not) and families whose
checkpoints fuse tensors (Phi-3, GPT-NeoX).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from keel.atomic import replace_dir
from keel.config import ModelConfig
from keel.families import stored_names
from keel.train.checkpoint import ModelParts, barrier, process_rank
from keel.weights.convert import DEFAULT_MAX_SHARD_BYTES
from keel.weights.names import hf_source

EXPORT_DIR = "hf"


def hf_state(parts: ModelParts, config: ModelConfig) -> dict:
    """This rank's model tensors (sharded as they are) under their HF names."""
    stored = stored_names(config) or {}  # a family's renamed tensors (the trainer refused fused ones)
    state = {}
    for name, tensor in parts.model_state().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # the tied head is the embedding
        hf_name = hf_source(config, name, set()).names[0]
        state[stored.get(hf_name, hf_name)] = tensor
    return state


def file_indices(nbytes: dict[str, int], limit: int = DEFAULT_MAX_SHARD_BYTES) -> dict[str, int]:
    """HF file (1-based) of every tensor, given its size in bytes: in name order, a new file once `limit`
    bytes are reached."""
    indices, index, size = {}, 1, 0
    for name in sorted(nbytes):
        if size and size + nbytes[name] > limit:
            index, size = index + 1, 0
        indices[name] = index
        size += nbytes[name]
    return indices


def export_hf(parts: ModelParts, config: ModelConfig, run_dir: Path, write_model_files: Callable[[Path], None]) -> Path:
    """Write RUN/hf from every rank's shards (collective: every rank calls it)."""
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    final, tmp = Path(run_dir) / EXPORT_DIR, Path(run_dir) / f"{EXPORT_DIR}.tmp"
    if process_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier(None)
    state = hf_state(parts, config)
    # Every rank must pass the same map, covering every tensor: a pipeline stage knows only its own.
    sizes = {name: t.numel() * t.element_size() for name, t in state.items()}  # global sizes (DTensor)
    everyone = [sizes]
    if dist.is_initialized():
        everyone = [{} for _ in range(dist.get_world_size())]
        dist.all_gather_object(everyone, sizes)
    indices = file_indices({name: n for part in everyone for name, n in part.items()})
    writer = HuggingFaceStorageWriter(
        path=str(tmp), fqn_to_index_mapping=indices, save_distributed=True, enable_consolidation=True
    )
    dcp.save(state, storage_writer=writer, no_dist=not dist.is_initialized())
    barrier(None)
    if process_rank() == 0:
        shutil.rmtree(tmp / "sharded", ignore_errors=True)
        write_model_files(tmp)
        shutil.rmtree(final, ignore_errors=True)
        replace_dir(tmp, final)
    barrier(None)
    return final
