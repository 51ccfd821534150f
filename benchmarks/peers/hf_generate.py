"""transformers `generate` with static batches: requests in arrival order, left
padded, each batch generating until its longest request is done (a request's
own output length is what counts as output). The batch size is the best of a
small sweep on the first requests (`options.batch_sizes`)."""

from __future__ import annotations

import common


def load(workload: dict):
    import torch
    import transformers

    dtype = getattr(torch, workload["dtype"])
    model = transformers.AutoModelForCausalLM.from_pretrained(workload["model_dir"], dtype=dtype).eval()
    model.generation_config.eos_token_id = None  # ignore EOS: fixed output lengths
    model.generation_config.pad_token_id = 0
    return model


class StepClock:
    """A stopping criterion that never stops: it stamps the time of every step."""

    def __init__(self):
        self.times: list[float] = []

    def __call__(self, input_ids, scores, **kwargs):
        import torch

        self.times.append(common.now())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def run_batch(model, batch: list[dict]) -> tuple[list[float], int]:
    """Generate for one batch; the time stamp after each new token, and the KV bytes it held."""
    import torch
    from transformers import StoppingCriteriaList

    width = max(len(r["prompt_token_ids"]) for r in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    mask = torch.zeros(len(batch), width, dtype=torch.long)
    for i, r in enumerate(batch):
        prompt = r["prompt_token_ids"]
        ids[i, width - len(prompt):] = torch.tensor(prompt)
        mask[i, width - len(prompt):] = 1
    new = max(r["max_tokens"] for r in batch)
    clock = StepClock()
    with torch.inference_mode():
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                       stopping_criteria=StoppingCriteriaList([clock]))
    c = model.config
    head = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv = len(batch) * (width + new) * c.num_hidden_layers * 2 * c.num_key_value_heads * head * model.dtype.itemsize
    return clock.times, kv


def run(model, requests: list[dict], batch_size: int) -> tuple[float, list[dict], int]:
    records, peak = [], 0
    start = common.now()
    for i in range(0, len(requests), batch_size):
        batch = requests[i:i + batch_size]
        times, kv = run_batch(model, batch)
        peak = max(peak, kv)
        for r in batch:
            n = r["max_tokens"]
            records.append(common.record(r, start, times[0], times[n - 1], n))
    return common.now() - start, records, peak


def best_batch_size(model, workload: dict, sizes: list[int]) -> tuple[int, dict]:
    """Output tokens/s of each size on the first requests (outputs capped short)."""
    sample = [dict(r, max_tokens=min(r["max_tokens"], 16)) for r in workload["requests"][:max(sizes)]]
    rates = {}
    for size in sizes:
        elapsed, records, _ = run(model, sample[:size], size)
        rates[size] = sum(r["output_tokens"] for r in records) / elapsed
    return max(rates, key=rates.get), rates


def main() -> None:
    workload, config, out = common.parse()
    options = config.get("options", {})
    model = load(workload)
    run(model, common.warmup_requests(workload), 4)
    sizes = [s for s in options.get("batch_sizes", [8, 16, 32, 64]) if s <= len(workload["requests"])] or [1]
    size, rates = best_batch_size(model, workload, sizes)
    elapsed, records, peak = run(model, workload["requests"], size)
    common.write(out, config, "generate", elapsed, records, peak, {"batch_size": size, "sweep_tokens_per_s": rates})


if __name__ == "__main__":
    main()
