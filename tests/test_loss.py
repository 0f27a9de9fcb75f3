"""The chunked cross-entropy against the reference formula F.cross_entropy(logits.float(), targets)."""

import pytest
import torch
import torch.nn.functional as F

from keel.model import loss as loss_module
from keel.model.loss import cross_entropy_loss


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_bytes", [4 * 97 * 3, 4 << 20])  # 3 rows per chunk (ragged last one), one chunk
def test_matches_reference_loss_and_gradient(monkeypatch, dtype, chunk_bytes):
    monkeypatch.setattr(loss_module, "CHUNK_BYTES", chunk_bytes)
    torch.manual_seed(0)
    base = (torch.randn(2, 11, 97) * 4).to(dtype)
    targets = torch.randint(0, 97, (2, 11))
    targets[0, 3] = targets[1, 0] = -100
    ours_in = base.clone().requires_grad_()
    ref_in = base.clone().requires_grad_()
    ours = cross_entropy_loss(ours_in, targets)
    ref = F.cross_entropy(ref_in.float().flatten(0, 1), targets.flatten(), ignore_index=-100)
    (ours * 3.0).backward()
    (ref * 3.0).backward()
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)
    assert ours_in.grad.dtype == dtype
    tol = dict(rtol=1e-6, atol=1e-7) if dtype == torch.float32 else dict(rtol=8e-3, atol=1e-6)  # bf16: 1 ulp
    torch.testing.assert_close(ours_in.grad, ref_in.grad, **tol)
    assert torch.all(ours_in.grad[0, 3] == 0) and torch.all(ours_in.grad[1, 0] == 0)  # ignored rows


def test_all_targets_ignored_is_nan_like_the_reference():
    logits = torch.randn(4, 10)
    targets = torch.full((4,), -100)
    assert torch.isnan(cross_entropy_loss(logits, targets))
    assert torch.isnan(F.cross_entropy(logits, targets))
    assert cross_entropy_loss(logits, targets, reduction="sum") == 0


def test_sum_reduction_and_its_gradient():
    torch.manual_seed(1)
    logits = torch.randn(6, 13, requires_grad=True)
    ref_in = logits.detach().clone().requires_grad_()
    targets = torch.tensor([1, -100, 3, 12, 0, -100])
    ours = cross_entropy_loss(logits, targets, reduction="sum")
    ref = F.cross_entropy(ref_in, targets, reduction="sum")
    ours.backward()
    ref.backward()
    torch.testing.assert_close(ours, ref)
    torch.testing.assert_close(logits.grad, ref_in.grad)


def test_no_grad_evaluation_and_extreme_logits():
    logits = torch.tensor([[1e4, 0.0, -1e4], [0.0, 0.0, 0.0]])
    targets = torch.tensor([1, 2])
    with torch.no_grad():
        ours = cross_entropy_loss(logits, targets)
    torch.testing.assert_close(ours, F.cross_entropy(logits, targets))
    assert torch.isfinite(ours)


def test_chunks_stay_cache_sized_on_cpus_and_few_on_gpus():
    """A CPU chunk is 4 MiB of float32 logits whatever the batch; off the CPU the chunks grow so that a
    call iterates at most MAX_CHUNKS times (Llama 3's 128,256-token vocabulary, 16 Ki rows: 32 chunks)."""
    from keel.model.loss import MAX_CHUNKS, chunk_rows

    cpu, cuda = torch.device("cpu"), torch.device("cuda")  # a device name, no GPU needed
    assert chunk_rows(16384, 128256, cpu) == 8 and chunk_rows(16384, 32000, cpu) == 32
    for rows, vocab in [(16384, 128256), (131072, 128256), (4096, 32000), (7, 256000)]:
        per = chunk_rows(rows, vocab, cuda)
        assert -(-rows // per) <= MAX_CHUNKS
        assert per >= min(rows, (256 << 20) // (4 * vocab))  # 256 MiB of float32 logits, or every row
