"""`keel train plot RUN_DIR`: loss, throughput and (MoE) expert load of a run, from its metrics.jsonl, as a PNG."""

from __future__ import annotations

import io
from pathlib import Path

from keel.atomic import write_atomic
from keel.errors import KeelError
from keel.train.metrics import read_metrics


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # no display on servers
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise KeelError(f"{path}: no metrics file (is {run_dir} a keel train run directory?)")
    everything = read_metrics(path)
    records = [r for r in everything if "loss" in r]
    if not records:
        raise KeelError(f"{path}: no training steps logged yet")
    steps = [r["step"] for r in records]
    moe = [r for r in records if r.get("moe")]
    fig, axes = plt.subplots(3 if moe else 2, 1, figsize=(8, 8.5 if moe else 6), sharex=True)
    ax_loss, ax_tps = axes[0], axes[1]
    ax_loss.plot(steps, [r["loss"] for r in records], label="train loss", linewidth=1)
    val = [r for r in everything if r.get("val_loss") is not None]
    if val:
        ax_loss.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", label="validation loss")
    ax_loss.set_ylabel("loss (nats/token)")
    ax_loss.grid(alpha=0.3)
    ax_loss.legend()
    ax_tps.plot(steps, [r.get("tokens_per_s", 0) for r in records], color="tab:green", linewidth=1)
    ax_tps.set_ylabel("tokens/s")
    ax_tps.grid(alpha=0.3)
    if moe:  # expert load per MoE layer: max/mean tokens per expert (1 = balanced), dropped share dashed
        ax_moe = axes[2]
        for layer in sorted(moe[-1]["moe"], key=int):
            rows = [r for r in moe if r["moe"].get(layer, {}).get("max_over_mean") is not None]
            line = ax_moe.plot(
                [r["step"] for r in rows],
                [r["moe"][layer]["max_over_mean"] for r in rows],
                linewidth=1,
                label=f"layer {layer}",
            )[0]
            if any(r["moe"][layer]["dropped_fraction"] for r in rows):
                ax_moe.plot(
                    [r["step"] for r in rows],
                    [1 + r["moe"][layer]["dropped_fraction"] for r in rows],
                    "--",
                    color=line.get_color(),
                    linewidth=0.8,
                )
        ax_moe.set_ylabel("expert load max/mean\n(dashed: 1 + dropped)")
        ax_moe.grid(alpha=0.3)
        ax_moe.legend(fontsize="small", ncol=4)
    axes[-1].set_xlabel("step")
    fig.suptitle(run_dir.name)
    fig.tight_layout()
    out = Path(out) if out else run_dir / "curves.png"
    png = io.BytesIO()
    fig.savefig(png, dpi=110, format="png")
    plt.close(fig)
    write_atomic(out, png.getvalue())
    return out
