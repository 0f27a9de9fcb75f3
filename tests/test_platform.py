"""keel.platform: one probe of the host, the KEEL_CPU_ISA cap, and the choices made from it (the compute
dtype of `--dtype auto`, oneDNN pre-packing, the backends the start-up line names)."""

from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from keel import kernels, platform
from keel.cli import main
from keel.errors import KeelError
from keel.platform import auto_dtype, export_isa_caps, probe
from keel.quant.loading import load_model
from keel.serve.engine import EngineConfig
from keel.serve.llm import LLM
from tiny_models import build_hf_model, save_byte_tokenizer, save_hf_model

pytestmark = pytest.mark.isa


def test_probe_agrees_with_torch():
    p = probe()
    assert p.aten_capability == torch.backends.cpu.get_cpu_capability()
    assert len(p.cuda_devices) == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    if p.arch == "x86_64":
        assert p.native_isa in platform.X86_LEVELS
        assert (p.native_isa != "default") == torch.cpu._is_avx2_supported()
        assert (platform.X86_LEVELS.index(p.native_isa) >= 2) == torch.cpu._is_avx512_supported()
        assert (p.native_isa in ("avx512_bf16", "amx")) == torch.cpu._is_avx512_bf16_supported()
    requested = platform.requested_isa()
    assert p.isa == (requested or p.native_isa) and p.forced == (p.isa != p.native_isa)
    if not p.forced:  # the features are the CPU's own
        assert p.onednn_bf16 == torch.ops.mkldnn._is_mkldnn_bf16_supported()


def test_forced_avx2_caps_every_feature(force_isa):
    p = force_isa("avx2")
    assert p.isa == "avx2" and p.avx2
    assert not (p.avx512 or p.vnni or p.avx512_bf16 or p.amx or p.onednn_bf16 or p.native_bf16_matmul)
    assert ("forced by KEEL_CPU_ISA" in p.describe()) == (p.native_isa != "avx2")
    assert platform.host() is p  # asked once, then remembered


def test_isa_override_errors_are_one_line(monkeypatch):
    monkeypatch.setenv("KEEL_CPU_ISA", "avx9000")
    with pytest.raises(KeelError, match=r"KEEL_CPU_ISA='avx9000': choose from native, ") as e:
        probe()
    assert "\n" not in str(e.value)
    if platform._arch() == "x86_64":
        monkeypatch.setattr(platform, "_native_level", lambda arch: "avx2")
        monkeypatch.setenv("KEEL_CPU_ISA", "avx512_bf16")
        with pytest.raises(KeelError, match="highest level is avx2; it can only be lowered"):
            probe()
    monkeypatch.setenv("KEEL_CPU_ISA", "native")
    assert platform.requested_isa() is None


def test_the_override_caps_torch_unless_the_user_did(monkeypatch):
    for var in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX")  # the user's own cap stays
    monkeypatch.delenv("KEEL_CPU_ISA", raising=False)
    export_isa_caps()
    assert "ATEN_CPU_CAPABILITY" not in os.environ
    if platform._arch() != "x86_64":
        return
    monkeypatch.setenv("KEEL_CPU_ISA", "avx2")
    export_isa_caps()
    assert os.environ["ATEN_CPU_CAPABILITY"] == "avx2"
    assert os.environ["ONEDNN_MAX_CPU_ISA"] == "AVX"
    assert os.environ["MKL_ENABLE_INSTRUCTIONS"] == "AVX2"


def test_generated_code_is_cached_apart_per_vector_isa(tmp_path):
    """Two processes on one machine, one with torch's kernels lowered to the portable level
    (ATEN_CPU_CAPABILITY=default, as make test's forced-AVX2 leg lowers them to AVX2): inductor's caches
    (keyed without the vector ISA its C++ was generated for) land in different directories under KEEL_CACHE."""
    code = (
        "from keel.paths import inductor_cache_dir; from keel.platform import host; "
        "print(inductor_cache_dir()); print(host().aten_capability)"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "KEEL_CPU_ISA")}
    env["KEEL_CACHE"] = str(tmp_path)
    runs = []
    for capability in (None, "default"):
        run_env = env if capability is None else {**env, "ATEN_CPU_CAPABILITY": capability}
        out = subprocess.run([sys.executable, "-c", code], env=run_env, capture_output=True, text=True, check=True)
        directory, aten = out.stdout.split()
        runs.append((Path(directory), aten))
    here = probe()  # the CPU's own level does not follow the caps
    for directory, aten in runs:
        assert directory == tmp_path / "inductor" / f"{here.arch}-{here.native_isa}-{aten.lower()}"
    assert runs[1][1] == "DEFAULT"
    assert (runs[0][1] == "DEFAULT") == (runs[0][0] == runs[1][0])


def _host(native_bf16: bool) -> platform.Platform:
    base = probe()
    return dataclasses.replace(base, arch="x86_64", avx512_bf16=native_bf16, amx=False, onednn_bf16=native_bf16)


@pytest.mark.parametrize(
    ("stored", "quantized", "native", "emulated"),
    [
        ("bfloat16", False, "bfloat16", "float32"),
        ("float16", False, "bfloat16", "float32"),  # no CPU has a fast float16 path
        ("float32", False, "float32", "float32"),  # bf16 would round the checkpoint
        (None, False, "bfloat16", "float32"),  # GGUF blocks
        ("float32", True, "bfloat16", "bfloat16"),  # the int kernels' fast path on every x86 CPU
    ],
)
def test_auto_dtype_by_host(stored, quantized, native, emulated):
    assert auto_dtype(stored, "cpu", quantized, _host(True))[0] == native
    dtype, why = auto_dtype(stored, "cpu", quantized, _host(False))
    assert dtype == emulated
    assert ("emulated" in why) == (emulated == "float32" and stored != "float32")
    assert auto_dtype(stored, "cuda", quantized, _host(False))[0] == (stored or "bfloat16")


def test_a_bf16_checkpoint_loads_in_float32_at_avx2(tmp_path, force_isa):
    build_hf_model("llama").to(torch.bfloat16).save_pretrained(tmp_path)
    force_isa("avx2")
    loaded = load_model(tmp_path, "auto")
    assert loaded.config.dtype == "bfloat16"
    assert loaded.model.dtype == torch.float32 and "emulated" in loaded.dtype_reason
    assert load_model(tmp_path, "bfloat16").model.dtype == torch.bfloat16  # asked for: honoured


def test_the_startup_line_names_the_backends(tmp_path, force_isa, caplog):
    save_hf_model("llama", tmp_path)
    save_byte_tokenizer(tmp_path)
    force_isa("avx2")
    with caplog.at_level(logging.INFO, logger="keel.serve"):
        llm = LLM(str(tmp_path), EngineConfig.of(quantize="int8", num_blocks=32, max_model_len=128))
    line = llm.engine.backends
    assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("backends: ")] == [f"backends: {line}"]
    assert line.startswith(f"platform {platform.host().arch} avx2")
    if kernels.enabled():  # keel's block kernels take any activations: float32, as for a float model at AVX2
        assert "compute float32 (auto: " in line
        assert "int8 keel block_linear (keel avx2), int8 activations + residual, float32 scales" in line
        assert "float32 MKL sgemm" in line or "float32 aten sgemm" in line  # the kept head
        assert "KV cache paged float32, attention kernels" in line and "decode eager" in line
        return
    assert "compute bfloat16 (auto: the int8/int4 kernels" in line
    assert "int8 aten _weight_int8pack_mm, bfloat16 activations" in line  # q/k/v, o, gate/up, down
    assert "bfloat16 aten (emulated); from 16 rows upcast to float32" in line  # the kept head: no oneDNN bf16 at AVX2
    assert "KV cache paged bfloat16, attention torch" in line and "decode eager" in line


def test_an_unrunnable_isa_is_one_line_at_the_cli(tmp_path, monkeypatch, capsys):
    save_hf_model("llama", tmp_path)
    save_byte_tokenizer(tmp_path)
    capsys.readouterr()  # the save's progress bars
    monkeypatch.setenv("KEEL_CPU_ISA", "pentium")
    platform.host.cache_clear()
    try:
        assert main(["generate", str(tmp_path), "--prompt", "hi", "--max-tokens", "2"]) == 1
    finally:
        monkeypatch.undo()
        platform.host.cache_clear()
    err = capsys.readouterr().err
    assert err.startswith("keel: error: KEEL_CPU_ISA='pentium'") and err.count("\n") == 1


def test_a_local_rank_beyond_the_nodes_gpus_is_one_line_naming_the_count():
    """keel.platform.local_rank_cuda: what training ranks and serving workers take as their GPU."""
    import torch

    from keel.platform import local_rank_cuda

    count = torch.cuda.device_count()
    want = rf"local rank {count} has no GPU: {count} CUDA device\(s\) visible on this node, one per local rank"
    want += r" \(a hint\)$"
    with pytest.raises(KeelError, match=want):
        local_rank_cuda(count, " (a hint)")
