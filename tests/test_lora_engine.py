"""LoRA adapters through the engine, on kvforge-tiny: an adapter's greedy output
equals the base model with the adapter merged into its weights (W + scale B A),
whether its requests run alone or beside other adapters' and the base model's,
with chunked prefill, preemption, n > 1, prefix caching and draft-model
speculation; adapters evicted from memory reload; reloaded weights never reuse
stale KV; and bad requests fail alone, saying why."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvforge import LLM, LoRARequest, SamplingParams
from kvforge.benchmarks.peers.lora_adapters import write_adapter
from kvforge.models import resolve_model_dir

sys.path.insert(0, str(Path(__file__).parent))  # the adapter writer sits beside this file
from lora_tiny_adapters import write_tiny_adapter  # noqa: E402

PROMPTS = ["def main(", "import numpy as np\n", "class Tree:", "for i in range(", "x = [", "return self."]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
FLOAT32 = {"device": "cpu", "dtype": "float32", "warmup": False}


def merged_model(adapter_dir: Path, out: Path) -> Path:
    """kvforge-tiny with the adapter folded into its weights, as a model directory."""
    import json

    base = resolve_model_dir("kvforge-tiny")
    shutil.copytree(base, out)
    weights = {k: v.float() for k, v in load_file(str(base / "model.safetensors")).items()}
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    scale = config["lora_alpha"] / config["r"]
    adapter = load_file(str(adapter_dir / "adapter_model.safetensors"))
    for key, a in adapter.items():
        if ".lora_A." not in key:
            continue
        b = adapter[key.replace(".lora_A.", ".lora_B.")]
        target = key.replace("base_model.model.", "", 1).replace(".lora_A.weight", ".weight")
        weights[target] = weights[target] + scale * (b.double() @ a.double()).float()
    save_file(weights, str(out / "model.safetensors"))
    return out


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    import json

    root = tmp_path_factory.mktemp("lora")
    config = json.loads((resolve_model_dir("kvforge-tiny") / "config.json").read_text())
    write_adapter(root / "beta", config, rank=8, seed=2, base_model="kvforge-tiny")
    dirs = [write_tiny_adapter(root / "alpha", seed=1), root / "beta"]  # q and v only; every projection
    requests = [LoRARequest("alpha", 1, str(dirs[0])), LoRARequest("beta", 2, str(dirs[1]))]
    merged = [merged_model(d, root / f"merged-{d.name}") for d in dirs]
    return requests, merged


@pytest.fixture(scope="module")
def expected(adapters):
    """Each prompt's greedy tokens: the base model, and each merged model."""
    requests, merged = adapters
    out = {None: tokens(LLM("kvforge-tiny", **FLOAT32).generate(PROMPTS, GREEDY))}
    for request, path in zip(requests, merged):
        out[request.lora_name] = tokens(LLM(str(path), **FLOAT32).generate(PROMPTS, GREEDY))
    return out


def tokens(outputs) -> list[list[int]]:
    for output in outputs:
        assert output.outputs[0].finish_reason != "error", output.outputs[0].error
    return [output.outputs[0].token_ids for output in outputs]


def mixed(requests) -> list:
    """Per prompt: the base model, alpha, beta in turn."""
    return [[None, *requests][i % 3] for i in range(len(PROMPTS))]


def want(expected, loras) -> list[list[int]]:
    return [expected[None if r is None else r.lora_name][i] for i, r in enumerate(loras)]


def test_adapters_change_the_output(adapters, expected):
    assert expected["alpha"] != expected[None] and expected["beta"] != expected[None] != expected["alpha"]


@pytest.mark.parametrize("linear_kernel", ["torch", "auto"])
def test_each_adapter_alone_equals_its_merged_weights(adapters, expected, linear_kernel):
    requests, _ = adapters
    llm = LLM("kvforge-tiny", lora={"max_loras": 2}, linear_kernel=linear_kernel, **FLOAT32)
    for request in requests:
        assert tokens(llm.generate(PROMPTS, GREEDY, lora_request=request)) == expected[request.lora_name]
    assert tokens(llm.generate(PROMPTS, GREEDY)) == expected[None], "LoRA enabled changed base requests"


SETTINGS = {
    "one batch": {},
    "chunked prefill": {"scheduler": {"max_num_batched_tokens": 8}},
    "preemption": {"cache": {"block_size": 4, "num_blocks": 24}},
    "prefix caching": {"cache": {"enable_prefix_caching": True}},
    "draft model": {"speculative": {"proposer": "draft_model", "num_tokens": 3,
                                    "options": {"model": "kvforge-tiny-draft"}}},
    "ngram": {"speculative": {"proposer": "ngram", "num_tokens": 3}},
    "multi-step decoding": {"scheduler": {"num_scheduler_steps": 6}},
}


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_adapters_and_base_in_one_batch_equal_each_alone(adapters, expected, setting):
    requests, _ = adapters
    loras = mixed(requests)
    llm = LLM("kvforge-tiny", lora={"max_loras": 2}, **FLOAT32, **SETTINGS[setting])
    assert tokens(llm.generate(PROMPTS, GREEDY, lora_request=loras)) == want(expected, loras)
    metrics = llm.engine.metrics()
    if setting == "preemption":
        assert metrics["preemptions"] > 0, "nothing was preempted: the setting proves nothing"
    if "speculative" in SETTINGS[setting]:
        assert metrics["spec_draft_tokens"] > 0, "nothing was drafted: the setting proves nothing"
    if setting == "multi-step decoding":  # 24 tokens each, one step at a time, would take 24 steps and more
        assert metrics["steps"] < 12, "no burst ran: the setting proves nothing"


def test_one_slot_runs_every_adapter_in_turn(adapters, expected):
    requests, _ = adapters
    loras = mixed(requests)
    llm = LLM("kvforge-tiny", lora={"max_loras": 1, "max_cpu_loras": 1}, **FLOAT32)
    assert tokens(llm.generate(PROMPTS, GREEDY, lora_request=loras)) == want(expected, loras)
    assert len(llm.engine.list_loras()) == 1, "more adapters kept loaded than max_cpu_loras"


def test_n_samples_of_an_adapter_request_each_follow_the_adapter(adapters, expected):
    requests, _ = adapters
    llm = LLM("kvforge-tiny", lora={"max_loras": 2}, **FLOAT32)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, n=3)
    (output,) = llm.generate(PROMPTS[:1], params, lora_request=requests[1])
    assert [c.token_ids for c in output.outputs] == [expected["beta"][0]] * 3


def test_reloaded_weights_under_the_same_name_never_reuse_stale_kv(adapters, expected, tmp_path):
    requests, merged = adapters
    llm = LLM("kvforge-tiny", lora={"max_loras": 2}, cache={"enable_prefix_caching": True}, **FLOAT32)
    moving = tmp_path / "moving"
    shutil.copytree(requests[0].lora_path, moving)
    first = LoRARequest("moving", 7, str(moving))
    assert tokens(llm.generate(PROMPTS, GREEDY, lora_request=first)) == expected["alpha"]
    shutil.rmtree(moving)
    shutil.copytree(requests[1].lora_path, moving)  # other weights, same name, id and path
    assert llm.engine.remove_lora(7)
    assert tokens(llm.generate(PROMPTS, GREEDY, lora_request=first)) == expected["beta"]


def test_a_request_for_an_adapter_without_lora_enabled_fails_alone_saying_how(adapters, expected):
    requests, _ = adapters
    llm = LLM("kvforge-tiny", **FLOAT32)
    good, bad = llm.generate(PROMPTS[:2], GREEDY, lora_request=[None, requests[0]])
    assert good.outputs[0].token_ids == expected[None][0]
    assert bad.outputs[0].finish_reason == "error" and "lora" in bad.outputs[0].error and "max_loras" in bad.outputs[0].error


def test_a_bad_adapter_directory_fails_its_request_naming_the_file(adapters, expected, tmp_path):
    llm = LLM("kvforge-tiny", lora={"max_loras": 2}, **FLOAT32)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 4, "lora_alpha": 8, '
                                                '"target_modules": ["q_proj"]}')
    good, bad = llm.generate(PROMPTS[:2], GREEDY, lora_request=[None, LoRARequest("broken", 3, str(broken))])
    assert good.outputs[0].token_ids == expected[None][0]
    assert bad.outputs[0].finish_reason == "error" and "adapter_model.safetensors" in bad.outputs[0].error


def test_a_bad_adapter_is_the_request_s_error_and_add_lora_names_the_file(tmp_path):
    from kvforge.core import RequestError
    from kvforge.models.lora_adapter import LoRAAdapterError

    llm = LLM("kvforge-tiny", lora={"max_loras": 1}, **FLOAT32)
    missing = LoRARequest("missing", 9, str(tmp_path / "nowhere"))
    with pytest.raises(RequestError, match="adapter_config.json"):
        llm.engine.add_request("r", "x", GREEDY, lora_request=missing)
    with pytest.raises(LoRAAdapterError, match="adapter_config.json"):
        llm.engine.add_lora(missing)
    assert not llm.engine.has_unfinished_requests() and llm.engine.list_loras() == []


def test_int8_base_weights_with_float_adapters(adapters):
    """The base GEMMs in int8, the adapters in float: base requests write what the int8
    model alone writes, beside adapter requests, and each adapter changes the output."""
    requests, _ = adapters
    int8 = {**FLOAT32, "quantization": {"weights": "int8_weight"}}
    alone = tokens(LLM("kvforge-tiny", **int8).generate(PROMPTS, GREEDY))
    llm = LLM("kvforge-tiny", lora={"max_loras": 2}, **int8)
    loras = mixed(requests)
    got = tokens(llm.generate(PROMPTS, GREEDY, lora_request=loras))
    assert [g for g, r in zip(got, loras) if r is None] == [a for a, r in zip(alone, loras) if r is None]
    assert all(g != a for g, a, r in zip(got, alone, loras) if r is not None)
    layer = llm.engine.model.model.layers[0].self_attn.qkv_proj
    assert type(layer.base).__name__ == "Int8Linear" and layer.a.dtype == torch.float32
