"""Executors by name and by class: the engine finds `parallel.executor` among the
`kvforge.executors` entry points without importing kvforge.distributed, refuses an
unknown name with the installed ones, and runs any class that follows
`kvforge.engine.executors.Executor`, needing nothing else of it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvforge import LLMEngine, SamplingParams
from kvforge.core import ConfigError, EngineConfig
from kvforge.engine import executors
from kvforge.engine.model_runner import ModelRunner

CONFIG = {"model": "kvforge-tiny", "device": "cpu", "dtype": "float32", "cache": {"num_blocks": 32}}
GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)


def test_kvforge_registers_its_executors_as_entry_points():
    found = executors.installed_executors()
    assert {"mp", "ray", "torchrun", "external"} <= set(found)
    for name in ("mp", "ray", "torchrun"):
        cls = found[name].load()  # loading a class imports its module, never Ray itself
        assert all(callable(getattr(cls, method, None)) for method in ("runner", "shutdown")), name


def test_an_unknown_executor_is_refused_with_the_installed_names():
    config = EngineConfig.model_validate({**CONFIG, "parallel": {"tensor_parallel_size": 2, "executor": "mpi"}})
    with pytest.raises(ConfigError, match=r"'mpi' is not an installed executor; installed: external, mp, ray, "
                                          r"torchrun"):
        LLMEngine(config)


def test_auto_is_torchrun_under_torchrun_and_mp_otherwise(monkeypatch):
    config = EngineConfig(parallel={"tensor_parallel_size": 2})
    monkeypatch.delenv(executors.TORCHRUN_MARK, raising=False)
    assert executors.executor_name(config) == "mp"
    monkeypatch.setenv(executors.TORCHRUN_MARK, "run-1")
    assert executors.executor_name(config) == "torchrun"
    assert executors.executor_name(EngineConfig(parallel={"executor": "ray"})) == "ray"


class OneRankExecutor:
    """The smallest executor: one rank, this process. It uses only what the protocol
    gives it, and records how the engine calls it."""

    def __init__(self, config, attention_backend, kv_quantizer, weight_quantizer, device, dtype):
        from kvforge.models import load_model

        self.calls = ["init"]
        self.model = load_model(config.model, dtype=dtype, device=device, attention_backend=attention_backend,
                                linear_kernel=config.linear_kernel)
        self.memory = []

    def runner(self, kv, kv_caches, block_size, num_blocks):
        self.calls.append(("runner", num_blocks))
        self.memory = [(self.model.weight_bytes(), sum(c.numel() * c.element_size() for c in kv_caches))]
        return ModelRunner(self.model, kv, kv_caches, block_size, kv_caches[0].device)

    def shutdown(self):
        self.calls.append("shutdown")


def generate(engine: LLMEngine) -> list[list[int]]:
    for i, prompt in enumerate([[1, 2, 3], [7] * 9]):
        engine.add_request(str(i), prompt_token_ids=prompt, params=GREEDY)
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    return [done["0"], done["1"]]


def test_an_executor_class_is_injected_and_called_in_the_protocols_order():
    config = EngineConfig.model_validate(CONFIG)
    plain = generate(LLMEngine(config))
    engine = LLMEngine(config, executor=OneRankExecutor)
    assert generate(engine) == plain
    engine.shutdown()
    assert engine.executor.calls == ["init", ("runner", engine.num_blocks), "shutdown"]


def test_an_injected_executor_needs_the_engine_to_load_the_model():
    from kvforge.models import load_model

    with pytest.raises(ConfigError, match="or an executor, need the engine to load the model itself"):
        LLMEngine(EngineConfig.model_validate(CONFIG), model=load_model("kvforge-tiny", linear_kernel="torch"),
                  executor=OneRankExecutor)


def test_a_single_process_engine_never_imports_the_distributed_package():
    code = ("import sys; from kvforge import LLM, SamplingParams; "
            "LLM('kvforge-tiny', device='cpu').generate(['Hi'], SamplingParams(max_tokens=2)); "
            "print(sorted(m for m in sys.modules if m.startswith(('kvforge.distributed', 'ray'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]"
