"""Verification of draft tokens: which drafts the target model accepts, and the token after them.

The target ran one forward over [last token, d_1 .. d_k]: row j of its logits is the target's
distribution p_j for the position of d_{j+1} (row k: the position after the last draft).

- Greedy requests keep the longest prefix of drafts that equals the target's argmax, then the
  target's argmax at the first mismatch (or after the last draft: the bonus token). The output is
  exactly the one plain greedy decoding gives.
- Sampled requests use rejection sampling (Leviathan et al. 2023; Chen et al. 2023): draft d_j
  drawn from q_j is accepted with probability min(1, p_j(d_j) / q_j(d_j)); at the first rejection
  a token is drawn from the normalised residual max(p_j - q_j, 0) and the rest are dropped; when
  every draft is accepted, a bonus token is drawn from p_k. Every emitted token is then distributed
  exactly as plain sampling from p would be. Deterministic drafts (n-gram lookup) have q = one-hot,
  so d_j is accepted with probability p_j(d_j) and a rejection resamples p_j without d_j.

p_j is the request's *processed* distribution (penalties, temperature, top-k/top-p/min-p), the
one plain sampling draws from; penalties and min_tokens see the drafts before position j as if
they were already output, which is what they would be if accepted.
"""

from __future__ import annotations

import torch
from torch import Tensor

from keel.serve.request import Request
from keel.serve.sampling import RowState, Sampler, TokenLogprobs, _logprobs


def draw(probs: Tensor, generator: torch.Generator | None) -> int:
    """One token from a probability row, by the exponential race the sampler uses."""
    q = torch.empty_like(probs).exponential_(generator=generator)
    return int((probs / q.clamp_min_(torch.finfo(torch.float32).tiny)).argmax())


def accept_drafts(p: Tensor, drafts: list[int], q: Tensor | None, generator: torch.Generator | None) -> tuple[int, int]:
    """Rejection sampling over k drafts: p [k + 1, V] target probabilities, q [k, V] draft probabilities
    (None: deterministic drafts). Returns (number of drafts accepted, the token that follows them)."""
    k = len(drafts)
    index = torch.tensor(drafts, dtype=torch.long, device=p.device)
    p_draft = p[:k].gather(1, index[:, None]).squeeze(1)
    q_draft = q[:k].gather(1, index[:, None]).squeeze(1) if q is not None else torch.ones_like(p_draft)
    u = torch.rand(k, generator=generator, device=p.device)
    # Accept while u < p/q (written u * q < p: no division, and q = 0 cannot occur for a drawn token).
    accepted = (u * q_draft < p_draft).tolist()
    a = accepted.index(False) if False in accepted else k
    if a == k:
        return k, draw(p[k], generator)  # every draft accepted: the bonus token
    if q is None:
        residual = p[a].clone()
        residual[drafts[a]] = 0.0
    else:
        residual = (p[a] - q[a]).clamp_min_(0.0)
    total = float(residual.sum())
    # A rejection has probability 1 - sum(min(p, q)) = sum(max(p - q, 0)) > 0, so the residual has
    # mass; float rounding can still leave ~0 when p and q agree: then p itself is the answer.
    return a, draw(residual / total if total > 1e-12 else p[a], generator)


def verify_drafts(
    sampler: Sampler, logits: Tensor, requests: list[tuple[Request, range]]
) -> list[tuple[Request, list[int], list[TokenLogprobs] | None]]:
    """For each request (with its rows of `logits`, one per fed token: k + 1), the tokens it gains:
    the accepted drafts, then one more. With logprobs asked, their raw logprobs (as plain decoding)."""
    states: list[RowState] = []
    flat_rows: list[int] = []
    for request, rows in requests:
        drafts = request.spec_token_ids
        assert len(rows) == len(drafts) + 1, "a verifying request has one logits row per fed token"
        for j, row in enumerate(rows):
            # Row j predicts the token after draft j: penalties see drafts[:j] as already output.
            output = request.output_token_ids + drafts[:j]
            mask = None if request.token_bitmask is None else request.token_bitmask[j]  # the grammar after drafts[:j]
            states.append(
                RowState(
                    request.params, request.generator, request.prompt_token_ids, output, request.eos_token_ids, mask
                )
            )
            flat_rows.append(row)
    raw = logits[flat_rows]
    x, greedy = sampler.process_logits(raw, states)
    greedy_rows = greedy.tolist()
    argmax = x.argmax(dim=-1).tolist()
    results = []
    offset = 0
    for request, _ in requests:
        drafts = request.spec_token_ids
        k = len(drafts)
        span = slice(offset, offset + k + 1)
        if greedy_rows[offset]:
            target = argmax[span]
            a = 0
            while a < k and drafts[a] == target[a]:
                a += 1
            tokens = drafts[:a] + [target[a]]
        else:
            p = x[span].softmax(dim=-1)
            q = request.spec_probs.to(p.device, torch.float32) if request.spec_probs is not None else None
            a, last = accept_drafts(p, drafts, q, request.generator)
            tokens = drafts[:a] + [last]
        lps = None
        if request.params.logprobs is not None:
            ids = torch.tensor(tokens, dtype=torch.long, device=raw.device)
            lp = _logprobs(raw[offset : offset + len(tokens)], ids, [request.params.logprobs] * len(tokens))
            lps = lp.to_lists(ids)
        results.append((request, tokens, lps))
        offset += k + 1
    return results
