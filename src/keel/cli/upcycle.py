"""`keel upcycle MODEL DST`: a mixture-of-experts model from a dense one (identical experts)."""

from __future__ import annotations

import argparse
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("upcycle", help="make a mixture-of-experts model from a dense one (identical experts)")
    p.add_argument("model", help="dense model: HF directory, GGUF file or catalog name")
    p.add_argument("dst", type=Path, help="output HF directory (Mixtral format)")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--seed", type=int, default=0, help="router initialisation")
    p.add_argument("--noise", type=float, default=0.0, help="relative std of noise added to each expert copy")
    p.add_argument("--dtype", default="float32", help="weights dtype written (float32, bfloat16, float16)")
    p.add_argument("--overwrite", action="store_true")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from keel.quant.loading import load_model
    from keel.tools.upcycle import upcycle_model
    from keel.weights.convert import save_model

    loaded = load_model(args.model, "float32")
    sparse = upcycle_model(loaded.model, args.experts, args.top_k, seed=args.seed, noise=args.noise)
    dst = save_model(sparse, loaded.tokenizer, args.dst, dtype=args.dtype, overwrite=args.overwrite)
    counts = sparse.config.param_counts()
    print(
        f"wrote {dst}: {sparse.config.architecture}, {args.experts} experts, top-{args.top_k}, "
        f"{counts['total'] / 1e6:.1f}M parameters ({counts['active'] / 1e6:.1f}M active per token)"
    )
    return 0
