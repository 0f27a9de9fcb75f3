"""Where a run's model comes from and how it runs, end to end through `keel train`: built on the meta device
with only each rank's shards (start-up memory), a seed checkpoint, an HF or keel checkpoint as the source
read shard by shard, the HF export, compiled blocks. Shares test_train_run.py's tiny model, data and
helpers (the data are built again here, so that the two files run in parallel)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from keel.cli import main
from keel.train.checkpoint import COMPLETE, latest_checkpoint
from keel.train.config import load_config
from keel.train.metrics import read_metrics
from keel.train.trainer import Trainer
from test_train_run import config, forbid_exec, keel_process, keel_train, losses, make_train_root, refused, run


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return make_train_root(tmp_path_factory.mktemp("sources"))


@pytest.fixture
def no_torchrun(monkeypatch):
    forbid_exec(monkeypatch)


# In make test-slow (29 s on the 2-core AVX2 machine), to keep make test within its budget.
@pytest.mark.slow
def test_fsdp_ranks_never_hold_the_whole_model(root):
    """A model built on the meta device and sharded before it holds any data: under FSDP over 2 ranks each
    rank's resident set grows by its half of the weights during start-up, never by the whole model
    (66M parameters, 252 MiB in float32: a rank that built the whole model would grow by that much)."""
    wide = config(root, "wide")
    text = wide.read_text().replace("vocab_size = 256\nhidden_size = 32", "vocab_size = 32000\nhidden_size = 1024")
    wide.write_text(text)
    r = keel_train(wide, "--nproc", "2", "--set", "training.steps=1", "--set", "checkpoint.interval=0")
    assert r.returncode == 0, r.stderr[-3000:]
    record = next(r for r in read_metrics(root / "runs/wide/metrics.jsonl") if "start_memory" in r)
    from keel.train.config import model_config_from

    params = model_config_from(load_config(wide).model.config).param_counts()["total"]
    assert params > 65_000_000
    startup = record["start_memory"]["startup_peak_bytes"]
    assert 0.35 * 4 * params < startup < 0.65 * 4 * params, (startup, 4 * params)


# In `make test-slow` (the default suite's budget): the seed checkpoint's rollback test stays.
@pytest.mark.slow
def test_a_seed_checkpoint_starts_every_layout_from_its_weights(root, capsys, no_torchrun):
    """`keel train --seed-checkpoint` writes the initial model as step 0 (one process); a later run starts
    from it whatever its layout or seed: 2 ranks (FSDP) and one process resuming it give the same losses,
    which differ from the run's own seed-0 initialisation. Writing one twice, or over 2 ranks, is refused."""
    seeded = config(root, "seeded")
    assert main(["train", str(seeded), "--seed-checkpoint", "--set", "run.seed=5"]) == 0
    seed_dir = root / "runs/seeded/checkpoints/step-00000000"
    assert (seed_dir / "SEED").exists() and (seed_dir / COMPLETE).exists() and (seed_dir / "config.json").exists()
    assert "already has a checkpoint" in refused(capsys, seeded, "--seed-checkpoint")
    assert "one process" in refused(capsys, config(root, "seeded-2"), "--seed-checkpoint", "--nproc", "2")
    args = ["--set", "training.steps=3", "--set", "checkpoint.interval=0"]
    r = keel_train(seeded, "--nproc", "2", *args)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "started from the seed checkpoint" in r.stderr
    two = losses(root / "runs/seeded")
    _, one = run(config(root, "seeded-1"), "training.steps=3", "checkpoint.interval=0", f"checkpoint.resume={seed_dir}")
    _, fresh = run(config(root, "unseeded"), "training.steps=3", "checkpoint.interval=0")
    for step in (1, 2, 3):
        assert two[step] == pytest.approx(one.losses[step], rel=1e-5), step
    assert abs(one.losses[1] - fresh.losses[1]) > 1e-3  # the seed-5 weights, not seed 0's


def test_a_rollback_to_the_seed_checkpoint_restarts_the_run_from_scratch(root, no_torchrun):
    """With only the seed checkpoint to go back to, a rollback restores its model and the state every run
    starts with (no optimizer moments, the schedule's first rate, the loader at the start): replayed
    without skipping, steps 1-5 give the uninterrupted run's losses exactly."""
    path = config(root, "seed-rollback")
    assert main(["train", str(path), "--seed-checkpoint"]) == 0
    settings = ("training.steps=5", "checkpoint.interval=0")
    _, straight = run(config(root, "seed-straight"), *settings)
    guard = ("guard.nan=rollback", "guard.skip_batches_after_rollback=0")
    _, result = run(path, *settings, *guard, env={"KEEL_FAULTS": "nan@3"})
    assert [(e["action"], e["step"]) for e in result.events] == [("rollback", 3)]
    for step in range(1, 6):
        assert result.losses[step] == straight.losses[step], step


def source_config(root: Path, name: str, source: Path) -> Path:
    """A run that starts from the checkpoint `source` (its config and tokenizer) instead of [model.config]."""
    path = config(root, name)
    text = path.read_text()
    start, end = text.index("[model]"), text.index("[run]")
    path.write_text(text[:start] + f'[model]\nsource = "{source}"\n' + text[end:])
    return path


def test_a_run_from_an_hf_checkpoint_starts_from_its_weights_on_any_layout_and_exports_hf(root, no_torchrun):
    """`model.source` = an HF safetensors directory: the model the trainer builds holds exactly its weights
    (each rank reads its blocks: tests/test_train_materialize.py); 2 ranks with tp = 2 train it as one
    process does; `checkpoint.export_hf` writes RUN/hf from the ranks' shards, which transformers loads
    with the final checkpoint's weights and keel serves."""
    import transformers

    from keel.quant.loading import load_model
    from keel.serve.engine import EngineConfig
    from keel.serve.llm import LLM
    from keel.serve.sampling import SamplingParams

    hf_in = root / "tok"  # the tiny HF Llama the other tests take their tokenizer from
    trainer = Trainer(load_config(source_config(root, "from-hf-built", hf_in), ["training.steps=1"]))
    try:
        reference = load_model(hf_in, "float32").model.state_dict()
        built = trainer.modules[0].state_dict()
        assert built.keys() == reference.keys()
        for key, value in reference.items():
            assert torch.equal(built[key], value), key
    finally:
        trainer.close()
    args = ["training.steps=3", "checkpoint.interval=0"]
    _, one = run(source_config(root, "from-hf-1", hf_in), *args)
    path = source_config(root, "from-hf-2", hf_in)
    r = keel_train(
        path, "--nproc", "2", *(a for x in [*args, "parallel.tp=2", "checkpoint.export_hf=true"] for a in ("--set", x))
    )
    assert r.returncode == 0, r.stderr[-3000:]
    two = losses(root / "runs/from-hf-2")
    for step in (1, 2, 3):
        assert two[step] == pytest.approx(one.losses[step], rel=1e-5), step
    exported = root / "runs/from-hf-2/hf"
    assert (exported / "model.safetensors.index.json").exists() and not (exported / "sharded").exists()
    final = load_model(latest_checkpoint(root / "runs/from-hf-2/checkpoints"), "float32").model
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32)
    tokens = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        torch.testing.assert_close(hf_model(tokens).logits, final(tokens), rtol=1e-5, atol=1e-5)
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    answers = [
        LLM(str(model), EngineConfig.of(dtype="float32")).generate("hello", greedy, use_tqdm=False)[0]
        for model in (exported, latest_checkpoint(root / "runs/from-hf-2/checkpoints"))
    ]
    assert len(answers[0].outputs[0].token_ids) == 8
    assert answers[0].outputs[0].token_ids == answers[1].outputs[0].token_ids


def test_a_run_from_a_keel_checkpoint_reads_its_model_only(root, no_torchrun):
    """`model.source` = a `keel train` checkpoint directory: DCP reads its model (no optimizer state, step 0,
    the new run's own schedule), resharded for the new layout."""
    from keel.quant.loading import load_model

    run(config(root, "base"), "training.steps=2", "checkpoint.interval=0")
    base = latest_checkpoint(root / "runs/base/checkpoints")
    trainer = Trainer(load_config(source_config(root, "from-keel", base), ["training.steps=2"]))
    try:
        assert trainer.step == 0 and not any(o.state for o in trainer.optimizers)
        reference = load_model(base, "float32").model.state_dict()
        built = trainer.modules[0].state_dict()
        for key, value in reference.items():
            assert torch.equal(built[key], value), key
    finally:
        trainer.close()


# In make test-slow (44 s on the 2-core AVX2 machine), to keep make test within its budget.
@pytest.mark.slow
def test_compiled_blocks_train_like_eager_ones(root):
    """`training.compile`: each decoder block through torch.compile (inductor), in a `keel train` process of
    its own (as a user runs it: no compiler state left by other tests), compiled once for all blocks
    (dynamo takes a block's parameters as inputs: TORCH_LOGS counts the graphs); the losses are eager's."""
    _, eager = run(config(root, "eager"), "training.steps=3", "checkpoint.interval=0")
    args = ["--set", "training.steps=3", "--set", "checkpoint.interval=0", "--set", "training.compile=true"]
    # A cache of its own: inductor's on-disk FX graph cache has served a graph generated for another thread
    # count (pytorch#160812: its key lacked the count baked into the C++), and other tests compile too.
    # One thread, as each xdist worker runs (conftest): the process has one core of the two.
    env = {
        "TORCH_LOGS": "graph_breaks,recompiles",
        "TORCHINDUCTOR_CACHE_DIR": str(root / "inductor-compiled"),
        "OMP_NUM_THREADS": "1" if os.environ.get("PYTEST_XDIST_WORKER") else "2",
    }
    r = keel_process(config(root, "compiled"), *args, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Recompiling" not in r.stderr  # the second block reuses the first block's graph
    compiled = losses(root / "runs/compiled")
    records = [r for r in read_metrics(root / "runs/compiled/metrics.jsonl") if "loss" in r]
    assert sorted(compiled) == [1, 2, 3], (records, r.stderr[-3000:])  # every step applied, none skipped
    for step in (1, 2, 3):
        assert compiled[step] == pytest.approx(eager.losses[step], rel=1e-5), step


@pytest.mark.parametrize("family", ["gemma3", "phi3"])
def test_the_hf_export_writes_a_renaming_family_under_its_own_names(root, tmp_path, family):
    """OLMo 2 and the Gemmas store some norms under other names than keel's (Gemma's even swap two):
    `checkpoint.export_hf` writes them under the stored names, so transformers loads the run's weights.
    A family that fuses tensors (Phi-3) is refused before the run, naming `keel convert`."""
    import transformers

    from keel.errors import KeelError
    from keel.quant.loading import load_model
    from tiny_models import save_byte_tokenizer, save_hf_model

    source = tmp_path / family
    save_hf_model(family, source)
    save_byte_tokenizer(source)
    path = source_config(root, f"export-{family}", source)
    overrides = ["training.steps=2", "checkpoint.interval=0", "checkpoint.export_hf=true"]
    if family == "phi3":
        with pytest.raises(KeelError, match="phi3 checkpoints store tensors fused.*keel convert"):
            Trainer(load_config(path, overrides))
        return
    run(path, *overrides)
    exported = root / f"runs/export-{family}/hf"
    final = load_model(latest_checkpoint(root / f"runs/export-{family}/checkpoints"), "float32").model
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32)
    tokens = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        torch.testing.assert_close(hf_model(tokens).logits, final(tokens), rtol=1e-5, atol=1e-5)
