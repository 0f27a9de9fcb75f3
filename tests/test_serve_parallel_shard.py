"""Tensor-parallel sharding layout (keel.weights.shard): which slice each rank holds, KV-head
replication when there are fewer KV heads than ranks, and shard-wise reads that put the full
tensors back together."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from keel.errors import KeelError
from keel.model.transformer import Transformer
from keel.weights.loader import open_checkpoint
from keel.weights.shard import TensorParallelLayout, read_shard, slice_of
from tiny_models import save_hf_model


def _shapes(config) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        model = Transformer(config)
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def test_smollm2_splits_three_ways_with_one_kv_head_per_rank():
    config = open_checkpoint("smollm2-135m-instruct").config  # 9 heads, 3 KV heads
    shapes = _shapes(config)
    layouts = [TensorParallelLayout(config, 3, r) for r in range(3)]
    assert [lay.kv_head_range() for lay in layouts] == [(0, 1), (1, 2), (2, 3)] and layouts[0].kv_replicas == 1
    sharded = sum(torch.Size(s).numel() for n, s in shapes.items() if layouts[0].shard_of(n) is not None)
    replicated = sum(torch.Size(s).numel() for n, s in shapes.items() if layouts[0].shard_of(n) is None)
    assert replicated < 0.01 * sharded  # norms only (the head is tied to the embedding)
    for layout in layouts:
        per_rank = sum(torch.Size(slice_of(s, layout.shard_of(n))).numel() for n, s in shapes.items())
        assert per_rank == sharded // 3 + replicated
    with pytest.raises(KeelError, match="9 attention heads do not divide into 2 ranks"):
        TensorParallelLayout(config, 2, 0)


def test_fewer_kv_heads_than_ranks_are_replicated_to_the_ranks_whose_queries_use_them():
    config = open_checkpoint("smollm2-135m-instruct").config
    config = type(config)(**{**vars(config), "num_heads": 12, "num_kv_heads": 2, "head_dim": 48})
    group = config.num_heads // config.num_kv_heads  # query heads per KV head
    for rank in range(6):
        layout = TensorParallelLayout(config, 6, rank)
        assert layout.kv_replicas == 3
        first, last = layout.kv_head_range()
        queries = range(rank * layout.local_heads, (rank + 1) * layout.local_heads)
        assert last - first == 1 and {q // group for q in queries} == {first}
    with pytest.raises(KeelError, match="neither divide"):
        TensorParallelLayout(type(config)(**{**vars(config), "num_kv_heads": 4}), 6, 0)


def test_uneven_vocabulary_and_bad_rank():
    config = open_checkpoint("smollm2-135m-instruct").config
    config = type(config)(**{**vars(config), "vocab_size": 250})
    assert [TensorParallelLayout(config, 3, r).vocab_range() for r in range(3)] == [(0, 84), (84, 168), (168, 250)]
    with pytest.raises(KeelError, match="rank 3 outside"):
        TensorParallelLayout(config, 3, 3)


@pytest.mark.parametrize("tp", [2, 4])
def test_shard_reads_put_every_tensor_back_together(tmp_path, tp):
    save_hf_model("llama-bias", tmp_path, tie_word_embeddings=False)  # 4 heads, 2 KV heads, biases
    config = open_checkpoint(str(tmp_path)).config
    layouts = [TensorParallelLayout(config, tp, r) for r in range(tp)]
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        for hf_name in f.keys():
            name = hf_name.removeprefix("model.")
            full = f.get_tensor(hf_name)
            parts = [read_shard(f, hf_name, lay.shard_of(name)) for lay in layouts]
            shard = layouts[0].shard_of(name)
            for part, lay in zip(parts, layouts, strict=True):
                assert tuple(part.shape) == slice_of(tuple(full.shape), lay.shard_of(name))
            if shard is None:
                assert all(torch.equal(p, full) for p in parts)
            elif layouts[0].kv_replicas > 1 and name.endswith(
                ("k_proj.weight", "v_proj.weight", "k_proj.bias", "v_proj.bias")
            ):
                # Each KV head on kv_replicas ranks: every replica equal, one of each makes the whole.
                step = layouts[0].kv_replicas
                assert all(torch.equal(parts[i], parts[i - i % step]) for i in range(tp))
                assert torch.equal(torch.cat(parts[::step], dim=shard.dim), full)
            else:
                assert torch.equal(torch.cat(parts, dim=shard.dim), full), name


def _tp_worker(rank: int, world: int, init_file: str, model_dirs: list[str], outs: list[str]) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    from keel.quant.loading import load_model
    from keel.serve.parallel.tensor import shard_model

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timedelta(seconds=120)
    )
    from keel.serve.parallel.load import load_tensor_parallel

    try:
        for model_dir, out in zip(model_dirs, outs, strict=True):
            loaded = load_model(model_dir, "float32")
            shard_model(loaded.model, TensorParallelLayout(loaded.config, world, rank))
            # Shard-wise loading (only this rank's slices read from the file) gives the same parameters.
            by_slices = load_tensor_parallel(model_dir, torch.float32, world, rank).model
            cut = dict(loaded.model.named_parameters())
            assert cut.keys() == dict(by_slices.named_parameters()).keys()
            assert all(torch.equal(p, cut[n]) for n, p in by_slices.named_parameters()), rank
            with torch.inference_mode():
                logits = by_slices(TOKENS)
            if rank == 0:
                torch.save(logits, out)
        # Every rank done before any tears gloo down: a peer closing its pairs while another rank's gloo
        # threads still use them aborts that process ("terminate called without an active exception").
        dist.barrier()
    finally:
        dist.destroy_process_group()


TOKENS = torch.tensor([[1, 5, 9, 200, 3, 77, 12, 0], [4, 4, 250, 8, 16, 31, 2, 99]])
TP2 = ("llama-bias", "qwen3")


def _sharded(root: Path, archs: tuple[str, ...], tp: int) -> dict[str, tuple[Path, Path]]:
    """One gloo group of tp processes runs every architecture in `archs` (spawning is the slow part):
    {arch: (its model directory, rank 0's logits)}."""
    import torch.multiprocessing as mp

    runs = {}
    for arch in archs:
        save_hf_model(arch, root / arch, tie_word_embeddings=(arch == "llama"))
        runs[arch] = (root / arch, root / f"{arch}-logits.pt")
    dirs, outs = ([str(run[i]) for run in runs.values()] for i in (0, 1))
    mp.spawn(_tp_worker, args=(tp, str(root / "store"), dirs, outs), nprocs=tp, join=True)
    return runs


@pytest.fixture(scope="module")
def tp2_runs(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    return _sharded(tmp_path_factory.mktemp("tp2"), TP2, 2)


@pytest.mark.parametrize(
    ("arch", "tp"),
    [
        *((arch, 2) for arch in TP2),
        pytest.param("llama", 4, marks=pytest.mark.slow),
        # GPT-2: its ranks' slices of Conv1D weights stored transposed, the learned positions replicated
        pytest.param("gpt2", 2, marks=pytest.mark.slow),
        # OPT: the learned table's offset rows replicated; GPT-J: q/k rows regrouped per head, each rank its heads'
        pytest.param("opt", 2, marks=pytest.mark.slow),
        # OPT-350m: the norms after the residual adds, project_in / project_out replicated
        pytest.param("opt-350m", 2, marks=pytest.mark.slow),
        # DBRX: Wqkv's q/k/v and each expert's rows of the fused w1 / v1 / w2 (w2's transposed) read by rank
        pytest.param("dbrx", 2, marks=pytest.mark.slow),
        pytest.param("gptj", 2, marks=pytest.mark.slow),
        # Laguna, AFMoE: each rank the output gate of its own heads (one row a head; one a channel)
        pytest.param("laguna", 2, marks=pytest.mark.slow),
        pytest.param("afmoe", 2, marks=pytest.mark.slow),
        # CodeGen: each rank's heads gathered from the 4 shards of the fused q/v/k; Persimmon: GPT-NeoX's per-head
        # q/k/v rows, its q/k LayerNorms (one weight and bias for all heads) replicated
        pytest.param("codegen", 2, marks=pytest.mark.slow),
        pytest.param("persimmon", 2, marks=pytest.mark.slow),
    ],
)
def test_sharded_forward_equals_the_full_model(tmp_path, arch, tp, request):
    """gloo, tp processes: the model read slice by slice equals the full model cut down, and its logits
    equal the unsharded model's (tp 4 on 2 KV heads: replicated KV heads)."""
    from keel.quant.loading import load_model

    runs = request.getfixturevalue("tp2_runs") if tp == 2 and arch in TP2 else _sharded(tmp_path, (arch,), tp)
    model_dir, out = runs[arch]
    full = load_model(str(model_dir), "float32").model
    with torch.inference_mode():
        expected = full(TOKENS)
    torch.testing.assert_close(torch.load(out), expected, rtol=1e-4, atol=1e-5)
