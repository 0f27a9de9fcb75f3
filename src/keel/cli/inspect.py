"""`keel inspect MODEL`: a checkpoint's structure, parameters and provenance."""

from __future__ import annotations

import argparse
import json

from keel.cli.common import add_model_args


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("inspect", help="print a checkpoint's structure, parameters and provenance")
    add_model_args(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from keel.errors import ConfigError
    from keel.tools.inspect import describe, format_text
    from keel.tools.survey import format_survey, unknown_family
    from keel.weights import open_checkpoint, resolve_path

    path = resolve_path(args.model)
    survey = unknown_family(path)
    if survey is not None:  # a family keel does not know: what it could place, then the error
        print(json.dumps(survey, indent=2) if args.json else format_survey(survey))
        raise ConfigError(
            f"{path}: unsupported {survey['architecture']}; supported: {', '.join(survey['known'])} "
            "(what keel could and could not place is listed above)"
        )
    info = describe(open_checkpoint(args.model, head_dim=args.head_dim, num_heads=args.num_heads))
    print(json.dumps(info, indent=2, default=str) if args.json else format_text(info))
    return 0
