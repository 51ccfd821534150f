"""Multi-step decoding: several decode steps per scheduler step.

A decode step at batch 1 on a small model spends a share of its time outside
the model that counts (docs/benchmarks.md, "batch1"): scheduling, applying the
result (stop checks, cached blocks) and building output objects. With
`scheduler.num_scheduler_steps = K` (16 by default) the engine runs a *burst*
of up to K forward passes when every scheduled request decodes
plainly, and pays that work once per burst (vLLM's multi-step scheduling does
the same). Within a burst each pass feeds every request the token the pass
before sampled (`ModelRunner.execute_next`); the scheduler reserved KV blocks
for all K positions beforehand (`Scheduler.reserve_steps`), and the K tokens
are applied together, with the stop checks token by token, as accepted drafts
are. Where the model's C++ decoder stack runs its LM head too, the whole
burst is one C++ call (`cpp_burst`: forward, head and each row's token per
pass, no Python between passes): the greedy token (`ModelRunner.greedy_burst`),
or, when a request samples, the sampler's own C++ draw
(`ModelRunner.sampled_burst`, kernels/sample_rows.cpp) with every pass's
uniform numbers drawn beforehand from the same generators in the same order.

Output is the same as one step at a time: each pass samples its rows exactly
as a plain step does (the same greedy rows, the same draws from the same
generators, in the same order). A request that stops inside a burst keeps the
tokens up to its stop; the passes after it are wasted work for it (the burst
ends early once every request has sampled an EOS or stop token id).

A burst runs only where nothing of a step depends on the tokens before it
beyond the model's input (`burst_length`): every entry a plain decode
(`step_sampling.samples_raw_rows`: no drafts, forks, grammar, penalties, logit
bias, logprobs or `min_tokens` still to reach) of a request that has its first
token already, so time to first token never waits for a burst; and none while
other requests wait to be scheduled. Penalties (repetition, presence,
frequency) are allowed where the burst runs in C++ (`ModelRunner.bursts_in_cpp`):
its sampled burst applies them over each request's history as it grows
(kernels/row_penalties.h), as the sampler does step by step (a burst the stack
then refuses runs one pass). A burst also ends after the pass that
brings its time to `scheduler.max_burst_s`, so a request that arrives during one
starts at most about that late, and a stream's outputs arrive at most about that
far apart, whatever the model's size.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from .sampler import LARGEST_FLOAT, Sampler, burst_uniforms, row_settings
from .scheduler_output import SampledTokens, SamplerOutput, ScheduledRequest, SchedulerOutput
from .step_sampling import samples_raw_rows


def burst_length(scheduled: Sequence[ScheduledRequest], max_steps: int, max_model_len: int,
                 others_wait: bool = False, penalties: bool = False) -> int:
    """How many decode steps this step's entries may run in one burst: 1 while
    `others_wait` (requests not scheduled wait for a slot or for blocks, which a
    request finishing inside a burst would free only at its end) or unless every
    entry is a plain decode of a request past its first token (with `penalties`,
    one with repetition, presence or frequency penalties counts as plain: the
    burst runs in C++, which keeps each request's history as it grows); else
    `max_steps`, capped where a request would reach `max_tokens` or the model's
    context (the last pass computes position `max_model_len - 1` at most)."""
    steps = max_steps
    if steps <= 1 or not scheduled or others_wait:
        return 1
    for entry in scheduled:
        request = entry.request
        if (entry.num_tokens != 1 or entry.draft_token_ids or not request.output_token_ids
                or entry.num_prompt_logit_rows or not samples_raw_rows(entry, penalties)):
            return 1
        steps = min(steps, request.params.max_tokens - len(request.output_token_ids),
                    max_model_len - request.num_tokens + 1)
    return max(1, steps)


def run_burst(runner, sampler, plan: SchedulerOutput, steps: int, lora_slots: Sequence[int] | None,
              max_seconds: float) -> SamplerOutput:
    """Up to `steps` decode steps of `plan`'s entries (`burst_length` of them at
    most, their blocks reserved), sampled by `sampler` (a `StepSampler`) one pass
    at a time; every request's tokens, in order, as one `SamplerOutput`. The burst
    ends after the pass that brings its time to `max_seconds`.

    A pass whose logits hold a NaN or an infinity ends the burst before it: its
    tokens are dropped, so the requests it concerns are set aside by the next
    step as by a plain one (or by this one, when it is the first pass)."""
    scheduled = plan.scheduled
    requests = [entry.request for entry in scheduled]
    stop_ids = [{request.eos_token_id, *request.params.stop_token_ids} - {None} for request in requests]
    # One C++ call where the model's decoder stack runs its head; a burst it shortens
    # at a stop token another request listed is only shorter.
    steps_tokens = cpp_burst(runner, sampler.sampler, scheduled, steps, sorted(set().union(*stop_ids)), max_seconds)
    if steps_tokens:  # (empty: the first step's logits were not finite, which the path below reports)
        return SamplerOutput({request.request_id: SampledTokens([tokens[i] for tokens in steps_tokens])
                              for i, request in enumerate(requests)})
    if any(request.params.uses_penalties for request in requests):
        steps = 1  # the sampler reads a request's output so far, which grows only when the burst is applied
    began = time.perf_counter()
    emitted: list[list[int]] = [[] for _ in scheduled]
    stopped = [False] * len(scheduled)
    tokens: list[int] = []
    for step in range(steps):
        logits = (runner.execute(scheduled, lora_slots=lora_slots) if step == 0
                  else runner.execute_next(scheduled, tokens, lora_slots=lora_slots))
        out = sampler.sample(plan, logits)
        if out.non_finite:
            if step == 0:
                return out
            break
        tokens = [out.tokens[request.request_id].token_ids[0] for request in requests]
        for i, token in enumerate(tokens):
            emitted[i].append(token)
            stopped[i] = stopped[i] or token in stop_ids[i]
        if all(stopped) or time.perf_counter() - began >= max_seconds:
            break
    return SamplerOutput({request.request_id: SampledTokens(ids) for request, ids in zip(requests, emitted)})


def cpp_burst(runner, sampler: Sampler, scheduled: Sequence[ScheduledRequest], steps: int, stop_ids: list[int],
              max_seconds: float) -> list[list[int]] | None:
    """The burst's tokens, step after step, from one call of the model's C++
    decoder stack (`ModelRunner.greedy_burst`, or `sampled_burst` when a request
    samples: the uniform numbers of every pass drawn beforehand, as the passes
    would draw them one by one, and the generators then left as after the passes
    that ran); None where it cannot run (the caller runs the passes in Python)."""
    requests = [entry.request for entry in scheduled]
    params = [request.params for request in requests]
    greedy, penalized = all(p.greedy for p in params), any(p.uses_penalties for p in params)
    if greedy and not penalized:
        return runner.greedy_burst(scheduled, steps, stop_ids, max_seconds)
    if not runner.bursts_in_cpp:
        return None
    if greedy:  # penalized greedy rows: a step of greedy rows draws no numbers
        u, keep = torch.zeros(steps, len(requests), dtype=torch.float64), lambda passes: None
    else:
        drawn = burst_uniforms(requests, sampler.generator(torch.device("cpu")), steps)
        if drawn is None:
            return None
        u, keep = drawn
    steps_tokens = runner.sampled_burst(scheduled, steps, stop_ids, max_seconds, row_settings(params), u,
                                        penalty_history(requests))
    keep(len(steps_tokens) if steps_tokens is not None else 0)
    return steps_tokens


def penalty_history(requests: Sequence) -> tuple:
    """`(repetition, presence, frequency, prompt_tokens, output_tokens)` of the
    requests, as `DecoderStack.decode_sampled` takes them: each row's penalties and,
    for a row with any, its prompt and output tokens so far (int64; empty for the others)."""
    empty = torch.empty(0, dtype=torch.int64)
    prompt_tokens, output_tokens = [], []
    for request in requests:
        uses = request.params.uses_penalties
        prompt_tokens.append(torch.tensor(request.prompt_token_ids, dtype=torch.int64) if uses else empty)
        output_tokens.append(torch.tensor(request.output_token_ids, dtype=torch.int64) if uses else empty)
    return ([float(min(r.params.repetition_penalty, LARGEST_FLOAT)) for r in requests],
            [float(r.params.presence_penalty) for r in requests], [float(r.params.frequency_penalty) for r in requests],
            prompt_tokens, output_tokens)
