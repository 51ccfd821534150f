#!/usr/bin/env bash
# kvforge GPU check: run on a CUDA machine where kvforge is already installed
# (with triton, flashinfer-python and xformers if they are to be checked).
# Installs nothing. Runs, in a few minutes:
#   1. the full conformance grid of every attention backend
#      (kvforge conformance --kind attention_backend),
#   2. the attention kernel benchmarks (benchmarks/bench_attention.py), and the decode shape over
#      each quantized KV dtype a backend declares (int8, fp8: triton), against its float-KV time,
#   3. a device-copy bandwidth probe (and, with two GPUs, TP=2 / PP=2 parity and figures),
# and prints a short table last. Logs go to $GPU_CHECK_DIR (default /tmp/kvforge_gpu_check).
#
#   bash benchmarks/gpu_check.sh                # full grid
#   GPU_CHECK_QUICK=1 bash benchmarks/gpu_check.sh   # the reduced grid, for a first look
#
# Exit status: 0 when every stage passed, 1 when a stage failed, 2 without CUDA.
set -uo pipefail

cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python}"
OUT="${GPU_CHECK_DIR:-${TMPDIR:-/tmp}/kvforge_gpu_check}"
CONFORMANCE_TIMEOUT="${GPU_CHECK_CONFORMANCE_TIMEOUT:-600}"  # per backend
BENCH_TIMEOUT="${GPU_CHECK_BENCH_TIMEOUT:-300}"

if ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "gpu_check: FAILED: no CUDA device is visible to torch (torch.cuda.is_available() is False)." >&2
    echo "gpu_check: this script needs an NVIDIA GPU and a CUDA build of torch; on a CPU machine run" >&2
    echo "gpu_check:   kvforge conformance --kind attention_backend   (triton: TRITON_INTERPRET=1 ... --plugin triton --quick)" >&2
    exit 2
fi
if [ "${TRITON_INTERPRET:-}" = "1" ]; then
    echo "gpu_check: unsetting TRITON_INTERPRET: the GPU check times and validates the compiled kernels" >&2
    unset TRITON_INTERPRET
fi
mkdir -p "$OUT"
rm -f "$OUT"/conformance_*.json

"$PYTHON" - <<'EOF' | tee "$OUT/environment.txt"
import importlib.metadata as md, torch
print(f"device: {torch.cuda.get_device_name()} (capability {'.'.join(map(str, torch.cuda.get_device_capability()))})")
for dist in ("torch", "triton", "flashinfer-python", "xformers", "kvforge"):
    try:
        print(f"{dist}: {md.version(dist)}")
    except md.PackageNotFoundError:
        print(f"{dist}: not installed")
EOF

# 1. Conformance: every attention backend, full grid (reduced with GPU_CHECK_QUICK=1), one
# process per backend with its own time limit, so a slow first compile of one does not hide the others.
backends=$("$PYTHON" -c "from kvforge.core import ATTENTION_BACKEND, build_registry
print(' '.join(r.name for r in build_registry().implementations(ATTENTION_BACKEND)))")
conformance_rc=0
for name in $backends; do
    echo "== conformance: $name (log: $OUT/conformance_$name.log)"
    timeout "$CONFORMANCE_TIMEOUT" "$PYTHON" - "$OUT/conformance_$name.json" "$name" \
        > "$OUT/conformance_$name.log" 2>&1 <<'EOF'
import json, os, sys
from kvforge.conformance import run_conformance
code, results = run_conformance(["attention_backend"], [sys.argv[2]], os.environ.get("GPU_CHECK_QUICK") == "1")
rows = [dict(implementation=r.implementation, group=r.group, status=r.status, passed=r.passed, failed=r.failed,
             skipped=r.skipped, failures=r.failures[:5], skip_reasons=r.skip_reasons[:2]) for r in results]
json.dump(dict(code=code, results=rows), open(sys.argv[1], "w"), indent=1)
sys.exit(0 if code in (0, 5) and not any(r["failed"] for r in rows) else 1)
EOF
    rc=$?
    if [ "$rc" -eq 124 ]; then
        echo "   timed out after ${CONFORMANCE_TIMEOUT}s (GPU_CHECK_CONFORMANCE_TIMEOUT)"
        echo '{"code": 124, "results": [], "timeout": true}' > "$OUT/conformance_$name.json"
    fi
    [ "$rc" -eq 0 ] || conformance_rc=1
    tail -n 1 "$OUT/conformance_$name.log"
done

# 2. Kernel benchmarks (the GPU shapes of benchmarks/bench_attention.py).
echo "== benchmarks (log: $OUT/bench.log)"
timeout "$BENCH_TIMEOUT" "$PYTHON" -m kvforge.benchmarks.bench_attention --repeat 20 > "$OUT/bench.log" 2>&1
bench_rc=$?
tail -n 3 "$OUT/bench.log"

# 2b. Quantized KV: the decode shape once per (backend, per-token quantizer it reads), beside the
# same backend over float KV. GB/s counts the bytes the kernel must read: codes and scales.
echo "== quantized-KV decode (log: $OUT/quantized_bench.log)"
timeout "$BENCH_TIMEOUT" "$PYTHON" - > "$OUT/quantized_bench.log" 2>&1 <<'EOF'
import torch
from kvforge.benchmarks.bench_attention import shapes, skip_reason, workload
from kvforge.core import (ATTENTION_BACKEND, PER_TOKEN, QUANTIZER, AttentionLayerSpec, KVCacheSpec, build_registry,
                          write_quantized_kv_by_slot)
registry, shape = build_registry(), shapes("cuda")[0]
w = workload(shape, "cuda")
layer = AttentionLayerSpec(shape.num_heads, shape.num_kv_heads, shape.head_size)
keys, values = (w.cache[:, i].flatten(0, 1) for i in (0, 1))  # every slot of the float cache, quantized below
slots = torch.arange(keys.shape[0], device="cuda")
quantizers = [r.cls() for r in registry.implementations(QUANTIZER) if r.cls.granularity == PER_TOKEN]

def median_ms(call, repeat=20):
    call()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(); call(); end.record(); torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]

print(f"{'shape':<8} {'backend':<18} {'time (ms)':>10} {'GB/s':>8} {'vs float KV':>12}")
for cls in (r.cls for r in registry.implementations(ATTENTION_BACKEND)):
    readable = [q for q in quantizers if q.storage_dtype in cls.quantized_kv_dtypes]
    if not readable or skip_reason(cls, shape, "cuda"):
        continue
    float_ms = None
    for q in [None, *readable]:
        spec = KVCacheSpec(shape.block_size, shape.num_kv_heads, shape.head_size, shape.dtype, quantizer=q)
        cache = w.cache
        if q is not None:
            cache = torch.zeros(cls.kv_cache_shape(w.cache.shape[0], spec), dtype=spec.tensor_dtype, device="cuda")
            write_quantized_kv_by_slot(keys, values, cache, slots, spec)
        backend, out = cls(layer, spec, "cuda"), torch.empty_like(w.query)
        plan = backend.plan(w.batch)
        ms = median_ms(lambda: backend.forward(w.query, cache, plan, out=out))
        float_ms = float_ms or ms
        row = shape.head_size * spec.storage_dtype.itemsize + (4 if q else 0)  # one token's K or V of one head
        read = 2 * shape.num_seqs * shape.seq_len * shape.num_kv_heads * row
        print(f"{shape.name:<8} {cls.name + '+' + (q.name if q else 'float'):<18} {ms:>10.3f} {read / ms / 1e6:>8.1f} "
              f"{ms / float_ms:>11.2f}x")
EOF
quantized_bench_rc=$?
tail -n 4 "$OUT/quantized_bench.log"
[ "$quantized_bench_rc" -eq 0 ] || bench_rc=1

# 2c. Tensor and pipeline parallelism, where the machine has two GPUs (NCCL): TP=2 and PP=2 give
# one process's greedy tokens on kvforge-tiny, then the figures on bench-llama-50m.
echo "== tensor/pipeline parallel (log: $OUT/parallel.log)"
timeout "$BENCH_TIMEOUT" "$PYTHON" - > "$OUT/parallel.log" 2>&1 <<'EOF'
import sys, torch
if torch.cuda.device_count() < 2:
    print(f"skipped: {torch.cuda.device_count()} CUDA device(s); TP=2 and PP=2 need one per rank")
    sys.exit(0)
from kvforge import LLM, SamplingParams
from kvforge.benchmarks.tensor_parallel_figures import main
params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
tokens = []
for parallel in ({}, {"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}):
    llm = LLM("kvforge-tiny", device="cuda", dtype="float32", parallel=parallel)
    tokens.append([o.outputs[0].token_ids for o in llm.generate(["def main(", "Hello"], params)])
    llm.engine.shutdown()
print(f"greedy tokens TP=2 == one process: {tokens[1] == tokens[0]}; PP=2 == one process: {tokens[2] == tokens[0]}")
main(["--device", "cuda"])
sys.exit(0 if tokens[1] == tokens[0] == tokens[2] else 1)
EOF
[ $? -eq 0 ] || bench_rc=1
tail -n 12 "$OUT/parallel.log"

# 3. Memory bandwidth the kernels are judged against: a large device-to-device copy.
"$PYTHON" - > "$OUT/bandwidth.txt" 2>&1 <<'EOF'
import torch
x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
y = torch.empty_like(x)
for _ in range(3):
    y.copy_(x)
start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
start.record()
for _ in range(20):
    y.copy_(x)
end.record()
torch.cuda.synchronize()
seconds = start.elapsed_time(end) / 1e3 / 20
print(f"{2 * x.numel() / seconds / 1e9:.1f}")  # bytes read + written per second
EOF

# 4. The short table, last.
"$PYTHON" - "$OUT" "$conformance_rc" "$bench_rc" <<'EOF'
import glob, json, os, sys
out, conformance_rc, bench_rc = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
print("\n================ kvforge GPU check ================")
print(next(iter(open(os.path.join(out, "environment.txt")).read().splitlines()), "device: (unknown)"))
print(f"\nconformance ({'reduced' if os.environ.get('GPU_CHECK_QUICK') == '1' else 'full'} grid), "
      f"attention_backend, groups per backend:")
by_backend = {}
for file in sorted(glob.glob(os.path.join(out, "conformance_*.json"))):
    name = os.path.basename(file)[len("conformance_"):-len(".json")]
    try:
        report = json.load(open(file))
    except (OSError, ValueError):
        report = {"results": []}
    by_backend[name] = [r for r in report["results"] if r["implementation"] == name]
    if report.get("timeout") or not by_backend[name]:
        why = "timed out" if report.get("timeout") else "no results"
        print(f"  {name:<12} {'FAIL':<8} {why}: see {out}/conformance_{name}.log")
        del by_backend[name]
for name, groups in sorted(by_backend.items()):
    count = {s: sum(g["status"] == s for g in groups) for s in ("pass", "fail", "skipped")}
    verdict = "FAIL" if count["fail"] else ("pass" if not count["skipped"] else "partial" if count["pass"] else "skipped")
    note = next((g["skip_reasons"][0] for g in groups if g["status"] == "skipped" and g["skip_reasons"]), "")
    print(f"  {name:<12} {verdict:<8} pass {count['pass']}  fail {count['fail']}  skipped {count['skipped']}"
          + (f"  (skipped: {note[:70]})" if count["skipped"] else ""))
    for g in groups:
        for failure in g["failures"][:2]:
            print(f"      {g['group']}: {failure[:150]}")
quantized = {name: [g for g in groups if "quantiz" in g["group"]] for name, groups in by_backend.items()}
print("\nquantized-KV conformance (groups named *quantiz*):")
if not any(quantized.values()):
    print("  none ran: this kvforge has no quantized-KV attention check (conformance/check_attention_quantized_kv.py)")
for name, groups in sorted(quantized.items()):
    for g in groups:
        why = f"  ({g['skip_reasons'][0][:70]})" if g["status"] == "skipped" and g["skip_reasons"] else ""
        print(f"  {name:<12} {g['status']:<8} {g['group']}: pass {g['passed']}  fail {g['failed']}{why}")
try:
    bandwidth = float(open(os.path.join(out, "bandwidth.txt")).read().split()[-1])
    print(f"\nmemory bandwidth (1 GiB device copy): {bandwidth:.0f} GB/s")
except (OSError, ValueError, IndexError):
    bandwidth = None
    print("\nmemory bandwidth: probe failed (see bandwidth.txt)")
lines = open(os.path.join(out, "bench.log")).read().splitlines()
start = next((i for i, line in enumerate(lines) if line.startswith("shape")), None)
print(f"\nattention benchmarks (exit {bench_rc}):")
table = lines[start:] if start is not None else [f"  no table: see {out}/bench.log"]
print("\n".join("  " + line for line in table))
print("\nquantized-KV decode (bytes read: codes + float32 scales):")
quantized_lines = open(os.path.join(out, "quantized_bench.log")).read().splitlines()
start = next((i for i, line in enumerate(quantized_lines) if line.startswith("shape")), None)
print("\n".join("  " + line for line in (quantized_lines[start:] if start is not None
                                          else [f"no table: see {out}/quantized_bench.log"])))
rows = {}
for line in table[1:]:
    parts = line.split()
    if len(parts) >= 4:
        try:
            rows[(parts[0], parts[1])] = (float(parts[2]), float(parts[3]))
        except ValueError:
            pass
triton, flashinfer = rows.get(("decode", "triton")), rows.get(("decode", "flashinfer"))
print("\ntargets:")
if triton and bandwidth:
    print(f"  triton decode bandwidth / memory bandwidth: {triton[1] / bandwidth:.2f} (target >= 0.70)")
if triton and flashinfer:
    print(f"  triton decode time / flashinfer decode time: {triton[0] / flashinfer[0]:.2f} (target <= 1.30)")
if not triton:
    print("  triton decode not measured")
status = "PASS" if conformance_rc == 0 and bench_rc == 0 else "FAIL"
print(f"\ngpu_check: {status} (conformance exit {conformance_rc}, benchmarks exit {bench_rc}; logs in {out}/)")
EOF
[ "$conformance_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
