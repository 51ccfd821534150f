"""How torch dtypes are named in configs, capabilities and messages."""

from __future__ import annotations

import torch


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.bfloat16` -> `"bfloat16"`: the name configs use and messages print."""
    return str(dtype).removeprefix("torch.")
