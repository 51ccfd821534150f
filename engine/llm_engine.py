"""`LLMEngine`: add requests, call `step()` until done, read the outputs.

One step: schedule, run the model over one ragged batch, sample, and hand the
result to `Scheduler.update_from_output`, which applies it (requests with
non-finite logits ended, positions, cached blocks, forks, appended tokens,
stops); then report outputs and figures. For embedding in a custom serving
loop; `LLM` wraps it for batch use.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvforge.core import BlockStateError, ConfigError, EngineConfig, ProposerTarget, RequestError, build_registry, cdiv
from kvforge.models import heap

from . import components, executors
from .decode_bursts import burst_length, run_burst
from .detokenizer import IncrementalDetokenizer
from .kv_cache_manager import KVCacheManager
from .lora_request import LoRARequest
from .metrics import EngineMetrics, prometheus_text
from .model_runner import ModelRunner
from .outputs import RequestOutput, completion_of, timings_of
from .prompt_logprobs import PromptScorer
from .request import FinishReason, Request
from .drafting import Drafter
from .sampling_params import SamplingParams
from .scheduler import Scheduler
from .scheduler_output import SamplerOutput
from .step_sampling import StepSampler
from .vocabulary import vocabulary_of
from .warmup import warm_up, warm_up_tokens

log = logging.getLogger(__name__)


@dataclass
class _Group:
    """The samples of one user request, and how much of each was reported."""

    samples: list[Request]
    reported_tokens: list[int] = field(default_factory=list)
    reported_text: list[int] = field(default_factory=list)


class LLMEngine:
    """The reference engine. Build it from a config (`LLMEngine(config)`), a model
    name or directory (`LLMEngine(model="kvforge-tiny")`, which sets `config.model`
    as `LLM` does), or hand it a ready `model` (any CausalLM, see contracts) and
    `tokenizer`.

    `selected` names the implementation chosen for each part (attention backend,
    block allocator, scheduler policy, and the KV / weight quantizer and
    speculative proposer when configured); it is logged once at INFO.

    With `parallel.world_size > 1` the ranks run on the executor `parallel.executor`
    names (`executors.executor_class`); `executor=cls` passes a class following
    `executors.Executor` instead (also with one rank)."""

    def __init__(self, config: EngineConfig | None = None, *, model=None, tokenizer=None, registry=None,
                 executor: type[executors.Executor] | None = None):
        config, model = _config_and_model(config, model)
        self.config = config
        plugins = config.plugins
        self.registry = registry or build_registry(allow=plugins.allow, deny=plugins.deny, strict=plugins.strict)
        self.device = components.resolve_device(config)
        self.dtype = components.resolve_dtype(config, self.device)
        if self.device.type == "cpu" and config.keep_freed_memory:
            heap.keep_freed_memory()
        components.check_supported(config, self.dtype)
        kv_quantizer = components.resolve_kv_quantizer(self.registry, config)
        weight_quantizer = None
        self.executor = None  # an executors.Executor when parallel.world_size > 1 (or one is passed)
        if model is None:
            from kvforge.models import load_model, load_tokenizer

            layers = components.model_layers(config.model)
            backend = components.select_backend(self.registry, config, layers, self.device, self.dtype, kv_quantizer)
            weight_quantizer = components.weight_quantizer(self.registry, config)
            if executor is None and config.parallel.world_size > 1:
                executor = executors.executor_class(config)
            if executor is not None:
                self.executor = executor(config, backend, kv_quantizer, weight_quantizer, self.device, self.dtype)
                model = self.executor.model
            else:
                model = load_model(config.model, dtype=self.dtype, device=self.device, attention_backend=backend,
                                   linear_kernel=components.linear_kernel(config, self.dtype, self.device),
                                   kv_quantizer=kv_quantizer,
                                   weight_quantizer=weight_quantizer,
                                   weight_activations=config.quantization.activations,
                                   lora=config.lora if config.lora.enabled else None)
            tokenizer = tokenizer if tokenizer is not None else load_tokenizer(config.model)
        elif config.parallel.world_size > 1 or executor is not None:
            raise ConfigError(
                f"parallel.tensor_parallel_size / pipeline_parallel_size over {config.parallel.world_size} rank(s), "
                "or an executor, need the engine to load the model itself (each rank loads its part); pass a model name or directory, "
                "not a ready model")
        elif kv_quantizer is not None:
            components.use_kv_quantizer(model, kv_quantizer)
        self.model, self.tokenizer = model, tokenizer
        if self.device.type == "cpu":
            heap.release_free_memory()  # what loading freed (before the steps' activations are kept)
        block_size = config.cache.block_size
        spec = model.kv_cache_spec(block_size)
        self.num_blocks = components.num_blocks(config, spec, self.device, int(model.max_model_len))
        allocator = components.build_allocator(self.registry, config, self.num_blocks)
        self.kv = KVCacheManager(allocator, block_size, config.cache.enable_prefix_caching)
        policy = components.build_policy(self.registry, config)
        self.eos_token_id = getattr(model, "eos_token_id", None)
        if self.eos_token_id is None and tokenizer is not None:
            self.eos_token_id = getattr(tokenizer, "eos_token_id", None)
        self.structured_outputs = components.build_structured_outputs(
            self.registry, config, lambda: vocabulary_of(self.tokenizer, int(model.vocab_size), self.eos_token_id))
        self.scheduler = Scheduler(policy, self.kv,
                                   max_num_seqs=config.scheduler.max_num_seqs,
                                   max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
                                   max_model_len=int(model.max_model_len), structured_outputs=self.structured_outputs,
                                   max_loras=config.lora.max_loras if config.lora.enabled else None)
        kv_caches = model.allocate_kv_cache(self.num_blocks, block_size)
        if self.executor is None:
            self.runner = ModelRunner(model, self.kv, kv_caches, block_size, self.device)
        else:
            self.runner = self.executor.runner(self.kv, kv_caches, block_size, self.num_blocks)
        self.loras = components.build_lora_adapters(config, model, self.runner)  # None without lora.enabled
        if config.warmup:
            warm_up(self.runner, self.kv,
                    max_num_batched_tokens=warm_up_tokens(self.device, config.scheduler.max_num_batched_tokens),
                    max_num_seqs=config.scheduler.max_num_seqs, max_model_len=int(model.max_model_len))
        self.stats = EngineMetrics()
        self.step_sampler = StepSampler(config.seed, self.stats, self.structured_outputs)
        self.prompt_scorer = PromptScorer(None if tokenizer is None else lambda token: tokenizer.decode([token]))
        self.max_model_len = int(model.max_model_len)
        self.vocab_size = int(model.vocab_size)
        self.drafter = None
        self.max_burst = config.scheduler.num_scheduler_steps  # multi-step decoding; with a drafter, as it allows
        proposer = components.build_proposer(self.registry, config, ProposerTarget(
            config.model, self.vocab_size, self.max_model_len, self.device, self.dtype))
        if proposer is not None:
            spec = config.speculative
            self.drafter = Drafter(proposer, num_tokens=spec.num_tokens,
                                   disable_above_batch_size=spec.disable_above_batch_size,
                                   vocab_size=self.vocab_size, max_model_len=self.max_model_len,
                                   draft_policy=spec.draft_policy, device=self.device)
        self.selected = components.selected_names(model, allocator, policy, kv_quantizer, weight_quantizer, proposer)
        log.info("%s", components.describe_selection(self.selected))
        self.groups: dict[str, _Group] = {}
        self._arrivals = itertools.count()

    # Requests

    def add_request(self, request_id: str, prompt: str | Sequence[int] | None = None,
                    params: SamplingParams | None = None, priority: int = 0, *,
                    prompt_token_ids: Sequence[int] | None = None, arrival_time: float | None = None,
                    cache_salt: str | None = None, lora_request: LoRARequest | None = None) -> None:
        """Queue a request. Raises `RequestError` naming what is wrong (and changes
        nothing) for an invalid request; other requests are unaffected.

        `cache_salt` (vLLM's name) goes into the hash of every prefix-cache block of
        this request, so requests with different salts (tenants) never share cached
        blocks, and none can learn from timing what another has cached.

        `lora_request` runs it with that LoRA adapter (None: the base model); the
        adapter is loaded from its directory unless loaded already, and a bad one is
        refused here with a `RequestError` naming the file or field."""
        params = params if params is not None else SamplingParams()
        text, token_ids = self._prompt_tokens(request_id, prompt, prompt_token_ids)
        self._check_request(request_id, token_ids, params, priority)
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise RequestError(f"request {request_id!r}: cache_salt must be a non-empty string or None, "
                               f"got {cache_salt!r}")
        spec = self._structured_spec(request_id, params)
        adapter = self._lora_adapter(request_id, lora_request)
        arrival_index = next(self._arrivals)
        arrival_time = time.monotonic() if arrival_time is None else arrival_time
        samples = [
            Request(request_id if i == 0 else f"{request_id}#{i}", token_ids, params, priority=priority,
                    arrival_index=arrival_index, arrival_time=arrival_time, group_id=request_id, sample_index=i,
                    prompt=text, eos_token_id=None if params.ignore_eos else self.eos_token_id, cache_salt=cache_salt,
                    lora_request=lora_request, lora_adapter=adapter,
                    detokenizer=IncrementalDetokenizer(self.tokenizer)
                    if self.tokenizer is not None and params.detokenize else None)
            for i in range(params.n)
        ]
        if spec is not None:  # compiles off the step loop; the request waits for it
            samples[0].grammar_job = self.structured_outputs.start(spec, params.n)
        self.groups[request_id] = _Group(samples, [0] * params.n, [0] * params.n)
        samples[0].forks = samples[1:]  # they fork from it once its prompt is in the cache
        self.scheduler.add(samples[0])
        self.stats.num_requests += 1

    def _lora_adapter(self, request_id: str, lora_request: LoRARequest | None):
        """The loaded adapter of `lora_request` (None for the base model)."""
        if lora_request is None:
            return None
        if not isinstance(lora_request, LoRARequest):
            raise RequestError(f"request {request_id!r}: lora_request must be a kvforge.LoRARequest or None, "
                               f"got {type(lora_request).__name__}")
        if self.loras is None:
            raise RequestError(f"request {request_id!r} asks for LoRA adapter {lora_request.lora_name!r}, but this "
                               "engine serves no adapters; enable them with lora = {max_loras = N, max_lora_rank = R} "
                               "(LLM(model, lora={'max_loras': 4}))")
        try:
            return self.loras.get(lora_request)
        except ConfigError as exc:  # the adapter's directory is wrong: this request is, not the engine
            raise RequestError(f"request {request_id!r}: {exc}") from exc

    # LoRA adapters

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter ahead of its requests (`LoRAAdapterError` naming what is
        wrong with its directory); True once it is loaded."""
        if not isinstance(lora_request, LoRARequest):
            raise TypeError(f"add_lora takes a kvforge.LoRARequest, got {type(lora_request).__name__}")
        if self.loras is None:
            raise ConfigError("this engine serves no LoRA adapters; enable them with lora = {max_loras = N} "
                              "(LLM(model, lora={'max_loras': 4}))")
        self.loras.get(lora_request)
        return True

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget a loaded adapter (running requests keep their copy); False if it was not loaded."""
        return self.loras is not None and self.loras.remove(lora_int_id)

    def list_loras(self) -> list[LoRARequest]:
        """The loaded adapters, least recently used first."""
        return [] if self.loras is None else self.loras.requests()

    def _structured_spec(self, request_id: str, params: SamplingParams):
        """The request's structured-output spec, its backend chosen (`RequestError` naming
        why none can compile it); None without structured outputs."""
        if params.structured_outputs is None:
            return None
        if self.tokenizer is None or self.eos_token_id is None:
            lacks = "a tokenizer" if self.tokenizer is None else "an EOS token"
            raise RequestError(f"request {request_id!r}: structured_outputs needs the model's tokenizer and EOS token, "
                               f"and model {self.config.model!r} lacks {lacks}")
        spec = params.structured_outputs.spec()
        try:
            self.structured_outputs.backend_for(spec)
        except RequestError as exc:
            raise RequestError(f"request {request_id!r}: {exc}") from exc
        return spec

    def _prompt_tokens(self, request_id, prompt, prompt_token_ids) -> tuple[str | None, list[int]]:
        if prompt is not None and prompt_token_ids is not None:
            raise RequestError(f"request {request_id!r}: pass a prompt or prompt_token_ids, not both")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError(f"request {request_id!r}: a text prompt needs a tokenizer, and model "
                                   f"{self.config.model!r} has none; pass prompt_token_ids instead")
            return prompt, list(self.tokenizer.encode(prompt))
        token_ids = prompt_token_ids if prompt_token_ids is not None else prompt
        if token_ids is None:
            raise RequestError(f"request {request_id!r}: no prompt; pass a prompt string or prompt_token_ids")
        if isinstance(token_ids, torch.Tensor):
            token_ids = token_ids.tolist()
        return None, [int(t) for t in token_ids]

    def _check_request(self, request_id: str, token_ids: list[int], params: SamplingParams, priority: int) -> None:
        def fail(why: str) -> None:
            raise RequestError(f"request {request_id!r}: {why}")

        if not isinstance(request_id, str) or not request_id:
            raise RequestError(f"request id must be a non-empty string, got {request_id!r}")
        if request_id in self.groups:
            fail("a request with this id is still running; use a unique id per request")
        if not isinstance(params, SamplingParams):
            fail(f"params must be a SamplingParams, got {type(params).__name__}")
        if not isinstance(priority, int):
            fail(f"priority must be an integer, got {priority!r}")
        if not token_ids:
            fail("the prompt is empty; give at least one token")
        if len(token_ids) > self.max_model_len:
            fail(f"the prompt has {len(token_ids)} tokens, more than the model's context of "
                 f"{self.max_model_len}; shorten it")
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            fail(f"token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        bad = [t for t in params.logit_bias or () if t >= self.vocab_size]
        if bad:
            fail(f"logit_bias keys {bad[:5]} are outside the vocabulary [0, {self.vocab_size}); "
                 "bias this model's tokens")
        blocks = cdiv(len(token_ids), self.kv.block_size)
        if blocks > self.num_blocks:
            fail(f"the prompt needs {blocks} KV blocks but the whole cache has {self.num_blocks}; "
                 "raise cache.num_blocks or cache.memory_budget, or shorten the prompt")

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its blocks; returns its final output, or
        None if no such request is unfinished."""
        group = self.groups.pop(request_id, None)
        if group is None:
            return None
        for sample in group.samples:
            if not sample.finished:
                self.scheduler.finish(sample, FinishReason.ABORT)
        if self.drafter is not None:
            self.drafter.release(group.samples)
        self.stats.num_aborted += 1
        return self._output(request_id, group)

    def shutdown(self) -> None:
        """Stop the worker processes of a tensor- or pipeline-parallel engine (also done
        at exit) and the grammar compile threads; it cannot step afterwards."""
        self.structured_outputs.shutdown()
        if self.executor is not None:
            self.executor.shutdown()

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups)

    def reset_prefix_cache(self) -> int:
        """Forget every cached KV block (see `KVCacheManager.reset_prefix_cache`);
        refused with `BlockStateError` while running requests hold blocks.
        Returns how many cached blocks were cleared."""
        return self.kv.reset_prefix_cache()

    # Stepping

    def step(self, final_only: bool = False) -> list[RequestOutput]:
        """Run one scheduler step; the outputs of every request that progressed
        (with `final_only`, of every request that finished)."""
        drafts = self.drafter.propose(self.scheduler.running) if self.drafter is not None else None
        if drafts:
            drafts = self.structured_outputs.cut_drafts(drafts, self.scheduler.running)
        plan = self.scheduler.schedule(drafts)
        if not plan.scheduled and not plan.finished and self.scheduler.waiting_for_grammar:
            # only grammars compiling: sleep until one is ready rather than spin
            self.structured_outputs.wait([r.grammar_job for r in self.scheduler.waiting_for_grammar], 0.05)
        touched = dict.fromkeys(r.group_id for r in plan.finished)  # ordered, unlike a set
        finished = list(plan.finished)
        passes = 1
        if plan.scheduled:
            self.stats.num_prompt_tokens += sum(
                max(0, min(e.request.num_prompt_tokens, e.start + e.num_tokens) - e.start) for e in plan.scheduled)
            sampled, passes = self._run(plan)
            if self.loras is not None:
                self.loras.count_tokens(plan.scheduled, sampled.tokens)
            update = self.scheduler.update_from_output(plan, sampled)
            self.stats.num_generated_tokens += update.num_generated_tokens
            touched.update(dict.fromkeys(r.group_id for r in update.failed))
            touched.update(dict.fromkeys(r.group_id for r in update.progressed))
            finished += update.finished
        if self.drafter is not None:
            self.drafter.observe(plan.scheduled, passes)
            if finished:
                self.drafter.release(finished)
        self.stats.num_steps += 1
        outputs = []
        for group_id in touched:
            group = self.groups.get(group_id)
            if group is None:
                continue
            samples = group.samples
            done = samples[0].finished if len(samples) == 1 else all(s.finished for s in samples)
            if done or not final_only:
                outputs.append(self._output(group_id, group))
            if done:
                del self.groups[group_id]
                self.stats.num_finished += 1
                self.stats.num_errors += any(s.finish_reason is FinishReason.ERROR for s in group.samples)
        if not self.groups:
            self._check_no_blocks_held()
        return outputs

    def _run(self, plan) -> tuple[SamplerOutput, int]:
        """The model over the plan's entries, sampled: one step, or a multi-step burst
        where `scheduler.num_scheduler_steps` (and the drafter, with speculation)
        allows one (`decode_bursts`); with the number of decode passes run."""
        lora_slots = self._lora_slots(plan.scheduled)
        most = self.max_burst
        if self.drafter is not None and self.drafter.burst_passes is not None:
            most = min(most, self.drafter.burst_passes)
        steps = 1
        if most > 1:
            steps = burst_length(plan.scheduled, most, self.max_model_len, self.scheduler.others_wait(plan),
                                 penalties=self.runner.bursts_in_cpp)
            steps = self.scheduler.reserve_steps(plan, steps) if steps > 1 else 1
        if steps > 1:
            sampled = run_burst(self.runner, self.step_sampler, plan, steps, lora_slots,
                                self.config.scheduler.max_burst_s)
            return sampled, max((len(t.token_ids) for t in sampled.tokens.values()), default=1)
        logits = self.runner.execute(plan.scheduled, lora_slots=lora_slots)
        logits = self.prompt_scorer.take(plan.scheduled, logits)
        return self.step_sampler.sample(plan, logits), 1

    def _lora_slots(self, scheduled) -> list[int] | None:
        """Each scheduled entry's LoRA slot (-1: the base model); None when no entry runs an adapter."""
        if self.loras is None or all(e.request.lora_request is None for e in scheduled):
            return None
        return self.loras.slots_for([None if e.request.lora_request is None
                                     else (e.request.lora_request, e.request.lora_adapter) for e in scheduled])

    def _check_no_blocks_held(self) -> None:
        """With no request left, every KV block must be back in the pool; a block still
        held is leaked by the allocator (or the engine), and would shrink the cache
        for every later request, showing up only as truncated outputs."""
        usage = self.kv.usage()
        held = usage.num_blocks - usage.free
        if held:
            name = self.selected["block_allocator"]
            raise BlockStateError(
                f"KV block leak: no request is left, but block allocator {name!r} "
                f"({type(self.kv.allocator).__module__}.{type(self.kv.allocator).__qualname__}) reports {held} of "
                f"{usage.num_blocks} blocks still held; its free() does not return every block to the pool. "
                f"Run `kvforge conformance --plugin PLUGIN` on the plugin that provides {name!r}, or choose another "
                f"allocator (cache.allocator)")

    def _output(self, group_id: str, group: _Group) -> RequestOutput:
        completions = []
        for i, sample in enumerate(group.samples):
            completions.append(completion_of(sample, group.reported_tokens[i], group.reported_text[i]))
            group.reported_tokens[i] = len(sample.output_token_ids)
            group.reported_text[i] = len(completions[-1].text)
        first = group.samples[0]
        # once complete the list never changes again, so it is handed out, not copied
        scored = None if first.prompt_logprobs is None or first.needs_prompt_logits else first.prompt_logprobs
        return RequestOutput(group_id, first.prompt, first.prompt_token_ids, completions,
                             all(s.finished for s in group.samples), timings_of(group.samples), scored)

    # Metrics

    def metrics(self) -> dict[str, float]:
        """Running, waiting, KV usage, preemptions, prefix-cache hit rate, ... as a dict."""
        usage = self.kv.usage()
        figures = self.stats.snapshot(running=len(self.scheduler.running), waiting=len(self.scheduler.waiting),
                                      kv_usage=usage.usage, preemptions=self.scheduler.num_preemptions,
                                      prefix_cache_hit_rate=usage.hit_rate)
        figures.update(self.structured_outputs.figures(len(self.scheduler.waiting_for_grammar)))
        return figures

    def lora_figures(self) -> dict[str, dict[str, int]]:
        """Per LoRA adapter name: requests running and waiting, prompt tokens computed
        and tokens generated so far (empty without `lora.enabled`)."""
        if self.loras is None:
            return {}
        return self.loras.figures(self.scheduler.running, [*self.scheduler.waiting, *self.scheduler.waiting_for_grammar])

    def metrics_prometheus(self) -> str:
        """`metrics()` in Prometheus text format (needs prometheus_client)."""
        return prometheus_text(self.metrics())


def _config_and_model(config, model) -> tuple[EngineConfig, object]:
    """The config to build from and the ready model (None to load one): a model name
    or directory given as `model` becomes `config.model`, as in `LLM`."""
    if config is not None and not isinstance(config, EngineConfig):
        hint = (f"; to load a model by name, write LLMEngine(model={str(config)!r})"
                if isinstance(config, (str, Path)) else "")
        raise TypeError(f"LLMEngine's config must be an EngineConfig (or None), got {type(config).__name__}{hint}")
    config = config or EngineConfig()
    if isinstance(model, (str, Path)):
        return EngineConfig.model_validate({**config.model_dump(), "model": str(model)}), None
    if model is not None and not callable(getattr(model, "kv_cache_spec", None)):
        raise TypeError(f"LLMEngine's model must be a model name, a model directory or a CausalLM (with "
                        f"kv_cache_spec, allocate_kv_cache, plan, forward, compute_logits), got "
                        f"{type(model).__name__}")
    return config, model
