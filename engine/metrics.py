"""Engine metrics, readable as a dict and, when `prometheus_client` is installed,
in Prometheus' text format. prometheus_client is optional: nothing imports it
unless `prometheus_text` is called."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineMetrics:
    """Counters the engine updates; gauges are read from the engine on demand."""

    num_requests: int = 0
    num_finished: int = 0
    num_aborted: int = 0
    num_errors: int = 0
    num_prompt_tokens: int = 0  # computed prompt tokens (recomputation included)
    num_generated_tokens: int = 0
    num_steps: int = 0
    num_draft_tokens: int = 0  # draft tokens verified
    num_accepted_tokens: int = 0  # of those, accepted
    num_verifications: int = 0  # (request, step) pairs that verified drafts

    def snapshot(self, *, running: int, waiting: int, kv_usage: float, preemptions: int,
                 prefix_cache_hit_rate: float) -> dict[str, float]:
        """Every figure as a flat dict."""
        acceptance = self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0
        per_step = self.num_accepted_tokens / self.num_verifications if self.num_verifications else 0.0
        return {
            "running": running,
            "waiting": waiting,
            "kv_usage": kv_usage,
            "preemptions": preemptions,
            "prefix_cache_hit_rate": prefix_cache_hit_rate,
            "spec_acceptance_rate": acceptance,
            "spec_draft_tokens": self.num_draft_tokens,
            "spec_accepted_tokens": self.num_accepted_tokens,
            "spec_mean_accepted_tokens": per_step,
            "requests": self.num_requests,
            "finished": self.num_finished,
            "aborted": self.num_aborted,
            "errors": self.num_errors,
            "prompt_tokens": self.num_prompt_tokens,
            "generated_tokens": self.num_generated_tokens,
            "steps": self.num_steps,
        }


DESCRIPTIONS = {
    "running": "requests running now",
    "waiting": "requests waiting (new or preempted)",
    "kv_usage": "fraction of KV cache blocks in use",
    "preemptions": "preemptions so far",
    "prefix_cache_hit_rate": "fraction of looked-up prefix blocks found in the cache",
    "spec_acceptance_rate": "fraction of speculative draft tokens accepted",
    "spec_draft_tokens": "speculative draft tokens verified so far",
    "spec_accepted_tokens": "speculative draft tokens accepted so far",
    "spec_mean_accepted_tokens": "mean draft tokens accepted per verification (one request in one step)",
    "structured_waiting_for_grammar": "requests waiting for their structured-output grammar to compile",
    "structured_compiles": "structured-output grammar compile jobs finished (one per request, all its samples)",
    "structured_compile_seconds_sum": "seconds spent compiling structured-output grammars, in all",
    "structured_compile_failures": "structured-output specs that failed to compile",
    "structured_mask_seconds_sum": "seconds spent filling and applying grammar bitmasks, in all",
    "structured_mask_steps": "sampling calls that masked logits with grammar bitmasks",
    "structured_draft_tokens_cut": "speculative draft tokens dropped before verification because the grammar rejects them",
}


def prometheus_text(values: dict[str, float], prefix: str = "kvforge_") -> str:
    """The figures in Prometheus' text exposition format. Needs `prometheus_client`
    (`pip install prometheus_client`); raises ImportError saying so otherwise."""
    try:
        from prometheus_client import CollectorRegistry, Gauge, generate_latest
    except ImportError as exc:
        raise ImportError("Prometheus output needs prometheus_client: pip install prometheus_client") from exc
    registry = CollectorRegistry()
    for name, value in values.items():
        Gauge(prefix + name, DESCRIPTIONS.get(name, name.replace("_", " ")), registry=registry).set(value)
    return generate_latest(registry).decode()
