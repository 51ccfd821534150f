"""The conformance suite's distribution check has teeth: the same chi-square
test that passes the real verifier catches one that accepts drafts without
comparing them with the target."""

from __future__ import annotations

from kvforge.conformance.check_speculative_engine import engine_for, homogeneity_pvalue, sampled_continuations


class AcceptEverything:
    """A broken verifier: every draft is accepted, then the real verifier's last token."""

    def __init__(self, real):
        self.real = real

    def __call__(self, logits, requests, drafts, draft_probs, mask=None):
        verified = self.real(logits, requests, drafts, draft_probs, mask)
        verified.token_ids = [draft + [tokens[-1]] for draft, tokens in zip(drafts, verified.token_ids)]
        return verified


def test_distribution_check_detects_a_verifier_that_accepts_without_comparing():
    plain = sampled_continuations(engine_for(None, seed=1))
    honest = engine_for("ngram", seed=2)
    assert homogeneity_pvalue(plain, sampled_continuations(honest)) > 1e-3
    biased = engine_for("ngram", seed=2)
    biased.step_sampler.verifier = AcceptEverything(biased.step_sampler.verifier)
    assert homogeneity_pvalue(plain, sampled_continuations(biased)) < 1e-6
    assert biased.metrics()["spec_draft_tokens"] > 0
