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
    config["architectures"] = ["GPT2LMHeadModel"]
    (model / "config.json").write_text(json.dumps(config))
    result = run_keel("inspect", str(model))
    assert_one_line_error(result, "GPT2LMHeadModel", "LlamaForCausalLM", "Qwen3MoeForCausalLM")


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

    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert_one_line_error(run_keel("inspect", str(path)), "gpt2.gguf", "gpt2")


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
