"""kvforge's reference engine on a workload: requests are added at their
`arrival_step`, the engine is stepped until all finish. Options are engine
config sections (`{"cache": {...}, "scheduler": {...}}`), and `dtype` (the run's
own, instead of the workload's); with a
`structured_outputs` section, a request that carries a `json_schema` is
constrained to it (and ends when its document does, EOS not ignored). With
`lora_adapters` (`{"count": C, "rank": R}`, beside a `lora` section), request i
runs adapter i mod C of `lora_adapters.adapter_dirs`. `info.startup_s` is the time
from the interpreter's launch (imports, loading and the first step included) to the
first token of a `common.STARTUP_PROMPT`-token prompt, run before warm-up."""

from __future__ import annotations

import json
import time

import common
import lora_adapters


def float32_kv_bytes_per_token(model_dir: str) -> int:
    """Keys and values of every layer for one token in float32, from the model's config."""
    with open(f"{model_dir}/config.json") as f:
        config = json.load(f)
    heads = config["num_attention_heads"]
    head = config.get("head_dim") or config["hidden_size"] // heads
    return config["num_hidden_layers"] * 2 * (config.get("num_key_value_heads") or heads) * head * 4


def engine_for(workload: dict, options: dict):
    from kvforge import LLMEngine
    from kvforge.core import load_config

    options = {name: value for name, value in options.items() if name != "lora_adapters"}
    dtype = options.pop("dtype", workload["dtype"])  # a run of its own weight dtype (the batch1 scenario)
    budget = int(workload["kv_cache_gib"] * 2**30)
    if "kv_tokens_float32" in options:  # one budget in bytes for every KV dtype of a scenario
        budget = options.pop("kv_tokens_float32") * float32_kv_bytes_per_token(workload["model_dir"])
    sections = {"cache": {"memory_budget": budget}, "scheduler": {}}
    for name, values in options.items():
        sections[name] = {**sections.get(name, {}), **values} if isinstance(values, dict) else values
    config = load_config(model=workload["model_dir"], device="cpu", dtype=dtype, **sections).config
    return LLMEngine(config)


def sampling_params(request: dict, structured: bool):
    """Greedy, `max_tokens` exactly (EOS ignored), or constrained to the request's schema."""
    from kvforge import SamplingParams, StructuredOutputsParams

    # token ids only, no text: like the vLLM peer (detokenize=False)
    if structured and request.get("json_schema") is not None:
        return SamplingParams(max_tokens=request["max_tokens"], temperature=0.0, detokenize=False,
                              structured_outputs=StructuredOutputsParams(json=request["json_schema"]))
    return SamplingParams(max_tokens=request["max_tokens"], temperature=0.0, ignore_eos=True, detokenize=False)


def lora_requests(workload: dict, options: dict) -> list | None:
    """The adapters of a run with `lora_adapters`, as LoRARequests; None without."""
    adapters = lora_adapters.run_adapters(workload, options)
    if adapters is None:
        return None
    from kvforge import LoRARequest

    return [LoRARequest(*adapter) for adapter in adapters]


def run(engine, requests: list[dict], structured: bool = False, loras: list | None = None) -> tuple[float, list[dict], int]:
    """Step the engine over `requests`; (elapsed, per-request records, peak blocks in use)."""

    pending = sorted(requests, key=lambda r: r["arrival_step"])
    progress = common.Progress()
    step, peak = 0, 0
    start = common.now()
    while pending or engine.has_unfinished_requests():
        while pending and pending[0]["arrival_step"] <= step:
            r = pending.pop(0)
            lora = loras[r.get("lora_index", 0) % len(loras)] if loras else None
            engine.add_request(r["id"], prompt_token_ids=r["prompt_token_ids"], params=sampling_params(r, structured),
                               priority=r["priority"], lora_request=lora)
            progress.add(r["id"])
        progress.observe(engine.step())
        peak = max(peak, engine.kv.usage().in_use)
        step += 1
    return common.now() - start, progress.records(requests), peak


def main() -> None:
    workload, config, out = common.parse()
    options = config.get("options", {})
    structured = "structured_outputs" in options
    from kvforge.engine.long_lived import long_lived_start_up

    with long_lived_start_up():  # one engine in this process, as `kvforge generate` and `serve` build theirs
        engine = engine_for(workload, options)
    loras = lora_requests(workload, options)
    for lora in loras or ():  # loaded before timing, as the vLLM runner does
        engine.add_lora(lora)
    # start-up: from the interpreter's launch to the first token of a short prompt (plain:
    # no adapter, no schema, so the run's own figures count only its requests)
    first = workload["requests"][0]
    short = first["prompt_token_ids"][:common.STARTUP_PROMPT]
    run(engine, [dict(first, id="start", prompt_token_ids=short, max_tokens=1, arrival_step=0)])
    startup = common.process_age()
    run(engine, common.warmup_requests(workload), structured, loras)
    cpu = time.process_time()
    elapsed, records, peak = run(engine, workload["requests"], structured, loras)
    cpu = time.process_time() - cpu  # this process's CPU time: on a crowded machine, steadier than elapsed
    spec = engine.model.kv_cache_spec(engine.kv.block_size)
    info = {"num_blocks": engine.num_blocks, "block_size": engine.kv.block_size,
            "model_class": type(engine.model).__name__, "metrics": engine.metrics(), "cpu_s": cpu,
            "lora": engine.lora_figures(), "kv_cache_bytes": engine.num_blocks * spec.bytes_per_block(),
            "startup_s": startup, **common.resident_memory()}
    common.write(out, config, "kvforge", elapsed, records, peak * spec.bytes_per_block(), info)


if __name__ == "__main__":
    main()
