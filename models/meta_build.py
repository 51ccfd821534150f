"""Build a model's modules on the meta device: shapes only, no memory, for weights
about to be loaded (or a model only split or inspected).

    with on_meta():
        model = LlamaForCausalLM(config)

A meta tensor holds no values, so initialising one sets nothing; but torch runs
`normal_` on a meta tensor through a decomposition that imports torch._dynamo,
which brings sympy and triton with it (over a second and some 150 MB of resident
memory for a process that never compiles anything). `nn.Embedding` initialises
its weight so. Inside `on_meta`, `torch.nn.init`'s functions and `Tensor.normal_`
called on a meta tensor return it as it is: what they would have done to it.
The mode is per thread, as `torch.device` is.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.overrides import TorchFunctionMode


def _meta_to_initialise(func, args, kwargs) -> torch.Tensor | None:
    """The meta tensor `func(*args, **kwargs)` would fill with initial values, if it is
    one of those (`torch.nn.init` passes its tensor by keyword)."""
    if func is not torch.Tensor.normal_ and getattr(func, "__module__", None) != "torch.nn.init":
        return None
    tensor = args[0] if args else kwargs.get("tensor")
    return tensor if isinstance(tensor, torch.Tensor) and tensor.is_meta else None


class _SkipMetaInit(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensor = _meta_to_initialise(func, args, kwargs)
        return tensor if tensor is not None else func(*args, **kwargs)


@contextmanager
def on_meta() -> Iterator[None]:
    """Create tensors on the meta device, skipping initialisers (module docstring)."""
    with torch.device("meta"), _SkipMetaInit():
        yield
