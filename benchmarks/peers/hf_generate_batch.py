"""transformers' own continuous batching (the manager behind `generate_batch`),
with an explicit cache: `num_blocks` pages of `page_size` tokens and
`max_batch_tokens` set in `ContinuousBatchingConfig` (left unset it sizes the
cache from system RAM). Requests go in through `add_request` so each gets its
own `max_new_tokens`, as `generate_batch` takes only one for all.

Its best `max_requests_per_batch` comes from a small sweep on the first requests
(`options.max_requests_per_batch`, a list), as `generate` sweeps its batch size:
on CPU its SDPA path gathers every running request's cache for every query
token, so a step costs more than linearly in the number of requests and the
fewest that keep the matmuls busy win (on 64 `mixed` requests with outputs
capped at 64, 8 ran 2.2x as fast as 64)."""

from __future__ import annotations

import time

import common

SWEEP_REQUESTS, SWEEP_MAX_TOKENS = 32, 32


def main() -> None:
    import torch
    import transformers
    from transformers import ContinuousBatchingConfig, GenerationConfig

    workload, config, out = common.parse()
    options = config.get("options", {})
    model = transformers.AutoModelForCausalLM.from_pretrained(
        workload["model_dir"], dtype=getattr(torch, workload["dtype"])).eval()
    c = model.config
    head = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    page = options.get("page_size", 64)
    page_bytes = c.num_hidden_layers * 2 * page * c.num_key_value_heads * head * model.dtype.itemsize
    num_blocks = max(16, int(workload["kv_cache_gib"] * 2**30 // page_bytes))
    max_batch_tokens = options.get("max_batch_tokens", 2048)
    gen = GenerationConfig(do_sample=False, max_new_tokens=512, eos_token_id=None, pad_token_id=0)

    def cache_config(max_requests: int) -> ContinuousBatchingConfig:
        return ContinuousBatchingConfig(page_size=page, num_blocks=num_blocks,
                                        max_batch_tokens=max_batch_tokens,
                                        max_requests_per_batch=max_requests)

    def run(requests: list[dict], max_requests: int) -> tuple[float, list[dict]]:
        with model.continuous_batching_context_manager(generation_config=gen,
                                                       continuous_batching_config=cache_config(max_requests),
                                                       block=True, timeout=30) as manager:
            start = common.now()
            for r in requests:
                manager.add_request(r["prompt_token_ids"], request_id=r["id"], max_new_tokens=r["max_tokens"],
                                    record_timestamps=True, eos_token_id=-1)
            results = {}
            while len(results) < len(requests):
                result = manager.get_result(timeout=1)
                if result is not None and result.is_finished():
                    results[result.request_id] = result
                elif result is None and not manager.is_running():
                    raise RuntimeError("transformers' continuous batching thread stopped early")
            elapsed = common.now() - start
        records = []
        for r in requests:
            res = results[r["id"]]
            stamps = res.timestamps or [res.lifespan[1]]
            if common.now is not time.perf_counter:  # transformers stamps wall time: no TTFT under the cpu clock
                stamps = [None]
            records.append(common.record(r, start, stamps[0], stamps[-1], len(res.generated_tokens)))
        return elapsed, records

    def best_max_requests(sizes: list[int]) -> tuple[int, dict]:
        """Output tokens/s of each size on the first requests (outputs capped short)."""
        sample = [dict(r, max_tokens=min(r["max_tokens"], SWEEP_MAX_TOKENS))
                  for r in workload["requests"][:SWEEP_REQUESTS]]
        rates = {}
        for size in sizes:
            elapsed, records = run(sample, size)
            rates[size] = sum(r["output_tokens"] for r in records) / elapsed
        return max(rates, key=rates.get), rates

    run(common.warmup_requests(workload), 4)
    sizes = options.get("max_requests_per_batch", [2, 4, 8, 16, 32])
    sizes = [sizes] if isinstance(sizes, int) else sizes
    size, rates = best_max_requests(sizes) if len(sizes) > 1 else (sizes[0], {})
    elapsed, records = run(workload["requests"], size)
    common.write(out, config, "generate_batch", elapsed, records, num_blocks * page_bytes,
                 {"num_blocks": num_blocks, "page_size": page, "max_batch_tokens": max_batch_tokens,
                  "max_requests_per_batch": size, "sweep_tokens_per_s": rates,
                  "attn_implementation": getattr(c, "_attn_implementation", None)})


if __name__ == "__main__":
    main()
