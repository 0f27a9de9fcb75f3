"""Mixture-of-experts compute and communication.

    python bench/moe.py [--threads 2] [--repeats 5]

1. Grouped against looped expert compute: one MoE block of an 8-expert, top-2 model with
   SmolLM2-135M's widths (hidden 576, expert FFN 1536), forward (serving) and forward + backward
   (training), at decode-sized and prefill-sized token counts, bf16 and fp32. Three
   implementations of the same arithmetic on the same routed tokens:
   - keel: `torch._grouped_mm`, one call per projection for all experts (the default path);
   - loop: keel's segment loop, one matmul per expert over the sorted tokens (the fallback);
   - transformers: `MixtralExperts` (eager: a one-hot mask and a Python loop over the experts hit).
   Times are medians of --repeats runs, interleaved, in one process.
2. All-to-all volume and time per step at world 2 (gloo, 2 processes, 1 thread each): the block
   with experts split over the two ranks (ep = 2), forward + backward on 2,048 tokens per rank;
   bytes sent off-rank counted by the dispatcher against the prediction 2 (dispatch + combine) x 2
   (forward + backward) x T x k x (ep - 1)/ep x hidden x bytes for uniform routing, and the time
   spent inside the all-to-alls.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from keel.config import ModelConfig
from keel.model import grouped
from keel.model.moe import MoE

H, FFN, E, K = 576, 1536, 8, 2


def block(dtype: torch.dtype) -> MoE:
    config = ModelConfig(
        architecture="mixtral",
        vocab_size=32,
        hidden_size=H,
        intermediate_size=FFN,
        num_layers=1,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        num_experts=E,
        num_experts_per_tok=K,
        moe_intermediate_size=FFN,
    )
    torch.manual_seed(0)
    moe = MoE(config)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.02)
    return moe.to(dtype)


def hf_experts(moe: MoE):
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    cfg = MixtralConfig(hidden_size=H, intermediate_size=FFN, num_local_experts=E, num_experts_per_tok=K)
    cfg._experts_implementation = "eager"
    experts = MixtralExperts(cfg).to(moe.experts.gate_up_proj.dtype)
    with torch.no_grad():
        experts.gate_up_proj.copy_(moe.experts.gate_up_proj)
        experts.down_proj.copy_(moe.experts.down_proj)
    return experts


def run_keel(moe: MoE, x: torch.Tensor, training: bool, force_loop: bool) -> None:
    saved = grouped._HAS_GROUPED_MM
    grouped._HAS_GROUPED_MM = saved and not force_loop  # the segment loop: keel's fallback path
    try:
        with torch.set_grad_enabled(training):
            out = moe(x)
            if training:
                out.float().pow(2).mean().backward()
    finally:
        grouped._HAS_GROUPED_MM = saved


def run_hf(hf, x: torch.Tensor, routing, training: bool) -> None:
    with torch.set_grad_enabled(training):
        out = hf(x, routing.ids, routing.weights.to(x.dtype))
        if training:
            out.float().pow(2).mean().backward()


def measure(moe: MoE, hf, x: torch.Tensor, routing, training: bool, repeats: int) -> dict[str, float]:
    """Median milliseconds of each implementation, runs interleaved."""
    runs = {
        "grouped": functools.partial(run_keel, moe, x, training, False),
        "loop": functools.partial(run_keel, moe, x, training, True),
        "hf": functools.partial(run_hf, hf, x, routing, training),
    }
    times: dict[str, list[float]] = {name: [] for name in runs}
    for fn in runs.values():
        fn()  # warm-up
    for _ in range(repeats):
        for name, fn in runs.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) * 1e3 for name, ts in times.items()}


def compute_table(args) -> None:
    print(
        f"\n1. grouped vs looped expert compute ({E} experts, top-{K}, hidden {H}, expert FFN {FFN}, "
        f"{torch.get_num_threads()} threads)"
    )
    print(
        f"{'dtype':9} {'tokens':>6} {'pass':>8} {'keel grouped':>13} {'loop':>9} {'transformers':>13} "
        f"{'loop/grouped':>13} {'hf/grouped':>11}"
    )
    for dtype in (torch.bfloat16, torch.float32):
        moe = block(dtype)
        hf = hf_experts(moe)
        for tokens in (16, 256, 2048):
            x = torch.randn(tokens, H, dtype=dtype)
            with torch.no_grad():  # the transformers run gets keel's routing as plain inputs
                routing = moe.router(x)
            for training in (False, True):
                if training and tokens == 16:
                    continue
                med = measure(moe, hf, x, routing, training, args.repeats)
                kind = "fwd+bwd" if training else "fwd"
                print(
                    f"{str(dtype).removeprefix('torch.'):9} {tokens:6d} {kind:>8} {med['grouped']:10.2f} ms "
                    f"{med['loop']:6.2f} ms {med['hf']:10.2f} ms {med['loop'] / med['grouped']:12.2f}x "
                    f"{med['hf'] / med['grouped']:10.2f}x"
                )
                moe.zero_grad(set_to_none=True)
                hf.zero_grad(set_to_none=True)


def _a2a_worker(rank: int, world: int, init_file: str, tokens: int, repeats: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        from keel.model import expert_parallel

        moe = block(torch.float32)
        expert_parallel.shard_experts(moe, dist.group.WORLD)
        for p in moe.experts.parameters():
            p.requires_grad_(True)
        spent = [0.0]
        original = expert_parallel._all_to_all

        def timed(*a, **kw):
            start = time.perf_counter()
            out = original(*a, **kw)
            spent[0] += time.perf_counter() - start
            return out

        expert_parallel._all_to_all = timed
        # The backward all-to-alls run inside autograd's functions, not through _all_to_all: time the
        # forward ones and double them (the backward moves the same bytes in the reverse direction).
        torch.manual_seed(rank)
        x = torch.randn(tokens, H, requires_grad=True)
        step_times, a2a_times, sent = [], [], []
        dispatcher = moe.dispatcher
        for i in range(repeats + 1):
            dist.barrier()
            spent[0] = 0.0
            dispatcher.bytes_sent = 0
            start = time.perf_counter()
            moe(x).pow(2).mean().backward()
            elapsed = time.perf_counter() - start
            if i:
                step_times.append(elapsed)
                a2a_times.append(2 * spent[0])
                sent.append(2 * dispatcher.bytes_sent)
        if rank == 0:
            predicted = 2 * 2 * tokens * K * (world - 1) / world * H * 4
            print(
                f"\n2. all-to-all at world {world} (gloo, 1 thread per rank), {tokens} tokens per rank, top-{K}, "
                f"hidden {H}, float32, forward + backward"
            )
            print(
                f"   bytes sent off-rank per step (rank 0): {statistics.median(sent) / 2**20:.2f} MiB; "
                f"predicted for uniform routing {predicted / 2**20:.2f} MiB "
                f"({statistics.median(sent) / predicted:.3f}x)"
            )
            print(
                f"   step (fwd+bwd) {statistics.median(step_times) * 1e3:.1f} ms, of which all-to-all "
                f"~{statistics.median(a2a_times) * 1e3:.1f} ms "
                f"({statistics.median(a2a_times) / statistics.median(step_times):.0%})"
            )
    finally:
        dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--a2a-tokens", type=int, default=2048)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print("command: python bench/moe.py " + " ".join(sys.argv[1:]))
    compute_table(args)
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_a2a_worker, args=(2, os.path.join(tmp, "store"), args.a2a_tokens, args.repeats), nprocs=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
