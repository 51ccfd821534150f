"""Keeping drafts inside the context is the engine's duty (guarantee 4 of
`kvforge.core.SpeculativeProposer`): a proposer that drafts past the target's
context is cut to what the context leaves, so no draft is ever verified at a
position the model does not have, and the output is the output without speculation."""

from __future__ import annotations

import sys
from pathlib import Path

from kvforge import SamplingParams
from kvforge.core import DraftProposal, SpeculativeProposer, build_registry, hookimpl

sys.path.insert(0, str(Path(__file__).parent))  # the test-local fake model sits beside this file
from engine_fakes import FakeCausalLM, fake_engine, reference_greedy  # noqa: E402

CONTEXT = 16
MODEL = FakeCausalLM(vocab_size=12, max_model_len=CONTEXT)  # no position embedding past 15: IndexError there


class DraftsPastTheContext(SpeculativeProposer):
    """Drafts the model's greedy continuation while it fits the context, then
    repeats its last guess: always `num_tokens` drafts, whatever the context left."""

    name = "drafts-past-the-context"
    past_the_end: list[tuple[int, int]] = []  # (tokens so far, drafts) of each proposal that passed the context

    def propose(self, requests, num_tokens):
        proposals = []
        for request in requests:
            tokens = list(request.token_ids)
            fits = max(0, min(num_tokens, CONTEXT + 1 - len(tokens)))
            guess = reference_greedy(MODEL, tokens, fits) if fits else [tokens[-1]]
            drafts = (guess + [guess[-1]] * num_tokens)[:num_tokens]
            if len(tokens) + len(drafts) > CONTEXT:
                self.past_the_end.append((len(tokens), len(drafts)))
            proposals.append(DraftProposal(drafts))
        return proposals


class Plugin:
    @hookimpl
    def kvforge_implementations(self):
        return [DraftsPastTheContext]


def test_drafts_past_the_context_are_cut_by_the_engine_and_the_output_is_unchanged():
    registry = build_registry()
    registry.register_plugin(Plugin(), "test-proposers")
    engine = fake_engine(MODEL, registry=registry, speculative={"proposer": DraftsPastTheContext.name,
                                                                "num_tokens": 6})
    near_the_end, short = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3], [5, 6, 7]  # 11 of 16 positions; 3 of 16
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    engine.add_request("near", near_the_end, params)
    engine.add_request("short", short, params)
    DraftsPastTheContext.past_the_end.clear()
    done = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                done[output.request_id] = output
    # Both ran up to the context (the last token needs no position of its own), as without speculation.
    for request_id, prompt in (("near", near_the_end), ("short", short)):
        output = done[request_id]
        assert output.finish_reason == "length" and len(prompt) + len(output.token_ids) == CONTEXT + 1
        assert output.token_ids == reference_greedy(MODEL, prompt, CONTEXT + 1 - len(prompt))
    assert DraftsPastTheContext.past_the_end, "the proposer never drafted past the context: the test proves nothing"
    assert engine.metrics()["spec_accepted_tokens"] > 0
