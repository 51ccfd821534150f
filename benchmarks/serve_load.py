"""`kvforge bench serve`: streamed requests with Poisson arrivals against an
OpenAI-compatible server, at several rates; per rate TTFT, time per output token
(TPOT) and inter-token latency (ITL) at p50/p99, throughput, and goodput (requests
per second that met the latency target).

Each engine's server runs in its own process on a free port of 127.0.0.1:
`kvforge serve`, or vLLM's OpenAI server with the Python given as `--peer
vllm=PYTHON` (same model directory, float32, KV budget through
`VLLM_CPU_KVCACHE_SPACE` as in the other scenarios). The workload is the `mixed`
scenario's prompts and output lengths (token ids, greedy, EOS ignored), the same
for every engine and rate; arrival times come from a fixed seed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import socket
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from .harness import peer_env, percentile

SERVED_NAME = "bench"
START_TIMEOUT_S = 600


@dataclass
class LatencyTarget:
    """A request meets the target when its TTFT and its TPOT are both within bounds."""

    ttft_s: float
    tpot_s: float

    def met(self, record: dict) -> bool:
        return (record["ttft_s"] is not None and record["ttft_s"] <= self.ttft_s
                and (record["tpot_s"] is None or record["tpot_s"] <= self.tpot_s))


def arrival_times(count: int, rate: float, seed: int = 0) -> list[float]:
    """Seconds from the start at which each request is sent: a Poisson process of `rate` per second."""
    rng = random.Random(seed)
    times, now = [], 0.0
    for _ in range(count):
        times.append(now)
        now += rng.expovariate(rate)
    return times


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kvforge_engine_name(data_parallel_size: int) -> str:
    """The results' name of `kvforge serve` with this many replicas ("kvforge" for one)."""
    return "kvforge" if data_parallel_size == 1 else f"kvforge-dp{data_parallel_size}"


def server_command(engine: str, python: str, model_dir: str, port: int, kv_cache_gib: float,
                   threads: int | None) -> list[str]:
    if engine == "kvforge" or engine.startswith("kvforge-dp"):
        # Each replica gets the whole KV budget and `threads` threads: DP=N uses N times the resources.
        command = [python, "-m", "kvforge", "serve", model_dir, "--port", str(port), "--served-model-name",
                   SERVED_NAME, "--uvicorn-log-level", "warning", "--set", "device=cpu", "--set", "dtype=float32",
                   "--set", f"cache.memory_budget={int(kv_cache_gib * 2**30)}"]
        if engine != "kvforge":
            command += ["--data-parallel-size", engine.removeprefix("kvforge-dp")]
        return command + (["--threads", str(threads)] if threads else [])
    if engine == "vllm":
        # kvforge's scheduler defaults, so both batch alike
        return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--served-model-name",
                SERVED_NAME, "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--seed", "0",
                "--max-num-seqs", "128", "--max-num-batched-tokens", "2048"]
    raise ValueError(f"unknown server engine {engine!r}; choose kvforge or vllm")


class Server:
    """One engine's server process, stopped (SIGTERM, then SIGKILL) on exit."""

    def __init__(self, engine: str, python: str, model_dir: str, kv_cache_gib: float, threads: int | None,
                 log_path: Path):
        self.port = _free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "w")
        env = peer_env("kvforge" if engine.startswith("kvforge") else engine, kv_cache_gib, threads)
        # The offline vLLM peer runs its engine core in-process to time its steps; a server
        # runs it as `vllm serve` does, in its own process beside the HTTP front end.
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        env["NO_PROXY"] = env["no_proxy"] = "127.0.0.1"
        self.proc = subprocess.Popen(server_command(engine, python, model_dir, self.port, kv_cache_gib, threads),
                                     stdout=self._log, stderr=subprocess.STDOUT, env=env)

    def __enter__(self) -> "Server":
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode} (log: {self.log_path})")
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=5) as response:
                    if response.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(0.5)
        self.__exit__()
        raise RuntimeError(f"the server did not become healthy in {START_TIMEOUT_S} s (log: {self.log_path})")

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


async def _one(client, request: dict, send_at: float, start: float) -> dict:
    await asyncio.sleep(max(0.0, start + send_at - time.perf_counter()))
    sent = time.perf_counter()
    token_times, tokens, error = [], None, None
    try:
        stream = await client.completions.create(
            model=SERVED_NAME, prompt=request["prompt_token_ids"], max_tokens=request["max_tokens"], temperature=0,
            stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        async for chunk in stream:
            # A chunk with a choice carries the step's new tokens, even when their text is
            # still empty (a character's bytes pending); a usage chunk has none.
            if chunk.choices and (chunk.choices[0].text or not chunk.choices[0].finish_reason):
                token_times.append(time.perf_counter())
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
    except Exception as exc:  # one failed request is a figure of the run, not the end of it
        error = f"{type(exc).__name__}: {exc}"
    end = time.perf_counter()
    ttft = token_times[0] - sent if token_times else None
    tokens = tokens if tokens is not None else len(token_times)
    tpot = (end - token_times[0]) / (tokens - 1) if token_times and tokens > 1 else None
    itl = [b - a for a, b in zip(token_times, token_times[1:])]
    return {"id": request["id"], "ttft_s": ttft, "tpot_s": tpot, "itl_s": itl, "e2e_s": end - sent,
            "output_tokens": tokens, "error": error, "finished_at": end - start}


async def run_rate(base_url: str, requests: list[dict], rate: float, seed: int = 0) -> tuple[list[dict], float]:
    """Send `requests` at Poisson arrivals of `rate` per second; their records and the run's seconds."""
    import openai

    client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=3600)
    try:
        start = time.perf_counter()
        records = await asyncio.gather(*(_one(client, r, at, start)
                                         for r, at in zip(requests, arrival_times(len(requests), rate, seed))))
        return list(records), time.perf_counter() - start
    finally:
        await client.close()


def summarize(records: list[dict], seconds: float, target: LatencyTarget) -> dict:
    ok = [r for r in records if r["error"] is None]

    def pct(key: str, q: float):
        return percentile([r[key] for r in ok if r[key] is not None], q)

    itl = [x for r in ok for x in r["itl_s"]]
    return {
        "requests": len(records), "errors": len(records) - len(ok), "seconds": seconds,
        "output_tokens_per_s": sum(r["output_tokens"] for r in ok) / seconds if seconds > 0 else 0.0,
        "ttft_p50_s": pct("ttft_s", 50), "ttft_p99_s": pct("ttft_s", 99),
        "tpot_p50_s": pct("tpot_s", 50), "tpot_p99_s": pct("tpot_s", 99),
        "itl_p50_s": percentile(itl, 50), "itl_p99_s": percentile(itl, 99),
        "met_target": sum(target.met(r) for r in ok),
        "goodput_req_per_s": sum(target.met(r) for r in ok) / seconds if seconds > 0 else 0.0,
    }


def bench_serve(engines: dict[str, str], model_dir: str, requests: list[dict], rates: list[float], *,
                kv_cache_gib: float, threads: int | None, target: LatencyTarget, out: Path, log=print) -> dict:
    """Every engine at every rate; writes serve.json, serve.md and serve.png under `out`.

    All servers are up at once and the engines take turns at each rate, so a slow
    phase of a shared machine falls on every engine alike instead of on one."""
    out.mkdir(parents=True, exist_ok=True)
    results = {"model_dir": model_dir, "requests": len(requests), "rates": rates, "kv_cache_gib": kv_cache_gib,
               "threads": threads, "target": {"ttft_s": target.ttft_s, "tpot_s": target.tpot_s},
               "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "engines": {}}
    with contextlib.ExitStack() as stack:
        servers = {}
        for engine, python in engines.items():
            entry = results["engines"][engine] = {"python": python, "rates": [], "status": "ok"}
            log(f"serve: starting {engine} ...")
            try:
                servers[engine] = stack.enter_context(
                    Server(engine, python, model_dir, kv_cache_gib, threads, out / f"serve-{engine}.log"))
                asyncio.run(run_rate(servers[engine].base_url, requests[:2], rates[0]))  # warm-up, not reported
            except Exception as exc:
                entry["status"] = f"failed: {exc}"
                log(f"serve: {engine} failed: {exc}")
                servers.pop(engine, None)
        for rate in rates:
            for engine, server in servers.items():
                records, seconds = asyncio.run(run_rate(server.base_url, requests, rate))
                figures = {"rate": rate, **summarize(records, seconds, target)}
                results["engines"][engine]["rates"].append(figures)
                log(f"serve: {engine} at {rate:g} req/s: " + format_row(figures))
    for entry in results["engines"].values():
        entry["max_rate_meeting_target"] = max(
            (r["rate"] for r in entry["rates"] if r["errors"] == 0 and r["met_target"] == r["requests"]), default=None)
    (out / "serve.json").write_text(json.dumps(results, indent=2))
    (out / "serve.md").write_text(markdown(results) + "\n")
    plot(results, out / "serve.png")
    return results


def _ms(value) -> str:
    return "n/a" if value is None else f"{value * 1e3:.1f}"


def format_row(f: dict) -> str:
    return (f"TTFT p50/p99 {_ms(f['ttft_p50_s'])}/{_ms(f['ttft_p99_s'])} ms, TPOT {_ms(f['tpot_p50_s'])}/"
            f"{_ms(f['tpot_p99_s'])} ms, ITL {_ms(f['itl_p50_s'])}/{_ms(f['itl_p99_s'])} ms, "
            f"{f['output_tokens_per_s']:.1f} tok/s, goodput {f['goodput_req_per_s']:.2f} req/s, {f['errors']} errors")


def markdown(results: dict) -> str:
    target = results["target"]
    lines = [f"Serving: {results['requests']} streamed `mixed` requests per rate, Poisson arrivals, greedy, "
             f"EOS ignored; latency target TTFT <= {target['ttft_s'] * 1e3:.0f} ms and TPOT <= "
             f"{target['tpot_s'] * 1e3:.0f} ms; started {results['started']}.", "",
             "| engine | rate req/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms | ITL p50 / p99 ms | output tok/s "
             "| goodput req/s | met | errors |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for engine, entry in results["engines"].items():
        for f in entry["rates"]:
            lines.append(f"| {engine} | {f['rate']:g} | {_ms(f['ttft_p50_s'])} / {_ms(f['ttft_p99_s'])} | "
                         f"{_ms(f['tpot_p50_s'])} / {_ms(f['tpot_p99_s'])} | {_ms(f['itl_p50_s'])} / "
                         f"{_ms(f['itl_p99_s'])} | {f['output_tokens_per_s']:.1f} | {f['goodput_req_per_s']:.2f} | "
                         f"{f['met_target']}/{f['requests']} | {f['errors']} |")
        if entry.get("status", "ok") != "ok":
            lines.append(f"| {engine} | {entry['status']} | | | | | | | |")
    lines.append("")
    for engine, entry in results["engines"].items():
        lines.append(f"- {engine}: highest rate with every request within the target: "
                     f"{entry.get('max_rate_meeting_target') or 'none'}")
    return "\n".join(lines)


def plot(results: dict, path: Path) -> Path | None:
    """p50 and p99 TTFT and TPOT against the arrival rate, one line per engine."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    engines = {e: entry["rates"] for e, entry in results["engines"].items() if entry["rates"]}
    if not engines:
        return None
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for engine, rows in engines.items():
        rates = [r["rate"] for r in rows]
        for axis, key in ((left, "ttft"), (right, "tpot")):
            for q, style in (("p50", "-o"), ("p99", "--o")):
                values = [(r[f"{key}_{q}_s"] or float("nan")) * 1e3 for r in rows]
                axis.plot(rates, values, style, label=f"{engine} {q}")
    for axis, name in ((left, "TTFT"), (right, "TPOT")):
        axis.set_xlabel("arrival rate, requests/s")
        axis.set_ylabel(f"{name}, ms")
        axis.set_yscale("log")
        axis.set_title(f"{name} against load")
        axis.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
