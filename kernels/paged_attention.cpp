// kvforge's CPU paged attention, registered as torch.library custom ops:
//
//   kvforge_cpp::paged_attention(query, kv_cache, query_start_loc, seq_lens, context_lens,
//                                block_table, scale, sliding_window, logit_soft_cap,
//                                alibi_slopes, out!, kv_scales=None) -> ()
//   kvforge_cpp::write_kv(key, value, kv_cache!, slot_mapping) -> ()
//   kvforge_cpp::write_quantized_kv(key, value, kv_data!, kv_scales!, slot_mapping) -> ()
//
// The cache is [num_blocks, 2, block_size, num_kv_heads, head_size] (NHD), dense
// within a block; blocks may lie further apart than their size. It holds either
// the query's dtype, or int8 / float8_e4m3fn / float8_e5m2 with `kv_scales`
// [num_blocks, 2, block_size, num_kv_heads] float32 beside it (value = data *
// scale): the two views `kvforge.core.quantized_kv_views` makes of a quantized
// cache's rows of bytes. The attention runs over tiles of (sequence, KV head,
// run of query tokens) in parallel; each tile reads its blocks straight through
// the block table (no gather copy), converts stored keys and values to float32
// as it reads them (never a dequantized copy of the cache), handles every query
// head of its KV head together (GQA), and keeps an online softmax in float32.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "cpu_isa.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)  // clang lacks `#pragma GCC target`
#include <immintrin.h>
#endif

namespace kvforge_cpp {

// Everything a tile needs, as raw pointers and strides (element units unless named bytes).
struct Problem {
  at::ScalarType dtype;  // of query and out
  at::ScalarType kv_dtype;  // of the stored keys and values: dtype, or a quantized storage dtype
  const void* query;
  int64_t q_token_stride, q_head_stride;
  const char* cache;  // block b's keys and values begin at cache + b * block_bytes
  int64_t block_bytes;
  const char* scales;  // quantized: block b's scales [2, block_size, num_kv_heads] at scales + b * scale_block_bytes
  int64_t scale_block_bytes;
  int64_t block_size, num_kv_heads, head_size, queries_per_kv;
  const int32_t* query_start;
  const int32_t* context_lens;
  const int32_t* block_table;
  int64_t block_table_stride;
  float scale;
  int64_t window;  // 0: none
  float soft_cap;  // 0: none
  const float* alibi;  // nullptr: none; else one slope per query head
  void* out;
  int64_t o_token_stride, o_head_stride;
};

struct Tile {
  int64_t seq, kv_head, kv_heads;  // KV heads [kv_head, kv_head + kv_heads) of sequence `seq`
  int64_t q_begin, q_end;  // its query tokens [q_begin, q_end)
  int64_t cost;
};

// Per-thread buffers, allocated once per thread per call.
struct Scratch {
  std::vector<float> q, acc, score, row_max, row_sum, keys, values;
  std::vector<float> prefill;  // the prefill tile's buffers, sized on its first use (prefill_tile.h, prefill_tile_avx2.h)
  std::vector<float> invariant;  // the batch-invariant tile's buffers, sized on its first use (invariant_tile.h)
  Scratch(int64_t rows, int64_t head_size, int64_t block_size)
      : q(rows * head_size), acc(rows * head_size), score(rows * std::max<int64_t>(round8(block_size), 16)),
        row_max(rows), row_sum(rows),
        keys(round8(block_size) * head_size), values(block_size * head_size) {}
  static int64_t round8(int64_t n) { return (n + 7) / 8 * 8; }
};

template <typename T>
struct TypeTag {
  using type = T;
};

// Storage types that come with one float32 scale per (token, KV head).
template <typename K>
constexpr bool kScaled = std::is_same_v<K, int8_t> || std::is_same_v<K, c10::Float8_e4m3fn> ||
                         std::is_same_v<K, c10::Float8_e5m2>;

// Every float8 byte as float32, for the paths without F16C: one table lookup per
// element instead of c10's bit-by-bit conversion.
struct Fp8Values {
  float e4m3fn[256], e5m2[256];
  Fp8Values() {
    for (int b = 0; b < 256; ++b) {
      e4m3fn[b] = static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(b), c10::Float8_e4m3fn::from_bits()));
      e5m2[b] = static_cast<float>(c10::Float8_e5m2(static_cast<uint8_t>(b), c10::Float8_e5m2::from_bits()));
    }
  }
};
const Fp8Values kFp8Values;

// A stored key or value element as float32 (before its scale), one at a time.
inline float stored_value(float x) { return x; }
inline float stored_value(c10::Half x) { return static_cast<float>(x); }
inline float stored_value(c10::BFloat16 x) { return static_cast<float>(x); }
inline float stored_value(int8_t x) { return static_cast<float>(x); }
inline float stored_value(c10::Float8_e4m3fn x) { return kFp8Values.e4m3fn[x.x]; }
inline float stored_value(c10::Float8_e5m2 x) { return kFp8Values.e5m2[x.x]; }

// Rows per KV head from which a tile transposes each key block (see
// attention_tile.h): below it the transpose costs more than it saves.
constexpr int64_t kTransposeRows = 16;

namespace base {
#include "vector_kernels.h"
#include "attention_tile.h"
#include "invariant_tile.h"
}  // namespace base

#ifdef KVFORGE_HAS_X86_PATHS
#define KVFORGE_F16C 1
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {
#include "vector_kernels.h"
#include "attention_tile.h"
#include "invariant_tile.h"
#include "prefill_tile_avx2.h"
}  // namespace avx2
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,avx2,fma,f16c")
namespace avx512bf16 {
#include "transpose16.h"
#include "prefill_bf16.h"
#include "narrow_bf16.h"
}  // namespace avx512bf16
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")
namespace avx512 {
#include "vector_kernels.h"
#include "attention_tile.h"
#include "decode_tile.h"
#include "prefill_tile.h"
#include "transpose16.h"
#include "narrow_rows.h"
#include "invariant_tile.h"

// Per tile: the prefill tile (prefill_tile.h) for many rows of one KV head when
// `prefill`, else the fast kernel when the problem allows it, else the generic one;
// tiles of up to kFetchRows query rows per KV head fetch ahead (fetch_ahead).
constexpr int64_t kFetchRows = 8;
inline void run_tiles_fast(const Problem& p, const std::vector<Tile>& tiles, int64_t rows_max, bool prefill) {
  const bool fast = p.soft_cap <= 0.f && p.alibi == nullptr && p.head_size % 16 == 0;
  const auto fetches_ahead = [&](const Tile& tile) {
    return fast && !(prefill && prefill_tile_fits(p, tile)) && TileRows(p, tile).head_rows <= kFetchRows;
  };
  run_tiles_with(
      p, tiles, rows_max,
      [&](const Tile& tile, Scratch& s, auto type, const Tile* after) {
        using K = typename decltype(type)::type;
        if (prefill && prefill_tile_fits(p, tile)) {
          attend_tile_prefill<K>(p, tile, s);
        } else if (!fast) {
          attend_tile<K>(p, tile, s);
        } else if (fetches_ahead(tile)) {
          attend_tile_fast<K, true>(p, tile, s, after);
        } else {
          attend_tile_fast<K, false>(p, tile, s);
        }
      },
      fetches_ahead);
}

// The batch-invariant kernel where the prefill tile serves it (a head size of 16
// to 1024 in steps of 16, at most kLanes query heads per KV head): every tile on
// the prefill tile's arithmetic with its key tiles at fixed positions. Tiles of
// up to kNarrowRows rows per KV head (decodes) take narrow_rows.h, all their KV
// heads at once; the others the prefill tile itself, one KV head at a time.
// Soft-cap, ALiBi, sliding windows, quantized caches and any block size are
// served, since both apply them per row.
inline bool invariant_prefill_fits(const Problem& p) {
  return p.head_size % 16 == 0 && p.head_size >= 16 && p.head_size <= 1024 && p.queries_per_kv <= kLanes;
}
inline void run_tiles_invariant_prefill(const Problem& p, const std::vector<Tile>& tiles, int64_t rows_max) {
  const auto narrow = [&](const Tile& tile) { return TileRows(p, tile).head_rows <= kNarrowRows; };
  run_tiles_with(
      p, tiles, rows_max,
      [&](const Tile& tile, Scratch& s, auto type, const Tile* after) {
        using K = typename decltype(type)::type;
        if (narrow(tile)) {
          attend_tile_narrow<K>(p, tile, s, after);
          return;
        }
        for (int64_t h = 0; h < tile.kv_heads; ++h) {
          const Tile one{tile.seq, tile.kv_head + h, 1, tile.q_begin, tile.q_end, tile.cost};
          attend_tile_prefill<K, true>(p, one, s);
        }
      },
      narrow);  // a narrow tile asks for the first keys of the tile its thread takes next
}

// Otherwise (more than kLanes query heads per KV head), where the fast tile
// serves it (no soft-cap or ALiBi, a head size and block size that are multiples
// of 16): every tile on the fast tile with its groups of keys at fixed positions.
inline bool invariant_fast_fits(const Problem& p) {
  return p.soft_cap <= 0.f && p.alibi == nullptr && p.head_size % 16 == 0 && p.block_size % 16 == 0;
}
inline void run_tiles_invariant_fast(const Problem& p, const std::vector<Tile>& tiles, int64_t rows_max) {
  const auto fetches_ahead = [&](const Tile& tile) { return TileRows(p, tile).head_rows <= kFetchRows; };
  run_tiles_with(
      p, tiles, rows_max,
      [&](const Tile& tile, Scratch& s, auto type, const Tile* after) {
        using K = typename decltype(type)::type;
        if (fetches_ahead(tile)) {
          attend_tile_fast<K, true, true>(p, tile, s, after);
        } else {
          attend_tile_fast<K, false, true>(p, tile, s);
        }
      },
      fetches_ahead);
}
}  // namespace avx512
#pragma GCC pop_options
#undef KVFORGE_F16C
#endif

namespace {

// Query rows a tile holds at most: enough to reuse each key and value row many
// times while the tile's accumulators stay in L1/L2.
constexpr int64_t kTileRows = 64;

void check_int32_vector(const at::Tensor& t, const char* name, int64_t length) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kInt && t.dim() == 1 && t.size(0) == length,
              "kvforge_cpp: ", name, " must be a CPU int32 vector of length ", length, ", got ", t.scalar_type(),
              " with shape ", t.sizes());
}

// The KV storage dtypes that come with scales, by name, for error messages.
constexpr const char* kQuantizedKvDtypes = "int8, float8_e4m3fn or float8_e5m2";

bool is_quantized_kv_dtype(at::ScalarType t) {
  return t == at::kChar || t == at::ScalarType::Float8_e4m3fn || t == at::ScalarType::Float8_e5m2;
}

// The NHD cache (or its data view) is dense within a block; only the block stride is free.
void check_cache_layout(const at::Tensor& kv_cache) {
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(1) == 2,
              "kvforge_cpp: kv_cache must be [num_blocks, 2, block_size, num_kv_heads, head_size], got ",
              kv_cache.sizes());
  const int64_t head = kv_cache.size(4), slot = kv_cache.size(3) * head, half = kv_cache.size(2) * slot;
  TORCH_CHECK(kv_cache.stride(4) == 1 && kv_cache.stride(3) == head && kv_cache.stride(2) == slot &&
                  kv_cache.stride(1) == half && kv_cache.stride(0) >= 2 * half,
              "kvforge_cpp: kv_cache must be dense within each block (strides [>=", 2 * half, ", ", half, ", ",
              slot, ", ", head, ", 1]), got strides ", kv_cache.strides(), "; pass a contiguous cache or the data "
              "view of kvforge.core.quantized_kv_views");
}

// Scales [num_blocks, 2, block_size, num_kv_heads] float32, dense within a block.
void check_scales(const at::Tensor& scales, const at::Tensor& kv_cache) {
  const auto want = kv_cache.sizes().slice(0, 4);
  TORCH_CHECK(scales.device().is_cpu() && scales.scalar_type() == at::kFloat && scales.sizes() == want,
              "kvforge_cpp: kv_scales must be a CPU float32 tensor of shape ", want,
              " (one scale per block, key/value, slot and KV head), got ", scales.scalar_type(), " ", scales.sizes());
  const int64_t slot = scales.size(3), half = scales.size(2) * slot;
  TORCH_CHECK(scales.stride(3) == 1 && scales.stride(2) == slot && scales.stride(1) == half &&
                  scales.stride(0) >= 2 * half,
              "kvforge_cpp: kv_scales must be dense within each block, got strides ", scales.strides());
}

// Whether AVX-512 and AVX2 run prompt tiles on the prefill tile (prefill_tile.h, prefill_tile_avx2.h):
// KVFORGE_CPP_PREFILL=off sends them to the older tiles, for before/after figures.
bool prefill_tile_enabled() {
  const char* flag = std::getenv("KVFORGE_CPP_PREFILL");
  if (flag == nullptr || std::string(flag) == "on") return true;
  TORCH_CHECK(std::string(flag) == "off", "kvforge_cpp: KVFORGE_CPP_PREFILL must be on or off, got '", flag, "'");
  return false;
}

}  // namespace

void paged_attention(const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& query_start_loc,
                     const at::Tensor& seq_lens, const at::Tensor& context_lens, const at::Tensor& block_table,
                     double scale, int64_t sliding_window, double logit_soft_cap,
                     const std::optional<at::Tensor>& alibi_slopes, const at::Tensor& out,
                     const std::optional<at::Tensor>& kv_scales, bool batch_invariant) {
  TORCH_CHECK(query.dim() == 3, "kvforge_cpp: query must be [num_tokens, num_heads, head_size], got ", query.sizes());
  check_cache_layout(kv_cache);
  const auto dtype = query.scalar_type();
  const auto kv_dtype = kv_cache.scalar_type();
  TORCH_CHECK(out.scalar_type() == dtype, "kvforge_cpp: out must have the query's dtype ", dtype, ", got ",
              out.scalar_type());
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16,
              "kvforge_cpp: dtype must be float32, float16 or bfloat16, got ", dtype);
  if (kv_scales.has_value()) {
    TORCH_CHECK(is_quantized_kv_dtype(kv_dtype), "kvforge_cpp: with kv_scales, kv_cache must hold ",
                kQuantizedKvDtypes, ", got ", kv_dtype);
    check_scales(*kv_scales, kv_cache);
  } else {
    TORCH_CHECK(kv_dtype == dtype, "kvforge_cpp: kv_cache must have the query's dtype ", dtype, ", got ", kv_dtype,
                is_quantized_kv_dtype(kv_dtype) ? " (a quantized cache needs its kv_scales)" : "");
  }
  TORCH_CHECK(query.device().is_cpu() && kv_cache.device().is_cpu() && out.device().is_cpu(),
              "kvforge_cpp: tensors must be on the CPU");
  TORCH_CHECK(out.sizes() == query.sizes(), "kvforge_cpp: out must have the query's shape ", query.sizes(),
              ", got ", out.sizes());
  const int64_t num_tokens = query.size(0), num_heads = query.size(1), head_size = query.size(2);
  const int64_t num_blocks = kv_cache.size(0), block_size = kv_cache.size(2), num_kv_heads = kv_cache.size(3);
  TORCH_CHECK(kv_cache.size(4) == head_size, "kvforge_cpp: kv_cache head size ", kv_cache.size(4),
              " differs from the query's ", head_size);
  TORCH_CHECK(num_kv_heads > 0 && num_heads % num_kv_heads == 0, "kvforge_cpp: ", num_heads,
              " query heads is not a multiple of ", num_kv_heads, " KV heads");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1, "kvforge_cpp: query and out need a unit stride on head_size");
  const int64_t num_seqs = seq_lens.size(0);
  check_int32_vector(query_start_loc, "query_start_loc", num_seqs + 1);
  check_int32_vector(seq_lens, "seq_lens", num_seqs);
  check_int32_vector(context_lens, "context_lens", num_seqs);
  TORCH_CHECK(block_table.device().is_cpu() && block_table.scalar_type() == at::kInt && block_table.dim() == 2 &&
                  block_table.size(0) == num_seqs && block_table.stride(1) == 1,
              "kvforge_cpp: block_table must be a CPU int32 [num_seqs, max_blocks] with unit column stride");
  TORCH_CHECK(sliding_window >= 0, "kvforge_cpp: sliding_window must be >= 0 (0: none)");
  at::Tensor slopes;
  if (alibi_slopes.has_value()) {
    slopes = alibi_slopes->to(at::kFloat).contiguous();
    TORCH_CHECK(slopes.dim() == 1 && slopes.size(0) == num_heads, "kvforge_cpp: alibi_slopes needs one slope per head");
  }
  const at::Tensor starts = query_start_loc.contiguous();
  const at::Tensor seqs = seq_lens.contiguous();
  const at::Tensor contexts = context_lens.contiguous();
  const int32_t* start = starts.data_ptr<int32_t>();
  const int32_t* seq = seqs.data_ptr<int32_t>();
  const int32_t* context = contexts.data_ptr<int32_t>();
  const int32_t* table = block_table.data_ptr<int32_t>();
  if (num_tokens == 0 || num_seqs == 0) return;

  const int64_t group = num_heads / num_kv_heads;
  const int64_t tile_tokens = std::max<int64_t>(1, kTileRows / group);
  // A sequence with few query rows (a decode) takes all its KV heads in one tile,
  // so each block is read as one contiguous run, when there are enough
  // sequences to keep every thread busy; otherwise one KV head per tile.
  const bool many_seqs = num_seqs >= 2 * at::get_num_threads();
  std::vector<Tile> tiles;
  for (int64_t b = 0; b < num_seqs; ++b) {
    const int64_t q_len = start[b + 1] - start[b];
    TORCH_CHECK(start[b] >= 0 && q_len >= 0 && start[b + 1] <= num_tokens, "kvforge_cpp: query_start_loc[", b,
                "..", b + 1, "] = ", start[b], "..", start[b + 1], " is not a range of the ", num_tokens, " tokens");
    if (q_len == 0) continue;
    TORCH_CHECK(context[b] >= 0 && context[b] + q_len <= seq[b], "kvforge_cpp: sequence ", b, " has context ",
                context[b], " + ", q_len, " new tokens > seq_len ", seq[b]);
    const int64_t used_blocks = (context[b] + q_len + block_size - 1) / block_size;
    TORCH_CHECK(used_blocks <= block_table.size(1), "kvforge_cpp: sequence ", b, " needs ", used_blocks,
                " blocks but the block table has ", block_table.size(1), " columns");
    for (int64_t i = 0; i < used_blocks; ++i) {
      const int64_t id = table[b * block_table.stride(0) + i];
      TORCH_CHECK(id >= 0 && id < num_blocks, "kvforge_cpp: block_table[", b, ", ", i, "] = ", id,
                  " is outside the cache's ", num_blocks, " blocks");
    }
    const int64_t heads_per_tile = many_seqs && q_len * num_heads <= kTileRows ? num_kv_heads : 1;
    for (int64_t t0 = 0; t0 < q_len; t0 += tile_tokens) {
      const int64_t t1 = std::min(q_len, t0 + tile_tokens);
      const int64_t last = context[b] + t1;  // keys seen by the tile's last token
      const int64_t first = sliding_window > 0 ? std::max<int64_t>(0, context[b] + t0 - sliding_window + 1) : 0;
      for (int64_t h = 0; h < num_kv_heads; h += heads_per_tile) {
        tiles.push_back({b, h, heads_per_tile, t0, t1, (t1 - t0) * heads_per_tile * (last - first)});
      }
    }
  }
  // Longest first, so the dynamic schedule ends with short tiles (LPT).
  std::stable_sort(tiles.begin(), tiles.end(), [](const Tile& a, const Tile& b) { return a.cost > b.cost; });

  const char* scale_bytes = kv_scales.has_value() ? static_cast<const char*>(kv_scales->data_ptr()) : nullptr;
  const int64_t scale_block_bytes = kv_scales.has_value() ? kv_scales->stride(0) * int64_t{sizeof(float)} : 0;
  Problem p{dtype, kv_dtype, query.data_ptr(), query.stride(0), query.stride(1),
            static_cast<const char*>(kv_cache.data_ptr()), kv_cache.stride(0) * kv_cache.element_size(),
            scale_bytes, scale_block_bytes, block_size, num_kv_heads, head_size, group, start, context, table,
            block_table.stride(0),
            static_cast<float>(scale), sliding_window, static_cast<float>(logit_soft_cap),
            slopes.defined() ? slopes.data_ptr<float>() : nullptr, out.data_ptr(), out.stride(0), out.stride(1)};
  const int64_t rows_max = std::max(tile_tokens * group, many_seqs ? kTileRows : int64_t{0});
#ifdef KVFORGE_HAS_X86_PATHS
  if (batch_invariant) {
    switch (isa()) {
      case Isa::kAvx512:
        if (avx512::invariant_prefill_fits(p)) {
          avx512::run_tiles_invariant_prefill(p, tiles, rows_max);
        } else if (avx512::invariant_fast_fits(p)) {
          avx512::run_tiles_invariant_fast(p, tiles, rows_max);
        } else {
          avx512::run_tiles_invariant(p, tiles, rows_max);
        }
        return;
      case Isa::kAvx2: avx2::run_tiles_invariant(p, tiles, rows_max); return;
      case Isa::kBaseline: break;
    }
    base::run_tiles_invariant(p, tiles, rows_max);
    return;
  }
  switch (isa()) {
    case Isa::kAvx512: avx512::run_tiles_fast(p, tiles, rows_max, prefill_tile_enabled()); return;
    case Isa::kAvx2:
      if (prefill_tile_enabled()) {
        avx2::run_tiles_prefill(p, tiles, rows_max);
      } else {
        avx2::run_tiles(p, tiles, rows_max);
      }
      return;
    case Isa::kBaseline: break;
  }
#else
  if (batch_invariant) {
    base::run_tiles_invariant(p, tiles, rows_max);
    return;
  }
#endif
  base::run_tiles(p, tiles, rows_max);
}

void write_kv(const at::Tensor& key, const at::Tensor& value, const at::Tensor& kv_cache,
              const at::Tensor& slot_mapping) {
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(1) == 2 && kv_cache.is_contiguous(),
              "kvforge_cpp: kv_cache must be a contiguous [num_blocks, 2, block_size, num_kv_heads, head_size], got ",
              kv_cache.sizes());
  const int64_t num_blocks = kv_cache.size(0), block_size = kv_cache.size(2);
  const int64_t row = kv_cache.size(3) * kv_cache.size(4);  // one slot: all KV heads
  TORCH_CHECK(key.sizes() == value.sizes() && key.dim() == 3 && key.size(1) == kv_cache.size(3) &&
                  key.size(2) == kv_cache.size(4),
              "kvforge_cpp: key and value must both be [num_tokens, ", kv_cache.size(3), ", ", kv_cache.size(4),
              "], got ", key.sizes(), " and ", value.sizes());
  TORCH_CHECK(key.scalar_type() == kv_cache.scalar_type() && value.scalar_type() == kv_cache.scalar_type(),
              "kvforge_cpp: key, value and kv_cache must share one dtype");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 && slot_mapping.size(0) == key.size(0),
              "kvforge_cpp: slot_mapping must be int64 [num_tokens]");
  TORCH_CHECK(key.device().is_cpu() && value.device().is_cpu() && kv_cache.device().is_cpu() &&
                  slot_mapping.device().is_cpu(),
              "kvforge_cpp: tensors must be on the CPU");
  // Each token's heads must be one contiguous run; only the token stride is free.
  const at::Tensor k = key.stride(2) == 1 && key.stride(1) == key.size(2) ? key : key.contiguous();
  const at::Tensor v = value.stride(2) == 1 && value.stride(1) == value.size(2) ? value : value.contiguous();
  const at::Tensor slots = slot_mapping.contiguous();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t num_tokens = key.size(0);
  for (int64_t t = 0; t < num_tokens; ++t) {  // validate first: a bad slot must not leave half a write
    TORCH_CHECK(slot[t] >= -1 && slot[t] < num_blocks * block_size, "kvforge_cpp: slot_mapping[", t, "] = ", slot[t],
                " is outside the cache's ", num_blocks * block_size, " slots (-1 means skip)");
  }
  const int64_t bytes = row * kv_cache.element_size();
  const auto* k_src = static_cast<const char*>(k.data_ptr());
  const auto* v_src = static_cast<const char*>(v.data_ptr());
  const int64_t k_stride = k.stride(0) * k.element_size(), v_stride = v.stride(0) * v.element_size();
  auto* cache = static_cast<char*>(kv_cache.data_ptr());
  at::parallel_for(0, num_tokens, 256, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (slot[t] < 0) continue;
      const int64_t block = slot[t] / block_size, offset = slot[t] % block_size;
      std::memcpy(cache + ((block * 2 + 0) * block_size + offset) * bytes, k_src + t * k_stride, bytes);
      std::memcpy(cache + ((block * 2 + 1) * block_size + offset) * bytes, v_src + t * v_stride, bytes);
    }
  });
}

#include "quantized_write.h"

// The instruction set paged_attention runs with here and now (see isa()).
std::string isa_name() {
  switch (isa()) {
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx2: return "avx2";
    case Isa::kBaseline: break;
  }
  return "baseline";
}

TORCH_LIBRARY(kvforge_cpp, m) {
  m.def("isa() -> str");
  m.def(
      "paged_attention(Tensor query, Tensor kv_cache, Tensor query_start_loc, Tensor seq_lens, "
      "Tensor context_lens, Tensor block_table, float scale, int sliding_window, float logit_soft_cap, "
      "Tensor? alibi_slopes, Tensor(a!) out, Tensor? kv_scales=None, bool batch_invariant=False) -> ()");
  m.def("write_kv(Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor slot_mapping) -> ()");
  m.def("write_quantized_kv(Tensor key, Tensor value, Tensor(a!) kv_data, Tensor(b!) kv_scales, "
        "Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(kvforge_cpp, CPU, m) {
  m.impl("paged_attention", &paged_attention);
  m.impl("write_kv", &write_kv);
  m.impl("write_quantized_kv", &write_quantized_kv);
}

TORCH_LIBRARY_IMPL(kvforge_cpp, CompositeExplicitAutograd, m) {
  m.impl("isa", &isa_name);
}

}  // namespace kvforge_cpp
