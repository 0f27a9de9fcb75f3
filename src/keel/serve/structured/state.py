"""One request's grammar: which tokens it allows next, fed the request's output as it grows."""

from __future__ import annotations

import torch
from torch import Tensor


class GrammarState:
    """A GrammarMatcher with keel's bitmask rows ([ceil(V / 32)] int32, bit j of word w: token 32 w + j)."""

    def __init__(self, matcher, vocab_size: int) -> None:
        self.matcher = matcher
        self.width = (vocab_size + 31) // 32

    @property
    def terminated(self) -> bool:
        """The grammar accepted its stop token: nothing may follow."""
        return self.matcher.is_terminated()

    def accept(self, token_id: int) -> bool:
        """Advance past a generated token; False if the grammar does not allow it (then nothing changes)."""
        return self.matcher.accept_token(token_id)

    def next_mask(self) -> Tensor:
        """[1, W] the tokens allowed at the next position."""
        mask = torch.empty(1, self.width, dtype=torch.int32)
        self.matcher.fill_next_token_bitmask(mask, 0)
        return mask

    def draft_masks(self, drafts: list[int]) -> Tensor:
        """[k + 1, W]: row j allows what may follow drafts[:j]. The drafts are accepted tentatively and
        rolled back; after the first draft the grammar refuses, rows allow everything (that draft gets
        probability 0 at its row, so verification rejects it and never reads the later rows)."""
        masks = torch.full((len(drafts) + 1, self.width), -1, dtype=torch.int32)
        accepted = 0
        for j in range(len(drafts) + 1):
            if self.matcher.is_terminated():
                break
            self.matcher.fill_next_token_bitmask(masks, j)
            if j == len(drafts) or not self.matcher.accept_token(drafts[j]):
                break
            accepted += 1
        if accepted:
            self.matcher.rollback(accepted)
        return masks
