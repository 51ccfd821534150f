#!/usr/bin/env bash
# kvforge GPU check: run on a CUDA machine where kvforge is already installed
# (with triton, flashinfer-python and xformers if they are to be checked).
# Installs nothing. Runs, in a few minutes:
#   1. the full conformance grid of every attention backend that runs on CUDA, and end-to-end
#      greedy generation with each against the `reference` backend (benchmarks/generate_parity.py),
#   2. the attention kernel benchmarks (benchmarks/bench_attention.py), and the decode shape over
#      each quantized KV dtype a backend declares (int8, fp8: triton), against its float-KV time,
#   3. a device-copy bandwidth probe, the Triton tuning sweeps (benchmarks/triton_sweep.py), and,
#      with two GPUs, TP=2 / PP=2 parity and figures,
# and prints a short table last. Logs go to $GPU_CHECK_DIR (default /tmp/kvforge_gpu_check).
#
#   bash benchmarks/gpu_check.sh                # full grid
#   GPU_CHECK_QUICK=1 bash benchmarks/gpu_check.sh   # the reduced grid, for a first look
#   GPU_CHECK_WORKERS=6 (pytest-xdist processes per backend), GPU_CHECK_CHECK_LIMIT=200 (seconds per check),
#   GPU_CHECK_CONFORMANCE_TIMEOUT / GPU_CHECK_BENCH_TIMEOUT (seconds per stage)
#
# Exit status: 0 when every stage passed, 1 when a stage failed, 2 without CUDA.
set -uo pipefail

PYTHON="${PYTHON:-python}"
OUT="${GPU_CHECK_DIR:-${TMPDIR:-/tmp}/kvforge_gpu_check}"
CONFORMANCE_TIMEOUT="${GPU_CHECK_CONFORMANCE_TIMEOUT:-600}"  # the conformance runs and generation, in parallel
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
mkdir -p "$OUT" && OUT="$(cd "$OUT" && pwd)"
# Run from the log folder: from a source checkout's root, `python -m kvforge...` would import the
# checkout's bare `kvforge/` folder instead of the installed package.
cd "$OUT" || exit 1
rm -f "$OUT"/conformance_* "$OUT"/generate.* "$OUT"/sweep.*

"$PYTHON" - <<'EOF' | tee "$OUT/environment.txt"
import importlib.metadata as md, torch
print(f"device: {torch.cuda.get_device_name()} (capability {'.'.join(map(str, torch.cuda.get_device_capability()))})")
for dist in ("torch", "triton", "flashinfer-python", "xformers", "kvforge"):
    try:
        print(f"{dist}: {md.version(dist)}")
    except md.PackageNotFoundError:
        print(f"{dist}: not installed")
EOF

# 1. Correctness, in parallel (the GPU is not timed yet): the conformance grid of every
# attention backend that runs on CUDA (plain pytest over the suite's check modules, spread over
# $GPU_CHECK_WORKERS processes with pytest-xdist where installed: the first compile of every
# kernel variant dominates), and end-to-end greedy generation with each against `reference`.
backends=$("$PYTHON" -c "from kvforge.core import ATTENTION_BACKEND, build_registry
print(' '.join(r.name for r in build_registry().implementations(ATTENTION_BACKEND)
               if 'cuda' in r.cls.devices and r.cls.availability().ok))")
"$PYTHON" -c "from kvforge.core import ATTENTION_BACKEND, build_registry
for r in build_registry().implementations(ATTENTION_BACKEND):
    a = r.cls.availability()
    print(f'backend {r.name}: ' + ('available' if a.ok else f'not run: {a.reason}') + f'; devices {sorted(r.cls.devices)}')
" | tee -a "$OUT/environment.txt"
package=$("$PYTHON" -c "import kvforge.conformance as c, os; print(os.path.dirname(c.__file__))")
modules=$(cd "$package" && ls check_attention_*.py | sed 's/\.py$//; s/^/kvforge.conformance./' | tr '\n' ' ')
workers=()
if "$PYTHON" -c "import xdist" 2>/dev/null; then workers=(-n "${GPU_CHECK_WORKERS:-6}"); fi
quick=""; [ "${GPU_CHECK_QUICK:-}" = "1" ] && quick=1
pids=()
for name in $backends; do
    echo "== conformance: $name (log: $OUT/conformance_$name.log)"
    KVFORGE_CONFORMANCE_PLUGINS="$name" KVFORGE_CONFORMANCE_QUICK="$quick" \
    KVFORGE_CONFORMANCE_TIME_LIMIT="${GPU_CHECK_CHECK_LIMIT:-200}" \
        timeout "$CONFORMANCE_TIMEOUT" "$PYTHON" -m pytest --pyargs $modules --rootdir "$package" \
        -p no:cacheprovider -q -rfE "${workers[@]}" --junitxml "$OUT/conformance_$name.xml" \
        > "$OUT/conformance_$name.log" 2>&1 &
    pids+=($!)
done
echo "== end-to-end greedy generation (log: $OUT/generate.log)"
timeout "$CONFORMANCE_TIMEOUT" "$PYTHON" -m kvforge.benchmarks.generate_parity --device cuda \
    --json "$OUT/generate.json" > "$OUT/generate.log" 2>&1 &
generate_pid=$!
conformance_rc=0
for pid in "${pids[@]}"; do
    wait "$pid"; rc=$?
    # pytest: 0 all passed, 5 nothing collected (every check skipped counts as passed here)
    [ "$rc" -eq 0 ] || [ "$rc" -eq 5 ] || conformance_rc=1
done
wait "$generate_pid"; generate_rc=$?
[ "$generate_rc" -eq 0 ] || conformance_rc=1
for name in $backends; do echo "   $name: $(tail -n 1 "$OUT/conformance_$name.log")"; done
echo "   generate: $(tail -n 1 "$OUT/generate.log")"

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

# 3b. Tuning the Triton kernel: tile, warps, stages and splits on the decode target shape, and
# query rows per tile on a prefill shape.
if [[ " $backends " == *" triton "* ]]; then
    for mode in decode prefill decode_fp8_e4m3 decode_int8; do
        echo "== triton $mode sweep (log: $OUT/sweep_$mode.log)"
        case "$mode" in
            prefill) flags=(--prefill) ;;
            decode_*) flags=(--kv-cache-dtype "${mode#decode_}") ;;
            *) flags=() ;;
        esac
        timeout "$BENCH_TIMEOUT" "$PYTHON" -m kvforge.benchmarks.triton_sweep "${flags[@]}" \
            --json "$OUT/sweep_$mode.json" > "$OUT/sweep_$mode.log" 2>&1 || echo "   sweep exit $?"
        head -n 5 "$OUT/sweep_$mode.log"
    done
fi

# 4. The short table, last.
"$PYTHON" -m kvforge.benchmarks.gpu_check_report "$OUT" "$conformance_rc" "$bench_rc" | tee "$OUT/summary.txt"
[ "$conformance_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
