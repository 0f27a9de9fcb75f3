"""keel's C++ kernels (keel.kernels) against their torch references, at every ISA level this machine runs.

Quantized linear: weights exactly as stored (4-bit and 8-bit blocks of 32, float16 or float32 scales,
with and without mins, a scale per half block, per block, per group of blocks or per row), activations quantized to
int8 blocks of 32 on the fly. The reference computes the same product from the dequantized weights
and the quantize-dequantized activations in float64, so the only difference is float32 summation
order. Paged attention: against a dense softmax over the positions each query may see.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from keel import kernels
from keel.model.layers import RMSNorm, apply_rotary
from keel.quant import QuantizedLinear
from keel.quant import linear as quant_linear
from keel.quant.block_layout import nibble_blocks, values_of_nibble_blocks
from keel.quant.embedding import BlockEmbedding
from keel.quant.linear import BLOCK_DEQUANTIZE_ROWS
from keel.quant.loading import load_model
from test_gguf import TOKENS, build_hf, write_gguf
from tiny_models import build_hf_model

pytestmark = [
    pytest.mark.isa,  # run again under KEEL_CPU_ISA=avx2 by `make test`
    pytest.mark.skipif(not kernels.enabled(), reason=f"keel kernels: {kernels.status()}"),
]

LEVELS = kernels.levels_here()


def quantize_rows_reference(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] float32 -> the int8-block activations the kernels multiply by, as float64 (q * d)."""
    blocks = x.float().reshape(x.shape[0], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    inverse = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    q = (blocks * inverse).round()
    return (q.double() * (amax / 127.0).double()).reshape(x.shape)


def dequantize_reference(codes, scales, mins, bits: int) -> torch.Tensor:
    values = values_of_nibble_blocks(codes) if bits == 4 else codes
    n, k = values.shape
    g = scales.shape[1]
    w = values.double().reshape(n, g, -1) * scales.double()[..., None]
    if mins is not None:
        w = w + mins.double()[..., None]
    return w.reshape(n, k)


def random_weights(n: int, k: int, bits: int, groups: int, scale_dtype, with_mins: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    if bits == 4:
        codes = nibble_blocks(torch.randint(0, 16, (n, k), generator=g))
    else:
        codes = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scales = (torch.rand(n, groups, generator=g) * 0.02 + 1e-3).to(scale_dtype)
    mins = (-torch.rand(n, groups, generator=g) * 0.1).to(scale_dtype) if with_mins else None
    return codes, scales, mins


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize(
    ("bits", "scale_dtype", "with_mins", "per"),
    [
        (4, torch.float16, True, "block"),  # GGUF Q4_1 (Q4_0: mins = -8 d)
        (4, torch.float16, False, "block"),  # 4-bit codes without mins (the kernels' no-min path)
        (4, torch.float32, True, 4),  # keel int4, groups of 128
        (8, torch.float16, False, "block"),  # GGUF Q8_0
        (8, torch.float32, False, "row"),  # keel int8, per output channel
        (8, torch.float32, True, 2),  # int8 with mins, groups of 64
        (4, torch.float32, True, "block"),  # GGUF Q4_K (sub-block scales and mins as float32)
        (8, torch.float32, True, "block"),  # GGUF Q5_K (codes 0..31)
        (8, torch.float32, False, "half"),  # GGUF Q6_K (a scale per 16 values)
        (8, torch.float16, False, "half"),
    ],
)
@pytest.mark.parametrize(
    ("n", "k", "m"),
    [(1, 32, 1), (37, 96, 3), (130, 800, 17), (64, 576, 1), (21, 288, 133), (19, 1568, 2), (45, 160, 11)],
)
def test_block_linear_matches_its_reference(level, bits, scale_dtype, with_mins, per, n, k, m):
    blocks = k // 32
    named = {"half": 2 * blocks, "block": blocks, "row": 1}
    groups = named.get(per) or (blocks // per if blocks % per == 0 else blocks)
    codes, scales, mins = random_weights(n, k, bits, groups, scale_dtype, with_mins)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1))
    want = quantize_rows_reference(x) @ dequantize_reference(codes, scales, mins, bits).T
    with kernels.using_level(level):
        got = torch.ops.keel.block_linear(x, codes, scales, mins, bits, None)
        got_bf16 = torch.ops.keel.block_linear(x.bfloat16(), codes, scales, mins, bits, None)
    assert got.dtype == torch.float32 and got.shape == (m, n)
    tolerance = 1e-5 * (want.abs().max().item() + 1) * math.sqrt(blocks)
    assert (got.double() - want).abs().max().item() < tolerance
    # bf16 activations: the same product of the bf16-rounded rows, rounded to bf16.
    want_bf16 = quantize_rows_reference(x.bfloat16().float()) @ dequantize_reference(codes, scales, mins, bits).T
    assert got_bf16.dtype == torch.bfloat16
    assert (got_bf16.double() - want_bf16).abs().max().item() < 1e-2 * (want_bf16.abs().max().item() + 1)


PANEL_FORMS = [  # (bits, scale dtype, mins, groups as blocks per scale: 0 half blocks, -1 the whole row)
    (4, torch.float16, True, 1),  # Q4_1
    (4, torch.float16, "centred", 1),  # Q4_0: mins -8 x scales (the VNNI kernel's integer offsets)
    (4, torch.float32, True, 4),  # keel int4, groups of 128
    (8, torch.float16, False, 1),  # Q8_0
    (8, torch.float32, False, -1),  # keel int8 per channel
    (8, torch.float32, True, 1),  # Q5_K
    (8, torch.float16, False, 0),  # Q6_K
]


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize(("bits", "scale_dtype", "with_mins", "per"), PANEL_FORMS)
@pytest.mark.parametrize(("n", "k"), [(16, 32), (37, 160), (130, 1568), (3, 256)])
def test_panel_layout_gives_the_row_layouts_products(level, bits, scale_dtype, with_mins, per, n, k):
    """Weights re-stored in panels of 16 rows (keel::block_panels, what the engine does from the AVX2
    level) give the row layout's products at every level and row count (the AVX2 and VNNI kernels read
    them as stored, the portable level converts them back), and convert back bit for bit."""
    blocks = k // 32
    groups = 2 * blocks if per == 0 else 1 if per == -1 else blocks // per if blocks % per == 0 else blocks
    codes, scales, mins = random_weights(n, k, bits, groups, scale_dtype, with_mins, seed=n)
    if bits == 8:  # the one code whose magnitude int8 cannot hold (the AVX2 kernel's sign step)
        codes[n // 2, :5] = -128
    if with_mins == "centred":
        mins = (-8 * scales.float()).to(scale_dtype)
        if n > 16:  # one min off the centre: its panel takes the mins' path, the others the offsets'
            mins[n - 1, 0] *= 0.5
    stored = torch.ops.keel.block_panels(codes, scales, mins, bits)
    assert len(stored) == (3 if with_mins else 2)
    assert [t.shape for t in stored] == [t.shape for t in (codes, scales, mins) if t is not None]
    if n > 16:  # the bytes moved (a single panel of one row, or of one unit a row, is its own transpose)
        assert not torch.equal(stored[0], codes)
    back = torch.ops.keel.block_rows(*stored[:2], stored[2] if with_mins else None, bits)
    originals = [t for t in (codes, scales, mins) if t is not None]
    assert len(back) == len(originals) and all(torch.equal(a, b) for a, b in zip(back, originals, strict=True))
    panel_mins = stored[2] if with_mins else None
    for m in (1, 2, 3, 4, 7, 8, 33):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        for passes in (1, 2):
            with kernels.using_level(level):
                want = torch.ops.keel.block_linear(x, codes, scales, mins, bits, None, passes)
                got = torch.ops.keel.block_linear(x, stored[0], stored[1], panel_mins, bits, None, passes, 16)
            rounding = 1e-5 * (want.abs().max().item() + 1) * math.sqrt(blocks)
            assert got.shape == (m, n) and (got - want).abs().max().item() < rounding, (m, passes)
    ids = torch.tensor([0, n - 1, n // 2, n - 1])
    with kernels.using_level(level):
        assert torch.equal(
            torch.ops.keel.block_embedding(ids, stored[0], stored[1], panel_mins, bits, torch.float32, 16),
            torch.ops.keel.block_embedding(ids, codes, scales, mins, bits, torch.float32),
        )
        assert torch.equal(
            torch.ops.keel.block_dequantize(stored[0], stored[1], panel_mins, bits, 16),
            torch.ops.keel.block_dequantize(codes, scales, mins, bits),
        )


def test_bad_panel_rows_are_refused():
    codes, scales, mins = random_weights(20, 64, 4, 2, torch.float16, True)
    with pytest.raises(RuntimeError, match="panel_rows must be 0"):
        torch.ops.keel.block_linear(torch.randn(1, 64), codes, scales, mins, 4, None, 1, 8)


def test_levels_follow_the_architecture():
    here = kernels.host()
    arm = dataclasses.replace(here, arch="aarch64", avx2=False, avx512=False, vnni=False, amx=False, neon=True)
    assert kernels.kernel_level(arm) == "neon_dotprod"  # the library lowers it where the CPU lacks SDOT
    assert kernels.kernel_level(dataclasses.replace(arm, neon=False)) == "scalar"
    assert kernels.levels_of("aarch64") == ("scalar", "neon", "neon_dotprod")
    assert kernels.levels_of("riscv64") == ("scalar",)
    # Only this architecture's levels (and the portable one) can be set.
    foreign = "neon" if here.arch == "x86_64" else "avx2"
    with pytest.raises(RuntimeError, match="is not an"):
        torch.ops.keel.set_kernel_isa(kernels.ISA_VALUES[foreign])
    with pytest.raises(ValueError, match="does not run here"):
        with kernels.using_level(foreign):
            pass


@pytest.mark.parametrize(("bits", "groups"), [(4, 20), (8, 20), (8, 40)])
def test_levels_agree_and_rows_are_independent(bits, groups):
    """Every ISA level computes the same numbers (to float32 rounding), and a row's output does not
    depend on the other rows of the batch (decode and prefill of the same token agree, to float32
    rounding: one row and many run different kernels, which sum in different orders)."""
    codes, scales, mins = random_weights(200, 640, bits, groups, torch.float16, bits == 4)
    x = torch.randn(9, 640, generator=torch.Generator().manual_seed(3))
    outs = []
    for level in LEVELS:
        with kernels.using_level(level):
            outs.append(torch.ops.keel.block_linear(x, codes, scales, mins, bits, None))
            single = torch.cat(
                [torch.ops.keel.block_linear(x[i : i + 1], codes, scales, mins, bits, None) for i in range(9)]
            )
            rounding = 1e-6 * outs[-1].abs().max().item()
            assert torch.allclose(single, outs[-1], rtol=0, atol=rounding), level
    for out in outs[1:]:
        assert torch.allclose(out, outs[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize(
    ("bits", "groups", "scale_dtype"),
    [(4, 3, torch.float16), (4, 1, torch.float32), (8, 3, torch.float16), (8, 6, torch.float16)],
)
def test_dequantize_and_embedding_read_the_blocks(level, bits, groups, scale_dtype):
    codes, scales, mins = random_weights(50, 96, bits, groups, scale_dtype, bits == 4)
    # q * scale, then + min, each rounded to float32 (the float load's arithmetic).
    values = (values_of_nibble_blocks(codes) if bits == 4 else codes).float().reshape(50, groups, -1)
    want = values * scales.float()[..., None]
    want = (want if mins is None else want + mins.float()[..., None]).reshape(50, 96)
    assert (want.double() - dequantize_reference(codes, scales, mins, bits)).abs().max() < 1e-6
    with kernels.using_level(level):
        assert torch.equal(torch.ops.keel.block_dequantize(codes, scales, mins, bits), want)
        with kernels.using_level("scalar"):  # every level's values are the portable loop's, bit for bit
            portable = torch.ops.keel.block_dequantize(codes, scales, mins, bits)
        assert torch.equal(torch.ops.keel.block_dequantize(codes, scales, mins, bits), portable)
    ids = torch.tensor([[3, 0, 49], [7, 7, 1]])
    rows = torch.ops.keel.block_embedding(ids, codes, scales, mins, bits, torch.bfloat16)
    assert rows.shape == (2, 3, 96) and rows.dtype == torch.bfloat16
    assert torch.equal(rows, want[ids].bfloat16())
    with pytest.raises(RuntimeError, match="token id 50"):
        torch.ops.keel.block_embedding(torch.tensor([50]), codes, scales, mins, bits, torch.float32)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("bits", [4, 8])
def test_refined_activations_give_the_float_product(level, bits):
    """Two passes (int8 and the int8 residual): the float product of the stored weights to ~1e-4,
    against one pass's ~1e-2, with heavy-tailed inputs (as after SiLU-and-multiply)."""
    codes, scales, mins = random_weights(96, 544, bits, 17, torch.float16, bits == 4)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(5, 544, generator=g) * torch.exp(2 * torch.randn(5, 544, generator=g))
    exact = x.double() @ dequantize_reference(codes, scales, mins, bits).T
    with kernels.using_level(level):
        outs = [torch.ops.keel.block_linear(x, codes, scales, mins, bits, None, p).double() for p in (1, 2)]
    errors = [((out - exact).norm() / exact.norm()).item() for out in outs]
    assert errors[1] < 2e-4 and errors[0] > 10 * errors[1], errors


def test_bad_block_weights_are_refused():
    codes, scales, mins = random_weights(8, 64, 4, 2, torch.float16, True)
    x = torch.randn(1, 64)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        torch.ops.keel.block_linear(torch.randn(1, 48), codes[:, :24].contiguous(), scales, mins, 4, None)
    with pytest.raises(RuntimeError, match="mins must match"):
        torch.ops.keel.block_linear(x, codes, scales, mins.float(), 4, None)
    with pytest.raises(RuntimeError, match="bits must be 4 or 8"):
        torch.ops.keel.block_linear(x, codes, scales, mins, 5, None)
    with pytest.raises(RuntimeError, match="1 or 2 passes"):
        torch.ops.keel.block_linear(x, codes, scales, mins, 4, None, 3)
    codes8, halves, _ = random_weights(8, 64, 8, 4, torch.float32, False)
    with pytest.raises(RuntimeError, match="half-block scales take no mins"):
        torch.ops.keel.block_linear(x, codes8, halves, halves, 8, None)
    with pytest.raises(RuntimeError, match="G dividing 2"):  # half blocks are 8-bit only
        torch.ops.keel.block_linear(x, codes, halves, halves, 4, None)


# ----------------------------------------------------------------------------- the layer and loading
@pytest.mark.parametrize(("scheme", "group"), [("int4", 32), ("int4", 128), ("int8", 0)])
def test_quantized_linear_runs_blocks_here(scheme, group):
    torch.manual_seed(0)
    linear = nn.Linear(256, 80, bias=True)
    layer = QuantizedLinear(linear, scheme, group or 128)
    assert layer.layout == "blocks" and "keel block_linear" in layer.backend
    x = torch.randn(4, 256)
    want = quantize_rows_reference(x) @ layer.dequantized().double().T + linear.bias.double()
    got = layer(x)
    assert (got.double() - want).abs().max().item() < 1e-4
    # The dequantized weights are the scheme's own (the kernels change only how the product is run).
    assert (layer.dequantized() - linear.weight).abs().max() < (0.5 / 15 if scheme == "int4" else 0.5 / 127) * 2 * (
        linear.weight.abs().max()
    )
    # Prefill-sized products with refined activations: the stored weights dequantized, times the float
    # rows (exact; one int8 pass of 4-bit weights runs the panel kernel instead: the test below).
    layer.activation_passes = 2
    rows = torch.randn(BLOCK_DEQUANTIZE_ROWS, 256)
    want_rows = rows.double() @ layer.dequantized().double().T + linear.bias.double()
    assert (layer(rows).double() - want_rows).abs().max().item() < 1e-4
    # A dtype move keeps the stored scales (the kernels read float32 and float16 whatever the activations).
    layer.to(torch.bfloat16)
    assert layer.scales.dtype == torch.float32 and layer(x.bfloat16()).dtype == torch.bfloat16


def test_one_pass_4_bit_prefill_runs_the_integer_kernel(monkeypatch):
    """With one int8 pass, 4-bit products of prefill size run a panel kernel where one exists (it beats
    dequantizing for BLAS there); the portable level, and refined activations below the VNNI level (whose
    panel kernel beats BLAS with them too), still dequantize."""
    torch.manual_seed(0)
    linear = nn.Linear(256, 48, bias=True)
    layer = QuantizedLinear(linear, "int4", 32)
    layer.activation_passes = 1
    rows = torch.randn(BLOCK_DEQUANTIZE_ROWS + 3, 256)
    integer = quantize_rows_reference(rows) @ layer.dequantized().double().T + linear.bias.double()
    dequantized = []
    real = QuantizedLinear._dequantized_product
    monkeypatch.setattr(QuantizedLinear, "_dequantized_product", lambda self, x: dequantized.append(1) or real(self, x))
    for level in LEVELS:
        with kernels.using_level(level):
            got = layer(rows)
            panels = kernels.panels_here()  # x86-64 from AVX2; aarch64's row kernels take decode sizes only
        assert (got.double() - integer).abs().max().item() < 1e-4 or not panels
        assert bool(dequantized) == (not panels), level
        assert panels == (level in ("avx2", "avx512_vnni", "amx")), level
        dequantized.clear()
    layer.activation_passes = 2
    for level in LEVELS:
        with kernels.using_level(level):
            layer(rows)
        assert bool(dequantized) == (level not in ("avx512_vnni", "amx")), level
        dequantized.clear()


def test_eight_bit_products_of_many_rows_run_the_vnni_panels(monkeypatch):
    """8-bit products of batched-decode and prefill size run the integer kernel at the VNNI level (its
    panel kernel beats BLAS there) and dequantize for BLAS below it, with the same results."""
    torch.manual_seed(0)
    linear = nn.Linear(320, 40, bias=False)
    layer = QuantizedLinear(linear, "int8", 32)
    assert layer.bits == 8 and layer.layout == "blocks"
    dequantized = []
    real = QuantizedLinear._dequantized_product
    monkeypatch.setattr(QuantizedLinear, "_dequantized_product", lambda self, x: dequantized.append(1) or real(self, x))
    for passes in (1, 2):
        layer.activation_passes = passes
        rows = torch.randn(40, 320)
        exact = rows.double() @ layer.dequantized().double().T
        for level in LEVELS:
            with kernels.using_level(level):
                got = layer(rows).double()
            assert bool(dequantized) == (level not in ("avx512_vnni", "amx")), (level, passes)
            dequantized.clear()
            assert ((got - exact).norm() / exact.norm()).item() < (2e-2 if passes == 1 else 2e-4), (level, passes)


def test_fused_block_layers_equal_their_parts():
    torch.manual_seed(0)
    parts = [QuantizedLinear(nn.Linear(128, n, bias=False), "int4", 32) for n in (64, 32, 32)]
    fused = parts[0].fused_with(parts[1:])
    x = torch.randn(3, 128)
    assert torch.equal(fused(x), torch.cat([p(x) for p in parts], dim=-1))
    assert parts[0].fused_with([QuantizedLinear(nn.Linear(128, 32), "int8")]) is None  # other layout


def test_layers_stored_in_panels_compute_as_before():
    """keel.quant.panels on a model: every block layer and the tied embedding re-stored, the same
    outputs (to float32 rounding), `values()` the row layout's, and no fusing of re-stored parts."""
    from keel.quant.panels import store_in_panels

    torch.manual_seed(0)
    net = nn.ModuleList([QuantizedLinear(nn.Linear(128, 80), "int4", 32), QuantizedLinear(nn.Linear(128, 37), "int8")])
    head = net[0]
    embedding = BlockEmbedding.sharing(head)
    net.append(embedding)
    x = torch.randn(5, 128)
    many = torch.randn(300, 128, generator=torch.Generator().manual_seed(2))
    values = [m.values() for m in net[:2]]
    before = [m(x) for m in net[:2]]
    before_many = {level: _at_level(level, head, many) for level in LEVELS}
    rows_before = embedding(torch.tensor([1, 79]))
    assert store_in_panels(net) == 2 and store_in_panels(net) == 0
    assert all(m.panel_rows == 16 for m in net[:2]) and "panels of 16 rows" in head.backend
    assert embedding.qweight is head.qweight and embedding.panel_rows == 16
    assert torch.equal(embedding(torch.tensor([1, 79])), rows_before)
    for m, (q, s, mins), want in zip(net[:2], values, before, strict=True):
        q2, s2, mins2 = m.values()
        assert torch.equal(q, q2) and torch.equal(s, s2) and (mins is None or torch.equal(mins, mins2))
        assert torch.allclose(m(x), want, rtol=1e-5, atol=1e-5)
    assert head.fused_with([QuantizedLinear(nn.Linear(128, 16), "int4", 32)]) is None
    for level in LEVELS:  # lower levels convert per call (and dequantize products of many rows there)
        assert torch.allclose(_at_level(level, head, many), before_many[level], rtol=1e-5, atol=1e-4), level


def _at_level(level: str, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with kernels.using_level(level):
        return layer(x)


def test_kernels_switched_off_build_torch_layers(monkeypatch):
    monkeypatch.setenv("KEEL_KERNELS", "0")
    monkeypatch.setattr(kernels, "_ACTIVE", None)  # the per-call checks read it again, and as before after
    assert not kernels.enabled() and not kernels.active() and kernels.status() == "off (KEEL_KERNELS=0)"
    layer = QuantizedLinear(nn.Linear(64, 32), "int4", 32)
    assert layer.layout == "aten"


def test_gguf_blocks_and_tied_head_run_as_stored(tmp_path):
    """--quantize gguf with nothing kept: every Q4_1 block runs as stored, the tied head on the
    embedding's blocks; logits within the int8 activations' error of the float (dequantized) load."""
    from gguf import GGMLQuantizationType as Q

    path = write_gguf(build_hf("llama"), tmp_path / "m.gguf", qtype=Q.Q4_1)
    reference = load_model(path, "float32")
    loaded = load_model(path, "float32", quantize="gguf", quant_keep=())
    layers = [m for m in loaded.model.modules() if isinstance(m, QuantizedLinear)]
    assert all(m.layout == "blocks" and m.scales.dtype == torch.float16 for m in layers)
    head = loaded.model.lm_head
    if loaded.model.config.tie_word_embeddings:
        assert isinstance(head, QuantizedLinear)
    # The embedding looks its rows up in the head's blocks (one copy of the codes): the float load's rows exactly.
    embedding = loaded.model.embed_tokens
    assert isinstance(embedding, BlockEmbedding) and embedding.qweight is head.qweight
    assert torch.equal(embedding(TOKENS), reference.model.embed_tokens(TOKENS))
    with torch.inference_mode():
        want, got = reference.model(TOKENS), loaded.model(TOKENS)
    assert ((got - want).norm() / want.norm()).item() < 0.03


@pytest.mark.parametrize("isa", ["avx2", None])
def test_auto_dtype_on_the_kernels_is_float32_on_every_cpu(tmp_path, force_isa, isa):
    """--dtype auto with --quantize on keel's kernels: float32 whatever the host's bf16 support (the
    kernels multiply float32 activations; their fused layers run float32 only)."""
    from gguf import GGMLQuantizationType as Q

    if isa is not None:
        force_isa(isa)
    path = write_gguf(build_hf("llama"), tmp_path / "m.gguf", qtype=Q.Q4_1)
    loaded = load_model(path, "auto", quantize="gguf")
    assert loaded.model.dtype == torch.float32 and "keel's block kernels" in loaded.dtype_reason
    assert load_model(path, "bfloat16", quantize="gguf").model.dtype == torch.bfloat16  # asked for: honoured


def test_untied_and_kept_embeddings(tmp_path):
    """An untied model's embedding runs its own token_embd blocks; a kept (float) tied head keeps the
    float table it reads; `--quant-keep embed_tokens` keeps a float embedding."""
    from gguf import GGMLQuantizationType as Q

    path = write_gguf(build_hf("llama-bias"), tmp_path / "m.gguf", qtype=Q.Q8_0)  # untied
    reference = load_model(path, "float32").model
    loaded = load_model(path, "float32", quantize="gguf", quant_keep=()).model
    assert isinstance(loaded.embed_tokens, BlockEmbedding) and loaded.embed_tokens.bits == 8
    assert loaded.embed_tokens.qweight is not loaded.lm_head.qweight
    assert torch.equal(loaded.embed_tokens(TOKENS), reference.embed_tokens(TOKENS))
    kept = load_model(path, "float32", quantize="gguf", quant_keep=("embed_tokens",)).model
    assert type(kept.embed_tokens) is nn.Embedding
    tied = write_gguf(build_hf("llama"), tmp_path / "t.gguf", qtype=Q.Q8_0)
    float_head = load_model(tied, "float32", quantize="gguf", quant_keep=("lm_head",)).model
    assert type(float_head.embed_tokens) is nn.Embedding and float_head.lm_head.weight is float_head.embed_tokens.weight


def test_a_gguf_files_head_runs_as_stored_unless_kept(tmp_path):
    """Under gguf (auto's choice for the file) the head keeps the type the file gave it, its tied embedding sharing
    the codes, and the logits stay those of the float head to the refined activations' accuracy; --quant-keep lm_head
    expands it. keel's own int8/int4 keep the head in float by default; --quant-keep-as alone tiers the head."""
    from gguf import GGMLQuantizationType as Q

    from keel.quant.config import DEFAULT_KEEP, keep_for
    from keel.serve import EngineConfig, LLMEngine

    path = write_gguf(build_hf("llama"), tmp_path / "q.gguf", qtype=Q.Q4_1)
    stored = load_model(path, "float32", quantize="auto").model
    assert isinstance(stored.lm_head, QuantizedLinear) and stored.lm_head.layout == "blocks"
    assert isinstance(stored.embed_tokens, BlockEmbedding)
    kept = load_model(path, "float32", quantize="auto", quant_keep=("lm_head",)).model
    assert type(kept.lm_head) is nn.Linear and type(kept.embed_tokens) is nn.Embedding
    with torch.no_grad():
        a, b = stored(TOKENS), kept(TOKENS)
    assert (a - b).norm() <= 1e-3 * b.norm()
    engine = LLMEngine(str(path), EngineConfig.of(num_blocks=16, max_model_len=64, compile=False))
    assert isinstance(engine.model.lm_head, QuantizedLinear)
    assert keep_for(None, "gguf") == () and keep_for(None, "gguf", "int8") == DEFAULT_KEEP == ("lm_head",)
    assert keep_for(None, "int4") == keep_for(None, None) == DEFAULT_KEEP and keep_for((), "int8") == ()


def test_k_quant_blocks_run_as_stored(tmp_path):
    """A Q4_K_M-like file (Q4_K, with Q6_K attn_v and Q5_K ffn_down): every K-quant tensor runs as its
    integer codes (Q4_K 4-bit, Q5_K 8-bit with mins, Q6_K 8-bit with a scale per 16 values), the tied
    head on the embedding's Q4_K blocks; logits within the int8 activations' error of the float load."""
    from gguf import GGMLQuantizationType as Q

    model = build_hf_model("llama", 0, num_hidden_layers=2, hidden_size=256, intermediate_size=512)
    path = write_gguf(model, tmp_path / "m.gguf", qtype=Q.Q4_K, mixed={"attn_v": Q.Q6_K, "ffn_down": Q.Q5_K})
    reference = load_model(path, "float32")
    loaded = load_model(path, "float32", quantize="gguf", quant_keep=())
    layers = {n: m for n, m in loaded.model.named_modules() if isinstance(m, QuantizedLinear)}
    assert all(m.layout == "blocks" and m.scales.dtype == torch.float32 for m in layers.values())
    forms = {(m.bits, m.in_features // m.scales.shape[1], m.mins is not None) for m in layers.values()}
    assert forms == {(4, 32, True), (8, 16, False), (8, 32, True)}, forms
    assert isinstance(loaded.model.lm_head, QuantizedLinear) and loaded.model.lm_head.bits == 4
    assert isinstance(loaded.model.embed_tokens, BlockEmbedding)
    assert torch.equal(loaded.model.embed_tokens(TOKENS), reference.model.embed_tokens(TOKENS))
    with torch.inference_mode():
        want, got = reference.model(TOKENS), loaded.model(TOKENS)
    assert ((got - want).norm() / want.norm()).item() < 0.03


# ----------------------------------------------------------------------------- paged attention
def dense_attention(q, keys, values, tables, table_of, positions, block_size, window, scale, v_dim, softcap=0.0):
    """q [R, H, D]; keys/values [H_kv, slots, D] -> [R, H, v_dim] by a plain softmax over the visible rows (each
    scaled score soft-capped at softcap * tanh(score / softcap) when softcap > 0, Gemma 2's)."""
    heads, kv_heads = q.shape[1], keys.shape[0]
    out = []
    for r in range(q.shape[0]):
        pos = int(positions[r])
        table = tables[int(table_of[r]) if table_of is not None else r]
        slots = torch.tensor([int(table[p // block_size]) * block_size + p % block_size for p in range(pos + 1)])
        k = keys[:, slots].double()
        v = (values[:, slots] if values is not None else keys[:, slots, :v_dim]).double()
        qq = q[r].double().view(kv_heads, heads // kv_heads, -1)
        s = torch.einsum("hgd,hld->hgl", qq, k) * scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        if window > 0:
            s[..., torch.arange(pos + 1) <= pos - window] = float("-inf")
        elif window < 0:  # Llama 4's chunks of -window positions
            s[..., torch.arange(pos + 1) < pos - pos % -window] = float("-inf")
        out.append(torch.einsum("hgl,hld->hgd", s.softmax(-1), v).reshape(heads, -1))
    return torch.stack(out)


def random_store(store: str, kv_heads: int, slots: int, dim: int, g: torch.Generator) -> tuple:
    """((keys, values, key scales, value scales) as paged_attention takes them, dense keys, dense values) for a
    store kind: float32, bfloat16, int8 with float16 scales, or latent (float32 keys, no values)."""
    keys = torch.randn(kv_heads, slots, dim, generator=g)
    values = None if store == "latent" else torch.randn(kv_heads, slots, dim, generator=g)
    key_scales = value_scales = None
    dense_k, dense_v = keys, values
    if store == "int8":
        key_scales = (torch.rand(kv_heads, slots, 1, generator=g) * 0.05).half()
        value_scales = (torch.rand(kv_heads, slots, 1, generator=g) * 0.05).half()
        keys = torch.randint(-127, 128, keys.shape, generator=g, dtype=torch.int8)
        values = torch.randint(-127, 128, keys.shape, generator=g, dtype=torch.int8)
        dense_k, dense_v = keys.float() * key_scales.float(), values.float() * value_scales.float()
    elif store == "bfloat16":
        keys, values = keys.bfloat16(), values.bfloat16()
        dense_k, dense_v = keys.float(), values.float()
    return (keys, values, key_scales, value_scales), dense_k, dense_v


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("store", ["float32", "bfloat16", "int8", "latent"])
@pytest.mark.parametrize("window", [0, 21, -24])
@pytest.mark.parametrize("softcap", [0.0, 0.5])
def test_paged_attention_matches_dense_softmax(level, store, window, softcap):
    """Decodes and a short chunk over every store kind, with and without a sliding window (or Llama 4's chunks
    of 24: -24) and score soft-capping (a cap of 0.5 bends most of these scores: the capped reference is far from
    the uncapped)."""
    g = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, bs, blocks = (8, 1, 80, 16, 40) if store == "latent" else (6, 2, 64, 16, 40)
    v_dim = 64 if store == "latent" else dim
    stored, dense_k, dense_v = random_store(store, kv_heads, blocks * bs, dim, g)
    # Three sequences: a decode at position 0, a decode past a block boundary, a 5-token prefill chunk.
    tables = torch.stack([torch.randperm(blocks, generator=g)[:8] for _ in range(3)]).int()
    table_of = torch.tensor([0, 1, 2, 2, 2, 2, 2])
    positions = torch.tensor([0, 37, 60, 61, 62, 63, 64])
    q = torch.randn(len(positions), heads, dim, generator=g)
    want = dense_attention(q, dense_k, dense_v, tables, table_of, positions, bs, window, 0.125, v_dim, softcap)
    with kernels.using_level(level):
        got = torch.ops.keel.paged_attention(
            q, *stored, tables, table_of, positions, bs, window, 0.125, v_dim, softcap=softcap
        )
    assert got.shape == (len(positions), heads, v_dim)
    assert (got.double() - want).abs().max().item() < 1e-5
    if softcap:
        uncapped = dense_attention(q, dense_k, dense_v, tables, table_of, positions, bs, window, 0.125, v_dim)
        assert (uncapped - want).abs().max().item() > 1e-2


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("store", ["float32", "bfloat16", "int8", "latent"])
@pytest.mark.parametrize("window", [0, 21, -24])
@pytest.mark.parametrize("group", [3, 20])
def test_paged_attention_prefill_chunks_in_tiles(level, store, window, group):
    """Long prefill chunks (cut into tiles of rows that share each block's reads) beside decodes: a chunk of
    40 rows from position 9 (tiles straddle blocks, the first starts mid-block), one of 23 rows from 0, a
    lone row of a third sequence at a position after a gap; GQA groups of 3 and of 20 (cut in 16s)."""
    g = torch.Generator().manual_seed(2)
    kv_heads, dim, bs, blocks = 2, (48 if store == "latent" else 64), 16, 24
    heads, v_dim = kv_heads * group, (32 if store == "latent" else dim)
    stored, dense_k, dense_v = random_store(store, kv_heads, blocks * bs, dim, g)
    tables = torch.stack([torch.randperm(blocks, generator=g)[:4] for _ in range(3)]).int()
    table_of = torch.tensor([1] + [0] * 40 + [2] * 23 + [2, 1])
    positions = torch.tensor([30, *range(9, 49), *range(0, 23), 40, 31])
    q = torch.randn(len(positions), heads, dim, generator=g)
    want = dense_attention(q, dense_k, dense_v, tables, table_of, positions, bs, window, 0.125, v_dim)
    with kernels.using_level(level):
        got = torch.ops.keel.paged_attention(q, *stored, tables, table_of, positions, bs, window, 0.125, v_dim)
    assert (got.double() - want).abs().max().item() < 1e-5


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("store", ["float32", "bfloat16"])
@pytest.mark.parametrize("softcap", [0.0, 0.7])
def test_paged_attention_tiles_are_bit_for_bit_their_rows(level, store, softcap):
    """A chunk attended in tiles gives exactly what its rows give attended one call each (a lone row takes the
    row body): the tiles change the work's sharing, not its rounding, so greedy tokens do not move. Capped
    scores too: a score's cap does not depend on where in the block the tile's row starts."""
    g = torch.Generator().manual_seed(3)
    stored, _, _ = random_store(store, 3, 20 * 16, 64, g)
    tables = torch.randperm(20, generator=g)[:6][None].int()
    positions = torch.arange(7, 90)
    table_of = torch.zeros(len(positions), dtype=torch.long)
    q = torch.randn(len(positions), 9, 64, generator=g)
    with kernels.using_level(level):
        whole = torch.ops.keel.paged_attention(q, *stored, tables, table_of, positions, 16, 0, 0.125, 64, softcap)
        alone = [
            torch.ops.keel.paged_attention(
                q[r : r + 1], *stored, tables, table_of[:1], positions[r : r + 1], 16, 0, 0.125, 64, softcap
            )
            for r in range(len(positions))
        ]
    assert torch.equal(whole, torch.cat(alone))


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("dim", [16, 24, 20, 96])
@pytest.mark.parametrize("softcap", [0.0, 0.4])
def test_paged_attention_head_dims_take_every_body(level, dim, softcap):
    """Head dims of whole 16-lane vectors (the AVX-512 body), of 8-lane ones only (the AVX2 body), and
    neither (the portable loops), each level: the dense softmax, over blocks cut at every offset, with and
    without soft-capped scores."""
    g = torch.Generator().manual_seed(1)
    heads, kv_heads, bs, blocks = 4, 2, 16, 12
    keys = torch.randn(kv_heads, blocks * bs, dim, generator=g)
    values = torch.randn(kv_heads, blocks * bs, dim, generator=g)
    tables = torch.stack([torch.randperm(blocks, generator=g)[:6] for _ in range(2)]).int()
    table_of = torch.tensor([0, 1, 1])
    positions = torch.tensor([16, 70, 93])
    q = torch.randn(len(positions), heads, dim, generator=g)
    want = dense_attention(q, keys, values, tables, table_of, positions, bs, 0, 0.2, dim, softcap)
    with kernels.using_level(level):
        got = torch.ops.keel.paged_attention(
            q, keys, values, None, None, tables, table_of, positions, bs, 0, 0.2, dim, softcap
        )
    assert (got.double() - want).abs().max().item() < 1e-5


def test_paged_attention_refuses_a_table_outside_the_store():
    keys = torch.randn(1, 64, 32)
    with pytest.raises(RuntimeError, match="outside the store"):
        torch.ops.keel.paged_attention(
            torch.randn(1, 2, 32), keys, keys, None, None, torch.tensor([[9]], dtype=torch.int32), None,
            torch.tensor([3]), 16, 0, 1.0, 32,
        )  # fmt: skip
    with pytest.raises(RuntimeError, match="softcap must be >= 0"):
        torch.ops.keel.paged_attention(
            torch.randn(1, 2, 32), keys, keys, None, None, torch.tensor([[0]], dtype=torch.int32), None,
            torch.tensor([3]), 16, 0, 1.0, 32, -1.0,
        )  # fmt: skip


# ----------------------------------------------------------------------------- fused small ops
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_small_ops_compute_the_torch_formulas(dtype):
    torch.manual_seed(0)
    norm = RMSNorm(576).to(dtype)
    norm.weight.data = torch.randn(576).to(dtype)
    x = torch.randn(2, 3, 576).to(dtype)
    q, cos, sin = (
        torch.randn(2, 3, 9, 64).to(dtype),
        torch.randn(2, 3, 1, 64).to(dtype),
        torch.randn(2, 3, 1, 64).to(dtype),
    )
    gate_up = torch.randn(5, 2 * 384).to(dtype)
    with torch.enable_grad():  # autograd on: torch's ops
        assert not kernels.fused_ops(x)
        want = norm(x), apply_rotary(q, cos, sin)
    with torch.inference_mode():  # keel's fused kernels in float32; torch's ops in bf16
        assert kernels.fused_ops(x) == (dtype == torch.float32)
        got = norm(x), apply_rotary(q, cos, sin)
    for w, g in zip(want, got, strict=True):
        assert torch.allclose(w.float(), g.float(), rtol=1e-6, atol=1e-6 if dtype == torch.float32 else 1e-2)
    if dtype == torch.float32:
        gate, up = gate_up.chunk(2, dim=-1)  # views of one tensor, as a fused gate_up projection gives them
        assert torch.allclose(torch.ops.keel.fused_silu_mul(gate, up), F.silu(gate) * up, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("level", kernels.levels_here())
@pytest.mark.parametrize("inter", [1, 13, 16, 384, 1536 + 7])
def test_silu_mul_at_every_level(level, inter):
    """keel::fused_silu_mul (the vector exponential from AVX2, a scalar tail) against torch's silu."""
    g = torch.Generator().manual_seed(inter)
    gate = torch.randn(5, inter, generator=g) * 6
    gate[0, : min(inter, 4)] = torch.tensor([0.0, -0.0, 88.0, -90.0])[: min(inter, 4)]
    up = torch.randn(5, inter, generator=g)
    with kernels.using_level(level):
        got = torch.ops.keel.fused_silu_mul(gate, up)
    assert torch.allclose(got, F.silu(gate) * up, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- the real checkpoint
def k_quant_form(weight: torch.Tensor, half_blocks: bool) -> QuantizedLinear:
    """A layer in the form keel runs Q6_K (8-bit codes -32..31, a scale per 16 values) or Q5_K (codes
    0..31 with a scale and a min per 32) in, by plain rounding (gguf cannot produce K-quants; the
    kernels' error against the same weights as floats is what is measured, not the quantizer's)."""
    n, k = weight.shape
    if half_blocks:
        w = weight.float().reshape(n, k // 16, 16)
        scales = (w.abs().amax(-1) / 32).clamp(min=1e-12)
        q = (w / scales[..., None]).round().clamp(-32, 31).to(torch.int8).reshape(n, k)
        return QuantizedLinear.from_blocks(8, q, scales, None, dtype=torch.float32)
    w = weight.float().reshape(n, k // 32, 32)
    low, high = w.amin(-1), w.amax(-1)
    scales = ((high - low) / 31).clamp(min=1e-12)
    q = ((w - low[..., None]) / scales[..., None]).round().clamp(0, 31).to(torch.int8).reshape(n, k)
    return QuantizedLinear.from_blocks(8, q, scales, low, dtype=torch.float32)


# Two minutes on a 2-core machine, in `make test-slow` (the default suite's budget); each kernel's tests above stay.
@pytest.mark.slow
def test_smollm2_perplexity_on_the_kernels_is_within_half_a_percent_of_the_float_path(monkeypatch):
    """Every format keel's kernels run, on SmolLM2-135M's GGUF: its own Q4_1 blocks with the tied head
    on the embedding's Q8_0 blocks, keel's int4 (g32) and int8 of the dequantized weights, and the
    K-quants' forms (`k_quant_form`). Each
    against the float path of the same weights (the file dequantized; each quantized layer's own
    dequantized weights as float layers). With refined activations (the default: int8 and its residual)
    the kernels stay within 0.05%. With int8 activations alone (llama.cpp's way) within +1%: on this
    146-token paragraph keel's int8 weights measure +0.68%, on 4,096 Shakespeare tokens every format
    +0.01-0.4% (bench/activation_quality.py)."""
    import copy

    from keel.model.perplexity import perplexity
    from keel.quant import quantize_model
    from keel.quant.apply import replace_module, set_activations
    from test_smollm2 import CATALOG_NAME, DICKENS

    base = load_model(CATALOG_NAME, "float32")
    ids = base.tokenizer.encode(DICKENS, add_special_tokens=False)
    # The paragraph is one forward of more rows than BLOCK_DEQUANTIZE_ROWS, where a block layer would
    # multiply its dequantized weights through BLAS (the float product): the integer kernels run instead.
    assert len(ids) >= BLOCK_DEQUANTIZE_ROWS
    monkeypatch.setattr(quant_linear, "BLOCK_DEQUANTIZE_ROWS", 1 << 30)
    monkeypatch.setattr(quant_linear, "EIGHT_BIT_DEQUANTIZE_ROWS", {1: 1 << 30, 2: 1 << 30})
    monkeypatch.setattr(quant_linear, "STORED_DEQUANTIZE_ROWS", dict.fromkeys(quant_linear.STORED_DEQUANTIZE_ROWS))
    float_path = perplexity(base.model, ids)
    gguf = load_model(CATALOG_NAME, "float32", quantize="gguf", quant_keep=()).model
    assert all(m.layout == "blocks" for m in gguf.modules() if isinstance(m, QuantizedLinear))
    assert all(m.activation_passes == 2 for m in gguf.modules() if isinstance(m, QuantizedLinear))
    assert abs(perplexity(gguf, ids) / float_path - 1) <= 5e-4
    # The layout the serving engine stores from the AVX2 level: the stored-panel kernels, the same bounds.
    from keel.quant.panels import store_in_panels

    assert store_in_panels(gguf) > 0
    assert abs(perplexity(gguf, ids) / float_path - 1) <= 5e-4
    set_activations(gguf, "int8")
    assert perplexity(gguf, ids) <= 1.01 * float_path
    del gguf
    for scheme, group in (("int4", 32), ("int8", 128), ("k-quant forms", 0)):
        model = copy.deepcopy(base.model)
        if group:
            quantize_model(model, scheme, group, keep=set())
        else:  # Q4_K's form is int4 g32's; Q6_K's form for v and down (as in Q4_K_M files), Q5_K's elsewhere
            for name, linear in [(n, m) for n, m in model.named_modules() if type(m) is nn.Linear]:
                if name != "lm_head":
                    half = name.endswith(("v_proj", "down_proj"))
                    replace_module(model, name, k_quant_form(linear.weight.detach(), half))
        layers = [(n, m) for n, m in model.named_modules() if isinstance(m, QuantizedLinear)]
        assert layers and all(m.layout == "blocks" for _, m in layers)
        quantized = {}
        for activations in ("int8", "refined"):
            set_activations(model, activations)
            quantized[activations] = perplexity(model, ids)
        for name, layer in layers:  # the same weights, as float layers
            dense = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None)
            dense.weight.data = layer.dequantized()
            if layer.bias is not None:
                dense.bias.data = layer.bias.float()
            replace_module(model, name, dense)
        float_path = perplexity(model, ids)
        assert quantized["int8"] <= 1.01 * float_path, scheme
        assert abs(quantized["refined"] / float_path - 1) <= 5e-4, scheme
