"""The `draft_model` proposer drafts what kvforge-tiny-draft would generate, keeps
its cache in step with the request's tokens (rejected drafts leave no trace),
and refuses what it cannot serve with errors that say what to change."""

from __future__ import annotations

import json
import random

import pytest
import torch

from kvforge.conformance.check_speculative_proposer import TARGET
from kvforge.core import (
    SPECULATIVE_PROPOSER,
    ConfigError,
    ProposalRequest,
    RequestError,
    SelectionError,
    build_registry,
)
from kvforge.engine import draft_model_proposer
from kvforge.engine.draft_model_proposer import DraftModelProposer
from kvforge.models import resolve_model_dir

K = 5


def ready(target=TARGET, **options) -> DraftModelProposer:
    options.setdefault("num_blocks", 64)
    proposer = DraftModelProposer(**options)
    proposer.setup(target)
    return proposer


def random_tokens(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(length)]


@pytest.fixture(scope="module")
def draft_llm():
    from kvforge import LLM

    return LLM("kvforge-tiny-draft", device="cpu", dtype="float32", cache={"num_blocks": 64})


def greedy_continuation(llm, tokens: list[int], count: int) -> list[int]:
    from kvforge import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=count, ignore_eos=True)
    (output,) = llm.generate(prompt_token_ids=[tokens], sampling_params=params)
    return list(output.outputs[0].token_ids)


def test_registered_under_its_name():
    assert build_registry().select(SPECULATIVE_PROPOSER, "draft_model").cls is DraftModelProposer


def test_conformance_target_states_kvforge_tinys_own_facts():
    config = json.loads((resolve_model_dir(TARGET.model) / "config.json").read_text())
    assert (TARGET.vocab_size, TARGET.max_model_len) == (config["vocab_size"], config["max_position_embeddings"])


def test_greedy_drafts_are_the_draft_models_own_greedy_generation(draft_llm):
    prompts = [random_tokens(1, 1), random_tokens(2, 7), random_tokens(3, 33), list(b"def main():\n    return ")]
    requests = [ProposalRequest(f"r{i}", tokens) for i, tokens in enumerate(prompts)]
    proposals = ready().propose(requests, K)
    for tokens, proposal in zip(prompts, proposals):
        assert proposal.probs is None
        assert proposal.token_ids == greedy_continuation(draft_llm, tokens, K)


def test_drafts_after_some_are_accepted_continue_the_greedy_generation(draft_llm):
    tokens = list(b"for i in range(10):\n    print(")
    proposer = ready()
    (first,) = proposer.propose([ProposalRequest("r", tokens)], K)
    grown = tokens + first.token_ids[:2] + [ord("x")]  # two accepted, then the target's own token
    (second,) = proposer.propose([ProposalRequest("r", grown)], K)
    assert second.token_ids == greedy_continuation(draft_llm, grown, K)


def count_fed_tokens(proposer, monkeypatch) -> list[int]:
    """Tokens fed to the draft per model call, from here on."""
    fed, execute = [], proposer.runner.execute
    monkeypatch.setattr(proposer.runner, "execute",
                        lambda entries: fed.append(sum(e.num_tokens for e in entries)) or execute(entries))
    return fed


def test_only_tokens_not_yet_in_the_drafts_cache_are_fed(monkeypatch):
    tokens = random_tokens(17, 30)
    proposer = ready()
    fed = count_fed_tokens(proposer, monkeypatch)
    (first,) = proposer.propose([ProposalRequest("r", tokens)], K)
    assert fed == [30, 1, 1, 1, 1]  # the prompt, then one decode step per further draft
    fed.clear()
    proposer.propose([ProposalRequest("r", tokens + first.token_ids[:2] + [ord("x")])], K)
    assert fed == [1, 1, 1, 1, 1]  # two drafts accepted and cached: only the target's token is new
    fed.clear()
    (third,) = proposer.propose([ProposalRequest("r", tokens + first.token_ids[:2] + [ord("x")])], K)
    proposer.propose([ProposalRequest("r", tokens + first.token_ids[:2] + [ord("x")] + third.token_ids + [7])], K)
    assert fed[5] == 2  # all five accepted: the last draft was never fed, so it comes with the new token


@pytest.mark.parametrize("temperature", [0.0, 0.9])
@pytest.mark.parametrize("diverge_at", [-2, 10])  # among the drafts (a rejection), or deep in the prompt
def test_after_tokens_diverge_from_the_drafts_the_next_proposal_equals_a_fresh_proposers(temperature, diverge_at):
    tokens = random_tokens(4, 30)
    proposer = ready()
    (first,) = proposer.propose([ProposalRequest("r", tokens, temperature)], K)
    held = tokens + first.token_ids
    changed = held[:diverge_at] + [(held[diverge_at] + 1) % 256] + random_tokens(5, 3)
    request = ProposalRequest("r", changed, temperature)
    (after,) = proposer.propose([request], K)
    (fresh,) = ready().propose([request], K)
    assert after.token_ids == fresh.token_ids
    if temperature:
        assert torch.allclose(after.probs, fresh.probs, atol=1e-5)


def test_a_proposer_that_trusted_stale_cache_entries_would_be_caught(monkeypatch):
    # Why the test above can fail: trusting every held entry keeps the rejected drafts' keys.
    tokens = random_tokens(4, 30)
    proposer = ready()
    (first,) = proposer.propose([ProposalRequest("r", tokens)], K)
    changed = tokens[:10] + random_tokens(6, 24)
    (fresh,) = ready().propose([ProposalRequest("r", changed)], K)
    monkeypatch.setattr(draft_model_proposer, "common_prefix_length", lambda held, new: min(len(held), len(new)))
    (stale,) = proposer.propose([ProposalRequest("r", changed)], K)
    assert stale.token_ids != fresh.token_ids


def mixed_requests() -> list[ProposalRequest]:
    return [ProposalRequest("a", random_tokens(7, 12)), ProposalRequest("b", random_tokens(8, 3), 0.8),
            ProposalRequest("c", random_tokens(9, 41)), ProposalRequest("d", random_tokens(10, 26), 1.5)]


def assert_same_proposals(first, second):
    assert [p.token_ids for p in first] == [p.token_ids for p in second]
    for a, b in zip(first, second):
        assert (a.probs is None) == (b.probs is None)
        if a.probs is not None:
            assert torch.allclose(a.probs, b.probs, atol=1e-5)


def test_batched_proposals_equal_one_at_a_time_ones():
    requests = mixed_requests()
    batched = ready().propose(requests, K)
    alone = ready()
    assert_same_proposals(batched, [alone.propose([request], K)[0] for request in requests])


def test_chunked_catch_up_equals_one_pass():
    requests = mixed_requests()
    assert_same_proposals(ready(max_num_batched_tokens=7).propose(requests, K), ready().propose(requests, K))


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_sampled_drafts_come_with_probability_rows_that_give_them_mass(temperature):
    request = ProposalRequest("r", random_tokens(11, 20), temperature)
    (proposal,) = ready().propose([request], K)
    probs = proposal.probs
    assert probs.shape == (K, TARGET.vocab_size) and probs.dtype == torch.float32
    assert (probs >= 0).all() and torch.allclose(probs.sum(-1), torch.ones(K), atol=1e-5)
    assert (probs[torch.arange(K), torch.tensor(proposal.token_ids)] > 0).all()


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_first_probability_row_is_the_draft_models_distribution_at_the_temperature(draft_llm, temperature):
    from kvforge import SamplingParams

    tokens = random_tokens(12, 15)
    (proposal,) = ready().propose([ProposalRequest("r", tokens, temperature)], K)
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5)
    (output,) = draft_llm.generate(prompt_token_ids=[tokens], sampling_params=params)
    top = output.outputs[0].logprobs[0]  # the raw distribution's five likeliest tokens
    raw = torch.tensor(list(top.values()))
    drafted = proposal.probs[0, torch.tensor(list(top))].log()
    # softmax(logits / T): log-probability differences are the raw ones divided by T.
    assert torch.allclose((drafted - drafted[0]) * temperature, raw - raw[0], atol=1e-4)
    if temperature == 1.0:
        assert torch.allclose(drafted, raw, atol=1e-4)


def test_sampled_drafts_follow_their_probability_rows():
    # 600 requests with the same tokens differ only in their ids, so in their draws.
    tokens = random_tokens(13, 6)
    requests = [ProposalRequest(f"r{i}", tokens, 2.0) for i in range(600)]
    proposals = ready(num_blocks=1200).propose(requests, 1)
    probs = proposals[0].probs[0].double()
    drawn = torch.bincount(torch.tensor([p.token_ids[0] for p in proposals]), minlength=TARGET.vocab_size).double()
    top = probs.argsort(descending=True)[:4]  # the likeliest tokens, the rest pooled: a chi-square on 4 dof
    expected = torch.cat([probs[top], (1 - probs[top].sum()).reshape(1)]) * len(requests)
    observed = torch.cat([drawn[top], (len(requests) - drawn[top].sum()).reshape(1)])
    assert float(((observed - expected) ** 2 / expected).sum()) < 18.47  # p = 0.001


def test_same_request_and_tokens_draw_the_same_drafts():
    request = ProposalRequest("r", random_tokens(14, 10), 1.0)
    (first,) = ready().propose([request], K)
    (again,) = ready().propose([request], K)
    (other,) = ready().propose([ProposalRequest("another id", request.token_ids, 1.0)], K)
    assert first.token_ids == again.token_ids
    assert other.token_ids != first.token_ids


def test_never_drafts_past_the_targets_context():
    short = type(TARGET)(TARGET.model, TARGET.vocab_size, 20, TARGET.device, TARGET.dtype)
    proposer = ready(short)
    lengths = [15, 17, 19, 20]
    proposals = proposer.propose([ProposalRequest(f"r{n}", random_tokens(n, n)) for n in lengths], K)
    assert [len(p.token_ids) for p in proposals] == [5, 3, 1, 0]


def test_out_of_blocks_drops_only_that_requests_drafts():
    first, second = ProposalRequest("a", random_tokens(15, 10)), ProposalRequest("b", random_tokens(16, 10))
    proposer = ready(block_size=4, num_blocks=5)  # room for one request's 10 tokens and 4 drafts
    alone = ready().propose([first, second], 4)
    proposals = proposer.propose([first, second], 4)
    assert proposals[0].token_ids == alone[0].token_ids
    assert proposals[1].token_ids == []
    proposer.release("a")
    assert proposer.propose([second], 4)[0].token_ids == alone[1].token_ids


def test_release_frees_every_block_and_forgets_the_request():
    proposer = ready()
    free = proposer.kv.num_free_blocks
    requests = mixed_requests()
    before = proposer.propose(requests, K)
    assert proposer.kv.num_free_blocks < free
    for request in requests:
        proposer.release(request.request_id)
    assert proposer.kv.num_free_blocks == free and not proposer.held
    proposer.release("never seen")
    assert_same_proposals(proposer.propose(requests, K), before)


def test_draft_with_another_vocabulary_is_refused_with_both_sizes(tmp_path):
    config = json.loads((resolve_model_dir("kvforge-tiny-draft") / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "vocab_size": 300}))
    with pytest.raises(ConfigError, match=r"vocabulary of 300 tokens .* has 259"):
        ready(model=str(tmp_path))


@pytest.mark.parametrize("options, message", [
    ({"modle": "kvforge-tiny-draft"}, r"no option 'modle' \(did you mean 'model'\?\); valid options: model, "),
    ({"num_blocks": 0}, r"num_blocks = 0: Input should be greater than or equal to 1"),
    ({"num_blocks": 2.5}, r"num_blocks = 2.5: .*integer"),
    ({"block_size": True}, r"block_size = True: .*integer"),
    ({"memory_budget": "lots"}, r"memory_budget = 'lots': .*not a size"),
    ({"max_num_batched_tokens": -1}, r"max_num_batched_tokens = -1"),
])
def test_bad_options_are_refused_naming_the_option(options, message):
    with pytest.raises(ConfigError, match=message):
        DraftModelProposer(**options)


def test_setup_refuses_what_it_cannot_load():
    with pytest.raises(SelectionError, match="unknown attention_backend 'nope'; valid choices: auto, "):
        ready(attention_backend="nope")
    with pytest.raises(ConfigError, match=r"speculative.options.model: model '/no/such/dir' is neither"):
        ready(model="/no/such/dir")
    other = type(TARGET)("/models/some-llama", 32000, 4096, TARGET.device, TARGET.dtype)
    with pytest.raises(ConfigError, match="needs speculative.options.model for the target '/models/some-llama'"):
        ready(other)


def test_malformed_calls_are_refused():
    proposer = ready()
    with pytest.raises(RequestError, match=r"request ids \['a'\] appear more than once"):
        proposer.propose([ProposalRequest("a", [1, 2]), ProposalRequest("a", [1, 2])], K)
    with pytest.raises(RequestError, match=r"'a': temperature must be >= 0"):
        proposer.propose([ProposalRequest("a", [1, 2], -1.0)], K)
    with pytest.raises(RequestError, match="num_tokens must be >= 0"):
        proposer.propose([ProposalRequest("a", [1, 2])], -1)
    assert proposer.propose([ProposalRequest("a", [1, 2])], 0)[0].token_ids == []


def test_propose_before_setup_is_refused():
    with pytest.raises(RequestError, match=r"not set up; the engine calls setup\(ProposerTarget\)"):
        DraftModelProposer().propose([ProposalRequest("r", [1, 2])], K)
