"""What sampling costs a batch-1 decode on a CPU: sampled against greedy
decoding, and the sampler's C++ draw against its tensor ops.

`decode` rows: one request from a one-token prompt decodes `--tokens` tokens
through `LLM.generate` (multi-step bursts as configured by default), greedy and
with each sampling setting, median tok/s (1 / time per output token) of
`--repeats` rounds, the settings alternated within each round; each sampled
setting's ratio to greedy, and, with `--tensor-path`, the same setting run
with the sampler's tensor ops (`sampling_probs` and the inverse-CDF draw, the
bursts pass by pass: the path where kvforge's C++ library is not loaded) and
the C++ draw's speedup over it.

`draw` rows: one row of standard normal logits per vocabulary size, µs per
call (the best of `--repeats` runs of 200 calls) of `kvforge_cpp::sample_rows`
and of the tensor ops for the same setting.

    python -m kvforge.benchmarks.sampled_decode --model bench-llama-25m --dtype bfloat16 --tensor-path
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch

SETTINGS = {
    "greedy": dict(temperature=0.0),
    "temperature 0.8": dict(temperature=0.8),
    "top-p 0.95": dict(temperature=0.8, top_p=0.95),
    "top-k 40, top-p 0.95": dict(temperature=0.8, top_k=40, top_p=0.95),
    "min-p 0.05": dict(temperature=0.8, min_p=0.05),
    "top-k 40, top-p 0.9, repetition 1.1": dict(temperature=0.8, top_k=40, top_p=0.9, repetition_penalty=1.1),
}
VOCABULARIES = (1024, 16384, 32000, 152064)


@contextlib.contextmanager
def tensor_path():
    """The sampler's tensor ops instead of `kvforge_cpp::sample_rows`, sampled
    bursts pass by pass and penalised requests one pass a step: what runs where
    the C++ library is not loaded."""
    from kvforge.engine import decode_bursts, sampler

    ready, burst = sampler.compiled_sample_ready, decode_bursts.cpp_burst

    def greedy_only(runner, step_sampler, scheduled, *args):
        if all(entry.request.params.greedy and not entry.request.params.uses_penalties for entry in scheduled):
            return burst(runner, step_sampler, scheduled, *args)
        return None

    sampler.compiled_sample_ready, decode_bursts.cpp_burst = (lambda logits, u: False), greedy_only
    try:
        yield
    finally:
        sampler.compiled_sample_ready, decode_bursts.cpp_burst = ready, burst


def decode_rows(path: str, dtype: str, tokens: int, repeats: int, with_tensor_path: bool) -> list[dict]:
    from kvforge import LLM, SamplingParams

    llm = LLM(model=path, dtype=dtype, cache={"memory_budget": 64 << 20, "enable_prefix_caching": False})
    runs = [(name, False) for name in SETTINGS]
    if with_tensor_path:
        runs += [(name, True) for name in SETTINGS if name != "greedy"]
    rates: dict[tuple[str, bool], list[float]] = {run: [] for run in runs}

    def rate(name: str) -> float:
        params = SamplingParams(max_tokens=tokens + 1, ignore_eos=True, seed=1, detokenize=False, **SETTINGS[name])
        return 1.0 / llm.generate([{"prompt_token_ids": [5]}], params, use_tqdm=False)[0].timings.tpot

    for name, tensor in runs:  # warm-up
        with tensor_path() if tensor else contextlib.nullcontext():
            rate(name)
    for _ in range(repeats):
        for name, tensor in runs:
            with tensor_path() if tensor else contextlib.nullcontext():
                rates[(name, tensor)].append(rate(name))
    greedy = statistics.median(rates[("greedy", False)])
    rows = []
    for name in SETTINGS:
        median = statistics.median(rates[(name, False)])
        row = {"setting": name, "tok/s": median, "x greedy": median / greedy}
        if with_tensor_path and name != "greedy":
            row["tensor tok/s"] = statistics.median(rates[(name, True)])
            row["x tensor"] = median / row["tensor tok/s"]
        rows.append(row)
    return rows


def draw_rows(repeats: int, vocabularies=VOCABULARIES) -> list[dict]:
    from kvforge import SamplingParams
    from kvforge.engine import sampler
    from kvforge.kernels import build

    build.load()
    generator = torch.Generator().manual_seed(0)
    rows = []
    for vocab in vocabularies:
        logits = torch.randn(1, vocab, generator=generator)
        u = torch.rand(1, generator=generator, dtype=torch.float64)
        for name, setting in SETTINGS.items():
            if name == "greedy" or "repetition_penalty" in setting:  # penalties are not part of the draw
                continue
            params = [SamplingParams(**setting)]
            settings = sampler.row_settings(params)

            def kernel():
                return torch.ops.kvforge_cpp.sample_rows(logits, *settings, u)

            def tensors():
                return sampler.inverse_cdf(sampler.sampling_probs(logits, params), u)

            row = {"vocabulary": vocab, "setting": name}
            for label, call in (("sample_rows µs", kernel), ("tensor ops µs", tensors)):
                call()
                best = float("inf")
                for _ in range(repeats):
                    began = time.perf_counter()
                    for _ in range(200):
                        call()
                    best = min(best, (time.perf_counter() - began) / 200 * 1e6)
                row[label] = best
            row["x tensor"] = row["tensor ops µs"] / row["sample_rows µs"]
            rows.append(row)
    return rows


def markdown(rows: list[dict]) -> str:
    columns = list(dict.fromkeys(key for row in rows for key in row))
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        cells = []
        for column in columns:
            value = row.get(column, "")
            cells.append(f"{value:.2f}" if isinstance(value, float) and column.startswith("x ") else
                         f"{value:,.1f}" if isinstance(value, float) else str(value))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    from kvforge.benchmarks.model_dirs import model_dir

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="bench-llama-25m")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tokens", type=int, default=128, help="output tokens per decode")
    parser.add_argument("--repeats", type=int, default=3, help="rounds; decode: the median, draw: the best")
    parser.add_argument("--tensor-path", action="store_true", help="also decode with the sampler's tensor ops")
    parser.add_argument("--only", choices=["decode", "draw"], help="one of the two tables")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.only != "draw":
        print(f"decode, {args.model}, {args.dtype}, one thread")
        print(markdown(decode_rows(str(model_dir(args.model)), args.dtype, args.tokens, args.repeats,
                                   args.tensor_path)))
    if args.only != "decode":
        print("\ndraw, one row, one thread")
        print(markdown(draw_rows(args.repeats)))


if __name__ == "__main__":
    main()
