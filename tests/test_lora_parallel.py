"""LoRA adapters under tensor and pipeline parallelism: every rank keeps its cut of
each adapter (A's input columns of a row-parallel layer, B's output rows of a
column-parallel one, a stage only its layers' parts), and loads each adapter the
driver puts in a slot; the greedy tokens of a batch mixing two adapters and the
base model equal the single-rank engine's, with one slot, so adapters are
swapped in and out of it between steps."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from kvforge import LLM, LoRARequest, SamplingParams
from kvforge.benchmarks.peers.lora_adapters import write_adapter
from kvforge.models import resolve_model_dir

sys.path.insert(0, str(Path(__file__).parent))  # the adapter writers sit beside this file
from lora_tiny_adapters import write_tiny_adapter  # noqa: E402

PROMPTS = ["def main(", "import os\n", "class Tree:", "x = [", "for i in range("]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
COMMON = {"device": "cpu", "dtype": "float32", "warmup": False, "lora": {"max_loras": 1, "max_cpu_loras": 2},
          "cache": {"block_size": 4, "num_blocks": 256}}


@pytest.fixture(scope="module")
def loras(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    config = json.loads((resolve_model_dir("kvforge-tiny") / "config.json").read_text())
    write_adapter(root / "every", config, rank=8, seed=3, base_model="kvforge-tiny")
    write_tiny_adapter(root / "qv", seed=4)
    every, qv = LoRARequest("every", 1, str(root / "every")), LoRARequest("qv", 2, str(root / "qv"))
    return [[every, None, qv][i % 3] for i in range(len(PROMPTS))]


def run(loras, model="kvforge-tiny", parallel=None):
    llm = LLM(model, **COMMON, parallel={"collective_timeout_s": 60, **(parallel or {})})
    try:
        outputs = llm.generate(PROMPTS, GREEDY, lora_request=loras)
        for output in outputs:
            assert output.outputs[0].finish_reason != "error", output.outputs[0].error
        return [output.outputs[0].token_ids for output in outputs]
    finally:
        llm.engine.shutdown()


@pytest.fixture(scope="module")
def one_rank(loras):
    tokens = run(loras)
    assert tokens != run([None] * len(PROMPTS)), "the adapters change nothing: the comparison proves nothing"
    return tokens


@pytest.mark.parametrize("parallel", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}],
                         ids=["tensor", "pipeline"])
def test_adapters_split_over_ranks_give_the_single_rank_tokens(loras, one_rank, parallel):
    assert run(loras, parallel=parallel) == one_rank


def test_gpt2_adapters_split_their_fused_qkv_over_ranks(tmp_path):
    from lora_fixtures import save_adapter, save_base

    pytest.importorskip("peft")
    base = save_base("gpt2", tmp_path / "gpt2")
    adapter = save_adapter(base, tmp_path / "adapter", r=4, alpha=8, seed=5)
    loras = [[LoRARequest("a", 1, str(adapter)), None][i % 2] for i in range(len(PROMPTS))]
    prompts = [[3, 7, 11, 2], [5, 9], [1, 2, 3, 4, 5, 6], [8], [13, 21, 34]]

    def tokens(parallel):
        llm = LLM(str(base), **COMMON, parallel={"collective_timeout_s": 60, **parallel})
        try:
            return [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY,
                                                                  lora_request=loras)]
        finally:
            llm.engine.shutdown()

    assert tokens({"tensor_parallel_size": 2}) == tokens({})
