"""Speculative decoding figures: every proposer against none, on the same model
and requests, measured back to back in one process (1 thread):

* output tokens per second with and without speculation, and their ratio (the speedup);
* drafts verified, accepted, the acceptance rate and the mean drafts accepted per
  verification;
* whether greedy output is token for token the same as without speculation;

for each proposer with adaptive drafting (`speculative.draft_policy = "adaptive"`,
the default) and with fixed drafting (`"fixed"`, always `num_tokens`), at batch 1
(one request at a time, where decode reads every weight for one token) and batch
32 (also fixed with `disable_above_batch_size` set below 32, so speculation turns
itself off), on three kinds of text: repetitive (the output repeats or edits what
came before: what prompt lookup feeds on), free (greedy continuations of
ordinary openings) and unpredictable (the free openings sampled at temperature
1.0, unseeded: output the drafts seldom guess; "identical" does not apply).

A second engine without speculation, built last, is measured too ("none, second
engine"): how far it reads from the first is how far two identical engines differ
in one process, which no number of rounds removes. Each engine runs the whole
workload once untimed first (compilation, first
allocations, adaptive drafting's warm-up); then every configuration runs once per
round, the order rotated round by round, and each row gives its fastest round
against none's fastest and the median of its per-round ratios to none. With
`KVFORGE_BENCH_CLOCK=cpu` the time is the process's CPU time (one thread),
steadier than wall time on a machine shared with other work.

    python -m kvforge.benchmarks.bench_speculative --model kvforge-tiny --model bench-llama-50m
"""

from __future__ import annotations

import argparse
import json
import random
from statistics import median

import torch

from kvforge.core import SPECULATIVE_PROPOSER, build_registry

REPETITIVE_TEXT = [
    "def area(w, h):\n    return w * h\n\n\ndef area(w, h):\n    return w * h\n\n\ndef area(",
    "for i in range(10):\n    print(i)\nfor i in range(10):\n    print(i)\nfor i in range(10):\n",
    "x = x + 1\ny = y + 1\nx = x + 1\ny = y + 1\nx = x + 1\ny = y + 1\n",
    "the cat sat on the mat. the cat sat on the mat. the cat sat on the mat. the cat",
]
FREE_TEXT = [
    "Once upon a time, there was a little ",
    "import os\nimport sys\n\n\ndef main():\n",
    "The weather today is ",
    "class Stack:\n    def __init__(self):\n",
]


def proposers() -> list[str]:
    return [r.name for r in build_registry().implementations(SPECULATIVE_PROPOSER) if r.availability().ok]


def prompts(model: str, tokenizer, vocab: int, repetitive: bool, count: int, seed: int = 0) -> list[list[int]]:
    """Text prompts for the built-in (trained) models; token ids for random-weight ones: a
    16-token motif repeated (repetitive) or random ids (free)."""
    if model.startswith("kvforge-"):
        texts = REPETITIVE_TEXT if repetitive else FREE_TEXT
        return [list(tokenizer.encode(texts[i % len(texts)])) for i in range(count)]
    rng = random.Random(seed)
    if repetitive:
        return [[rng.randrange(3, vocab) for _ in range(16)] * 4 for _ in range(count)]
    return [[rng.randrange(3, vocab) for _ in range(64)] for _ in range(count)]


TEXTS = ("repetitive", "free", "unpredictable")
CONTROL = "none, second engine"


def engine_for(model: str, batch: int, speculative: dict, scheduler: dict | None = None):
    """An engine for `model` at `batch` running requests (`scheduler`: more scheduler settings)."""
    from kvforge import LLMEngine
    from kvforge.core import load_config

    config = load_config(model=model, device="cpu", dtype="float32", cache={"memory_budget": 2**29},
                         scheduler={**(scheduler or {}), "max_num_seqs": batch}, speculative=speculative).config
    return LLMEngine(config)


def run(engine, requests: list[list[int]], tokens: int, temperature: float = 0.0) -> tuple[float, list[list[int]]]:
    from kvforge import LLM, SamplingParams

    from .peers.common import clock

    now = clock()
    params = SamplingParams(max_tokens=tokens, temperature=temperature, ignore_eos=True, detokenize=False)
    start = now()
    outputs = LLM.from_engine(engine).generate(prompt_token_ids=requests, sampling_params=params)
    return now() - start, [list(out.outputs[0].token_ids) for out in outputs]


def draft_metrics(engine) -> dict:
    return {k: v for k, v in engine.metrics().items() if k.startswith("spec_")}


def settings_for(batch: int, num_tokens: int) -> list[tuple[str, dict]]:
    """(label, speculative section) of every configuration measured at `batch`."""
    settings = [("none", {})]
    for name in proposers():
        settings += [(name, {"proposer": name, "num_tokens": num_tokens}),
                     (f"{name}, fixed", {"proposer": name, "num_tokens": num_tokens, "draft_policy": "fixed"})]
    if batch > 1:
        settings += [(f"{name}, fixed, off above {batch // 2}",
                      {"proposer": name, "num_tokens": num_tokens, "draft_policy": "fixed",
                       "disable_above_batch_size": batch // 2}) for name in proposers()]
    # A second engine without speculation, built last: what it reads against the first is
    # how far two identical engines differ in one process (memory placement), not noise
    # of the rounds, which the median over rounds does not remove.
    return settings + [(CONTROL, {})]


def measure(model: str, path: str, *, batch: int, text: str, tokens: int, num_tokens: int,
            repeats: int = 5) -> list[dict]:
    """Every configuration against none for one (model, text, batch). All engines are
    built first and each runs the whole workload once untimed (compilation, first
    allocations, and adaptive drafting's warm-up at the batch sizes the workload passes
    through); then `repeats` rounds run every configuration once each, the order rotated
    round by round (A B C, B C A, ...), so a slow stretch of the host falls on all of
    them. A row gives the configuration's fastest round against none's fastest
    (`speedup`) and the median over rounds of its time against none's in the same
    round (`speedup_median`)."""
    settings = settings_for(batch, num_tokens)
    row = {"model": model, "text": text, "batch": batch}
    engines, rows = {}, []
    for label, speculative in settings:
        try:
            engines[label] = engine_for(path, batch, speculative)
        except Exception as exc:  # noqa: BLE001 - a proposer that cannot serve this model is reported, not fatal
            rows.append({**row, "proposer": label, "error": f"{type(exc).__name__}: {exc}"[:200]})
    probe = engines["none"]
    requests = prompts(model, probe.tokenizer, int(probe.model.vocab_size), text == "repetitive",
                       4 if batch == 1 else batch)
    temperature = 1.0 if text == "unpredictable" else 0.0
    for engine in engines.values():
        run(engine, requests, tokens, temperature)  # warm-up, untimed
        engine.stats.__init__()  # in place (the sampler holds it): the draft counts of the timed runs only
    labels = list(engines)
    seconds: dict[str, list[float]] = {label: [] for label in labels}
    outputs = {}
    for round_ in range(repeats):
        for label in labels[round_ % len(labels):] + labels[:round_ % len(labels)]:
            took, outputs[label] = run(engines[label], requests, tokens, temperature)
            seconds[label].append(took)
    for label, engine in engines.items():
        identical = outputs[label] == outputs["none"] if not temperature else None
        rows.append({**row, "proposer": label, "tokens_per_s": len(requests) * tokens / min(seconds[label]),
                     "speedup": min(seconds["none"]) / min(seconds[label]),
                     "speedup_median": median(n / s for n, s in zip(seconds["none"], seconds[label])),
                     "identical": identical, **draft_metrics(engine)})
    return sorted(rows, key=lambda r: [label for label, _ in settings].index(r["proposer"]))


def markdown(rows: list[dict]) -> str:
    lines = ["| model | text | batch | proposer | tok/s | speedup, fastest | speedup, median of rounds | "
             "drafts verified | acceptance | accepted per verification | identical |",
             "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        if "error" in r:
            why = r["error"] if len(r["error"]) <= 100 else r["error"][:100] + "…"
            lines.append(f"| {r['model']} | {r['text']} | {r['batch']} | {r['proposer']} | {why} | | | | | | |")
            continue
        rate, per_step = r.get("spec_acceptance_rate"), r.get("spec_mean_accepted_tokens")
        drafted = r.get("spec_draft_tokens")
        identical = "n/a" if r.get("identical") is None else r["identical"]
        lines.append(f"| {r['model']} | {r['text']} | {r['batch']} | {r['proposer']} | {r['tokens_per_s']:.1f} | "
                     f"{r['speedup']:.2f}x | {r['speedup_median']:.2f}x | {'' if not drafted else drafted} | "
                     f"{'' if not drafted else f'{rate:.2f}'} | {'' if not drafted else f'{per_step:.2f}'} | "
                     f"{identical} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    from kvforge.benchmarks.model_dirs import model_dir

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", action="append", help="default: kvforge-tiny and bench-llama-50m")
    parser.add_argument("--tokens", type=int, default=64, help="output tokens per request")
    parser.add_argument("--num-tokens", type=int, default=4, help="draft tokens per step (speculative.num_tokens)")
    parser.add_argument("--batch", type=int, action="append", help="default: 1 and 32")
    parser.add_argument("--text", action="append", choices=TEXTS, help="default: all three")
    parser.add_argument("--repeats", type=int, default=5,
                        help="timed rounds, every configuration once each (default: 5)")
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    for model in args.model or ["kvforge-tiny", "bench-llama-50m"]:
        path = str(model_dir(model))
        for text in args.text or TEXTS:
            for batch in args.batch or [1, 32]:
                found = measure(model, path, batch=batch, text=text, tokens=args.tokens,
                                num_tokens=args.num_tokens, repeats=args.repeats)
                print("\n".join(markdown(found).splitlines()[2:]), flush=True)
                rows += found
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    print(markdown(rows))


if __name__ == "__main__":
    main()


# pytest-benchmark: `pytest benchmarks/bench_speculative.py --benchmark-only` (BENCH_MODEL picks the model).

def pytest_generate_tests(metafunc):
    if "batch" in metafunc.fixturenames:
        metafunc.parametrize("batch", [1, 32])
        metafunc.parametrize("text", TEXTS)


def test_every_proposer_against_none(benchmark, batch, text):
    """The rows of `measure` in extra_info; times the whole comparison."""
    import os

    from kvforge.benchmarks.model_dirs import model_dir

    model = os.environ.get("BENCH_MODEL", "kvforge-tiny")
    rows = benchmark.pedantic(lambda: measure(model, str(model_dir(model)), batch=batch, text=text,
                                              tokens=32, num_tokens=4, repeats=1), rounds=1, iterations=1)
    benchmark.extra_info["rows"] = rows
