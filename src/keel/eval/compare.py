"""`keel eval compare BASELINE.json CANDIDATE.json`: the regression gate.

Per suite: the change of each metric, and McNemar's exact test on the items both runs scored (the
runs see the same items, so the paired test is the right one: it counts only items whose outcome
changed). Greedy stability: the share of golden prompts whose greedy tokens are identical, and for
the others the first token where they part. Perplexity: the relative change. What differs between
the two manifests is listed, so a report says what was changed as well as what it did.

A gate fails when a suite's primary metric drops by more than `max_drop` with p < `alpha` (a drop
the item count cannot explain), when greedy stability is below `min_greedy_stability`, or when
perplexity rises by more than `max_ppl_increase` (relative). It also fails when a check cannot be
made: a suite, the golden outputs or the perplexity missing from one side, or the two runs having
scored different things (the suite's items hash, the golden prompts and token count, the corpus,
windows and tokenizer). Suites only the candidate has are listed as not gated.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from keel.eval.stats import mcnemar_p


@dataclass
class Thresholds:
    max_drop: float = 0.05  # absolute drop of a suite's primary metric
    alpha: float = 0.05  # ... counted only when McNemar's p is below this
    min_greedy_stability: float = 0.0  # share of golden prompts with identical greedy tokens
    max_ppl_increase: float = 0.01  # relative perplexity increase


@dataclass
class Comparison:
    suites: dict[str, dict[str, Any]] = field(default_factory=dict)
    greedy: dict[str, Any] | None = None
    perplexity: dict[str, Any] | None = None
    manifest_changes: dict[str, tuple[Any, Any]] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    ungated: list[str] = field(default_factory=list)  # suites only the candidate has

    @property
    def passed(self) -> bool:
        return not self.failures

    def as_dict(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "failures": self.failures,
            "ungated": self.ungated,
            "suites": self.suites,
            "greedy": self.greedy,
            "perplexity": self.perplexity,
            "manifest_changes": {k: list(v) for k, v in self.manifest_changes.items()},
        }


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for key, item in value.items():
            out.update(_flatten(item, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: value}


# Fields every run has different (when, where, which files hashed to the combined hash).
_VOLATILE = ("created", "machine.torch_threads", "weights.files.", "weights.path")


def manifest_changes(base: dict[str, Any], cand: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    a, b = _flatten(base), _flatten(cand)
    return {
        k: (a.get(k), b.get(k))
        for k in sorted(set(a) | set(b))
        if a.get(k) != b.get(k) and not any(k.startswith(v) for v in _VOLATILE)
    }


def compare_suite(base: dict[str, Any], cand: dict[str, Any]) -> dict[str, Any]:
    metrics = {}
    for name in base["metrics"]:
        if name not in cand["metrics"]:
            continue
        shared = [
            i for i in base["items"] if i in cand["items"] and name in base["items"][i] and name in cand["items"][i]
        ]
        if not shared:
            continue
        gained = sum(1 for i in shared if cand["items"][i][name] and not base["items"][i][name])
        lost = sum(1 for i in shared if base["items"][i][name] and not cand["items"][i][name])
        # Both scores over the items both runs scored, so the change and the test describe the same items.
        a = sum(base["items"][i][name] for i in shared) / len(shared)
        b = sum(cand["items"][i][name] for i in shared) / len(shared)
        metrics[name] = {
            "baseline": a,
            "candidate": b,
            "delta": b - a,
            "items": len(shared),
            "gained": gained,
            "lost": lost,
            "p_value": mcnemar_p(gained, lost),
        }
    return {"primary": base["primary"], "metrics": metrics}


def greedy_stability(base: dict[str, Any], cand: dict[str, Any]) -> dict[str, Any]:
    a, b = base["outputs"], cand["outputs"]
    shared = sorted(set(a) & set(b))
    divergences = {}
    for pid in shared:
        x, y = a[pid]["token_ids"], b[pid]["token_ids"]
        if x != y:
            first = next((i for i, (s, t) in enumerate(zip(x, y, strict=False)) if s != t), None)
            divergences[pid] = first if first is not None else min(len(x), len(y))  # one stopped earlier
    positions = sorted(divergences.values())
    return {
        "prompts": len(shared),
        "identical": len(shared) - len(divergences),
        "stability": (len(shared) - len(divergences)) / len(shared) if shared else 1.0,
        "first_divergence": divergences,
        "earliest_divergence": positions[0] if positions else None,
        "median_divergence": positions[len(positions) // 2] if positions else None,
    }


def compare(base: dict[str, Any], cand: dict[str, Any], thresholds: Thresholds | None = None) -> Comparison:
    t = thresholds or Thresholds()
    base_manifest, cand_manifest = base.get("manifest", {}), cand.get("manifest", {})
    result = Comparison(manifest_changes=manifest_changes(base_manifest, cand_manifest))
    result.ungated = [name for name in cand.get("suites", {}) if name not in base.get("suites", {})]
    for name, suite in base.get("suites", {}).items():
        if name not in cand.get("suites", {}):
            result.failures.append(f"suite {name}: missing from the candidate")
            continue
        hashes = [m.get("suites", {}).get(name, {}).get("items_sha256") for m in (base_manifest, cand_manifest)]
        if None not in hashes and hashes[0] != hashes[1]:
            result.failures.append(
                f"suite {name}: the runs scored different items (another version of the suite, "
                "--limit or needle settings); not comparable"
            )
            continue
        row = compare_suite(suite, cand["suites"][name])
        result.suites[name] = row
        primary = row["metrics"].get(row["primary"])
        if primary and primary["delta"] < -t.max_drop and primary["p_value"] < t.alpha:
            result.failures.append(
                f"suite {name}: {row['primary']} {primary['baseline']:.3f} -> {primary['candidate']:.3f} "
                f"({primary['delta']:+.3f}, p={primary['p_value']:.3g}; allowed drop {t.max_drop})"
            )
    for section in ("golden", "perplexity"):
        if (section in base) != (section in cand):
            side = "baseline" if section not in base else "candidate"
            result.failures.append(f"{section}: missing from the {side}; cannot be gated")
    if "golden" in base and "golden" in cand:
        same_prompts = [m.get("golden", {}).get("prompts_sha256") for m in (base_manifest, cand_manifest)]
        if base["golden"].get("max_tokens") != cand["golden"].get("max_tokens") or same_prompts[0] != same_prompts[1]:
            result.failures.append("golden: the runs used different golden prompts or token counts; not comparable")
    if "golden" in base and "golden" in cand and not any(f.startswith("golden") for f in result.failures):
        result.greedy = greedy_stability(base["golden"], cand["golden"])
        if result.greedy["stability"] < t.min_greedy_stability:
            result.failures.append(
                f"greedy stability {result.greedy['stability']:.3f} below {t.min_greedy_stability} "
                f"(first divergence at token {result.greedy['earliest_divergence']})"
            )
    if "perplexity" in base and "perplexity" in cand:
        pa, pb = base["perplexity"], cand["perplexity"]
        same_tokens = (
            pa["tokens_scored"],
            pa["context"],
            pa["stride"],
            pa.get("corpus"),
            base_manifest.get("tokenizer_sha256"),
        ) == (pb["tokens_scored"], pb["context"], pb["stride"], pb.get("corpus"), cand_manifest.get("tokenizer_sha256"))
        change = pb["perplexity"] / pa["perplexity"] - 1
        result.perplexity = {
            "baseline": pa["perplexity"],
            "candidate": pb["perplexity"],
            "relative": change,
            "comparable": same_tokens,
        }
        if not same_tokens:
            result.failures.append(
                "perplexity: the runs scored different corpora, windows or tokenizers; not comparable"
            )
        elif change > t.max_ppl_increase:
            result.failures.append(
                f"perplexity {pa['perplexity']:.4f} -> {pb['perplexity']:.4f} "
                f"({change:+.2%}; allowed {t.max_ppl_increase:+.2%})"
            )
    return result


def report(c: Comparison) -> str:
    """The comparison as a plain-text table."""
    lines = [f"{'suite':<24} {'metric':<12} {'baseline':>9} {'candidate':>9} {'delta':>8} {'+/-':>7} {'p':>7}"]
    for name, row in c.suites.items():
        for metric, m in row["metrics"].items():
            mark = "*" if metric == row["primary"] else " "
            lines.append(
                f"{name:<24} {metric + mark:<12} {m['baseline']:>9.3f} {m['candidate']:>9.3f} "
                f"{m['delta']:>+8.3f} {'+' + str(m['gained']) + '/-' + str(m['lost']):>7} "
                f"{m['p_value']:>7.3g}"
            )
    if c.greedy is not None:
        g = c.greedy
        where = f"; first divergence at token {g['earliest_divergence']}, median {g['median_divergence']}"
        lines.append(
            f"greedy stability: {g['identical']}/{g['prompts']} identical ({g['stability']:.1%})"
            + (where if g["identical"] < g["prompts"] else "")
        )
    if c.perplexity is not None:
        p = c.perplexity
        lines.append(f"perplexity: {p['baseline']:.4f} -> {p['candidate']:.4f} ({p['relative']:+.2%})")
    if c.ungated:
        lines.append(f"not gated (only in the candidate): {', '.join(c.ungated)}")
    if c.manifest_changes:
        lines.append("changed between the runs:")
        lines += [f"  {k}: {a!r} -> {b!r}" for k, (a, b) in c.manifest_changes.items()]
    lines.append("PASS" if c.passed else "FAIL:\n  " + "\n  ".join(c.failures))
    return "\n".join(lines)
