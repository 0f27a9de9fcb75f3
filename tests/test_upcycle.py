"""Sparse upcycling: a MoE made of identical copies of a dense MLP computes the dense model."""

from __future__ import annotations

import pytest
import torch

from keel.quant.loading import load_model
from keel.tools.upcycle import upcycle_model
from tiny_models import save_byte_tokenizer, save_hf_model

DICKENS = "It was the best of times, it was the worst of times, it was the age of wisdom"


# The real SmolLM2 upcycled, in `make test-slow` (the default suite's budget); keel upcycle's test stays.
@pytest.mark.slow
def test_upcycled_smollm2_equals_the_dense_model():
    """The real checkpoint, 4 experts top-2: the same logits and the same greedy continuation."""
    dense = load_model("smollm2-135m-instruct", "float32")
    sparse = upcycle_model(dense.model, num_experts=4, top_k=2)
    assert sparse.config.architecture == "mixtral" and sparse.config.num_experts == 4
    assert sum(p.numel() for p in sparse.parameters()) > 2.5 * sum(p.numel() for p in dense.model.parameters())
    ids = torch.tensor([dense.tokenizer.encode(DICKENS)])
    with torch.no_grad():
        want, got = dense.model(ids), sparse(ids)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=2e-4)
        # The router spreads tokens over experts (random routing): every expert computes something.
        routing = sparse.layers["0"].mlp.router(dense.model.embed_tokens(ids)[0])
        assert len(set(routing.ids.flatten().tolist())) == 4
        tokens_dense, tokens_sparse = ids, ids
        for _ in range(6):
            tokens_dense = torch.cat([tokens_dense, dense.model(tokens_dense)[:, -1:].argmax(-1)], dim=1)
            tokens_sparse = torch.cat([tokens_sparse, sparse(tokens_sparse)[:, -1:].argmax(-1)], dim=1)
    assert tokens_sparse.tolist() == tokens_dense.tolist()


def test_keel_upcycle_writes_a_mixtral_that_transformers_loads(tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    from keel.cli import main  # in-process: the CLI's own main (keel's commands in a shell: test_cli_errors.py)

    save_hf_model("llama", tmp_path / "dense")
    save_byte_tokenizer(tmp_path / "dense")
    assert main(["upcycle", str(tmp_path / "dense"), str(tmp_path / "moe"), "--experts", "4", "--top-k", "2"]) == 0
    assert "4 experts, top-2" in capsys.readouterr().out
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "moe", dtype=torch.float32).eval()
    assert type(hf).__name__ == "MixtralForCausalLM"
    dense = load_model(tmp_path / "dense", "float32").model
    ours = load_model(tmp_path / "moe", "float32")
    tokens = torch.tensor([[5, 9, 200, 17, 3, 64, 80]])
    with torch.no_grad():
        want = dense(tokens)
        torch.testing.assert_close(hf(tokens).logits, want, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(ours.model(tokens), want, rtol=1e-4, atol=1e-5)
    assert ours.tokenizer is not None
    # A model without a sparse counterpart: one line, exit 1.
    save_hf_model("qwen2", tmp_path / "qwen2")
    capsys.readouterr()
    assert main(["upcycle", str(tmp_path / "qwen2"), str(tmp_path / "x")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("keel: error: upcycle:") and err.count("\n") == 1, err
