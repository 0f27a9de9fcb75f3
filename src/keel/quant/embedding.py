"""The token embedding read from integer blocks (`torch.ops.keel.block_embedding`).

A GGUF file's `token_embd` is quantized (Q8_0, Q6_K, Q4_K, ...). Where keel's kernels run, the
embedding keeps those blocks instead of a float table: a lookup dequantizes only the rows of the
step's tokens (exactly: q * scale + min in float32), and a tied head (keel.quant.on_load) and the
embedding share one copy of the codes. For SmolLM2-135M that drops its float32 table (113 MB).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from keel.quant.block_layout import apply_keeping_scales


class BlockEmbedding(nn.Module):
    """Drop-in for nn.Embedding over block-layout codes (keel.quant.block_layout) and their scales."""

    def __init__(
        self, bits: int, codes: Tensor, scales: Tensor, mins: Tensor | None, dtype: torch.dtype = torch.float32
    ) -> None:
        super().__init__()
        self.bits = bits
        self.num_embeddings = codes.shape[0]
        self.embedding_dim = codes.shape[1] * (2 if bits == 4 else 1)
        self.compute_dtype = dtype
        self.register_buffer("qweight", codes)
        self.register_buffer("scales", scales)
        self.register_buffer("mins", mins)
        self.panel_rows = 0  # the codes' layout (keel.quant.block_layout); `sharing` takes the head's
        self.table: Tensor | None = None  # the dequantized table, once moved where the kernels do not run

    @classmethod
    def sharing(cls, layer: nn.Module) -> BlockEmbedding:
        """The embedding of a tied head in the block layout (a QuantizedLinear), on the same tensors."""
        b = layer._buffers
        embedding = cls(layer.bits, b["qweight"], b["scales"], b["mins"], layer.compute_dtype)
        embedding.panel_rows = layer.panel_rows
        return embedding

    def forward(self, ids: Tensor) -> Tensor:
        if self.table is not None:
            return nn.functional.embedding(ids, self.table)
        b = self._buffers
        return torch.ops.keel.block_embedding(
            ids, b["qweight"], b["scales"], b["mins"], self.bits, self.compute_dtype, self.panel_rows
        )

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> BlockEmbedding:  # type: ignore[override]
        """Codes and scales stay as stored (a dtype move changes the output dtype only,
        `apply_keeping_scales`); a move off the CPU dequantizes the table for torch's embedding there."""
        codes = self._buffers["qweight"]
        probe = fn(torch.empty(0, dtype=self.compute_dtype, device=codes.device if codes is not None else "cpu"))
        if codes is not None and probe.device.type not in ("cpu", "meta"):
            b = self._buffers
            table = torch.ops.keel.block_dequantize(b["qweight"], b["scales"], b["mins"], self.bits, self.panel_rows)
            self.table = table.to(device=probe.device, dtype=probe.dtype)
            for name in ("qweight", "scales", "mins"):
                self._buffers[name] = None
        elif self.table is not None:
            self.table = fn(self.table)
        else:
            apply_keeping_scales(self, fn, recurse, probe.device)
        self.compute_dtype = probe.dtype
        return self

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.bits}-bit blocks"
