"""Which suites an eval run takes: built-in names, 'needle' (generated for the tokenizer), or suite files."""

from __future__ import annotations

from keel.errors import KeelError


def resolve_suites(names: list[str] | None, tokenizer, limit: int | None, needle_lengths, needle_depths) -> list:
    """The Suite objects of --suite values (built-in names, 'needle', or files); None: every built-in suite and
    the needle suite."""
    from pathlib import Path

    from keel.eval.needle import DEFAULT_DEPTHS, DEFAULT_LENGTHS, needle_suite
    from keel.eval.suites import builtin_suite_paths, load_suite

    builtin = {p.stem: p for p in builtin_suite_paths()}
    suites = []
    for name in names or [*builtin, "needle"]:
        if name == "needle":
            from keel.data.corpora import shakespeare_path

            haystack = shakespeare_path().read_text(encoding="utf-8")
            lengths, depths = needle_lengths or DEFAULT_LENGTHS, needle_depths or DEFAULT_DEPTHS
            suite = needle_suite(tokenizer, haystack, lengths, depths)
        elif name in builtin:
            suite = load_suite(builtin[name])
        elif Path(name).is_file():
            suite = load_suite(name)
        else:
            raise KeelError(f"--suite {name}: not a built-in suite ({', '.join([*builtin, 'needle'])}) nor a file")
        if limit is not None:
            suite.items = suite.items[:limit]
        if (suite.template.chat or suite.kind == "multi_turn") and not tokenizer.chat_template:
            raise KeelError(
                f"suite {suite.name} renders its prompts with a chat template, and this model has "
                "none: choose other suites with --suite"
            )
        if any(s.name == suite.name for s in suites):
            raise KeelError(f"--suite {name}: a suite named {suite.name!r} is already selected")
        suites.append(suite)
    return suites
