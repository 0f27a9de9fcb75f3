"""Loss-parallel under tensor parallelism: the head's logits stay sharded on the vocabulary and torch's
loss_parallel() computes the cross-entropy across the tp ranks, giving the loss and gradients of the
gathered-logits path (tp = 2 over 2 gloo ranks, the same seeded model both ways)."""

from __future__ import annotations

import contextlib
import json
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from keel.model.seeded_init import init_weights_seeded, materialize
from keel.model.transformer import Transformer
from test_train_parallel import MODELS


def _worker(rank: int, store: str, out: str) -> None:
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import loss_parallel

    from keel.model.loss import cross_entropy_loss
    from keel.train.parallel import build_mesh, parallelize

    torch.set_num_threads(1)
    timeout = timedelta(seconds=60)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2, timeout=timeout)
    mesh = build_mesh(1, 1, 1, 2, "cpu", ep=1)
    tokens = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(0))
    inputs, targets = tokens[:, :-1], tokens[:, 1:].clone()
    targets[0, 3] = -100
    results = {}
    for sharded in (False, True):
        with torch.device("meta"):
            model = Transformer(MODELS["dense"]())
        parallelize(model, mesh, sequence_parallel=True, loss_parallel=sharded)
        materialize(model, "cpu", lambda m: init_weights_seeded(m, 3))
        with loss_parallel() if sharded else contextlib.nullcontext():
            logits = model(inputs)
            loss = cross_entropy_loss(logits, targets)
            loss.backward()
        grad = model.layers["0"].mlp.down_proj.weight.grad.full_tensor()
        results[sharded] = {
            "dtensor": isinstance(logits, DTensor) and logits.placements == (Shard(2),),
            "loss": float(loss.full_tensor() if isinstance(loss, DTensor) else loss),
            "grad": grad.flatten()[:64].tolist(),
        }
    Path(f"{out}.{rank}").write_text(json.dumps(results))
    dist.destroy_process_group()


def test_vocab_sharded_logits_give_the_gathered_loss_and_gradients(tmp_path: Path):
    out = str(tmp_path / "out")
    mp.spawn(_worker, args=(str(tmp_path / "store"), out), nprocs=2, join=True)
    for rank in range(2):
        got = json.loads(Path(f"{out}.{rank}").read_text())
        gathered, sharded = got["false"], got["true"]
        assert sharded["dtensor"] and not gathered["dtensor"]
        assert abs(sharded["loss"] - gathered["loss"]) < 1e-5 * abs(gathered["loss"])
        torch.testing.assert_close(torch.tensor(sharded["grad"]), torch.tensor(gathered["grad"]), rtol=1e-4, atol=1e-7)


def _vocab_slice_worker(rank: int, store: str, out: str) -> None:
    from keel.model.loss import cross_entropy_loss
    from keel.train.vocab_parallel import shard_offset, vocab_parallel_cross_entropy

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    vocab = 37  # uneven slices: columns 0..18 and 19..36, as Shard(-1) splits them
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 11, vocab, generator=g) * 4
    targets = torch.randint(0, vocab, (3, 11), generator=g)
    targets[1, 2:5] = -100
    start, end = shard_offset(vocab, rank, 2), shard_offset(vocab, rank + 1, 2)
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        whole = logits.to(dtype).requires_grad_()
        mine = logits.to(dtype)[..., start:end].clone().requires_grad_()
        for reduction in ("mean", "sum"):
            want = cross_entropy_loss(whole, targets, reduction=reduction)
            got = vocab_parallel_cross_entropy(mine, targets, vocab, dist.group.WORLD, reduction=reduction)
            (want_grad,) = torch.autograd.grad(want * 3, whole)
            (got_grad,) = torch.autograd.grad(got * 3, mine)
            results[f"{dtype}-{reduction}"] = {
                "loss": [float(got), float(want)],
                "grad_error": (got_grad.float() - want_grad[..., start:end].float()).abs().max().item(),
                "grad_scale": want_grad.float().abs().max().item(),
                "grad_dtype": str(got_grad.dtype),
            }
    Path(f"{out}.{rank}").write_text(json.dumps(results))
    dist.destroy_process_group()


def test_vocab_slices_give_the_whole_logits_loss_and_gradients(tmp_path: Path):
    """Under a pipeline the last stage's loss gets each tp rank's plain vocabulary slice
    (keel.train.vocab_parallel): its loss and its slice of the gradient are the whole logits' (uneven
    slices, ignored targets, float32 and bf16 logits, mean and sum), on every rank."""
    out = str(tmp_path / "out")
    mp.spawn(_vocab_slice_worker, args=(str(tmp_path / "store"), out), nprocs=2, join=True)
    for rank in range(2):
        got = json.loads(Path(f"{out}.{rank}").read_text())
        assert len(got) == 4
        for case, r in got.items():
            sharded, whole = r["loss"]
            assert abs(sharded - whole) < 1e-5 * abs(whole), (rank, case)
            assert r["grad_error"] < (1e-6 if "float32" in case else 1e-2) * r["grad_scale"], (rank, case)
            assert r["grad_dtype"] == case.split("-")[0], (rank, case)
