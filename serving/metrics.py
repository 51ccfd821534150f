"""`/metrics`: Prometheus counters, gauges and histograms under vLLM's names and
buckets (`vllm:num_requests_running`, `vllm:time_to_first_token_seconds`, ...),
so dashboards built for `vllm serve` read a kvforge server unchanged.

With LoRA adapters, vLLM's `vllm:lora_requests_info` (its value the time of
the last update; labels `running_lora_adapters` and `waiting_lora_adapters`,
the adapters with requests running or waiting, comma-separated, and `max_lora`)
and, per adapter (label `lora_name`), kvforge's own request gauges and token
counters (`kvforge:lora_prompt_tokens_total`, ...).

The metrics are built once per server and updated after every engine step (and
after aborts); a scrape only renders them. Counters follow the engine's own
running totals, so a scrape never misses what happened between two scrapes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvforge.engine.structured_outputs import COMPILE_SECONDS_BUCKETS

# vLLM's buckets (vllm/v1/metrics/loggers.py), so histogram quantiles compare across servers.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                         20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)
N_BUCKETS = (1, 2, 5, 10, 20)
FINISH_REASONS = ("stop", "length", "abort", "error")


def buckets_1_2_5(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to `max_value` (vLLM's token-count buckets)."""
    out, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return out
            out.append(mantissa * scale)
        scale *= 10


@dataclass
class EngineSnapshot:
    """An engine's gauges and running totals after a step: all the metrics read
    of it, small enough to send from a replica's process after every step."""

    running: int
    waiting: int
    kv_usage: float
    prefix_lookups: int
    prefix_hits: int
    preemptions: int
    prompt_tokens: int
    generated_tokens: int
    drafts: int
    draft_tokens: int
    accepted_tokens: int
    waiting_for_grammar: int = 0  # structured outputs: requests whose grammar compiles, the compile
    grammar_compile_seconds: tuple[float, ...] = ()  # times since the last snapshot, and a running total
    grammar_mask_seconds: float = 0.0
    max_loras: int = 0  # lora.max_loras; 0 without LoRA
    # LoRA adapter name: running, waiting, prompt_tokens, generation_tokens (`LLMEngine.lora_figures`)
    lora: dict[str, dict[str, int]] = field(default_factory=dict)

    @classmethod
    def of(cls, engine) -> "EngineSnapshot":
        usage, stats = engine.kv.usage(), engine.stats
        grammars = engine.structured_outputs.stats
        return cls(len(engine.scheduler.running), len(engine.scheduler.waiting), usage.usage, usage.lookups,
                   usage.hits, engine.scheduler.num_preemptions, stats.num_prompt_tokens,
                   stats.num_generated_tokens, stats.num_verifications, stats.num_draft_tokens,
                   stats.num_accepted_tokens, len(engine.scheduler.waiting_for_grammar),
                   grammars.take_compile_seconds(), grammars.mask_seconds_sum,
                   engine.config.lora.max_loras if engine.config.lora.enabled else 0, engine.lora_figures())


class ServerMetrics:
    """Every metric of one server, labelled `model_name` and `engine` as vLLM's
    are; with data-parallel replicas, `engine` is the replica's index (as in
    vLLM's data-parallel serving) and each replica has its own series."""

    def __init__(self, model_name: str, max_model_len: int, block_size: int, num_engines: int = 1):
        self.registry = CollectorRegistry()
        self.block_size = block_size
        names = ["model_name", "engine"]
        engines = [{"model_name": model_name, "engine": str(i)} for i in range(num_engines)]

        def per_engine(metric) -> list:  # one labelled child per engine, indexed by the engine's number
            return [metric.labels(**labels) for labels in engines]

        def gauge(name, doc):
            return per_engine(Gauge(name, doc, names, registry=self.registry))

        def counter(name, doc):
            return per_engine(Counter(name, doc, names, registry=self.registry))

        def histogram(name, doc, buckets):
            return per_engine(Histogram(name, doc, names, buckets=buckets, registry=self.registry))

        self.running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.prefix_queries = counter("vllm:prefix_cache_queries",
                                      "Prefix cache queries, in tokens (looked-up blocks times the block size).")
        self.prefix_hits = counter("vllm:prefix_cache_hits",
                                   "Prefix cache hits, in tokens (hit blocks times the block size).")
        self.preemptions = counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self.spec_drafts = counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.")
        self.spec_draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.")
        self.spec_accepted_tokens = counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.")
        self.waiting_for_grammar = gauge("kvforge:structured_output_requests_waiting_for_grammar",
                                         "Requests whose structured-output grammar is compiling.")
        self.grammar_compile_seconds = histogram("kvforge:structured_output_compile_seconds",
                                                 "Seconds each structured-output compile took (one per request, "
                                                 "all its samples).", COMPILE_SECONDS_BUCKETS)
        self.grammar_mask_seconds = counter("kvforge:structured_output_mask_seconds",
                                            "Seconds spent filling and applying grammar bitmasks.")
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          [*names, "finished_reason"], registry=self.registry)
        self.success = {reason: [success.labels(**labels, finished_reason=reason) for labels in engines]
                        for reason in FINISH_REASONS}
        token_buckets = buckets_1_2_5(max_model_len)
        self.request_prompt_tokens = histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.",
                                               token_buckets)
        self.request_generation_tokens = histogram("vllm:request_generation_tokens",
                                                   "Number of generation tokens processed.", token_buckets)
        self.request_max_tokens = histogram("vllm:request_params_max_tokens",
                                            "Histogram of the max_tokens request parameter.", token_buckets)
        self.request_n = histogram("vllm:request_params_n", "Histogram of the n request parameter.", N_BUCKETS)
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              TTFT_BUCKETS)
        self.tpot = histogram("vllm:time_per_output_token_seconds",
                              "Histogram of time per output token in seconds.", TOKEN_LATENCY_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             TOKEN_LATENCY_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             REQUEST_LATENCY_BUCKETS)
        self.lora_info = Gauge("vllm:lora_requests_info", "Running stats on lora requests.",
                               ["max_lora", "waiting_lora_adapters", "running_lora_adapters"], registry=self.registry)
        self._lora_info_labels: tuple[str, str, str] | None = None  # its one series' labels (one engine)
        lora_names = [*names, "lora_name"]
        self.lora_running = Gauge("kvforge:lora_requests_running", "Requests running with each LoRA adapter.",
                                  lora_names, registry=self.registry)
        self.lora_waiting = Gauge("kvforge:lora_requests_waiting", "Requests waiting with each LoRA adapter.",
                                  lora_names, registry=self.registry)
        self.lora_prompt_tokens = Counter("kvforge:lora_prompt_tokens", "Prefill tokens processed with each LoRA "
                                          "adapter.", lora_names, registry=self.registry)
        self.lora_generation_tokens = Counter("kvforge:lora_generation_tokens", "Tokens generated with each LoRA "
                                              "adapter.", lora_names, registry=self.registry)
        self._engine_labels = engines
        if num_engines > 1:  # the router's view of each replica, only where there is routing
            self.outstanding = gauge("kvforge:replica_outstanding_tokens",
                                     "Prompt tokens not yet prefilled plus tokens not yet generated, per replica.")
            self.replica_alive = gauge("kvforge:replica_alive", "1 while the replica's process serves, 0 once dead.")
            for i in range(num_engines):
                self.replica_alive[i].set(1)
        self._totals: dict[tuple[int, str], float] = {}
        self._last_token_time: dict[str, float] = {}  # per engine request: when its latest token came

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def on_step(self, engine, outputs, now: float) -> None:
        """Bring every metric up to date after a step (or after aborts) of the one engine."""
        self.on_snapshot(0, EngineSnapshot.of(engine), outputs, now)

    def on_snapshot(self, index: int, snapshot: EngineSnapshot, outputs, now: float) -> None:
        """Bring engine `index`'s metrics up to date after one of its steps."""
        self.running[index].set(snapshot.running)
        self.waiting[index].set(snapshot.waiting)
        self.kv_usage[index].set(snapshot.kv_usage)
        self.waiting_for_grammar[index].set(snapshot.waiting_for_grammar)
        advance = [(self.prefix_queries, "queries", snapshot.prefix_lookups * self.block_size),
                   (self.prefix_hits, "hits", snapshot.prefix_hits * self.block_size),
                   (self.preemptions, "preemptions", snapshot.preemptions),
                   (self.prompt_tokens, "prompt", snapshot.prompt_tokens),
                   (self.generation_tokens, "generation", snapshot.generated_tokens),
                   (self.spec_drafts, "drafts", snapshot.drafts),
                   (self.spec_draft_tokens, "draft_tokens", snapshot.draft_tokens),
                   (self.spec_accepted_tokens, "accepted", snapshot.accepted_tokens),
                   (self.grammar_mask_seconds, "grammar_mask_seconds", snapshot.grammar_mask_seconds)]
        for counter, key, total in advance:
            delta = total - self._totals.get((index, key), 0)
            if delta > 0:
                counter[index].inc(delta)
            self._totals[(index, key)] = total
        for seconds in snapshot.grammar_compile_seconds:
            self.grammar_compile_seconds[index].observe(seconds)
        if snapshot.max_loras:
            self._on_lora(index, snapshot)
        for output in outputs:
            self._observe(index, output, now)

    def _on_lora(self, index: int, snapshot: EngineSnapshot) -> None:
        """The LoRA metrics of engine `index` (LoRA is served by one engine, not by
        replicas). `vllm:lora_requests_info` keeps one series, the current one: the
        series of a label set that no longer holds is removed, so a scrape reads the
        adapters of now without picking the newest timestamp among old ones."""
        figures = snapshot.lora
        labels = (str(snapshot.max_loras), ",".join(n for n, f in figures.items() if f["waiting"]),
                  ",".join(n for n, f in figures.items() if f["running"]))
        if self._lora_info_labels not in (None, labels):
            self.lora_info.remove(*self._lora_info_labels)
        self._lora_info_labels = labels
        self.lora_info.labels(*labels).set(time.time())
        for name, figure in figures.items():
            per = {**self._engine_labels[index], "lora_name": name}
            self.lora_running.labels(**per).set(figure["running"])
            self.lora_waiting.labels(**per).set(figure["waiting"])
            for counter, key in ((self.lora_prompt_tokens, "prompt_tokens"),
                                 (self.lora_generation_tokens, "generation_tokens")):
                delta = figure[key] - self._totals.get((index, f"lora:{name}:{key}"), 0)
                if delta > 0:
                    counter.labels(**per).inc(delta)
                self._totals[(index, f"lora:{name}:{key}")] = figure[key]

    def _observe(self, index: int, output, now: float) -> None:
        request_id = output.request_id
        if any(c.new_token_ids for c in output.outputs):
            last = self._last_token_time.get(request_id)
            if last is None:
                if output.timings.ttft is not None:
                    self.ttft[index].observe(output.timings.ttft)
            else:
                self.itl[index].observe(now - last)
            self._last_token_time[request_id] = now
        if not output.finished:
            return
        self._last_token_time.pop(request_id, None)
        timings = output.timings
        reason = output.outputs[0].finish_reason or "abort"
        self.success[reason if reason in self.success else "error"][index].inc()
        self.e2e[index].observe((timings.finish_time or now) - timings.arrival_time)
        if timings.tpot is not None:
            self.tpot[index].observe(timings.tpot)
        self.request_prompt_tokens[index].observe(len(output.prompt_token_ids))
        self.request_generation_tokens[index].observe(sum(len(c.token_ids) for c in output.outputs))

    def forget(self, request_id: str) -> None:
        """A request that will report nothing more (its replica died)."""
        self._last_token_time.pop(request_id, None)

    def on_request(self, max_tokens: int, n: int, index: int = 0) -> None:
        """A request was accepted (by engine `index`) with these parameters."""
        self.request_max_tokens[index].observe(max_tokens)
        self.request_n[index].observe(n)


