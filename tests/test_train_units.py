"""Single-process units of the trainer: optimizer groups, LR schedule, loss scaler, guard, MFU."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from keel.config import ModelConfig
from keel.train.guard import TrainingGuard
from keel.train.metrics import flops_per_token, measure_cpu_peak, read_metrics
from keel.train.optim import build_optimizer, build_scheduler, lr_lambda, param_groups
from keel.train.precision import DynamicLossScaler, clip_grad_norm_, global_grad_norm


def test_no_weight_decay_on_norms_and_biases():
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Embedding(10, 8))
    decay, no_decay = param_groups([model], 0.1)
    assert {p.ndim for p in decay["params"]} == {2} and len(decay["params"]) == 2
    assert {p.ndim for p in no_decay["params"]} == {1} and len(no_decay["params"]) == 3
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    opt = build_optimizer([model], 1e-3, (0.9, 0.95), 1e-8, 0.1)
    assert isinstance(opt, torch.optim.AdamW)


def test_warmup_cosine_schedule():
    f = lr_lambda(warmup_steps=10, total_steps=110, decay="cosine", min_lr_ratio=0.1)
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)
    assert f(10) == pytest.approx(1.0) and f(60) == pytest.approx(0.55) and f(110) == pytest.approx(0.1)
    assert all(f(s) >= f(s + 1) - 1e-12 for s in range(10, 120))
    lin = lr_lambda(0, 100, "linear", 0.0)
    assert lin(50) == pytest.approx(0.5) and lr_lambda(5, 100, "constant", 0.1)(80) == 1.0
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=2.0)
    sched = build_scheduler(opt, 10, 110, "cosine", 0.1)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.2)
    for _ in range(10):
        opt.step()
        sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(2.0)


def test_grad_norm_and_clipping_single_process():
    a, b = nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(2, 2))
    a.grad, b.grad = torch.tensor([3.0, 0.0, 0.0]), torch.tensor([[0.0, 4.0], [0.0, 0.0]])
    assert global_grad_norm([a, b]).item() == pytest.approx(5.0)
    norm = clip_grad_norm_([a, b], max_norm=1.0)
    assert norm.item() == pytest.approx(5.0)
    assert global_grad_norm([a, b]).item() == pytest.approx(1.0, rel=1e-4)
    a.grad[0] = float("inf")
    before = b.grad.clone()
    assert not math.isfinite(clip_grad_norm_([a, b], 1.0).item())
    assert torch.equal(b.grad, before)  # nothing scaled on overflow


def test_loss_scaler_backs_off_and_grows():
    s = DynamicLossScaler(init_scale=1024, growth_factor=2, backoff_factor=0.5, growth_interval=3)
    assert s.scale_loss(torch.tensor(1.0)).item() == 1024
    s.update(found_inf=True)
    assert s.scale == 512 and s.overflows == 1
    for _ in range(3):
        s.update(found_inf=False)
    assert s.scale == 1024
    p = nn.Parameter(torch.zeros(2))
    p.grad = torch.tensor([1024.0, 2048.0])
    s.unscale_([p])
    assert p.grad.tolist() == [1.0, 2.0]
    restored = DynamicLossScaler()
    restored.load_state_dict(s.state_dict())
    assert restored.scale == s.scale and restored.clean_steps == s.clean_steps
    assert DynamicLossScaler(enabled=False).scale_loss(torch.tensor(3.0)).item() == 3.0


def test_guard_nan_and_spikes():
    g = TrainingGuard(nan="rollback", spike="skip", spike_zscore=4, grad_norm_zscore=4, window=20, warmup=10)
    for i in range(12):
        loss = 3.0 - 0.01 * i + 0.005 * (-1) ** i
        assert g.check(i, loss, 1.0 + 0.01 * (-1) ** i) is None
        g.accept(loss, 1.0 + 0.01 * (-1) ** i)
    e = g.check(12, float("nan"), 1.0)
    assert e.kind == "nan_loss" and e.action == "rollback"
    e = g.check(13, 2.9, float("inf"))
    assert e.kind == "nan_grad"
    e = g.check(14, 9.0, 1.0)
    assert e.kind == "loss_spike" and e.action == "skip" and e.zscore > 4
    e = g.check(15, 2.88, 50.0)
    assert e.kind == "grad_spike"
    assert g.check(16, 2.87, 1.0) is None
    assert len(g.events) == 4 and "loss_spike" in g.events[2].describe()
    restored = TrainingGuard(window=20)
    restored.load_state_dict(g.state_dict())
    assert list(restored.losses) == list(g.losses)
    off = TrainingGuard(spike="off", warmup=0)
    off.accept(1.0, 1.0)
    assert off.check(1, 100.0, 1.0) is None


def test_a_run_of_skipped_steps_escalates_to_a_rollback_then_a_stop():
    g = TrainingGuard(nan="skip", warmup=0, escalate_after=3)
    actions = [g.check(step, float("nan"), 1.0).action for step in (1, 2, 3)]
    assert actions == ["skip", "skip", "rollback"] and g.events[-1].skipped == [1, 2, 3]
    g.load_state_dict(g.state_dict())  # the rollback's restore: a new run of skips starts
    assert g.check(4, float("nan"), 1.0).action == "skip"
    g.accept(2.0, 1.0)  # an applied step ends the run
    assert [g.check(s, float("nan"), 1.0).action for s in (5, 6)] == ["skip", "skip"]
    last = g.check(7, float("nan"), 1.0)
    assert last.action == "stop" and "3 skipped steps in a row (5, 6, 7)" in last.describe()
    never = TrainingGuard(nan="skip", warmup=0, escalate_after=0)
    assert all(never.check(s, float("nan"), 1.0).action == "skip" for s in range(20))


def test_the_watchdog_runs_its_dump_hook_before_it_exits():
    """StepWatchdog's on_fire (the NCCL flight recorder's dump in a GPU run) runs after the stacks and before
    the exit; a hook that raises still lets the process exit with the watchdog's code."""
    import subprocess
    import sys

    script = (
        "import time\n"
        "from keel.train.watchdog import StepWatchdog\n"
        "def hook():\n"
        "    print('hook ran', flush=True)\n"
        "    raise RuntimeError('no recorder')\n"
        "w = StepWatchdog(0.4, hook)\n"
        "w.step_started(7)\n"
        "time.sleep(30)\n"
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert r.returncode == 3 and "hook ran" in r.stdout
    assert "watchdog: step 7 exceeded" in r.stderr and "the dump failed: no recorder" in r.stderr


def test_flight_recorder_environment_points_into_the_run(tmp_path):
    from keel.train import flight_recorder

    env = flight_recorder.environment(tmp_path, 500)
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1" and env["TORCH_FR_BUFFER_SIZE"] == "500"
    assert env["TORCH_FR_DUMP_TEMP_FILE"] == str(tmp_path / "flight_recorder" / "rank_")
    assert (tmp_path / "flight_recorder").is_dir()  # NCCL's dump opens rank_N there and does not make the directory


def test_flops_per_token_and_peak(tmp_path):
    cfg = ModelConfig.from_hf(
        {
            "architectures": ["LlamaForCausalLM"],
            "hidden_size": 768,
            "intermediate_size": 2048,
            "num_hidden_layers": 12,
            "num_attention_heads": 12,
            "num_key_value_heads": 12,
            "vocab_size": 32000,
            "tie_word_embeddings": False,
        }
    )
    non_embedding = 12 * (4 * 768 * 768 + 3 * 768 * 2048 + 2 * 768) + 768
    expected = 6 * (non_embedding + 32000 * 768) + 12 * 12 * 768 * 256
    assert flops_per_token(cfg, 256) == pytest.approx(expected)
    assert measure_cpu_peak(torch.float32, max_size=256, seconds=0.05) > 1e8
    (tmp_path / "m.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo')  # a torn last line
    assert read_metrics(tmp_path / "m.jsonl") == [{"step": 1, "loss": 2.0}]


def test_gpu_peaks_are_the_datasheets_float32_not_tf32(monkeypatch):
    """keel leaves float32 products in full precision on CUDA: an fp32 run's MFU is against the IEEE float32
    peak (TF32's is ~7x higher on an H100); a GPU without that figure gets none rather than a wrong one."""
    from keel.train import metrics

    name = {"value": "NVIDIA H100 80GB HBM3"}
    monkeypatch.setattr(metrics.torch.cuda, "get_device_name", lambda device=None: name["value"])
    cuda = torch.device("cuda", 0)
    assert metrics.peak_flops(cuda, "fp32")[0] == 67e12 and metrics.peak_flops(cuda, "bf16")[0] == 989e12
    name["value"] = "NVIDIA B200"
    peak, source = metrics.peak_flops(cuda, "fp32")
    assert peak == 0.0 and "MFU not computed" in source and metrics.peak_flops(cuda, "bf16")[0] == 2250e12


def test_the_cpu_peak_is_measured_once_per_machine_dtype_and_thread_count(tmp_path, monkeypatch):
    from keel.train import metrics

    monkeypatch.setenv("KEEL_CACHE", str(tmp_path))
    measured: list[torch.dtype] = []
    monkeypatch.setattr(metrics, "measure_cpu_peak", lambda dtype: measured.append(dtype) or 1e9 * len(measured))
    cpu = torch.device("cpu")
    first, source = metrics.peak_flops(cpu, "fp32")
    assert first == 1e9 and "kept in" not in source and measured == [torch.float32]
    assert metrics.peak_flops(cpu, "fp32") == (1e9, f"{source}, kept in {tmp_path / 'cpu_peak_flops.json'}")
    assert metrics.peak_flops(cpu, "bf16")[0] == 2e9 and measured == [torch.float32, torch.bfloat16]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        assert metrics.peak_flops(cpu, "fp32")[0] == 3e9  # another thread count: measured again
    finally:
        torch.set_num_threads(threads)
    assert metrics.peak_flops(cpu, "fp32")[0] == 1e9 and len(measured) == 3
    (tmp_path / "cpu_peak_flops.json").write_text('{"torn')  # unreadable: measured again and rewritten
    assert metrics.peak_flops(cpu, "fp32")[0] == 4e9 and metrics.peak_flops(cpu, "fp32")[0] == 4e9


@pytest.mark.parametrize(
    ("name", "worlds"),
    [
        ("tiny-shakespeare", [1, 2]),
        ("smollm2-continue", [1, 2]),
        ("smollm2-finetune", [2]),
        ("llama3-8b-8gpu", [8]),
        ("llama3-70b-64gpu", [64]),
    ],
)
def test_recipes_validate_at_their_scale(name, worlds):
    from pathlib import Path

    from keel.train.config import load_config, resolve_layout

    cfg = load_config(Path(__file__).parent.parent / "configs" / f"{name}.toml")
    for world in worlds:
        layout = resolve_layout(cfg, world)
        assert layout.world_size == world and layout.grad_accum >= 1
