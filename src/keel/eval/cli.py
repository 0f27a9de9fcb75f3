"""`keel eval ppl MODEL --corpus FILE|NAME [--context 1024] [--stride 512] [--max-tokens N]`;
`keel eval run` and `keel eval compare` are in keel.eval.run_cli."""

from __future__ import annotations

import argparse
import sys

from keel.data.text_corpus import CORPORA, corpus_text
from keel.dtypes import DTYPE_CHOICES
from keel.errors import KeelError


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("eval", help="evaluate a model: perplexity, capability suites, regression gate")
    eval_sub = p.add_subparsers(dest="eval_command", required=True, metavar="EVAL")
    q = eval_sub.add_parser("ppl", help="sliding-window perplexity over a text corpus")
    q.add_argument("model", metavar="MODEL", help="HF directory, .gguf file, or catalog name")
    q.add_argument("--corpus", required=True, help=f"a UTF-8 text file, or one of: {', '.join(CORPORA)}")
    q.add_argument("--context", type=int, default=1024, help="tokens per window (default 1024)")
    q.add_argument("--stride", type=int, default=512, help="tokens between window starts (default 512)")
    q.add_argument("--max-tokens", type=int, default=None, help="score only the corpus's first N tokens")
    q.add_argument("--dtype", default="auto", choices=list(DTYPE_CHOICES))
    q.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    q.add_argument("--json", default=None, metavar="PATH", help="also write the result as JSON")
    q.set_defaults(func=cmd_ppl)
    from keel.eval.run_cli import register_compare, register_run

    register_run(eval_sub)
    register_compare(eval_sub)


def cmd_ppl(args: argparse.Namespace) -> int:
    from keel.model.perplexity import check_window_options, leading_tokens, sliding_window_perplexity

    check_window_options(args.context, args.stride)  # option errors before any loading
    if args.max_tokens is not None and args.max_tokens < 2:
        raise KeelError(f"--max-tokens must be >= 2, got {args.max_tokens}")
    import torch

    from keel.quant.loading import load_model

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    name, text = corpus_text(args.corpus)
    loaded = load_model(args.model, args.dtype)
    if loaded.tokenizer is None:
        raise KeelError(f"{args.model}: no tokenizer found (tokenizer.json or GGUF tokenizer metadata)")
    ids = leading_tokens(loaded.tokenizer, text, args.max_tokens)
    result = sliding_window_perplexity(loaded.model, ids, args.context, args.stride)
    dtype = str(loaded.model.dtype).removeprefix("torch.")
    print(
        f"{args.model} ({dtype}) on {name}: perplexity {result.perplexity:.4f} over {result.tokens_scored} tokens "
        f"({result.windows} windows of {args.context}, stride {args.stride}; {result.tokens_per_s:.0f} tok/s)"
    )
    if args.json:
        record = {"model": str(args.model), "dtype": dtype, "corpus": name, **result.as_dict()}
        from keel.eval.run import write_json

        write_json(args.json, record)
    sys.stdout.flush()
    return 0
