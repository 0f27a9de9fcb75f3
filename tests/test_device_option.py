"""--device (keel.platform.resolve_device): auto, cpu, cuda and cuda:N; where CUDA is asked for and absent,
one line naming what is missing; the option on keel.LLM and on generate, eval and serve."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from keel import platform
from keel.errors import KeelError
from keel.platform import resolve_device
from keel.quant.loading import load_model
from keel.serve.llm import LLM
from test_cli_errors import assert_one_line_error, run_keel
from tiny_models import save_byte_tokenizer, save_hf_model


def _with_gpus(*names: str) -> platform.Platform:
    return dataclasses.replace(platform.probe(), cuda_devices=names)


def test_auto_takes_the_first_gpu_where_one_is_visible():
    assert resolve_device("auto", _with_gpus()) == torch.device("cpu")
    assert resolve_device(None, _with_gpus()) == torch.device("cpu")
    assert resolve_device("auto", _with_gpus("NVIDIA H200")) == torch.device("cuda", 0)


def test_cpu_cuda_and_device_indices():
    two = _with_gpus("NVIDIA H200", "NVIDIA H200")
    assert resolve_device("cpu", two) == torch.device("cpu")
    assert resolve_device("CUDA", two) == torch.device("cuda", 0)
    assert resolve_device("cuda:1", two) == torch.device("cuda", 1)
    with pytest.raises(KeelError, match=r"--device cuda:2: 2 CUDA device\(s\) visible here \(cuda:0..cuda:1\)"):
        resolve_device("cuda:2", two)


@pytest.mark.parametrize("spec", ["gpu", "cuda:x", "cuda:", "cuda:-1", "mps"])
def test_other_devices_are_refused_by_name(spec):
    with pytest.raises(KeelError, match="expected auto, cpu, cuda or cuda:N"):
        resolve_device(spec, _with_gpus("NVIDIA H200"))


def test_cuda_without_a_gpu_says_what_is_missing(monkeypatch):
    none = _with_gpus()
    monkeypatch.setattr(torch.version, "cuda", None)
    with pytest.raises(KeelError, match=r"--device cuda: this torch \(.*\) is a CPU build, without CUDA"):
        resolve_device("cuda", none)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(KeelError, match=r"built for CUDA 13.0 but sees no GPU \(CUDA_VISIBLE_DEVICES=''\)"):
        resolve_device("cuda:0", none)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    directory = tmp_path_factory.mktemp("device") / "llama"
    save_hf_model("llama", directory)
    save_byte_tokenizer(directory)
    return directory


def test_the_engine_runs_where_the_option_says(tiny):
    llm = LLM(str(tiny), device="cpu", num_blocks=16, max_model_len=64, compile=False)
    assert llm.engine.device_type == "cpu"
    assert llm.engine.config.load.device == "cpu"  # keel.LLM routes the option into the config
    default = LLM(str(tiny), num_blocks=16, max_model_len=64, compile=False)  # auto
    assert default.engine.device_type == ("cuda" if platform.host().cuda_devices else "cpu")
    if not platform.host().cuda_devices:
        with pytest.raises(KeelError, match="--device cuda: "):
            LLM(str(tiny), num_blocks=16, max_model_len=64, compile=False, device="cuda")


def test_a_callers_model_is_served_where_it_lies_or_the_device_is_refused(tiny):
    """A LoadedModel the engine does not adapt is served on its own device: a different device asked for
    is refused by name rather than dropped; with adapt=True the engine moves the model."""
    loaded = load_model(str(tiny), "float32")
    assert LLM(loaded, num_blocks=16, max_model_len=64, compile=False).engine.device_type == "cpu"
    assert LLM(loaded, num_blocks=16, max_model_len=64, compile=False, device="cpu").engine.device_type == "cpu"
    meta = load_model(str(tiny), "float32")
    meta.model.to("meta")
    with pytest.raises(KeelError, match="--device cpu: the model given was loaded on meta"):
        LLM(meta, num_blocks=16, max_model_len=64, compile=False, device="cpu")


@pytest.mark.skipif(bool(platform.host().cuda_devices), reason="asks for CUDA where none is visible")
@pytest.mark.parametrize(
    "command", [["generate", "{model}", "--prompt", "hi"], ["eval", "run", "{model}"], ["serve", "{model}"]]
)
def test_cli_device_cuda_without_a_gpu_is_one_line(tiny, command):
    args = [part.format(model=tiny) for part in command]
    assert_one_line_error(run_keel(*args, "--device", "cuda"), "--device cuda: ")
