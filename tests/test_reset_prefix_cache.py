"""`reset_prefix_cache()` through the KV cache manager, `LLMEngine` and `LLM`:
refused while requests hold blocks, and afterwards no request hits anything
computed before (vLLM's reset scenario); outputs stay the same."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from kvforge import LLM, SamplingParams
from kvforge.core import BlockStateError
from kvforge.engine.kv_cache_manager import KVCacheManager
from kvforge.plugins.block_allocators import NoCacheAllocator, PrefixCachingAllocator

sys.path.insert(0, str(Path(__file__).parent))  # the test-local fake model sits beside this file
from engine_fakes import FakeCausalLM, fake_engine  # noqa: E402

BS = 4
PROMPT = [5, 9, 2, 7, 1, 3, 3, 8, 4, 6]
GREEDY = SamplingParams(temperature=0, max_tokens=4)


def computed(kv, request_id, tokens):
    hit = kv.admit(request_id, tokens)
    assert kv.allocate_slots(request_id, len(tokens))
    kv.cache_blocks(request_id, tokens, len(tokens))
    return hit


# The manager

def test_manager_refuses_while_a_request_holds_blocks_and_names_it():
    kv = KVCacheManager(PrefixCachingAllocator(16, BS), BS, True)
    computed(kv, "held", PROMPT)
    kv.admit("empty", [1])  # admitted, but holds no block: no reason to refuse
    before = kv.usage()
    with pytest.raises(BlockStateError, match="requests hold blocks \\('held'\\); let them finish or abort them"):
        kv.reset_prefix_cache()
    assert kv.usage() == before and kv.block_table("held")


def test_manager_refusal_names_at_most_three_requests():
    kv = KVCacheManager(PrefixCachingAllocator(16, BS), BS, True)
    for request_id in "abcde":
        computed(kv, request_id, [ord(request_id)] * BS)
    with pytest.raises(BlockStateError, match="\\('a', 'b', 'c' and 2 more\\)"):
        kv.reset_prefix_cache()


def test_manager_reset_makes_the_next_admission_miss():
    kv = KVCacheManager(PrefixCachingAllocator(16, BS), BS, True)
    assert computed(kv, "a", PROMPT) == 0
    kv.free("a")
    assert computed(kv, "b", PROMPT) == 8  # hit, as without a reset
    kv.free("b")
    assert kv.reset_prefix_cache() == 2
    assert computed(kv, "c", PROMPT) == 0 and kv.usage().hits == 2


def test_vllm_reset_scenario_two_requests_sharing_a_prefix():
    # vLLM's test_reset_prefix_cache, re-expressed: 3 shared full blocks plus a partial one each.
    kv = KVCacheManager(PrefixCachingAllocator(16, BS), BS, True)
    shared = [i for i in range(3) for _ in range(BS)]
    computed(kv, "0", shared + [3] * 3)
    assert computed(kv, "1", shared + [4] * 3) == 3 * BS
    assert kv.block_table("1")[:3] == kv.block_table("0")[:3]
    with pytest.raises(BlockStateError, match="'0', '1'"):
        kv.reset_prefix_cache()
    assert kv.usage().hits == 3
    kv.free("0")
    kv.free("1")
    assert kv.reset_prefix_cache() == 3
    assert all(kv.allocator.block_hash_of(b) is None for b in range(16)) and kv.usage().cached == 0


def test_manager_over_an_allocator_without_caching_resets_to_nothing():
    kv = KVCacheManager(NoCacheAllocator(8, BS), BS, False)
    computed(kv, "a", PROMPT)
    with pytest.raises(BlockStateError, match="'a'"):
        kv.reset_prefix_cache()
    kv.free("a")
    assert kv.reset_prefix_cache() == 0


# The engine and LLM

def test_llm_reset_makes_a_repeated_prompt_recompute_with_the_same_output():
    llm = LLM.from_engine(fake_engine(FakeCausalLM(), block_size=BS))
    first = llm.generate(prompt_token_ids=[PROMPT], sampling_params=GREEDY)[0]
    second = llm.generate(prompt_token_ids=[PROMPT], sampling_params=GREEDY)[0]
    hits = llm.engine.kv.usage().hits
    assert hits > 0 and second.token_ids == first.token_ids
    assert llm.reset_prefix_cache() > 0 and llm.engine.kv.usage().cached == 0
    third = llm.generate(prompt_token_ids=[PROMPT], sampling_params=GREEDY)[0]
    assert llm.engine.kv.usage().hits == hits, "a request hit a block cached before the reset"
    assert third.token_ids == first.token_ids


def test_llm_reset_is_refused_during_a_stream_and_allowed_after():
    llm = LLM.from_engine(fake_engine(FakeCausalLM(), block_size=BS))
    stream = llm.stream(prompt_token_ids=[PROMPT], sampling_params=GREEDY)
    next(stream)
    with pytest.raises(BlockStateError, match="requests hold blocks \\('0'\\)"):
        llm.reset_prefix_cache()
    stream.close()  # aborts what it left running
    assert llm.reset_prefix_cache() >= 0 and llm.engine.kv.usage().cached == 0


def test_engine_reset_is_refused_while_running_and_works_after_an_abort():
    engine = fake_engine(FakeCausalLM(), block_size=BS)
    engine.add_request("r", prompt_token_ids=PROMPT, params=GREEDY)
    engine.step()
    with pytest.raises(BlockStateError, match="'r'"):
        engine.reset_prefix_cache()
    engine.abort_request("r")
    assert engine.reset_prefix_cache() == 2  # the prompt's two full blocks were cached in the first step
    assert engine.kv.usage().free == engine.num_blocks
