"""`keel train` on one CUDA device: run by `bench/gpu_check.sh --train` on a lent GPU.

The trainer takes cuda:LOCAL_RANK wherever torch sees a GPU, so gpu_check also runs test_train_run.py's
single-process cases there; these add what only the device shows (the weights on it, the allocator's peaks,
CUDA's generator in a checkpoint, kernels whose summation order varies between runs, the profiler's kernels
and memory snapshot). Every path here runs on CPU in the default suite through the same Trainer
(test_train_run.py, test_train_sources.py). `KEEL_GPU_TESTS_ON_CPU=1` runs this file on the CPU with the
device-only assertions left out: a check of the file itself before a device session spends minutes on it.
"""

from __future__ import annotations

import json
import os
import pickle

import pytest
import torch

from keel.train.checkpoint import latest_checkpoint
from keel.train.config import load_config
from keel.train.metrics import read_metrics
from keel.train.trainer import Trainer
from test_train_run import assert_fp16_scale_backs_off, config, keel_process, losses, make_train_root, run

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
pytestmark = pytest.mark.skipif(
    not CUDA and os.environ.get("KEEL_GPU_TESTS_ON_CPU") != "1", reason="needs a CUDA device (bench/gpu_check.sh)"
)

# ~4M parameters (16 MB in float32): large enough that the allocator's 512-byte rounding and the rotary
# tables are a small share of what start-up allocates.
WIDER = ["model.config.hidden_size=256", "model.config.intermediate_size=1024", "model.config.num_hidden_layers=4"]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return make_train_root(tmp_path_factory.mktemp("device-train"))


def test_the_weights_live_on_the_device_once_and_the_model_learns(root):
    trainer = Trainer(load_config(config(root, "device"), ["training.steps=30", "checkpoint.interval=0", *WIDER]))
    try:
        params = [p for m in trainer.modules for p in m.parameters()]
        assert {p.device.type for p in params} == {DEVICE}
        weights = sum(p.numel() * p.element_size() for p in params)
        result = trainer.run()
    finally:
        trainer.close()
    assert result.losses[30] < result.losses[1] - 0.5, result.losses
    records = [r for r in read_metrics(root / "runs/device/metrics.jsonl") if "loss" in r]
    start = records[0]["start_memory"]
    if CUDA:
        # Built on the meta device and materialised in place: start-up allocates the weights once (no whole
        # model built elsewhere and copied over), and the first step adds gradients, AdamW's two moments
        # and activations on top.
        assert weights <= start["startup_peak_bytes"] <= 1.15 * weights + 2**20, (start, weights)
        assert start["first_step_peak_bytes"] >= 4 * weights, (start, weights)
        assert records[-1]["peak_memory_bytes"] >= start["baseline_bytes"] + start["first_step_peak_bytes"]


def test_a_checkpoint_carries_the_devices_generator(root):
    trainer = Trainer(load_config(config(root, "device-rng"), ["training.steps=2"]))
    try:
        torch.manual_seed(3)
        if CUDA:
            torch.cuda.manual_seed_all(3)
        trainer.save(blocking=True)
        after_save = torch.rand(4, device=DEVICE).tolist()
        torch.manual_seed(9)
        if CUDA:
            torch.cuda.manual_seed_all(9)
        trainer._restore(latest_checkpoint(root / "runs/device-rng/checkpoints"))
        assert torch.rand(4, device=DEVICE).tolist() == after_save
    finally:
        trainer.close()


def test_a_deterministic_run_resumes_bit_for_bit(root):
    """run.deterministic, each run a `keel train` process of its own (cuBLAS reads its workspace setting when
    the process makes its first handle): stopped at step 6 and resumed, steps 7-12 repeat the straight run's
    losses exactly. A default run resumed the same way (in this process) matches to the last bits only where
    the device's kernels sum in varying order; how far it parts is printed for the record."""
    common = ["training.steps=12", "checkpoint.interval=6"]
    flags = [a for override in [*common, "run.deterministic=true"] for a in ("--set", override)]
    r = keel_process(config(root, "straight-det"), *flags)
    assert r.returncode == 0, r.stderr[-3000:]
    path = config(root, "resumed-det")
    r = keel_process(path, *flags, env={"KEEL_FAULTS": "stop@6"})
    assert r.returncode == 0, r.stderr[-3000:]
    r = keel_process(path, *flags)
    assert r.returncode == 0, r.stderr[-3000:]
    straight, resumed = losses(root / "runs/straight-det"), losses(root / "runs/resumed-det")
    assert sorted(resumed) == list(range(1, 13))
    assert [resumed[s] for s in range(7, 13)] == [straight[s] for s in range(7, 13)]

    _, plain = run(config(root, "straight-default"), *common)
    path = config(root, "resumed-default")
    _, first = run(path, *common, env={"KEEL_FAULTS": "stop@6"})
    assert first.stopped_by_signal and first.steps_done == 6
    _, again = run(path, *common)
    parted = max(abs(again.losses[s] - plain.losses[s]) / abs(plain.losses[s]) for s in range(7, 13))
    print(f"default kernels: a resumed run parts from the straight one by at most {parted:.2e} (relative)")
    assert parted < 1e-3


def test_fp16_loss_scaling_backs_off_on_the_device(root):
    assert_fp16_scale_backs_off(root, "device-fp16")  # torch's fp16 autocast and keel's scaler on CUDA


def test_compiled_blocks_train_like_eager_ones_on_the_device(root):
    """training.compile: inductor's kernels for the device (Triton on CUDA), float32, in a process of its own."""
    _, eager = run(config(root, "device-eager"), "training.steps=3", "checkpoint.interval=0")
    args = ["--set", "training.steps=3", "--set", "checkpoint.interval=0", "--set", "training.compile=true"]
    r = keel_process(config(root, "device-compiled"), *args, env={"TORCH_LOGS": "recompiles"}, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Recompiling" not in r.stderr
    compiled = losses(root / "runs/device-compiled")
    assert sorted(compiled) == [1, 2, 3]
    for step in (1, 2, 3):
        assert compiled[step] == pytest.approx(eager.losses[step], rel=1e-4), step


def test_the_profiler_records_device_kernels_and_the_allocators_history(root):
    run(config(root, "device-profiled"), "training.steps=3", "profile.steps=[2]", "checkpoint.interval=0")
    profile = root / "runs/device-profiled/profile"
    events = json.loads((profile / "trace-step-00000002-rank-0.json").read_text())["traceEvents"]
    assert "keel train step 2" in {e.get("name") for e in events}
    if CUDA:
        assert any(e.get("cat") == "kernel" for e in events)  # the step's CUDA kernels, not only host ops
        snapshot = pickle.loads((profile / "memory-rank-0.pickle").read_bytes())
        assert snapshot["segments"] and snapshot["device_traces"]
    else:
        assert not (profile / "memory-rank-0.pickle").exists()
