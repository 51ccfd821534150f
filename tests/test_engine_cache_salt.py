"""`cache_salt`: requests with different salts never share prefix-cache blocks;
requests with the same salt (or both without one) do, and the salt never changes
what is generated."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from kvforge.core import RequestError
from kvforge.engine.sampling_params import SamplingParams

sys.path.insert(0, str(Path(__file__).parent))  # the test-local fake model sits beside this file
from engine_fakes import FakeCausalLM, fake_engine  # noqa: E402

BS = 4
PROMPT = list(range(1, 11))  # two full blocks of 4, then 2 tokens
GREEDY = SamplingParams(temperature=0, max_tokens=3)


def run_one(engine, request_id: str, salt: str | None) -> tuple[list[int], int]:
    """The request's tokens, and how many prefix-cache block hits it added."""
    hits = engine.kv.usage().hits
    engine.add_request(request_id, prompt_token_ids=PROMPT, params=GREEDY, cache_salt=salt)
    final = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            final = output
    return final.token_ids, engine.kv.usage().hits - hits


@pytest.mark.parametrize("first, second, shared", [
    ("tenant-a", "tenant-a", True),
    (None, None, True),
    ("tenant-a", "tenant-b", False),
    (None, "tenant-a", False),
    ("tenant-a", None, False),
])
def test_blocks_are_shared_only_between_equal_salts(first, second, shared):
    engine = fake_engine(FakeCausalLM(), block_size=BS)
    tokens_a, hits_a = run_one(engine, "a", first)
    tokens_b, hits_b = run_one(engine, "b", second)
    assert hits_a == 0
    assert hits_b == (2 if shared else 0), f"salts {first!r} and {second!r}: {hits_b} hits"
    assert tokens_a == tokens_b  # the salt changes what is cached, never what is generated


def test_a_salted_request_hits_its_own_cache_after_another_salt_filled_it():
    engine = fake_engine(FakeCausalLM(), block_size=BS)
    run_one(engine, "a", "x")
    assert run_one(engine, "b", "y")[1] == 0
    assert run_one(engine, "c", "x")[1] == 2 and run_one(engine, "d", "y")[1] == 2


def test_samples_of_a_salted_request_fork_without_leaking_into_unsalted_cache():
    engine = fake_engine(FakeCausalLM(), block_size=BS)
    engine.add_request("n2", prompt_token_ids=PROMPT, params=SamplingParams(temperature=0, max_tokens=3, n=2),
                       cache_salt="s")
    while engine.has_unfinished_requests():
        engine.step()
    assert run_one(engine, "plain", None)[1] == 0
    assert run_one(engine, "salted", "s")[1] == 2


@pytest.mark.parametrize("salt", ["", 7])
def test_an_invalid_salt_is_refused_and_names_the_field(salt):
    engine = fake_engine(FakeCausalLM(), block_size=BS)
    with pytest.raises(RequestError, match="cache_salt must be a non-empty string"):
        engine.add_request("r", prompt_token_ids=PROMPT, params=GREEDY, cache_salt=salt)
    assert not engine.has_unfinished_requests()
