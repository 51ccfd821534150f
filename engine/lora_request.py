"""`LoRARequest`: which adapter a request runs with (vLLM's name and fields)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvforge.core import RequestError


@dataclass(frozen=True)
class LoRARequest:
    """A LoRA adapter by name, id and PEFT directory.

    `lora_int_id` (a positive integer) identifies the adapter inside the engine:
    requests with the same id share one loaded copy. `lora_name` is what the
    server's `model` field and the metrics call it. `lora_path` is a PEFT
    directory (`adapter_config.json`, `adapter_model.safetensors`)."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise RequestError(f"LoRARequest.lora_name must be a non-empty string, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise RequestError(f"LoRARequest {self.lora_name!r}: lora_int_id must be a positive integer "
                               f"(0 and below are the base model's), got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, (str, Path)) or not str(self.lora_path):
            raise RequestError(f"LoRARequest {self.lora_name!r}: lora_path must be a PEFT adapter directory, "
                               f"got {self.lora_path!r}")
        object.__setattr__(self, "lora_path", str(self.lora_path))
