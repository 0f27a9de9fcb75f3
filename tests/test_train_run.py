"""`keel train` end to end on a tiny Llama: learning, checkpoints, exact resume, guards, fp16, faults.

Single-process runs go in-process (Trainer); distributed ones through `keel train --nproc 2`
(torchrun, gloo), as users run them: the CLI's launcher in this process, and the torchrun command it
execs as a child process (keel_train); runs that must be processes of their own, in one (keel_process).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch

from keel.cli import main
from keel.errors import KeelError
from keel.train.checkpoint import COMPLETE, latest_checkpoint
from keel.train.config import load_config
from keel.train.data import write_token_file
from keel.train.metrics import read_metrics
from keel.train.trainer import GuardStop, Trainer
from tiny_models import save_byte_tokenizer, save_hf_model

MODEL = """
[model]
tokenizer = "{tok}"
[model.config]
architectures = ["LlamaForCausalLM"]
vocab_size = 256
hidden_size = 32
intermediate_size = 64
num_hidden_layers = 2
num_attention_heads = 4
num_key_value_heads = 2
max_position_embeddings = 128
tie_word_embeddings = false
eos_token_id = 2
"""


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return make_train_root(tmp_path_factory.mktemp("train"))


def make_train_root(root: Path) -> Path:
    """The tiny HF Llama with its byte tokenizer (root/tok) and a learnable token file (root/data.bin)."""
    save_hf_model("llama", root / "tok")
    save_byte_tokenizer(root / "tok")
    rng = np.random.default_rng(0)
    words = [rng.integers(3, 250, size=int(rng.integers(2, 6))) for _ in range(40)]
    stream = np.concatenate([words[i] for i in rng.integers(0, 40, size=12000)])  # learnable: a 40-word language
    write_token_file(root / "data.bin", stream, vocab_size=256, eos_id=2)
    return root


def config(root: Path, name: str, extra: str = "") -> Path:
    text = (
        MODEL.format(tok=root / "tok")
        + f"""
[run]
name = "{name}"
dir = "{root}/runs/{{name}}"
[data]
path = "{root}/data.bin"
seq_len = 32
[training]
steps = 20
global_batch_size = 8
micro_batch_size = 4
[optimizer]
lr = 3e-3
[schedule]
warmup_steps = 2
[checkpoint]
interval = 10
keep = 5
async_save = false
[guard]
spike = "off"
[log]
progress = false
{extra}"""
    )
    path = root / f"{name}.toml"
    path.write_text(text)
    return path


def run(path: Path, *overrides: str, env: dict | None = None):
    old = dict(os.environ)
    os.environ.update(env or {})
    try:
        trainer = Trainer(load_config(path, overrides))
        try:
            return trainer, trainer.run()
        finally:
            trainer.close()
    finally:
        os.environ.clear()
        os.environ.update(old)


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r and r.get("applied")}


def test_learns_logs_and_checkpoints_a_loadable_model(root):
    from keel.quant.loading import load_model

    trainer, result = run(config(root, "learn"), "training.steps=40")
    first, last = result.losses[1], result.losses[40]
    assert last < first - 1.0, (first, last)
    records = read_metrics(root / "runs/learn/metrics.jsonl")
    step_records = [r for r in records if "loss" in r]
    assert [r["step"] for r in step_records] == list(range(1, 41))
    assert all(r["tokens_per_s"] > 0 and 0 < r["mfu"] < 1 and r["peak_memory_bytes"] > 0 for r in step_records)
    ckpt = latest_checkpoint(root / "runs/learn/checkpoints")
    assert ckpt.name == "step-00000040" and (ckpt / COMPLETE).exists() and (ckpt / "config.json").exists()
    assert sorted(p.name for p in (root / "runs/learn/checkpoints").iterdir()) == [
        "step-00000010",
        "step-00000020",
        "step-00000030",
        "step-00000040",
    ]
    # The checkpoint directory is a model: same logits as the trained module.
    loaded = load_model(ckpt, "float32")
    tokens = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        assert torch.equal(loaded.model(tokens), trainer.modules[0].cpu().eval()(tokens))  # trained on a GPU too
    assert loaded.tokenizer is not None


def test_a_checkpoint_converts_for_transformers_and_is_served(root, tmp_path):
    """Point 6 and "done when": `keel convert` of a training checkpoint loads in transformers with
    the trained module's logits, and `keel serve` serves the checkpoint directory itself."""
    import openai
    from transformers import AutoModelForCausalLM

    from keel.serve.openai.child import ServerProcess

    trainer, result = run(config(root, "deliver"), "training.steps=10")
    ckpt = latest_checkpoint(root / "runs/deliver/checkpoints")
    assert main(["convert", str(ckpt), str(tmp_path / "hf")]) == 0  # in-process: the CLI's own main
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    tokens = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        want = trainer.modules[0].eval()(tokens)
        torch.testing.assert_close(hf(tokens).logits, want, rtol=1e-4, atol=1e-4)
    server = ServerProcess(ckpt, "--served-model-name", "trained", "--threads", "1", log_path=tmp_path / "log")
    try:
        server.wait_ready()
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none")
        out = client.completions.create(model="trained", prompt=[5, 6, 7], max_tokens=4, temperature=0)
        assert out.usage.completion_tokens >= 1 and out.choices[0].finish_reason in ("stop", "length")
        # The served greedy token's logprob is the trained module's best next-token log-probability.
        with torch.no_grad():
            best = trainer.modules[0](torch.tensor([[5, 6, 7]]))[0, -1].log_softmax(-1).max().item()
        served = client.completions.create(model="trained", prompt=[5, 6, 7], max_tokens=1, temperature=0, logprobs=1)
        assert served.choices[0].logprobs.token_logprobs[0] == pytest.approx(best, abs=1e-3)
    finally:
        assert server.terminate() == 0, server.tail(40)


def test_exact_resume_single_process(root):
    _, straight = run(config(root, "straight"))
    path = config(root, "resumed")
    _, first = run(path, env={"KEEL_FAULTS": "stop@10"})  # as SIGTERM during step 10
    assert first.stopped_by_signal and first.steps_done == 10
    _, resumed = run(path)  # resume = "auto": the checkpoint written at the stop
    assert sorted(resumed.losses) == list(range(11, 21))
    for step in range(11, 21):
        assert resumed.losses[step] == straight.losses[step], step  # bit-identical


def test_resuming_a_model_of_another_shape_is_one_line_and_writes_nothing(root):
    """A run whose config now builds another model than its checkpoints hold: a one-line error naming the field,
    before the run's config.toml is rewritten (it would describe a model its checkpoints do not hold)."""
    path = config(root, "reshaped")
    run(path, "training.steps=10")
    saved = (root / "runs/reshaped/config.toml").read_text()
    with pytest.raises(KeelError, match="hidden_size 32, the config builds 64"):
        Trainer(load_config(path, ["training.steps=20", "model.config.hidden_size=64"]))
    assert (root / "runs/reshaped/config.toml").read_text() == saved
    Trainer(load_config(path, ["model.config.hidden_size=64", "checkpoint.resume=none"])).close()  # a new start


def test_deterministic_kernels_for_the_run_only(root):
    """run.deterministic: torch's deterministic algorithms are on while the trainer lives (every training op
    has a deterministic CPU kernel: the run goes through) and off again after; a CPU run is deterministic
    already, so its losses are the default run's bit for bit (on a GPU, tests/test_cuda_train.py)."""
    _, plain = run(config(root, "nondet"), "training.steps=3", "checkpoint.interval=0")
    trainer = Trainer(
        load_config(config(root, "det"), ["training.steps=3", "checkpoint.interval=0", "run.deterministic=true"])
    )
    try:
        assert torch.are_deterministic_algorithms_enabled()
        result = trainer.run()
    finally:
        trainer.close()
    assert not torch.are_deterministic_algorithms_enabled()
    assert result.losses == plain.losses


def test_run_device_cpu_trains_on_the_cpu_and_cuda_without_a_gpu_is_one_line(root):
    trainer = Trainer(load_config(config(root, "on-cpu"), ["training.steps=1", "run.device=cpu"]))
    try:
        assert trainer.device.type == "cpu" and all(p.device.type == "cpu" for p in trainer.modules[0].parameters())
    finally:
        trainer.close()
    if not torch.cuda.is_available():
        with pytest.raises(KeelError, match='run.device = "cuda": torch sees no CUDA device'):
            Trainer(load_config(config(root, "on-cuda"), ["run.device=cuda"]))


def test_a_resume_follows_the_resumed_runs_schedule(root):
    """A checkpoint of a 3-step run resumed as a 6-step run: the learning rate of step 4 is the 6-step
    schedule's (the checkpoint's optimizer held the 3-step schedule's, its minimum)."""
    from keel.train.optim import lr_lambda

    run(config(root, "sched-short"), "training.steps=3", "checkpoint.interval=0")
    longer = load_config(config(root, "sched-long"), ["training.steps=6"])
    trainer = Trainer(longer)
    try:
        trainer._restore(latest_checkpoint(root / "runs/sched-short/checkpoints"))
        s = longer.schedule
        want = longer.optimizer.lr * lr_lambda(s.warmup_steps, 6, s.decay, s.min_lr_ratio)(3)
        assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(want, rel=1e-12)
        short = lr_lambda(s.warmup_steps, 3, s.decay, s.min_lr_ratio)(3)
        assert want != pytest.approx(longer.optimizer.lr * short)  # the two schedules differ there
    finally:
        trainer.close()


def test_checkpoints_carry_numpy_python_and_torch_rng_states(root):
    """A checkpoint restores NumPy's and Python's global generators as well as torch's: draws after a
    restore repeat the draws made after the save."""
    import random

    trainer = Trainer(load_config(config(root, "rng"), ["training.steps=2"]))
    try:
        np.random.seed(1), random.seed(2), torch.manual_seed(3)
        trainer.save(blocking=True)
        after_save = (np.random.random(), random.random(), torch.rand(1).item())
        np.random.seed(9), random.seed(9), torch.manual_seed(9)  # other states
        trainer._restore(latest_checkpoint(root / "runs/rng/checkpoints"))
        assert (np.random.random(), random.random(), torch.rand(1).item()) == after_save
    finally:
        trainer.close()


# In make test-slow (24 s on the 2-core AVX2 machine), to keep make test within its budget.
@pytest.mark.slow
def test_a_collective_that_waits_past_the_timeout_fails_the_run(root):
    """parallel.timeout_s reaches the process group: rank 1 hangs before step 3 (watchdog off), rank 0's
    next collective fails after the timeout instead of waiting for torch's default half hour."""
    path = config(root, "pg_timeout")
    args = ["--nproc", "2", "--set", "parallel.timeout_s=5.0", "--set", "watchdog.timeout_s=0.0"]
    r = keel_train(path, *args, env={"KEEL_FAULTS": "hang@3:1"}, timeout=120)
    assert r.returncode != 0
    assert "rank 1 hangs before step 3" in r.stdout + r.stderr
    assert "timed out" in (r.stdout + r.stderr).lower(), (r.stdout + r.stderr)[-3000:]


def test_profile_writes_a_chrome_trace_of_each_chosen_step(root):
    """[profile] steps = [2, 3]: a Chrome trace per traced step (and rank) under RUN/profile, holding the
    step's range and the operators it ran; no trace for the other steps."""
    import json

    run(config(root, "profiled"), "training.steps=4", "profile.steps=[3, 2]")
    traces = sorted(p.name for p in (root / "runs/profiled/profile").iterdir())
    assert traces == ["trace-step-00000002-rank-0.json", "trace-step-00000003-rank-0.json"]
    events = json.loads((root / "runs/profiled/profile" / traces[0]).read_text())["traceEvents"]
    names = {e.get("name") for e in events}
    assert "keel train step 2" in names and "keel train step 3" not in names
    assert any(str(n).startswith("aten::") for n in names)  # the step's operators


def test_guard_skips_nan_and_rolls_back_spike(root):
    guard = '[guard]\nnan = "skip"\nspike = "rollback"\nwarmup = 4\nspike_zscore = 4\ngrad_norm_zscore = 1000\n'
    path = config(root, "guard", guard)
    path.write_text(path.read_text().replace('[guard]\nspike = "off"\n', ""))
    _, result = run(path, "training.steps=16", "checkpoint.interval=5", env={"KEEL_FAULTS": "nan@3,spike@13:50"})
    kinds = [(e["kind"], e["action"], e["step"]) for e in result.events]
    assert ("nan_loss", "skip", 3) in kinds and ("loss_spike", "rollback", 13) in kinds
    records = read_metrics(root / "runs/guard/metrics.jsonl")
    assert any(r.get("rolled_back_to") == 10 for r in records)  # back to the step-10 checkpoint
    assert result.steps_done == 16 and all(np.isfinite(v) for s, v in result.losses.items() if s not in (3, 13))


def test_a_rollback_skips_the_batch_that_caused_the_spike(root):
    """A spike caused by its batch (KEEL_FAULTS bad_batch: it comes back whenever that batch is trained on):
    by default the rollback to step 10 skips the batches of steps 11-13, so the run goes on after one
    rollback; replaying them (skip_batches_after_rollback = 0) meets the spike again until the guard
    stops the run."""
    guard = '[guard]\nspike = "rollback"\nwarmup = 4\nspike_zscore = 4\ngrad_norm_zscore = 1000\nmax_rollbacks = 2\n'
    path = config(root, "bad_batch", guard)
    path.write_text(path.read_text().replace('[guard]\nspike = "off"\n', ""))
    env = {"KEEL_FAULTS": "bad_batch@13:50"}
    _, result = run(path, "training.steps=16", "checkpoint.interval=5", env=env)
    assert [(e["action"], e["step"]) for e in result.events] == [("rollback", 13)]
    assert result.steps_done == 16 and all(np.isfinite(v) for v in result.losses.values())
    replay = config(root, "bad_batch_replayed", guard)
    replay.write_text(replay.read_text().replace('[guard]\nspike = "off"\n', ""))
    with pytest.raises(GuardStop, match="max_rollbacks"):
        run(replay, "training.steps=16", "checkpoint.interval=5", "guard.skip_batches_after_rollback=0", env=env)


def test_skipped_steps_in_a_row_roll_back_then_stop_naming_them(root):
    """NaN losses at every step from 11 (each injected once; the guard skips them): the fifth in a row
    escalates to a rollback to step 10; after it the NaNs go on (steps 16-20), and that run of five skips
    stops the run with a message naming the steps."""
    path = config(root, "escalate")
    nans = ",".join(f"nan@{s}" for s in range(11, 30))
    with pytest.raises(GuardStop, match=r"5 skipped steps in a row \(\d+, \d+, \d+, \d+, \d+\)"):
        run(path, "training.steps=30", "checkpoint.interval=10", env={"KEEL_FAULTS": nans})
    records = read_metrics(root / "runs/escalate/metrics.jsonl")
    assert any(r.get("rolled_back_to") == 10 for r in records)


def assert_fp16_scale_backs_off(root: Path, name: str) -> Path:
    """A 10-step fp16 run of config `name` from a loss scale of 2**28, which overflows fp16 gradients at
    once: the scale drops, a few back-offs later the steps apply, and the loss falls. The config's path."""
    path = config(root, name)
    _, result = run(path, "training.precision=fp16", "training.init_scale=268435456.0", "training.steps=10")
    records = [r for r in read_metrics(root / "runs" / name / "metrics.jsonl") if "loss" in r]
    overflows = [r for r in records if r.get("overflow")]
    assert overflows and records[0]["loss_scale"] < 2**28  # the scale dropped
    assert any(r["applied"] for r in records[len(overflows) :])  # then steps apply again
    assert result.losses[10] < result.losses[1]
    return path


def test_fp16_loss_scale_backs_off_and_training_goes_on(root):
    path = assert_fp16_scale_backs_off(root, "fp16")
    # The same on FSDP2-sharded gradients (2 ranks, fp16 compute copies, fp32 reductions): the
    # overflow is found in the global norm over both shards, so both ranks skip the same steps.
    r = keel_train(
        path,
        "--nproc",
        "2",
        "--set",
        "run.name=fp16-fsdp",
        "--set",
        "training.precision=fp16",
        "--set",
        "training.init_scale=268435456.0",
        "--set",
        "training.steps=16",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    sharded = [r for r in read_metrics(root / "runs/fp16-fsdp/metrics.jsonl") if "loss" in r]
    skipped = [r["step"] for r in sharded if r.get("overflow")]
    assert skipped == list(range(1, len(skipped) + 1)) and len(skipped) >= 6  # 2**28 down to <= 2**22
    assert sharded[-1]["loss_scale"] < 2**22 and all(r["applied"] for r in sharded[len(skipped) :])
    assert sharded[-1]["loss"] < sharded[0]["loss"] - 0.02


MOE_MODEL = """
[model]
tokenizer = "{tok}"
[model.config]
architectures = ["Qwen3MoeForCausalLM"]
vocab_size = 256
hidden_size = 32
intermediate_size = 64
moe_intermediate_size = 16
num_experts = 4
num_experts_per_tok = 2
num_hidden_layers = 2
num_attention_heads = 4
num_key_value_heads = 2
max_position_embeddings = 128
eos_token_id = 2
"""


def test_moe_training_logs_expert_load_drops_and_aux_losses(root, capsys, no_torchrun):
    from keel.train.plot import plot_run

    path = config(root, "moe", "[moe]\naux_loss_coef = 0.02\nz_loss_coef = 0.001\ncapacity_factor = 1.0\n")
    path.write_text(path.read_text().replace(MODEL.format(tok=root / "tok"), MOE_MODEL.format(tok=root / "tok")))
    _, result = run(path, "training.steps=6")
    assert result.losses[6] < result.losses[1]
    records = [r for r in read_metrics(root / "runs/moe/metrics.jsonl") if "loss" in r]
    slots = 8 * 32 * 2  # global batch x seq_len x top-k, over both micro-batches
    limit = math.ceil(1.0 * 4 * 32 * 2 / 4)  # per micro-batch forward: 4 sequences of 32 tokens
    for r in records:
        assert sorted(r["moe"]) == ["0", "1"]
        for layer in r["moe"].values():
            assert sum(layer["tokens_per_expert"]) == slots
            assert layer["max_over_mean"] >= 1.0
            # Dropped: at least the overflow of the step's total counts over two micro-batches' capacity.
            overflow = sum(max(0, c - 2 * limit) for c in layer["tokens_per_expert"])
            assert layer["dropped_fraction"] >= overflow / slots
        assert r["moe_load_balance_loss"] >= 1.0 - 1e-6 and r["moe_router_z_loss"] > 0
    assert any(r["moe_dropped_fraction"] > 0 for r in records)
    assert plot_run(root / "runs/moe").stat().st_size > 10_000
    # The aux-loss-free bias needs a router with a selection bias: Qwen3-MoE has none.
    assert "bias_update_rate" in refused(capsys, path, "--set", "moe.bias_update_rate=0.001")


# ---------------------------------------------------------------- distributed, through the CLI
def keel_process(path: Path, *args: str, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    """`keel train PATH ARGS` in a process of its own, exactly as a shell runs it."""
    cmd = [sys.executable, "-m", "keel.cli", "train", str(path), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})})


def keel_train(path: Path, *args: str, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    """`keel train PATH ARGS --nproc N` (N > 1) through the CLI's own main in this process: its checks, then
    the torchrun command that `keel` execs in its own place, run as a child process with this environment
    (and `env`). The same launch as in a shell, without starting one interpreter more per run."""
    launched: list[subprocess.CompletedProcess] = []

    def execv(executable: str, argv: list[str]) -> None:
        launched.append(subprocess.run(argv, executable=executable, capture_output=True, text=True, timeout=timeout))

    saved = dict(os.environ)  # the launcher sets OMP_NUM_THREADS for the ranks: not for later tests
    os.environ.update(env or {})
    try:
        with mock.patch.object(os, "execv", execv):
            code = main(["train", str(path), *args])
    finally:
        os.environ.clear()
        os.environ.update(saved)
    assert launched, f"keel train {path} {args} returned {code} without starting torchrun"
    return launched[0]


@pytest.fixture
def no_torchrun(monkeypatch):
    forbid_exec(monkeypatch)


def forbid_exec(monkeypatch) -> None:
    """For `keel train` run in this process (the CLI's own main) on configs it must refuse: the launcher
    execs torchrun once its checks pass, which here would replace the pytest process; fail instead."""

    def execv(*args):
        raise AssertionError(f"keel train got past its checks and would exec {args}")

    monkeypatch.setattr(os, "execv", execv)


def refused(capsys, path: Path, *args: str) -> str:
    """`keel train PATH ARGS` in this process (needs no_torchrun): exit 1 and one `keel: error:` line,
    checked before any process starts (the same in a shell: test_bad_configs_fail_before_any_process_starts)."""
    capsys.readouterr()
    assert main(["train", str(path), *args]) == 1, args
    err = capsys.readouterr().err
    assert err.startswith("keel: error:") and err.count("\n") == 1, (args, err)
    return err


@pytest.mark.parametrize(
    ("layout", "logged"),
    [
        # tensor parallel with sequence parallelism (the default), dp 1
        (["parallel.tp=2"], "dp_replicate=1 dp_shard=1 tp=2"),
        # HSDP 2 x 1: replicated, unsharded
        (["parallel.dp_replicate=2", "parallel.dp_shard=1"], "dp_replicate=2 dp_shard=1 tp=1"),
    ],
    ids=["tp2-sp", "hsdp2x1"],
)
def test_the_trainer_end_to_end_on_other_layouts_matches_one_process(root, layout, logged):
    """`keel train --nproc 2` with tensor parallelism (+SP) or HSDP gives the one-process losses, step for
    step (other reduction orders: float32 rounding, within 1e-5 relative over 6 steps)."""
    name = "layout-" + "-".join(x.split("=")[0].split(".")[1] + x.split("=")[1] for x in layout)
    _, single = run(config(root, name + "-single"), "training.steps=6", "checkpoint.interval=0")
    args = ["--set", "training.steps=6", "--set", "checkpoint.interval=0"]
    r = keel_train(config(root, name), "--nproc", "2", *args, *(a for x in layout for a in ("--set", x)))
    assert r.returncode == 0, r.stderr[-3000:]
    assert logged in r.stderr  # the start-up line: the layout the ranks ran
    two = losses(root / f"runs/{name}")
    assert sorted(two) == list(range(1, 7))
    for step in range(1, 7):
        assert two[step] == pytest.approx(single.losses[step], rel=1e-5), step


@pytest.mark.slow
def test_the_trainer_at_world_8_with_pp_dp_and_tp_matches_one_process(root):
    """pp = 2 x dp_shard = 2 x tp = 2 (+SP) over 8 ranks, end to end: one process's losses (1e-5 relative)."""
    _, single = run(config(root, "w8-single"), "training.steps=4", "checkpoint.interval=0")
    layout = ["parallel.pp=2", "parallel.dp_shard=2", "parallel.tp=2"]
    args = ["--set", "training.steps=4", "--set", "checkpoint.interval=0", *(a for x in layout for a in ("--set", x))]
    r = keel_train(config(root, "w8"), "--nproc", "8", *args, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "pp=2 dp_replicate=1 dp_shard=2 tp=2" in r.stderr
    eight = losses(root / "runs/w8")
    assert sorted(eight) == [1, 2, 3, 4]
    for step in range(1, 5):
        assert eight[step] == pytest.approx(single.losses[step], rel=1e-5), step


# In make test-slow (22 s on the 2-core AVX2 machine), to keep make test within its budget.
@pytest.mark.slow
def test_a_one_process_checkpoint_resumes_onto_more_ranks_and_another_layout(root):
    """A checkpoint written by one process (step 3 of 6) resumed by 2 ranks with tp = 2 (+SP): DCP reshards
    it, and steps 4-6 give the uninterrupted single-process run's losses (1e-5 relative)."""
    _, straight = run(config(root, "grow-straight"), "training.steps=6", "checkpoint.interval=0")
    # The same 6-step run (its LR schedule), stopped after step 3 as SIGTERM would stop it.
    run(config(root, "grow-first"), "training.steps=6", "checkpoint.interval=0", env={"KEEL_FAULTS": "stop@3"})
    first = latest_checkpoint(root / "runs/grow-first/checkpoints")
    assert first is not None and first.name == "step-00000003"
    args = ["--set", "training.steps=6", "--set", "checkpoint.interval=0", "--set", f"checkpoint.resume={first}"]
    r = keel_train(config(root, "grow"), "--nproc", "2", "--set", "parallel.tp=2", *args)
    assert r.returncode == 0, r.stderr[-3000:]
    resumed = losses(root / "runs/grow")
    assert sorted(resumed) == [4, 5, 6]
    for step in (4, 5, 6):
        assert resumed[step] == pytest.approx(straight.losses[step], rel=1e-5), step


# In make test-slow (21 s on the 2-core AVX2 machine), to keep make test within its budget.
@pytest.mark.slow
def test_a_pipeline_checkpoint_resumes_in_one_process(root):
    """A 2-stage pipeline's checkpoint (each rank holds its stage's layers, under the whole model's names)
    resumed by one process: steps 4-6 give the uninterrupted single-process run's losses."""
    _, straight = run(config(root, "pp-straight"), "training.steps=6", "checkpoint.interval=0")
    args = ["--set", "training.steps=6", "--set", "checkpoint.interval=0", "--set", "parallel.pp=2"]
    r = keel_train(config(root, "pp-first"), "--nproc", "2", *args, env={"KEEL_FAULTS": "stop@3"})
    assert r.returncode == 0, r.stderr[-3000:]
    first = latest_checkpoint(root / "runs/pp-first/checkpoints")
    assert first is not None and first.name == "step-00000003"
    _, resumed = run(config(root, "pp-resumed"), "training.steps=6", f"checkpoint.resume={first}")
    assert sorted(resumed.losses) == [4, 5, 6]
    for step in (4, 5, 6):
        assert resumed.losses[step] == pytest.approx(straight.losses[step], rel=1e-5), step


# In `make test-slow` (the default suite's budget): resuming onto other layouts and crash recovery have their own tests.
@pytest.mark.slow
def test_fsdp_parity_resume_across_layouts_and_crash_recovery(root):
    _, single = run(config(root, "single"))
    # FSDP over 2 ranks: the single-process curve (async checkpoints on their own gloo group).
    fsdp = config(root, "fsdp")
    r = keel_train(fsdp, "--nproc", "2", "--set", "checkpoint.async_save=true")
    assert r.returncode == 0, r.stderr[-3000:]
    two = losses(root / "runs/fsdp")
    assert sorted(two) == list(range(1, 21))
    for step in range(1, 21):
        assert two[step] == pytest.approx(single.losses[step], rel=1e-5, abs=1e-6), step
    # Resume the 2-rank run's step-10 checkpoint in one process (another layout): within 1e-5.
    other = config(root, "relayout")
    _, resumed = run(other, f"checkpoint.resume={root}/runs/fsdp/checkpoints/step-00000010")
    for step in range(11, 21):
        assert resumed.losses[step] == pytest.approx(two[step], abs=1e-5), step
    # Kill rank 1 before step 13 under --max-restarts=1: torchrun restarts both ranks, they resume
    # from step 10 and end where the uninterrupted run ended.
    crash = config(root, "crash")
    r = keel_train(crash, "--nproc", "2", "--max-restarts", "1", env={"KEEL_FAULTS": "crash@13:1"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "rank 1 crashes before step 13" in r.stdout + r.stderr
    assert losses(root / "runs/crash")[20] == pytest.approx(two[20], abs=1e-6)


def test_a_stop_on_one_rank_stops_every_rank_after_the_same_step(root):
    """SIGTERM reaching rank 1 alone (KEEL_FAULTS stop@7:1) during step 7 of a 2-rank FSDP run: the ranks
    agree at the step boundary, both stop after step 7, and the final checkpoint (committed before the
    validation pass) is step 7's; a run resumed from it goes on from step 8."""
    path = config(root, "stop1")
    args = ["--nproc", "2", "--set", "data.val_tokens=1200"]
    r = keel_train(path, *args, env={"KEEL_FAULTS": "stop@7:1"})
    assert r.returncode == 0, r.stderr[-3000:]
    records = read_metrics(root / "runs/stop1/metrics.jsonl")
    assert max(x["step"] for x in records if "loss" in x) == 7
    assert [x["step"] for x in records if "val_loss" in x] == [7]  # validated after the checkpoint
    latest = latest_checkpoint(root / "runs/stop1/checkpoints")
    assert latest is not None and latest.name == "step-00000007" and (latest / COMPLETE).exists()
    r = keel_train(path, *args, "--set", "training.steps=9")
    assert r.returncode == 0, r.stderr[-3000:]
    steps = [x["step"] for x in read_metrics(root / "runs/stop1/metrics.jsonl") if "loss" in x]
    assert steps[-2:] == [8, 9]


def test_an_async_checkpoint_is_committed_once_written(root):
    """Async saves over 2 ranks every 5 steps, rank 0 killed before step 8 (no restart): step 5's save,
    whose files were written while step 7 waited 3 s (`sleep@7:3`: time for the background write on a
    loaded machine), was committed at a step boundary, so it is the latest complete checkpoint
    (committed only when the next save started, a crash there lost it)."""
    path = config(root, "commit")
    r = keel_train(
        path,
        "--nproc",
        "2",
        "--set",
        "checkpoint.async_save=true",
        "--set",
        "checkpoint.interval=5",
        env={"KEEL_FAULTS": "sleep@7:3,crash@8:0"},
    )
    assert r.returncode != 0 and "rank 0 crashes before step 8" in r.stdout + r.stderr
    latest = latest_checkpoint(root / "runs/commit/checkpoints")
    assert latest is not None and latest.name == "step-00000005" and (latest / COMPLETE).exists()


# In `make test-slow` (the default suite's budget): pipeline losses are test_train_parallel's.
@pytest.mark.slow
def test_validation_loss_is_the_same_with_a_pipeline(root):
    """Held-out tokens (the tail of the file) are evaluated at the end; a 2-stage pipeline runs them
    through the schedule forward-only and reports the single-process value."""
    extra = ["data.val_tokens=1200", "training.steps=4", "checkpoint.interval=0"]
    run(config(root, "val1"), *extra)
    single = [r["val_loss"] for r in read_metrics(root / "runs/val1/metrics.jsonl") if "val_loss" in r]
    assert len(single) == 1 and 0 < single[0] < 10
    args = [a for x in extra for a in ("--set", x)]
    r = keel_train(config(root, "val2"), "--nproc", "2", "--set", "parallel.pp=2", *args)
    assert r.returncode == 0, r.stderr[-3000:]
    piped = [r["val_loss"] for r in read_metrics(root / "runs/val2/metrics.jsonl") if "val_loss" in r]
    assert piped == [pytest.approx(single[0], rel=1e-6)]


DEEPSEEK_MODEL = """
[model]
tokenizer = "{tok}"
[model.config]
architectures = ["DeepseekV3ForCausalLM"]
vocab_size = 256
hidden_size = 32
intermediate_size = 64
moe_intermediate_size = 16
n_routed_experts = 4
n_shared_experts = 1
num_experts_per_tok = 2
n_group = 2
topk_group = 1
first_k_dense_replace = 1
routed_scaling_factor = 2.5
q_lora_rank = 16
kv_lora_rank = 8
qk_nope_head_dim = 8
qk_rope_head_dim = 4
v_head_dim = 8
num_hidden_layers = 3
num_attention_heads = 4
num_key_value_heads = 4
max_position_embeddings = 128
eos_token_id = 2
"""


def test_deepseek_v3_trains_with_aux_loss_free_balancing_and_is_served(root, capsys, no_torchrun):
    """DeepSeek-V3 (MLA, sigmoid router, first layer dense) trains; the selection bias moves with the
    load and is saved with the model, so the checkpoint loads with the trained routing."""
    from keel.quant.loading import load_model

    def deepseek_config(name: str) -> Path:
        path = config(root, name, "[moe]\nbias_update_rate = 0.01\n")
        model = DEEPSEEK_MODEL.format(tok=root / "tok")
        path.write_text(path.read_text().replace(MODEL.format(tok=root / "tok"), model))
        return path

    path = deepseek_config("deepseek")
    _, result = run(path, "training.steps=12")
    assert result.losses[12] < result.losses[1]
    # One step: the bias moves by the rule, rate * sign(mean load - load), from the logged load.
    # (Seed 0 happens to route layer 1's tokens evenly over the two expert groups.)
    trainer, _ = run(deepseek_config("deepseek-1"), "training.steps=1", "run.seed=1")
    records = [r for r in read_metrics(root / "runs/deepseek-1/metrics.jsonl") if "loss" in r]
    assert sorted(records[0]["moe"]) == ["1", "2"]  # layer 0 is dense (first_k_dense_replace = 1)
    module = trainer.modules[0]
    for layer in ("1", "2"):
        load = torch.tensor(records[0]["moe"][layer]["tokens_per_expert"], dtype=torch.float32)
        assert load.max() > load.mean()  # not balanced already: the rule has something to do
        bias = module.layers[layer].mlp.router.e_score_correction_bias
        torch.testing.assert_close(bias, 0.01 * torch.sign(load.mean() - load))
    # The bias is part of the model: the checkpoint loads with it and routes the same.
    loaded = load_model(latest_checkpoint(root / "runs/deepseek-1/checkpoints"), "float32")
    for layer in ("1", "2"):
        torch.testing.assert_close(
            loaded.model.layers[layer].mlp.router.e_score_correction_bias,
            module.layers[layer].mlp.router.e_score_correction_bias,
        )
    tokens = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(tokens), module.eval()(tokens))


@pytest.mark.slow
def test_deepseek_v32_trains_with_its_indexer_frozen(root, no_torchrun):
    """DeepSeek Sparse Attention (index_topk 4 of 32 tokens) trains: the attention learns through the selection, the
    indexer (no gradients, as transformers computes it) keeps its initial weights, which the checkpoint holds."""
    from keel.quant.loading import load_model

    path = config(root, "dsa")
    model = DEEPSEEK_MODEL.format(tok=root / "tok").replace("DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM")
    model += "index_topk = 4\nindex_n_heads = 4\nindex_head_dim = 8\n"
    path.write_text(path.read_text().replace(MODEL.format(tok=root / "tok"), model))
    trainer = Trainer(load_config(path, ["training.steps=10"]))
    try:
        attention = trainer.modules[0].layers["1"].self_attn
        indexer = {k: v.detach().clone() for k, v in attention.indexer.state_dict().items()}
        q_b = attention.q_b_proj.weight.detach().clone()
        result = trainer.run()
    finally:
        trainer.close()
    assert result.losses[10] < result.losses[1]
    assert not torch.equal(attention.q_b_proj.weight, q_b)
    for key, value in attention.indexer.state_dict().items():
        torch.testing.assert_close(value, indexer[key], rtol=0, atol=0)
    loaded = load_model(latest_checkpoint(root / "runs/dsa/checkpoints"), "float32").model
    torch.testing.assert_close(loaded.layers["1"].self_attn.indexer.wk.weight, indexer["wk.weight"])


@pytest.mark.slow
@pytest.mark.parametrize("layout", [[], ["--set", "parallel.pp=2"]], ids=["fsdp2", "pp2"])
def test_deepseek_v32_trains_on_two_ranks_as_in_one_process(root, layout):
    """DSA through `keel train --nproc 2`: FSDP (the indexer's unused gradients) and two pipeline stages (each
    layer's selection its own) give the one-process losses."""
    model = DEEPSEEK_MODEL.format(tok=root / "tok").replace("DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM")
    model += "index_topk = 4\nindex_n_heads = 4\nindex_head_dim = 8\n"
    name = "dsa-two-" + ("pp" if layout else "fsdp")
    paths = [config(root, name + "-single"), config(root, name)]
    for path in paths:
        path.write_text(path.read_text().replace(MODEL.format(tok=root / "tok"), model))
    _, single = run(paths[0], "training.steps=4", "checkpoint.interval=0")
    args = ["--set", "training.steps=4", "--set", "checkpoint.interval=0", *layout]
    r = keel_train(paths[1], "--nproc", "2", *args)
    assert r.returncode == 0, r.stderr[-3000:]
    two = losses(root / f"runs/{name}")
    assert [two[step] for step in range(1, 5)] == pytest.approx([single.losses[step] for step in range(1, 5)], rel=1e-5)


# In make test-slow (21 s on the 2-core AVX2 machine), to keep make test within its budget.
@pytest.mark.slow
def test_expert_parallel_training_matches_one_process_and_reshards(root, capsys, no_torchrun):
    """ep = 2 through the CLI: the one-process losses; its checkpoint resumes in one process (experts
    gathered from their two ranks by DCP); bad ep settings are one-line errors."""

    def moe_config(name: str) -> Path:
        path = config(root, name, "[moe]\nz_loss_coef = 0.001\n")
        path.write_text(path.read_text().replace(MODEL.format(tok=root / "tok"), MOE_MODEL.format(tok=root / "tok")))
        return path

    _, single = run(moe_config("moe-single"), "training.steps=10", "checkpoint.interval=5")
    r = keel_train(
        moe_config("moe-ep"),
        "--nproc",
        "2",
        "--set",
        "parallel.ep=2",
        "--set",
        "training.steps=10",
        "--set",
        "checkpoint.interval=5",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    ep = losses(root / "runs/moe-ep")
    for step in range(1, 11):
        assert ep[step] == pytest.approx(single.losses[step], rel=1e-5, abs=1e-6), step
    _, resumed = run(
        moe_config("moe-relayout"),
        "training.steps=10",
        f"checkpoint.resume={root}/runs/moe-ep/checkpoints/step-00000005",
    )
    for step in range(6, 11):
        assert resumed.losses[step] == pytest.approx(ep[step], abs=1e-5), step
    bad = [
        (["--nproc", "2", "--set", "parallel.ep=3"], "ep = 3 must divide dp_shard = 2"),
        (["--nproc", "4", "--set", "parallel.ep=2", "--set", "parallel.tp=2"], "ep > 1 with tp > 1"),
    ]
    for args, expected in bad:
        assert expected in refused(capsys, moe_config("moe-bad"), *args)
    dense = config(root, "dense-ep")
    assert "needs a mixture-of-experts model" in refused(capsys, dense, "--nproc", "2", "--set", "parallel.ep=2")


# In make test-slow (19 s on the 2-core AVX2 machine), to keep make test within its budget.
@pytest.mark.slow
def test_crash_during_checkpoint_write_keeps_the_last_good_one(root):
    path = config(root, "torn")
    r = keel_train(
        path,
        "--nproc",
        "2",
        "--set",
        "checkpoint.interval=5",
        "--set",
        "training.steps=10",
        env={"KEEL_FAULTS": "crash_in_save@10:0"},
    )
    assert r.returncode != 0
    checkpoints = root / "runs/torn/checkpoints"
    assert latest_checkpoint(checkpoints).name == "step-00000005"
    assert (checkpoints / "step-00000010.tmp").is_dir() and not (checkpoints / "step-00000010").exists()
    _, resumed = run(path, "checkpoint.interval=5", "training.steps=10")  # resumes from step 5
    assert sorted(resumed.losses) == list(range(6, 11))


def test_bad_configs_fail_before_any_process_starts(root, capsys):
    path = config(root, "bad")
    bad_file = root / "bad-run-dir"
    bad_file.write_text("a file where the run directory should be")
    unprepared = root / "unprepared.bin"
    unprepared.write_bytes(b"\0" * 64)
    short = root / "short.bin"
    write_token_file(short, np.arange(3, 100), vocab_size=256, eos_id=2)
    short.write_bytes(short.read_bytes()[:-2])  # one token fewer than its sidecar says
    cases = [
        (["--set", "training.stpes=3"], "training.stpes"),
        (["--nproc", "4", "--set", "parallel.tp=3"], "world size 4"),
        (["--nproc", "4", "--set", "parallel.dp_shard=3"], "but the world size is 4"),
        (["--nproc", "2", "--set", "training.global_batch_size=6"], "not divisible"),
        # Data files and the run directory (keel.train.preflight), checked in the launching process:
        (["--nproc", "2", "--set", f"data.path={root}/missing.bin"], "missing.bin: no sidecar"),
        (["--nproc", "2", "--set", f"data.path={unprepared}"], "write the file with `keel data prepare`"),
        (["--nproc", "2", "--set", f"data.path={short}"], "truncated or rewritten; prepare it again"),
        (["--nproc", "2", "--set", "model.config.vocab_size=128"], "but the model's vocabulary has 128 entries"),
        (["--nproc", "2", "--set", f"run.dir={bad_file}"], "exists and is not a directory"),
        (["--nproc", "2", "--set", f"checkpoint.resume={root}"], "not a complete keel checkpoint directory"),
    ]
    for args, expected in cases:  # in this process: `keel train` stops before torchrun (or a rank) starts
        assert main(["train", str(path), *args]) == 1, args
        err = capsys.readouterr().err
        assert err.startswith("keel: error:") and expected in err and err.count("\n") == 1, (args, err)
    # ... and as a user runs it: one line, no traceback, no torchrun failure report.
    r = keel_process(path, "--nproc", "2", "--set", f"data.path={root}/missing.bin", timeout=60)
    assert r.returncode == 1 and r.stderr.startswith("keel: error:") and "missing.bin" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    unknown = root / "unknown.toml"
    unknown.write_text(path.read_text() + "\n[optimiser]\nlr = 1\n")
    assert main(["train", str(unknown)]) == 1
    err = capsys.readouterr().err
    assert "optimiser" in err and "optimizer" in err  # lists the valid keys


def test_the_launcher_checks_a_run_without_importing_torch(root):
    """`keel train --nproc N` validates the config, the data and the run directory, then execs torchrun: the
    launching process never imports torch (each rank does), so it adds no torch start-up to the run's."""
    path = config(root, "launcher")
    code = (
        "import os, sys\n"
        "from keel.cli import main\n"
        "os.execv = lambda exe, cmd: (print('torch' in sys.modules, 'torch.distributed.run' in cmd), sys.exit(0))\n"
        f"main(['train', {str(path)!r}, '--nproc', '2'])\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.split() == ["False", "True"], (r.stdout, r.stderr)


# In make test-slow (10 s on the 2-core AVX2 machine), to keep make test within its budget.
@pytest.mark.slow
def test_watchdog_dumps_stacks_and_exits_on_a_hang(root):
    path = config(root, "hang")
    # 5 s: under a loaded machine an earlier step took over 2 s and tripped it first
    r = keel_process(path, "--set", "watchdog.timeout_s=5", env={"KEEL_FAULTS": "hang@3:0"}, timeout=60)
    assert r.returncode == 3, r.stderr[-2000:]
    assert "watchdog: step 3 exceeded 5 s" in r.stderr and "Thread" in r.stderr  # every thread's stack


def test_plot_draws_loss_and_throughput(root, capsys):
    run(config(root, "plotted"), "training.steps=4")
    assert main(["train", "plot", str(root / "runs/plotted")]) == 0  # in-process: the CLI's own main
    png = root / "runs/plotted/curves.png"
    assert f"wrote {png}" in capsys.readouterr().out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert main(["train", "plot", str(root / "nowhere")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("keel: error:") and "no metrics file" in err and err.count("\n") == 1
