"""What every peer runner shares. Standard library only: runners execute in
other Python environments (a vLLM venv) where kvforge is not installed.

    python <runner>.py --workload W.json --config C.json --out R.json

The result JSON: `label`, `peer`, `elapsed_s` (first request added to last one
finished, load and warm-up excluded), `peak_kv_bytes` (None where the engine
does not expose it), `info`, and per request `id`, `cls`, `output_tokens`,
`ttft_s` (added to first token), `latency_s` (added to last token), and for a
request that carries a `json_schema` (the structured scenario), or of every request
of a run with the option `keep_token_ids`, its `token_ids`, so the bench can check the
output against the schema or against another run's.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path


def parse() -> tuple[dict, dict, str]:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workload", required=True)
    parser.add_argument("--config", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    with open(args.workload) as f:
        workload = json.load(f)
    with open(args.config) as f:
        config = json.load(f)
    return workload, config, args.out


def record(request: dict, added: float, first: float | None, last: float | None, output_tokens: int) -> dict:
    return {"id": request["id"], "cls": request.get("cls"), "output_tokens": output_tokens,
            "ttft_s": None if first is None else first - added,
            "latency_s": None if last is None else last - added}


class Progress:
    """When each request was added, produced its first token and finished, seen
    through the cumulative outputs an engine step returns (kvforge's and vLLM's
    `RequestOutput` share `request_id`, `outputs[0].token_ids` and `finished`)."""

    def __init__(self) -> None:
        self.added: dict[str, float] = {}
        self.first: dict[str, float] = {}
        self.done: dict[str, tuple[float, int]] = {}
        self.token_ids: dict[str, list[int]] = {}

    def add(self, request_id: str) -> None:
        self.added[request_id] = now()

    def observe(self, outputs) -> None:
        """Call right after each step with what it returned."""
        t = now()
        for out in outputs:
            n = len(out.outputs[0].token_ids)
            if n and out.request_id not in self.first:
                self.first[out.request_id] = t
            if out.finished:
                self.done[out.request_id] = (t, n)
                self.token_ids[out.request_id] = list(out.outputs[0].token_ids)

    def records(self, requests: list[dict], token_ids: bool = False) -> list[dict]:
        """Each request's record; with its `token_ids` too when it carries a schema or `token_ids` is set."""
        records = []
        for r in requests:
            one = record(r, self.added[r["id"]], self.first.get(r["id"]), *self.done[r["id"]])
            if token_ids or r.get("json_schema") is not None:
                one["token_ids"] = self.token_ids[r["id"]]
            records.append(one)
        return records


def write(out: str, config: dict, peer: str, elapsed: float, requests: list[dict], peak_kv_bytes=None,
          info: dict | None = None) -> None:
    result = {"label": config.get("label", peer), "peer": peer, "elapsed_s": elapsed, "peak_kv_bytes": peak_kv_bytes,
              "info": info or {}, "requests": requests}
    with open(out, "w") as f:
        json.dump(result, f)


def resident_memory() -> dict:
    """This process's resident memory in bytes: `peak_rss_bytes` (the most it held,
    loading included) and `rss_bytes` (now); empty where /proc is not there."""
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return {}
    kib = {name: int(value.split()[0]) for name, value in
           (line.split(":", 1) for line in status.splitlines()) if name in ("VmHWM", "VmRSS")}  # "NNN kB"
    return {"peak_rss_bytes": kib["VmHWM"] * 1024, "rss_bytes": kib["VmRSS"] * 1024}


STARTUP_PROMPT = 8  # prompt tokens of the request a peer's `info.startup_s` times to its first token


def process_age() -> float | None:
    """Seconds since this process started (the interpreter's launch, imports included),
    to 10 ms; None where /proc is not there."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()  # after the command name
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except OSError:
        return None
    return uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22, starttime, in clock ticks since boot


def warmup_requests(workload: dict, count: int = 4, max_tokens: int = 4) -> list[dict]:
    """A few short requests to run before timing (first-call costs: allocation, kernels)."""
    # reversed prompts: the same lengths, but no prefix shared with the timed requests
    return [dict(r, id=f"warm{i}", prompt_token_ids=r["prompt_token_ids"][::-1],
                 max_tokens=min(max_tokens, r["max_tokens"]), arrival_step=0)
            for i, r in enumerate(workload["requests"][:count])]


def clock():
    """Every peer's clock: wall time, or with `KVFORGE_BENCH_CLOCK=cpu` in the
    environment the CPU time of the peer's process (all its threads). On a
    machine shared with other work, wall time also counts the time other
    processes held the cores, by luck of scheduling; CPU time does not, so
    ratios between engines stay comparable there (with one thread per engine,
    as the bench runs them; an engine that spin-waits would be charged for it)."""
    name = os.environ.get("KVFORGE_BENCH_CLOCK", "wall")
    if name not in ("wall", "cpu"):
        raise SystemExit(f"KVFORGE_BENCH_CLOCK={name!r}: choose wall (the default) or cpu")
    return time.process_time if name == "cpu" else time.perf_counter


now = clock()
