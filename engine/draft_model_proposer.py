"""The `draft_model` speculative proposer: a smaller model with the target's
vocabulary drafts the next tokens.

The draft runs on the engine's own parts: a `KVCacheManager` (without prefix
caching, so a block's content may be overwritten) over an allocator chosen
through the registry, an attention backend chosen like the engine chooses its
own, and a `ModelRunner` for the ragged batches. Per request it remembers the
token ids whose keys and values its cache holds. Each `propose`:

1. keeps the longest common prefix of what it holds and the request's tokens
   (a rejected draft is rolled back by writing over it; nothing is freed);
2. feeds the missing tokens of every request in one ragged batch, in chunks of
   at most `max_num_batched_tokens`, which gives the first draft token;
3. runs k - 1 batched decode steps, one per further draft token.

Greedy requests (temperature 0) draft the argmax. Sampled ones draw from
softmax(logits / T) and return those rows as `probs`, so the engine's
rejection sampling stays exact; the draw uses a generator seeded from the
request id and its length, so the same state drafts the same tokens.
"""

from __future__ import annotations

import difflib
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvforge.core import (
    ConfigError,
    DraftProposal,
    EngineConfig,
    ProposalRequest,
    ProposerTarget,
    RequestError,
    SpeculativeProposer,
    build_registry,
    hookimpl,
)

from .sampler import inverse_cdf

DEFAULT_DRAFTS = {"kvforge-tiny": "kvforge-tiny-draft"}
"""The draft model used when `model` is not given, by target model name."""

DRAFT_CUDA_FRACTION = 0.1
"""Default KV budget on CUDA, as a fraction of free memory: the engine's own default
(most of what is free) would leave nothing for the target's cache."""


class DraftModelOptions(BaseModel):
    """`speculative.options` of the `draft_model` proposer."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str | None = Field(None, description="the draft: a built-in model name or a local Hugging Face directory; "
                                                "default kvforge-tiny-draft for the target kvforge-tiny")
    attention_backend: str = Field("auto", description="attention_backend name for the draft, or auto")
    block_size: int = Field(16, ge=1, le=1024, strict=True, description="tokens per block of the draft's KV cache")
    num_blocks: int | None = Field(None, ge=1, strict=True, description="blocks in the draft's KV cache")
    memory_budget: float | str | None = Field(
        None, description="the draft's KV cache size: bytes (int or '512MiB') or a fraction (0, 1) of free memory")
    max_num_batched_tokens: int = Field(
        2048, ge=1, strict=True, description="most tokens fed to the draft in one step (longer catch-ups are chunked)")


OPTION_NAMES = tuple(DraftModelOptions.model_fields)


def parse_options(options: dict[str, Any]) -> tuple[DraftModelOptions, EngineConfig]:
    """Validated options and the engine config the draft's parts are built from
    (its `model` still unset), or a ConfigError naming the bad option."""
    unknown = sorted(set(options) - set(OPTION_NAMES))
    if unknown:
        hints = [f"{name!r} (did you mean {close[0]!r}?)" if (close := difflib.get_close_matches(name, OPTION_NAMES, 1))
                 else repr(name) for name in unknown]
        raise ConfigError(f"speculative proposer 'draft_model' has no option {', '.join(hints)}; valid options: "
                          f"{', '.join(OPTION_NAMES)}")
    try:
        parsed = DraftModelOptions(**options)
        config = EngineConfig(
            attention={"backend": parsed.attention_backend},
            cache={"block_size": parsed.block_size, "num_blocks": parsed.num_blocks,
                   "memory_budget": parsed.memory_budget, "enable_prefix_caching": False},
            scheduler={"max_num_batched_tokens": parsed.max_num_batched_tokens})
    except ValidationError as exc:
        problems = "; ".join(f"{option_of(error['loc'])} = {error.get('input')!r}: {error['msg']}"
                             for error in exc.errors())
        raise ConfigError(f"invalid speculative.options for 'draft_model': {problems}") from None
    return parsed, config


def option_of(loc: tuple) -> str:
    """The option a pydantic error location points at (it may also name a section or a union member)."""
    return next((str(part) for part in loc if part in OPTION_NAMES), ".".join(map(str, loc)))


@dataclass
class _Sequence:
    """One request's tokens as the `ModelRunner` reads them (`token_slice`): all of
    them in `prompt_token_ids`, drafts appended as they are drawn."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)


@dataclass
class _Step:
    """`num_tokens` tokens of `request` from position `start`: shaped like the
    scheduler's `ScheduledRequest`, which is what `ModelRunner.execute` reads."""

    request: _Sequence
    start: int
    num_tokens: int
    num_logit_rows: int = 1  # 1: the logits of its last token are wanted
    num_prompt_logit_rows: int = 0  # the draft model scores no prompt
    draft_token_ids: tuple = ()  # the target's drafts to verify; the draft model verifies none


@dataclass
class _Drafting:
    """One request being drafted in this `propose` call."""

    index: int  # position in the call's request list
    sequence: _Sequence
    start: int  # the next token to feed: every one before it is in the draft's cache
    length: int  # tokens the request has
    num_drafts: int
    temperature: float
    uniforms: torch.Tensor | None = None  # one per draft token, for sampled requests
    drafts: list[int] = field(default_factory=list)
    probs: list[torch.Tensor] = field(default_factory=list)


class DraftModelProposer(SpeculativeProposer):
    """Drafts with a smaller model of the same vocabulary, kept in step with the
    tokens the target accepted. Options: see `DraftModelOptions`."""

    name = "draft_model"

    def __init__(self, **options):
        self.options, self.config = parse_options(options)
        self.target: ProposerTarget | None = None
        self.model = None
        self.kv = None
        self.runner = None
        self.num_blocks = 0
        self.max_model_len = 0  # the smaller of the target's and the draft's context
        self.held: dict[str, list[int]] = {}  # request id -> token ids whose KV the draft's cache holds

    # Setup

    def draft_name(self, target: ProposerTarget) -> str:
        """The draft model for `target`: the `model` option, or the built-in default."""
        if self.options.model is not None:
            return self.options.model
        default = DEFAULT_DRAFTS.get(target.model) or DEFAULT_DRAFTS.get(Path(target.model).name)
        if default is None:
            raise ConfigError(
                f"speculative proposer 'draft_model' needs speculative.options.model for the target {target.model!r} "
                f"(a default draft exists only for {', '.join(DEFAULT_DRAFTS)}): give a built-in model name or a "
                "local Hugging Face directory of a smaller model with the same vocabulary")
        return default

    def setup(self, target: ProposerTarget) -> None:
        """Load the draft on the target's device and dtype and size its KV cache.
        Refuses a draft whose vocabulary size differs from the target's."""
        from kvforge.models import load_model
        from kvforge.models.loader import load_config, resolve_model_dir

        from . import components
        from .kv_cache_manager import KVCacheManager
        from .model_runner import ModelRunner

        name = self.draft_name(target)
        try:
            draft_config = load_config(resolve_model_dir(name))
        except ConfigError as exc:
            raise ConfigError(f"speculative.options.model: {exc}") from None
        vocab_size = draft_config.value("vocab_size")
        if vocab_size != target.vocab_size:
            raise ConfigError(
                f"the draft model {name!r} has a vocabulary of {vocab_size} tokens but the target {target.model!r} "
                f"has {target.vocab_size}; a draft must share the target's vocabulary: choose another "
                "speculative.options.model")
        config = self.config.model_copy(update={"model": name})
        if config.cache.num_blocks is None and config.cache.memory_budget is None and target.device.type == "cuda":
            config = config.model_copy(update={"cache": config.cache.model_copy(
                update={"memory_budget": DRAFT_CUDA_FRACTION})})
        registry = build_registry()
        backend = components.select_backend(registry, config, components.model_layers(name), target.device,
                                             target.dtype)
        model = load_model(name, dtype=target.dtype, device=target.device, attention_backend=backend)
        block_size = config.cache.block_size
        num_blocks = components.num_blocks(config, model.kv_cache_spec(block_size), target.device,
                                           int(model.max_model_len))
        allocator = components.build_allocator(registry, config, num_blocks)
        self.kv = KVCacheManager(allocator, block_size, enable_prefix_caching=False)
        self.runner = ModelRunner(model, self.kv, model.allocate_kv_cache(num_blocks, block_size), block_size,
                                  target.device)
        self.model, self.target = model, target
        self.num_blocks = num_blocks
        self.max_model_len = min(target.max_model_len, int(model.max_model_len))
        self.held.clear()

    # Drafting

    def propose(self, requests: Sequence[ProposalRequest], num_tokens: int) -> list[DraftProposal]:
        """Up to `num_tokens` drafts per request, never past the target's context
        (draft `i` takes position `len(token_ids) + i`, which must lie inside it)."""
        if self.runner is None:
            raise RequestError("the draft_model proposer is not set up; the engine calls setup(ProposerTarget) "
                               "before the first propose")
        if num_tokens < 0:
            raise RequestError(f"num_tokens must be >= 0, got {num_tokens}")
        ids = [request.request_id for request in requests]
        if len(set(ids)) != len(ids):
            twice = sorted({i for i in ids if ids.count(i) > 1})
            raise RequestError(f"request ids {twice} appear more than once in one propose call; each request's "
                               "drafts extend its own cache, so give every request (and every sample) its own id")
        proposals = [DraftProposal([]) for _ in requests]
        drafting = [d for i, request in enumerate(requests) if (d := self._prepare(i, request, num_tokens)) is not None]
        if not drafting:
            return proposals
        self._catch_up(drafting)
        for step in range(1, max(d.num_drafts for d in drafting)):
            active = [d for d in drafting if d.num_drafts > step]
            entries = [_Step(d.sequence, d.length + step - 1, 1) for d in active]
            self._draw(active, self.runner.execute(entries))
        for d in drafting:
            # The cache now holds the request's tokens and every draft but the last (never fed).
            self.held[d.sequence.request_id] = d.sequence.prompt_token_ids[:d.length + d.num_drafts - 1]
            proposals[d.index] = DraftProposal(d.drafts, torch.stack(d.probs) if d.probs else None)
        return proposals

    def _prepare(self, index: int, request: ProposalRequest, num_tokens: int) -> _Drafting | None:
        """Roll the request's cache back to what still matches and reserve room for
        this call's writes; None when it gets no drafts (context or cache full)."""
        if not request.temperature >= 0:
            raise RequestError(f"request {request.request_id!r}: temperature must be >= 0 (0: greedy), "
                               f"got {request.temperature}")
        tokens = list(request.token_ids)
        length = len(tokens)
        num_drafts = min(num_tokens, self.max_model_len - length)
        if num_drafts <= 0 or length == 0:
            return None
        request_id = request.request_id
        if request_id not in self.kv:
            self.kv.admit(request_id, ())
        # The last token is fed again even when held: its logits give the first draft.
        start = min(common_prefix_length(self.held.get(request_id, []), tokens), length - 1)
        if not self.kv.allocate_slots(request_id, length + num_drafts - 1):
            return None  # out of blocks: no drafts this step; what it holds stays valid
        self.held[request_id] = tokens[:start]
        drafting = _Drafting(index, _Sequence(request_id, tokens), start, length, num_drafts,
                             float(request.temperature))
        if drafting.temperature > 0:
            seed = zlib.crc32(f"{request_id}:{length}".encode())
            drafting.uniforms = torch.rand(num_drafts, generator=torch.Generator().manual_seed(seed),
                                           dtype=torch.float64)
        return drafting

    def _catch_up(self, drafting: list[_Drafting]) -> None:
        """Feed every request's uncached tokens, chunked under the token budget; the
        logits of each request's last token give its first draft."""
        budget = self.config.scheduler.max_num_batched_tokens
        while True:
            entries, finishing = [], []
            left = budget
            for d in drafting:
                count = min(d.length - d.start, left)
                if count <= 0:
                    continue
                d.start += count
                left -= count
                entries.append(_Step(d.sequence, d.start - count, count, int(d.start == d.length)))
                if d.start == d.length:
                    finishing.append(d)
            if not entries:
                return
            self._draw(finishing, self.runner.execute(entries))

    def _draw(self, drafting: list[_Drafting], logits: torch.Tensor) -> None:
        """Draw one draft token for each request from its row of `logits`, batched:
        argmax for greedy rows, inverse-CDF sampling of softmax(logits / T) for the others."""
        if not drafting:
            return
        tokens = logits.argmax(dim=-1)
        sampled = [row for row, d in enumerate(drafting) if d.temperature > 0]
        probs = None
        if sampled:
            rows = torch.tensor(sampled, device=logits.device)
            temperatures = torch.tensor([drafting[r].temperature for r in sampled], device=logits.device)
            probs = torch.softmax(logits[rows] / temperatures[:, None], dim=-1)
            uniforms = torch.stack([drafting[r].uniforms[len(drafting[r].drafts)] for r in sampled]).to(logits.device)
            tokens[rows] = inverse_cdf(probs, uniforms)  # the sampler's draw: never a token of zero probability
        chosen = tokens.tolist()
        for row, d in enumerate(drafting):
            d.drafts.append(chosen[row])
            d.sequence.prompt_token_ids.append(chosen[row])
        if probs is not None:
            for i, row in enumerate(sampled):
                drafting[row].probs.append(probs[i])

    # Bookkeeping

    def release(self, request_id: str) -> None:
        """Free the request's blocks in the draft's cache; unknown ids are ignored."""
        self.held.pop(request_id, None)
        if self.kv is not None and request_id in self.kv:
            self.kv.free(request_id)


def common_prefix_length(held: list[int], tokens: list[int]) -> int:
    """How many leading tokens `held` and `tokens` share."""
    n = min(len(held), len(tokens))
    if held[:n] == tokens[:n]:  # the usual case (nothing rejected): one comparison in C
        return n
    return int((torch.tensor(held[:n]) != torch.tensor(tokens[:n])).to(torch.uint8).argmax())


@hookimpl
def kvforge_implementations():
    return [DraftModelProposer]
