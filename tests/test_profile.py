"""`keel profile decode`: the per-step split of decode and prefill on a tiny random Llama, through
the real engine and torch.profiler."""

from __future__ import annotations

import json

import pytest

from keel.cli import main
from keel.profile.decode import PARTS, profile_decode
from keel.profile.roofline import streamed_weight_bytes
from tiny_models import save_byte_tokenizer, save_hf_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("profile") / "llama"
    save_hf_model("llama", directory)
    save_byte_tokenizer(directory)
    return directory


@pytest.mark.parametrize("batch", [1, 3])
def test_profile_splits_the_step(model_dir, tmp_path, batch):
    trace = tmp_path / "trace.json"
    profile = profile_decode(str(model_dir), batch=batch, steps=4, prompt_tokens=8, prefill=24, trace=str(trace))
    decode, prefill = profile.decode, profile.prefill
    assert decode.batch == batch == decode.tokens_per_step and prefill.tokens_per_step == 24
    for step in (decode, prefill):
        assert set(step.parts_ms) == set(PARTS) and step.step_ms > 0
        # The model's parts ran and were seen; together with the overhead they make the step.
        for part in ("norms", "attention projections", "attention", "MLP / experts", "LM head", "KV writes"):
            assert step.parts_ms[part] > 0, (step.kind, part)
        assert sum(step.parts_ms.values()) + step.overhead_ms >= step.step_ms * 0.999
    assert decode.parts_ms["sampling"] > 0 and decode.parts_ms["scheduling"] > 0
    # Bytes: the weights once per step plus every sequence's cache.
    from keel.serve.engine import EngineConfig, LLMEngine

    weights = streamed_weight_bytes(LLMEngine(str(model_dir), EngineConfig.of(num_blocks=64, max_model_len=256)).model)
    assert decode.weight_bytes == weights and decode.kv_bytes > 0
    assert decode.bytes_per_step == decode.weight_bytes + decode.kv_bytes
    events = json.loads(trace.read_text())["traceEvents"]
    assert any(e.get("name", "").startswith("keel.part::MLP") for e in events)


def test_profile_cli(model_dir, tmp_path, capsys):
    out = tmp_path / "profile.json"
    # In-process (the CLI's own main), as test_profile_cli_errors_are_one_line below.
    args = ["--steps", "4", "--prompt-tokens", "8", "--prefill", "16", "--quantize", "int8", "--json", str(out)]
    capsys.readouterr()
    assert main(["profile", "decode", str(model_dir), *args]) == 0
    stdout = capsys.readouterr().out
    assert "decode: batch 1" in stdout and "prefill: batch 1, 16 token(s)" in stdout
    assert "Python / dispatch overhead" in stdout and "roofline" in stdout
    profile = json.loads(out.read_text())
    assert profile["quantize"] == "int8" and profile["decode"]["tokens_per_s"] > 0


def test_profile_cli_errors_are_one_line(model_dir, tmp_path, capsys):
    # In-process (the CLI's own main): each error is keel's one line and exit 1.
    assert main(["profile", "decode", str(tmp_path / "missing")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("keel: error: ") and err.count("\n") == 1 and str(tmp_path / "missing") in err
    assert main(["profile", "decode", str(model_dir), "--batch", "0"]) == 1
    assert capsys.readouterr().err.strip() == "keel: error: --batch must be >= 1, got 0"
