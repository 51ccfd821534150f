"""The LoRA adapters a server serves beside its base model, by name.

A request's `model` picks what runs it: the served model name (or no `model`)
is the base model, an adapter's name is that adapter. The server's list is what
`/v1/models` shows and what `model` may name; the engine keeps its own cache of
loaded adapters (`lora.max_cpu_loras`), which may drop one and read it from its
directory again when a request needs it.

Adapters come from `--lora-modules` (loaded by the engine before the server
starts) and, with `--enable-lora-updates`, from `POST /v1/load_lora_adapter`;
the server numbers them (`lora_int_id`) in the order they came, as vLLM does,
and never reuses a number. Loading and removing go through the engine loop
(`EngineLoop.call`), never to the engine directly.
"""

from __future__ import annotations

import asyncio
import logging
from kvforge.core import ConfigError, RequestError
from kvforge.engine.lora_request import LoRARequest

from .errors import APIError

log = logging.getLogger(__name__)

# Codes of the 400s a load answers: the directory is not an adapter this model runs, or the name is taken.
INVALID_LORA_ADAPTER = "invalid_lora_adapter"
LORA_ADAPTER_EXISTS = "lora_adapter_exists"


class ServedAdapters:
    """The base model's name and the adapters served beside it."""

    def __init__(self, base_name: str, loop, adapters: list[LoRARequest] = ()):
        self.base_name = base_name
        self.loop = loop  # EngineLoop: every engine call goes through it
        self.adapters: dict[str, LoRARequest] = {request.lora_name: request for request in adapters}
        self._next_id = 1 + max((r.lora_int_id for r in adapters), default=0)
        self._changing = asyncio.Lock()  # one load or unload at a time: a name is checked, then taken

    def resolve(self, model: str | None) -> LoRARequest | None:
        """The adapter `model` names (None: the base model); 404 `model_not_found`
        naming what is served when it names neither."""
        if model is None or model == self.base_name:
            return None
        request = self.adapters.get(model)
        if request is None:
            adapters = f" and the LoRA adapters {sorted(self.adapters)}" if self.adapters else ""
            raise APIError(404, f"model {model!r} is not served here; this server serves {self.base_name!r}"
                           f"{adapters} (see GET /v1/models)", param="model", code="model_not_found")
        return request

    async def load(self, name: str, path: str) -> LoRARequest:
        """Load the adapter in directory `path` as `name` (the engine reads and
        checks it now): 400 when the name is taken or the directory is not an
        adapter this model runs (the message names the file or field)."""
        async with self._changing:
            if name == self.base_name or name in self.adapters:
                taken = ("is the served model's name" if name == self.base_name
                         else f"has already been loaded (from {self.adapters[name].lora_path})")
                raise APIError(400, f"The lora adapter {name!r} {taken}; unload it first (POST "
                               "/v1/unload_lora_adapter) or choose another lora_name", param="lora_name",
                               code=LORA_ADAPTER_EXISTS)
            try:
                request = LoRARequest(name, self._next_id, path)
                await self.loop.call(lambda engine: engine.add_lora(request))
            except (RequestError, ConfigError, OSError) as exc:  # LoRAAdapterError is a ConfigError
                raise APIError(400, f"LoRA adapter {name!r} cannot be loaded: {exc}", param="lora_path",
                               code=INVALID_LORA_ADAPTER) from None
            self._next_id += 1
            self.adapters[name] = request
            log.info("loaded LoRA adapter %r (lora_int_id %d) from %s", name, request.lora_int_id, path)
            return request

    async def unload(self, name: str | None, lora_int_id: int | None) -> LoRARequest:
        """Stop serving the adapter named `name` (or numbered `lora_int_id`): 404 if
        none is. Requests already running with it finish with it."""
        async with self._changing:
            request = next((r for r in self.adapters.values()
                            if (name is None or r.lora_name == name)
                            and (lora_int_id is None or r.lora_int_id == lora_int_id)), None)
            if request is None:
                given = " and ".join(f"{k} {v!r}" for k, v in (("lora_name", name), ("lora_int_id", lora_int_id))
                                     if v is not None)
                raise APIError(404, f"The lora adapter with {given} cannot be found; loaded: "
                               f"{sorted(self.adapters) or 'none'} (GET /v1/models lists them)",
                               param="lora_name" if name is not None else "lora_int_id", code="lora_adapter_not_found")
            del self.adapters[request.lora_name]
            await self.loop.call(lambda engine: engine.remove_lora(request.lora_int_id))
            log.info("unloaded LoRA adapter %r (lora_int_id %d)", request.lora_name, request.lora_int_id)
            return request

    def model_cards(self, created: int) -> list[dict]:
        """`/v1/models`' entries of the adapters, as vLLM lists them: `parent` is the base model."""
        return [{"id": name, "object": "model", "created": created, "owned_by": "kvforge",
                 "root": request.lora_path, "parent": self.base_name}
                for name, request in self.adapters.items()]
