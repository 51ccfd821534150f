"""The `structured` scenario of `kvforge bench`: what structured outputs cost.

* Runs (each engine in its own process, through the harness): kvforge
  constrained by xgrammar and unconstrained, at batch 32 and batch 1, and
  vLLM's CPU build both ways at batch 32. Every request carries a schema from
  the structured conformance corpus, wrapped as an array of at least
  `MIN_ITEMS` such items: no document completes within `max_tokens`, so the
  constrained runs generate exactly `max_tokens` per request, as the
  unconstrained ones do with EOS ignored. Throughput ratios compare equal
  token counts on the same prompts. JSON is compact in both engines (kvforge's
  default; vLLM is configured so), so they follow the same grammar.
* After the runs (`figures`): each constrained run's outputs checked (every
  complete item of the array validates against the item schema; `jsonschema`
  judges), the constrained/unconstrained ratios, the engine's own mask time
  per step, each backend's compile time per schema (cold: a fresh backend;
  cached: the same spec again) on the model's vocabulary, compile latency as
  its own part of TTFT (one request at a time in an engine per backend, without
  a spec, with a cold one and a cached one: structured_ttft.py), and where the
  mask time goes at batch 32 (filling one row per request, applying the batch).
"""

from __future__ import annotations

import functools
import json
import random
from pathlib import Path

from .scenarios import Run, Scenario, Target, _ids, request
from .structured_costs import compile_times, mask_profile
from .structured_ttft import ttft_parts

SCHEMAS = ("person", "tool_call", "order", "tree_defs", "event", "shape_oneof", "nullable_nested", "matrix",
           "object/all_required[8]", "nested/depth4")
"""The corpus schemas measured (conformance/structured_corpus.py); --quick takes the first four."""
MIN_ITEMS = 1024
"""An item and its comma take at least two tokens: 1024 items outlast any `max_tokens` here."""
BIG_BATCH = 32
BACKEND = "xgrammar"  # the runs' backend: the default, and vLLM's default on CPU
SUBJECT = f"kvforge structured b{BIG_BATCH}"
PAIRS = {  # figure -> (constrained run, unconstrained run)
    f"kvforge batch {BIG_BATCH}": (SUBJECT, f"kvforge unconstrained b{BIG_BATCH}"),
    "kvforge batch 1": ("kvforge structured b1", "kvforge unconstrained b1"),
    f"vLLM CPU batch {BIG_BATCH}": ("vLLM CPU structured", "vLLM CPU unconstrained"),
}


def cases(quick: bool) -> list:
    """The corpus cases of `SCHEMAS` (the first four with `quick`)."""
    from kvforge.conformance.structured_corpus import corpus

    by_name = {case.name: case for case in corpus()}
    return [by_name[name] for name in SCHEMAS[:4 if quick else None]]


def long_schema(item: dict) -> dict:
    """An array of at least `MIN_ITEMS` of `item`; its `$defs` move to the root, where its references point."""
    item = dict(item)
    defs = item.pop("$defs", None)
    return {**({"$defs": defs} if defs else {}), "type": "array", "items": item, "minItems": MIN_ITEMS}


def long_specs(chosen: list) -> list:
    """The specs the runs send: each case's schema as `long_schema`."""
    from kvforge.core import StructuredOutputSpec
    from kvforge.core.structured_output import JSON

    return [StructuredOutputSpec(JSON, json.dumps(long_schema(json.loads(c.spec.value)))) for c in chosen]


def item_schema(long: dict) -> dict:
    """The item schema of `long_schema(item)`, its `$defs` back in place."""
    return {**long["items"], **({"$defs": long["$defs"]} if "$defs" in long else {})}


def scenario(vocab: int, quick: bool, seed: int = 0) -> Scenario:
    rng = random.Random(seed + 5)
    n, prompt_max, output = (BIG_BATCH, 32, 48) if quick else (BIG_BATCH, 128, 128)
    items = [json.loads(case.spec.value) for case in cases(quick)]
    requests = [dict(request(i, _ids(rng, rng.randint(16, prompt_max), vocab), output),
                     json_schema=long_schema(items[i % len(items)])) for i in range(n)]
    constrained = {"structured_outputs": {"backend": BACKEND}}
    runs = []
    for batch in (BIG_BATCH, 1):
        scheduler = {"scheduler": {"max_num_seqs": batch}}
        runs += [Run(f"kvforge structured b{batch}", "kvforge", {**constrained, **scheduler}),
                 Run(f"kvforge unconstrained b{batch}", "kvforge", scheduler)]
    runs += [Run("vLLM CPU structured", "vllm", {"max_num_seqs": BIG_BATCH, "structured_outputs_backend": BACKEND}),
             Run("vLLM CPU unconstrained", "vllm", {"max_num_seqs": BIG_BATCH})]
    targets = [Target(f"structured: <= 10% throughput cost at batch {BIG_BATCH} ({BACKEND})", SUBJECT,
                      f"kvforge unconstrained b{BIG_BATCH}", "throughput", 0.90),
               Target("structured: >= 1.0x vLLM CPU structured output tokens/s", SUBJECT, "vLLM CPU structured",
                      "throughput", 1.0)]
    note = (f"Every request is constrained ({BACKEND}) to an array of at least {MIN_ITEMS} items of one of "
            f"{len(items)} corpus schemas, so it generates exactly {output} tokens, as the unconstrained runs do "
            "with EOS ignored; the same prompts everywhere. JSON compact (no whitespace between tokens) in both "
            "engines. TTFT of a constrained run includes waiting for its grammar (the first request of each "
            "schema compiles it).")
    return Scenario("structured", requests, runs, SUBJECT, targets, note=note,
                    figures=functools.partial(figures, quick=quick))


# After the runs


def figures(summary: dict, scenario_dir: Path, model_dir: Path, *, quick: bool) -> dict:
    """The scenario's own figures, under `structured` in its summary."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    vocabulary = model_vocabulary(tokenizer, model_dir)
    chosen = cases(quick)
    runs = {run["label"]: (i, run) for i, run in enumerate(summary["runs"])}
    workload = json.loads((Path(scenario_dir) / "workload.json").read_text())
    requests = {r["id"]: r for r in workload["requests"]}
    constrained = {pair[0] for pair in PAIRS.values()}
    outputs = {}
    for label, (i, run) in runs.items():
        if run["status"] == "ok" and label in constrained:
            result = json.loads((Path(scenario_dir) / f"run{i}.json").read_text())
            outputs[label] = check_outputs(result, requests, tokenizer)
    return {"structured": {
        "schemas": [case.name for case in chosen], "min_items": MIN_ITEMS, "backend": BACKEND,
        "outputs": outputs,
        "overhead": overhead({label: run for label, (_, run) in runs.items()}),
        "compile": compile_times(vocabulary, chosen, rounds=1 if quick else 3),
        "compile_in_ttft": ttft_parts(model_dir, [json.loads(case.spec.value) for case in chosen],
                                      rounds=1 if quick else 3),
        "mask_profile": mask_profile(vocabulary, long_specs(chosen), BIG_BATCH, steps=8 if quick else 32),
    }}


def model_vocabulary(tokenizer, model_dir: Path):
    """The model's `Vocabulary`, as the engine builds it."""
    from kvforge.engine.vocabulary import vocabulary_of

    config = json.loads((Path(model_dir) / "config.json").read_text())
    return vocabulary_of(tokenizer, int(config["vocab_size"]), tokenizer.eos_token_id)


def check_outputs(result: dict, requests: dict[str, dict], tokenizer) -> dict:
    """Each request's output, an array cut by `max_tokens`, judged item by item:
    every complete item (one followed by a comma) must validate against the item
    schema; the text must be well formed up to its last complete item."""
    import jsonschema

    count = items = invalid = malformed = 0
    exact = True
    for record in result["requests"]:
        request = requests[record["id"]]
        count += 1
        exact &= record["output_tokens"] == request["max_tokens"]
        text = tokenizer.decode(record["token_ids"])
        documents, well_formed = complete_items(text)
        malformed += not well_formed
        validator = jsonschema.Draft202012Validator(item_schema(request["json_schema"]))
        items += len(documents)
        invalid += sum(not validator.is_valid(d) for d in documents)
    return {"requests": count, "complete_items": items, "invalid_items": invalid, "malformed": malformed,
            "all_max_tokens": exact, "valid": invalid == 0 and malformed == 0}


def complete_items(text: str) -> tuple[list, bool]:
    """The items of a JSON array that `text` begins, each followed by a comma; and
    whether the text is well formed up to the last of them (an opening bracket,
    items separated by commas)."""
    decoder = json.JSONDecoder()
    at = _skip_space(text, 0)
    if at == len(text):
        return [], True
    if text[at] != "[":
        return [], False
    at, found = at + 1, []
    while True:
        at = _skip_space(text, at)
        try:
            item, end = decoder.raw_decode(text, at)
        except ValueError:
            return found, True  # the item max_tokens cut
        end = _skip_space(text, end)
        if end == len(text):
            return found, True  # an item that may go on (a number cut short)
        if text[end] != ",":
            return found, False
        found.append(item)
        at = end + 1


def _skip_space(text: str, at: int) -> int:
    while at < len(text) and text[at] in " \t\n\r":
        at += 1
    return at


def overhead(runs: dict[str, dict]) -> dict[str, dict]:
    """Per pair: constrained tokens/s over unconstrained (wall and per CPU second),
    and the constrained run's mask time per step from the engine's metrics."""
    out = {}
    for name, (constrained, free) in PAIRS.items():
        a, b = runs.get(constrained), runs.get(free)
        if not (a and b and a["status"] == "ok" and b["status"] == "ok"):
            continue
        ma, mb = a["metrics"], b["metrics"]
        entry = {"constrained": constrained, "unconstrained": free,
                 "constrained_tokens_per_s": ma["tokens_per_s"], "unconstrained_tokens_per_s": mb["tokens_per_s"],
                 "ratio": ma["tokens_per_s"] / mb["tokens_per_s"],
                 "ratio_cpu": (ma["tokens_per_cpu_s"] / mb["tokens_per_cpu_s"]
                               if ma.get("tokens_per_cpu_s") and mb.get("tokens_per_cpu_s") else None)}
        engine = a.get("info", {}).get("metrics") or {}
        if engine.get("structured_mask_steps"):
            entry["mask_ms_per_step"] = 1e3 * engine["structured_mask_seconds_sum"] / engine["structured_mask_steps"]
            entry["mask_steps"] = engine["structured_mask_steps"]
            entry["mask_fraction"] = engine["structured_mask_seconds_sum"] / a["metrics"]["elapsed_s"]
        out[name] = entry
    return out


# The report


def markdown(figures: dict) -> list[str]:
    lines = [f"Schemas: {', '.join(f'`{name}`' for name in figures['schemas'])} (conformance corpus); in the "
             f"runs each as the items of an array of at least {figures['min_items']}.", ""]
    lines += ["Throughput constrained over unconstrained (same prompts, same token counts):", "",
              "| pair | constrained tok/s | unconstrained tok/s | ratio | per CPU second | mask ms/step "
              "| mask share of run |", "|---|---:|---:|---:|---:|---:|---:|"]
    for name, e in figures["overhead"].items():
        mask = f"{e['mask_ms_per_step']:.2f}" if "mask_ms_per_step" in e else "–"
        share = f"{e['mask_fraction']:.1%}" if "mask_fraction" in e else "–"
        cpu = f"{e['ratio_cpu']:.3f}" if e.get("ratio_cpu") else "–"
        lines.append(f"| {name} | {e['constrained_tokens_per_s']:.1f} | {e['unconstrained_tokens_per_s']:.1f} "
                     f"| {e['ratio']:.3f} | {cpu} | {mask} | {share} |")
    lines += ["", "Outputs of the constrained runs (complete items judged by `jsonschema`):", "",
              "| run | requests | all generated max_tokens | complete items | invalid items | malformed |",
              "|---|---:|---|---:|---:|---:|"]
    for label, o in figures["outputs"].items():
        lines.append(f"| {label} | {o['requests']} | {'yes' if o['all_max_tokens'] else 'no'} "
                     f"| {o['complete_items']} | {o['invalid_items']} | {o['malformed']} |")
    compiled = figures["compile"]
    names = list(compiled)
    lines += ["", "Compile time per schema, ms (median; cold: a fresh backend; cached: the same spec again):", "",
              "| schema | " + " | ".join(f"{n} cold | {n} cached" for n in names) + " |",
              "|---|" + "---:|---:|" * len(names)]
    for schema in figures["schemas"]:
        cells = []
        for n in names:
            spec = compiled[n]["specs"][schema]
            if "refused" in spec:
                cells += ["refused", ""]
            else:
                cells += [f"{spec['cold_ms']['median']:.2f}", f"{spec['cached_ms']['median']:.3f}"]
        lines.append(f"| `{schema}` | " + " | ".join(cells) + " |")
    setup = " | ".join(f"{compiled[n]['setup_ms']:.0f} | " for n in names)
    lines.append(f"| set-up on the vocabulary | {setup} |")
    lines += compile_in_ttft_lines(figures.get("compile_in_ttft") or {})
    profile = figures.get("mask_profile") or {}
    if profile:
        lines += ["", "Where mask time goes, per step of a batch of grammars (ms, medians, in this process):", "",
                  "| backend | batch | fill all rows | per row µs | apply | reference apply, same bitmask "
                  "| accept tokens |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        for n, p in profile.items():
            lines.append(f"| {n} | {p['batch']} | {p['fill_ms']:.3f} | {p['fill_us_per_row']:.1f} "
                         f"| {p['apply_ms']:.3f} | {p['apply_reference_ms']:.3f} | {p['accept_ms']:.3f} |")
    return lines + [""]


def compile_in_ttft_lines(parts: dict) -> list[str]:
    """The table of compile latency within TTFT, one row per backend."""
    if not parts:
        return []
    lines = ["", "Compile latency within TTFT, ms (one request at a time, 32-token prompt, first token; medians; "
             "compile as the engine's metric recorded it; share: compile over that request's TTFT):", "",
             "| backend | TTFT, no spec | TTFT, cold spec | compile, cold | share | TTFT, cached spec "
             "| compile, cached | share | first structured request (set-up) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, p in parts.items():
        ttft, compiled, share = p["ttft_ms"], p["compile_ms"], p["compile_share"]
        lines.append(f"| {name} | {ttft['none']['median']:.1f} | {ttft['cold']['median']:.1f} "
                     f"| {compiled['cold']['median']:.2f} | {share['cold']:.0%} | {ttft['cached']['median']:.1f} "
                     f"| {compiled['cached']['median']:.2f} | {share['cached']:.0%} | {p['first_request_ms']:.0f} |")
    return lines
