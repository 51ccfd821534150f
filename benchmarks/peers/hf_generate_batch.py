"""transformers' own continuous batching (the manager behind `generate_batch`),
with an explicit cache: `num_blocks` pages of `page_size` tokens and
`max_batch_tokens` set in `ContinuousBatchingConfig` (left unset it sizes the
cache from system RAM). Requests go in through `add_request` so each gets its
own `max_new_tokens`, as `generate_batch` takes only one for all."""

from __future__ import annotations

import common


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
    cb = ContinuousBatchingConfig(page_size=page, num_blocks=num_blocks,
                                  max_batch_tokens=options.get("max_batch_tokens", 2048),
                                  max_requests_per_batch=options.get("max_requests_per_batch", 128))
    gen = GenerationConfig(do_sample=False, max_new_tokens=512, eos_token_id=None, pad_token_id=0)

    def run(requests: list[dict]) -> tuple[float, list[dict]]:
        with model.continuous_batching_context_manager(generation_config=gen, continuous_batching_config=cb,
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
            records.append(common.record(r, start, stamps[0], stamps[-1], len(res.generated_tokens)))
        return elapsed, records

    run(common.warmup_requests(workload))
    elapsed, records = run(workload["requests"])
    common.write(out, config, "generate_batch", elapsed, records, num_blocks * page_bytes,
                 {"num_blocks": num_blocks, "page_size": page, "max_batch_tokens": cb.max_batch_tokens,
                  "attn_implementation": getattr(c, "_attn_implementation", None)})


if __name__ == "__main__":
    main()
