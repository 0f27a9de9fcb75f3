"""Token files for training: `prepare` writes them, `TokenFile` maps them, `BatchLoader` feeds them.

Format: a flat array of token ids (uint16 when every id fits, else uint32), every document followed by
the tokenizer's EOS id (packing with document separators), plus a JSON sidecar `<file>.json` with the
dtype, counts, tokenizer and the file's sha256. Both are written atomically; the sidecar is removed
before the token file is replaced and written after it, so a crash never leaves a sidecar that
describes a different token file.

Samples: sample i is the window tokens[i*S : i*S + S + 1] (S = seq_len): inputs are its first S tokens,
labels its last S. Input windows do not overlap; each label window reaches one token into the next
sample, so every token but the first is predicted once per epoch (Megatron's GPT dataset does the same).

Order: one global stream, the concatenation of per-epoch permutations seeded by (seed, epoch). An
optimizer step takes the next `dp_size * micro_batch_size * grad_accum` samples of the stream and rank
r takes the r-th contiguous slice. The stream does not depend on dp_size, so a run resumed on another
data-parallel layout (same global batch) trains on exactly the same samples in the same steps.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Literal

import numpy as np

if TYPE_CHECKING:
    from torch import Tensor

from keel.atomic import atomic_file, write_json_atomic
from keel.errors import KeelError
from keel.jsonl import iter_jsonl

SIDECAR_FORMAT = "keel-tokens"
SIDECAR_VERSION = 1
_BATCH_DOCS = 1024  # documents per encode_batch call
_HASH_CHUNK = 1 << 24

Format = Literal["text", "jsonl"]
Split = Literal["file", "paragraph"]


def sidecar_path(path: str | Path) -> Path:
    """`data/x.bin` -> `data/x.bin.json`."""
    path = Path(path)
    return path.with_name(path.name + ".json")


@dataclass
class PreparedInfo:
    """The sidecar of a token file."""

    dtype: str  # "uint16" | "uint32"
    num_tokens: int
    num_documents: int
    vocab_size: int
    eos_id: int
    tokenizer: str  # the reference it was opened from
    tokenizer_sha256: str  # of the tokenizer's JSON: the same ids mean the same text
    sources: list[str]
    sha256: str  # of the token file
    format: str = SIDECAR_FORMAT
    version: int = SIDECAR_VERSION

    @classmethod
    def read(cls, path: str | Path) -> PreparedInfo:
        side = sidecar_path(path)
        try:
            data = json.loads(side.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise KeelError(f"{path}: no sidecar {side.name}; write the file with `keel data prepare`") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise KeelError(f"{side}: not a valid token-file sidecar ({e})") from None
        if not isinstance(data, dict) or data.get("format") != SIDECAR_FORMAT:
            raise KeelError(f"{side}: not a keel token-file sidecar")
        if data.get("version") != SIDECAR_VERSION:
            raise KeelError(f"{side}: sidecar version {data.get('version')} is not supported (expected 1)")
        try:
            info = cls(**data)
        except TypeError as e:
            raise KeelError(f"{side}: malformed sidecar ({e})") from None
        if info.dtype not in ("uint16", "uint32"):
            raise KeelError(f"{side}: dtype {info.dtype!r} is not uint16 or uint32")
        return info


# --------------------------------------------------------------------------- prepare


def split_documents(text: str, split: Split) -> list[str]:
    """The documents of one text file: the whole file, or its blank-line separated paragraphs.
    Surrounding whitespace is dropped; empty documents are left out."""
    blocks = [text] if split == "file" else re.split(r"\n[ \t\r\f\v]*\n", text)
    docs = [block.strip() for block in blocks]
    return [doc for doc in docs if doc]


def _documents(path: Path, fmt: Format, split: Split, jsonl_field: str) -> Iterator[str]:
    """The documents of one input: text per `split`; jsonl one document per record."""
    try:
        if fmt == "text":
            yield from split_documents(path.read_text(encoding="utf-8"), split)
            return
        with path.open(encoding="utf-8") as f:
            for number, record in iter_jsonl(f, str(path)):
                value = record.get(jsonl_field) if isinstance(record, dict) else None
                if not isinstance(value, str):
                    raise KeelError(f"{path}:{number}: no string field {jsonl_field!r}")
                if value.strip():
                    yield value
    except FileNotFoundError:
        raise KeelError(f"{path}: no such file") from None
    except UnicodeDecodeError as e:
        raise KeelError(f"{path}: not UTF-8 text ({e})") from None
    except IsADirectoryError:
        raise KeelError(f"{path}: is a directory, expected a text or jsonl file") from None


def _format_of(path: Path, fmt: Format | None) -> Format:
    if fmt is not None:
        return fmt
    return "jsonl" if path.suffix.lower() in (".jsonl", ".ndjson") else "text"


def _batches(docs: Iterable[str], size: int) -> Iterator[list[str]]:
    batch: list[str] = []
    for doc in docs:
        batch.append(doc)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def prepare(
    inputs: list[Path],
    tokenizer_ref: str,
    out: Path,
    fmt: Format | None = None,
    jsonl_field: str = "text",
    split: Split = "paragraph",
    progress: bool = True,
) -> PreparedInfo:
    """Tokenize `inputs` into the token file `out` (+ sidecar). `fmt` None: jsonl for .jsonl/.ndjson
    files, else text; `split` applies to text files (a jsonl record is always one document)."""
    inputs = [Path(p) for p in inputs]
    out = Path(out)
    _check_prepare_paths(inputs, out)
    tokenizer = _prepare_tokenizer(tokenizer_ref)
    eos_id = tokenizer.eos_token_ids[0]
    vocab_size = tokenizer.vocab_size
    dtype = np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)
    hf = tokenizer.tokenizer
    tokenizer_sha = hashlib.sha256(hf.to_str().encode("utf-8")).hexdigest()

    def write(f: BinaryIO) -> PreparedInfo:
        documents = _documents_of(inputs, fmt, split, jsonl_field)
        sha256, num_tokens, num_documents = _write_tokens(f, documents, inputs, hf, eos_id, dtype, out.name, progress)
        if num_tokens == 0:
            raise KeelError(f"data prepare: no documents in {', '.join(map(str, inputs))}")
        return PreparedInfo(
            dtype=dtype.name,
            num_tokens=num_tokens,
            num_documents=num_documents,
            vocab_size=vocab_size,
            eos_id=eos_id,
            tokenizer=str(tokenizer_ref),
            tokenizer_sha256=tokenizer_sha,
            sources=[str(p) for p in inputs],
            sha256=sha256,
        )

    out.parent.mkdir(parents=True, exist_ok=True)
    # Special-token text inside a document ("<|im_end|>") is tokenized as plain text, so the EOS id only
    # ever appears as a separator.
    special_before = hf.encode_special_tokens
    hf.encode_special_tokens = True
    try:
        return _write_with_sidecar(out, write)
    finally:
        hf.encode_special_tokens = special_before


def _check_prepare_paths(inputs: list[Path], out: Path) -> None:
    if not inputs:
        raise KeelError("data prepare: no input files")
    for path in inputs:
        if not path.is_file():
            raise KeelError(f"{path}: no such file")
    if out.is_dir():
        raise KeelError(f"{out}: is a directory; --out names the token file to write")
    written = {out.resolve(), sidecar_path(out).resolve()}
    for path in inputs:
        if path.resolve() in written:  # the input would be replaced by its own tokens
            raise KeelError(f"{path}: an input is also the output (--out {out}); write the token file elsewhere")


def _prepare_tokenizer(tokenizer_ref: str) -> Any:
    """The model's tokenizer, which must have an EOS token to separate documents."""
    from keel.weights import open_checkpoint

    tokenizer = open_checkpoint(tokenizer_ref).tokenizer
    if tokenizer is None:
        raise KeelError(f"{tokenizer_ref}: the model has no tokenizer")
    if not tokenizer.eos_token_ids:
        raise KeelError(f"{tokenizer_ref}: the tokenizer has no EOS token to separate documents")
    return tokenizer


def _documents_of(
    inputs: list[Path], fmt: Format | None, split: Split, jsonl_field: str
) -> Iterator[tuple[Path, Iterator[list[str]]]]:
    """Each input with its documents, in batches of _BATCH_DOCS."""
    for path in inputs:
        yield path, _batches(_documents(path, _format_of(path, fmt), split, jsonl_field), _BATCH_DOCS)


def _write_tokens(
    f: BinaryIO,
    documents: Iterator[tuple[Path, Iterator[list[str]]]],
    inputs: list[Path],
    hf: Any,
    eos_id: int,
    dtype: np.dtype,
    label: str,
    progress: bool,
) -> tuple[str, int, int]:
    """Encode every document, each followed by EOS, into `f`: (sha256, tokens, documents) written."""
    from tqdm import tqdm

    digest = hashlib.sha256()
    num_tokens = num_documents = 0
    total_bytes = sum(p.stat().st_size for p in inputs)
    with tqdm(total=total_bytes, unit="B", unit_scale=True, desc=f"tokenizing -> {label}", disable=not progress) as bar:
        done_bytes = 0
        for path, batches in documents:
            for batch in batches:
                encodings = hf.encode_batch_fast(batch, add_special_tokens=False)
                ids: list[int] = []
                for enc in encodings:
                    ids.extend(enc.ids)
                    ids.append(eos_id)
                chunk = np.asarray(ids, dtype=dtype).tobytes()
                f.write(chunk)
                digest.update(chunk)
                num_tokens += len(ids)
                num_documents += len(batch)
                bar.update(min(sum(len(d.encode("utf-8")) for d in batch), total_bytes - bar.n))
            done_bytes += path.stat().st_size
            bar.update(max(0, done_bytes - bar.n))  # blank lines between documents were not counted
            bar.set_postfix(tokens=f"{num_tokens:,}")
    return digest.hexdigest(), num_tokens, num_documents


def _write_with_sidecar(out: Path, write: Callable[[BinaryIO], PreparedInfo]) -> PreparedInfo:
    """`write(f)` the tokens through a temp file that then replaces `out`, then write the sidecar it returns."""
    side = sidecar_path(out)
    with atomic_file(out) as f:
        info = write(f)
        side.unlink(missing_ok=True)  # never a sidecar next to a token file it does not describe
    write_json_atomic(side, asdict(info))
    return info


def write_token_file(
    out: str | Path,
    tokens: np.ndarray | list[int],
    vocab_size: int,
    eos_id: int,
    tokenizer: str = "",
    sources: Iterable[str | Path] = (),
) -> PreparedInfo:
    """Write already tokenized ids as a token file + sidecar (tests, or ids made elsewhere)."""
    out = Path(out)
    array = np.asarray(tokens)
    if array.ndim != 1 or array.size == 0 or array.min() < 0 or array.max() >= vocab_size:
        raise ValueError(f"tokens must be a non-empty 1-d array of ids in [0, {vocab_size})")
    data = array.astype(np.uint16 if vocab_size <= 2**16 else np.uint32)
    out.parent.mkdir(parents=True, exist_ok=True)

    def write(f: BinaryIO) -> PreparedInfo:
        f.write(data.tobytes())
        return PreparedInfo(
            dtype=data.dtype.name,
            num_tokens=int(data.size),
            num_documents=int((data == eos_id).sum()),
            vocab_size=vocab_size,
            eos_id=eos_id,
            tokenizer=tokenizer,
            tokenizer_sha256="",
            sources=[str(s) for s in sources],
            sha256=hashlib.sha256(data.tobytes()).hexdigest(),
        )

    return _write_with_sidecar(out, write)


def file_sha256(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


# --------------------------------------------------------------------------- reading


class TokenFile:
    """A read-only, memory-mapped token file; `tf[a:b]` is an int64 tensor. `verify=True` also checks
    the sha256 (reads the whole file once)."""

    def __init__(self, path: str | Path, verify: bool = False) -> None:
        self.path = Path(path)
        self.info = PreparedInfo.read(self.path)
        dtype = np.dtype(self.info.dtype)
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            raise KeelError(f"{self.path}: no such file") from None
        expected = self.info.num_tokens * dtype.itemsize
        if size != expected:
            raise KeelError(
                f"{self.path}: {size} bytes, but its sidecar says {self.info.num_tokens} {dtype.name} tokens "
                f"({expected} bytes): truncated or rewritten; prepare it again"
            )
        if verify and file_sha256(self.path) != self.info.sha256:
            raise KeelError(f"{self.path}: sha256 does not match its sidecar: the file is corrupt; prepare it again")
        if self.info.num_tokens == 0:
            raise KeelError(f"{self.path}: holds no tokens")
        self._tokens: np.ndarray = np.memmap(self.path, dtype=dtype, mode="r")
        self._start, self._stop = 0, self.info.num_tokens

    @property
    def eos_id(self) -> int:
        return self.info.eos_id

    @property
    def vocab_size(self) -> int:
        return self.info.vocab_size

    def __len__(self) -> int:
        return self._stop - self._start

    def __getitem__(self, index: slice) -> Tensor:
        if not isinstance(index, slice):
            raise TypeError("TokenFile supports slices only: tf[a:b]")
        start, stop, step = index.indices(len(self))
        if step != 1:
            raise ValueError("TokenFile slices must be contiguous")
        window = self._tokens[self._start + start : self._start + max(start, stop)]
        import torch  # here, not at import: `keel train` checks token files before it execs torchrun

        return torch.from_numpy(window.astype(np.int64))

    def numpy(self) -> np.ndarray:
        """The tokens of this view as the file's dtype (a memory map, no copy)."""
        return self._tokens[self._start : self._stop]

    def window(self, start: int, stop: int) -> TokenFile:
        """A view of tokens [start, stop) of this view, sharing the memory map."""
        start, stop, _ = slice(start, stop).indices(len(self))
        view = object.__new__(TokenFile)
        view.path, view.info, view._tokens = self.path, self.info, self._tokens
        view._start, view._stop = self._start + start, self._start + max(start, stop)
        return view


def open_datasets(
    path: str | Path, val_path: str | Path | None = None, val_tokens: int | None = None, verify: bool = False
) -> tuple[TokenFile, TokenFile | None]:
    """Training and validation token files per the `[data]` section: val_path (its first val_tokens, or
    all), else the last val_tokens of `path` held out of training, else no validation."""
    train = TokenFile(path, verify=verify)
    if val_path is not None:
        val = TokenFile(val_path, verify=verify)
        if val.info.tokenizer_sha256 != train.info.tokenizer_sha256:
            raise KeelError(f"{val_path}: tokenized with {val.info.tokenizer}, but {path} with {train.info.tokenizer}")
        return train, val if val_tokens is None else val.window(0, val_tokens)
    if val_tokens is None:
        return train, None
    if val_tokens >= len(train):
        raise KeelError(f"data.val_tokens = {val_tokens} holds out all of {path} ({len(train)} tokens)")
    cut = len(train) - val_tokens
    return train.window(0, cut), train.window(cut, len(train))


# --------------------------------------------------------------------------- batches


def num_samples(num_tokens: int, seq_len: int) -> int:
    """Samples of seq_len + 1 tokens at stride seq_len."""
    return max(0, (num_tokens - 1) // seq_len)


class BatchLoader:
    """Micro-batches of one data-parallel rank, in a global order independent of dp_size (module doc)."""

    def __init__(
        self,
        token_file: TokenFile,
        seq_len: int,
        micro_batch_size: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
        grad_accum: int = 1,
    ) -> None:
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} is not in [0, {dp_size})")
        if min(seq_len, micro_batch_size, grad_accum) < 1:
            raise ValueError("seq_len, micro_batch_size and grad_accum must be >= 1")
        self.tokens = token_file
        self.seq_len = seq_len
        self.micro_batch_size = micro_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.grad_accum = grad_accum
        self.seed = seed
        self.num_samples = num_samples(len(token_file), seq_len)
        if self.num_samples == 0:
            raise KeelError(
                f"{token_file.path}: {len(token_file)} tokens, too few for one sample of seq_len + 1 = {seq_len + 1}"
            )
        self._step_start = 0  # global samples before the current optimizer step
        self._micro = 0  # micro-batches of the current step already returned
        self._perm_epoch = -1
        self._perm = np.empty(0, dtype=np.int64)

    @property
    def samples_per_step(self) -> int:
        return self.dp_size * self.micro_batch_size * self.grad_accum

    @property
    def samples_consumed(self) -> int:
        """Global samples of all completed optimizer steps."""
        return self._step_start

    @property
    def epoch(self) -> int:
        return self._step_start // self.num_samples

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:
            rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, epoch])))
            self._perm, self._perm_epoch = rng.permutation(self.num_samples), epoch
        return self._perm

    def _sample_ids(self, first: int, count: int) -> list[int]:
        """Sample indices of global stream positions [first, first + count)."""
        ids = []
        for position in range(first, first + count):
            epoch, offset = divmod(position, self.num_samples)
            ids.append(int(self._permutation(epoch)[offset]))
        return ids

    def next_microbatch(self) -> tuple[Tensor, Tensor]:
        """(inputs, labels), both int64 [micro_batch_size, seq_len]."""
        per_rank = self.micro_batch_size * self.grad_accum
        first = self._step_start + self.dp_rank * per_rank + self._micro * self.micro_batch_size
        ids = self._sample_ids(first, self.micro_batch_size)
        data = self.tokens.numpy()
        s = self.seq_len
        windows = np.stack([data[i * s : i * s + s + 1] for i in ids]).astype(np.int64)
        import torch

        batch = torch.from_numpy(windows)
        self._micro += 1
        if self._micro == self.grad_accum:  # the step is complete: state_dict now points past it
            self._step_start += self.samples_per_step
            self._micro = 0
        return batch[:, :-1].contiguous(), batch[:, 1:].contiguous()

    def skip(self, num_steps: int) -> None:
        """Drop the next num_steps optimizer steps' samples (e.g. the batches after a rollback)."""
        if num_steps < 0:
            raise ValueError(f"cannot skip {num_steps} steps")
        if self._micro:
            raise RuntimeError("skip() in the middle of an optimizer step")
        self._step_start += num_steps * self.samples_per_step

    def state_dict(self) -> dict[str, Any]:
        """The position at the start of the next optimizer step not yet complete: resuming from it
        redoes a step that was interrupted between micro-batches. Independent of the dp layout."""
        return {
            "samples_consumed": self._step_start,
            "epoch": self.epoch,
            "seed": self.seed,
            "num_samples": self.num_samples,
            "seq_len": self.seq_len,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue at `state`'s position with its seed; the data must yield the same samples."""
        for key in ("num_samples", "seq_len"):
            if key in state and state[key] != getattr(self, key):
                raise KeelError(
                    f"{self.tokens.path}: the checkpoint's data had {key} = {state[key]}, this run has "
                    f"{getattr(self, key)}; the sample order would not continue"
                )
        consumed = int(state["samples_consumed"])
        if consumed % self.samples_per_step:
            raise KeelError(
                f"the checkpoint consumed {consumed} samples, not a whole number of steps of {self.samples_per_step} "
                "(was the global batch size changed?)"
            )
        self.seed = int(state["seed"])
        self._step_start, self._micro = consumed, 0
        self._perm_epoch = -1


def iter_eval_batches(
    token_file: TokenFile, seq_len: int, batch_size: int, dp_rank: int, dp_size: int
) -> Iterator[tuple[Tensor, Tensor]]:
    """Validation batches in file order: rank r takes the r-th of dp_size equal contiguous shares (up to
    dp_size - 1 samples are left out), so every rank runs the same number of forwards."""
    total = num_samples(len(token_file), seq_len)
    share = total // dp_size
    if share == 0:
        raise KeelError(f"{token_file.path}: too few validation tokens for {dp_size} ranks at seq_len {seq_len}")
    data = token_file.numpy()
    first = dp_rank * share
    for start in range(first, first + share, batch_size):
        ids = range(start, min(start + batch_size, first + share))
        windows = np.stack([data[i * seq_len : i * seq_len + seq_len + 1] for i in ids]).astype(np.int64)
        import torch

        batch = torch.from_numpy(windows)
        yield batch[:, :-1].contiguous(), batch[:, 1:].contiguous()


# --------------------------------------------------------------------------- CLI
