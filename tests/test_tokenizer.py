"""Incremental detokenization and chat templates (sampling: tests/test_serve_sampling.py)."""

from __future__ import annotations

import pytest

from keel.errors import KeelError
from keel.tokenizer import Tokenizer
from tiny_models import save_byte_tokenizer


@pytest.fixture(scope="module")
def byte_tokenizer(tmp_path_factory) -> Tokenizer:
    directory = tmp_path_factory.mktemp("tok")
    save_byte_tokenizer(directory)
    tokenizer = Tokenizer.from_hf_dir(directory)
    assert tokenizer is not None
    return tokenizer


TEXT = "naïve café 東京 🙂 done"


def test_incremental_detokenizer_only_emits_complete_utf8(byte_tokenizer):
    ids = byte_tokenizer.encode(TEXT)
    assert len(ids) == len(TEXT.encode("utf-8"))  # one token per byte: characters span tokens
    detok = byte_tokenizer.detokenizer()
    deltas = [detok.add(i) for i in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) + detok.flush() == TEXT
    # The 4-byte emoji appears whole, after its last byte, never before.
    emoji_at = next(i for i, d in enumerate(deltas) if "🙂" in d)
    assert deltas[emoji_at - 3 : emoji_at] == ["", "", ""]


def test_detokenizer_flush_reveals_an_incomplete_tail(byte_tokenizer):
    detok = byte_tokenizer.detokenizer()
    ids = byte_tokenizer.encode("ok 🙂")[:-1]  # cut inside the emoji
    text = "".join(detok.add(i) for i in ids)
    assert text == "ok "
    assert detok.flush() == "\ufffd"


def test_chat_template_renders_like_transformers(byte_tokenizer, tmp_path):
    from transformers import AutoTokenizer

    byte_tokenizer.save_hf(tmp_path)
    reference = AutoTokenizer.from_pretrained(tmp_path)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi 🙂"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Bye"},
    ]
    for add in (True, False):
        expected = reference.apply_chat_template(messages, add_generation_prompt=add, tokenize=False)
        assert byte_tokenizer.apply_chat_template(messages, add_generation_prompt=add) == expected
    assert byte_tokenizer.encode_chat(messages) == reference.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )


def test_chat_template_errors_are_keel_errors():
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models

    broken = Tokenizer(HFTokenizer(models.BPE()), chat_template="{{ raise_exception('no system role') }}")
    with pytest.raises(KeelError, match="no system role"):
        broken.apply_chat_template([{"role": "user", "content": "x"}])
