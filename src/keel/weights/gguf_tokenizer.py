"""The tokenizer of a GGUF file, rebuilt as a `tokenizers.Tokenizer` from its vocabulary and merges.

llama.cpp stores byte-level BPE vocabularies as `tokenizer.ggml.tokens` / `merges` / `token_type`
plus a `pre` name that selects the pre-tokenizer regex; this module maps those onto the
`tokenizers` library the way llama.cpp and transformers' GGUF loader do.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from keel.errors import KeelError
from keel.tokenizer import Tokenizer

# Pre-tokenizer regexes, as llama.cpp (llama-vocab.cpp) and transformers' GGUF loader use them.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> (regexes applied in turn, llama.cpp's ignore_merges flag)
_PRE_TOKENIZERS: dict[str, tuple[tuple[str, ...], bool]] = {
    "default": ((_GPT2_SPLIT,), False),
    "gpt2": ((_GPT2_SPLIT,), False),
    # SmolLM / StarCoder: every digit alone, then the GPT-2 regex.
    **{name: ((r"\p{N}", _GPT2_SPLIT), False) for name in ("smollm", "starcoder", "refact", "codeshell")},
    **{name: ((_LLAMA3_SPLIT,), True) for name in ("llama3", "llama-v3", "llama-bpe", "falcon3")},
    **{name: ((_LLAMA3_SPLIT,), False) for name in ("smaug-bpe", "dbrx")},
    **{name: ((_QWEN2_SPLIT,), False) for name in ("qwen2", "deepseek-r1-qwen", "megrez")},
}
_CONTROL, _USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (the alphabet byte-level BPE vocabularies are spelled in)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def tokenizer_from_gguf(get: Callable[[str], Any], eos_token_ids: list[int], path: Path) -> Tokenizer | None:
    """The tokenizer stored in a GGUF's `tokenizer.*` metadata (`get(key)` reads a key, None if absent),
    or None for a weights-only file."""
    model = get("tokenizer.ggml.model")
    tokens = get("tokenizer.ggml.tokens")
    if model is None or tokens is None:
        return None  # a weights-only GGUF
    if model != "gpt2":
        raise KeelError(
            f"{path}: GGUF tokenizer model {model!r} is not supported (keel reads byte-level BPE, 'gpt2', only)"
        )
    pre = get("tokenizer.ggml.pre") or "default"
    if pre not in _PRE_TOKENIZERS:
        raise KeelError(
            f"{path}: GGUF pre-tokenizer {pre!r} is not supported (supported: {', '.join(_PRE_TOKENIZERS)})"
        )
    splits, ignore_merges = _PRE_TOKENIZERS[pre]
    types = get("tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = [tuple(m.split(" ", 1)) for m in get("tokenizer.ggml.merges") or []]
    tok, vocab, alphabet = _byte_level_bpe(tokens, merges, splits, ignore_merges)
    _add_special_tokens(tok, tokens, types, vocab, alphabet)

    token_at = lambda i: tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None  # noqa: E731
    bos = token_at(get("tokenizer.ggml.bos_token_id"))
    eos = token_at(get("tokenizer.ggml.eos_token_id"))
    # llama.cpp adds BOS by default for llama3-style vocabularies; the file's flag overrides.
    add_bos = get("tokenizer.ggml.add_bos_token", ignore_merges)
    add_eos = get("tokenizer.ggml.add_eos_token", False)
    _add_bos_eos(tok, bos if add_bos else None, eos if add_eos else None)
    return Tokenizer(
        tok,
        chat_template=get("tokenizer.chat_template"),
        bos_token=bos,
        eos_token=eos,
        eos_token_ids=eos_token_ids,
    )


def _byte_level_bpe(
    tokens: list[str], merges: list[tuple[str, ...]], splits: tuple[str, ...], ignore_merges: bool
) -> tuple[HFTokenizer, dict[str, int], set[str]]:
    """The BPE model with its pre-tokenizer regexes and byte-level decoder; also its vocabulary and alphabet."""
    # Tokens are stored in the byte-level alphabet already; respell any that are not (as transformers does).
    alphabet_map = _bytes_to_unicode()
    alphabet = set(alphabet_map.values())
    spelled = [t if set(t) <= alphabet else "".join(alphabet_map[b] for b in t.encode()) for t in tokens]
    vocab = {token: i for i, token in enumerate(spelled)}
    tok = HFTokenizer(models.BPE(vocab, merges, ignore_merges=ignore_merges))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(s), behavior="isolated") for s in splits] + [byte_level]
    )
    tok.decoder = decoders.ByteLevel()
    return tok, vocab, alphabet


def _add_special_tokens(
    tok: HFTokenizer, tokens: list[str], types: list[int], vocab: dict[str, int], alphabet: set[str]
) -> None:
    """Control tokens (<|im_start|>, ...) are special; user-defined ones (<think>) are matched whole."""
    # A control token outside the byte alphabet is a llama.cpp mislabel; transformers skips those too.
    tok.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, kind in zip(tokens, types, strict=False)
            if kind == _CONTROL and set(t) <= alphabet
        ]
    )
    tok.add_tokens(
        [
            AddedToken(t, special=False, normalized=False)
            for t, kind in zip(tokens, types, strict=False)
            if kind == _USER_DEFINED and t in vocab
        ]
    )


def _add_bos_eos(tok: HFTokenizer, bos: str | None, eos: str | None) -> None:
    """A post-processor that puts `bos` before and `eos` after each sequence (None: not added)."""
    if bos is None and eos is None:
        return
    first = [bos] if bos is not None else []
    last = [eos] if eos is not None else []
    specials = [(t, tok.token_to_id(t)) for t in dict.fromkeys(first + last)]
    tok.post_processor = processors.TemplateProcessing(
        single=" ".join(first + ["$A"] + last),
        pair=" ".join(first + ["$A"] + last + first + ["$B:1"] + last),
        special_tokens=specials,
    )
