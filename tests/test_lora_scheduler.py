"""The scheduler's LoRA admission rule (at most `max_loras` distinct adapters among
the running requests; requests of a further adapter wait, keeping their place,
while others go past) and adapter identity in the prefix cache's block hashes."""

from __future__ import annotations

from types import SimpleNamespace

from kvforge import SamplingParams
from kvforge.core import BLOCK_ALLOCATOR, SCHEDULER_POLICY, build_registry
from kvforge.engine.kv_cache_manager import KVCacheManager
from kvforge.engine.lora_request import LoRARequest
from kvforge.engine.request import Request
from kvforge.engine.scheduler import Scheduler
from kvforge.engine.scheduler_output import SampledTokens, SamplerOutput

REGISTRY = build_registry()
_arrivals = iter(range(10**9))


def make(max_loras, num_blocks=64, max_num_seqs=8, prefix_caching=False):
    allocator = REGISTRY.get(BLOCK_ALLOCATOR, "default").cls(num_blocks, 4)
    kv = KVCacheManager(allocator, 4, prefix_caching)
    return Scheduler(REGISTRY.get(SCHEDULER_POLICY, "fcfs").cls(), kv, max_num_seqs=max_num_seqs,
                     max_num_batched_tokens=256, max_loras=max_loras)


def request(name, adapter=None, max_tokens=3, prompt=(1, 2, 3, 4, 5), fingerprint="f") -> Request:
    lora = None if adapter is None else LoRARequest(adapter, 1 + ord(adapter[0]), f"/adapters/{adapter}")
    return Request(name, list(prompt), SamplingParams(max_tokens=max_tokens, temperature=0.0),
                   arrival_index=next(_arrivals), lora_request=lora,
                   lora_adapter=None if lora is None else SimpleNamespace(fingerprint=fingerprint))


def step(s: Scheduler) -> list[str]:
    out = s.schedule()
    s.update_from_output(out, SamplerOutput({e.request.request_id: SampledTokens([7]) for e in out.scheduled if e.samples}))
    return [e.request.request_id for e in out.scheduled]


def running_adapters(s: Scheduler) -> set[int]:
    return {r.lora_id for r in s.running if r.lora_request is not None}


def test_requests_of_a_further_adapter_wait_while_others_go_past():
    s = make(max_loras=2)
    for name, adapter in [("a1", "a"), ("b1", "b"), ("c1", "c"), ("base", None), ("a2", "a")]:
        s.add(request(name, adapter))
    first = step(s)
    assert first == ["a1", "b1", "base", "a2"], "c1 is a third adapter: it waits, the base and a's second go past"
    assert [r.request_id for r in s.waiting] == ["c1"]
    seen = set(first)
    while s.has_unfinished():
        assert len(running_adapters(s)) <= 2
        seen |= set(step(s))
    assert "c1" in seen, "the held-back request ran once an adapter's requests finished"


def test_without_max_loras_every_adapter_runs_at_once():
    s = make(max_loras=None)
    for name, adapter in [("a1", "a"), ("b1", "b"), ("c1", "c")]:
        s.add(request(name, adapter))
    assert step(s) == ["a1", "b1", "c1"]


def test_a_held_back_request_keeps_its_place_ahead_of_later_ones_of_its_adapter():
    s = make(max_loras=1)
    s.add(request("a1", "a", max_tokens=2))
    s.add(request("b1", "b"))
    s.add(request("b2", "b"))
    assert step(s) == ["a1"]
    assert [r.request_id for r in s.waiting] == ["b1", "b2"]
    while "b1" not in step(s):
        pass
    assert {r.request_id for r in s.running} == {"b1", "b2"}


def test_adapter_and_its_weights_key_the_prefix_cache():
    s = make(max_loras=4, prefix_caching=True)
    prompt = tuple(range(1, 17))  # four full blocks
    first = request("first", "a", max_tokens=1, prompt=prompt, fingerprint="weights-1")
    s.add(first)
    while s.has_unfinished():
        step(s)

    def hits(req) -> int:
        computed = s.kv.admit(req.request_id, req.all_token_ids, req.prefix_extra_keys())
        s.kv.free(req.request_id)
        return computed

    assert hits(request("same", "a", prompt=prompt, fingerprint="weights-1")) > 0
    assert hits(request("reloaded", "a", prompt=prompt, fingerprint="weights-2")) == 0, \
        "an adapter reloaded with other weights under the same name reused stale KV"
    assert hits(request("other", "b", prompt=prompt, fingerprint="weights-1")) == 0
    assert hits(request("base", None, prompt=prompt)) == 0
