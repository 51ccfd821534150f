"""llama.cpp on the `batch1` workload: the bench model converted to GGUF by
llama.cpp's own converter (llama_cpp_convert.py), then `llama-bench -p P -n N
-t THREADS -o json` (P: the workload's prompt length, N: its decode tokens),
and `llama-bench -p 0 -n N -d P` (tg after a P-token context, recorded in
`info.tg_after_prompt_tps`); with the option `batched` (sequence counts),
`llama-batched-bench` on the same shapes. `info.peak_rss_bytes` is the most
resident memory the `-p P -n N` run held (its rusage; `run_measured`);
`info.startup_s` the time from launching llama-bench to its exit after a short
pp test and a one-token tg test (`run_startup`).

Run it with a Python that has torch and transformers (the harness runs it with
kvforge's); `--config` carries `peer_path`: llama.cpp's bin directory or its
llama-bench binary. Options: `outtype` (f32, bf16 or q8_0: the converter's
`--outtype`). Threads: OMP_NUM_THREADS, as the harness sets it for every peer.

The result has one record per llama-bench repetition: its prompt processing
time as the TTFT, its `tg` time per token as the time per output token, so the
bench reads pp tok/s and tg tok/s as it reads kvforge's (prompt / TTFT and
1 / TPOT). llama-bench times with the wall clock, whatever KVFORGE_BENCH_CLOCK
says; `info.clock` records it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

try:
    import common  # run as a script, beside it
except ImportError:  # imported as kvforge.benchmarks.peers.llama_cpp_peer
    from . import common

OUTTYPES = ("f32", "bf16", "q8_0")
BENCH, BATCHED = "llama-bench", "llama-batched-bench"
SETUP = "docs/benchmarks.md, 'Setting up the llama.cpp peer'"


def locate(path: str) -> dict:
    """llama-bench, llama-batched-bench (None when not built) and the source tree
    holding convert_hf_to_gguf.py, from `path` (the bin directory or the
    llama-bench binary); ValueError saying what is missing otherwise."""
    if os.sep not in path and shutil.which(path):  # a bare name: found on PATH
        path = shutil.which(path)
    given = Path(os.path.expanduser(path))
    bench = given if given.is_file() else given / BENCH
    if not bench.is_file():
        raise ValueError(f"no {BENCH} at {given} (give llama.cpp's bin directory or its {BENCH}; build: {SETUP})")
    if not os.access(bench, os.X_OK):
        raise ValueError(f"{bench} is not executable")
    batched = bench.parent / BATCHED
    source = next((p for p in bench.resolve().parents if (p / "convert_hf_to_gguf.py").is_file()), None)
    if source is None:
        raise ValueError(f"no convert_hf_to_gguf.py in any folder above {bench}: run the llama.cpp build "
                         f"inside its source tree ({SETUP})")
    return {"bench": str(bench), "batched": str(batched) if os.access(batched, os.X_OK) else None,
            "source": str(source)}


def convert(source: str, model_dir: str, outtype: str, out: Path) -> Path:
    """The model as GGUF of `outtype`, converted once into `out`'s folder."""
    if outtype not in OUTTYPES:
        raise SystemExit(f"outtype {outtype!r}: choose from {', '.join(OUTTYPES)}")
    gguf = out.parent / f"{Path(model_dir).name}.{outtype}.gguf"
    if not gguf.is_file():
        command = [sys.executable, str(Path(__file__).with_name("llama_cpp_convert.py")), source, model_dir,
                   "--outtype", outtype, "--outfile", str(gguf)]
        proc = subprocess.run(command, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"GGUF conversion failed: {proc.stderr.strip()[-1500:]}")
    return gguf


def bench_tests(report: list[dict]) -> dict[str, dict]:
    """llama-bench's JSON report (one entry per test) as {"pp": entry, "tg": entry}: a
    test with prompt tokens and no generated ones is pp, the reverse tg."""
    tests = {}
    for entry in report:
        if entry["n_prompt"] > 0 and entry["n_gen"] == 0:
            tests["pp"] = entry
        elif entry["n_gen"] > 0 and entry["n_prompt"] == 0:
            tests["tg"] = entry
    missing = {"pp", "tg"} - set(tests)
    if missing:
        raise ValueError(f"llama-bench report has no {' or '.join(sorted(missing))} test")
    return tests


def records(tests: dict[str, dict], requests: list[dict] | None = None) -> list[dict]:
    """One record per repetition, named by `requests` (the workload's, one
    repetition each, their id and class; default rep0, rep1, ...): TTFT its
    prompt time, each further token its tg time per token (llama-bench's
    `samples_ns`: nanoseconds per repetition)."""
    pp, tg = tests["pp"], tests["tg"]
    requests = requests or [{"id": f"rep{i}"} for i in range(len(pp["samples_ns"]))]
    out = []
    for request, pp_ns, tg_ns in zip(requests, pp["samples_ns"], tg["samples_ns"]):
        ttft = pp_ns / 1e9
        out.append({"id": request["id"], "cls": request.get("cls"), "output_tokens": tg["n_gen"] + 1,
                    "ttft_s": ttft, "latency_s": ttft + tg_ns / 1e9})
    return out


def threads() -> int | None:
    value = os.environ.get("OMP_NUM_THREADS")
    return int(value) if value else None


def run_bench(binary: str, gguf: Path, prompt: int, gen: int, repetitions: int,
              depth: int = 0) -> tuple[list[dict], int | None]:
    """llama-bench's JSON report and its peak resident bytes (`run_measured`: None where
    not known); with `depth`, its tests start after that many tokens in the context."""
    command = [binary, "-m", str(gguf), "-p", str(prompt), "-n", str(gen), "-r", str(repetitions), "-o", "json"]
    if depth:
        command += ["-d", str(depth)]
    if threads():
        command += ["-t", str(threads())]
    stdout, peak = run_measured(command)
    return json.loads(stdout), peak


def run_startup(binary: str, gguf: Path) -> float:
    """Seconds from launching llama-bench to its exit after one pp test of
    `common.STARTUP_PROMPT` tokens and one one-token tg test, no warm-up: llama.cpp's
    start-up to a first token."""
    command = [binary, "-m", str(gguf), "-p", str(common.STARTUP_PROMPT), "-n", "1", "-r", "1", "--no-warmup", "-o", "json"]
    if threads():
        command += ["-t", str(threads())]
    start = time.perf_counter()
    run_measured(command)
    return time.perf_counter() - start


def run_measured(command: list[str]) -> tuple[str, int | None]:
    """Run `command`: its stdout and the most resident memory it held, in bytes, or
    None where that cannot be told. Linux carries the launching process's own peak
    over exec into the child's `ru_maxrss`, so that figure is the child's only when
    it exceeds this process's peak (this peer is small: a model's run does); below
    it, a run's peak is not known."""
    launcher = common.resident_memory().get("peak_rss_bytes", 0)
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(command, stdout=out, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait again
        out.seek(0)
        err.seek(0)
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(command)} failed: {err.read().decode(errors='replace').strip()[-800:]}")
        peak = usage.ru_maxrss * 1024  # Linux counts kilobytes
        return out.read().decode(), peak if peak > launcher else None


def run_batched(binary: str, gguf: Path, prompt: int, gen: int, sequences: list[int]) -> list[dict]:
    """llama-batched-bench: each count of parallel sequences, prompts of `prompt`, `gen` tokens each (jsonl rows)."""
    context = max(sequences) * (prompt + gen)
    command = [binary, "-m", str(gguf), "-c", str(context), "-b", "2048", "-ub", "512", "-npp", str(prompt),
               "-ntg", str(gen), "-npl", ",".join(map(str, sequences)), "--output-format", "jsonl"]
    if threads():
        command += ["-t", str(threads())]
    proc = subprocess.run(command, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed: {proc.stderr.strip()[-800:]}")
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def main() -> None:
    workload, config, out = common.parse()
    options = config.get("options", {})
    try:
        found = locate(config["peer_path"])
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    first = workload["requests"][0]
    prompt, gen = len(first["prompt_token_ids"]), first["max_tokens"] - 1  # the first token comes from the prompt
    gguf = convert(found["source"], workload["model_dir"], options.get("outtype", "f32"), Path(out))
    # one repetition per request of the first one's class (the others, kvforge's decode from an empty
    # context, are what llama-bench's tg test measures already), as kvforge runs each once
    measured = [r for r in workload["requests"] if r.get("cls") == first.get("cls")]
    report, peak = run_bench(found["bench"], gguf, prompt, gen, len(measured))
    tests = bench_tests(report)
    rows = records(tests, measured)
    info = {"clock": "wall", "outtype": options.get("outtype", "f32"), "gguf_bytes": gguf.stat().st_size,
            "threads": threads(), "llama_bench": {k: tests[k]["avg_ts"] for k in tests},
            "build_commit": tests["pp"].get("build_commit"), "cpu_info": tests["pp"].get("cpu_info"),
            "peak_rss_bytes": peak}
    info["startup_s"] = run_startup(found["bench"], gguf)
    # tg again after the prompt (-d P): the context kvforge's decode steps see
    deep, _ = run_bench(found["bench"], gguf, 0, gen, len(measured), depth=prompt)
    info["tg_after_prompt_tps"] = next((e["avg_ts"] for e in deep if e["n_gen"] > 0), None)
    if options.get("batched"):
        if found["batched"] is None:
            info["batched"] = f"not run: no {BATCHED} beside {found['bench']}"
        else:
            info["batched"] = run_batched(found["batched"], gguf, prompt, gen, options["batched"])
    elapsed = sum(r["latency_s"] for r in rows)  # the repetitions ran one after another
    common.write(out, config, "llama.cpp", elapsed, rows, None, info)


if __name__ == "__main__":
    main()
