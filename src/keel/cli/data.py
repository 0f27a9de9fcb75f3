"""`keel data prepare INPUT... --tokenizer MODEL --out FILE`: a token file for `keel train` (keel.train.data)."""

from __future__ import annotations

import argparse
from pathlib import Path

from keel.train.data import prepare, sidecar_path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("data", help="training data")
    data_sub = p.add_subparsers(dest="data_command", required=True, metavar="COMMAND")
    _register_prepare(data_sub)


def run_prepare(args: argparse.Namespace) -> int:
    inputs: list[Path] = []
    for item in args.inputs:
        if item == "shakespeare" and not Path(item).exists():
            from keel.data.corpora import shakespeare_path

            inputs.append(shakespeare_path())
        else:
            inputs.append(Path(item))
    info = prepare(inputs, args.tokenizer, Path(args.out), args.format, args.jsonl_field, args.split)
    print(
        f"{args.out}: {info.num_tokens:,} tokens ({info.dtype}) in {info.num_documents:,} documents "
        f"from {len(inputs)} file(s); sidecar {sidecar_path(args.out)}"
    )
    return 0


def _register_prepare(subparsers: argparse._SubParsersAction) -> None:
    """`keel data prepare`."""
    p = subparsers.add_parser(
        "prepare",
        help="tokenize text or jsonl files into a token file for keel train",
        description="Tokenize documents into a flat token file (EOS between documents) plus a JSON sidecar.",
    )
    p.add_argument("inputs", nargs="+", metavar="INPUT", help="text or jsonl files, or `shakespeare` (the corpus)")
    p.add_argument("--tokenizer", required=True, metavar="MODEL", help="model whose tokenizer to use")
    p.add_argument("--out", required=True, metavar="FILE", help="token file to write, e.g. data/shakespeare.bin")
    p.add_argument("--format", choices=["text", "jsonl"], default=None, help="default: by suffix (.jsonl = jsonl)")
    p.add_argument("--jsonl-field", default="text", metavar="NAME", help="jsonl field with the text (default text)")
    p.add_argument(
        "--split",
        choices=["file", "paragraph"],
        default="paragraph",
        help="text documents: whole files, or blank-line separated paragraphs (default)",
    )
    p.set_defaults(func=run_prepare)
