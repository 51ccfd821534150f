"""What a speculative verification step costs against a plain decode step, per
proposer, split into the step's phases.

Each configuration (no speculation, then every proposer with fixed drafting, so
that every step it can drafts `--num-tokens` per request) decodes `--batch`
greedy requests whose output loops (the bench's repetitive text: prompt lookup
finds a draft at nearly every step). Only the steps that matter are kept: for
no speculation its pure decode steps, for a proposer its steps that verified at
least three quarters of the most drafts the batch may take (at batch 1 all 4; at
32 prompt lookup seldom finds a draft for every request at once), with their
mean drafts. Phases (µs per kept step, this thread's CPU
time, `step_profile.StepClock`): propose (the proposer and the drafting
policy), build inputs, forward + logits (with the model's plan), sample (the
verification), and the rest (scheduling, applying the result, outputs). The
best of `--repeats` rounds is reported.

    python -m kvforge.benchmarks.spec_step_split --model kvforge-tiny --batch 1 32
"""

from __future__ import annotations

import argparse

import torch

from .bench_speculative import REPETITIVE_TEXT, engine_for, proposers
from .machine import EVERY_STEP
from .step_profile import StepClock

COLUMNS = ("propose", "build inputs", "forward + logits", "sample", "rest")


def kept_steps(engine, clock: StepClock, requests: list[list[int]], tokens: int, most_drafts: int) -> list[dict]:
    """Run `requests` to `tokens` output tokens each, all admitted at once; each kept
    step's phases in seconds and its drafts (pure decodes verifying at least three
    quarters of `most_drafts`, or none when it is 0)."""
    from kvforge import SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, detokenize=False)
    for i, prompt in enumerate(requests):
        engine.add_request(f"split-{clock.steps}-{i}", prompt_token_ids=prompt, params=params)
    kept = []
    while engine.has_unfinished_requests():
        before, total, drafts = dict(clock.seconds), clock.total, engine.stats.num_draft_tokens
        prompt_tokens = engine.stats.num_prompt_tokens
        engine.step()
        if engine.stats.num_prompt_tokens != prompt_tokens or len(engine.scheduler.running) != len(requests):
            continue  # a prefill, or a batch already draining
        verified = engine.stats.num_draft_tokens - drafts
        if (verified < 0.75 * most_drafts) if most_drafts else verified:
            continue
        step = {label: clock.seconds[label] - before[label] for label in clock.seconds}
        step["total"], step["drafts"] = clock.total - total, verified
        kept.append(step)
    return kept


def split(steps: list[dict]) -> dict:
    """Microseconds per step of each column of `COLUMNS`, and the whole step."""
    n = len(steps)
    per = {label: sum(s[label] for s in steps) / n * 1e6 for label in steps[0] if label != "drafts"}
    row = {"propose": per.get("propose", 0.0), "build inputs": per["build inputs"],
           "forward + logits": per["plan"] + per["forward"] + per["logits"], "sample": per["sample"],
           "step": per["total"], "steps": n, "drafts": sum(s["drafts"] for s in steps) / n}
    row["rest"] = row["step"] - sum(row[c] for c in COLUMNS[:-1])
    return row


def measure(model: str, path: str, batch: int, num_tokens: int, tokens: int, repeats: int) -> list[dict]:
    settings = [("none", {})] + [(name, {"proposer": name, "num_tokens": num_tokens, "draft_policy": "fixed"})
                                 for name in proposers()]
    rows = []
    for label, speculative in settings:
        try:
            engine = engine_for(path, batch, speculative, EVERY_STEP)
        except Exception as exc:  # noqa: BLE001 - a proposer that cannot serve this model is reported
            rows.append({"model": model, "batch": batch, "configuration": label, "error": str(exc)[:120]})
            continue
        texts = [list(engine.tokenizer.encode(REPETITIVE_TEXT[i % len(REPETITIVE_TEXT)])) for i in range(batch)]
        clock = StepClock(engine)
        if engine.drafter is not None:  # the proposer and the policy, timed as a phase of the step
            clock.add_phase("propose", engine.drafter, "propose")
        most = 0 if engine.drafter is None else batch * num_tokens
        kept_steps(engine, clock, texts, tokens, most)  # warm-up
        best = None
        for _ in range(repeats):
            steps = kept_steps(engine, clock, texts, tokens, most)
            if steps and (best is None or split(steps)["step"] < best["step"]):
                best = split(steps)
        if best is None:
            rows.append({"model": model, "batch": batch, "configuration": label,
                         "error": "no step verified three quarters of the drafts it may"})
            continue
        rows.append({"model": model, "batch": batch, "configuration": label, **best})
    plain = next((r["step"] for r in rows if r["configuration"] == "none" and "step" in r), None)
    for row in rows:
        if "step" in row and plain:
            row["x_plain"] = row["step"] / plain
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| model | batch | configuration | steps kept | drafts per step | step µs | × plain | "
             + " | ".join(COLUMNS) + " |", "|---|---:|---|---:|---:|---:|---:|" + "---:|" * len(COLUMNS)]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['batch']} | {r['configuration']} | {r['error']} |" + " |" * 8)
            continue
        lines.append(f"| {r['model']} | {r['batch']} | {r['configuration']} | {r['steps']} | {r['drafts']:.1f} | "
                     f"{r['step']:,.0f} | "
                     f"{r.get('x_plain', float('nan')):.2f} | " + " | ".join(f"{r[c]:,.0f}" for c in COLUMNS) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    from kvforge.benchmarks.model_dirs import model_dir

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="kvforge-tiny")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--num-tokens", type=int, default=4, help="drafts per request (speculative.num_tokens)")
    parser.add_argument("--tokens", type=int, default=128, help="output tokens per request and round")
    parser.add_argument("--repeats", type=int, default=3, help="rounds; the fastest is reported")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    for batch in args.batch:
        rows += measure(args.model, str(model_dir(args.model)), batch, args.num_tokens, args.tokens, args.repeats)
    print(markdown(rows))


if __name__ == "__main__":
    main()
