"""[log] tensorboard / wandb: the records of metrics.jsonl as tracker scalars, written by rank 0."""

from __future__ import annotations

import importlib.machinery
import math
import sys
import types
from pathlib import Path

import pytest

from keel.train.metrics import read_metrics
from keel.train.trackers import scalars
from test_train_run import config, make_train_root, refused, run


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return make_train_root(tmp_path_factory.mktemp("trackers"))


def test_tensorboard_event_files_hold_the_jsonl_records(root):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run(
        config(root, "tb"),
        "training.steps=4",
        "data.val_tokens=256",
        "checkpoint.interval=2",
        "log.tensorboard=true",
    )
    records = read_metrics(root / "runs/tb/metrics.jsonl")
    events = EventAccumulator(str(root / "runs/tb/tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"loss", "grad_norm", "lr", "tokens_per_s", "val_loss"} <= tags, tags
    for tag in ("loss", "grad_norm", "lr", "val_loss"):
        expected = [(r["step"], r[tag]) for r in records if tag in r]
        logged = [(e.step, e.value) for e in events.Scalars(tag)]
        assert len(logged) == len(expected) and expected, (tag, logged, expected)
        for (step, value), (want_step, want) in zip(logged, expected, strict=True):
            assert step == want_step and value == pytest.approx(want, rel=1e-6), tag
    nested = [t for t in tags if t.startswith("start_memory/")]
    assert nested, tags  # a dict field's numbers, one level down


def test_scalars_keep_numbers_and_leave_flags_and_text():
    record = {"step": 3, "loss": 2.5, "applied": True, "guard": {"kind": "nan_loss", "value": math.nan}, "n": 4}
    assert set(scalars(record)) == {"loss", "n", "guard/value"}


def test_wandb_run_gets_every_logged_record(root, monkeypatch):
    """W&B is not a dependency of keel: this stands a recording module in its place to check what keel sends."""
    calls: dict[str, list] = {"init": [], "log": [], "finish": []}

    class FakeRun:
        def log(self, values, step):
            calls["log"].append((step, dict(values)))

        def finish(self):
            calls["finish"].append(True)

    fake = types.ModuleType("wandb")
    fake.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
    fake.init = lambda **kwargs: calls["init"].append(kwargs) or FakeRun()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setenv("WANDB_PROJECT", "keel-tests")
    run(config(root, "wb"), "training.steps=3", "checkpoint.interval=0", "log.wandb=true")
    (init,) = calls["init"]
    assert init["project"] == "keel-tests" and init["name"] == "wb" and init["config"]["training"]["steps"] == 3
    losses = [(r["step"], r["loss"]) for r in read_metrics(root / "runs/wb/metrics.jsonl") if "loss" in r]
    assert [(step, values["loss"]) for step, values in calls["log"]] == losses
    assert calls["finish"] == [True]


@pytest.mark.parametrize("tracker", ["tensorboard", "wandb"])
def test_a_missing_tracker_package_is_refused_before_the_run(root, tracker, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, tracker, None)  # as if not installed, whatever this machine has
    err = refused(capsys, config(root, "refused"), "--set", f"log.{tracker}=true")
    assert f"log.{tracker}" in err and "not installed" in err, err
    assert not Path(root / "runs/refused").exists()
