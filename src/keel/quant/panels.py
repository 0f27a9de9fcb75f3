"""Block weights re-stored in panels for the stored-panel kernels: the serving engine's step after fusing.

From the `avx2` kernel level keel's block products read weights in panels of 16 output rows
(csrc/kernels.h, "the panel layout"; csrc/block_gemm_stored_avx2.cpp, block_gemm_stored_avx512.cpp at
the VNNI level, and block_gemm_stored_amx.cpp's tiles, whose B operand is a stored panel block as it
lies): one contiguous stream per 16 rows, each row's 4 values a 32-bit lane, so one broadcast multiply
serves 16 rows (vpdpbusd; two maddubs on AVX2) with no per-row reduction and no per-call repacking. The
same codes, scales and mins in another order (llama.cpp repacks its Q4_0/Q8_0 weights at load the same
way): no bytes added, no rounding changed. The layers keep what else reads them working: `values()` and
moves off the CPU read the rows back, a tied embedding reads the head's panels (`keel::block_embedding`
gathers a token's row), and the portable level converts per call (tests that run every level on one
model).
"""

from __future__ import annotations

from torch import nn

from keel import kernels
from keel.quant.embedding import BlockEmbedding
from keel.quant.linear import QuantizedLinear


def panels_pay() -> bool:
    """Whether block weights are re-stored in panels here: from the AVX2 kernel level, where the stored-panel
    kernels beat the row layout's (and, at the VNNI level, BLAS) at the row counts measured
    (docs/BENCHMARKS.md: "issue 22, sixth part" for VNNI, "eleventh part" for AVX2)."""
    return kernels.stored_panels_here()


def store_in_panels(model: nn.Module) -> int:
    """Re-store every block-layout QuantizedLinear of `model` in panels, and point each BlockEmbedding
    that shared a head's row-layout codes at the head's panels; the number of layers re-stored."""
    embeddings: dict[int, list[BlockEmbedding]] = {}
    for module in model.modules():
        if isinstance(module, BlockEmbedding) and module._buffers.get("qweight") is not None:
            embeddings.setdefault(id(module._buffers["qweight"]), []).append(module)
    stored = 0
    for module in model.modules():
        if not isinstance(module, QuantizedLinear):
            continue
        codes = module._buffers.get("qweight")
        if not module.store_in_panels():
            continue
        stored += 1
        for embedding in embeddings.pop(id(codes), []):
            for name in ("qweight", "scales", "mins"):
                embedding._buffers[name] = module._buffers[name]
            embedding.panel_rows = module.panel_rows
    return stored
