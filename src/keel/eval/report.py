"""An eval run's results as the table `keel eval run` prints."""

from __future__ import annotations


def summary_table(record: dict) -> str:
    lines = [f"{'suite':<24} {'dimension':<24} {'n':>4} {'metric':<12} {'score':>6} {'95% CI':>15} {'chance':>7}"]
    for name, s in record["suites"].items():
        for metric, m in s["metrics"].items():
            chance = f"{s['chance']:.3f}" if s["chance"] is not None and metric.startswith("acc") else ""
            lines.append(
                f"{name:<24} {s['dimension']:<24} {m['n']:>4} {metric:<12} {m['value']:>6.3f} "
                f"[{m['ci95'][0]:.3f}, {m['ci95'][1]:.3f}] {chance:>7}"
            )
        for group, m in s.get("groups", {}).items():
            lines.append(
                f"  {name} @ {group:<18} {'':<19} {m['n']:>4} {'':<12} {m['value']:>6.3f} "
                f"[{m['ci95'][0]:.3f}, {m['ci95'][1]:.3f}]"
            )
    lines.append("dimensions:")
    for name, m in record["dimensions"].items():
        lines.append(f"  {name:<28} {m['n']:>4} items  {m['value']:.3f} [{m['ci95'][0]:.3f}, {m['ci95'][1]:.3f}]")
    if "perplexity" in record:
        p = record["perplexity"]
        lines.append(
            f"perplexity on {p['corpus']}: {p['perplexity']:.4f} ({p['tokens_scored']} tokens, "
            f"context {p['context']}, stride {p['stride']})"
        )
    if "golden" in record:
        lines.append(
            f"golden greedy outputs: {len(record['golden']['outputs'])} prompts x "
            f"{record['golden']['max_tokens']} tokens"
        )
    return "\n".join(lines)
