"""Every parallel layout reproduces the single-process loss curve (gloo on CPU, world size 2 and 4).

One process group per world size runs all of its layouts in sequence (spawning is the slow part);
each layout trains a tiny float32 model from the same seed on the same synthetic batches with AdamW
for STEPS steps, and rank 0 writes the per-step global losses. The pytest process trains the same
models alone and compares.

Tolerance: rtol 1e-5, atol 1e-5 (about 6e-5 on losses of 4-5.5). Sharded layouts add gradients in
another order (reduce-scatter of per-rank means, row-split matmuls, microbatch accumulation), so float32
results differ in the last bits: the largest deviation seen over 10 AdamW steps is about 2e-6. Real
bugs land well outside: dropping the all-reduce of Qwen3's q/k-norm weight gradients under TP moves
the loss by 4e-4, restarting rotary positions on each sequence shard by 6e-2. q/k weights are
sharpened and the data are learnable walks, so attention, positions and the loss curve all matter.
The bf16 mixed-precision layout is compared loosely (rtol 2e-2): it checks that path trains alike.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from keel.config import ModelConfig
from keel.model.loss import cross_entropy_loss
from keel.model.transformer import build_model
from keel.train.precision import global_grad_norm
from tiny_models import COMMON, TINY_CONFIGS

STEPS = 10
BATCH = 8  # global sequences per step
SEQ = 16  # divisible by tp (sequence parallel)
LR = 3e-3
RTOL, ATOL = 1e-5, 1e-5


def tiny_config(name: str, **overrides) -> ModelConfig:
    """The tiny_models architecture `name` as a keel config, without importing transformers."""
    _, model_cls, extra = TINY_CONFIGS[name]
    return ModelConfig.from_hf({**COMMON, **extra, "architectures": [model_cls], **overrides})


MODELS = {
    "dense": lambda: tiny_config("llama", num_hidden_layers=4, tie_word_embeddings=False),
    "tied": lambda: tiny_config("llama", num_hidden_layers=2),
    "qwen3": lambda: tiny_config("qwen3", num_hidden_layers=2),  # q/k norm, head_dim != hidden/heads
    "qwen2": lambda: tiny_config("qwen2", num_hidden_layers=2),  # q/k/v biases
    "mistral": lambda: tiny_config("mistral", num_hidden_layers=2),  # sliding window 8 < SEQ: masked path
    "olmo": lambda: tiny_config("olmo", num_hidden_layers=2),  # q/k/v clamped per rank, weightless LayerNorms
    # the embedding's weightless norm (first stage only), reversed rotation, weightless q/k norms, relu2 MLP
    "nanochat": lambda: tiny_config("nanochat", num_hidden_layers=2),
    "moe": lambda: tiny_config("qwen3_moe", num_hidden_layers=2),
    # learned positions: the first stage's table under pp; under tp replicated, its output cut by the sequence (sp)
    "gpt_bigcode": lambda: tiny_config("gpt_bigcode-mha", num_hidden_layers=2, scale_attn_weights=True),
    # ALiBi (each tp rank's heads take their slopes), the embedding's own biased LayerNorm (first stage only)
    "bloom": lambda: tiny_config("bloom", num_hidden_layers=2, tie_word_embeddings=False),
    # softmax sinks (cut with the heads under tp), biased router and experts (split with them under ep)
    "gpt_oss": lambda: tiny_config("gpt_oss", num_hidden_layers=2),
    # the attention's output gated per head (cut with the heads under tp), a softplus gate; experts replicated
    "laguna": lambda: tiny_config("laguna", num_hidden_layers=3),
    # latent attention (heads cut under tp, the shared rope key's gradient summed), DeepSeek-V3's experts
    "deepseek": lambda: tiny_config("deepseek_v3", num_hidden_layers=2),
    # A.X-K2's gated latent query (q_gate_proj, cut by heads as q_b_proj) and low-rank gated norms (sequence-parallel),
    # without its indexer (tp refuses DSA's)
    "axk2_dense": lambda: dataclasses.replace(
        tiny_config("axk2", num_hidden_layers=2), index_topk=0, index_n_heads=0, index_head_dim=0
    ),
    # V2-Lite's full-rank q_proj, YaRN
    "deepseek_v2": lambda: tiny_config("deepseek_v2", num_hidden_layers=2),
    # DeepSeek-V3's router (sigmoid, selection bias, 2 groups) with the router z-loss, whose gradient
    # is injected inside each block: it must survive pipeline splitting and sharding.
    "moe_aux": lambda: dataclasses.replace(
        tiny_config("qwen3_moe", num_hidden_layers=2),
        router_scoring="sigmoid",
        router_bias=True,
        n_group=2,
        topk_group=1,
        routed_scaling_factor=1.5,
    ),
}
# Only the z-loss: a mean over tokens, so the same on any split of the batch. The load-balancing loss
# is a product of per-batch means, defined per micro-batch (as in Megatron): a split batch changes
# its value, so it cannot match one process exactly (its formula and gradient: tests/test_moe.py).
AUX_LOSS_COEF, Z_LOSS_COEF = 0.0, 0.05


def enable_aux_losses(model_name: str, modules, grad_scale: float) -> None:
    if not model_name.endswith("_aux"):
        return
    from keel.model.moe import MoE

    for module in modules:
        for sub in module.modules():
            if isinstance(sub, MoE):
                sub.aux_loss_coef, sub.z_loss_coef, sub.aux_grad_scale = AUX_LOSS_COEF, Z_LOSS_COEF, grad_scale


@dataclass(frozen=True)
class Layout:
    name: str
    model: str = "dense"
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    ep: int = 1  # experts split over ep of the dp_shard ranks
    sequence_parallel: bool = True
    loss_parallel: bool = False  # logits sharded on the vocabulary (under pp: keel.train.vocab_parallel's loss)
    schedule: str = "1f1b"
    stages_per_rank: int = 1
    microbatches: int = 4
    accum: int = 1  # gradient accumulation: the local batch in this many forward/backward calls per step
    ac_mode: str = "none"
    reshard_after_forward: bool = True
    param_dtype: str | None = None  # FSDP mixed precision: compute copies in this dtype
    rtol: float = RTOL
    norm_steps: int = STEPS  # steps whose gradient norm must match (bf16: only the first, before paths diverge)
    more: bool = False  # a variant of a kind make test already covers: run by make test-slow

    @property
    def world(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.tp


LAYOUTS = [
    Layout("dp_shard=2", dp_shard=2),
    Layout("dp_replicate=2 (HSDP 2x1)", dp_replicate=2),
    Layout("dp_shard=2 full-AC no-reshard", dp_shard=2, ac_mode="full", reshard_after_forward=False),
    Layout("dp_shard=2 tied", model="tied", dp_shard=2, more=True),
    # bf16 compute cannot match a float32 run bit-for-bit: this checks the mixed-precision path trains alike.
    Layout("dp_shard=2 bf16 params", dp_shard=2, param_dtype="bfloat16", rtol=2e-2, norm_steps=1),
    Layout("tp=2 sp", tp=2),
    Layout("tp=2 no-sp selective-AC", tp=2, sequence_parallel=False, ac_mode="selective"),
    Layout("tp=2 sp tied", model="tied", tp=2, more=True),
    Layout("tp=2 sp qwen3", model="qwen3", tp=2, more=True),
    Layout("tp=2 sp qwen2", model="qwen2", tp=2, more=True),
    Layout("tp=2 sp mistral", model="mistral", tp=2, more=True),
    Layout("tp=2 sp olmo", model="olmo", tp=2, more=True),
    Layout("tp=2 sp nanochat", model="nanochat", tp=2, more=True),
    Layout("pp=2 1f1b nanochat", model="nanochat", pp=2, more=True),
    Layout("tp=2 sp bloom", model="bloom", tp=2, more=True),
    Layout("pp=2 1f1b bloom", model="bloom", pp=2, more=True),
    Layout("tp=2 sp gpt_bigcode", model="gpt_bigcode", tp=2, more=True),
    Layout("tp=2 no-sp gpt_bigcode", model="gpt_bigcode", tp=2, sequence_parallel=False, more=True),
    Layout("pp=2 1f1b gpt_bigcode", model="gpt_bigcode", pp=2, more=True),
    Layout("pp=2 gpipe", pp=2, schedule="gpipe", more=True),
    Layout("pp=2 1f1b", pp=2, schedule="1f1b"),
    Layout("pp=2 interleaved1f1b x2", pp=2, schedule="interleaved1f1b", stages_per_rank=2),
    Layout("pp=2 zbv", pp=2, schedule="zbv", stages_per_rank=2, more=True),
    Layout("pp=2 interleavedzb x2", pp=2, schedule="interleavedzb", stages_per_rank=2, more=True),
    Layout("pp=2 1f1b accum=2", pp=2, accum=2),
    Layout("dp_shard=2 accum=2", dp_shard=2, accum=2),
    Layout("moe dp_shard=2", model="moe", dp_shard=2),
    Layout("moe pp=2", model="moe", pp=2),
    Layout("moe tp=2 sp (attention only)", model="moe", tp=2),
    Layout("moe sigmoid-router z-loss dp_shard=2", model="moe_aux", dp_shard=2, more=True),
    Layout("moe sigmoid-router z-loss pp=2", model="moe_aux", pp=2, more=True),
    Layout("moe ep=2", model="moe", dp_shard=2, ep=2),
    Layout("gpt_oss ep=2", model="gpt_oss", dp_shard=2, ep=2),
    Layout("gpt_oss tp=2 sp", model="gpt_oss", tp=2),
    Layout("tp=2 sp laguna", model="laguna", tp=2, more=True),
    Layout("deepseek tp=2 sp", model="deepseek", tp=2),
    Layout("axk2 tp=2 no-sp", model="axk2_dense", tp=2, sequence_parallel=False, more=True),
    Layout("deepseek_v2 tp=2 no-sp", model="deepseek_v2", tp=2, sequence_parallel=False, more=True),
    Layout("moe sigmoid-router z-loss ep=2", model="moe_aux", dp_shard=2, ep=2),
    Layout("moe ep=4", model="moe", dp_shard=4, ep=4),
    Layout("moe ep=2 x dp_shard_mod_ep=2 (experts FSDP-sharded too)", model="moe", dp_shard=4, ep=2),
    Layout("moe ep=2 x pp=2", model="moe", pp=2, dp_shard=2, ep=2),
    Layout("moe ep=2 x dp_replicate=2 (HSDP)", model="moe", dp_replicate=2, dp_shard=2, ep=2),
    Layout("dp_shard=2 x tp=2", dp_shard=2, tp=2),
    Layout("dp_replicate=2 x dp_shard=2 (HSDP)", dp_replicate=2, dp_shard=2),
    Layout("pp=2 x dp_shard=2", pp=2, dp_shard=2),
    Layout("pp=2 x dp_shard=2 accum=2", pp=2, dp_shard=2, accum=2, microbatches=2),
    Layout("pp=2 x tp=2 loss-parallel", pp=2, tp=2, loss_parallel=True),
    Layout("pp=2 x tp=2 gathered logits", pp=2, tp=2),
    Layout("dp_shard=4", dp_shard=4),
    Layout("pp=4 1f1b", pp=4),
    Layout("dp_replicate=2 x tp=2 (HSDP 2x1 + TP)", dp_replicate=2, tp=2),
    Layout(
        "pp=2 interleaved1f1b x2 x dp_shard=2 no-reshard",
        pp=2,
        dp_shard=2,
        schedule="interleaved1f1b",
        stages_per_rank=2,
        reshard_after_forward=False,
    ),
    Layout("moe dp_shard=2 x tp=2", model="moe", dp_shard=2, tp=2),
]


def batches(config: ModelConfig) -> torch.Tensor:
    """[STEPS, BATCH, SEQ + 1] fixed tokens (inputs are [:-1], targets [1:]): learnable walks
    start + k * stride (mod 64), so that the loss curve moves instead of sitting at log(vocab)."""
    g = torch.Generator().manual_seed(1234)
    start = torch.randint(0, 64, (STEPS, BATCH, 1), generator=g)
    stride = torch.randint(1, 4, (STEPS, BATCH, 1), generator=g)
    return (start + stride * torch.arange(SEQ + 1)) % 64


def fresh_model(config: ModelConfig):
    torch.manual_seed(0)
    model = build_model(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            # At std 0.02 attention is nearly uniform and the loss ignores q/k and the rotary
            # positions: sharpen q/k (as tiny_models does), so a wrong head split or position shows.
            if name.endswith(
                ("q_proj.weight", "k_proj.weight", "q_b_proj.weight", "kv_a_proj_with_mqa.weight", "kv_b_proj.weight")
            ):
                p.mul_(10)
            # Norm weights at exactly 1 hide a wrongly reduced norm-weight gradient less well.
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.1)


def reference_losses(model_name: str) -> dict[str, list[float]]:
    """Losses and gradient norms per step. The norms matter: AdamW is nearly invariant to a constant
    factor on a gradient, so a wrongly scaled gradient (e.g. experts averaged over the wrong group)
    barely moves the losses but shows in the norm."""
    config = MODELS[model_name]()
    model = fresh_model(config)
    enable_aux_losses(model_name, [model], 1.0)
    opt = optimizer(model.parameters())
    losses, norms = [], []
    for batch in batches(config):
        loss = cross_entropy_loss(model(batch[:, :-1]), batch[:, 1:])
        loss.backward()
        norms.append(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "grad_norms": norms}


# ----------------------------------------------------------------------------- worker side


def run_layout(layout: Layout) -> dict[str, list[float]]:
    from keel.train.parallel import build_mesh, dp_rank_and_size, parallelize
    from keel.train.pipeline import build_pipeline
    from keel.train.vocab_parallel import vocab_parallel_loss

    config = MODELS[layout.model]()
    mesh = build_mesh(layout.pp, layout.dp_replicate, layout.dp_shard, layout.tp, ep=layout.ep)
    dp_rank, dp_size = dp_rank_and_size(mesh)

    def par(module):
        return parallelize(
            module,
            mesh,
            sequence_parallel=layout.sequence_parallel,
            ac_mode=layout.ac_mode,
            ac_every=2,
            reshard_after_forward=layout.reshard_after_forward,
            param_dtype=getattr(torch, layout.param_dtype) if layout.param_dtype else None,
            loss_parallel=layout.loss_parallel,
        )

    if layout.pp > 1:
        loss_fn = cross_entropy_loss
        if layout.loss_parallel:  # the last stage returns its tp rank's slice of the vocabulary
            loss_fn = vocab_parallel_loss(mesh["tp"].get_group(), config.vocab_size)
        pipe = build_pipeline(
            lambda: fresh_model(config),
            mesh["pp"],
            layout.schedule,
            layout.microbatches,
            layout.stages_per_rank,
            loss_fn,
            parallelize_fn=par,
        )
        params = [p for m in pipe.modules for p in m.parameters()]
        # pipe.step divides each microbatch's loss by the microbatch count: the aux losses alike.
        enable_aux_losses(layout.model, pipe.modules, 1.0 / (layout.microbatches * layout.accum))
    else:
        model = par(fresh_model(config))
        params = list(model.parameters())
        enable_aux_losses(layout.model, [model], 1.0 / layout.accum)
    opt = optimizer(params)

    rows = BATCH // dp_size
    losses, norms = [], []
    pp_group = mesh["pp"].get_group() if layout.pp > 1 else None
    for batch in batches(config):
        local = batch[dp_rank * rows : (dp_rank + 1) * rows]
        loss = None
        for chunk in local.chunk(layout.accum):  # gradients add up over the chunks
            inputs, targets = chunk[:, :-1], chunk[:, 1:]
            if layout.pp > 1:
                part = pipe.step(inputs, targets)
            else:
                part = cross_entropy_loss(model(inputs), targets)
                (part / layout.accum).backward()
            if part is not None:
                loss = part.detach() / layout.accum + (0 if loss is None else loss)
        if layout.pp > 1:
            # pipe.step's gradients are those of the chunk's mean loss: scale the sum to the batch mean.
            for p in params:
                if p.grad is not None:
                    p.grad.div_(layout.accum)
        norms.append(global_grad_norm(params, pp_group).item())
        opt.step()
        opt.zero_grad()
        # Ranks holding the last stage have a loss (tp copies are equal): average them all.
        total = torch.zeros(()) if loss is None else loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / (layout.world // layout.pp))
    return {"losses": losses, "grad_norms": norms}


def _worker(rank: int, world: int, init_file: str, layouts: list[dict], out: str) -> None:
    torch.set_num_threads(1)  # world 4 on 2 cores
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timedelta(seconds=300)
    )
    try:
        results = {}
        for fields in layouts:
            layout = Layout(**fields)
            start = time.perf_counter()
            results[layout.name] = {**run_layout(layout), "seconds": time.perf_counter() - start}
        if rank == 0:
            Path(out).write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def selected(world: int, more: bool) -> list[Layout]:
    return [layout for layout in LAYOUTS if layout.world == world and layout.more == more]


def run_world(world: int, more: bool) -> dict:
    layouts = [asdict(layout) for layout in selected(world, more)]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "results.json")
        mp.spawn(_worker, args=(world, os.path.join(tmp, "store"), layouts, out), nprocs=world, join=True)
        return json.loads(Path(out).read_text())


# ----------------------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def references() -> dict[str, dict[str, list[float]]]:
    return {name: reference_losses(name) for name in MODELS}


# World 2 keeps every parallelism kind in `make test`; its variants (other architectures, schedules and
# routers, ~25 s) and world 4 (~40 s) run in `make test-slow`.
@pytest.mark.parametrize(
    ("world", "more"),
    [(2, False), pytest.param(2, True, marks=pytest.mark.slow), pytest.param(4, False, marks=pytest.mark.slow)],
    ids=["2", "2-variants", "4"],
)
def test_layouts_reproduce_single_process_losses(world: int, more: bool, references: dict) -> None:
    results = run_world(world, more)
    failures = []
    for layout in selected(world, more):
        got, want = results[layout.name], references[layout.model]
        deviation = max(abs(g - w) for g, w in zip(got["losses"], want["losses"], strict=True))
        norm_dev = max(abs(g / w - 1) for g, w in zip(got["grad_norms"], want["grad_norms"], strict=True))
        print(f"{layout.name:48s} max |dloss| {deviation:.2e} max rel dnorm {norm_dev:.2e}  ({got['seconds']:.1f}s)")
        # Norms amplify float noise along the trajectory more than losses: 1e-4 (a wrong reduction is >= 1e-3).
        checks = (("losses", STEPS, layout.rtol), ("grad_norms", layout.norm_steps, max(layout.rtol, 1e-4)))
        for key, steps, rtol in checks:
            mine, theirs = torch.tensor(got[key][:steps]), torch.tensor(want[key][:steps])
            if not torch.allclose(mine, theirs, rtol=rtol, atol=ATOL):
                failures.append(f"{layout.name} {key}: {got[key]} != {want[key]}")
    assert not failures, "\n".join(failures)


def test_reference_loss_decreases(references: dict) -> None:
    # The comparison above is only meaningful if training moves the loss.
    for name, ref in references.items():
        losses = ref["losses"]
        assert losses[-1] < losses[0] - 0.5, (name, losses)


def test_tp_rejects_indivisible_heads() -> None:
    from types import SimpleNamespace

    from keel.train.parallel import apply_tp

    model = fresh_model(MODELS["dense"]())  # 4 heads, 2 kv heads
    # The check runs before any collective, so a stand-in mesh of size 4 is enough.
    with pytest.raises(ValueError, match=r"num_kv_heads \(2\)"):
        apply_tp(model, SimpleNamespace(size=lambda: 4))


def test_pipeline_split_keeps_global_layer_keys() -> None:
    from keel.model.stages import layer_ranges, split_stage
    from keel.train.pipeline import stage_ids

    assert layer_ranges(5, 2) == [range(0, 3), range(3, 5)]
    assert stage_ids(0, 2, 2, "loop") == [0, 2] and stage_ids(0, 2, 2, "v") == [0, 3]
    config = MODELS["dense"]()
    first, last = split_stage(fresh_model(config), 0, 2), split_stage(fresh_model(config), 1, 2)
    assert list(first.layers) == ["0", "1"] and first.norm is None and first.lm_head is None
    assert list(last.layers) == ["2", "3"] and last.embed_tokens is None and last.lm_head is not None
