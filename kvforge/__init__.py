"""kvforge: a plugin-based kernel and backend framework for LLM inference.

The contract lives in `kvforge.core`; built-in implementations in
`kvforge.plugins` and `kvforge.backends`; models in `kvforge.models`; the
reference engine in `kvforge.engine`; the shared test suite in
`kvforge.conformance`.

    from kvforge import LLM, SamplingParams
    LLM(model="kvforge-tiny").generate(["def main("], SamplingParams(max_tokens=32))
"""

from kvforge.core import API_VERSION, EngineConfig, load_config

__version__ = "0.1.0"
__all__ = ["API_VERSION", "EngineConfig", "LLM", "LLMEngine", "LoRARequest", "SamplingParams", "StructuredOutputsParams",
           "load_config", "__version__"]

_ENGINE_EXPORTS = {
    "LLM": "kvforge.engine.llm",
    "LLMEngine": "kvforge.engine.llm_engine",
    "LoRARequest": "kvforge.engine.lora_request",
    "SamplingParams": "kvforge.engine.sampling_params",
    "StructuredOutputsParams": "kvforge.engine.structured_outputs_params",
}


def __getattr__(name: str):
    # The engine pulls in models and transformers; `kvforge plugins` and
    # `kvforge config` should not pay for that, so it loads on first use.
    if name in _ENGINE_EXPORTS:
        from importlib import import_module

        return getattr(import_module(_ENGINE_EXPORTS[name]), name)
    raise AttributeError(f"module 'kvforge' has no attribute {name!r}")
