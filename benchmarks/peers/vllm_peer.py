"""vLLM's CPU build on a workload, run in-process (no engine-core subprocess) so
its step loop can be timed like kvforge's: requests added at once, the engine
stepped until all finish. Run it with the Python of the vLLM venv; the harness
sets VLLM_ENABLE_V1_MULTIPROCESSING=0, VLLM_CPU_KVCACHE_SPACE and HF_HUB_OFFLINE=1.
Options: `max_num_seqs`, `max_num_batched_tokens`, `enable_prefix_caching`, and
`structured_outputs_backend` (e.g. "xgrammar"): with it, a request that carries a
`json_schema` is constrained to it (and ends when its document does). With
`lora_adapters` (`{"count": C, "rank": R}`, and `max_loras`, `max_lora_rank`),
request i runs adapter i mod C of `lora_adapters.adapter_dirs`, the same files
kvforge's runner serves. With `kvforge_attention_backend` (e.g. "cpp"), vLLM's CPU
attention runs on that kvforge attention backend (kvforge's vLLM plugin, which must be
installed in the vLLM environment); without it, stock vLLM runs even where
KVFORGE_VLLM_ATTENTION_BACKEND is set. `keep_token_ids` records every request's tokens."""

from __future__ import annotations

import os
import time

import common
import lora_adapters

ATTENTION_ENV = "KVFORGE_VLLM_ATTENTION_BACKEND"  # kvforge.vllm_plugin's; runners do not import kvforge


def kv_usage(llm) -> float | None:
    """The scheduler's fraction of KV blocks in use, where the in-process core exposes it."""
    try:
        return float(llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.usage)
    except AttributeError:
        return None


def sampling_params(request: dict, structured: bool):
    """Greedy, `max_tokens` exactly (EOS ignored), or constrained to the request's schema."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

    if structured and request.get("json_schema") is not None:
        return SamplingParams(max_tokens=request["max_tokens"], temperature=0.0, detokenize=False,
                              output_kind=RequestOutputKind.CUMULATIVE,
                              structured_outputs=StructuredOutputsParams(json=request["json_schema"]))
    return SamplingParams(max_tokens=request["max_tokens"], min_tokens=request["max_tokens"], temperature=0.0,
                          ignore_eos=True, detokenize=False, output_kind=RequestOutputKind.CUMULATIVE)


def lora_requests(workload: dict, options: dict) -> list | None:
    """The adapters of a run with `lora_adapters`, as vLLM LoRARequests; None without."""
    adapters = lora_adapters.run_adapters(workload, options)
    if adapters is None:
        return None
    from vllm.lora.request import LoRARequest

    return [LoRARequest(*adapter) for adapter in adapters]


def lora_config(options: dict) -> dict:
    """`LLM(...)` arguments enabling LoRA for a run with adapters."""
    spec = options.get("lora_adapters")
    if not spec:
        return {}
    count = options.get("max_loras", spec["count"])
    return {"enable_lora": True, "max_loras": count, "max_cpu_loras": count,
            "max_lora_rank": options.get("max_lora_rank", spec["rank"])}


def choose_attention(options: dict) -> str | None:
    """Set (or clear) KVFORGE_VLLM_ATTENTION_BACKEND before vLLM loads its plugins in this
    process; the kvforge backend's name, or None for vLLM's own attention."""
    from importlib.metadata import entry_points

    name = options.get("kvforge_attention_backend")
    if name is None:
        os.environ.pop(ATTENTION_ENV, None)
        return None
    if not any(ep.name == "kvforge" for ep in entry_points(group="vllm.general_plugins")):
        raise SystemExit("kvforge_attention_backend needs kvforge's vLLM plugin in this environment: "
                         "pip install -e <kvforge checkout> with this Python (docs/vllm.md)")
    os.environ[ATTENTION_ENV] = name
    return name


def run(llm, requests: list[dict], structured: bool = False, loras: list | None = None, token_ids: bool = False
        ) -> tuple[float, list[dict], float | None]:
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    progress = common.Progress()
    peak = None
    start = common.now()
    for r in requests:
        params = sampling_params(r, structured)
        lora = loras[r.get("lora_index", 0) % len(loras)] if loras else None
        engine.add_request(r["id"], TokensPrompt(prompt_token_ids=r["prompt_token_ids"]), params, lora_request=lora)
        progress.add(r["id"])
    while engine.has_unfinished_requests():
        progress.observe(engine.step())
        usage = kv_usage(llm)
        if usage is not None:
            peak = max(peak or 0.0, usage)
    return common.now() - start, progress.records(requests, token_ids), peak


def structured_config(options: dict) -> dict:
    """`LLM(...)` arguments choosing the structured-output backend, when the run names one;
    JSON compact (no whitespace between tokens), as kvforge writes it by default, so both
    engines follow the same grammar (vLLM's xgrammar backend reads this from its config)."""
    backend = options.get("structured_outputs_backend")
    if backend is None:
        return {}
    return {"structured_outputs_config": {"backend": backend, "disable_any_whitespace": True}}


def main() -> None:
    from vllm import LLM

    workload, config, out = common.parse()
    options = config.get("options", {})
    attention = choose_attention(options)
    llm = LLM(model=workload["model_dir"], dtype=workload["dtype"], seed=0,
              max_num_seqs=options.get("max_num_seqs", 128),
              max_num_batched_tokens=options.get("max_num_batched_tokens", 2048),
              enable_prefix_caching=options.get("enable_prefix_caching", True),
              **structured_config(options), **lora_config(options))
    structured = "structured_outputs_backend" in options
    loras = lora_requests(workload, options)
    for lora in loras or ():  # loaded before timing, as the kvforge runner does
        llm.llm_engine.add_lora(lora)
    run(llm, common.warmup_requests(workload), structured, loras)
    cpu = time.process_time()
    elapsed, records, peak = run(llm, workload["requests"], structured, loras, options.get("keep_token_ids", False))
    cpu = time.process_time() - cpu  # the in-process engine's CPU time (see kvforge_peer)
    space = float(os.environ.get("VLLM_CPU_KVCACHE_SPACE", "0")) * 2**30
    peak_bytes = int(peak * space) if peak is not None and space else None
    import vllm

    common.write(out, config, "vllm", elapsed, records, peak_bytes,
                 {"vllm_version": vllm.__version__, "kv_cache_space_gib": space / 2**30, "peak_kv_fraction": peak,
                  "cpu_s": cpu, "kvforge_attention_backend": attention})


if __name__ == "__main__":
    main()
