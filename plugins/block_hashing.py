"""Content hashes of KV blocks for prefix caching (a helper module, not a plugin).

A block's hash covers its parent's hash, its token ids and its extra keys
(cache salt, model or adapter tag), so equal hashes mean equal prefixes. The
first block of a sequence chains to a root hash derived from the seed; two
pools with different seeds never share hashes.

Algorithms: `sha256` (the default; collision resistant, so one tenant cannot
forge another's block) and `xxhash` (xxh3-128, several times faster; only when
the optional `xxhash` package is installed).
"""

from __future__ import annotations

import hashlib
import importlib.util
import struct
from array import array
from collections.abc import Callable, Sequence
from typing import Any

from kvforge.core import BlockHash, ConfigError

Hasher = Callable[[bytes], bytes]


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def _xxhash() -> Hasher:
    import xxhash

    def digest(data: bytes) -> bytes:
        return xxhash.xxh3_128_digest(data)

    return digest


ALGORITHMS: dict[str, tuple[str, Callable[[], Hasher]]] = {
    # name: (the module it needs, or "" for the standard library; factory)
    "sha256": ("", lambda: _sha256),
    "xxhash": ("xxhash", _xxhash),
}


def available_algorithms() -> list[str]:
    """The hash algorithm names usable here (cheap: no import)."""
    return [name for name, (module, _) in ALGORITHMS.items()
            if not module or importlib.util.find_spec(module) is not None]


def make_hasher(algorithm: str) -> Hasher:
    """The digest function for `algorithm`, or a ConfigError naming the choices."""
    if algorithm not in ALGORITHMS:
        raise ConfigError(f"cache.hash_algorithm {algorithm!r} is unknown; valid choices: {', '.join(ALGORITHMS)}")
    module, factory = ALGORITHMS[algorithm]
    if module and importlib.util.find_spec(module) is None:
        raise ConfigError(f"cache.hash_algorithm {algorithm!r} is unavailable: the {module!r} package is not "
                          f"installed; run `pip install {module}` or choose one of {', '.join(available_algorithms())}")
    return factory()


def root_hash(hasher: Hasher, seed: int) -> BlockHash:
    """The parent of every sequence's first block."""
    return hasher(b"kvforge-root\0" + str(seed).encode())


def encode_block(parent: BlockHash, token_ids: Sequence[int], extra_keys: Sequence[Any]) -> bytes:
    """An unambiguous byte string for (parent, token ids, extra keys).

    The parent is length-prefixed and the tokens are counted, so no two
    different inputs encode alike; extra keys go in as their `repr`, which
    keeps `1`, `"1"` and `b"1"` apart.
    """
    if hasattr(token_ids, "tolist"):  # a tensor or numpy slice
        token_ids = token_ids.tolist()
    tokens = array("q", token_ids).tobytes()
    extra = repr(tuple(extra_keys)).encode() if extra_keys else b""
    return struct.pack("<II", len(parent), len(token_ids)) + parent + tokens + extra
