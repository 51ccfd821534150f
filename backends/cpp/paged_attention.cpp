// kvforge's CPU paged attention, registered as torch.library custom ops:
//
//   kvforge_cpp::paged_attention(query, kv_cache, query_start_loc, seq_lens, context_lens,
//                                block_table, scale, sliding_window, logit_soft_cap,
//                                alibi_slopes, out!) -> ()
//   kvforge_cpp::write_kv(key, value, kv_cache!, slot_mapping) -> ()
//
// The cache layout is [num_blocks, 2, block_size, num_kv_heads, head_size]. The
// attention runs over tiles of (sequence, KV head, run of query tokens) in
// parallel; each tile reads its blocks straight through the block table (no
// gather copy), handles every query head of its KV head together (GQA), and
// keeps an online softmax in float32 whatever the input dtype.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

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

// Everything a tile needs, as raw pointers and strides (element units).
struct Problem {
  at::ScalarType dtype;
  const void* query;
  int64_t q_token_stride, q_head_stride;
  const void* cache;
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

// Rows per KV head from which a tile transposes each key block (see
// attention_tile.h): below it the transpose costs more than it saves.
constexpr int64_t kTransposeRows = 16;

namespace base {
#include "vector_kernels.h"
#include "attention_tile.h"
}  // namespace base

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)  // clang lacks `#pragma GCC target`
#define KVFORGE_HAS_X86_PATHS 1
#define KVFORGE_F16C 1
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {
#include "vector_kernels.h"
#include "attention_tile.h"
}  // namespace avx2
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")
namespace avx512 {
#include "vector_kernels.h"
#include "attention_tile.h"
#include "decode_tile.h"
}  // namespace avx512
#pragma GCC pop_options
#undef KVFORGE_F16C
#endif

namespace {

enum class Isa { kBaseline, kAvx2, kAvx512 };

// The best instruction set this CPU runs, capped by KVFORGE_CPP_ISA (baseline,
// avx2 or avx512; tests run every level). KVFORGE_CPP_PORTABLE=1 still means
// baseline. Read per call, which costs nothing next to the attention itself.
Isa isa() {
#ifdef KVFORGE_HAS_X86_PATHS
  static const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                           __builtin_cpu_supports("f16c");
  static const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                             __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
  const char* portable = std::getenv("KVFORGE_CPP_PORTABLE");
  const char* cap = std::getenv("KVFORGE_CPP_ISA");
  const std::string limit = portable != nullptr && portable[0] == '1' ? "baseline" : (cap != nullptr ? cap : "");
  if (limit == "baseline" || !avx2) return Isa::kBaseline;
  if (limit == "avx2" || !avx512) return Isa::kAvx2;
  return Isa::kAvx512;
#else
  return Isa::kBaseline;
#endif
}

// Query rows a tile holds at most: enough to reuse each key and value row many
// times while the tile's accumulators stay in L1/L2.
constexpr int64_t kTileRows = 64;

void check_int32_vector(const at::Tensor& t, const char* name, int64_t length) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kInt && t.dim() == 1 && t.size(0) == length,
              "kvforge_cpp: ", name, " must be a CPU int32 vector of length ", length, ", got ", t.scalar_type(),
              " with shape ", t.sizes());
}

}  // namespace

void paged_attention(const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& query_start_loc,
                     const at::Tensor& seq_lens, const at::Tensor& context_lens, const at::Tensor& block_table,
                     double scale, int64_t sliding_window, double logit_soft_cap,
                     const std::optional<at::Tensor>& alibi_slopes, const at::Tensor& out) {
  TORCH_CHECK(query.dim() == 3, "kvforge_cpp: query must be [num_tokens, num_heads, head_size], got ", query.sizes());
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(1) == 2,
              "kvforge_cpp: kv_cache must be [num_blocks, 2, block_size, num_kv_heads, head_size], got ",
              kv_cache.sizes());
  TORCH_CHECK(kv_cache.is_contiguous(), "kvforge_cpp: kv_cache must be contiguous");
  TORCH_CHECK(query.scalar_type() == kv_cache.scalar_type() && out.scalar_type() == query.scalar_type(),
              "kvforge_cpp: query, kv_cache and out must share one dtype, got ", query.scalar_type(), ", ",
              kv_cache.scalar_type(), " and ", out.scalar_type());
  const auto dtype = query.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16,
              "kvforge_cpp: dtype must be float32, float16 or bfloat16, got ", dtype);
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

  Problem p{dtype, query.data_ptr(), query.stride(0), query.stride(1), kv_cache.data_ptr(), block_size,
            num_kv_heads, head_size, group, start, context, table, block_table.stride(0),
            static_cast<float>(scale), sliding_window, static_cast<float>(logit_soft_cap),
            slopes.defined() ? slopes.data_ptr<float>() : nullptr, out.data_ptr(), out.stride(0), out.stride(1)};
  const int64_t rows_max = std::max(tile_tokens * group, many_seqs ? kTileRows : int64_t{0});
#ifdef KVFORGE_HAS_X86_PATHS
  switch (isa()) {
    case Isa::kAvx512: avx512::run_tiles_fast(p, tiles, rows_max); return;
    case Isa::kAvx2: avx2::run_tiles(p, tiles, rows_max); return;
    case Isa::kBaseline: break;
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
      "Tensor? alibi_slopes, Tensor(a!) out) -> ()");
  m.def("write_kv(Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(kvforge_cpp, CPU, m) {
  m.impl("paged_attention", &paged_attention);
  m.impl("write_kv", &write_kv);
}

TORCH_LIBRARY_IMPL(kvforge_cpp, CompositeExplicitAutograd, m) {
  m.impl("isa", &isa_name);
}

}  // namespace kvforge_cpp
