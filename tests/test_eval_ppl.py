"""`keel eval ppl` (keel.model.perplexity): sliding-window perplexity against a direct computation, every
token after the first scored exactly once, deterministic, and clear CLI errors."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from keel import kernels
from keel.cli import main as keel_main
from keel.errors import KeelError
from keel.model.perplexity import sliding_window_perplexity, windows
from keel.quant.loading import load_model
from tiny_models import save_byte_tokenizer, save_hf_model


@pytest.mark.parametrize(("n", "context", "stride"), [(100, 32, 16), (100, 32, 32), (33, 32, 7), (5, 32, 16)])
def test_every_token_after_the_first_is_scored_once(n, context, stride):
    plan = windows(n, context, stride)
    scored = [t for begin, end, k in plan for t in range(end - k, end)]
    assert scored == list(range(1, n))  # in order, no gaps, no repeats
    assert all(end - begin <= context and end - k > begin for begin, end, k in plan)  # each has a prefix


def _direct_nll(model, ids: list[int], context: int, stride: int) -> float:
    """The same windows computed the plain way: full logits, then the scored rows."""
    total = 0.0
    for begin, end, k in windows(len(ids), context, stride):
        logits = model(torch.tensor([ids[begin:end]]))[0].float()
        targets = torch.tensor(ids[end - k : end])
        total += F.cross_entropy(logits[end - begin - k - 1 : end - begin - 1], targets, reduction="sum").item()
    return total


def test_matches_direct_computation_and_is_deterministic(tmp_path):
    save_hf_model("llama", tmp_path)
    model = load_model(str(tmp_path), "float32").model
    ids = torch.randint(0, model.config.vocab_size, (150,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.inference_mode():
        for context, stride in [(64, 32), (64, 64), (200, 100)]:
            result = sliding_window_perplexity(model, ids, context, stride)
            assert result.tokens_scored == len(ids) - 1
            assert result.nll_sum == pytest.approx(_direct_nll(model, ids, context, stride), rel=1e-5)
            assert sliding_window_perplexity(model, ids, context, stride).nll_sum == result.nll_sum
        # One window holding everything: the plain perplexity of the sequence.
        whole = sliding_window_perplexity(model, ids, 200, 100)
        logits = model(torch.tensor([ids]))[0, :-1].float()
        assert whole.perplexity == pytest.approx(math.exp(F.cross_entropy(logits, torch.tensor(ids[1:])).item()))
        # Overlapping windows give each scored token more context: a different figure than disjoint ones.
        assert (
            sliding_window_perplexity(model, ids, 64, 16).nll_sum
            != sliding_window_perplexity(model, ids, 64, 64).nll_sum
        )
    with pytest.raises(KeelError, match="--stride"):
        windows(100, 32, 33)


def test_cli_prints_perplexity_and_writes_json(tmp_path, capsys):
    save_hf_model("llama", tmp_path / "m")
    save_byte_tokenizer(tmp_path / "m")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 8)
    out = tmp_path / "ppl.json"
    args = ["eval", "ppl", str(tmp_path / "m"), "--corpus", str(corpus), "--context", "64", "--stride", "32"]
    assert keel_main([*args, "--json", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["tokens_scored"] == len(corpus.read_text().encode()) - 1  # byte tokenizer: one token per byte
    assert f"perplexity {record['perplexity']:.4f}" in capsys.readouterr().out
    assert record["quantize"] is None  # auto: an HF checkpoint in float
    assert keel_main([*args, "--quantize", "int8", "--json", str(out)]) == 0
    quantized = json.loads(out.read_text())
    assert quantized["quantize"] == "int8" and quantized["perplexity"] != record["perplexity"]
    printed = capsys.readouterr().out
    # float32 where keel's kernels run the int8 blocks; without them auto picks torch's dtype for this host
    assert ("(float32, int8) on " if kernels.active() else ", int8) on ") in printed
    assert keel_main([*args[:3], "--corpus", str(tmp_path / "missing.txt")]) == 1
    assert "missing.txt: no such file" in capsys.readouterr().err
    assert keel_main([*args, "--stride", "65"]) == 1
    assert "--stride must be between 1 and --context (64), got 65" in capsys.readouterr().err
