"""kvforge: a plugin-based kernel and backend framework for LLM inference.

The contract lives in `kvforge.core`; built-in implementations in
`kvforge.plugins` and `kvforge.backends`; the shared test suite in
`kvforge.conformance`.
"""

from kvforge.core import API_VERSION, EngineConfig, load_config
from kvforge.engine.llm import LLM
from kvforge.engine.llm_engine import LLMEngine
from kvforge.engine.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["API_VERSION", "EngineConfig", "LLM", "LLMEngine", "SamplingParams", "load_config", "__version__"]
