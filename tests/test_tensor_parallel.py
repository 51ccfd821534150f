"""Tensor parallelism end to end, on CPU with gloo and one worker process (TP=2):
the same greedy tokens as one process, half the weights and KV per rank, and a
worker that dies or hangs fails the engine with the rank named, never a hang."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

from kvforge import LLM, LLMEngine, SamplingParams
from kvforge.cli import main
from kvforge.core import ConfigError, DistributedError, EngineConfig

sys.path.insert(0, str(Path(__file__).parent))  # the shared runs sit beside this file
from parallel_runs import COMMON, assert_half, assert_same, llama_dir, run, started_engine, step_in_thread  # noqa: E402

pytest.importorskip("transformers")
TP2 = {"tensor_parallel_size": 2}


@pytest.mark.slow
def test_tiny_model_gives_the_same_greedy_tokens_with_half_the_weights_and_kv_per_rank():
    one, [(weights, kv)] = run("kvforge-tiny")
    two, memory = run("kvforge-tiny", TP2)
    assert_same(two, one)
    assert len(memory) == 2
    for rank_weights, rank_kv in memory:
        assert_half(rank_weights, weights, slack=0.1)  # the replicated embedding is the slack
        assert rank_kv == kv // 2  # 4 KV heads: 2 per rank, same number of blocks


@pytest.mark.slow
def test_gqa_llama_with_two_kv_heads_splits_them(tmp_path_factory):
    model = llama_dir(tmp_path_factory, num_kv_heads=2)
    one, [(weights, kv)] = run(model)
    two, memory = run(model, TP2)
    assert_same(two, one)
    for rank_weights, rank_kv in memory:
        assert_half(rank_weights, weights, slack=0.5)  # embedding and head (128 x 64 each) replicated
        assert rank_kv == kv // 2


@pytest.mark.slow
def test_llama_with_one_kv_head_replicates_it_on_every_rank(tmp_path_factory):
    model = llama_dir(tmp_path_factory, num_kv_heads=1)
    one, [(_, kv)] = run(model)
    two, memory = run(model, TP2)
    assert_same(two, one)
    assert [rank_kv for _, rank_kv in memory] == [kv, kv]  # a replicated KV head costs each rank the whole cache


@pytest.mark.slow
def test_gpt2_splits_its_fused_qkv_and_biases(tmp_path):
    import torch
    import transformers

    # 131 tokens: each rank holds 66 rows of the tied embedding, the last one padding
    config = transformers.GPT2Config(vocab_size=131, n_embd=64, n_layer=2, n_head=4, n_positions=128,
                                     bos_token_id=None, eos_token_id=None)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():  # non-zero biases, so a bias added twice (or not at all) shows
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0, 0.2)
    model.save_pretrained(tmp_path)
    one, [(weights, kv)] = run(str(tmp_path))
    two, memory = run(str(tmp_path), TP2)
    assert_same(two, one)
    for rank_weights, rank_kv in memory:
        assert_half(rank_weights, weights, slack=0.4)  # the position embedding and the norms replicated
        assert rank_kv == kv // 2


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


@pytest.mark.slow
def test_a_killed_worker_fails_the_engine_naming_the_rank():
    engine = started_engine({"tensor_parallel_size": 2, "collective_timeout_s": 60})
    worker = engine.executor.workers[0]
    os.kill(worker.pid, signal.SIGKILL)
    error = step_in_thread(engine)
    assert isinstance(error, DistributedError)
    assert "rank 1" in str(error) and f"pid {worker.pid}" in str(error) and "SIGKILL" in str(error)
    with pytest.raises(DistributedError, match="rank 1"):  # and it stays failed, without waiting again
        engine.step()


@pytest.mark.slow
def test_a_stuck_worker_fails_the_engine_after_the_collective_timeout():
    engine = started_engine({"tensor_parallel_size": 2, "collective_timeout_s": 3})
    worker = engine.executor.workers[0]
    os.kill(worker.pid, signal.SIGSTOP)  # alive, never answering
    error = step_in_thread(engine)
    assert isinstance(error, DistributedError)
    assert "collective_timeout_s = 3 s" in str(error)
    worker.join(30)
    assert not worker.is_alive()  # the failure ended the stopped worker too (SIGKILL reaches a stopped process)


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


@pytest.mark.slow
def test_another_attention_backend_over_a_quantized_kv_cache_runs_unchanged_on_fewer_heads():
    sections = {"attention": {"backend": "sdpa"}, "cache": {"kv_cache_dtype": "int8"}}
    one, [(_, kv)] = run("kvforge-tiny", **sections)
    two, memory = run("kvforge-tiny", TP2, **sections)
    assert_same(two, one)
    assert [rank_kv for _, rank_kv in memory] == [kv // 2, kv // 2]  # int8 codes and their scales, split


@pytest.mark.parametrize("parallel, message", [
    ({"tensor_parallel_size": 2}, "does not divide the model's 3 attention heads; choose one of: 1, 3"),
    ({"pipeline_parallel_size": 3}, "more than the model's 2 layers; choose at most 2"),
])
def test_a_split_the_model_cannot_take_is_refused_before_any_process_starts(tmp_path, monkeypatch, parallel,
                                                                            message):
    import transformers

    from kvforge.distributed import executor

    def no_processes(spec, rank):
        raise AssertionError("a worker process was about to start")

    monkeypatch.setattr(executor, "WorkerProcess", no_processes)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=3, num_key_value_heads=3)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match=message):
        LLMEngine(EngineConfig(model=str(tmp_path), device="cpu", dtype="float32", parallel=parallel))
