"""Model architectures, keyed by the Hugging Face `architectures` name in config.json.

Adding an architecture, two ways:

* in code: `kvforge.models.register_architecture("MyForCausalLM", MyForCausalLM)`;
* from a package: an entry point in the group `kvforge.models`, named after the
  architecture, pointing at the class::

      [project.entry-points."kvforge.models"]
      MyForCausalLM = "my_package.my_model:MyForCausalLM"

The class subclasses `kvforge.models.CausalLM`. Entry points are read the first
time an architecture is looked up; an architecture registered in code wins.
"""

from __future__ import annotations

from importlib import metadata

from kvforge.core.errors import PluginError, UnsupportedConfigurationError

from .base import CausalLM
from .gpt2 import GPT2LMHeadModel
from .llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM

ENTRY_POINT_GROUP = "kvforge.models"

_ARCHITECTURES: dict[str, type[CausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "GPT2LMHeadModel": GPT2LMHeadModel,
}
_BROKEN: dict[str, str] = {}  # architecture -> why its entry point failed
_entry_points_read = False


def register_architecture(name: str, cls: type[CausalLM]) -> None:
    """Make `cls` serve checkpoints whose config.json lists `name` in `architectures`."""
    if not (isinstance(cls, type) and issubclass(cls, CausalLM)):
        raise PluginError(f"architecture {name!r}: {cls!r} is not a subclass of kvforge.models.CausalLM")
    _ARCHITECTURES[name] = cls


def _read_entry_points() -> None:
    global _entry_points_read
    if _entry_points_read:
        return
    _entry_points_read = True
    for entry_point in metadata.entry_points(group=ENTRY_POINT_GROUP):
        if entry_point.name in _ARCHITECTURES:
            continue
        try:
            register_architecture(entry_point.name, entry_point.load())
        except Exception as exc:  # a broken plugin must not hide the working architectures
            _ARCHITECTURES.pop(entry_point.name, None)
            _BROKEN[entry_point.name] = f"{type(exc).__name__}: {exc}"


def architectures() -> list[str]:
    """Every supported architecture name."""
    _read_entry_points()
    return sorted(_ARCHITECTURES)


def model_class(names: list[str] | str) -> type[CausalLM]:
    """The class for the first supported name in a config's `architectures` list."""
    _read_entry_points()
    names = [names] if isinstance(names, str) else list(names or [])
    for name in names:
        if name in _ARCHITECTURES:
            return _ARCHITECTURES[name]
    broken = [f"{n} (its plugin failed to load: {_BROKEN[n]})" for n in names if n in _BROKEN]
    if broken:
        raise PluginError("; ".join(broken))
    raise UnsupportedConfigurationError(
        f"unsupported architecture {', '.join(names) or '(config.json names none)'}; supported architectures: "
        f"{', '.join(architectures())}. Add one with kvforge.models.register_architecture or a "
        f"{ENTRY_POINT_GROUP!r} entry point")
