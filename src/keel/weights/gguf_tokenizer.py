"""The tokenizer of a GGUF file, rebuilt as a `tokenizers.Tokenizer` from its vocabulary and merges.

llama.cpp stores byte-level BPE vocabularies (`tokenizer.ggml.model == "gpt2"`) as
`tokenizer.ggml.tokens` / `merges` / `token_type` plus a `pre` name that selects the pre-tokenizer
regex; this module maps those onto the `tokenizers` library the way llama.cpp and transformers' GGUF
loader do.

SentencePiece vocabularies (`"llama"`: Llama 2, Mistral v0.1, TinyLlama, Phi-3) store `tokens`,
`scores` and `token_type` and no merges: llama.cpp (llm_tokenizer_spm in llama-vocab.cpp) prefixes
each stretch of text between special tokens with a space (`add_space_prefix`), writes spaces as
U+2581, then repeatedly merges the adjacent pair of symbols (UTF-8 characters at first) whose
concatenation is the best-scored token, the leftmost on a tie, and spells a character that no token
covers as byte tokens `<0xXX>`. That is BPE with the merges ranked by the score of the token they
make, which `tokenizers`' BPE model runs with the same leftmost tie-break (as transformers' GGUF
loader derives them); the file's scores, not any `merges` key, define the order, as in llama.cpp.

Gemma 4's vocabularies (`"gemma4"`, llama.cpp's LLAMA_VOCAB_PRE_TYPE_GEMMA4) are SentencePiece-style BPE with merges,
as transformers' GemmaTokenizer and llama.cpp both run them (`_gemma4_tokenizer` has the details).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from gguf import Keys
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
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
# o200k (GPT-4o, GPT-OSS, Llama 4): tokenizer.json's own regex, which llama.cpp rewrites without \p{Lu} classes.
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# DeepSeek-V3 / R1: numbers in threes, CJK runs, then words with their marks and punctuation runs.
_DEEPSEEK3_SPLITS = (
    r"\p{N}{1,3}",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)
# DeepSeek LLM / V2: newlines alone, letter runs (Latin, Greek, Cyrillic, ... as listed), ASCII and full-width
# punctuation runs, trailing spaces, CJK and Hangul runs, digit runs. Escaped: Unicode normalisation of source text
# would turn the singletons among these bounds (U+1F7D, U+1FD3, U+2126, U+212A, ...) into other characters.
_DEEPSEEK_LLM_SPLITS = (
    r"[\r\n]",
    r"\s?"
    "[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373"
    "\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481"
    "\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b"
    "\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b"
    "\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb"
    "\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128"
    "\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4"
    "\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf"
    "\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3"
    "\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943]+",
    "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
    r"\s+$",
    "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+",
    r"\p{N}+",
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
    **{name: ((_GPT4O_SPLIT,), False) for name in ("gpt-4o", "llama4", "kanana2", "talkie")},
    # GLM-4 / GLM-4.5 (llama.cpp's CHATGLM4: Llama 3's regex, merges ignored except for chatglm-bpe)
    **{name: ((_LLAMA3_SPLIT,), True) for name in ("glm4", "glm5")},
    "chatglm-bpe": ((_LLAMA3_SPLIT,), False),
    "deepseek-v3": (_DEEPSEEK3_SPLITS, False),
    "deepseek-llm": (_DEEPSEEK_LLM_SPLITS, False),
}
_K = Keys.Tokenizer  # the metadata keys, as gguf names them
_UNKNOWN, _CONTROL, _USER_DEFINED = 2, 3, 4  # tokenizer.ggml.token_type values
_SPM_SPACE = "\u2581"  # SentencePiece's visible space
# llama.cpp's SentencePiece defaults when the file names no special token ids.
_SPM_BOS_ID, _SPM_EOS_ID, _SPM_UNK_ID = 1, 2, 0
# llama.cpp strips the whitespace after Phi-3's special tokens (by model name: the file does not say so),
# except after these.
_PHI3_NO_RSTRIP = ("<unk>", "<s>", "<|endoftext|>")


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
    model = get(_K.MODEL)
    tokens = get(_K.LIST)
    if model is None or tokens is None:
        return None  # a weights-only GGUF
    if model == "llama":
        return _sentencepiece_tokenizer(get, tokens, eos_token_ids, path)
    if model == "gemma4":
        return _gemma4_tokenizer(get, tokens, eos_token_ids)
    if model != "gpt2":
        raise KeelError(
            f"{path}: GGUF tokenizer model {model!r} is not supported "
            "(keel reads byte-level BPE, 'gpt2', SentencePiece, 'llama', and Gemma 4's, 'gemma4')"
        )
    pre = get(_K.PRE) or "default"
    if pre not in _PRE_TOKENIZERS:
        raise KeelError(
            f"{path}: GGUF pre-tokenizer {pre!r} is not supported (supported: {', '.join(_PRE_TOKENIZERS)})"
        )
    splits, ignore_merges = _PRE_TOKENIZERS[pre]
    types = get(_K.TOKEN_TYPE) or [1] * len(tokens)
    merges = [tuple(m.split(" ", 1)) for m in get(_K.MERGES) or []]
    tok, vocab, alphabet = _byte_level_bpe(tokens, merges, splits, ignore_merges)
    _add_special_tokens(tok, tokens, types, vocab, alphabet)

    token_at = lambda i: tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None  # noqa: E731
    # llama.cpp adds BOS by default for llama3-style vocabularies; the file's flag overrides.
    return _wrapped(tok, get, token_at(get(_K.BOS_ID)), token_at(get(_K.EOS_ID)), ignore_merges, eos_token_ids)


def _sentencepiece_tokenizer(
    get: Callable[[str], Any], tokens: list[str], eos_token_ids: list[int], path: Path
) -> Tokenizer:
    """A SentencePiece (`"llama"`) vocabulary tokenized as llama.cpp's llm_tokenizer_spm does."""
    scores = get(_K.SCORES)
    if scores is None or len(scores) != len(tokens):
        raise KeelError(
            f"{path}: GGUF tokenizer model 'llama' (SentencePiece) needs tokenizer.ggml.scores, one per token "
            f"({len(tokens)} tokens, {'no' if scores is None else len(scores)} scores)"
        )
    types = get(_K.TOKEN_TYPE) or [1] * len(tokens)
    # A token spelled twice is looked up as its last id, as llama.cpp's token_to_id map does.
    vocab = {token: i for i, token in enumerate(tokens)}
    token_at = lambda i: tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None  # noqa: E731
    unk = token_at(get(_K.UNK_ID, _SPM_UNK_ID))
    # byte_fallback: a character no token spells becomes its UTF-8 bytes' <0xXX> tokens; without those,
    # the unknown token (consecutive ones fused, as sentencepiece does; llama.cpp has no answer there).
    bpe = models.BPE(vocab, _merges_by_score(vocab, scores), unk_token=unk, fuse_unk=True, byte_fallback=True)
    tok = HFTokenizer(bpe)
    add_space_prefix = bool(get(_K.ADD_PREFIX, True))
    # Normalizers run on each stretch of text between added tokens, so each one gets the space prefix:
    # llama.cpp prefixes the first stretch and every one that follows a special token (is_prev_special).
    # A Prepend, not Metaspace's prefix: llama.cpp prefixes text that starts with a space too.
    replace = normalizers.Replace(" ", _SPM_SPACE)
    tok.normalizer = normalizers.Sequence([normalizers.Prepend(_SPM_SPACE), replace]) if add_space_prefix else replace
    decoder = [decoders.Replace(_SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    # The prefix space comes off the decoded text again, as transformers does (llama.cpp's detokenize too,
    # but keeps it after a leading BOS it skips: the decoder does not see skipped tokens).
    tok.decoder = decoders.Sequence(decoder + ([decoders.Strip(" ", 1, 0)] if add_space_prefix else []))

    name = str(get(Keys.General.NAME) or "").lower()
    phi3 = "phi-3" in name or "phi3" in name
    special = [
        AddedToken(t, special=kind != _USER_DEFINED, normalized=False, rstrip=phi3 and t not in _PHI3_NO_RSTRIP)
        for t, kind in zip(tokens, types, strict=False)
        if kind in (_UNKNOWN, _CONTROL, _USER_DEFINED)
    ]
    # llama.cpp matches control and unknown tokens in the text when it parses special tokens (as keel
    # always does, like llama-server) and user-defined ones always: all whole, longest first.
    tok.add_special_tokens([t for t in special if t.special])
    tok.add_tokens([t for t in special if not t.special])

    bos, eos = token_at(get(_K.BOS_ID, _SPM_BOS_ID)), token_at(get(_K.EOS_ID, _SPM_EOS_ID))
    return _wrapped(tok, get, bos, eos, True, eos_token_ids)  # llama.cpp adds BOS to SentencePiece text by default


def _gemma4_tokenizer(get: Callable[..., Any], tokens: list[str], eos_token_ids: list[int]) -> Tokenizer:
    """A Gemma 4 (`"gemma4"`) vocabulary, tokenized as llama.cpp does (llm_tokenizer_bpe_session with
    LLAMA_VOCAB_PRE_TYPE_GEMMA4) and transformers' GemmaTokenizer does for the tokenizer.json it came from:

    - every ASCII space is written U+2581 (`escape_whitespaces`), with no prefix space (`add_space_prefix` false);
      tabs, other whitespace, digits and other characters are left as they are (no digit or word splitting);
    - the text is split into runs of newlines and runs of anything else (llama.cpp's `[^\n]+|[\n]+`; transformers
      does not split, which merges the same since Gemma 4's merges never join a newline to anything);
    - a run of newlines that is itself a token is that token, not merged (llama.cpp's Gemma 4 rule, PR 21343:
      Gemma's newline runs are SentencePiece user-defined pieces, added tokens in tokenizer.json that transformers
      matches before BPE, but the converter types them normal and writes no merges making them). They are added
      tokens here, so a run longer than the longest such token is cut greedily, longest first, as transformers
      does; llama.cpp merges such a run by rank instead (with no merges for newlines: one token per newline);
    - the rest is BPE over whole UTF-8 characters (no GPT-2 byte alphabet), the file's merges in rank order, the
      leftmost pair first among equal ranks, as both do;
    - a character no token spells becomes its UTF-8 bytes' `<0xXX>` tokens (byte fallback);
    - control and unknown tokens are special, user-defined ones (Gemma4Model's `<|channel>`, `<|tool_call>`, ...)
      are not; both are matched whole in the text, longest first;
    - BOS is always added: llama.cpp turns `add_bos_token` on for this vocabulary whatever the file says (as
      GemmaTokenizer's default); EOS only where the file's `add_eos_token` says so.

    Decoding turns U+2581 back into spaces and byte tokens into their bytes (invalid UTF-8 as U+FFFD), as
    GemmaTokenizer's decoder does; llama.cpp's detokenizer also drops a space before `?!.,` (clean_spaces),
    which transformers does not, and neither does keel.
    """
    types = get(_K.TOKEN_TYPE) or [1] * len(tokens)
    vocab = {token: i for i, token in enumerate(tokens)}  # a token spelled twice: its last id, as llama.cpp's map
    # llama.cpp cuts a merge at its first space after the first character (a merge of a literal space keeps it).
    merges = [(m[: m.index(" ", 1)], m[m.index(" ", 1) + 1 :]) for m in get(_K.MERGES) or [] if " " in m[1:]]
    tok = HFTokenizer(models.BPE(vocab, merges, byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", _SPM_SPACE)
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[^\n]+|[\n]+"), behavior="isolated")
    tok.decoder = decoders.Sequence([decoders.Replace(_SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    special = [
        AddedToken(t, special=kind != _USER_DEFINED, normalized=False)
        for t, kind in zip(tokens, types, strict=False)
        if kind in (_UNKNOWN, _CONTROL, _USER_DEFINED)
    ]
    tok.add_special_tokens([t for t in special if t.special])
    tok.add_tokens([t for t in special if not t.special])
    # Newline runs that are (normal) tokens: whole, ahead of BPE.
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in vocab if t and not t.strip("\n")])
    token_at = lambda i: tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None  # noqa: E731
    forced = lambda key, default=None: True if key == _K.ADD_BOS else get(key, default)  # noqa: E731
    bos, eos = token_at(get(_K.BOS_ID)), token_at(get(_K.EOS_ID))
    return _wrapped(tok, forced, bos, eos, True, eos_token_ids)


def _merges_by_score(vocab: dict[str, int], scores: list[float]) -> list[tuple[str, str]]:
    """Every pair of tokens that concatenate to a token, ranked by that token's score, best first.

    llama.cpp merges the adjacent symbols whose concatenation is the best-scored token, the leftmost
    first among equals; `tokenizers`' BPE merges the best-ranked pair, the leftmost first among equals.
    The splits of one token share its score: they are ranked next to each other, shortest left first.
    Distinct tokens of one score rank by id. Only there can the two differ: llama.cpp merges the leftmost
    of such pairs whatever their tokens, which no ranking reproduces. SentencePiece-trained vocabularies
    score every token apart (sentencepiece itself merges as llama.cpp does). Files whose converter wrote
    one placeholder score for all (gguf's LlamaHfVocab: -1000 each) keep a tokenizer.json's ids, which
    usually number the tokens in the original BPE's merge order: ranking by id follows that order.
    """
    ranked = []
    for token, i in vocab.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                ranked.append((-float(scores[i]), i, cut, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


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


def _wrapped(
    tok: HFTokenizer,
    get: Callable[..., Any],
    bos: str | None,
    eos: str | None,
    add_bos_default: bool,
    eos_token_ids: list[int],
) -> Tokenizer:
    """keel's Tokenizer over `tok`: BOS and EOS added as the file's flags say (BOS by `add_bos_default` where
    the file has no flag, EOS never), and its chat template."""
    add_bos, add_eos = get(_K.ADD_BOS, add_bos_default), get(_K.ADD_EOS, False)
    _add_bos_eos(tok, bos if add_bos else None, eos if add_eos else None)
    return Tokenizer(
        tok, chat_template=get(_K.CHAT_TEMPLATE), bos_token=bos, eos_token=eos, eos_token_ids=eos_token_ids
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
