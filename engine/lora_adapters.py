"""The adapters an engine serves: those loaded in memory, and the model's slots.

Two levels, as in vLLM and S-LoRA:
* loaded adapters (`LoRAAdapter`, weights in host memory): a least-recently-used
  cache of at most `lora.max_cpu_loras`, filled from PEFT directories on first use.
  A request keeps a reference to its adapter until it ends, so an adapter the
  cache drops while requests still use it stays alive for them; a later request
  loads it from its directory again.
* slots: the model's `lora.max_loras` slot buffers (`LoRAState`), which hold the
  adapters of the step that runs. Before each step the adapters of its requests
  are put in slots (one already there stays; otherwise the slot least recently
  used by a step is overwritten); the scheduler's admission rule keeps the
  distinct adapters of the running requests within `max_loras`, so they always fit.

A slot's adapter is identified by its id and the fingerprint of its weights, so
an adapter reloaded with other weights under the same id is copied in afresh.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from kvforge.core import RequestError
from kvforge.core.config import LoRAConfig
from kvforge.models.lora_adapter import LoRAAdapter, LoRAAdapterError, load_peft_adapter

from .lora_request import LoRARequest


class LoRAAdapters:
    def __init__(self, model, config: LoRAConfig, on_slot_load=None):
        self.model = model
        self.on_slot_load = on_slot_load  # (slot, path, fingerprint): other ranks load it too
        self.config = config
        self.state = model.lora  # the model's LoRAState (slot buffers)
        self.loaded: OrderedDict[int, tuple[LoRARequest, LoRAAdapter]] = OrderedDict()  # id -> ..., LRU first
        self.slots: list[tuple[int, str] | None] = [None] * config.max_loras  # (id, fingerprint) per slot
        self._slot_use: list[int] = [0] * config.max_loras  # the step that last used each slot
        self._steps = 0
        self._tokens: dict[str, list[int]] = {}  # name -> [prompt tokens computed, tokens generated]

    # Loaded adapters

    def get(self, request: LoRARequest) -> LoRAAdapter:
        """`request`'s adapter, loaded from its directory unless it is loaded already
        (under the same id and path); `LoRAAdapterError` naming the file or field."""
        found = self.loaded.get(request.lora_int_id)
        if found is not None and found[0].lora_path == request.lora_path:
            self.loaded.move_to_end(request.lora_int_id)
            return found[1]
        for other_id, (other, _) in self.loaded.items():
            if other.lora_name == request.lora_name and other_id != request.lora_int_id:
                raise RequestError(f"LoRA adapter name {request.lora_name!r} is already loaded with lora_int_id "
                                   f"{other_id}, not {request.lora_int_id}; one name, one id (remove it first)")
        adapter = load_peft_adapter(request.lora_path, self.model, max_rank=self.config.max_lora_rank)
        self.loaded[request.lora_int_id] = (request, adapter)
        self.loaded.move_to_end(request.lora_int_id)
        while len(self.loaded) > self.config.cpu_capacity:
            self.loaded.popitem(last=False)
        return adapter

    def remove(self, lora_int_id: int) -> bool:
        """Forget a loaded adapter (requests using it keep their copy); False if not loaded."""
        return self.loaded.pop(lora_int_id, None) is not None

    def requests(self) -> list[LoRARequest]:
        """The loaded adapters' requests, least recently used first."""
        return [request for request, _ in self.loaded.values()]

    def find(self, name: str) -> LoRARequest | None:
        return next((request for request, _ in self.loaded.values() if request.lora_name == name), None)

    # Figures

    def count_tokens(self, scheduled, sampled: dict) -> None:
        """Add one step's prompt tokens computed and tokens sampled to each adapter's counts."""
        for entry in scheduled:
            request = entry.request
            if request.lora_request is None:
                continue
            counts = self._tokens.setdefault(request.lora_request.lora_name, [0, 0])
            counts[0] += max(0, min(request.num_prompt_tokens, entry.start + entry.num_tokens) - entry.start)
            for sample in [request, *entry.forks]:
                emitted = sampled.get(sample.request_id)
                counts[1] += 0 if emitted is None else len(emitted.token_ids)

    def figures(self, running, waiting) -> dict[str, dict[str, int]]:
        """Per adapter name: `running`, `waiting`, `prompt_tokens`, `generation_tokens`."""
        names = {request.lora_name for request, _ in self.loaded.values()} | set(self._tokens)
        names |= {r.lora_request.lora_name for r in [*running, *waiting] if r.lora_request is not None}
        out = {}
        for name in sorted(names):
            prompt, generated = self._tokens.get(name, (0, 0))
            out[name] = {
                "running": sum(1 for r in running if r.lora_request is not None and r.lora_request.lora_name == name),
                "waiting": sum(1 for r in waiting if r.lora_request is not None and r.lora_request.lora_name == name),
                "prompt_tokens": prompt, "generation_tokens": generated}
        return out

    # Slots

    def slots_for(self, adapters: Sequence[tuple[LoRARequest, LoRAAdapter] | None]) -> list[int]:
        """The slot of each entry's adapter (-1: the base model) for one step,
        copying into slots the adapters not in one yet."""
        self._steps += 1
        wanted = {(r.lora_int_id, a.fingerprint): a for r, a in (x for x in adapters if x is not None)}
        if len(wanted) > len(self.slots):
            raise RuntimeError(f"{len(wanted)} distinct LoRA adapters in one step, more than lora.max_loras "
                               f"({len(self.slots)}): the scheduler's admission rule was broken")
        slot_of = {key: i for i, key in enumerate(self.slots) if key in wanted}
        free = sorted((i for i in range(len(self.slots)) if self.slots[i] not in wanted), key=self._slot_use.__getitem__)
        for key, adapter in wanted.items():
            if key not in slot_of:
                slot = free.pop(0)
                self.state.load(slot, adapter)
                if self.on_slot_load is not None:
                    self.on_slot_load(slot, adapter.path, adapter.fingerprint)
                self.slots[slot] = key
                slot_of[key] = slot
        for slot in slot_of.values():
            self._slot_use[slot] = self._steps
        return [-1 if x is None else slot_of[(x[0].lora_int_id, x[1].fingerprint)] for x in adapters]


def prefix_key(request: LoRARequest, adapter: LoRAAdapter) -> tuple:
    """The prefix-cache extra key of an adapter's requests: its name and the
    fingerprint of its weights, so KV computed with other weights is never reused."""
    return ("lora", request.lora_name, adapter.fingerprint)


__all__ = ["LoRAAdapters", "LoRAAdapterError", "prefix_key"]
