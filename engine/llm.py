"""`LLM`: batch generation in the shape users know from vLLM.

    from kvforge import LLM, SamplingParams
    llm = LLM(model="kvforge-tiny", cache={"block_size": 16})
    for out in llm.generate(["Hello"], SamplingParams(max_tokens=32)):
        print(out.text, out.finish_reason, out.timings.ttft)
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from kvforge.core import ConfigError, EngineConfig, RequestError, load_config

from .llm_engine import LLMEngine
from .lora_request import LoRARequest
from .outputs import CompletionOutput, RequestOutput, RequestTimings
from .sampling_params import SamplingParams


class LLM:
    """An engine plus a request loop. `model` is a local Hugging Face directory or a
    built-in name; other keyword arguments are config sections or top-level
    settings (`cache={"num_blocks": 256}`, `device="cpu"`, `seed=1`), applied over
    `config` (an `EngineConfig`) and `config_file` (TOML) when given."""

    def __init__(self, model: str | None = None, *, config: EngineConfig | None = None,
                 config_file: str | Path | None = None, overrides: Sequence[str] = (), **sections: Any):
        if config is not None:  # its explicitly set values, under the keyword arguments
            base = config.model_dump(exclude_unset=True)
            for name, value in sections.items():
                if isinstance(value, dict) and isinstance(base.get(name), dict):
                    value = {**base[name], **value}
                base[name] = value
            sections = base
        if model is not None:
            sections["model"] = model
        self.config = load_config(config_file, overrides=overrides, **sections).config
        self.engine = LLMEngine(self.config)
        self._ids = itertools.count()

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> "LLM":
        """Wrap an existing engine (for example one built around a custom model)."""
        llm = cls.__new__(cls)
        llm.config, llm.engine, llm._ids = engine.config, engine, itertools.count()
        return llm

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def reset_prefix_cache(self) -> int:
        """Forget every cached KV block, so the next `generate` recomputes every
        prompt (vLLM's `LLM.reset_prefix_cache`, which returns False where this raises
        `BlockStateError`: while a `stream` is still running). Returns how many
        cached blocks were cleared."""
        return self.engine.reset_prefix_cache()

    def generate(self, prompts: str | Mapping | Sequence[str | Mapping] | None = None,
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 prompt_token_ids: Sequence[Sequence[int]] | None = None,
                 priority: Sequence[int] | None = None, use_tqdm: bool = False,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """One finished output per prompt, in the order given. A prompt is text, or as in
        vLLM a dict `{"prompt": text}` or `{"prompt_token_ids": ids}`; token ids may
        also come as `prompt_token_ids=[[...], ...]`. An invalid prompt gets
        an output with `finish_reason == "error"` and `.error` saying why; the
        others run normally. `lora_request` runs every prompt with one LoRA adapter,
        or (a list) each prompt with its own (None: the base model)."""
        final: dict[str, RequestOutput] = {}
        order = []
        progress = None
        if use_tqdm:
            from tqdm import tqdm

            progress = tqdm(total=None, desc="requests", unit="req")
        for output in self._run(prompts, sampling_params, prompt_token_ids, priority, order, final_only=True,
                                lora_request=lora_request):
            if output.finished:
                final[output.request_id] = output
                if progress is not None:
                    progress.total = len(order)
                    progress.update(1)
        if progress is not None:
            progress.close()
        return [final[request_id] for request_id in order]

    def stream(self, prompts: str | Mapping | Sequence[str | Mapping] | None = None,
               sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
               prompt_token_ids: Sequence[Sequence[int]] | None = None,
               priority: Sequence[int] | None = None,
               lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> Iterator[RequestOutput]:
        """Yield a `RequestOutput` whenever a request progresses; its completions'
        `new_token_ids` / `new_text` hold what that step added."""
        yield from self._run(prompts, sampling_params, prompt_token_ids, priority, [], lora_request=lora_request)

    def _run(self, prompts, sampling_params, prompt_token_ids, priority, order: list[str],
             final_only: bool = False, lora_request=None) -> Iterator[RequestOutput]:
        inputs = _inputs(prompts, prompt_token_ids)
        params = _per_prompt(sampling_params, len(inputs), "sampling_params") if inputs else []
        priorities = _per_prompt(priority, len(inputs), "priority") if priority is not None else [0] * len(inputs)
        loras = _per_prompt(lora_request, len(inputs), "lora_request") if inputs else []
        for prompt, param, prio, lora in zip(inputs, params, priorities, loras):
            request_id = str(next(self._ids))
            order.append(request_id)
            try:
                self.engine.add_request(request_id, prompt, param or SamplingParams(), prio, lora_request=lora)
            except (RequestError, ConfigError) as exc:
                yield _error_output(request_id, prompt, str(exc))
        try:
            while self.engine.has_unfinished_requests():
                yield from self.engine.step(final_only=final_only)
        finally:  # a caller that stops iterating early leaves nothing running behind
            for request_id in order:
                self.engine.abort_request(request_id)


PROMPT_KEYS = ("prompt", "prompt_token_ids")  # a prompt dict holds one of them (vLLM's TextPrompt, TokensPrompt)


def _prompt(item):
    """A prompt as the engine takes it: text or token ids; a dict `{"prompt": text}`
    or `{"prompt_token_ids": ids}` gives its one value."""
    if not isinstance(item, Mapping):
        return item
    given = [key for key in PROMPT_KEYS if key in item]
    other = sorted(str(key) for key in item if key not in PROMPT_KEYS)
    if len(given) != 1 or other:
        raise RequestError(
            f"a prompt dict holds exactly one of {', '.join(repr(k) for k in PROMPT_KEYS)}, got keys "
            f"{sorted(str(k) for k in item) or 'none'}" + (f" ({', '.join(other)} not supported)" if other else "")
            + "; e.g. {'prompt_token_ids': [1, 2, 3]}")
    value = item[given[0]]
    return value if given[0] == "prompt" else list(value)


def _inputs(prompts, prompt_token_ids) -> list:
    if prompts is not None and prompt_token_ids is not None:
        raise RequestError("pass prompts or prompt_token_ids, not both")
    if prompts is not None:
        return [_prompt(prompts)] if isinstance(prompts, (str, Mapping)) else [_prompt(p) for p in prompts]
    if prompt_token_ids is None:
        raise RequestError("no prompts; pass prompts=[...] or prompt_token_ids=[[...], ...]")
    rows = list(prompt_token_ids)
    if rows and all(isinstance(t, int) for t in rows):
        rows = [rows]  # a single token-id prompt
    return [list(r) for r in rows]


def _per_prompt(value, count: int, name: str) -> list:
    if value is None or not isinstance(value, (list, tuple)):
        return [value] * count
    if len(value) != count:
        raise RequestError(f"{name} has {len(value)} entries for {count} prompts; give one, or one per prompt")
    return list(value)


def _error_output(request_id: str, prompt, message: str) -> RequestOutput:
    text = prompt if isinstance(prompt, str) else None
    token_ids = [] if isinstance(prompt, str) else list(prompt or [])
    completion = CompletionOutput(0, "", [], finish_reason="error", error=message)
    return RequestOutput(request_id, text, token_ids, [completion], True, RequestTimings(arrival_time=0.0))
