"""The closing table of `benchmarks/gpu_check.sh`, read from the files its stages
left in one folder: conformance JUnit XML per backend, the generation parity
rows, the attention benchmark logs, the bandwidth probe and the Triton sweep.

    python -m kvforge.benchmarks.gpu_check_report DIR CONFORMANCE_RC BENCH_RC
"""

from __future__ import annotations

import json
import os
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path


def read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def conformance(out: Path) -> list[str]:
    lines = []
    for file in sorted(out.glob("conformance_*.xml")):
        name = file.stem.removeprefix("conformance_")
        try:
            cases = list(ElementTree.parse(file).getroot().iter("testcase"))
        except (OSError, ElementTree.ParseError):
            lines.append(f"  {name:<12} FAIL     no results (timed out or crashed): see conformance_{name}.log")
            continue
        failed = [c for c in cases if c.find("failure") is not None or c.find("error") is not None]
        skipped = [c for c in cases if c.find("skipped") is not None]
        passed = len(cases) - len(failed) - len(skipped)
        verdict = "FAIL" if failed else "pass" if passed else "skipped"
        lines.append(f"  {name:<12} {verdict:<8} checks passed {passed}  failed {len(failed)}  skipped {len(skipped)}")
        for case in failed[:6]:
            problem = case.find("failure") if case.find("failure") is not None else case.find("error")
            message = (problem.get("message") or "").splitlines()[0][:140] if problem is not None else ""
            lines.append(f"      {case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}: {message}")
        reasons = sorted({(c.find("skipped").get("message") or "")[:100] for c in skipped})
        lines += [f"      skipped: {reason}" for reason in reasons[:3]]
    return lines or ["  none ran"]


def generation(out: Path) -> list[str]:
    try:
        rows = json.loads(read(out / "generate.json") or "null")
    except ValueError:
        rows = None
    if not rows:
        return [f"  no rows: see {out}/generate.log"] + ["  " + line for line in read(out / "generate.log").splitlines()[-5:]]
    lines = [f"  {'model':<16} {'dtype':<9} {'kv':<9} {'weights':<12} {'backend':<10} {'identical':>10} {'prefix':>7}"]
    for r in rows:
        head = f"  {r['model']:<16} {r['dtype']:<9} {r['kv_cache_dtype']:<9} {r['weights'] or '-':<12} {r['backend']:<10}"
        if "error" in r:
            lines.append(f"{head} FAILED: {r['error'][:90]}")
        else:
            lines.append(f"{head} {r['identical']:>4}/{r['requests']:<5} {r['prefix']:>7.3f}")
    return lines


def table_after_header(text: str, header: str) -> list[str]:
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith(header)), None)
    return lines[start:] if start is not None else []


def main(argv: list[str]) -> int:
    out, conformance_rc, bench_rc = Path(argv[0]), int(argv[1]), int(argv[2])
    quick = "reduced" if os.environ.get("GPU_CHECK_QUICK") == "1" else "full"
    print("\n================ kvforge GPU check ================")
    print(read(out / "environment.txt").strip())
    print(f"\nattention conformance ({quick} grid), per backend:")
    print("\n".join(conformance(out)))
    print("\nend-to-end greedy generation against `reference` on the same GPU (requests identical, token prefix):")
    print("\n".join(generation(out)))
    try:
        bandwidth = float(read(out / "bandwidth.txt").split()[-1])
        print(f"\nmemory bandwidth (1 GiB device-to-device copy, read + write): {bandwidth:.0f} GB/s")
    except (ValueError, IndexError):
        bandwidth = None
        print("\nmemory bandwidth: probe failed (see bandwidth.txt)")
    table = table_after_header(read(out / "bench.log"), "shape")
    print(f"\nattention benchmarks (exit {bench_rc}):")
    print("\n".join("  " + line for line in table) or f"  no table: see {out}/bench.log")
    quantized = table_after_header(read(out / "quantized_bench.log"), "shape")
    print("\nquantized-KV decode (bytes read: codes + float32 scales):")
    print("\n".join("  " + line for line in quantized) or f"  no table: see {out}/quantized_bench.log")
    for log in sorted(out.glob("sweep_*.log")):
        sweep = log.read_text().splitlines()
        print(f"\ntriton {log.stem.removeprefix('sweep_')} sweep (fastest first; first 10 rows):")
        print("\n".join("  " + line for line in sweep[:13]))
    rows = {}
    for line in table[1:]:
        parts = line.split()
        try:
            rows[(parts[0], parts[1])] = (float(parts[2]), float(parts[3]))
        except (IndexError, ValueError):
            pass
    triton, flashinfer = rows.get(("decode", "triton")), rows.get(("decode", "flashinfer"))
    print("\ntargets:")
    if triton and bandwidth:
        print(f"  triton decode bandwidth / copy bandwidth: {triton[1] / bandwidth:.2f} (target >= 0.70)")
    if triton and flashinfer:
        print(f"  triton decode time / flashinfer decode time: {triton[0] / flashinfer[0]:.2f} (target <= 1.30)")
    if not triton:
        print("  triton decode not measured")
    status = "PASS" if conformance_rc == 0 and bench_rc == 0 else "FAIL"
    print(f"\ngpu_check: {status} (correctness exit {conformance_rc}, benchmarks exit {bench_rc}; logs in {out}/)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
