"""Shapes of keel's C++ operators for torch.compile's tracing (fake tensors): what each returns,
without running it. Registered when the library is loaded (keel.kernels)."""

from __future__ import annotations

import torch
from torch import Tensor


def register() -> None:
    @torch.library.register_fake("keel::block_linear")
    def _(
        x: Tensor,
        codes: Tensor,
        scales: Tensor,
        mins: Tensor | None,
        bits: int,
        bias: Tensor | None,
        passes: int = 1,
        panel_rows: int = 0,
    ) -> Tensor:
        return x.new_empty(*x.shape[:-1], codes.shape[0])

    @torch.library.register_fake("keel::block_embedding")
    def _(
        ids: Tensor,
        codes: Tensor,
        scales: Tensor,
        mins: Tensor | None,
        bits: int,
        dtype: torch.dtype,
        panel_rows: int = 0,
    ) -> Tensor:
        k = codes.shape[1] * (2 if bits == 4 else 1)
        return torch.empty(*ids.shape, k, dtype=dtype, device=ids.device)

    @torch.library.register_fake("keel::paged_attention")
    def _(
        q: Tensor,
        keys: Tensor,
        values: Tensor | None,
        key_scales: Tensor | None,
        value_scales: Tensor | None,
        tables: Tensor,
        table_of: Tensor | None,
        positions: Tensor,
        block_size: int,
        window: int,
        scale: float,
        v_dim: int,
        softcap: float = 0.0,
        sinks: Tensor | None = None,
        alibi: Tensor | None = None,
    ) -> Tensor:
        return q.new_empty(q.shape[0], q.shape[1], v_dim)

    @torch.library.register_fake("keel::fused_rms_norm")
    def _(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
        return torch.empty_like(x)

    @torch.library.register_fake("keel::fused_rotary")
    def _(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        return torch.empty_like(x)

    @torch.library.register_fake("keel::fused_silu_mul")
    def _(gate: Tensor, up: Tensor) -> Tensor:
        return torch.empty_like(gate)

    @torch.library.register_fake("keel::decoder_layers")
    def _(
        x: Tensor,
        tensors: list[Tensor | None],
        ints: list[int],
        floats: list[float],
        cos: Tensor,
        sin: Tensor,
        k_stores: list[Tensor],
        v_stores: list[Tensor],
        k_scales: list[Tensor],
        v_scales: list[Tensor],
        slots: Tensor,
        tables: Tensor,
        table_of: Tensor,
        positions: Tensor,
    ) -> Tensor:
        return torch.empty_like(x)
