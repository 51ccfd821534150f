"""Decode and prefill microbenchmarks for every available `attention_backend`.

Each registered backend that is available here and serves the shape is timed on
one layer's `forward` over a paged cache whose physical blocks are shuffled (the
step's `plan` is built once, outside the timing, as an engine amortises it over
its layers; on CPU the cache sits on 2 MiB pages where the system grants them, as
the engine keeps its caches). Beside them, `contiguous-sdpa` runs PyTorch SDPA over an unpaged,
contiguous copy of the same keys and values: the floor paging is measured against.

Reported per row: median time, effective bandwidth (KV bytes read / time) and
the paging overhead ratio (time / contiguous SDPA's time on the same shape).

A second set of shapes compares KV-cache dtypes on decodes (CPU: 128 sequences
x 290 tokens, and 64 x 2048, larger than the caches): float32, bfloat16, and
float32 attention over caches quantized to int8, fp8_e4m3 and fp8_e5m2 by the
built-in quantizers. Their GB/s count the bytes a decode must read, scales
included. Only backends that declare the quantized storage dtype run those rows.

    pytest benchmarks/bench_attention.py                     # pytest-benchmark, table at the end
    python -m kvforge.benchmarks.bench_attention [--repeat N] # the table alone
    python -m kvforge.benchmarks.bench_attention --kv-dtypes --threads 1 --backend cpp
    python -m kvforge.benchmarks.bench_attention --threads 1 --clock cpu --backend cpp --backend vllm_cpu --block-size 32

Backends arrive through the registry, so a newly installed plugin shows up here
without edits. A backend that owns its cache layout (`kv_layout` other than NHD,
such as `vllm_cpu`) gets the same keys and values written into its own layout by
its own `write_kv`, before the timing. A backend whose class sets `conformance_grid = "reduced"` (one
that runs under an interpreter on this machine, like Triton on a CPU) is skipped:
its timings would measure the interpreter.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import statistics
import time
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from kvforge.core import (
    ATTENTION_BACKEND,
    FLOAT_DTYPES,
    NHD,
    QUANTIZER,
    SCALE_DTYPE,
    AttentionBatch,
    AttentionLayerSpec,
    KVCacheSpec,
    attention_request,
    build_registry,
    cdiv,
    quantized_kv_views,
)
from kvforge.models.huge_pages import zeros_on_huge_pages

BASELINE = "contiguous-sdpa"


@functools.lru_cache(maxsize=1)
def registry():
    return build_registry()


@dataclass(frozen=True)
class Shape:
    name: str
    num_seqs: int
    context_len: int  # tokens cached before the step, equal for every sequence
    query_len: int  # new tokens per sequence
    num_heads: int
    num_kv_heads: int
    head_size: int
    block_size: int
    dtype: torch.dtype
    kv_cache_dtype: str = "auto"  # or the name of the quantizer that stores the cache

    @property
    def seq_len(self) -> int:
        return self.context_len + self.query_len

    def quantizer(self):
        if self.kv_cache_dtype == "auto":
            return None
        return registry().select(QUANTIZER, self.kv_cache_dtype).cls()

    def cache_spec(self) -> KVCacheSpec:
        return KVCacheSpec(self.block_size, self.num_kv_heads, self.head_size, self.dtype,
                           quantizer=self.quantizer())

    def kv_bytes(self) -> int:
        """Keys and values (and their scales) one layer's attention must read at least once."""
        spec = self.cache_spec()
        element = torch.empty((), dtype=spec.storage_dtype).element_size()
        per_head = self.head_size * element + (SCALE_DTYPE.itemsize if spec.quantized else 0)
        return 2 * self.num_seqs * self.seq_len * self.num_kv_heads * per_head


def shapes(device: str) -> list[Shape]:
    if device == "cuda":  # the decode target of docs/gpu_backends.md: batch 64, context 4096, head 128
        return [Shape("decode", 64, 4096, 1, 32, 8, 128, 16, torch.bfloat16),
                Shape("prefill", 4, 0, 1024, 32, 8, 128, 16, torch.bfloat16)]
    # scaled down for a small shared CPU; float32, CPU's native attention dtype
    return [Shape("decode", 16, 512, 1, 16, 4, 128, 16, torch.float32),
            Shape("prefill", 2, 0, 256, 16, 4, 128, 16, torch.float32)]


KV_DTYPES = [("float32", torch.float32, "auto"), ("bfloat16", torch.bfloat16, "auto"),
             ("int8", torch.float32, "int8"), ("fp8_e4m3", torch.float32, "fp8_e4m3"),
             ("fp8_e5m2", torch.float32, "fp8_e5m2")]


def kv_dtype_shapes(device: str) -> list[Shape]:
    """Decodes over every KV-cache dtype: a batch whose cache fits in a server's L3,
    and one far larger (8 query / 4 KV heads of 64, block 16)."""
    sizes = [(128, 290), (64, 2048)] if device == "cpu" else [(32, 1024), (64, 4096)]
    return [Shape(f"decode-{seqs}x{context}/{label}", seqs, context, 1, 8, 4, 64, 16, dtype, kv)
            for seqs, context in sizes for label, dtype, kv in KV_DTYPES]


def device_here() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass
class Workload:
    """Everything one timed call needs: a paged layer and the same data unpaged."""

    shape: Shape
    query: torch.Tensor  # [T, heads, d]
    cache: torch.Tensor  # [num_blocks, 2, block_size, kv_heads, d], blocks shuffled
    batch: AttentionBatch
    keys: torch.Tensor  # [num_seqs, kv_heads, seq_len, d], contiguous
    values: torch.Tensor


def workload(shape: Shape, device: str, seed: int = 0) -> Workload:
    gen = torch.Generator().manual_seed(seed)
    s, bs = shape, shape.block_size
    per_seq = cdiv(s.seq_len, bs)
    num_blocks = s.num_seqs * per_seq + 8
    physical = torch.randperm(num_blocks, generator=gen)[: s.num_seqs * per_seq]
    table = physical.view(s.num_seqs, per_seq).to(torch.int32)
    keys = torch.randn(s.num_seqs, s.seq_len, s.num_kv_heads, s.head_size, generator=gen).to(s.dtype)
    values = torch.randn(s.num_seqs, s.seq_len, s.num_kv_heads, s.head_size, generator=gen).to(s.dtype)
    cache = torch.zeros(num_blocks, 2, bs, s.num_kv_heads, s.head_size, dtype=s.dtype)
    padded = per_seq * bs
    for kv, data in ((0, keys), (1, values)):
        full = torch.zeros(s.num_seqs, padded, s.num_kv_heads, s.head_size, dtype=s.dtype)
        full[:, : s.seq_len] = data
        cache[table.long(), kv] = full.view(s.num_seqs, per_seq, bs, s.num_kv_heads, s.head_size)
    if s.kv_cache_dtype != "auto":
        cache = quantized_cache(cache, s.cache_spec())
    if device == "cpu":  # on 2 MiB pages, as the engine keeps its caches (models/huge_pages.py)
        placed = zeros_on_huge_pages([tuple(cache.shape)], cache.dtype)
        cache = cache if placed is None else placed[0].copy_(cache)
    pos = torch.arange(s.context_len, s.seq_len)
    slots = (table[:, pos // bs].long() * bs + pos % bs).flatten()
    batch = AttentionBatch(
        query_start_loc=torch.arange(s.num_seqs + 1, dtype=torch.int32) * s.query_len,
        seq_lens=torch.full((s.num_seqs,), s.seq_len, dtype=torch.int32),
        context_lens=torch.full((s.num_seqs,), s.context_len, dtype=torch.int32),
        block_table=table, slot_mapping=slots, block_size=bs, max_query_len=s.query_len, max_seq_len=s.seq_len)
    batch = AttentionBatch(**{k: getattr(batch, k).to(device) for k in
                              ("query_start_loc", "seq_lens", "context_lens", "block_table", "slot_mapping")},
                           block_size=bs, max_query_len=s.query_len, max_seq_len=s.seq_len)
    query = torch.randn(s.num_seqs * s.query_len, s.num_heads, s.head_size, generator=gen).to(s.dtype)
    return Workload(shape, query.to(device), cache.to(device), batch,
                    keys.transpose(1, 2).contiguous().to(device), values.transpose(1, 2).contiguous().to(device))


def quantized_cache(cache: torch.Tensor, spec: KVCacheSpec) -> torch.Tensor:
    """`cache` (NHD) quantized per (token, KV head) by `spec.quantizer`, in the
    quantized layout: one row of bytes per block."""
    quantized = torch.zeros(cache.shape[0], spec.layer_block_bytes(), dtype=spec.tensor_dtype)
    data, scales = quantized_kv_views(quantized, spec)
    q = spec.quantizer.quantize(cache)
    data.copy_(q.data)
    scales.copy_(q.scale.squeeze(-1))
    return quantized


def contiguous_call(w: Workload):
    """The best SDPA call over the unpaged copy. Decodes pack the query heads that
    share a KV head into SDPA's query-length dimension (measured 2x faster on CPU
    than `enable_gqa`); prompts run causal with `enable_gqa`."""
    s = w.shape
    group = s.num_heads // s.num_kv_heads
    if s.query_len == 1:
        q = w.query.view(s.num_seqs, s.num_kv_heads, group, s.head_size)

        def call():
            return F.scaled_dot_product_attention(q, w.keys, w.values)
        return call
    q = w.query.view(s.num_seqs, s.query_len, s.num_heads, s.head_size).transpose(1, 2)
    causal = s.context_len == 0

    def call():
        return F.scaled_dot_product_attention(q, w.keys, w.values, is_causal=causal, enable_gqa=group > 1)
    return call


def backend_call(cls, w: Workload, device: str):
    s = w.shape
    layer = AttentionLayerSpec(s.num_heads, s.num_kv_heads, s.head_size)
    backend = cls(layer, s.cache_spec(), device)
    cache = w.cache if cls.kv_layout == NHD else own_layout_cache(backend, w)
    plan = backend.plan(w.batch)
    out = torch.empty_like(w.query)

    def call():
        return backend.forward(w.query, cache, plan, out=out)
    return call


def own_layout_cache(backend, w: Workload) -> torch.Tensor:
    """The workload's keys and values in the cache layout of a backend that owns one
    (`kv_layout` other than NHD), written by its own `write_kv` (outside the timing)."""
    s = w.shape
    cache = torch.zeros(type(backend).kv_cache_shape(w.cache.shape[0], s.cache_spec()), dtype=s.dtype,
                        device=w.cache.device)
    table = w.batch.block_table.long()
    pos = torch.arange(s.seq_len, device=table.device)
    slots = (table[:, pos // s.block_size] * s.block_size + pos % s.block_size).flatten()
    keys, values = (x.transpose(1, 2).reshape(-1, s.num_kv_heads, s.head_size) for x in (w.keys, w.values))
    backend.write_kv(keys, values, cache, slots)
    return cache


def candidates(shape: Shape, device: str) -> list:
    """pytest params: every registered backend, skipped with its reason when it cannot run."""
    params = [pytest.param(BASELINE, id=BASELINE)]
    for registration in registry().implementations(ATTENTION_BACKEND):
        cls = registration.cls
        why = skip_reason(cls, shape, device)
        marks = [pytest.mark.skip(reason=why)] if why else []
        params.append(pytest.param(registration.name, id=registration.name, marks=marks))
    return params


def skip_reason(cls, shape: Shape, device: str) -> str | None:
    availability = cls.availability()
    if not availability.ok:
        return f"unavailable: {availability.reason}"
    if cls.kv_layout != NHD and shape.kv_cache_dtype != "auto":
        return f"uses KV layout {cls.kv_layout}; this benchmark builds quantized caches in {NHD} only"
    if getattr(cls, "conformance_grid", "full") == "reduced":
        return "runs under an interpreter on this machine; its timings would measure the interpreter"
    spec = shape.cache_spec()
    layer = AttentionLayerSpec(shape.num_heads, shape.num_kv_heads, shape.head_size)
    reasons = cls.unsupported_reasons(attention_request([layer], device, shape.dtype, block_size=shape.block_size,
                                                        kv_storage_dtype=spec.storage_dtype if spec.quantized else None))
    return "; ".join(reasons) or None


def make_call(name: str, w: Workload, device: str):
    if name == BASELINE:
        return contiguous_call(w)
    return backend_call(registry().get(ATTENTION_BACKEND, name).cls, w, device)


def synchronized(call, device: str):
    if device != "cuda":
        return call

    def run():
        result = call()
        torch.cuda.synchronize()
        return result
    return run


# The table


def table(times: dict[tuple[str, str], float], device: str) -> list[str]:
    """Rows of `shape  backend  time  GB/s  ratio` from median seconds keyed by (shape, backend)."""
    lines = [f"{'shape':<26} {'backend':<18} {'time (ms)':>10} {'GB/s':>8} {'vs contiguous':>14}"]
    for shape in shapes(device) + kv_dtype_shapes(device):
        base = times.get((shape.name, BASELINE))
        for (shape_name, name), seconds in sorted(times.items(), key=lambda kv: kv[1]):
            if shape_name != shape.name:
                continue
            ratio = f"{seconds / base:.2f}x" if base else "-"
            lines.append(f"{shape.name:<26} {name:<18} {seconds * 1e3:>10.3f} {shape.kv_bytes() / seconds / 1e9:>8.2f} "
                         f"{ratio:>14}")
    return lines


RESULTS: dict[tuple[str, str], float] = {}


@pytest.fixture(scope="module", autouse=True)
def print_table(request):
    yield
    if not RESULTS:
        return
    capture = request.config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled():  # teardown output is captured otherwise
        print(f"\n\nattention on {device_here()} (paging overhead = time / contiguous SDPA on the same data):")
        print("\n".join(table(RESULTS, device_here())))


def bench(benchmark, shape: Shape, name: str):
    device = device_here()
    call = synchronized(make_call(name, workload(shape, device), device), device)
    call()  # warm up (JIT builds, autotuning, first-touch allocation)
    benchmark.extra_info.update(shape=shape.name, kv_bytes=shape.kv_bytes())
    benchmark.pedantic(call, rounds=10, iterations=1, warmup_rounds=1)
    median = benchmark.stats.stats.median
    RESULTS[(shape.name, name)] = median
    benchmark.extra_info["GB_per_s"] = shape.kv_bytes() / median / 1e9


DECODE, PREFILL = shapes(device_here())


@pytest.mark.parametrize("name", candidates(DECODE, device_here()))
def test_decode(benchmark, name):
    bench(benchmark, DECODE, name)


@pytest.mark.parametrize("name", candidates(PREFILL, device_here()))
def test_prefill(benchmark, name):
    bench(benchmark, PREFILL, name)


@pytest.mark.parametrize("shape,name", [
    pytest.param(shape, param.values[0], marks=param.marks, id=f"{shape.name}-{param.id}")
    for shape in kv_dtype_shapes(device_here()) for param in candidates(shape, device_here())])
def test_decode_kv_dtypes(benchmark, shape, name):
    bench(benchmark, shape, name)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=20, help="timed calls per row (median reported)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--kv-dtypes", action="store_true",
                        help="the decodes over every KV-cache dtype instead of the decode and prefill shapes")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="cpu: on-CPU time of this thread (time.thread_time; with --threads 1), which leaves "
                             "out the time a shared machine gives other processes; pytest: --benchmark-timer")
    parser.add_argument("--backend", action="append", default=None, metavar="NAME",
                        help=f"only this backend (repeatable; {BASELINE!r} is the unpaged floor); default: all")
    parser.add_argument("--block-size", type=int, default=None, metavar="N",
                        help="run every shape with this KV block size instead of its own (16)")
    parser.add_argument("--dtype", choices=sorted(FLOAT_DTYPES), default=None,
                        help="run the decode and prefill shapes in this dtype instead of float32 (CPU) or bfloat16 (CUDA)")
    args = parser.parse_args(argv)
    if args.block_size is not None and args.block_size < 1:
        parser.error(f"--block-size must be a positive number of tokens, got {args.block_size}")
    if args.dtype is not None and args.kv_dtypes:
        parser.error("--dtype sets the decode and prefill shapes' dtype; the --kv-dtypes rows each name their own")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.clock == "cpu" and (device_here() != "cpu" or torch.get_num_threads() > 1):
        parser.error("--clock cpu times only the calling thread: use it on the CPU with --threads 1")
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    device, times = device_here(), {}
    known = [BASELINE] + [r.name for r in registry().implementations(ATTENTION_BACKEND)]
    unknown = sorted(set(args.backend or ()) - set(known))
    if unknown:
        parser.error(f"unknown backend(s) {unknown}; valid: {known}")
    for shape in kv_dtype_shapes(device) if args.kv_dtypes else shapes(device):
        if args.block_size is not None:
            shape = dataclasses.replace(shape, block_size=args.block_size)
        if args.dtype is not None:
            shape = dataclasses.replace(shape, dtype=FLOAT_DTYPES[args.dtype])
        w = workload(shape, device)
        for name in [n for n in known if args.backend is None or n in args.backend]:
            if name != BASELINE and (why := skip_reason(registry().get(ATTENTION_BACKEND, name).cls,
                                                      shape, device)):
                print(f"skip {name} ({shape.name}): {why}")
                continue
            call = synchronized(make_call(name, w, device), device)
            call()
            samples = []
            for _ in range(args.repeat):
                start = clock()
                call()
                samples.append(clock() - start)
            times[(shape.name, name)] = statistics.median(samples)
        del w  # the larger shapes hold hundreds of MB
    print("\n".join(table(times, device)))


if __name__ == "__main__":
    main()
