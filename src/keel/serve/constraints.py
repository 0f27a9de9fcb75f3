"""Per-request token constraints, applied to a batch's logits before penalties and sampling.

- `logit_bias` (OpenAI): a bias added to the logits of the listed tokens;
- `allowed_token_ids` (vLLM): every other token gets -inf;
- `bad_words` (vLLM): a word's last token gets -inf where the output ends with the rest of the word
  (a one-token word: always); the engine turns each word into token sequences (with and without a
  leading space, as vLLM does);
- a grammar (structured outputs): the tokens its bitmask does not allow get -inf.
Every constraint keeps its rows' other logits as they are; rows without one are not touched.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from keel import kernels
from keel.errors import KeelError
from keel.serve.staging import to_device

if TYPE_CHECKING:
    from keel.tokenizer import Tokenizer

# A row's state is keel.serve.sampling.RowState (params, output_ids, token_bitmask); sampling imports this
# module, so the type is named here only in words.
RowState = Any


def has_constraints(states: list[RowState]) -> bool:
    return any(
        s.token_bitmask is not None or s.params.logit_bias or s.params.allowed_token_ids or s.params.bad_words_token_ids
        for s in states
    )


def apply_constraints(x: Tensor, states: list[RowState]) -> Tensor:
    """`x` [N, V] float32 (written in place and returned) with every row's constraints applied."""
    vocab = x.shape[-1]
    device = x.device
    bias_rows: list[int] = []
    bias_cols: list[int] = []
    bias_values: list[float] = []
    banned_rows: list[int] = []
    banned_cols: list[int] = []
    for i, s in enumerate(states):
        p = s.params
        for token, bias in (p.logit_bias or {}).items():
            if token < vocab:
                bias_rows.append(i)
                bias_cols.append(token)
                bias_values.append(float(bias))
        for word in p.bad_words_token_ids:
            prefix = word[:-1]
            if not prefix or s.output_ids[len(s.output_ids) - len(prefix) :] == prefix:
                banned_rows.append(i)
                banned_cols.append(word[-1])
        if p.allowed_token_ids is not None:
            keep = torch.zeros(vocab, dtype=torch.bool, device=device)
            keep[_ids([t for t in p.allowed_token_ids if t < vocab], device)] = True
            x[i].masked_fill_(~keep, float("-inf"))
    if bias_rows:
        index = (_ids(bias_rows, device), _ids(bias_cols, device))
        x.index_put_(index, to_device(bias_values, x.dtype, device), accumulate=True)
    if banned_rows:
        x[_ids(banned_rows, device), _ids(banned_cols, device)] = float("-inf")
    masked = [i for i, s in enumerate(states) if s.token_bitmask is not None]
    if masked:
        apply_token_bitmask(x, torch.stack([states[i].token_bitmask for i in masked]), masked)
    return x


def apply_token_bitmask(x: Tensor, bitmask: Tensor, rows: list[int]) -> None:
    """Set the logits of tokens a grammar does not allow to -inf: x [N, V] float32 in place, bitmask [M, W]
    int32 (xgrammar's layout), row m of it for x's row rows[m]. keel::apply_token_bitmask on CPU where keel's
    kernels run (one read of each 32-bit word), else torch (this unpacking is its reference)."""
    if x.device.type == "cpu" and kernels.active() and x.is_contiguous():
        torch.ops.keel.apply_token_bitmask(x, bitmask, torch.tensor(rows, dtype=torch.int64))
        return
    allowed = unpack_bitmask(bitmask.to(x.device, non_blocking=True), x.shape[-1])
    index = _ids(rows, x.device)
    x[index] = x[index].masked_fill(~allowed, float("-inf"))


def unpack_bitmask(bitmask: Tensor, vocab_size: int) -> Tensor:
    """[N, ceil(V / 32)] int32 -> [N, V] bool: bit j of word w says whether token 32 w + j is allowed."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask[:, :, None] >> shifts) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def _ids(values: list[int], device: torch.device) -> Tensor:
    return to_device(values, torch.int64, device)


def bad_words_token_ids(words: list[str], tokenizer: Tokenizer | None) -> list[list[int]]:
    """Each bad word as the token sequences it can be generated as: alone and after a space (vLLM's rule;
    the spaced form only where it tokenizes differently)."""
    if tokenizer is None:
        raise KeelError("bad_words need the model's tokenizer, and this model has none")
    sequences: list[list[int]] = []
    for word in words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = tokenizer.encode(text, add_special_tokens=False)
            if ids and ids not in sequences:
                sequences.append(ids)
    return sequences
