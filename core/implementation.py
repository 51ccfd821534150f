"""What every implementation of every kind has in common.

An implementation is a class. The registry never instantiates it to decide
anything: `availability()` and `unsupported_reasons()` are class methods, so
`kvforge plugins --explain` and `auto` selection cost nothing.
"""

from __future__ import annotations

from abc import ABC
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from .api import API_VERSION

if TYPE_CHECKING:  # structured_output imports this module
    from .structured_output import StructuredOutputSpec


@dataclass(frozen=True)
class Availability:
    """Whether an implementation can run on this machine at all, and why not."""

    ok: bool
    reason: str = ""

    @classmethod
    def yes(cls) -> "Availability":
        return cls(True, "")

    @classmethod
    def no(cls, reason: str) -> "Availability":
        return cls(False, reason)


@dataclass(frozen=True)
class SelectionRequest:
    """What the host asks of an implementation; every field is optional.

    `auto` selection and explicit selection both pass one of these to
    `unsupported_reasons`. Fields an implementation does not care about are ignored.
    """

    device: str | None = None
    dtype: Any = None  # torch.dtype
    kv_cache_dtype: str | None = None
    head_size: int | None = None
    block_size: int | None = None
    num_heads: int | None = None
    num_kv_heads: int | None = None
    features: frozenset[str] = field(default_factory=frozenset)
    prefix_caching: bool | None = None
    kv_storage_dtype: Any = None  # torch.dtype of a quantized KV cache; None for a float one
    kv_scale_granularity: str | None = None  # a quantized KV cache's scales: per_token (also when None) or per_tensor
    structured_output_spec: StructuredOutputSpec | None = None  # a structured_output backend must compile it
    batch_invariant: bool = False  # an attention backend must declare batch_invariant (its guarantee 8)


class Implementation(ABC):
    """Base of the six interfaces.

    Class attributes every implementation sets:

      * `name` — unique within its kind; what users type in the config.
      * `api_version` — the (major, minor) of kvforge.core it was written for.
      * `priority` — `auto` picks the available, supporting implementation with
        the highest priority; ties go to the name that sorts first.
    """

    kind: ClassVar[str]
    name: ClassVar[str]
    api_version: ClassVar[tuple[int, int]] = API_VERSION
    priority: ClassVar[int] = 0

    @classmethod
    def availability(cls) -> Availability:
        """Whether this implementation can run here. Must not raise and must not
        import heavy optional libraries just to answer when a cheaper check exists."""
        return Availability.yes()

    @classmethod
    def prepare(cls) -> None:
        """One-time set-up the host runs on the implementation it selected, before
        instantiating it: compiling kernels, loading a library. May be slow; never
        called just to list or explain. Raises a `KvforgeError` that says what failed;
        under `auto` the host then takes the next usable implementation (and
        `availability()` should say no from then on). Default: nothing to set up."""

    @classmethod
    def unsupported_reasons(cls, request: SelectionRequest) -> list[str]:
        """Reasons this implementation cannot serve `request`; empty when it can."""
        return []

    @classmethod
    def capabilities(cls) -> dict[str, Any]:
        """Declared capabilities, JSON-serialisable, shown by `kvforge plugins --json`."""
        return {}
