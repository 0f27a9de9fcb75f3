"""keel.train.data: token files (prepare, sidecar, memory map) and the layout-independent batch loader."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import keel.weights
from keel.cli import build_parser
from keel.errors import KeelError
from keel.tokenizer import Tokenizer
from keel.train.data import (
    BatchLoader,
    PreparedInfo,
    TokenFile,
    file_sha256,
    iter_eval_batches,
    open_datasets,
    prepare,
    sidecar_path,
    split_documents,
    write_token_file,
)

SMOLLM2 = "smollm2-135m-instruct"
CORPUS = (
    "THE TEMPEST\n\n"
    "Full fathom five thy father lies;\n  Of his bones are coral made;\n\n\n"
    "Caf\u00e9 cr\u00e8me \u2014 na\u00efve \U0001f600 emoji.\n"
    "   \n"
    "A line that mentions <|im_end|> and <|endoftext|> as plain text.\r\n\r\n"
    "    indented last paragraph\twith a tab.\n"
)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    tok = keel.weights.open_checkpoint(SMOLLM2).tokenizer
    assert tok is not None
    return tok


@pytest.fixture
def cached_tokenizer(tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> Tokenizer:
    """prepare() opens the tokenizer by reference; hand it the module's (opening the GGUF takes seconds)."""
    refs = {SMOLLM2, "stub"}
    monkeypatch.setattr(
        keel.weights, "open_checkpoint", lambda ref: SimpleNamespace(tokenizer=tokenizer if ref in refs else None)
    )
    return tokenizer


def documents_of(tokens: list[int], eos_id: int, tokenizer: Tokenizer) -> list[str]:
    docs, current = [], []
    for t in tokens:
        if t == eos_id:
            docs.append(tokenizer.decode(current, skip_special_tokens=False))
            current = []
        else:
            current.append(t)
    assert current == []  # the last document is terminated too
    return docs


# --------------------------------------------------------------------------- prepare


def test_split_documents() -> None:
    assert split_documents("a\n\nb\n \t\nc\n\n\n\nd e\nf\n", "paragraph") == ["a", "b", "c", "d e\nf"]
    assert split_documents("  a\n\nb\n", "file") == ["a\n\nb"]
    assert split_documents("\n\n  \n", "paragraph") == []


def test_prepare_round_trip(tmp_path: Path, cached_tokenizer: Tokenizer) -> None:
    tokenizer = cached_tokenizer
    source = tmp_path / "corpus.txt"
    source.write_bytes(CORPUS.encode("utf-8"))
    out = tmp_path / "data" / "corpus.bin"
    info = prepare([source], SMOLLM2, out, progress=False)

    expected = split_documents(CORPUS, "paragraph")
    assert len(expected) == 5 and info.num_documents == 5
    assert (info.dtype, info.vocab_size, info.eos_id, info.tokenizer) == ("uint16", 49152, 2, SMOLLM2)
    assert out.stat().st_size == 2 * info.num_tokens
    assert info.sha256 == file_sha256(out)
    assert json.loads(sidecar_path(out).read_text()) == json.loads(json.dumps(info.__dict__))
    assert PreparedInfo.read(out) == info

    tokens = TokenFile(out, verify=True)[:].tolist()
    assert len(tokens) == info.num_tokens and tokens.count(info.eos_id) == 5 and tokens[-1] == info.eos_id
    # Special-token text inside a document is plain text: the EOS id only ever separates documents.
    assert documents_of(tokens, info.eos_id, tokenizer) == expected
    assert not list(tmp_path.glob("data/.*"))  # no temp files left behind
    assert tokenizer.tokenizer.encode_special_tokens is False  # restored


def test_prepare_jsonl_and_file_split(tmp_path: Path, cached_tokenizer: Tokenizer) -> None:
    records = [{"body": "first doc\n\nstill first"}, {"body": "second", "id": 2}, {"body": "  "}]
    source = tmp_path / "docs.jsonl"
    source.write_text("\n".join(json.dumps(r) for r in records) + "\n\n")
    text = tmp_path / "whole.txt"
    text.write_text("para one\n\npara two\n")
    out = tmp_path / "mixed.bin"
    info = prepare([source, text], "stub", out, jsonl_field="body", split="file", progress=False)
    assert info.num_documents == 3 and info.sources == [str(source), str(text)]
    docs = documents_of(TokenFile(out)[:].tolist(), info.eos_id, cached_tokenizer)
    assert docs == ["first doc\n\nstill first", "second", "para one\n\npara two"]

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"body": "ok"}\n{"text": "no body"}\n')
    with pytest.raises(KeelError, match=r"bad.jsonl:2: no string field 'body'"):
        prepare([bad], "stub", tmp_path / "bad.bin", jsonl_field="body", progress=False)
    with pytest.raises(KeelError, match="no such file"):
        prepare([tmp_path / "missing.txt"], "stub", tmp_path / "x.bin", progress=False)
    with pytest.raises(KeelError, match="bare-weights: the model has no tokenizer"):
        prepare([text], "bare-weights", tmp_path / "x.bin", progress=False)
    assert not (tmp_path / "bad.bin").exists() and not list(tmp_path.glob(".*.tmp"))


def test_cli_prepare(
    tmp_path: Path, cached_tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    corpus = tmp_path / "shakespeare.txt"
    corpus.write_text("To be, or not to be.\n\nThat is the question.\n")
    monkeypatch.setattr("keel.data.corpora.shakespeare_path", lambda: corpus)
    monkeypatch.chdir(tmp_path)
    args = build_parser().parse_args(["data", "prepare", "shakespeare", "--tokenizer", SMOLLM2, "--out", "data/s.bin"])
    assert args.func(args) == 0
    assert "data/s.bin:" in capsys.readouterr().out
    info = TokenFile(tmp_path / "data" / "s.bin", verify=True).info
    assert info.num_documents == 2 and info.sources == [str(corpus)]


# --------------------------------------------------------------------------- token files


def test_token_file_checks(tmp_path: Path) -> None:
    path = tmp_path / "t.bin"
    info = write_token_file(path, np.arange(1000) % 300, vocab_size=300, eos_id=0)
    assert info.dtype == "uint16" and info.num_documents == 4
    tf = TokenFile(path, verify=True)
    assert len(tf) == 1000 and tf[3:6].dtype == torch.int64 and tf[3:6].tolist() == [3, 4, 5]
    view = tf.window(100, 200)
    assert len(view) == 100 and view[0:2].tolist() == [100, 101] and view.window(10, 20)[:1].tolist() == [110]

    big = write_token_file(tmp_path / "big.bin", [70000, 1], vocab_size=100_000, eos_id=1)
    assert big.dtype == "uint32" and TokenFile(tmp_path / "big.bin")[:].tolist() == [70000, 1]

    raw = bytearray(path.read_bytes())
    raw[10] ^= 0xFF
    path.write_bytes(bytes(raw))  # same size, different content
    TokenFile(path)  # only verify=True reads the whole file
    with pytest.raises(KeelError, match="sha256 does not match"):
        TokenFile(path, verify=True)
    path.write_bytes(bytes(raw[:-2]))
    with pytest.raises(KeelError, match="truncated or rewritten"):
        TokenFile(path)
    sidecar_path(path).unlink()
    with pytest.raises(KeelError, match="no sidecar t.bin.json; write the file with `keel data prepare`"):
        TokenFile(path)
    sidecar_path(path).write_text("{}")
    with pytest.raises(KeelError, match="not a keel token-file sidecar"):
        TokenFile(path)


def test_open_datasets(tmp_path: Path) -> None:
    write_token_file(tmp_path / "train.bin", np.arange(1000), vocab_size=1000, eos_id=0)
    write_token_file(tmp_path / "val.bin", np.arange(500), vocab_size=1000, eos_id=0)
    train, val = open_datasets(tmp_path / "train.bin", val_tokens=100)
    assert val is not None and len(train) == 900 and len(val) == 100 and val[0:1].tolist() == [900]
    train, val = open_datasets(tmp_path / "train.bin", tmp_path / "val.bin", val_tokens=50)
    assert val is not None and len(train) == 1000 and len(val) == 50
    assert open_datasets(tmp_path / "train.bin")[1] is None
    with pytest.raises(KeelError, match="holds out all"):
        open_datasets(tmp_path / "train.bin", val_tokens=1000)


def test_eval_batches_are_even_over_ranks(tmp_path: Path) -> None:
    write_token_file(tmp_path / "v.bin", np.arange(4 * 11 + 1), vocab_size=100, eos_id=0)  # 11 samples of 4
    tf = TokenFile(tmp_path / "v.bin")
    shares = [list(iter_eval_batches(tf, 4, 2, rank, 3)) for rank in range(3)]
    assert [len(s) for s in shares] == [2, 2, 2]  # 3 samples each, in batches of 2 and 1
    firsts = [int(x[0, 0]) // 4 for share in shares for x, _ in share]
    assert firsts == [0, 2, 3, 5, 6, 8]
    x, y = shares[0][0]
    assert torch.equal(y[:, :-1], x[:, 1:])


# --------------------------------------------------------------------------- loader

S = 4  # seq_len; the token file is 0, 1, 2, ... so sample i starts with token i * S


@pytest.fixture
def tokens(tmp_path: Path) -> TokenFile:
    write_token_file(tmp_path / "n.bin", np.arange(40 * S + 1), vocab_size=2**16, eos_id=0)  # 40 samples
    return TokenFile(tmp_path / "n.bin")


def loader(
    tf: TokenFile, dp_size: int = 1, rank: int = 0, global_batch: int = 8, micro: int | None = None, seed: int = 1
) -> BatchLoader:
    micro = micro or max(1, global_batch // dp_size // 2)
    return BatchLoader(tf, S, micro, rank, dp_size, seed, grad_accum=global_batch // (dp_size * micro))


def take_step(ld: BatchLoader) -> list[int]:
    """The sample ids of one optimizer step on this rank, in order."""
    ids = []
    for _ in range(ld.grad_accum):
        x, y = ld.next_microbatch()
        assert x.shape == y.shape == (ld.micro_batch_size, S) and x.dtype == y.dtype == torch.int64
        assert torch.equal(y, x + 1)  # labels are the inputs shifted by one token
        assert bool((x[:, 0] % S == 0).all())  # windows start at multiples of seq_len
        ids.extend((x[:, 0] // S).tolist())
    return ids


def global_steps(tf: TokenFile, dp_size: int, steps: int, **kw) -> list[list[int]]:
    """Per step, the samples of all ranks concatenated in rank order."""
    ranks = [loader(tf, dp_size, r, **kw) for r in range(dp_size)]
    return [[i for ld in ranks for i in take_step(ld)] for _ in range(steps)]


def test_order_is_deterministic_and_seeded(tokens: TokenFile) -> None:
    a, b = global_steps(tokens, 1, 4), global_steps(tokens, 1, 4)
    assert a == b
    assert sorted(i for step in a for i in step) != list(range(32))  # shuffled, not in file order
    assert global_steps(tokens, 1, 4, seed=2) != a


def test_global_order_does_not_depend_on_dp_size(tokens: TokenFile) -> None:
    reference = global_steps(tokens, 1, 12)  # 96 samples: crosses two epoch boundaries
    assert global_steps(tokens, 2, 12) == reference
    assert global_steps(tokens, 4, 12) == reference
    assert global_steps(tokens, 8, 12, micro=1) == reference
    assert global_steps(tokens, 2, 12, micro=1) == reference  # same global batch, other accumulation


def test_epochs_roll_over_with_a_new_permutation(tokens: TokenFile) -> None:
    ld = loader(tokens)
    stream = [i for _ in range(10) for i in take_step(ld)]  # 80 samples = 2 epochs of 40
    assert sorted(stream[:40]) == list(range(40)) and sorted(stream[40:]) == list(range(40))
    assert stream[:40] != stream[40:]
    assert ld.state_dict()["epoch"] == 2 and ld.samples_consumed == 80
    ld = loader(tokens)
    for _ in range(6):
        take_step(ld)
    assert ld.epoch == 1  # 48 samples


def test_resume_on_the_same_layout(tokens: TokenFile) -> None:
    ranks = [loader(tokens, 2, r) for r in range(2)]
    for _ in range(3):
        for ld in ranks:
            take_step(ld)
    states = [ld.state_dict() for ld in ranks]
    assert states[0] == states[1] and states[0]["samples_consumed"] == 24 and states[0]["seed"] == 1
    resumed = loader(tokens, 2, 1, seed=99)  # the checkpoint's seed wins
    resumed.load_state_dict(json.loads(json.dumps(states[1])))  # survives a JSON round trip
    for _ in range(5):
        x, y = ranks[1].next_microbatch()
        rx, ry = resumed.next_microbatch()
        assert torch.equal(x, rx) and torch.equal(y, ry)


def test_resume_on_another_dp_layout(tokens: TokenFile) -> None:
    reference = global_steps(tokens, 1, 8)
    ranks = [loader(tokens, 2, r) for r in range(2)]
    for _ in range(3):
        for ld in ranks:
            take_step(ld)
    state = ranks[0].state_dict()
    single = loader(tokens, 1)
    single.load_state_dict(state)
    assert [take_step(single) for _ in range(5)] == reference[3:]
    four = [loader(tokens, 4, r) for r in range(4)]
    for ld in four:
        ld.load_state_dict(state)
    assert [i for ld in four for i in take_step(ld)] == reference[3]


def test_state_mid_step_points_at_the_step_start(tokens: TokenFile) -> None:
    ld = loader(tokens, micro=2)  # 4 micro-batches per step
    take_step(ld)
    ld.next_microbatch()
    assert ld.state_dict()["samples_consumed"] == 8  # the interrupted step is redone on resume
    again = loader(tokens, micro=2)
    again.load_state_dict(ld.state_dict())
    assert take_step(again) == global_steps(tokens, 1, 2)[1]


def test_skip(tokens: TokenFile) -> None:
    reference = global_steps(tokens, 1, 9)
    ld = loader(tokens)
    take_step(ld)
    ld.skip(2)
    assert take_step(ld) == reference[3]
    ld.skip(4)  # across the epoch boundary
    assert take_step(ld) == reference[8] and ld.samples_consumed == 72
    ld.next_microbatch()
    with pytest.raises(RuntimeError, match="middle of an optimizer step"):
        ld.skip(1)


def test_load_state_dict_rejects_other_data(tokens: TokenFile, tmp_path: Path) -> None:
    state = loader(tokens).state_dict()
    write_token_file(tmp_path / "other.bin", np.arange(30 * S + 1), vocab_size=2**16, eos_id=0)
    with pytest.raises(KeelError, match="num_samples = 40, this run has 30"):
        loader(TokenFile(tmp_path / "other.bin")).load_state_dict(state)
    with pytest.raises(KeelError, match="not a whole number of steps"):
        loader(tokens, global_batch=16).load_state_dict({**state, "samples_consumed": 8})
    with pytest.raises(KeelError, match="too few for one sample"):
        BatchLoader(TokenFile(tmp_path / "other.bin"), 200, 1, 0, 1, 0)
