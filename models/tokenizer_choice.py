"""The tokenizer class transformers' `AutoTokenizer` picks for a model directory,
remembered so that later loads of the same directory go to that class directly.

To pick the class, `AutoTokenizer` loads the model's config through its config
class, and importing a config class imports much of transformers' modelling code
(for Llama, torch.distributed.tensor and sympy): most of the time and memory of
loading a small model's tokenizer. The class it picks depends only on the
directory's files and the transformers version, so the first load of a directory
asks `AutoTokenizer` and writes the answer to `tokenizer-classes.json` in kvforge's
cache (`KVFORGE_CACHE_DIR`, default `~/.cache/kvforge`), keyed by a fingerprint of
those (`fingerprint`); later loads with the same fingerprint call the class's own
`from_pretrained`, as `AutoTokenizer` would. Only classes defined in transformers
are remembered (never a model's own code). A cache that cannot be read or written,
or a remembered class that fails to load, only costs the shortcut.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
import os
import tempfile
from pathlib import Path

from kvforge.kernels.build import cache_root

CACHE_FILE = "tokenizer-classes.json"
MAX_ENTRIES = 64  # directories remembered; the oldest is forgotten first
# Read whole into the fingerprint: what the class is picked from (model type,
# tokenizer_class, auto_map). Other files count by size and modification time.
READ_WHOLE = ("config.json", "tokenizer_config.json")
STAT_ONLY = ("tokenizer.json", "tokenizer.model", "vocab.json", "merges.txt", "special_tokens_map.json")

log = logging.getLogger(__name__)


def fingerprint(model_dir: Path) -> str:
    """What `AutoTokenizer`'s choice for `model_dir` depends on, hashed: the
    transformers version, the directory's path, and its config and tokenizer files."""
    import transformers

    digest = hashlib.sha256(f"{transformers.__version__}\0{model_dir.resolve()}".encode())
    for name in READ_WHOLE + STAT_ONLY:
        path = model_dir / name
        if not path.is_file():
            digest.update(f"\0{name}:none".encode())
        elif name in READ_WHOLE:
            digest.update(f"\0{name}:".encode() + path.read_bytes())
        else:
            stat = path.stat()
            digest.update(f"\0{name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return digest.hexdigest()


def load(model_dir: Path):
    """The tokenizer of `model_dir` as `AutoTokenizer.from_pretrained` loads it."""
    key = fingerprint(model_dir)
    entries = _read()
    cls = _class(entries.get(key))
    if cls is not None:
        try:
            tokenizer = cls.from_pretrained(str(model_dir), local_files_only=True, _from_auto=True)
        except Exception as error:  # noqa: BLE001 - AutoTokenizer below loads it, or says what is wrong
            log.debug("remembered tokenizer class %s failed for %s: %s", cls.__name__, model_dir, error)
        else:
            if type(tokenizer) is cls:
                return tokenizer
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    name = f"{type(tokenizer).__module__}:{type(tokenizer).__qualname__}"
    if _class(name) is type(tokenizer) and entries.get(key) != name:
        entries.pop(key, None)
        entries[key] = name
        _write(dict(list(entries.items())[-MAX_ENTRIES:]))
    return tokenizer


def _class(name: str | None):
    """The class `module:qualname` names if transformers defines it, else None."""
    if not isinstance(name, str) or not name.startswith("transformers.") or ":" not in name:
        return None
    module, _, qualname = name.partition(":")
    try:
        return getattr(importlib.import_module(module), qualname)
    except (ImportError, AttributeError):
        return None


def _read() -> dict[str, str]:
    try:
        entries = json.loads((cache_root() / CACHE_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return entries if isinstance(entries, dict) else {}


def _write(entries: dict[str, str]) -> None:
    """Replace the cache file whole (a process reading it meanwhile sees the old or the new one)."""
    path = cache_root() / CACHE_FILE
    written = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=CACHE_FILE, delete=False) as out:
            written = out.name
            json.dump(entries, out)
        os.replace(written, path)
    except OSError as error:
        log.debug("tokenizer classes not remembered in %s: %s", path, error)
        if written is not None:
            Path(written).unlink(missing_ok=True)  # no half-written file left beside the cache
