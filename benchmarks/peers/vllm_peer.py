"""vLLM's CPU build on a workload, run in-process (no engine-core subprocess) so
its step loop can be timed like kvforge's: requests added at once, the engine
stepped until all finish. Run it with the Python of the vLLM venv; the harness
sets VLLM_ENABLE_V1_MULTIPROCESSING=0, VLLM_CPU_KVCACHE_SPACE and HF_HUB_OFFLINE=1.
Options: `max_num_seqs`, `max_num_batched_tokens`, `enable_prefix_caching`, and
`structured_outputs_backend` (e.g. "xgrammar"): with it, a request that carries a
`json_schema` is constrained to it (and ends when its document does)."""

from __future__ import annotations

import os
import time

import common


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


def run(llm, requests: list[dict], structured: bool = False) -> tuple[float, list[dict], float | None]:
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    progress = common.Progress()
    peak = None
    start = common.now()
    for r in requests:
        params = sampling_params(r, structured)
        engine.add_request(r["id"], TokensPrompt(prompt_token_ids=r["prompt_token_ids"]), params)
        progress.add(r["id"])
    while engine.has_unfinished_requests():
        progress.observe(engine.step())
        usage = kv_usage(llm)
        if usage is not None:
            peak = max(peak or 0.0, usage)
    return common.now() - start, progress.records(requests), peak


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
    llm = LLM(model=workload["model_dir"], dtype=workload["dtype"], seed=0,
              max_num_seqs=options.get("max_num_seqs", 128),
              max_num_batched_tokens=options.get("max_num_batched_tokens", 2048),
              enable_prefix_caching=options.get("enable_prefix_caching", True),
              **structured_config(options))
    structured = "structured_outputs_backend" in options
    run(llm, common.warmup_requests(workload), structured)
    cpu = time.process_time()
    elapsed, records, peak = run(llm, workload["requests"], structured)
    cpu = time.process_time() - cpu  # the in-process engine's CPU time (see kvforge_peer)
    space = float(os.environ.get("VLLM_CPU_KVCACHE_SPACE", "0")) * 2**30
    peak_bytes = int(peak * space) if peak is not None and space else None
    import vllm

    common.write(out, config, "vllm", elapsed, records, peak_bytes,
                 {"vllm_version": vllm.__version__, "kv_cache_space_gib": space / 2**30, "peak_kv_fraction": peak,
                  "cpu_s": cpu})


if __name__ == "__main__":
    main()
