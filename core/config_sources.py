"""Where configuration values come from, each source overriding the previous:

defaults < TOML file < environment (`KVFORGE_SECTION__KEY`) < CLI (`--set section.key=value`)
< Python keyword arguments (one dict per section, e.g. `cache={"block_size": 32}`).

`load_config` remembers, for every value, the source that set it.
"""

from __future__ import annotations

import difflib
import os
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from .config import FLOAT_KV_DTYPES, EngineConfig, implementation_names
from .errors import ConfigError

ENV_PREFIX = "KVFORGE_"
DEFAULT = "default"


@dataclass
class LoadedConfig:
    config: EngineConfig
    sources: dict[str, str]  # dotted key -> where its value came from

    def rows(self) -> list[tuple[str, Any, str]]:
        """(dotted key, value, source) for every setting, in declaration order."""
        return [(key, value, self.sources.get(key, DEFAULT)) for key, value in flatten(self.config.model_dump())]


def flatten(tree: Mapping[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    """`[(dotted key, value)]` of a nested config; a setting whose value is itself a
    dict (`speculative.options`) is one leaf, not a section."""
    items = []
    leaves = _valid_keys()
    for key, value in tree.items():
        if isinstance(value, Mapping) and f"{prefix}{key}" not in leaves:
            items.extend(flatten(value, f"{prefix}{key}."))
        else:
            items.append((f"{prefix}{key}", value))
    return items


def parse_value(text: str) -> Any:
    """A value written on the command line or in the environment: TOML syntax if it
    parses (32, true, 0.5, ["a", "b"]), otherwise the plain string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _valid_keys(model: type[BaseModel] = EngineConfig) -> list[str]:
    keys = []
    for name, info in model.model_fields.items():
        annotation = info.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            keys.extend(f"{name}.{sub}" for sub in annotation.model_fields)
        else:
            keys.append(name)
    return keys


def _set(tree: dict[str, Any], dotted: str, value: Any, source: str, sources: dict[str, str]) -> None:
    parts = dotted.split(".")
    if dotted not in _valid_keys() and not (len(parts) == 1 and parts[0] in EngineConfig.model_fields):
        close = difflib.get_close_matches(dotted, _valid_keys(), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"unknown setting {dotted!r} (from {source}){hint} Valid settings: {', '.join(_valid_keys())}")
    node = tree
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value
    sources[dotted] = source


def _merge_tree(tree: dict[str, Any], layer: Mapping[str, Any], source: str, sources: dict[str, str]) -> None:
    for dotted, value in flatten(layer):
        _set(tree, dotted, value, source, sources)


def read_toml(path: str | Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as handle:
            return tomllib.load(handle)
    except FileNotFoundError:
        raise ConfigError(f"config file {str(path)!r} does not exist; pass an existing TOML file to --config") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {str(path)!r} is not valid TOML: {exc}") from None


def env_layer(environ: Mapping[str, str]) -> list[tuple[str, str, str]]:
    """(dotted key, raw value, variable name) for every `KVFORGE_SECTION__KEY` and
    `KVFORGE_MODEL` / `_DEVICE` / `_DTYPE` / `_SEED` variable."""
    found = []
    top_level = {key.upper() for key in _valid_keys() if "." not in key}
    for variable, value in sorted(environ.items()):
        if not variable.startswith(ENV_PREFIX):
            continue
        rest = variable[len(ENV_PREFIX):]
        if "__" in rest:
            found.append((".".join(part.lower() for part in rest.split("__")), value, variable))
        elif rest in top_level:
            found.append((rest.lower(), value, variable))
    return found


def load_config(config_file: str | Path | None = None, environ: Mapping[str, str] | None = None,
                overrides: Iterable[str] = (), **sections: Any) -> LoadedConfig:
    """Merge every source and validate; a `ConfigError` names the field, value and choices."""
    environ = os.environ if environ is None else environ
    tree: dict[str, Any] = {}
    sources: dict[str, str] = {}
    if config_file is not None:
        _merge_tree(tree, read_toml(config_file), f"file {config_file}", sources)
    for dotted, raw, variable in env_layer(environ):
        _set(tree, dotted, parse_value(raw), f"env {variable}", sources)
    for override in overrides:
        dotted, sep, raw = override.partition("=")
        if not sep or not dotted.strip():
            raise ConfigError(f"--set expects section.key=value, got {override!r}")
        _set(tree, dotted.strip(), parse_value(raw.strip()), "--set", sources)
    for name, value in sections.items():
        if isinstance(value, BaseModel):
            value = value.model_dump(exclude_unset=True)
        if isinstance(value, Mapping):
            _merge_tree(tree, {name: value}, "python", sources)
        else:
            _set(tree, name, value, "python", sources)
    return LoadedConfig(validate_config(tree), sources)


def validate_config(tree: Mapping[str, Any]) -> EngineConfig:
    try:
        return EngineConfig.model_validate(tree)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc)) from None


def format_validation_error(exc: ValidationError) -> str:
    lines = []
    for error in exc.errors():
        field = ".".join(str(part) for part in error["loc"])
        message = error["msg"]
        if error["type"] == "extra_forbidden":
            message = f"unknown setting; valid settings: {', '.join(_valid_keys())}"
        lines.append(f"{field}: got {error.get('input')!r}: {message}")
    return "invalid configuration:\n  " + "\n  ".join(lines)


def check_implementation_names(config: EngineConfig, registry: Any) -> None:
    """Every named implementation must be registered; the error lists the valid names
    and suggests the closest one. `auto` always passes."""
    from .registry import AUTO, unknown_name_message

    problems = []
    for path, (kind, name) in implementation_names(config).items():
        if name == AUTO:
            continue
        valid = registry.names(kind)
        if name not in valid:
            problems.append(f"{path}: {unknown_name_message(kind, name, valid)}")
    problems += _prefix_caching_problems(config, registry)
    problems += _kv_quantizer_problems(config, registry)
    if problems:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(problems))


def _kv_quantizer_problems(config: EngineConfig, registry: Any) -> list[str]:
    """`cache.kv_cache_dtype` naming a registered quantizer that cannot quantize a KV
    cache (a weight-only `per_channel` one, a dynamic `per_tensor` one) would only fail
    when the engine builds the cache; say so here, with the names that would do."""
    from .api import QUANTIZER
    from .errors import KvforgeError

    name = config.cache.kv_cache_dtype
    if name in FLOAT_KV_DTYPES or name not in registry.names(QUANTIZER):
        return []
    try:
        cls = registry.get(QUANTIZER, name).cls
    except KvforgeError:  # a duplicate name: the engine's selection reports it, naming both plugins
        return []
    if cls.kv_capable():
        return []
    capable = [r.name for r in registry.implementations(QUANTIZER) if r.cls.kv_capable()]
    floats = [d for d in FLOAT_KV_DTYPES if d != "auto"]
    return [f"cache.kv_cache_dtype: quantizer {name!r} ({cls.granularity}) cannot quantize a KV cache, whose layout "
            f"keeps one scale per token and KV head; valid choices: auto, {', '.join(floats)}, or a KV-capable "
            f"quantizer: {', '.join(capable) or 'none registered'}"]


def _prefix_caching_problems(config: EngineConfig, registry: Any) -> list[str]:
    """`cache.enable_prefix_caching` (on by default) with a named allocator that has no
    prefix caching would only fail when the engine selects it; say so here, with the fix."""
    from .api import BLOCK_ALLOCATOR
    from .errors import KvforgeError
    from .registry import AUTO

    cache = config.cache
    if not cache.enable_prefix_caching or cache.allocator == AUTO or cache.allocator not in registry.names(BLOCK_ALLOCATOR):
        return []
    try:
        cls = registry.get(BLOCK_ALLOCATOR, cache.allocator).cls
    except KvforgeError:  # a duplicate name: the engine's selection reports it, naming both plugins
        return []
    if cls.supports_prefix_caching:
        return []
    return [f"cache.allocator: block allocator {cache.allocator!r} does not support prefix caching, which "
            f"cache.enable_prefix_caching (true by default) asks for; set cache.enable_prefix_caching=false, or "
            f"choose an allocator with prefix caching (or auto)"]
