"""SentencePiece GGUF vocabularies (`tokenizer.ggml.model == "llama"`: Llama 2, Mistral v0.1, TinyLlama),
tokenized by keel.weights.gguf_tokenizer as llama.cpp does.

No model hub here, so a small SentencePiece BPE model is trained with the `sentencepiece` package on the
repo's own Markdown plus generated multilingual text (with byte fallback, identity normalization and
whitespace kept, as Llama 2's tokenizer.model is set up), and its pieces, scores and types are written
to a tiny GGUF the way llama.cpp's converter writes them. Three references:

- sentencepiece itself on the same model: its BPE merges by score, best first and leftmost on a tie,
  exactly as llama.cpp's llm_tokenizer_spm does, for plain text;
- `llama_cpp_tokenize` below, a direct port of llama.cpp's SPM path (special-token partition, the space
  prefix on each stretch of text, the bigram queue, byte fallback), for what sentencepiece does
  differently: special tokens in the text and the prefix after them;
- transformers' GGUF tokenizer, where it agrees with llama.cpp (it drops llama.cpp's prefix space on
  text that starts with a space, and after special tokens).
"""

from __future__ import annotations

import heapq
import io
import json
import random
from pathlib import Path

import gguf
import numpy as np
import pytest
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

from keel.errors import KeelError
from keel.tokenizer import Tokenizer
from keel.weights.gguf import open_gguf
from keel.weights.gguf_file import GGUFFile
from keel.weights.gguf_tokenizer import tokenizer_from_gguf

spm = pytest.importorskip("sentencepiece")
pb = pytest.importorskip("sentencepiece.sentencepiece_model_pb2")

REPO = Path(__file__).resolve().parents[1]
SPACE = "\u2581"
CONTROL_SYMBOLS = ["<|im_start|>", "<|im_end|>"]
USER_SYMBOLS = ["<tool>"]
# Words the generated text draws on besides the repo's: accented Latin, Greek, Cyrillic, CJK, emoji.
FOREIGN = (
    "naïve café crème brûlée façade Ærøskøbing straße Ωμέγα λόγος Привет мир 東京 日本語のテキスト 北京大学 "
    "한국어 🙂 🚀 👨‍👩‍👧 ½ € — « » “ ” … ¿qué? ¡olé!"
).split()
# Characters too rare to get a piece (character_coverage drops them): byte fallback.
RARE = ["𝔘", "\ue000", "ǅ", "ꙮ", "☃", "\u00a0", "𓀀", "ﬁ"]


# ------------------------------------------------------------------------------ llama.cpp's algorithm
def llama_cpp_tokenize(
    text: str,
    tokens: list[str],
    scores: list[float],
    types: list[int],
    *,
    add_space_prefix: bool = True,
    add_bos: bool = False,
    bos_id: int = 1,
    rstrip: frozenset[int] = frozenset(),
) -> list[int]:
    """llama.cpp's `llama_vocab::impl::tokenize` for LLAMA_VOCAB_TYPE_SPM with parse_special (as llama-server
    tokenizes prompts): tokenizer_st_partition, then llm_tokenizer_spm_session on each stretch of text."""
    ids = {t: i for i, t in enumerate(tokens)}  # token_to_id: a token spelled twice maps to its last id
    special = [i for i, kind in enumerate(types) if kind in (2, 3, 4)]  # UNKNOWN, CONTROL, USER_DEFINED
    special.sort(key=lambda i: -len(tokens[i]))  # longest first
    fragments: list[str | int] = [text] if text else []
    for sid in special:
        piece, out = tokens[sid], []
        for fragment in fragments:
            while isinstance(fragment, str) and (at := fragment.find(piece)) >= 0:
                out += [fragment[:at]] if at else []
                out.append(sid)
                fragment = fragment[at + len(piece) :]
                if sid in rstrip:
                    fragment = fragment.lstrip(" \t\n\v\f\r")  # C isspace
            if fragment != "":
                out.append(fragment)
        fragments = out
    output = [bos_id] if add_bos else []
    prev_special = True  # "prefix with space if first token", and after each special token
    for fragment in fragments:
        if isinstance(fragment, int):
            output.append(fragment)
            prev_special = True
            continue
        prefixed = (" " if add_space_prefix and prev_special else "") + fragment
        output += _spm_session(prefixed.replace(" ", SPACE), ids, scores)
        prev_special = False
    return output


def _spm_session(text: str, ids: dict[str, int], scores: list[float]) -> list[int]:
    """llm_tokenizer_spm_session::tokenize: merge the best-scored adjacent pair (leftmost on a tie) until
    none is a token, then each symbol is its token or, if none, its UTF-8 bytes as <0xXX> tokens."""
    symbols = list(text)  # UTF-8 characters
    if not symbols:
        return []
    prev = list(range(-1, len(symbols) - 1))
    nxt = [*range(1, len(symbols)), -1]
    queue: list[tuple[float, int, int, int]] = []

    def try_add_bigram(left: int, right: int) -> None:
        if left == -1 or right == -1:
            return
        merged = symbols[left] + symbols[right]
        if merged in ids:  # priority_queue top: highest score, then smallest left
            heapq.heappush(queue, (-scores[ids[merged]], left, right, len(merged)))

    for i in range(1, len(symbols)):
        try_add_bigram(i - 1, i)
    while queue:
        _, left, right, size = heapq.heappop(queue)
        if not symbols[left] or not symbols[right] or len(symbols[left]) + len(symbols[right]) != size:
            continue  # one side was merged since
        symbols[left] += symbols[right]
        symbols[right] = ""
        nxt[left] = nxt[right]
        if nxt[right] >= 0:
            prev[nxt[right]] = left
        try_add_bigram(prev[left], left)
        try_add_bigram(left, nxt[left])
    out, i = [], 0
    while i != -1:
        if symbols[i] in ids:
            out.append(ids[symbols[i]])
        else:
            out += [ids[f"<0x{b:02X}>"] for b in symbols[i].encode()]  # byte_to_token
        i = nxt[i]
    return out


# ------------------------------------------------------------------------------------- the models
def training_text() -> str:
    """The repo's Markdown, and generated lines of the foreign words (so that they get pieces too)."""
    docs = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    text = "\n".join(p.read_text(encoding="utf-8") for p in docs if p.is_file())
    rng = random.Random(1)
    lines = [" ".join(rng.choice(FOREIGN) for _ in range(12)) for _ in range(400)]
    return text + "\n" + "\n".join(lines)


def train(byte_fallback: bool = True, vocab_size: int = 1200) -> bytes:
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(training_text().splitlines()),
        model_writer=model,
        model_type="bpe",
        vocab_size=vocab_size,
        byte_fallback=byte_fallback,
        # Llama 2's tokenizer.model: no normalization, whitespace kept as it is, a dummy prefix, digits split.
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=True,
        split_digits=True,
        allow_whitespace_only_pieces=True,
        character_coverage=0.9995,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        control_symbols=CONTROL_SYMBOLS,
        user_defined_symbols=USER_SYMBOLS,
        num_threads=1,
        minloglevel=2,
    )
    return model.getvalue()


class Vocab:
    """A trained SentencePiece model and its GGUF vocabulary (tokens, scores, token types)."""

    def __init__(self, proto: bytes) -> None:
        self.proto = pb.ModelProto()
        self.proto.ParseFromString(proto)
        self.sp = spm.SentencePieceProcessor(model_proto=proto)
        self.tokens = [p.piece for p in self.proto.pieces]
        self.scores = [p.score for p in self.proto.pieces]
        # sentencepiece's piece types are GGUF's token types (gguf.TokenType): NORMAL 1 .. BYTE 6.
        self.types = [int(p.type) for p in self.proto.pieces]
        self.id = {t: i for i, t in enumerate(self.tokens)}

    def without_dummy_prefix(self) -> spm.SentencePieceProcessor:
        proto = pb.ModelProto()
        proto.CopyFrom(self.proto)
        proto.normalizer_spec.add_dummy_prefix = False
        return spm.SentencePieceProcessor(model_proto=proto.SerializeToString())

    def llama_cpp(self, text: str, **kwargs) -> list[int]:
        return llama_cpp_tokenize(text, self.tokens, self.scores, self.types, **kwargs)


@pytest.fixture(scope="module")
def vocab() -> Vocab:
    return Vocab(train())


def write_gguf(path: Path, vocab: Vocab, name: str | None = None, ids: bool = True, **flags) -> Path:
    """A tiny llama GGUF (one tensor) with the vocabulary as llama.cpp's converter writes a SentencePiece
    one; `flags`: add_bos_token, add_eos_token, add_space_prefix (absent unless given)."""
    w = gguf.GGUFWriter(str(path), "llama")
    if name is not None:
        w.add_name(name)
    for key, value in dict(block_count=1, context_length=64, embedding_length=8, feed_forward_length=16).items():
        getattr(w, f"add_{key}")(value)
    w.add_head_count(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("llama")
    w.add_token_list(vocab.tokens)
    w.add_token_scores(vocab.scores)
    w.add_token_types(vocab.types)
    if ids:
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_unk_token_id(0)
    for flag, value in flags.items():
        getattr(w, f"add_{flag}")(value)
    w.add_tensor("token_embd.weight", np.zeros((len(vocab.tokens), 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def keel_tokenizer(path: Path):
    """keel's tokenizer for a GGUF, through keel's own GGUF reader (open_gguf passes the same `get`)."""
    fields = GGUFFile(path).fields
    return tokenizer_from_gguf(lambda key, default=None: fields.get(key, default), [], path)


@pytest.fixture(scope="module")
def gguf_path(vocab, tmp_path_factory) -> Path:
    return write_gguf(tmp_path_factory.mktemp("spm") / "spm.gguf", vocab, add_bos_token=True, add_space_prefix=True)


@pytest.fixture(scope="module")
def tok(gguf_path):
    return keel_tokenizer(gguf_path)


def mixed_text(n: int = 10_000, seed: int = 0) -> str:
    """~n characters: the repo's words and foreign ones, runs of spaces, newlines, tabs, CRLF, digits,
    punctuation, rare characters; leading and trailing spaces."""
    rng = random.Random(seed)
    words = (REPO / "README.md").read_text(encoding="utf-8").split()
    extra = ["2024", "3.14159", "0x1F", "1,000,000", "(x+y)*z", "a_b", "#!", "--flag=1", "'quoted'", '"dq"']
    gaps = [" "] * 6 + ["  ", "   ", "    ", "\n", "\n\n", "\t", " \t ", "\r\n", ""]
    parts: list[str] = ["  "]
    while sum(map(len, parts)) < n:
        r = rng.random()
        parts.append(rng.choice(RARE if r < 0.05 else FOREIGN if r < 0.3 else extra if r < 0.4 else words))
        parts.append(rng.choice(gaps))
    return "".join(parts) + "   "


# ------------------------------------------------------------------------------------------ tests
def test_mixed_text_matches_sentencepiece_and_llama_cpp(vocab, tok):
    text = mixed_text()
    assert len(text) >= 10_000 and any(c in text for c in RARE)
    ids = tok.encode(text, add_special_tokens=False)
    assert ids == vocab.sp.encode(text)
    assert ids == vocab.llama_cpp(text)
    assert any(vocab.types[i] == gguf.TokenType.BYTE for i in ids)  # byte fallback was exercised
    assert tok.encode(text) == [1, *ids]  # add_bos_token
    assert tok.decode(ids) == text == vocab.sp.decode(ids)
    assert tok.decode([1, *ids]) == text


EDGE_CASES = [
    "",
    " ",
    "  ",
    "\n",
    "\t",
    "a",
    " a",
    "  leading",
    "trailing  ",
    " both ",
    "Hello world",
    "Hello  world   !",
    "line one\nline two\n\n\tTabbed\r\nwindows",
    "12345 67.89",
    "naïve café Ærøskøbing",
    "東京 日本語のテキスト",
    "🙂👨‍👩‍👧🚀",
    "𝔘\ue000ꙮ☃",  # no piece: bytes
    "a\u00a0b",  # NBSP is not a space to SentencePiece
    f"{SPACE}x {SPACE}",  # U+2581 in the text itself
    "the the the the",
    "aaaaaaaaaaaaaaaa",
    "<tool",  # not the user-defined token
]


@pytest.mark.parametrize("text", EDGE_CASES)
def test_edge_cases(vocab, tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    assert ids == vocab.sp.encode(text) == vocab.llama_cpp(text), [vocab.tokens[i] for i in ids]
    assert tok.decode(ids) == text.replace(SPACE, " ")  # U+2581 is a space to SentencePiece
    assert tok.encode(text) == [1, *ids]


def test_random_strings(vocab, tok):
    """Short strings of a few frequent characters: many competing merges of equal and near scores."""
    rng = random.Random(2)
    alphabet = "theinarso  \n東京é"
    for _ in range(400):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 40)))
        ids = tok.encode(text, add_special_tokens=False)
        assert ids == vocab.sp.encode(text) == vocab.llama_cpp(text), repr(text)
        assert tok.decode(ids) == text


def test_without_space_prefix(vocab, tmp_path):
    """add_space_prefix = false: no dummy prefix (sentencepiece's add_dummy_prefix), nothing stripped."""
    tok = keel_tokenizer(write_gguf(tmp_path / "noprefix.gguf", vocab, add_space_prefix=False))
    sp = vocab.without_dummy_prefix()
    for text in [mixed_text(2000, seed=3), " a", "a", "  x  ", ""]:
        ids = tok.encode(text, add_special_tokens=False)
        assert ids == sp.encode(text) == vocab.llama_cpp(text, add_space_prefix=False)
        assert tok.decode(ids) == text


def test_special_tokens_in_text(vocab, tok):
    """Control and unknown tokens are matched whole (llama.cpp with parse_special, as llama-server
    tokenizes), user-defined ones always; each stretch of text after one gets the space prefix, as in
    llama.cpp (sentencepiece itself treats control tokens as text and adds no prefix after <tool>)."""
    start, end, tool = (vocab.id[t] for t in ("<|im_start|>", "<|im_end|>", "<tool>"))
    texts = [
        "<|im_start|>user\nHello world<|im_end|>\n<|im_start|>assistant\n",
        "x<tool>y <tool> z<tool>",
        "<unk> and <s> and </s>",
        "<|im_start|><|im_end|><|im_start|>",
        "  <|im_start|>  spaced  ",
    ]
    for text in texts:
        ids = tok.encode(text, add_special_tokens=False)
        assert ids == vocab.llama_cpp(text), (text, [vocab.tokens[i] for i in ids])
        assert tok.encode(text) == [1, *ids] == vocab.llama_cpp(text, add_bos=True)
    ids = tok.encode(texts[0], add_special_tokens=False)
    assert ids[0] == start and ids.count(start) == 2 and ids.count(end) == 1
    assert vocab.tokens[ids[1]].startswith(SPACE)  # "▁user": the prefix after a special token
    assert ids[:2] != vocab.sp.encode(texts[0])[:2]  # sentencepiece spells <|im_start|> out
    # Decoding skips control tokens and keeps user-defined ones; the prefix spaces come back as spaces.
    assert tok.decode(ids) == "user\nHello world \n assistant\n"
    assert (
        tok.decode(ids, skip_special_tokens=False)
        == "<|im_start|> user\nHello world<|im_end|> \n<|im_start|> assistant\n"
    )
    ids = tok.encode(texts[1], add_special_tokens=False)
    assert ids.count(tool) == 3 and tok.decode(ids) == "x<tool> y <tool>  z<tool>"


def test_bos_eos(vocab, tmp_path):
    """add_bos_token / add_eos_token, and llama.cpp's SentencePiece defaults where the file is silent:
    BOS added, no EOS, bos/eos/unk ids 1/2/0."""
    text = "Hello world"
    plain = vocab.sp.encode(text)
    cases = {
        "defaults": (dict(ids=False), [1, *plain]),
        "no bos": (dict(add_bos_token=False), plain),
        "bos and eos": (dict(add_bos_token=True, add_eos_token=True), [1, *plain, 2]),
    }
    for name, (kwargs, expected) in cases.items():
        tok = keel_tokenizer(write_gguf(tmp_path / f"{name}.gguf", vocab, **kwargs))
        assert tok.encode(text) == expected, name
        assert tok.encode(text, add_special_tokens=False) == plain, name
        assert (tok.bos_token, tok.eos_token, tok.eos_token_ids) == ("<s>", "</s>", [2]), name
        assert tok.decode(expected) == text and tok.decode([0]) == ""  # <unk> is special


def test_unknown_token_without_byte_fallback(tmp_path):
    """Without <0xXX> tokens a character no piece spells is the unknown token, a run of them one unknown
    token, as sentencepiece does (llama.cpp itself aborts there)."""
    vocab = Vocab(train(byte_fallback=False, vocab_size=600))
    assert not any(t == gguf.TokenType.BYTE for t in vocab.types)
    tok = keel_tokenizer(write_gguf(tmp_path / "nobytes.gguf", vocab))
    for text in ["a𝔘b", "𝔘𝔘 ꙮ☃x", mixed_text(2000, seed=4)]:
        ids = tok.encode(text, add_special_tokens=False)
        assert ids == vocab.sp.encode(text)
        assert 0 in ids


def test_phi3_strips_whitespace_after_special_tokens(vocab, tmp_path):
    """llama.cpp strips the whitespace after Phi-3's special tokens but <unk>, <s>, <|endoftext|> (it sets
    the RSTRIP attribute by general.name); any other model keeps it."""
    text = "<|im_start|> \n user\n<|im_end|>\n\n<s>  x </s> y"
    rstrip = frozenset(
        i for i, t in enumerate(vocab.types) if t in (2, 3, 4) and vocab.tokens[i] not in ("<unk>", "<s>")
    )
    phi3 = keel_tokenizer(write_gguf(tmp_path / "phi3.gguf", vocab, name="Phi-3-mini-4k-instruct"))
    ids = phi3.encode(text, add_special_tokens=False)
    assert ids == vocab.llama_cpp(text, rstrip=rstrip)
    assert phi3.decode(ids, skip_special_tokens=False) == "<|im_start|> user\n<|im_end|><s>   x </s> y"
    other = keel_tokenizer(write_gguf(tmp_path / "other.gguf", vocab, name="Llama-2-7b"))
    assert other.encode(text, add_special_tokens=False) == vocab.llama_cpp(text) != ids


def test_placeholder_scores(vocab, tmp_path):
    """A converter that writes one score for every token (gguf's LlamaHfVocab: -1000): keel ranks the
    merges by token id, which for this vocabulary (numbered by score, as sentencepiece numbers it) is the
    original merge order. llama.cpp merges the leftmost pair there instead: the one known difference."""
    flat = Vocab(vocab.proto.SerializeToString())
    flat.scores = [-1000.0] * len(flat.scores)
    tok = keel_tokenizer(write_gguf(tmp_path / "flat.gguf", flat))
    text = mixed_text(2000, seed=8)
    assert tok.encode(text, add_special_tokens=False) == vocab.sp.encode(text) != flat.llama_cpp(text)


def test_transformers_agrees_where_it_follows_llama_cpp(vocab, tok, gguf_path):
    """transformers' GGUF tokenizer (merges derived from the scores, byte fallback) gives the same ids
    and text on text that does not start with a space and has no special tokens; on text that does, it
    drops llama.cpp's space prefix (Metaspace's "first" scheme) where keel keeps it."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    text = mixed_text(seed=5).lstrip()
    for t in [text, "Hello world", "東京🙂 naïve", "a\n b\t c", "trailing  ", ""]:
        ids = tok.encode(t)
        assert ids == hf(t)["input_ids"], repr(t[:50])
        assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=True) == t
    for t in [" hi", "<|im_start|>user"]:
        assert tok.encode(t) == vocab.llama_cpp(t, add_bos=True) != hf(t)["input_ids"]


def test_token_bytes_and_incremental_decoding(vocab, tok):
    """A token that starts with U+2581 stands for a space even as the text's first token; byte tokens are
    their byte; streaming decodes to the same text as one decode."""
    assert tok.token_bytes(vocab.id[f"{SPACE}the"]) == b" the"
    assert tok.token_bytes(vocab.id["<0xE6>"]) == b"\xe6"
    assert tok.token_bytes(vocab.id["the"]) == b"the"
    ids = tok.encode(mixed_text(3000, seed=6), add_special_tokens=False)
    detok = tok.detokenizer()
    streamed = "".join(detok.add(i) for i in ids) + detok.flush()
    assert streamed == tok.decode(ids)


def test_checkpoint_and_refusals(vocab, gguf_path, tmp_path):
    """open_gguf reads the vocabulary with the checkpoint; a SentencePiece vocabulary without scores and
    an unknown tokenizer model are one-line KeelErrors."""
    checkpoint = open_gguf(gguf_path)
    assert checkpoint.tokenizer.encode("Hello world") == [1, *vocab.sp.encode("Hello world")]
    assert checkpoint.tokenizer.eos_token_ids == [2]
    # `keel convert` writes it as tokenizer.json, which reads back the same.
    checkpoint.tokenizer.save_hf(tmp_path)
    saved = Tokenizer.from_hf_dir(tmp_path)
    text = mixed_text(2000, seed=7) + "<|im_start|>x"
    assert saved.encode(text) == checkpoint.tokenizer.encode(text)
    assert saved.decode(saved.encode(text)) == checkpoint.tokenizer.decode(checkpoint.tokenizer.encode(text))
    tokens = vocab.tokens
    for meta, expected in (
        ({"tokenizer.ggml.scores": None}, "'llama'.*tokenizer.ggml.scores"),
        ({"tokenizer.ggml.scores": [0.0] * 3}, "'llama'.*tokenizer.ggml.scores"),
        ({"tokenizer.ggml.model": "t5"}, "'t5' is not supported.*'gpt2'.*'llama'"),
    ):
        fields = {
            "tokenizer.ggml.model": "llama",
            "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.scores": vocab.scores,
        }
        fields.update(meta)
        with pytest.raises(KeelError, match=expected) as e:
            tokenizer_from_gguf(lambda key, default=None, f=fields: f.get(key, default), [], tmp_path / "x.gguf")
        assert "\n" not in str(e.value)


GEMMA4_CONTROL = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<|turn>", "<turn|>"]
GEMMA4_NEWLINES = ["\n", "\n\n", "\n\n\n"]  # normal tokens without merges, as in Gemma 4's vocabulary


def write_gemma4_vocab(path, pieces: list[str], merges: list[str], add_bos: bool = True) -> list[str]:
    """A Gemma 4 vocabulary as Gemma4Model writes it (`tokenizer.ggml.model` gemma4, from gguf's LlamaHfVocab):
    control tokens, the 256 byte tokens, runs of newlines and the pieces (spaces spelled U+2581) as normal tokens,
    `<|channel>` user-defined (visible), every score -1000, the merges in rank order, add_bos as given (the
    converter writes true; llama.cpp turns false into true for this vocabulary)."""
    tokens = GEMMA4_CONTROL + [f"<0x{b:02X}>" for b in range(256)] + GEMMA4_NEWLINES + pieces + ["<|channel>"]
    types = [3] * len(GEMMA4_CONTROL) + [6] * 256 + [1] * (len(GEMMA4_NEWLINES) + len(pieces)) + [4]
    w = gguf.GGUFWriter(str(path), "gemma4")
    w.add_tokenizer_model("gemma4")
    w.add_token_list(tokens)
    w.add_token_scores([-1000.0] * len(tokens))
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_add_space_prefix(False)
    w.add_add_bos_token(add_bos)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return tokens


def gemma_tokenizer_reference(tokens: list[str], merges: list[str], added: list[str]) -> HFTokenizer:
    """transformers' GemmaTokenizer (models/gemma/tokenization_gemma.py), the class Gemma 4's tokenizer_config names,
    over the same vocabulary and merges: BPE with byte fallback and `<unk>`, spaces replaced by U+2581, its
    split on spaces (a no-op after that), U+2581/byte-fallback decoder; the control tokens special added tokens and
    the newline runs and `<|channel>` plain added tokens, as tokenizer.json lists them."""
    vocab = {t: i for i, t in enumerate(tokens)}
    bpe = models.BPE(vocab, [tuple(m.split(" ")) for m in merges], fuse_unk=True, unk_token="<unk>", byte_fallback=True)
    ref = HFTokenizer(bpe)
    ref.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous", invert=False)
    ref.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    ref.normalizer = normalizers.Replace(" ", "\u2581")
    ref.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in GEMMA4_CONTROL])
    ref.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
    return ref


def train_gemma_like_bpe(text: str) -> tuple[list[str], list[str]]:
    """A BPE vocabulary (pieces in id order, merges in rank order) learned from `text` with spaces as U+2581 and no
    merge across a newline; the rarest characters left out of its alphabet (they take the byte fallback)."""
    learner = HFTokenizer(models.BPE())
    learner.normalizer = normalizers.Replace(" ", "\u2581")
    learner.pre_tokenizer = pre_tokenizers.Split(Regex(r"[^\n]+|[\n]+"), behavior="isolated")
    lines = text.splitlines(keepends=True)
    learner.train_from_iterator(lines, trainers.BpeTrainer(vocab_size=800, limit_alphabet=70, show_progress=False))
    model = json.loads(learner.to_str())["model"]
    pieces = [t for t in sorted(model["vocab"], key=model["vocab"].get) if t.strip("\n")]
    return pieces, [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]


def test_gemma4_vocabulary_is_bpe_over_characters_with_spaces_as_u2581(tmp_path):
    """llama.cpp's Gemma 4 tokenizer: BOS forced, spaces as U+2581 without a prefix, merges in the file's rank order
    over whole characters (`▁w` + `o` ranks before `o` + `r`), a run of newlines that is a token whole (no merges
    make it) and a longer one cut longest first, a character without a token as its UTF-8 byte tokens, special and
    user-defined tokens matched whole; decoding undoes it all."""
    path = tmp_path / "g4.gguf"
    pieces = ["▁", "h", "e", "l", "o", "w", "r", "d", "he", "ll", "hell", "hello", "▁w", "▁wo", "or"]
    merges = ["h e", "l l", "he ll", "hell o", "▁ w", "▁w o", "o r"]
    tokens = write_gemma4_vocab(path, pieces, merges, add_bos=False)
    tokenizer = tokenizer_from_gguf(GGUFFile(path).fields.get, [1], path)
    text = "hello world\n\n\nhé<|turn>\n\n\n\n\n<|channel>"
    ids = tokenizer.encode(text)
    expected = ["<bos>", "hello", "▁wo", "r", "l", "d", "\n\n\n", "h", "<0xC3>", "<0xA9>", "<|turn>"]
    assert [tokens[i] for i in ids] == expected + ["\n\n\n", "\n\n", "<|channel>"]
    assert tokenizer.decode(ids, skip_special_tokens=False) == "<bos>" + text
    assert tokenizer.decode(ids) == text.replace("<|turn>", "")  # user-defined tokens are text


def test_gemma4_vocabulary_matches_transformers_gemma_tokenizer(tmp_path):
    """A BPE vocabulary learned over characters with spaces as U+2581 (as Gemma's), newline runs as tokens without
    merges: keel's ids and decoding equal transformers' GemmaTokenizer pipeline on the same vocabulary, over text
    with runs of spaces and newlines, tabs, CRLF, digits, foreign and unknown characters, special tokens; the
    tokenizer.json keel writes for it reads back the same."""
    text = mixed_text(6000, seed=3)
    pieces, merges = train_gemma_like_bpe(text)
    path = tmp_path / "g4.gguf"
    tokens = write_gemma4_vocab(path, pieces, merges)
    tokenizer = tokenizer_from_gguf(GGUFFile(path).fields.get, [1], path)
    reference = gemma_tokenizer_reference(tokens, merges, GEMMA4_NEWLINES + ["<|channel>"])
    rng = random.Random(5)
    inserts = ["\n" * k for k in range(1, 8)] + ["<|turn>", "<turn|>", "<|channel>", "<eos>", "\t\t", "\U0001f600", "é"]
    for start in range(0, len(text), 97):
        chunk = text[start : start + rng.randint(1, 300)]
        cut = rng.randint(0, len(chunk))
        chunk = chunk[:cut] + rng.choice(inserts) + chunk[cut:]
        ids = tokenizer.encode(chunk)
        assert ids == [2, *reference.encode(chunk, add_special_tokens=False).ids], chunk
        assert tokenizer.decode(ids, skip_special_tokens=False) == reference.decode(ids, skip_special_tokens=False)
        assert tokenizer.decode(ids) == reference.decode(ids)
    # `keel convert` writes it as tokenizer.json, which reads back the same (newline runs included).
    (tmp_path / "hf").mkdir()
    tokenizer.save_hf(tmp_path / "hf")
    saved = Tokenizer.from_hf_dir(tmp_path / "hf")
    sample = text[:2000] + "\n\n\n\n\n<|channel>\U0001f600"
    assert saved.encode(sample) == tokenizer.encode(sample)
