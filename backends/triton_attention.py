"""The `triton` attention backend: Triton kernels over the NHD paged cache.

One launch covers the whole ragged batch (prefill chunks with context and
decodes alike); the kernel reads the block table itself, packs the query heads
that share a KV head into one tile (GQA), and splits long decodes over the keys
(a second kernel merges the splits). Kernels: `kvforge.backends.triton_kernels`.

A quantized KV cache (int8, fp8 e4m3, fp8 e5m2 with per-(token, KV head)
scales, `kvforge.core.quantized_kv_views`) is read in place: the kernel loads
the stored bytes and the scales and dequantizes each tile in registers. Its
`write_kv` is the interface's default (the quantizer in PyTorch, then a scatter).

Runs on CUDA. On a CPU-only machine it is available only under
`TRITON_INTERPRET=1` (set before triton is first imported), where Triton's
interpreter runs the same kernels, slowly: the conformance suite then runs
its reduced grid (`conformance_grid = "reduced"`).
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

import torch

from kvforge.core import (
    ALIBI,
    LOGIT_SOFT_CAP,
    SLIDING_WINDOW,
    AttentionBackend,
    AttentionBatch,
    Availability,
    KVCacheSpec,
    SelectionRequest,
    UnsupportedConfigurationError,
    cdiv,
    dtype_name,
    hookimpl,
    quantized_kv_views,
)

INTERPRET_ENV = "TRITON_INTERPRET"


def interpreting() -> bool:
    return os.environ.get(INTERPRET_ENV, "") == "1"


def next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


@dataclass(frozen=True)
class TritonPlan:
    """The launch layout of one step, shared by every layer (never modified by `forward`).

    Query tile `i` is up to `block_q` new tokens of sequence `tile_seq[i]` (-1: no
    work; the tile count is an upper bound, so planning needs no device sync),
    starting at that sequence's token `tile_start[i]`. `num_splits > 1` splits
    each tile's keys into slices of `split_len` tokens.
    """

    batch: AttentionBatch
    tile_seq: torch.Tensor
    tile_start: torch.Tensor
    block_q: int
    block_n: int
    num_splits: int
    split_len: int


class TritonAttentionBackend(AttentionBackend):
    """Paged attention in Triton: ragged batch, in-kernel block table, GQA packing, split-KV."""

    name = "triton"
    # Under the interpreter `auto` should pick any real CPU kernel first (only `reference` is slower).
    priority = -90 if interpreting() else 30
    devices = frozenset({"cuda", "cpu"})  # cpu only under TRITON_INTERPRET=1; see unsupported_reasons
    dtypes = frozenset({torch.float32, torch.float16, torch.bfloat16})
    # Read as bytes and decoded in the kernel, so every GPU and the interpreter take the same path.
    quantized_kv_dtypes = frozenset({torch.int8, torch.float8_e4m3fn, torch.float8_e5m2})
    head_sizes = frozenset({32, 64, 80, 96, 128, 256})
    features = frozenset({SLIDING_WINDOW, LOGIT_SOFT_CAP, ALIBI})
    # The interpreter takes about a second per launch: the shared suite runs a subset.
    conformance_grid = "reduced" if interpreting() else "full"

    # Split-KV policy (instance attributes may be changed, e.g. by tests):
    # split a tile's keys when the batch is decode-like and the grid would
    # otherwise leave the device idle, never into slices shorter than this.
    split_min_len = 256
    max_splits = 64
    # Launch choices, None: the heuristics in plan() and forward(). Set on an instance to
    # tune (benchmarks/triton_sweep.py measures them on a GPU).
    query_rows: int | None = None  # rows (tokens x packed query heads) of a prefill tile
    block_n: int | None = None  # keys per tile
    num_warps: int | None = None
    num_stages: int | None = None  # software-pipelining depth of the key loop
    native_fp8: bool | None = None  # fp8 codes converted by the hardware (None: where it has them, 8.9+)

    @classmethod
    def availability(cls) -> Availability:
        if importlib.util.find_spec("triton") is None:
            return Availability.no("triton not installed (pip install 'kvforge[triton]')")
        if torch.cuda.is_available() or interpreting():
            return Availability.yes()
        return Availability.no(f"on CPU needs {INTERPRET_ENV}=1 (no CUDA device; the interpreter is slow)")

    @classmethod
    def unsupported_reasons(cls, request: SelectionRequest) -> list[str]:
        reasons = super().unsupported_reasons(request)
        if request.device == "cpu" and not interpreting():
            reasons.append(f"on CPU needs {INTERPRET_ENV}=1 (Triton's interpreter)")
        return reasons

    def __init__(self, layer, cache, device="cpu"):
        super().__init__(layer, cache, device)
        from . import triton_kernels  # imports triton: only once a backend is built

        self.kernels = triton_kernels
        self.interpret = interpreting()
        qpk = layer.queries_per_kv
        self.qpk_pad = next_power_of_2(qpk)
        self.head_pad = max(next_power_of_2(layer.head_size), 16)
        alibi = layer.alibi_slopes if layer.alibi_slopes is not None else (0.0,)
        self.alibi = torch.tensor(alibi, dtype=torch.float32, device=self.device)
        if self.device.type == "cuda":
            self.num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count
            self.has_fp8 = torch.cuda.get_device_capability(self.device) >= (8, 9)
        else:
            self.num_sms, self.has_fp8 = 1, False

    def plan(self, batch: AttentionBatch) -> TritonPlan:
        # tl.dot needs at least 16 rows: a tile packs block_q tokens x qpk_pad heads.
        rows = 16 if batch.max_query_len <= 16 // self.qpk_pad or self.interpret else (self.query_rows or 64)
        block_q = max(rows // self.qpk_pad, 1)
        # Key tiles: 64 keys of 16-bit heads up to 128 wide; otherwise 32, to bound shared memory.
        wide = self.head_pad > 128 or self.cache.dtype == torch.float32
        block_n = self.block_n or (32 if self.interpret or wide else 64)
        query_lens = batch.query_lens()
        tiles_per_seq = (query_lens + block_q - 1) // block_q
        tile_end = torch.cumsum(tiles_per_seq, 0)
        num_tiles = cdiv(batch.num_tokens, block_q) + batch.num_seqs  # an upper bound, known on the host
        index = torch.arange(num_tiles, device=query_lens.device)
        tile_seq = torch.searchsorted(tile_end, index, right=True)
        real = tile_seq < batch.num_seqs
        first_tile = (tile_end - tiles_per_seq)[tile_seq.clamp(max=max(batch.num_seqs - 1, 0))]
        tile_start = ((index - first_tile) * block_q).to(torch.int32)
        tile_seq = torch.where(real, tile_seq, -1).to(torch.int32)
        num_splits, split_len = self.splits(batch, num_tiles, block_q, block_n)
        return TritonPlan(batch, tile_seq, tile_start, block_q, block_n, num_splits, split_len)

    def splits(self, batch: AttentionBatch, num_tiles: int, block_q: int, block_n: int) -> tuple[int, int]:
        """(number of KV splits, keys per split): split only decode-like batches
        whose grid of tiles x KV heads would not fill the device twice over."""
        programs = num_tiles * self.cache.num_kv_heads
        wanted = cdiv(2 * self.num_sms, max(programs, 1))
        by_length = batch.max_seq_len // self.split_min_len
        num_splits = min(wanted, by_length, self.max_splits)
        if batch.max_query_len > block_q or num_splits <= 1:
            return 1, batch.max_seq_len
        split_len = cdiv(batch.max_seq_len, num_splits)
        split_len = cdiv(split_len, block_n) * block_n
        return cdiv(batch.max_seq_len, split_len), split_len

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        num_tokens, num_kv_heads, head_size = key.shape
        if num_tokens == 0:
            return
        check_cache(kv_cache, self.cache)
        if self.cache.quantized:
            super().write_kv(key, value, kv_cache, slot_mapping)
            return
        key, value = dense_rows(key), dense_rows(value)
        self.kernels.write_kv_kernel[(num_tokens,)](
            key, value, kv_cache, slot_mapping,
            key.stride(0), key.stride(1), value.stride(0), value.stride(1),
            kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
            NUM_KV_HEADS=num_kv_heads, HEAD_SIZE=head_size, HEADS_PAD=next_power_of_2(num_kv_heads),
            HEAD_PAD=self.head_pad, PAGE=kv_cache.shape[2],
        )

    def forward(self, query: torch.Tensor, kv_cache: torch.Tensor, plan: TritonPlan,
                out: torch.Tensor | None = None) -> torch.Tensor:
        if out is None:
            out = torch.empty_like(query)
        num_tokens, num_heads, head_size = query.shape
        if num_tokens == 0:
            return out
        check_cache(kv_cache, self.cache)
        if out.stride(2) != 1:  # the kernel writes rows of head_size contiguous elements
            out.copy_(self.forward(query, kv_cache, plan))
            return out
        query = dense_rows(query)
        layer, batch = self.layer, plan.batch
        split = plan.num_splits > 1
        if split:
            part_acc = torch.empty(plan.num_splits, num_tokens, num_heads, self.head_pad,
                                   dtype=torch.float32, device=query.device)
            part_ml = torch.empty(plan.num_splits, num_tokens, num_heads, 2, dtype=torch.float32, device=query.device)
        else:
            part_acc = part_ml = out  # never touched when not splitting
        data, scales, kv_format = self.stored_kv(kv_cache)
        grid = (plan.tile_seq.shape[0], layer.num_kv_heads, plan.num_splits)
        self.kernels.paged_attention_kernel[grid](
            query, data, scales, out, part_acc, part_ml,
            batch.block_table, batch.context_lens, batch.query_start_loc,
            plan.tile_seq, plan.tile_start, self.alibi,
            layer.softmax_scale, float(layer.logit_soft_cap or 0.0), int(layer.sliding_window or 0),
            plan.split_len, num_tokens, num_heads,
            query.stride(0), query.stride(1), out.stride(0), out.stride(1),
            *data.stride()[:4], *scales.stride()[:4], batch.block_table.stride(0),
            HEAD_SIZE=head_size, HEAD_PAD=self.head_pad, QPK=layer.queries_per_kv, QPK_PAD=self.qpk_pad,
            BLOCK_Q=plan.block_q, BLOCK_N=plan.block_n, PAGE=data.shape[2],
            USE_SOFT_CAP=layer.logit_soft_cap is not None, USE_WINDOW=layer.sliding_window is not None,
            USE_ALIBI=layer.alibi_slopes is not None, SPLIT=split,
            DOT_FP32=self.interpret or query.dtype == torch.float32, KV_FORMAT=kv_format,
            NATIVE_FP8=self.has_fp8 if self.native_fp8 is None else self.native_fp8,
            **self.launch_options(plan),
        )
        if split:
            self.kernels.reduce_splits_kernel[(num_tokens, num_heads)](
                part_acc, part_ml, out, plan.num_splits, num_tokens, num_heads, out.stride(0), out.stride(1),
                HEAD_SIZE=head_size, HEAD_PAD=self.head_pad, SPLITS_PAD=next_power_of_2(plan.num_splits),
            )
        return out

    def launch_options(self, plan: TritonPlan) -> dict[str, int]:
        """num_warps and num_stages of the attention kernel's launch: 4 warps, and for
        16-bit prefill tiles a 2-deep pipeline, the fastest the H200 sweep measured
        (docs/gpu_backends.md); Triton's default depth elsewhere."""
        options = {"num_warps": self.num_warps or 4}
        prefill_tile = plan.block_q * self.qpk_pad > 16
        if self.num_stages is not None:
            options["num_stages"] = self.num_stages
        elif prefill_tile and self.cache.dtype != torch.float32 and not self.interpret:
            options["num_stages"] = 2
        return options

    def stored_kv(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(data, scales, KV_FORMAT) as the attention kernel reads them: a quantized cache's
        NHD data viewed as bytes and its float32 scales (views, no copy), or the float
        cache itself with no scales (the kernel then never touches that argument)."""
        if not self.cache.quantized:
            return kv_cache, kv_cache, self.kernels.FLOAT_KV.value
        data, scales = quantized_kv_views(kv_cache, self.cache)
        return data.view(torch.uint8), scales, self.kernels.KV_FORMAT_OF_STORAGE[self.cache.storage_dtype]


def dense_rows(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` with its last dimension contiguous (the kernels index it with stride 1)."""
    return tensor if tensor.stride(-1) == 1 else tensor.contiguous()


def check_cache(kv_cache: torch.Tensor, spec: KVCacheSpec) -> None:
    if spec.quantized:
        if kv_cache.dim() != 2 or kv_cache.dtype != torch.uint8 or kv_cache.shape[1] != spec.layer_block_bytes() \
                or kv_cache.stride(1) != 1:
            raise UnsupportedConfigurationError(
                f"triton attention reads a KV cache quantized to {dtype_name(spec.storage_dtype)} as one row of "
                f"bytes per block, uint8 [num_blocks, {spec.layer_block_bytes()}] with contiguous rows; got "
                f"{dtype_name(kv_cache.dtype)} shape {tuple(kv_cache.shape)} strides {kv_cache.stride()}: allocate "
                f"it with the shape from kv_cache_shape() and dtype spec.tensor_dtype")
        return
    if kv_cache.dim() != 5 or kv_cache.stride(4) != 1:
        raise UnsupportedConfigurationError(
            f"triton attention reads the NHD cache [num_blocks, 2, block_size, num_kv_heads, head_size] with "
            f"contiguous head_size; got shape {tuple(kv_cache.shape)} strides {kv_cache.stride()}: allocate it "
            f"with the shape from kv_cache_shape()")


@hookimpl
def kvforge_implementations():
    return [TritonAttentionBackend]
