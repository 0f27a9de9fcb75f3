"""Models built on the meta device, parallelised there, each rank materialising and filling only its own
shards: initial weights that do not depend on the layout (keel.model.seeded_init: every layout holds
the slices of the one-process model, bit for bit) and a checkpoint's weights read shard by shard
(keel.train.sharded_load: every rank reads only its blocks of the safetensors file). Real
torch.distributed over gloo, world 2 and 4."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from keel.model.seeded_init import BLOCK_ELEMENTS, canonical_name, fill_normal, init_weights_seeded, materialize
from keel.model.transformer import Transformer
from test_train_parallel import MODELS
from tiny_models import save_hf_model

SEED = 11


def one_process(model_name: str) -> dict[str, torch.Tensor]:
    model = Transformer(MODELS[model_name]())
    init_weights_seeded(model, SEED)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_values_depend_on_seed_and_name_only_and_any_row_range_draws_the_same():
    rows, cols = 3 * BLOCK_ELEMENTS // 100 + 7, 100  # blocks of 2,621 rows: 4 blocks, the last partial
    whole = torch.empty(rows, cols)
    fill_normal(whole, "w", 1, 0.02)
    assert whole.std().item() == pytest.approx(0.02, rel=0.01)
    again = torch.empty(rows, cols)
    fill_normal(again, "w", 1, 0.02)
    assert torch.equal(whole, again)
    other_name, other_seed = torch.empty(rows, cols), torch.empty(rows, cols)
    fill_normal(other_name, "v", 1, 0.02)
    fill_normal(other_seed, "w", 2, 0.02)
    assert not torch.equal(whole, other_name) and not torch.equal(whole, other_seed)
    # Every block draws from its own generator: the blocks differ from one another.
    assert not torch.equal(whole[:10], whole[2621 : 2621 + 10])


def test_canonical_names_drop_wrapper_components():
    assert canonical_name("layers.3._checkpoint_wrapped_module.mlp.up_proj") == "layers.3.mlp.up_proj"
    assert canonical_name("_orig_mod.layers.0.self_attn") == "layers.0.self_attn"


def test_every_parameter_has_a_rule_and_a_stranger_is_refused():
    for name in MODELS:  # dense, tied, q/k norms, biases, MoE with a selection-bias buffer
        state = one_process(name)
        for key, value in state.items():
            if key.endswith("norm.weight"):
                assert torch.equal(value, torch.ones_like(value)), key
            elif key.endswith((".bias", "_bias")):  # biases (GPT-OSS's experts' too), DeepSeek's selection bias
                assert not value.any(), key
            elif key.endswith(".sinks"):  # GPT-OSS: one per head, too few for their spread to say much
                assert value.any() and value.abs().max() < 0.1, key
            else:
                assert value.std().item() == pytest.approx(0.02, rel=0.3), key
    model = Transformer(MODELS["dense"]())
    model.layers["0"].extra = nn.Module()
    model.layers["0"].extra.scale = nn.Parameter(torch.ones(3))
    with pytest.raises(ValueError, match="layers.0.extra.scale"):
        init_weights_seeded(model, SEED)


def test_a_meta_model_materialises_tied_with_its_buffers():
    with torch.device("meta"):
        model = Transformer(MODELS["tied"]())
    materialize(model, "cpu", lambda m: init_weights_seeded(m, SEED))
    assert model.lm_head.weight is model.embed_tokens.weight  # to_empty alone gives the head its own tensor
    for key, value in one_process("tied").items():
        assert torch.equal(model.state_dict()[key], value), key
    assert torch.equal(model.rotary.inv_freq, Transformer(MODELS["tied"]()).rotary.inv_freq)


def test_a_tied_models_stage_head_starts_from_the_embedding():
    from keel.model.stages import split_stage

    last = split_stage(Transformer(MODELS["tied"]()), 1, 2)  # a pipeline's last stage: the head, no embedding
    init_weights_seeded(last, SEED)
    assert torch.equal(last.lm_head.weight, one_process("tied")["embed_tokens.weight"])


# ----------------------------------------------------------------------------- layouts


LAYOUTS = {
    2: [
        ("dense", 1, 2, 1, 1),
        ("tied", 1, 1, 2, 1),
        ("qwen3", 1, 1, 2, 1),
        ("moe_aux", 1, 2, 1, 2),
        ("tied", 2, 1, 1, 1),
    ],
    4: [("dense", 1, 2, 2, 1), ("moe", 1, 4, 1, 2)],  # FSDP over TP shards (strided), EP within FSDP
}  # (model, pp, dp_shard, tp, ep)


class CountingReader:
    """A safetensors reader that counts the elements it reads."""

    def __init__(self, reader) -> None:
        self.reader, self.elements = reader, 0

    def __getattr__(self, name):
        return getattr(self.reader, name)

    def get_box(self, name, offset, shape):
        part = self.reader.get_box(name, offset, shape)
        self.elements += part.numel()
        return part


HF_LAYOUTS = {2: [(1, 2, 1), (1, 1, 2), (2, 1, 1)], 4: [(1, 2, 2)]}  # (pp, dp_shard, tp) over the HF model


def _load_hf_layouts(world: int, hf_dir: str) -> list[str]:
    from keel.model.seeded_init import materialize
    from keel.model.stages import split_stage
    from keel.train.parallel import build_mesh, parallelize
    from keel.train.sharded_load import load_shards
    from keel.weights import open_checkpoint

    mismatches = []
    for pp, dp, tp in HF_LAYOUTS[world]:
        checkpoint = open_checkpoint(hf_dir)
        want = {name: checkpoint.reader.get(name) for name in checkpoint.reader.names()}
        total = sum(t.numel() for t in want.values())
        reader = checkpoint.reader = CountingReader(checkpoint.reader)
        mesh = build_mesh(pp, 1, dp, tp, "cpu", ep=1)
        with torch.device("meta"):
            model = Transformer(checkpoint.config)
        if pp > 1:
            model = split_stage(model, mesh["pp"].get_local_rank(), pp)
        parallelize(model, mesh, sequence_parallel=True)
        materialize(model, "cpu", lambda m, source=checkpoint: load_shards(m, source))
        for key, value in model.state_dict().items():
            full = value.full_tensor() if hasattr(value, "full_tensor") else value
            if not torch.equal(full, want["lm_head.weight" if key == "lm_head.weight" else f"model.{key}"]):
                mismatches.append(f"pp{pp} dp{dp} tp{tp}: {key}")
        # This rank's share of the file (norms are replicated: a few elements more), never the whole.
        if reader.elements > 1.1 * total / world:
            mismatches.append(f"pp{pp} dp{dp} tp{tp}: read {reader.elements} of {total} elements")
    return mismatches


def _worker(rank: int, world: int, init_file: str, out: str, hf_dir: str) -> None:
    from keel.model.stages import split_stage
    from keel.train.parallel import build_mesh, parallelize

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timedelta(seconds=120)
    )
    try:
        mismatches = []
        for name, pp, dp, tp, ep in LAYOUTS[world]:
            want = one_process(name)
            mesh = build_mesh(pp, 1, dp, tp, "cpu", ep=ep)
            with torch.device("meta"):
                model = Transformer(MODELS[name]())
            if pp > 1:
                model = split_stage(model, mesh["pp"].get_local_rank(), pp)
            parallelize(model, mesh, sequence_parallel=True, ac_mode="full")
            model.to_empty(device="cpu")
            init_weights_seeded(model, SEED)
            for key, value in model.state_dict().items():
                full = value.full_tensor() if hasattr(value, "full_tensor") else value
                expected = want["embed_tokens.weight" if key == "lm_head.weight" and pp > 1 else key]
                if not torch.equal(full, expected):
                    mismatches.append(f"{name} pp{pp} dp{dp} tp{tp} ep{ep}: {key}")
        mismatches += _load_hf_layouts(world, hf_dir)
        Path(f"{out}.{rank}").write_text(json.dumps(mismatches))
    finally:
        dist.destroy_process_group()


# World 4 (FSDP over TP shards, EP inside FSDP) runs in `make test-slow`.
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_every_layout_materialises_the_one_process_model_and_reads_only_its_shards(world: int, tmp_path: Path):
    save_hf_model("llama-bias", tmp_path / "hf", num_hidden_layers=2)  # untied, with biases
    out = str(tmp_path / "mismatches")
    mp.spawn(_worker, args=(world, str(tmp_path / "store"), out, str(tmp_path / "hf")), nprocs=world, join=True)
    mismatches = [m for rank in range(world) for m in json.loads(Path(f"{out}.{rank}").read_text())]
    assert mismatches == []
