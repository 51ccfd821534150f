// kvforge's linear layers for CPUs, two torch.library custom ops over one tile
// driver and one epilogue:
//
//   kvforge_cpp::bf16_linear(x, packed, out_features, bias=None, epilogue="none",
//                            other=None, float_out=False) -> Tensor
//   kvforge_cpp::f32_linear(x, packed, out_features, bias=None, epilogue="none",
//                           other=None) -> Tensor
//
// bf16_linear: x bfloat16 [rows, in] (rows may be strided); packed bfloat16
// [blocks, pairs, 16, 2]; other bfloat16; y bfloat16, or float32 when float_out
// (logits). f32_linear: x, packed [blocks, in, 16], other and y float32. The
// weight is packed once at load by models/cpp_linear.py (layouts: linear_tile.h);
// bias float32 [blocks * 16] in the packed order, or None. Sums are float32; the
// epilogue then works on them before the one rounding:
//   "none":     y = x W^T + bias
//   "add":      y = x W^T + bias + other        (other [rows, out]: a residual)
//   "silu_mul": y = silu(x G^T + bg) * (x U^T + bu), G and U packed as
//               alternating blocks (gate, up, gate, up, ...): the MLP's two
//               projections as one GEMM, and no pass outside it.
// Register tiles per instruction set and dtype (Path below); chunks
// of rows x channel tiles run in parallel.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "cpu_isa.h"
#include "f32_packed_rows.h"
#include "int8_linear_common.h"

#ifdef KVFORGE_HAS_X86_PATHS
#include <immintrin.h>
#endif

namespace kvforge_cpp {

// What the epilogue adds to the sums, and where it writes (see finish_tile).
struct Epilogue {
  int mode;  // 0: + bias; 1: + bias + other (a residual); 2: silu(gate) * up, blocks interleaved gate, up
  const float* bias;  // [blocks * 16] in the packed order, or nullptr
  const void* other;  // [rows, n] for mode 1, bfloat16 or float32
  bool other_float;
  int64_t other_stride;
  void* y;  // [rows, n], bfloat16 or float32
  bool y_float;
  int64_t y_stride;
  int64_t n;  // output channels
  const float* scale = nullptr;  // [blocks * 16] in the packed order, multiplying the sums first; or nullptr
};

// The largest register tile any path runs: rows x blocks of 16 channels (acc
// buffers are laid out for it; each path picks its own tile within it).
constexpr int kMaxRows = 8;
constexpr int kMaxBlocks = 4;

namespace linear_base {
#include "bf16_vectors.h"
#define KVFORGE_VW_BYTES 16
#include "native_vectors.h"
#include "linear_tile.h"
}  // namespace linear_base

#ifdef KVFORGE_HAS_X86_PATHS
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace linear_avx2 {
#include "bf16_vectors.h"
#define KVFORGE_VW_BYTES 32
#include "native_vectors.h"
#include "linear_tile.h"
}  // namespace linear_avx2
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")
namespace linear_avx512 {
#include "bf16_vectors.h"
#define KVFORGE_VW_BYTES 64
#include "native_vectors.h"
#include "linear_tile.h"
}  // namespace linear_avx512
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,avx2,fma,f16c")
namespace linear_dpbf16 {
#include "bf16_vectors.h"
#define KVFORGE_VW_BYTES 64
#include "native_vectors.h"
#include "linear_tile.h"
#include "bf16_linear_dpbf16.h"
}  // namespace linear_dpbf16
#pragma GCC pop_options
#endif

namespace {

template <typename T>
using TileFn = void (*)(const T*, int64_t, const T*, int64_t, float*, const char*, int64_t);
using FinishFn = void (*)(const float*, int, int, int64_t, int64_t, const Epilogue&);
using WidenFn = void (*)(const uint16_t*, int64_t, int64_t, int64_t, float*);

// A register tile's size: rows x blocks of 16 channels. Blocks must be even:
// silu_mul's interleaved gate and up blocks have to land in one tile. `walk`:
// the tile runs as a walk (f32_walk in linear_tile.h) from its Tiles' `walk`.
// `stream`: the tile's blocks one after another, each block's sums over every
// input before the next block starts (the one-block tile per block), so a row
// tile reads its weights as one stream, front to back, and asks for nothing
// ahead (the next tile's weights follow in memory, where the hardware
// prefetcher is already reading).
struct TileShape {
  int rows, blocks;
  bool walk = false;
  bool stream = false;
};

// One dtype's register tiles on one ISA: at[MR - 1][NB - 1] for tails; `shape`,
// the path's tile; `many`, the tile for more than kMaxRows rows; and `few[m - 1]`,
// the tile for a call of m <= kMaxRows rows (a decode, one verifying drafts, a
// small batch). A tile of fewer rows than a call's reads the channel tile's
// weights once per row tile (the first pass from memory, the others from L2);
// its blocks are the streams it reads them from memory in, and the hardware
// prefetchers bring four side by side faster than two (docs/models.md,
// "Four-block tiles for a decode"). With KVFORGE_WIDE_TILES=off every call
// takes `shape` (wide_tiles_on). `walk`: the walks of a path whose `few` has
// any (else null), indexed as `at`.
template <typename T>
struct Tiles {
  TileFn<T> at[kMaxRows][kMaxBlocks];
  TileShape shape;
  TileShape many;
  TileShape few[kMaxRows];
  TileFn<T> walk[kMaxRows][kMaxBlocks];
};

// Everything one ISA runs: the tiles of each dtype and the epilogue; `widen`
// (widen_bf16_blocks) where a bfloat16 product of many rows runs faster as
// float32 tiles over weights widened once per call (see bf16_linear), else null.
struct Path {
  Tiles<uint16_t> bf16;
  Tiles<float> f32;
  FinishFn finish;
  const char* name;
  WidenFn widen;
};

#define KVFORGE_TILE_ROW(NS, FN, MR) {&NS::FN<MR, 1>, &NS::FN<MR, 2>, &NS::FN<MR, 3>, &NS::FN<MR, 4>}
#define KVFORGE_TILES(NS, FN)                                                                                   \
  {KVFORGE_TILE_ROW(NS, FN, 1), KVFORGE_TILE_ROW(NS, FN, 2), KVFORGE_TILE_ROW(NS, FN, 3),                       \
   KVFORGE_TILE_ROW(NS, FN, 4), KVFORGE_TILE_ROW(NS, FN, 5), KVFORGE_TILE_ROW(NS, FN, 6),                       \
   KVFORGE_TILE_ROW(NS, FN, 7), KVFORGE_TILE_ROW(NS, FN, 8)}

#define KVFORGE_SAME_TILE(R, B) {R, B}, {R, B}, {{R, B}, {R, B}, {R, B}, {R, B}, {R, B}, {R, B}, {R, B}, {R, B}}

const Path kBaseline = {{KVFORGE_TILES(linear_base, generic_tile), KVFORGE_SAME_TILE(4, 4)},
                        {KVFORGE_TILES(linear_base, f32_tile), KVFORGE_SAME_TILE(4, 4)},
                        &linear_base::finish_tile, "baseline", &linear_base::widen_bf16_blocks};
#ifdef KVFORGE_HAS_X86_PATHS
// AVX2 has 16 ymm registers and a 16-channel block takes two: 3 x 2 float32 tiles
// (12 sums, 4 weight vectors), and 2 x 2 bfloat16 (each weight vector splits in
// two). Tiles of more sums than registers keep some on the stack; where the
// weights come from memory, four blocks read side by side pay for that: float32
// 1-3 rows take 3 x 4, and bfloat16 2 x 4 but at 3-6 rows, where 2 x 2 reads
// faster (docs/models.md, "Four-block tiles for a decode"). float32 4-7 rows
// walk four blocks (4, 5 or 6 rows at once; 7 as 4 and 3), faster than any
// tile there (docs/models.md, "Walking four blocks for 4-7 rows").
const Path kAvx2 = {{KVFORGE_TILES(linear_avx2, generic_tile), {2, 2}, {2, 4},
                     {{2, 4}, {2, 4}, {2, 2}, {2, 2}, {2, 2}, {2, 2}, {2, 4}, {2, 4}}},
                    {KVFORGE_TILES(linear_avx2, f32_tile), {3, 2}, {3, 2},
                     {{3, 4}, {3, 4}, {3, 4}, {4, 4, true}, {5, 4, true}, {6, 4, true}, {4, 4, true}, {3, 2}},
                     KVFORGE_TILES(linear_avx2, f32_walk)},
                    &linear_avx2::finish_tile, "avx2", &linear_avx2::widen_bf16_blocks};
// On AVX-512 (measured on Zen 4) one row's float32 weights, and 1-8 rows'
// bfloat16 weights on the bfloat16 dot product, read faster as one stream
// (`stream`) than as the four or two side by side that AVX2 prefers; float32
// from 3 rows reads slower so. 5-8 float32 rows (a step verifying drafts) take
// one row tile of their own, 5 x 4, 6 x 4, 7 x 2 or 8 x 2, whose sums fit in
// the 32 registers, instead of a 4 x 4 tile and a second pass for the rest
// (docs/models.md, "One stream on AVX-512").
#define KVFORGE_AVX512_F32_TILES                                                                               \
  {4, 4}, {4, 4}, {{1, 4, false, true}, {4, 4}, {4, 4}, {4, 4}, {5, 4}, {6, 4}, {7, 2}, {8, 2}}
#define KVFORGE_STREAM_FEW(R, B)                                                                               \
  {R, B}, {R, B}, {{1, 4, false, true}, {2, 4, false, true}, {3, 4, false, true}, {4, 4, false, true},          \
                   {5, 4, false, true}, {6, 4, false, true}, {7, 4, false, true}, {8, 4, false, true}}
const Path kAvx512 = {{KVFORGE_TILES(linear_avx512, generic_tile), KVFORGE_SAME_TILE(4, 4)},
                      {KVFORGE_TILES(linear_avx512, f32_tile), KVFORGE_AVX512_F32_TILES},
                      &linear_avx512::finish_tile, "avx512", &linear_avx512::widen_bf16_blocks};
// bfloat16 8 rows x 2 blocks: 16 sums, and per input pair 2 weight loads for 16
// vdpbf16ps, which measured faster than 4 x 4 at every row count once a
// decode's weights stream from 2 MiB pages (docs/models.md).
const Path kDpbf16 = {{KVFORGE_TILES(linear_dpbf16, dpbf16_tile), KVFORGE_STREAM_FEW(8, 2)},
                      {KVFORGE_TILES(linear_dpbf16, f32_tile), KVFORGE_AVX512_F32_TILES},
                      &linear_dpbf16::finish_tile, "avx512_bf16", nullptr};
#endif

const Path& path_here() {
#ifdef KVFORGE_HAS_X86_PATHS
  switch (isa()) {
    case Isa::kAvx512: return has_avx512_bf16() ? kDpbf16 : kAvx512;
    case Isa::kAvx2: return kAvx2;
    case Isa::kBaseline: break;
  }
#endif
  return kBaseline;
}

// From this many rows bf16_linear widens the weights to float32 on paths with a
// `widen`: widening reads the bfloat16 weight and writes and reads one twice its
// size, which the float32 tiles' speed pays back from about 64-96 rows when the
// weights come from memory, as a model's layers do (docs/models.md, "Widening
// bfloat16 for many rows").
constexpr int64_t kWidenRows = 96;

// Rows go in chunks of (about) this many: a chunk's inputs stay in cache while
// every channel tile passes over them (a prefill's thousands of rows do not); a
// decode is one chunk.
constexpr int64_t kChunkRows = 64;

// The prefetches a chunk of row tiles spreads the next channel tile's weights
// over: each row tile's `steps` input steps fetch `step` bytes further on. A
// decode reads every weight from memory once; fetched into L2 during the
// tile before, the next tile's weights arrive while this one computes instead
// of stalling its first row tile. With too few rows to spread them at most one
// line a step (a small batch is bound by memory anyway), nothing is fetched.
struct Lookahead {
  const char* next;  // the next tile's first weight, or nullptr
  int64_t step;      // bytes per input step

  Lookahead(const char* next_tile, int64_t next_bytes, int64_t row_tiles, int64_t steps)
      : next(nullptr), step(0) {
    const int64_t spread = row_tiles * std::max<int64_t>(steps, 1);
    if (next_tile == nullptr || next_bytes > spread * 64) return;
    next = next_tile;
    step = (next_bytes + spread - 1) / spread;
  }
  // Where row tile `t` of the chunk starts fetching.
  const char* for_row_tile(int64_t t, int64_t steps) const { return next ? next + t * steps * step : nullptr; }
};

// Asks for what the epilogue of rows [r, r + mr) x blocks [block0, block0 + nb)
// reads (the residual, mode 1) and writes (y), before the tile computes: a
// prefill's residual and outputs are megabytes, and the epilogue stalled on
// each row's first touch of them.
KVFORGE_PREFETCH_HELPER void prefetch_epilogue(const Epilogue& e, int64_t r, int mr, int64_t block0, int nb) {
  const int64_t c0 = (e.mode == 2 ? block0 / 2 : block0) * 16;
  const int64_t channels = std::min<int64_t>((e.mode == 2 ? nb / 2 : nb) * 16, e.n - c0);
  if (channels <= 0) return;
  const int64_t y_bytes = e.y_float ? 4 : 2, other_bytes = e.other_float ? 4 : 2;
  for (int m = 0; m < mr; ++m) {
    const char* y = static_cast<const char*>(e.y) + ((r + m) * e.y_stride + c0) * y_bytes;
    for (int64_t b = 0; b < channels * y_bytes; b += 64) __builtin_prefetch(y + b, 1, 3);
    if (e.mode != 1) continue;
    const char* other = static_cast<const char*>(e.other) + ((r + m) * e.other_stride + c0) * other_bytes;
    for (int64_t b = 0; b < channels * other_bytes; b += 64) __builtin_prefetch(other + b, 0, 3);
  }
}

// Whether calls take the `many` and `few` tiles (`Tiles`): yes unless
// KVFORGE_WIDE_TILES=off, which keeps the path's `shape`, for before/after figures
// (benchmarks/decode_tiles.py). Read per call, as KVFORGE_CPP_ISA is.
inline bool wide_tiles_on() {
  const char* setting = std::getenv("KVFORGE_WIDE_TILES");
  return setting == nullptr || std::strcmp(setting, "off") != 0;
}

// Every tile of y = epilogue(x W^T): `w` holds `blocks` packed blocks of
// `block_elems` values each; a tile takes `steps` steps over the inputs.
template <typename T>
void run_tiles(const Tiles<T>& tiles, FinishFn finish, const T* x, int64_t x_stride, int64_t m, int64_t k,
               const T* w, int64_t blocks, int64_t block_elems, int64_t steps, const Epilogue& e) {
  const TileShape tile = !wide_tiles_on() ? tiles.shape : m <= kMaxRows ? tiles.few[m - 1] : tiles.many;
  const int64_t tile_blocks = tile.blocks, tile_rows = tile.rows;
  const auto cdiv = [](int64_t a, int64_t b) { return (a + b - 1) / b; };
  const int64_t channel_tiles = cdiv(blocks, tile_blocks);
  // The rows split evenly over the chunks (whole row tiles each), so that the threads'
  // equal shares of (chunk, channel tile) items are equal work: full chunks and a
  // short last one gave two threads 283 and 229 rows' work of 512, and 63 and 1 of 64.
  const int64_t most_rows = kChunkRows / tile_rows * tile_rows;
  const int64_t chunk_rows = cdiv(cdiv(m, cdiv(m, most_rows)), tile_rows) * tile_rows;
  const int64_t chunks = cdiv(m, chunk_rows);
  const bool many_rows = m > tile_rows;  // a decode's few outputs are in cache
  at::parallel_for(0, chunks * channel_tiles, 1, [&](int64_t i0, int64_t i1) {
    alignas(64) float acc[kMaxRows * kMaxBlocks * 16];
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t row_begin = i / channel_tiles * chunk_rows, row_end = std::min(m, row_begin + chunk_rows);
      const int64_t block0 = i % channel_tiles * tile_blocks;
      const int nb = static_cast<int>(std::min<int64_t>(tile_blocks, blocks - block0));
      const int64_t next_block0 = (i + 1) % channel_tiles * tile_blocks;
      // The next tile's weights are fetched over this tile's row tiles.
      const bool fetch_next = !tile.stream && i + 1 < i1;
      const Lookahead ahead(fetch_next ? reinterpret_cast<const char*>(w + next_block0 * block_elems) : nullptr,
                            std::min<int64_t>(tile_blocks, blocks - next_block0) * block_elems * int64_t{sizeof(T)},
                            cdiv(row_end - row_begin, tile_rows), steps);
      for (int64_t r = row_begin; r < row_end; r += tile_rows) {
        const int mr = static_cast<int>(std::min<int64_t>(tile_rows, row_end - r));
        if (many_rows) prefetch_epilogue(e, r, mr, block0, nb);
        if (tile.stream) {
          for (int b = 0; b < nb; ++b) {
            tiles.at[mr - 1][0](x + r * x_stride, x_stride, w + (block0 + b) * block_elems, k, acc + b * 16,
                                nullptr, 0);
          }
        } else {
          const TileFn<T> run = (tile.walk ? tiles.walk : tiles.at)[mr - 1][nb - 1];
          run(x + r * x_stride, x_stride, w + block0 * block_elems, k, acc,
              ahead.for_row_tile((r - row_begin) / tile_rows, steps), ahead.step);
        }
        finish(acc, mr, nb, r, block0, e);
      }
    }
  });
}

// The dtype as the kernels' names and messages spell it.
const char* dtype_word(at::ScalarType t) { return t == at::kFloat ? "float32" : "bfloat16"; }

// `other`: the residual [m, n] of `dtype` epilogue 'add' reads, absent otherwise.
void check_other(const char* op, int mode, const std::optional<at::Tensor>& other, at::ScalarType dtype, int64_t m,
                 int64_t n) {
  if (mode == 1) {
    TORCH_CHECK(other.has_value() && other->scalar_type() == dtype && other->dim() == 2 && other->size(0) == m &&
                    other->size(1) == n && other->stride(1) == 1, op,
                "epilogue 'add' needs `other`, a ", dtype_word(dtype), " [rows, out_features] = [", m, ", ", n,
                "] with unit stride along out_features");
  } else {
    TORCH_CHECK(!other.has_value(), op, "`other` is only read by epilogue 'add'");
  }
}

// The checks both ops share: out_features against the packed blocks, the bias, `other`.
void check_epilogue(const char* op, const at::Tensor& x, int64_t blocks, int64_t n,
                    const std::optional<at::Tensor>& bias, int mode, const std::optional<at::Tensor>& other) {
  const int64_t room = mode == 2 ? blocks / 2 * 16 : blocks * 16;
  TORCH_CHECK(n >= 0 && n <= room && n > room - 16 && (mode != 2 || blocks % 2 == 0), op, "out_features ", n,
              " does not fit the packed weight's ", blocks, " blocks of 16 channels",
              mode == 2 ? " (silu_mul: alternating gate and up blocks, an even number)" : "");
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == blocks * 16, op,
                "bias must be a contiguous float32 tensor of ", blocks * 16,
                " values (blocks x 16, in the packed order), got ", bias->scalar_type(), " ", bias->sizes());
  }
  check_other(op, mode, other, x.scalar_type(), x.size(0), n);
}

void check_x(const char* op, const at::Tensor& x, const at::Tensor& packed, at::ScalarType dtype) {
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), op, "tensors must be on the CPU");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == dtype && (x.stride(1) == 1 || x.size(1) <= 1), op,
              "x must be a 2-D ", dtype_word(dtype), " tensor [rows, in] with unit stride along `in`, got ", x.scalar_type(),
              " ", x.sizes(), " strides ", x.strides());
}

// The checks of an epilogue over `width` sums per row and the [m, n] result it
// writes (n = width / 2 for "silu_mul", which reads gate and up as alternating
// blocks of 16 output channels).
at::Tensor epilogue_output(const char* op, int64_t m, int64_t width, int mode, const std::optional<at::Tensor>& other,
                           at::ScalarType out_dtype) {
  TORCH_CHECK(mode != 2 || width % 32 == 0, op, "epilogue 'silu_mul' reads gate and up as alternating blocks of 16 "
              "output channels, so the weight must have a multiple of 32 of them, got ", width);
  const int64_t n = mode == 2 ? width / 2 : width;
  check_other(op, mode, other, out_dtype, m, n);
  return at::empty({m, n}, at::TensorOptions().dtype(out_dtype));
}

Epilogue epilogue_for(int mode, const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& other,
                      at::Tensor& y) {
  return Epilogue{mode,
                  bias.has_value() ? bias->data_ptr<float>() : nullptr,
                  mode == 1 ? other->data_ptr() : nullptr,
                  mode == 1 && other->scalar_type() == at::kFloat,
                  mode == 1 ? other->stride(0) : 0,
                  y.data_ptr(),
                  y.scalar_type() == at::kFloat,
                  y.stride(0),
                  y.size(1)};
}

}  // namespace

int epilogue_mode(const char* op, const std::string& name) {
  if (name == "none") return 0;
  if (name == "add") return 1;
  if (name == "silu_mul") return 2;
  TORCH_CHECK(false, op, "epilogue must be 'none', 'add' or 'silu_mul', got '", name, "'");
  return -1;
}

at::Tensor finish_each_row(const char* op, int64_t m, int64_t width, int mode, const std::optional<at::Tensor>& other,
                           at::ScalarType out_dtype, const std::function<const float*(int64_t, float*)>& row_sums) {
  const int64_t blocks = (width + 15) / 16;
  at::Tensor y = epilogue_output(op, m, width, mode, other, out_dtype);
  if (y.numel() == 0) return y;
  const Epilogue e = epilogue_for(mode, std::nullopt, other, y);
  const Path& path = path_here();
  at::parallel_for(0, m, std::max<int64_t>(1, 16384 / std::max<int64_t>(1, width)), [&](int64_t r0, int64_t r1) {
    std::vector<float> buffer(blocks * 16);  // whole blocks (the finish reads 16 channels at a time), zeros past width
    for (int64_t r = r0; r < r1; ++r) {
      const float* acc = row_sums(r, buffer.data());
      for (int64_t b = 0; b < blocks; b += kMaxBlocks) {
        path.finish(acc + b * 16, 1, static_cast<int>(std::min<int64_t>(kMaxBlocks, blocks - b)), r, b, e);
      }
    }
  });
  return y;
}

at::Tensor finish_rows(const char* op, const at::Tensor& sums, int mode, const std::optional<at::Tensor>& other,
                       at::ScalarType out_dtype) {
  const int64_t m = sums.size(0), width = sums.size(1);
  if (mode == 0) {
    check_other(op, mode, other, out_dtype, m, width);
    return sums.scalar_type() == out_dtype ? sums : sums.to(out_dtype);
  }
  // Rows the finish reads in place: float32, whole blocks. Others are copied into the row buffer first.
  const bool in_place = sums.scalar_type() == at::kFloat && width % 16 == 0 && sums.stride(1) == 1;
  return finish_each_row(op, m, width, mode, other, out_dtype, [&](int64_t r, float* buffer) -> const float* {
    if (in_place) return sums.data_ptr<float>() + r * sums.stride(0);
    at::from_blob(buffer, {width}, at::TensorOptions().dtype(at::kFloat)).copy_(sums[r]);
    return buffer;
  });
}

at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                       const std::optional<at::Tensor>& bias, const std::string& epilogue,
                       const std::optional<at::Tensor>& other, bool float_out) {
  const char* op = "kvforge_cpp.bf16_linear: ";
  const int mode = epilogue_mode(op, epilogue);
  check_x(op, x, packed, at::kBFloat16);
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kBFloat16 && packed.size(2) == 16 &&
                  packed.size(3) == 2 && packed.is_contiguous(), op,
              "packed must be a contiguous bfloat16 [blocks, pairs, 16, 2] (pack the weight with "
              "kvforge.models.cpp_linear.pack_weight), got ", packed.scalar_type(), " ", packed.sizes());
  TORCH_CHECK(packed.size(1) == (x.size(1) + 1) / 2, op, "x has ", x.size(1), " input features but the packed "
              "weight holds ", packed.size(1), " input pairs (", 2 * packed.size(1) - 1, " or ", 2 * packed.size(1),
              " features)");
  check_epilogue(op, x, packed.size(0), out_features, bias, mode, other);
  const int64_t m = x.size(0), k = x.size(1), blocks = packed.size(0), pairs = packed.size(1);
  at::Tensor y = at::empty({m, out_features}, x.options().dtype(float_out ? at::kFloat : at::kBFloat16));
  if (m == 0 || out_features == 0) return y;
  if (k == 0) {  // no inputs: every sum is zero; the epilogue still applies
    return bf16_linear(at::zeros({m, 2}, x.options()), at::zeros({blocks, 1, 16, 2}, packed.options()),
                       out_features, bias, epilogue, other, float_out);
  }
  const Path& path = path_here();
  const Epilogue e = epilogue_for(mode, bias, other, y);
  const uint16_t* w = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  if (path.widen != nullptr && m >= kWidenRows) {
    // Many rows on a path without a bfloat16 dot product: x and the weights as float32
    // once (an odd width padded with a zero input), then the float32 tiles, whose
    // sums take the bfloat16 tile's steps in its order: the same bits at any row count.
    at::Tensor x32 = at::zeros({m, 2 * pairs}, x.options().dtype(at::kFloat));
    x32.narrow(1, 0, k).copy_(x);
    at::Tensor w32 = at::empty({blocks, 2 * pairs, 16}, x32.options());
    float* wide = w32.data_ptr<float>();
    at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) { path.widen(w, pairs, b0, b1, wide); });
    run_tiles(path.f32, path.finish, x32.data_ptr<float>(), x32.stride(0), m, 2 * pairs, wide, blocks, pairs * 32,
              2 * pairs, e);
    return y;
  }
  run_tiles(path.bf16, path.finish, reinterpret_cast<const uint16_t*>(x.data_ptr()), x.stride(0), m, k, w, blocks,
            pairs * 32, k / 2, e);
  return y;
}

at::Tensor f32_linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                      const std::optional<at::Tensor>& bias, const std::string& epilogue,
                      const std::optional<at::Tensor>& other) {
  const char* op = "kvforge_cpp.f32_linear: ";
  const int mode = epilogue_mode(op, epilogue);
  check_x(op, x, packed, at::kFloat);
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kFloat && packed.size(2) == 16 &&
                  packed.is_contiguous(), op,
              "packed must be a contiguous float32 [blocks, in, 16] (pack the weight with "
              "kvforge.models.cpp_linear.pack_weight), got ", packed.scalar_type(), " ", packed.sizes());
  TORCH_CHECK(packed.size(1) == x.size(1), op, "x has ", x.size(1), " input features but the packed weight holds ",
              packed.size(1));
  check_epilogue(op, x, packed.size(0), out_features, bias, mode, other);
  const int64_t m = x.size(0), k = x.size(1), blocks = packed.size(0);
  at::Tensor y = at::empty({m, out_features}, x.options());
  if (m == 0 || out_features == 0) return y;
  if (k == 0) {  // no inputs: every sum is zero; the epilogue still applies
    return f32_linear(at::zeros({m, 1}, x.options()), at::zeros({blocks, 1, 16}, packed.options()), out_features,
                      bias, epilogue, other);
  }
  const Path& path = path_here();
  run_tiles(path.f32, path.finish, x.data_ptr<float>(), x.stride(0), m, k, packed.data_ptr<float>(), blocks, k * 16, k,
            epilogue_for(mode, bias, other, y));
  return y;
}

namespace {

// The widened ops' shared part: y, and channel_group's groups of channels
// (`channel_bytes` widened each; whole gate and up pairs, 32 channels, for
// "silu_mul"), in parallel, each given the epilogue of its own channels (their
// bias, their columns of y and of `other`): `run(group, n0, n1, scale, e)`
// widens channels [n0, n1) (`scale` the group's scales) and runs the tiles.
template <typename Run>
at::Tensor in_widened_groups(const char* op, int64_t m, int64_t n, int64_t channel_bytes, int64_t multiple,
                             const float* scale, const float* bias, int mode, const std::optional<at::Tensor>& other,
                             at::ScalarType out_dtype, Run&& run) {
  at::Tensor y = epilogue_output(op, m, n, mode, other, out_dtype);
  const int64_t y_bytes = y.element_size(), other_bytes = mode == 1 ? other->element_size() : 0;
  const int64_t group = channel_group(n, channel_bytes, mode == 2 ? std::max<int64_t>(multiple, 32) : multiple);
  in_channel_groups(n, group, scale, bias, [&](int64_t n0, int64_t n1, const float* s, const float* b) {
    const int64_t first = mode == 2 ? n0 / 2 : n0;  // the group's first output column
    Epilogue e = epilogue_for(mode, std::nullopt, other, y);
    e.bias = b;
    e.y = static_cast<char*>(e.y) + first * y_bytes;
    if (mode == 1) e.other = static_cast<const char*>(e.other) + n0 * other_bytes;
    e.n = (mode == 2 ? (n1 - n0) / 2 : n1 - n0);
    run(group, n0, n1, s, e);
  });
  return y;
}

}  // namespace

at::Tensor widened_linear(const char* op, const float* x, int64_t x_stride, int64_t m, int64_t k, int64_t n,
                          int64_t multiple, const float* scale, const float* bias, int mode,
                          const std::optional<at::Tensor>& other, at::ScalarType out_dtype,
                          const std::function<void(int64_t, int64_t, const float*, float*)>& widen) {
  const Path& path = path_here();
  return in_widened_groups(op, m, n, k * 4, multiple, scale, bias, mode, other, out_dtype,
                           [&](int64_t group, int64_t n0, int64_t n1, const float* s, const Epilogue& e) {
                             const std::unique_ptr<float[]> packed(new float[group * k]);  // n0..n1 written
                             widen(n0, n1, s, packed.get());
                             run_tiles(path.f32, path.finish, x, x_stride, m, k, packed.get(), (n1 - n0 + 15) / 16,
                                       k * 16, k, e);
                           });
}

at::Tensor widened_bf16_linear(const char* op, const uint16_t* x, int64_t x_stride, int64_t m, int64_t k, int64_t n,
                               int64_t multiple, const float* scale, const float* bias, int mode,
                               const std::optional<at::Tensor>& other,
                               const std::function<void(int64_t, int64_t, uint16_t*)>& widen) {
  const Path& path = path_here();
  const int64_t pairs = (k + 1) / 2;
  return in_widened_groups(op, m, n, pairs * 4, multiple, scale, bias, mode, other, at::kBFloat16,
                           [&](int64_t group, int64_t n0, int64_t n1, const float* s, Epilogue e) {
                             const std::unique_ptr<uint16_t[]> packed(new uint16_t[group * pairs * 2]);  // n0..n1
                             widen(n0, n1, packed.get());
                             e.scale = s;
                             run_tiles(path.bf16, path.finish, x, x_stride, m, k, packed.get(), (n1 - n0 + 15) / 16,
                                       pairs * 32, k / 2, e);
                           });
}

at::Tensor finish_blocks(const char* op, int64_t m, int64_t width, const float* scale, const float* bias, int mode,
                         const std::optional<at::Tensor>& other, at::ScalarType out_dtype,
                         const std::function<void(int64_t, float*)>& block_sums) {
  at::Tensor y = epilogue_output(op, m, width, mode, other, out_dtype);
  if (y.numel() == 0) return y;
  const int64_t blocks = (width + kSumsBlock - 1) / kSumsBlock;
  // The finish reads 16 scales and biases at a time: a width of part of a block reads them padded.
  std::vector<float> padded;
  if (width % kSumsBlock != 0) {
    padded.assign(2 * blocks * kSumsBlock, 0.f);
    std::copy(scale, scale + width, padded.begin());
    if (bias != nullptr) std::copy(bias, bias + width, padded.begin() + blocks * kSumsBlock);
    scale = padded.data();
    bias = bias != nullptr ? padded.data() + blocks * kSumsBlock : nullptr;
  }
  Epilogue e = epilogue_for(mode, std::nullopt, other, y);
  e.scale = scale;
  e.bias = bias;
  const Path& path = path_here();
  constexpr int kBlocks16 = kSumsBlock / 16;
  static_assert(kSumsBlock == kMaxBlocks * 16, "finish reads a row's sums kMaxBlocks blocks of 16 apart");
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    // [m][kSumsBlock]: on the stack for a decode's few rows
    alignas(64) float few[kMaxRows * kSumsBlock];
    std::vector<float> many(m > kMaxRows ? m * kSumsBlock : 0);
    float* sums = m > kMaxRows ? many.data() : few;
    for (int64_t b = b0; b < b1; ++b) {
      block_sums(b, sums);
      const int nb = static_cast<int>(std::min<int64_t>(kBlocks16, (width - b * kSumsBlock + 15) / 16));
      path.finish(sums, static_cast<int>(m), nb, 0, b * kBlocks16, e);
    }
  });
  return y;
}

// Which path the linear ops take here and now ("avx512_bf16", "avx512", "avx2" or "baseline").
std::string bf16_linear_path() { return path_here().name; }

TORCH_LIBRARY_FRAGMENT(kvforge_cpp, m) {
  m.def("bf16_linear(Tensor x, Tensor packed, int out_features, Tensor? bias=None, str epilogue=\"none\", "
        "Tensor? other=None, bool float_out=False) -> Tensor");
  m.def("f32_linear(Tensor x, Tensor packed, int out_features, Tensor? bias=None, str epilogue=\"none\", "
        "Tensor? other=None) -> Tensor");
  m.def("bf16_linear_path() -> str");
}

TORCH_LIBRARY_IMPL(kvforge_cpp, CPU, m) {
  m.impl("bf16_linear", &bf16_linear);
  m.impl("f32_linear", &f32_linear);
}

TORCH_LIBRARY_IMPL(kvforge_cpp, CompositeExplicitAutograd, m) {
  m.impl("bf16_linear_path", &bf16_linear_path);
}

}  // namespace kvforge_cpp
