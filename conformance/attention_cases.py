"""Random ragged batches over a paged cache, and the float64 oracle, for the
`attention_backend` checks.

Every case is built fresh from a random seed (`KVFORGE_CONFORMANCE_SEED` pins it
to reproduce a failure; every failure message names it). Physical blocks are a
random permutation, a few (block 0, which block-table padding names, always among
them) are never referenced and hold NaN, so a backend that reads them produces NaN. Slots past a sequence's end inside its last block hold
finite garbage, as a reused cache does. Output buffers start as NaN, so an
element the backend never writes is caught.

The oracle is the `reference` backend, found through an unfiltered registry and
run on the CPU in float64 over the same values the backend sees (inputs are
rounded to the backend's dtype first, so only the backend's arithmetic is judged).
A case may carry a KV `quantizer`: the backend's cache is then quantized (its
never-referenced blocks hold NaN scales) and the oracle reads the dequantized
keys and values, `data * scale`, exactly as the backend should.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import random
from dataclasses import dataclass

import pytest
import torch

from kvforge.core import (
    ATTENTION_BACKEND,
    FLOAT_DTYPES,
    AttentionBatch,
    AttentionLayerSpec,
    KVCacheSpec,
    Quantizer,
    Registration,
    Registry,
    attention_request,
    cdiv,
    dtype_name,
    kv_cache_request,
    quantized_kv_views,
)

from . import selection
from .attention_quick_grid import quick_lengths
from .selection import quick

SEED_ENV = "KVFORGE_CONFORMANCE_SEED"
TOLERANCES = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2, torch.float64: 1e-10}
DTYPES = tuple(FLOAT_DTYPES.values())
HEAD_SIZES = (64, 80, 96, 128, 256)  # 256 only where declared
QUERIES_PER_KV = (1, 4, 8)
BLOCK_SIZES = (1, 8, 16, 32)
NUM_KV_HEADS = 2
KINDS = ("decode", "long", "prefill", "aligned", "unaligned", "mixed", "chunked")
REDUCED_KINDS = ("decode", "prefill", "mixed")


# Which backend, where, how much of the grid


@dataclass(frozen=True)
class Target:
    """A backend class under test, the device it runs on, and whether it gets the reduced grid."""

    cls: type
    device: str
    reduced: bool

    @property
    def name(self) -> str:
        return self.cls.name

    def block_sizes(self) -> list[int]:
        declared = [b for b in BLOCK_SIZES if self.cls.block_sizes is None or b in self.cls.block_sizes]
        if self.reduced:  # one block size, preferring 16, where blocks are neither tiny nor huge
            return sorted(declared, key=lambda b: abs(b - 16))[:1]
        return declared

    def head_sizes(self) -> list[int]:
        sizes = [h for h in HEAD_SIZES if h != 256 or (self.cls.head_sizes is not None and 256 in self.cls.head_sizes)]
        sizes = [h for h in sizes if self.cls.head_sizes is None or h in self.cls.head_sizes]
        return sizes[:1] if self.reduced else sizes

    def dtypes(self) -> list[torch.dtype]:
        return [d for d in DTYPES if d in self.cls.dtypes]

    def reasons(self, layer: AttentionLayerSpec, block_size: int, dtype: torch.dtype,
                quantizer: Quantizer | None = None) -> list[str]:
        """Why the backend refuses `layer` over a KV cache quantized by `quantizer` (None: float)."""
        return self.cls.unsupported_reasons(attention_request([layer], self.device, dtype, block_size=block_size,
                                                              **kv_cache_request(quantizer)))


def target(registration: Registration) -> Target:
    """The backend under test, or a pytest skip naming why it cannot run here."""
    availability = registration.availability()
    if not availability.ok:
        pytest.skip(f"unavailable: {availability.reason}")
    devices = registration.cls.devices
    asked = selection.device()
    if asked is not None:
        problem = selection.device_problem(asked)
        if problem:
            pytest.fail(problem, pytrace=False)
        if asked not in devices:
            pytest.skip(f"declares devices {sorted(devices)}, not {asked!r}, the device this run checks on")
        device = asked
    elif torch.cuda.is_available() and "cuda" in devices:
        device = "cuda"
    elif "cpu" in devices:
        device = "cpu"
    else:
        pytest.skip(f"declares devices {sorted(devices)}; none is present here")
    reduced = quick() or getattr(registration.cls, "conformance_grid", "full") == "reduced"
    tgt = Target(registration.cls, device, reduced)
    for axis, grid_values in (("dtypes", DTYPES), ("head sizes", HEAD_SIZES), ("block sizes", BLOCK_SIZES)):
        if not getattr(tgt, axis.replace(" ", "_"))():
            pytest.skip(f"declares none of the {axis} the grid tests ({', '.join(map(str, grid_values))})")
    return tgt


@pytest.fixture
def one_thread():
    """Run a check with one intra-op thread and restore the setting after. The grid's
    tensors are tiny: on a shared CPU, waking a thread pool per op costs far more
    than the arithmetic."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def fresh_seed() -> int:
    pinned = os.environ.get(SEED_ENV)
    return int(pinned) if pinned else random.SystemRandom().randrange(2**31)


# Batches


def batch_lengths(kind: str, block_size: int, rng: random.Random, reduced: bool = False) -> list[tuple[int, int]]:
    """(context_len, query_len) of each sequence of a batch of `kind`."""
    if reduced:  # fixed shapes, each where a wrong backend shows (attention_quick_grid's table)
        return quick_lengths(kind, block_size)
    r = rng.randint
    if kind == "decode":
        return [(r(1, 48), 1) for _ in range(5)]
    if kind == "long":
        return [(r(300, 420), rng.choice([1, 6]))]
    if kind == "prefill":
        return [(0, r(1, 24)) for _ in range(4)]
    if kind == "chunked":
        return [(r(1, 40), r(2, 16)) for _ in range(3)]
    if kind == "mixed":
        seqs = [(0, r(2, 20)), (0, r(2, 20)), (r(1, 40), 1), (r(1, 40), 1), (r(1, 40), 1), (r(1, 30), r(2, 12))]
        rng.shuffle(seqs)
        return seqs
    if kind == "aligned":  # context and sequence lengths both whole blocks
        seqs = []
        for _ in range(3):
            before = r(0, 2) * block_size
            seqs.append((before, r(1, 2) * block_size))
        return seqs
    if kind == "unaligned":  # no sequence ends on a block boundary (unless blocks hold one token)
        seqs = []
        while len(seqs) < 3:
            context, new = r(0, 40), r(1, 12)
            if block_size == 1 or (context + new) % block_size:
                seqs.append((context, new))
        return seqs
    raise ValueError(f"unknown batch kind {kind!r}; valid kinds: {', '.join(KINDS)}")


@dataclass
class Case:
    """One step's inputs. Values are float64, already rounded to `dtype`."""

    label: str
    layer: AttentionLayerSpec
    dtype: torch.dtype
    block_size: int
    num_blocks: int
    unused_blocks: torch.Tensor  # physical blocks no sequence references
    batch: AttentionBatch  # CPU tensors
    query: torch.Tensor  # [T, heads, d]
    new_keys: torch.Tensor  # [T, kv_heads, d], written by the step
    new_values: torch.Tensor
    context_keys: torch.Tensor  # [C, kv_heads, d], already cached before the step
    context_values: torch.Tensor
    context_slots: torch.Tensor  # [C]
    garbage: torch.Tensor  # the whole NHD cache before anything is written (finite; unused blocks NaN)
    quantizer: Quantizer | None = None  # the KV cache's (a KV-capable quantizer), None for a float cache
    kv_scales: tuple[float, float] | None = None  # a static-scale quantizer's (key, value) scales for the layer

    def cache_spec(self) -> KVCacheSpec:
        return KVCacheSpec(self.block_size, self.layer.num_kv_heads, self.layer.head_size, self.dtype,
                           quantizer=self.quantizer, kv_scales=self.kv_scales)

    def stored(self, x: torch.Tensor, index: int) -> torch.Tensor:
        """What the cache gives back for keys (`index` 0) or values (1) `x` (float64): `x`
        itself, or for a quantized cache its quantizer's `data * scale` (float32, as
        backends compute it)."""
        if self.quantizer is None:
            return x
        q = self.cache_spec().key_value_quantizers[index].quantize(x.to(self.dtype))
        return (q.data.to(torch.float32) * q.scale).to(torch.float64)


def make_layer(head_size: int, queries_per_kv: int, *, num_kv_heads: int = NUM_KV_HEADS, sliding_window=None,
               soft_cap=None, alibi: bool = False) -> AttentionLayerSpec:
    heads = num_kv_heads * queries_per_kv
    slopes = tuple(2.0 ** (-8.0 * (h + 1) / heads) for h in range(heads)) if alibi else None
    return AttentionLayerSpec(heads, num_kv_heads, head_size, sliding_window=sliding_window,
                              logit_soft_cap=soft_cap, alibi_slopes=slopes)


def make_case(kind: str, layer: AttentionLayerSpec, block_size: int, dtype: torch.dtype, seed: int,
              reduced: bool = False, lengths: list[tuple[int, int]] | None = None) -> Case:
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    lengths = lengths or batch_lengths(kind, block_size, rng, reduced)
    contexts = [c for c, _ in lengths]
    queries = [q for _, q in lengths]
    seq_lens = [c + q for c, q in lengths]
    blocks_per_seq = [cdiv(s, block_size) for s in seq_lens]
    used = sum(blocks_per_seq)
    num_blocks = used + rng.randint(2, 5)
    # Block 0 is never referenced: block-table padding is 0, so a backend that reads
    # padding entries always meets NaN (and engines often reserve block 0 anyway).
    physical = torch.cat([torch.randperm(num_blocks - 1, generator=gen)[:used] + 1,
                          torch.zeros(1, dtype=torch.long)])
    physical = torch.cat([physical, torch.tensor(sorted(set(range(num_blocks)) - set(physical.tolist())),
                                                 dtype=torch.long)])
    table = torch.zeros(len(lengths), max(blocks_per_seq), dtype=torch.int32)
    start = 0
    for b, n in enumerate(blocks_per_seq):
        table[b, :n] = physical[start:start + n].to(torch.int32)
        start += n
    unused = physical[used:].sort().values

    def slots(b: int, first: int, last: int) -> torch.Tensor:
        pos = torch.arange(first, last)
        return table[b, pos // block_size].long() * block_size + pos % block_size

    new_slots = torch.cat([slots(b, c, c + q) for b, (c, q) in enumerate(lengths)])
    context_slots = torch.cat([slots(b, 0, c) for b, (c, _) in enumerate(lengths)])
    kv_heads, heads, d = layer.num_kv_heads, layer.num_heads, layer.head_size

    def values(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype).to(torch.float64)

    tokens, cached = sum(queries), sum(contexts)
    garbage = values(num_blocks, 2, block_size, kv_heads, d)
    garbage[unused] = float("nan")
    query_start = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    query_start[1:] = torch.tensor(queries).cumsum(0)
    batch = AttentionBatch(
        query_start_loc=query_start,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        context_lens=torch.tensor(contexts, dtype=torch.int32),
        block_table=table,
        slot_mapping=new_slots,
        block_size=block_size,
        max_query_len=max(queries),
        max_seq_len=max(seq_lens),
    )
    label = (f"{kind} batch (context, new)={lengths} head_size={d} heads={heads}/{kv_heads} block_size={block_size} "
             f"dtype={dtype_name(dtype)} features={sorted(layer.required_features())} seed={seed}")
    return Case(label, layer, dtype, block_size, num_blocks, unused, batch, values(tokens, heads, d),
                values(tokens, kv_heads, d), values(tokens, kv_heads, d), values(cached, kv_heads, d),
                values(cached, kv_heads, d), context_slots, garbage)


def batch_to(batch: AttentionBatch, device: str) -> AttentionBatch:
    moved = {name: getattr(batch, name).to(device) for name in
             ("query_start_loc", "seq_lens", "context_lens", "block_table", "slot_mapping")}
    return AttentionBatch(**moved, block_size=batch.block_size, max_query_len=batch.max_query_len,
                          max_seq_len=batch.max_seq_len)


def scatter(cache: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor) -> None:
    """Put tokens into an NHD cache by slot: the checks' own, independent cache write."""
    block_size = cache.shape[2]
    keep = slots >= 0
    blocks, offsets = slots[keep] // block_size, slots[keep] % block_size
    cache[blocks, 0, offsets] = keys[keep].to(cache.dtype)
    cache[blocks, 1, offsets] = values[keep].to(cache.dtype)


# Running a backend and the oracle


@functools.lru_cache(maxsize=1)
def oracle_class() -> type:
    # Unfiltered, so KVFORGE_PLUGINS narrowing the backends under test never hides the oracle.
    return Registry().load_entry_points().get(ATTENTION_BACKEND, "reference").cls


def oracle(case: Case) -> torch.Tensor:
    """The exact answer: `reference` in float64 on the CPU, `[T, heads, d]`."""
    spec = KVCacheSpec(case.block_size, case.layer.num_kv_heads, case.layer.head_size, torch.float64)
    backend = oracle_class()(case.layer, spec, "cpu")
    cache = case.garbage.clone()
    scatter(cache, case.stored(case.context_keys, 0), case.stored(case.context_values, 1), case.context_slots)
    scatter(cache, case.stored(case.new_keys, 0), case.stored(case.new_values, 1), case.batch.slot_mapping)
    return backend.forward(case.query, cache, backend.plan(case.batch))


def prepared_cache(backend, case: Case, device: str) -> torch.Tensor:
    """The backend's own cache holding garbage and the context (written by its `write_kv`);
    never-referenced blocks hold NaN whatever the layout (block is always dim 0)."""
    spec = case.cache_spec()
    shape = type(backend).kv_cache_shape(case.num_blocks, spec)
    gen = torch.Generator().manual_seed(case.num_blocks)
    if spec.quantized:  # finite quantized garbage; all-ones bytes are NaN scales (and NaN fp8 data)
        cache = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
        data, scales = quantized_kv_views(cache, spec)
        garbage = case.garbage.nan_to_num(0.0).to(case.dtype)
        for index, quantizer in enumerate(spec.key_value_quantizers):  # keys, values
            q = quantizer.quantize(garbage[:, index])
            data[:, index].copy_(q.data)
            scales[:, index].copy_(q.scale.squeeze(-1))  # per token: one per slot; static: the constant
        cache[case.unused_blocks] = 255
    else:
        cache = torch.randn(shape, generator=gen).to(case.dtype)
        cache[case.unused_blocks] = float("nan")
    cache = cache.to(device)
    backend.write_kv(case.context_keys.to(device, case.dtype), case.context_values.to(device, case.dtype), cache,
                     case.context_slots.to(device))
    return cache


def run_step(backend, case: Case, device: str, plan=None, cache: torch.Tensor | None = None) -> torch.Tensor:
    """One layer of one step as an engine runs it: write this step's keys, then attend
    into a NaN-poisoned output buffer. Returns the output on the CPU. `cache`: one from
    `prepared_cache`, for a caller that reads it afterwards (default: a fresh one)."""
    if cache is None:
        cache = prepared_cache(backend, case, device)
    batch = batch_to(case.batch, device)
    backend.write_kv(case.new_keys.to(device, case.dtype), case.new_values.to(device, case.dtype), cache,
                     batch.slot_mapping)
    if plan is None:
        plan = backend.plan(batch)
    query = case.query.to(device, case.dtype)
    out = torch.full_like(query, float("nan"))
    returned = backend.forward(query, cache, plan, out=out)
    assert returned is out, f"{case.label}: forward(out=...) must write into `out` and return it"
    return out.cpu()


def mismatch(out: torch.Tensor, expected: torch.Tensor, case: Case) -> str | None:
    """Why `out` is not an acceptable answer for `case`, or None."""
    if out.shape != expected.shape or out.dtype != case.dtype:
        return f"{case.label}: output {tuple(out.shape)} {out.dtype}, expected {tuple(expected.shape)} {case.dtype}"
    bad = ~torch.isfinite(out)
    if bad.any():
        rows = bad.flatten(1).any(1).nonzero().flatten().tolist()
        return f"{case.label}: {int(bad.sum())} output elements not written or not finite (token rows {rows[:8]})"
    error = relative_error(out, expected)
    tolerance = TOLERANCES[case.dtype]
    if not error <= tolerance:
        return f"{case.label}: relative error {error:.3g} > {tolerance:g}"
    return None


def relative_error(out: torch.Tensor, expected: torch.Tensor) -> float:
    expected = expected.to(torch.float64)
    return float(torch.linalg.vector_norm(out.to(torch.float64) - expected) / torch.linalg.vector_norm(expected))


def check_case(tgt: Target, case: Case) -> str | None:
    """Build the backend for `case` and judge one step; a configuration the backend
    declares unsupported must instead be refused by its constructor."""
    from kvforge.core import UnsupportedConfigurationError

    spec = case.cache_spec()
    reasons = tgt.reasons(case.layer, case.block_size, case.dtype, spec.quantizer)
    if reasons:
        try:
            tgt.cls(case.layer, case.cache_spec(), tgt.device)
        except UnsupportedConfigurationError:
            return None
        return f"{case.label}: declared unsupported ({'; '.join(reasons)}) but the constructor accepted it"
    backend = tgt.cls(case.layer, case.cache_spec(), tgt.device)
    return mismatch(run_step(backend, case, tgt.device), oracle(case), case)


def report(problems: list[str | None]) -> None:
    """Fail once with every problem found, so one run shows the whole pattern."""
    problems = [p for p in problems if p]
    assert not problems, f"{len(problems)} failing case(s):\n" + "\n".join(problems[:20])


def grid(tgt: Target, kind: str, dtype: torch.dtype) -> list[Case]:
    """Cases of one batch kind and dtype: every declared block size × every head size,
    the query/KV head ratio rotating through 1, 4, 8 (all pairs of head size and
    ratio are covered by the mixed group's head-ratio check)."""
    seed = fresh_seed()
    cases = []
    for i, block_size in enumerate(tgt.block_sizes()):
        for j, head_size in enumerate(tgt.head_sizes()):
            ratio = 4 if tgt.reduced else QUERIES_PER_KV[(i + j) % len(QUERIES_PER_KV)]
            layer = make_layer(head_size, ratio)
            cases.append(make_case(kind, layer, block_size, dtype, seed + len(cases), tgt.reduced))
    return cases


def skip_if_reduced(tgt: Target, kind: str) -> None:
    if tgt.reduced and kind not in REDUCED_KINDS:
        pytest.skip(f"reduced grid for {tgt.name}: batch kinds {', '.join(REDUCED_KINDS)} only")


def another_layer(case: Case, seed: int) -> Case:
    """The same step (same batch and block table) for another layer: fresh values."""
    gen = torch.Generator().manual_seed(seed)

    def like(t: torch.Tensor) -> torch.Tensor:
        return torch.randn(t.shape, generator=gen, dtype=torch.float64).to(case.dtype).to(torch.float64)

    return dataclasses.replace(case, label=f"{case.label} (layer 2, seed {seed})", query=like(case.query),
                               new_keys=like(case.new_keys), new_values=like(case.new_values),
                               context_keys=like(case.context_keys), context_values=like(case.context_values))
