"""`kvforge eval perplexity MODEL FILE`: a text file's perplexity through the engine.

The text is tokenized whole and read in strided windows (`kvforge/perplexity.py`);
the progress bar goes to stderr, the figures to stdout (`--json` for one JSON
object). KV cache and weight quantizers are chosen as for every other command, so
their effect on quality is one command each.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .cli_options import add_config_options


def add_parser(commands) -> None:
    parser = commands.add_parser("eval", help="evaluate a model's quality with the reference engine")
    tasks = parser.add_subparsers(dest="eval_task", required=True, metavar="TASK")
    ppl = tasks.add_parser("perplexity", help="perplexity of a text file, in strided windows")
    ppl.add_argument("model", help="a local Hugging Face directory or a built-in name")
    ppl.add_argument("file", help="a UTF-8 text file")
    ppl.add_argument("--kv-cache-dtype", metavar="NAME",
                     help="cache.kv_cache_dtype: auto, a float dtype or a KV quantizer (int8, fp8_e4m3, ...)")
    ppl.add_argument("--weights-quant", metavar="NAME", help="quantization.weights: a weight quantizer (int8_weight)")
    ppl.add_argument("--max-length", type=int, metavar="N", help="tokens per window (default: the model's context)")
    ppl.add_argument("--stride", type=int, metavar="S", help="tokens between window starts (default: max-length / 2)")
    ppl.add_argument("--json", action="store_true", help="print one JSON object")
    ppl.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_config_options(ppl)
    ppl.set_defaults(run=run_perplexity)


def overrides(args: argparse.Namespace) -> list[str]:
    """`--set` values, then the shorthands that were given."""
    given = list(args.overrides)
    if args.kv_cache_dtype:
        given.append(f"cache.kv_cache_dtype={json.dumps(args.kv_cache_dtype)}")
    if args.weights_quant:
        given.append(f"quantization.weights={json.dumps(args.weights_quant)}")
    return given


def run_perplexity(args: argparse.Namespace) -> int:
    from kvforge.engine.llm import LLM

    from .perplexity import perplexity

    path = Path(args.file)
    if not path.is_file():
        print(f"error: {args.file}: no such file; give a UTF-8 text file to score", file=sys.stderr)
        return 2
    llm = LLM(args.model, config_file=args.config, overrides=overrides(args))
    try:
        if llm.tokenizer is None:
            print(f"error: model {args.model!r} has no tokenizer, so a text file cannot be scored", file=sys.stderr)
            return 2
        token_ids = list(llm.tokenizer.encode(path.read_text(encoding="utf-8")))
        result = perplexity(llm, token_ids, args.max_length, args.stride, progress=not args.no_progress)
    finally:
        llm.engine.shutdown()
    config = llm.config
    figures = {"model": args.model, "file": str(path), "kv_cache_dtype": config.cache.kv_cache_dtype,
               "kv_scales": config.cache.kv_scales, "weights": config.quantization.weights,
               "activations": config.quantization.activations, "perplexity": result.perplexity,
               "bits_per_token": result.bits_per_token, "scored_tokens": result.num_scored_tokens,
               "windows": result.num_windows}
    if args.json:
        print(json.dumps(figures))
    else:
        print(f"perplexity {result.perplexity:.4f} ({result.bits_per_token:.4f} bits/token) over "
              f"{result.num_scored_tokens} tokens in {result.num_windows} windows")
    return 0
