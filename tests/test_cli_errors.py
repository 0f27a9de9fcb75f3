"""Bad input through the real `keel` executable: one line naming the thing, non-zero exit, no traceback."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tiny_models import save_byte_tokenizer, save_hf_model

KEEL = [sys.executable, "-m", "keel"]


def run_keel(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*KEEL, *args], capture_output=True, text=True, timeout=300)


def assert_one_line_error(result: subprocess.CompletedProcess, *needles: str) -> None:
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("keel: error:")
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("err") / "llama"
    save_hf_model("llama", directory)
    save_byte_tokenizer(directory)
    return directory


def copy_of(tiny: Path, tmp_path: Path) -> Path:
    target = tmp_path / "model"
    shutil.copytree(tiny, target)
    return target


def test_missing_file():
    assert_one_line_error(run_keel("inspect", "/nonexistent/model-dir"), "/nonexistent/model-dir")


def test_truncated_safetensors(tiny, tmp_path):
    model = copy_of(tiny, tmp_path)
    weights = model / "model.safetensors"
    size = weights.stat().st_size
    with open(weights, "r+b") as f:
        f.truncate(size // 2)
    assert_one_line_error(run_keel("generate", str(model), "--prompt", "hi"), "model.safetensors")


def test_unknown_architecture(tiny, tmp_path):
    model = copy_of(tiny, tmp_path)
    config = json.loads((model / "config.json").read_text())
    config["architectures"] = ["DiffLlamaForCausalLM"]
    (model / "config.json").write_text(json.dumps(config))
    result = run_keel("inspect", str(model))
    assert_one_line_error(result, "DiffLlamaForCausalLM", "LlamaForCausalLM", "Qwen3MoeForCausalLM")


def test_tensor_of_wrong_shape(tiny, tmp_path):
    model = copy_of(tiny, tmp_path)
    tensors = load_file(model / "model.safetensors")
    tensors["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(48, 64)
    save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})
    result = run_keel("generate", str(model), "--prompt", "hi")
    assert_one_line_error(result, "model.layers.1.self_attn.k_proj.weight", "[48, 64]", "[32, 64]")


def test_gguf_of_unsupported_architecture(tmp_path):
    import gguf
    import numpy as np

    path = tmp_path / "t5.gguf"
    writer = gguf.GGUFWriter(str(path), "t5")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert_one_line_error(run_keel("inspect", str(path)), "t5.gguf", "unsupported GGUF architecture 't5'")


def test_prompt_longer_than_context(tiny, tmp_path):
    model = copy_of(tiny, tmp_path)
    config = json.loads((model / "config.json").read_text())
    config["max_position_embeddings"] = 32
    (model / "config.json").write_text(json.dumps(config))
    result = run_keel("generate", str(model), "--prompt", "x" * 40)
    assert_one_line_error(result, "40 tokens", "context is 32")


def test_bad_sampling_option(tiny):
    assert_one_line_error(run_keel("generate", str(tiny), "--prompt", "hi", "--top-p", "1.5"), "top_p")


def test_chat_without_template(tiny, tmp_path):
    model = copy_of(tiny, tmp_path)
    save_byte_tokenizer(model, chat_template=None)
    assert_one_line_error(run_keel("generate", str(model), "--chat", "--prompt", "hi"), "chat template")


def test_generate_streams_and_reports_speed(tiny):
    result = run_keel("generate", str(tiny), "--prompt", "hello", "--max-tokens", "5", "--ignore-eos")
    assert result.returncode == 0, result.stderr
    assert "generated 5 tokens" in result.stderr and "tok/s" in result.stderr


def test_bad_options_are_one_line(tiny):
    """argparse's errors and option values it takes but keel cannot run: one line each, not the usage block."""
    assert_one_line_error(run_keel("generate", str(tiny), "--max-tokens", "abc"), "--max-tokens", "abc")
    assert_one_line_error(run_keel("generate", str(tiny), "--threads", "-1"), "--threads")
    assert_one_line_error(run_keel("plan", "train", str(tiny), "--gpus", "8xH200", "--mfu", "0"), "--mfu")
    serve_plan = ("plan", "serve", str(tiny), "--gpus", "1xH100", "--context", "64")
    assert_one_line_error(run_keel(*serve_plan, "--batch", "4", "--request-rate", "2"), "--batch", "--request-rate")


def test_unwritable_output_and_malformed_inputs_are_one_line(tiny, tmp_path):
    blocker = tmp_path / "afile"
    blocker.write_text("a file where a directory should be")
    assert_one_line_error(run_keel("convert", str(tiny), str(blocker / "out")), "afile")
    assert not any(p.name.endswith(".tmp") for p in tmp_path.rglob("*"))  # nothing half-written left
    config = json.loads((tiny / "config.json").read_text())
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({**config, "rms_norm_eps": -1}))
    assert_one_line_error(
        run_keel("plan", "serve", str(bad / "config.json"), "--gpus", "1xH100", "--context", "64"), "rms_norm_eps"
    )
    (bad / "config.json").write_text(json.dumps({**config, "num_attention_heads": "nine"}))
    assert_one_line_error(
        run_keel("plan", "serve", str(bad / "config.json"), "--gpus", "1xH100", "--context", "64"),
        "config.json",
        "nine",
    )
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"not a gguf file at all" * 10)
    assert_one_line_error(run_keel("inspect", str(garbage)), "garbage.gguf")


def test_data_prepare_does_not_write_over_its_input(tiny, tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_text("Some text to tokenize.\n\nAnd a second paragraph.\n")
    before = text.read_bytes()
    result = run_keel("data", "prepare", str(text), "--tokenizer", str(tiny), "--out", str(text))
    assert_one_line_error(result, "corpus.txt", "--out")
    assert text.read_bytes() == before


def test_option_messages_name_the_option_given(tiny, tmp_path):
    assert_one_line_error(run_keel("generate", str(tiny), "--prompt", "hi", "--temperature", "nan"), "temperature")
    assert_one_line_error(run_keel("upcycle", str(tiny), str(tmp_path / "moe"), "--experts", "0"), "--experts")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("a short corpus of text for a short window. " * 8)
    # --context below the default stride: the stride follows it (no complaint about a stride never given)
    result = run_keel("eval", "ppl", str(tiny), "--corpus", str(corpus), "--context", "16", "--max-tokens", "64")
    assert result.returncode == 0 and "stride 16" in result.stdout, result.stderr
    assert_one_line_error(run_keel("eval", "run", str(tiny), "--ppl-corpus", str(tmp_path / "nope")), "--ppl-corpus")
