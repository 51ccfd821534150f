"""What the tensor- and pipeline-parallel tests share: small random Llamas, one
run of a few prompts through a fresh engine, and the comparisons."""

from __future__ import annotations

import random
import threading

import pytest
import torch

from kvforge import LLM, LLMEngine, SamplingParams
from kvforge.core import EngineConfig

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=1)
COMMON = {"device": "cpu", "dtype": "float32", "seed": 0}
HANG_GUARD_S = 120  # a test thread still running after this has hung: the property under test failed
PROMPTS = [[random.Random(i).randrange(128) for _ in range(n)] for i, n in enumerate([1, 5, 19, 33, 7])]


def llama_dir(tmp_path_factory, num_kv_heads: int) -> str:
    """A random 2-layer Llama with 4 query heads and `num_kv_heads` KV heads, saved as a Hugging Face directory."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=num_kv_heads, max_position_embeddings=128, initializer_range=0.2,
        bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(num_kv_heads)
    path = tmp_path_factory.mktemp(f"llama_kv{num_kv_heads}")
    transformers.LlamaForCausalLM(config).eval().save_pretrained(path)
    return str(path)


def run(model: str, parallel: dict | None = None, **sections):
    """The greedy tokens of PROMPTS with their summed logprobs, plus (weight bytes, KV bytes)
    per rank, from a fresh engine with these `parallel` settings. A small step budget and a
    small cache make prompts prefill in chunks and requests preempt."""
    cache = {"num_blocks": 64, "block_size": 4, **sections.pop("cache", {})}
    llm = LLM(model, **COMMON, cache=cache, scheduler={"max_num_batched_tokens": 16},
              parallel={"collective_timeout_s": 60, **(parallel or {})}, **sections)
    try:
        outputs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)
        tokens = [(o.outputs[0].token_ids, o.outputs[0].cumulative_logprob) for o in outputs]
        engine = llm.engine
        memory = engine.executor.memory if engine.executor is not None else [
            (engine.model.weight_bytes(), sum(c.numel() * c.element_size() for c in engine.runner.kv_caches))]
        return tokens, memory
    finally:
        llm.engine.shutdown()


def assert_same(two, one) -> None:
    """The same tokens, and logprobs equal up to float32 summation order (an all-reduce adds
    the ranks' partial sums in another order than one GEMM): a rank that attends to wrong
    keys moves them far more, even where the argmax survives."""
    assert [tokens for tokens, _ in two] == [tokens for tokens, _ in one]
    assert [lp for _, lp in two] == pytest.approx([lp for _, lp in one], abs=1e-3)


def assert_half(part: int, whole: int, slack: float) -> None:
    assert whole / 2 <= part <= whole / 2 * (1 + slack), (part, whole)


def started_engine(parallel: dict) -> LLMEngine:
    """A 2-rank engine on kvforge-tiny two steps into a long request."""
    config = EngineConfig.model_validate({**COMMON, "model": "kvforge-tiny", "cache": {"num_blocks": 64},
                                          "parallel": parallel})
    engine = LLMEngine(config)
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=200, ignore_eos=True))
    engine.step()
    engine.step()
    return engine


def step_in_thread(engine: LLMEngine) -> BaseException | None:
    """Step `engine` until it fails or finishes, in a thread, then shut it down; the error it raised."""
    caught: list[BaseException] = []

    def target():
        try:
            while engine.has_unfinished_requests():
                engine.step()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            caught.append(exc)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    try:
        thread.join(HANG_GUARD_S)
        assert not thread.is_alive(), "the engine hung after a worker failed"
    finally:
        engine.shutdown()
    return caught[0] if caught else None
