"""`kvforge generate`: run prompts through the reference engine.

Prompts come from the arguments, from `--input FILE` (one per line, or JSONL
with a "prompt" field) or from stdin. Results go to stdout (text, or JSONL with
`--jsonl`); the progress bar and the summary go to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from kvforge.benchmarks.harness import percentile

from .cli_options import (add_batch_invariant_option, add_config_options, add_parallel_options,
                          batch_invariant_overrides, parallel_overrides, registry_from_config)


def add_parser(commands) -> None:
    parser = commands.add_parser("generate", help="generate text with the reference engine")
    parser.add_argument("prompts", nargs="*", metavar="PROMPT", help="prompts (default: --input or stdin)")
    parser.add_argument("--model", help="a local Hugging Face directory or a built-in name (default: kvforge-tiny)")
    add_config_options(parser)
    parser.add_argument("--input", metavar="FILE", help="read prompts from FILE: one per line, or JSONL with 'prompt'")
    parser.add_argument("--max-tokens", type=int, default=64, help="new tokens per prompt at most (default: 64)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default: 0)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, help="seed; prompt i uses seed + i, so each is reproducible alone")
    parser.add_argument("--stream", action="store_true", help="print tokens as they are generated")
    parser.add_argument("--jsonl", action="store_true", help="one JSON object per request on stdout")
    add_parallel_options(parser)
    add_batch_invariant_option(parser)
    parser.add_argument("--threads", type=int, help="CPU threads for torch (default: torch's choice); 1 is often "
                        "fastest for tiny models on a busy machine")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="the selection line also names the device, dtype and KV cache size")
    parser.add_argument("--no-summary", action="store_true",
                        help="print neither the selection line nor the summary")
    parser.set_defaults(run=run)


def read_prompts(args: argparse.Namespace) -> list[str]:
    if args.prompts:
        return list(args.prompts)
    if args.input:
        handle = open(args.input, encoding="utf-8")
    elif not sys.stdin.isatty():
        handle = sys.stdin
    else:
        return []
    prompts = []
    with handle:
        for line in handle:
            line = line.rstrip("\n")
            if not line.strip():
                continue
            if line.lstrip().startswith("{"):
                line = json.loads(line)["prompt"]
            prompts.append(line)
    return prompts


def summary(outputs, elapsed: float) -> dict:
    ttft = [o.timings.ttft for o in outputs if o.timings.ttft is not None]
    tpot = [o.timings.tpot for o in outputs if o.timings.tpot is not None]
    generated = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return {
        "requests": len(outputs),
        "errors": sum(o.finish_reason == "error" for o in outputs),
        "prompt_tokens": sum(len(o.prompt_token_ids) for o in outputs),
        "generated_tokens": generated,
        "seconds": elapsed,
        "tokens_per_s": generated / elapsed if elapsed > 0 else 0.0,
        "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
        "tpot_p50_s": percentile(tpot, 50), "tpot_p99_s": percentile(tpot, 99),
    }


def format_summary(figures: dict) -> str:
    def ms(value):
        return "n/a" if value is None else f"{value * 1000:.1f} ms"

    return (f"{figures['requests']} requests ({figures['errors']} errors), {figures['prompt_tokens']} prompt tokens, "
            f"{figures['generated_tokens']} generated in {figures['seconds']:.2f} s "
            f"({figures['tokens_per_s']:.1f} tokens/s); TTFT p50 {ms(figures['ttft_p50_s'])} "
            f"p99 {ms(figures['ttft_p99_s'])}; TPOT p50 {ms(figures['tpot_p50_s'])} p99 {ms(figures['tpot_p99_s'])}")


def selection_line(engine, verbose: bool) -> str:
    """The engine's one line naming what it selected; with `verbose`, where it runs too."""
    from kvforge.core import dtype_name
    from kvforge.engine.components import describe_selection

    line = describe_selection(engine.selected)
    if verbose:
        line += (f"; device {engine.device}, dtype {dtype_name(engine.dtype)}, {engine.num_blocks} KV blocks of "
                 f"{engine.kv.block_size} tokens")
        tp, pp = engine.config.parallel.tensor_parallel_size, engine.config.parallel.pipeline_parallel_size
        splits = ([f"tensor parallel over {tp} ranks"] if tp > 1 else []) + \
            ([f"pipeline parallel over {pp} stages"] if pp > 1 else [])
        if splits:
            line += " per rank; " + " x ".join(splits)
    return line


def record(output, selected: dict[str, str]) -> dict:
    return {"id": output.request_id, "prompt": output.prompt, "text": output.text, "token_ids": output.token_ids,
            "finish_reason": output.finish_reason, "error": output.error,
            "ttft_s": output.timings.ttft, "tpot_s": output.timings.tpot, "selected": selected}


def run(args: argparse.Namespace) -> int:
    from kvforge.engine.llm import LLM
    from kvforge.engine.long_lived import long_lived_start_up

    prompts = read_prompts(args)
    if not prompts:
        print("error: no prompts; give them as arguments, with --input FILE, or on stdin", file=sys.stderr)
        return 2
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    sections = {"model": args.model} if args.model else {}
    check_config(args, sections)
    with long_lived_start_up():  # this process builds one engine and exits after its prompts
        llm = LLM(config_file=args.config, overrides=parallel_overrides(args) + batch_invariant_overrides(args),
                  **sections)
    try:
        return generate(llm, prompts, args)
    finally:
        llm.engine.shutdown()


def check_config(args: argparse.Namespace, sections: dict) -> None:
    """Refuse, before any model loads, what `kvforge config show` refuses for the same
    settings: implementation names the registry lacks, a KV cache dtype no quantizer
    can keep, prefix caching asked of an allocator without it."""
    from kvforge.core import check_implementation_names, load_config

    loaded = load_config(config_file=args.config, overrides=parallel_overrides(args) + batch_invariant_overrides(args), **sections)
    check_implementation_names(loaded.config, registry_from_config(loaded, log_errors=False))


def generate(llm, prompts: list[str], args: argparse.Namespace) -> int:
    """Run `prompts` through `llm` as `args` asks; print the outputs and the summary."""
    from kvforge.engine.sampling_params import SamplingParams

    selected = llm.engine.selected
    if not args.no_summary:
        print(selection_line(llm.engine, args.verbose), file=sys.stderr)
    params = [SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                             top_k=args.top_k, seed=None if args.seed is None else args.seed + i)
              for i in range(len(prompts))]
    start = time.perf_counter()
    if args.stream:
        outputs = stream(llm, prompts, params, args.jsonl)
    else:
        outputs = llm.generate(prompts, params, use_tqdm=len(prompts) > 1)
        for output in outputs:
            print(json.dumps(record(output, selected)) if args.jsonl else format_output(output, len(prompts) > 1))
    elapsed = time.perf_counter() - start
    if not args.no_summary:
        print(format_summary(summary(outputs, elapsed)), file=sys.stderr)
    return 1 if any(o.finish_reason == "error" for o in outputs) else 0


def format_output(output, numbered: bool) -> str:
    body = output.text if output.finish_reason != "error" else f"error: {output.error}"
    return f"[{output.request_id}] {body}" if numbered else body


def stream(llm, prompts, params, jsonl: bool) -> list:
    """Print each step's new text as it comes; returns the final outputs."""
    final = {}
    for output in llm.stream(prompts, params):
        completion = output.outputs[0]
        if jsonl:
            event = {"id": output.request_id, "new_text": completion.new_text,
                     "new_token_ids": completion.new_token_ids, "finished": output.finished,
                     "finish_reason": completion.finish_reason, "error": completion.error}
            if output.finished:  # once per request, as the non-streaming records carry it
                event["selected"] = llm.engine.selected
            print(json.dumps(event), flush=True)
        elif len(prompts) > 1:
            if completion.new_text:
                print(f"[{output.request_id}] {completion.new_text!r}", flush=True)
        else:
            print(completion.new_text, end="", flush=True)
        if output.finished:
            final[output.request_id] = output
            if output.error and not jsonl:
                print(f"[{output.request_id}] error: {output.error}", file=sys.stderr)
    if not jsonl and len(prompts) == 1:
        print()
    return [final[k] for k in sorted(final, key=int)]
