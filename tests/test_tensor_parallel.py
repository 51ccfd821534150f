"""Tensor parallelism end to end, on CPU with gloo and one worker process (TP=2):
the same greedy tokens as one process, half the weights and KV per rank, and a
worker that dies or hangs fails the engine with the rank named, never a hang."""

from __future__ import annotations

import os
import random
import signal
import threading

import pytest
import torch

from kvforge import LLM, LLMEngine, SamplingParams
from kvforge.cli import main
from kvforge.core import ConfigError, DistributedError, EngineConfig

transformers = pytest.importorskip("transformers")

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=1)
COMMON = {"device": "cpu", "dtype": "float32", "seed": 0}
HANG_GUARD_S = 120  # a test thread still running after this has hung: the property under test failed


def llama_dir(tmp_path_factory, num_kv_heads: int):
    """A random 2-layer Llama with 4 query heads and `num_kv_heads` KV heads, saved as a Hugging Face directory."""
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=num_kv_heads, max_position_embeddings=128, initializer_range=0.2,
        bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(num_kv_heads)
    path = tmp_path_factory.mktemp(f"llama_kv{num_kv_heads}")
    transformers.LlamaForCausalLM(config).eval().save_pretrained(path)
    return str(path)


PROMPTS = [[random.Random(i).randrange(128) for _ in range(n)] for i, n in enumerate([1, 5, 19, 33, 7])]


def run(model: str, tp: int, **sections):
    """The greedy tokens of PROMPTS with their summed logprobs, plus (weight bytes, KV bytes) per
    rank, from a fresh engine.
    A small step budget and a small cache make prompts prefill in chunks and requests preempt."""
    cache = {"num_blocks": sections.pop("num_blocks", 64), "block_size": 4}
    llm = LLM(model, **COMMON, cache=cache, scheduler={"max_num_batched_tokens": 16},
              parallel={"tensor_parallel_size": tp, "collective_timeout_s": 60}, **sections)
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
    """The same tokens, and logprobs equal up to float32 summation order (the all-reduce adds
    the ranks' partial sums in another order than one GEMM): a rank that attends to wrong
    keys moves them far more, even where the argmax survives."""
    assert [tokens for tokens, _ in two] == [tokens for tokens, _ in one]
    assert [lp for _, lp in two] == pytest.approx([lp for _, lp in one], abs=1e-3)


def assert_half(part: int, whole: int, slack: float) -> None:
    assert whole / 2 <= part <= whole / 2 * (1 + slack), (part, whole)


@pytest.mark.slow
def test_tiny_model_gives_the_same_greedy_tokens_with_half_the_weights_and_kv_per_rank():
    one, [(weights, kv)] = run("kvforge-tiny", 1)
    two, memory = run("kvforge-tiny", 2)
    assert_same(two, one)
    assert len(memory) == 2
    for rank_weights, rank_kv in memory:
        assert_half(rank_weights, weights, slack=0.1)  # the replicated embedding is the slack
        assert rank_kv == kv // 2  # 4 KV heads: 2 per rank, same number of blocks


@pytest.mark.slow
def test_gqa_llama_with_two_kv_heads_splits_them(tmp_path_factory):
    model = llama_dir(tmp_path_factory, num_kv_heads=2)
    one, [(weights, kv)] = run(model, 1)
    two, memory = run(model, 2)
    assert_same(two, one)
    for rank_weights, rank_kv in memory:
        assert_half(rank_weights, weights, slack=0.5)  # embedding and head (128 x 64 each) replicated
        assert rank_kv == kv // 2


@pytest.mark.slow
def test_llama_with_one_kv_head_replicates_it_on_every_rank(tmp_path_factory):
    model = llama_dir(tmp_path_factory, num_kv_heads=1)
    one, [(_, kv)] = run(model, 1)
    two, memory = run(model, 2)
    assert_same(two, one)
    assert [rank_kv for _, rank_kv in memory] == [kv, kv]  # a replicated KV head costs each rank the whole cache


@pytest.mark.slow
def test_forked_samples_and_prefix_hits_copy_blocks_on_every_rank():
    """n > 1 forks share the prompt's blocks and copy the last one on write: the
    copies must reach the workers' shards too, or the samples' KV would differ."""
    params = SamplingParams(max_tokens=5, temperature=0.0, n=3, ignore_eos=True, logprobs=1)
    prompt = [[5, 6, 7, 8, 9, 10]]  # ends mid-block: the forks copy it

    def samples(tp):
        llm = LLM("kvforge-tiny", **COMMON, cache={"num_blocks": 64, "block_size": 4},
                  parallel={"tensor_parallel_size": tp})
        try:
            return [[(c.token_ids, c.cumulative_logprob) for c in
                     llm.generate(prompt_token_ids=prompt, sampling_params=params)[0].outputs] for _ in range(2)]
        finally:
            llm.engine.shutdown()

    one, two = samples(1), samples(2)
    for tp2_run, tp1_run in zip(two, one):  # the first run, then the one that hits the prefix cache
        assert_same(tp2_run, tp1_run)
    assert len({tuple(tokens) for tokens, _ in two[0] + two[1]}) == 1  # greedy forks agree


def step_in_thread(engine: LLMEngine) -> BaseException | None:
    """Step `engine` until it fails or finishes, in a thread; the error it raised."""
    caught: list[BaseException] = []

    def target():
        try:
            while engine.has_unfinished_requests():
                engine.step()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            caught.append(exc)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(HANG_GUARD_S)
    assert not thread.is_alive(), "the engine hung after a worker failed"
    return caught[0] if caught else None


def tp_engine(timeout_s: float) -> LLMEngine:
    config = EngineConfig.model_validate({**COMMON, "model": "kvforge-tiny", "cache": {"num_blocks": 64},
                                          "parallel": {"tensor_parallel_size": 2, "collective_timeout_s": timeout_s}})
    engine = LLMEngine(config)
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=200, ignore_eos=True))
    engine.step()
    engine.step()
    return engine


@pytest.mark.slow
def test_a_killed_worker_fails_the_engine_naming_the_rank():
    engine = tp_engine(timeout_s=60)
    worker = engine.executor.workers[0]
    os.kill(worker.pid, signal.SIGKILL)
    error = step_in_thread(engine)
    assert isinstance(error, DistributedError)
    assert "rank 1" in str(error) and f"pid {worker.pid}" in str(error) and "SIGKILL" in str(error)
    with pytest.raises(DistributedError, match="rank 1"):  # and it stays failed, without waiting again
        engine.step()
    engine.shutdown()


@pytest.mark.slow
def test_a_stuck_worker_fails_the_engine_after_the_collective_timeout():
    engine = tp_engine(timeout_s=3)
    worker = engine.executor.workers[0]
    os.kill(worker.pid, signal.SIGSTOP)
    try:
        error = step_in_thread(engine)
    finally:
        os.kill(worker.pid, signal.SIGCONT)
        engine.shutdown()
    assert isinstance(error, DistributedError)
    assert "collective_timeout_s = 3 s" in str(error)
    worker.join(30)
    assert not worker.is_alive()  # the failure stopped the worker too


def test_a_ready_model_cannot_be_split():
    from kvforge.models import load_model

    with pytest.raises(ConfigError, match="load the model itself"):
        LLMEngine(EngineConfig(device="cpu", parallel={"tensor_parallel_size": 2}),
                  model=load_model("kvforge-tiny", linear_kernel="torch"))


@pytest.mark.slow
def test_generate_command_takes_the_tensor_parallel_size(capsys):
    common = ["--set", "device='cpu'", "--set", "dtype='float32'", "--set", "cache.num_blocks=64",
              "--max-tokens", "5", "--jsonl", "Hello", "The cat"]
    assert main(["generate", *common]) == 0
    one = capsys.readouterr().out
    assert main(["generate", "--tensor-parallel-size", "2", "-v", *common]) == 0
    captured = capsys.readouterr()
    assert "tensor parallel over 2 ranks" in captured.err
    assert [line.split('"ttft_s"')[0] for line in captured.out.splitlines()] == \
        [line.split('"ttft_s"')[0] for line in one.splitlines()]
