"""Capability suites: local JSONL files, one header line then one item per line.

The header (line 1, an object with a "suite" key) declares how the suite is run and scored:

    {"suite": "factual_recall", "kind": "multiple_choice", "dimension": "factual_recall",
     "description": "...", "template": {"chat": false, "system": null, "prompt": "Question: {question}\\nAnswer:",
     "choice": " {choice}"}, "sampling": {"max_tokens": 32, "temperature": 0, "stop": ["\\n"]}, "match": "exact"}

kinds and their items (every item has a unique "id"):
- multiple_choice: {"question", "choices": [...], "answer": index}; scored by log-likelihood of each
  continuation given the context ("acc": highest sum; "acc_norm": highest sum per character, as lm-eval).
- generation: {"prompt", "target": str | [str], "match"?: "exact" | "contains" | "regex"}; greedy output
  scored against the targets.
- multi_turn: {"turns": [t1, t2, t3], "options": [...], "answer"?}; the answer to the last turn must
  name the same option as the answer to the first ("consistency"); "correct" when turn 1 names `answer`.

The built-in suites ship in this package (keel/eval/suites/*.jsonl); `keel eval run --suite FILE` takes
others. Errors name the file, line and field.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from keel.errors import KeelError
from keel.jsonl import iter_jsonl
from keel.serve.sampling import SamplingParams

KINDS = ("multiple_choice", "generation", "multi_turn", "needle")
DIMENSIONS = (
    "instruction_following",
    "factual_recall",
    "reasoning",
    "long_context_retrieval",
    "multi_turn_consistency",
)
MATCHES = ("exact", "contains", "regex")
METRICS = {
    "multiple_choice": ("acc", "acc_norm"),
    "generation": ("match",),
    "needle": ("match",),
    "multi_turn": ("consistency", "correct"),
}
PRIMARY = {kind: names[0] for kind, names in METRICS.items()}
BUILTIN_DIR = Path(__file__).parent / "suites"


@dataclass
class Template:
    chat: bool = False
    system: str | None = None
    prompt: str = "{prompt}"
    choice: str = " {choice}"


@dataclass
class Suite:
    name: str
    kind: str
    dimension: str
    items: list[dict[str, Any]]
    template: Template = field(default_factory=Template)
    sampling: dict[str, Any] = field(default_factory=dict)
    match: str = "exact"
    description: str = ""
    source: str = ""
    primary: str | None = None  # the metric the gate and the dimension use; None: the kind's default

    def header(self) -> dict[str, Any]:
        """What the results record about the suite (enough to tell two versions apart)."""
        return {
            "kind": self.kind,
            "dimension": self.dimension,
            "template": vars(self.template),
            "sampling": self.sampling,
            "match": self.match,
            "source": self.source,
            "primary": self.primary or PRIMARY[self.kind],
        }


def builtin_suite_paths() -> list[Path]:
    return sorted(BUILTIN_DIR.glob("*.jsonl"))


def load_suite(path: str | Path) -> Suite:
    """Read and validate one suite file."""
    path = Path(path)
    try:
        # split("\n"), not splitlines(): JSON strings may hold U+2028 and other line separators raw.
        lines = path.read_text(encoding="utf-8").split("\n")
    except OSError as e:
        raise KeelError(f"suite {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise KeelError(f"suite {path}: not UTF-8 text") from None
    rows: list[tuple[int, dict]] = []
    for number, value in iter_jsonl(lines, f"suite {path}"):
        if not isinstance(value, dict):
            raise KeelError(f"suite {path}:{number}: expected a JSON object")
        rows.append((number, value))
    if not rows or "suite" not in rows[0][1]:
        raise KeelError(f'suite {path}:1: the first line must be the header, an object with a "suite" key')
    (_, head), items = rows[0], rows[1:]
    where = f"suite {path}:1"
    kind = head.get("kind")
    if kind not in KINDS:
        raise KeelError(f"{where}: kind must be one of {', '.join(KINDS)}, got {kind!r}")
    dimension = head.get("dimension")
    if dimension not in DIMENSIONS:
        raise KeelError(f"{where}: dimension must be one of {', '.join(DIMENSIONS)}, got {dimension!r}")
    template = _template(head.get("template") or {}, where)
    match = head.get("match", "exact")
    if match not in MATCHES:
        raise KeelError(f"{where}: match must be one of {', '.join(MATCHES)}, got {match!r}")
    primary = head.get("primary")
    if primary is not None and primary not in METRICS[kind]:
        raise KeelError(f"{where}: primary must be one of {', '.join(METRICS[kind])} for {kind}, got {primary!r}")
    sampling = head.get("sampling") or {}
    if not isinstance(sampling, dict):
        raise KeelError(f"{where}: sampling must be an object of SamplingParams fields")
    sampling_params(sampling, where)  # fails at load, not after the model is up
    suite = Suite(
        primary=primary,
        name=str(head["suite"]),
        kind=kind,
        dimension=dimension,
        items=[item for _, item in items],
        template=template,
        sampling=dict(sampling),
        match=match,
        description=str(head.get("description", "")),
        source=path.name,
    )
    seen: set[str] = set()
    for number, item in items:
        _check_item(suite, item, f"suite {path}:{number}")
        if item["id"] in seen:
            raise KeelError(f"suite {path}:{number}: duplicate id {item['id']!r}")
        seen.add(item["id"])
    if not suite.items:
        raise KeelError(f"suite {path}: no items after the header")
    return suite


def _template(fields: Any, where: str) -> Template:
    if not isinstance(fields, dict):
        raise KeelError(f"{where}: template must be an object (chat, system, prompt, choice)")
    unknown = set(fields) - set(vars(Template()))
    if unknown:
        raise KeelError(f"{where}: unknown template field(s) {', '.join(sorted(unknown))}")
    template = Template(**fields)
    if not isinstance(template.chat, bool):
        raise KeelError(f"{where}: template.chat must be true or false, got {template.chat!r}")
    if template.system is not None and not isinstance(template.system, str):
        raise KeelError(f"{where}: template.system must be a string or null")
    if not isinstance(template.prompt, str) or not isinstance(template.choice, str):
        raise KeelError(f"{where}: template.prompt and template.choice must be strings")
    return template


def sampling_params(values: dict, where: str) -> SamplingParams:
    """A suite's sampling: greedy and 32 tokens unless its header says otherwise; errors name `where`."""
    try:
        params = SamplingParams(**{"temperature": 0.0, "max_tokens": 32, **values})
        params.validate()
    except (TypeError, KeelError) as e:
        raise KeelError(f"{where}: sampling: {e}") from None
    return params


def _render(template: str, where: str, **fields: Any) -> None:
    """Fail at load, naming the item, when a template cannot be filled from it."""
    try:
        template.format(**fields)
    except KeyError as e:
        raise KeelError(f"{where}: the template {template!r} needs field {e} that the item lacks") from None
    except (IndexError, ValueError, AttributeError, TypeError) as e:
        raise KeelError(f"{where}: the template {template!r} cannot be filled ({e})") from None


def _check_item(suite: Suite, item: dict, where: str) -> None:
    def need(name: str, kind: type | tuple[type, ...]) -> Any:
        if not isinstance(item.get(name), kind):
            raise KeelError(f"{where}: field {name!r} missing or not a {getattr(kind, '__name__', kind)}")
        return item[name]

    need("id", str)
    if suite.kind == "multiple_choice":
        choices = need("choices", list)
        if len(choices) < 2 or not all(isinstance(c, str) and c for c in choices):
            raise KeelError(f"{where}: 'choices' must be a list of at least two non-empty strings")
        answer = item.get("answer")
        if type(answer) is not int or not 0 <= answer < len(choices):  # not bool, which is an int
            raise KeelError(f"{where}: 'answer' {answer!r} is not an index into its {len(choices)} choices")
        for choice in choices:
            _render(suite.template.choice, where, choice=choice)
    elif suite.kind in ("generation", "needle"):
        target = item.get("target")
        targets = [target] if isinstance(target, str) else target
        if not targets or not isinstance(targets, list) or not all(isinstance(t, str) and t for t in targets):
            raise KeelError(f"{where}: 'target' must be a non-empty string or a list of them")
        match = item.get("match", suite.match)
        if match not in MATCHES:
            raise KeelError(f"{where}: match must be one of {', '.join(MATCHES)}, got {match!r}")
        if match == "regex":
            for t in targets:
                try:
                    re.compile(t)
                except re.error as e:
                    raise KeelError(f"{where}: target {t!r} is not a valid regex ({e})") from None
    elif suite.kind == "multi_turn":
        turns = need("turns", list)
        if len(turns) < 2 or not all(isinstance(t, str) for t in turns):
            raise KeelError(f"{where}: 'turns' must be a list of at least two strings")
        options = need("options", list)
        if not options or not all(isinstance(o, str) and o.strip() for o in options):
            raise KeelError(f"{where}: 'options' must be a list of non-empty strings")
        if len({o.casefold() for o in options}) != len(options):
            raise KeelError(f"{where}: 'options' repeat one another (case does not count)")
        if "answer" in item and item["answer"] not in options:
            raise KeelError(f"{where}: 'answer' {item['answer']!r} is not one of its options")
        if suite.primary == "correct" and "answer" not in item:
            raise KeelError(f"{where}: the suite's primary metric is 'correct': every item needs an 'answer'")
    if suite.kind != "multi_turn":
        _render(suite.template.prompt, where, **item)


def normalise(text: str) -> str:
    """What exact match compares: stripped, trailing sentence punctuation dropped, casefolded."""
    return text.strip().rstrip(".!?").strip().casefold()


def matches(output: str, targets: str | list[str], how: str) -> bool:
    targets = [targets] if isinstance(targets, str) else targets
    if how == "exact":
        return any(normalise(output) == normalise(t) for t in targets)
    if how == "contains":
        return any(t.casefold() in output.casefold() for t in targets)
    return any(re.search(t, output.strip()) is not None for t in targets)


def extract_option(text: str, options: list[str]) -> str | None:
    """The option named earliest in `text` (case-insensitive, whole words; the longer of two starting
    at the same place, so "New York" beats "York"), or None."""
    best: tuple[int, str] | None = None
    for option in options:
        words = r"\s+".join(re.escape(word) for word in option.split())  # "New York" also across a line break
        found = re.search(rf"(?<!\w){words}(?!\w)", text, re.IGNORECASE)
        if found and (best is None or (found.start(), -len(option)) < (best[0], -len(best[1]))):
            best = (found.start(), option)
    return best[1] if best else None
