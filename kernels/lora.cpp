// Batched LoRA for CPUs (Punica's SGMV / BGMV), a torch.library custom op:
//
//   kvforge_cpp::add_lora(y!, x, a, b, seg_starts, seg_slots) -> ()
//   kvforge_cpp::lora_path() -> str
//
// For the tokens t of segment g (seg_starts[g] <= t < seg_starts[g + 1]) whose
// slot s = seg_slots[g] is not -1: y[t] += (x[t] @ a[s]^T) @ b[s]. x [T, in],
// y [T, out] (unit stride along the features, any row stride: y may be a column
// slice of a fused projection's output), a [slots, R, in], b [slots, R, out],
// all four float32 or all four bfloat16; seg_starts int64 [G + 1] from 0 to T,
// non-decreasing; seg_slots int64 [G], each -1 or a slot. Sums are float32: the
// shrink writes a float32 buffer [T, R], the expand adds buffer @ b[s] to y
// with one rounding. Rows of slot -1 are never written.
//
// Both phases split their work into items that never straddle a segment, run in
// parallel: shrink over (token chunk, rank group), expand over (token chunk,
// column chunk). A decode step's one-token segments (BGMV) then spread over
// threads by adapter and columns, a prefill's long segment (SGMV) by tokens.
// Register tiles per instruction set: lora_tile.h.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "cpu_isa.h"

namespace kvforge_cpp {

namespace lora_base {
// x86-64's baseline SSE: 16 registers of 4 floats.
#define KVFORGE_VW_BYTES 16
constexpr int kShrinkTokens = 3, kShrinkRanks = 4, kExpandTokens = 4, kExpandVectors = 3;
#include "bf16_vectors.h"
#include "native_vectors.h"
#include "lora_tile.h"
}  // namespace lora_base

#ifdef KVFORGE_HAS_X86_PATHS
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace lora_avx2 {
// 16 registers of 8 floats: 12 sums, and room for the operands.
#define KVFORGE_VW_BYTES 32
constexpr int kShrinkTokens = 3, kShrinkRanks = 4, kExpandTokens = 4, kExpandVectors = 3;
#include "bf16_vectors.h"
#include "native_vectors.h"
#include "lora_tile.h"
}  // namespace lora_avx2
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")
namespace lora_avx512 {
// 32 registers of 16 floats: 16 sums.
#define KVFORGE_VW_BYTES 64
constexpr int kShrinkTokens = 4, kShrinkRanks = 4, kExpandTokens = 4, kExpandVectors = 4;
#include "bf16_vectors.h"
#include "native_vectors.h"
#include "lora_tile.h"
}  // namespace lora_avx512
#pragma GCC pop_options
#endif

namespace {

template <typename T>
using ShrinkFn = void (*)(const T*, int64_t, int64_t, const T*, int64_t, int64_t, int64_t, int64_t, float*);
template <typename T>
using ExpandFn = void (*)(const float*, int64_t, const T*, int64_t, T*, int64_t, int64_t, int64_t, int64_t);

// Everything one instruction set runs.
struct LoraPath {
  ShrinkFn<float> shrink_f32;
  ShrinkFn<uint16_t> shrink_bf16;
  ExpandFn<float> expand_f32;
  ExpandFn<uint16_t> expand_bf16;
  const char* name;
};

#define KVFORGE_LORA_PATH(NS, NAME)                                                                        \
  {&NS::shrink_rows<float>, &NS::shrink_rows<uint16_t>, &NS::expand_rows<float>, &NS::expand_rows<uint16_t>, \
   NAME}

const LoraPath kBaseline = KVFORGE_LORA_PATH(lora_base, "baseline");
#ifdef KVFORGE_HAS_X86_PATHS
const LoraPath kAvx2 = KVFORGE_LORA_PATH(lora_avx2, "avx2");
const LoraPath kAvx512 = KVFORGE_LORA_PATH(lora_avx512, "avx512");
#endif

const LoraPath& lora_path_here() {
#ifdef KVFORGE_HAS_X86_PATHS
  switch (isa()) {
    case Isa::kAvx512: return kAvx512;
    case Isa::kAvx2: return kAvx2;
    case Isa::kBaseline: break;
  }
#endif
  return kBaseline;
}

// Tokens per work item: a chunk's rows of x (shrink) or of y (expand) stay in
// cache while every rank group or column chunk passes over them.
constexpr int64_t kChunkTokens = 16;
// Columns per expand item: a multiple of every ISA's vector width, so only the last chunk has a tail.
constexpr int64_t kChunkColumns = 256;

// A run of tokens of one segment, with its slot.
struct Chunk {
  int64_t begin, end, slot;
};

std::vector<Chunk> active_chunks(const int64_t* starts, const int64_t* slots, int64_t segments) {
  std::vector<Chunk> chunks;
  for (int64_t g = 0; g < segments; ++g) {
    if (slots[g] < 0) continue;
    for (int64_t t = starts[g]; t < starts[g + 1]; t += kChunkTokens) {
      chunks.push_back({t, std::min(starts[g + 1], t + kChunkTokens), slots[g]});
    }
  }
  return chunks;
}

const char* dtype_word(at::ScalarType t) { return t == at::kFloat ? "float32" : "bfloat16"; }

void check_features(const char* op, const char* name, const at::Tensor& t, at::ScalarType dtype) {
  TORCH_CHECK(t.device().is_cpu(), op, name, " must be on the CPU, got ", t.device());
  TORCH_CHECK(t.dim() == 2 && t.scalar_type() == dtype && (t.stride(1) == 1 || t.size(1) <= 1), op, name,
              " must be a 2-D ", dtype_word(dtype), " tensor [tokens, features] with unit stride along the "
              "features (x's dtype), got ", t.scalar_type(), " ", t.sizes(), " strides ", t.strides());
}

void check_adapter(const char* op, const char* name, const at::Tensor& t, at::ScalarType dtype, int64_t slots,
                   int64_t rank, int64_t features, const char* features_of, const char* features_from) {
  TORCH_CHECK(t.device().is_cpu(), op, name, " must be on the CPU, got ", t.device());
  TORCH_CHECK(t.dim() == 3 && t.scalar_type() == dtype && t.is_contiguous(), op, name,
              " must be a contiguous ", dtype_word(dtype), " tensor [slots, R, ", features_of, "] (x's dtype), got ",
              t.scalar_type(), " ", t.sizes(), t.is_contiguous() ? "" : " (not contiguous: call .contiguous())");
  TORCH_CHECK(t.size(0) == slots && t.size(1) == rank && t.size(2) == features, op, name, " must be [slots, R, ",
              features_of, "] = [", slots, ", ", rank, ", ", features, "] (slots and R of a, ", features_of,
              " of ", features_from, "), got ", t.sizes());
}

// The segments, checked against the token count and the slot count.
void check_segments(const char* op, const at::Tensor& starts, const at::Tensor& slots, int64_t tokens,
                    int64_t slot_count) {
  TORCH_CHECK(starts.device().is_cpu() && starts.dim() == 1 && starts.scalar_type() == at::kLong &&
                  starts.is_contiguous() && starts.size(0) >= 1, op,
              "seg_starts must be a contiguous int64 CPU vector [G + 1] (segment starts, then the token count), got ",
              starts.scalar_type(), " ", starts.sizes(), " on ", starts.device());
  const int64_t segments = starts.size(0) - 1;
  TORCH_CHECK(slots.device().is_cpu() && slots.dim() == 1 && slots.scalar_type() == at::kLong &&
                  slots.is_contiguous() && slots.size(0) == segments, op,
              "seg_slots must be a contiguous int64 CPU vector of one slot per segment (", segments,
              ", one fewer than seg_starts), got ", slots.scalar_type(), " ", slots.sizes(), " on ", slots.device());
  const int64_t* s = starts.data_ptr<int64_t>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  TORCH_CHECK(s[0] == 0 && s[segments] == tokens, op, "seg_starts must run from 0 to the token count ", tokens,
              ", got ", s[0], " .. ", s[segments]);
  for (int64_t g = 0; g < segments; ++g) {
    TORCH_CHECK(s[g] <= s[g + 1], op, "seg_starts must not decrease, got ", s[g], " then ", s[g + 1],
                " at segment ", g);
    TORCH_CHECK(slot[g] >= -1 && slot[g] < slot_count, op, "seg_slots[", g, "] is ", slot[g],
                ": a slot must be -1 (the base model) or 0 .. ", slot_count - 1, " (a and b hold ", slot_count,
                " slots)");
  }
}

template <typename T>
void run(ShrinkFn<T> shrink, ExpandFn<T> expand, const at::Tensor& y, const at::Tensor& x, const at::Tensor& a,
         const at::Tensor& b, const std::vector<Chunk>& chunks) {
  const int64_t tokens = x.size(0), k = x.size(1), n = y.size(1), rank = a.size(1);
  const T* xp = reinterpret_cast<const T*>(x.data_ptr());
  const T* ap = reinterpret_cast<const T*>(a.data_ptr());
  const T* bp = reinterpret_cast<const T*>(b.data_ptr());
  T* yp = reinterpret_cast<T*>(y.data_ptr());
  const int64_t xs = x.stride(0), ys = y.stride(0);
  const int64_t count = static_cast<int64_t>(chunks.size());
  std::vector<float> buffer(tokens * rank);
  float* buf = buffer.data();

  // Few chunks (a decode of few adapters) split their ranks too, so that every thread has work.
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t groups = std::min<int64_t>(std::max<int64_t>(1, (2 * threads + count - 1) / count),
                                           std::max<int64_t>(1, rank / 4));
  const int64_t group_ranks = (rank + groups - 1) / groups;
  at::parallel_for(0, count * groups, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const Chunk& c = chunks[i / groups];
      const int64_t r0 = i % groups * group_ranks, r1 = std::min(rank, r0 + group_ranks);
      if (r0 < r1) shrink(xp + c.begin * xs, xs, c.end - c.begin, ap + c.slot * rank * k, k, rank, r0, r1,
                          buf + c.begin * rank);
    }
  });
  const int64_t columns = (n + kChunkColumns - 1) / kChunkColumns;
  at::parallel_for(0, count * columns, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const Chunk& c = chunks[i / columns];
      const int64_t c0 = i % columns * kChunkColumns, c1 = std::min(n, c0 + kChunkColumns);
      expand(buf + c.begin * rank, rank, bp + c.slot * rank * n, n, yp + c.begin * ys, ys, c.end - c.begin, c0, c1);
    }
  });
}

}  // namespace

void add_lora(const at::Tensor& y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b,
              const at::Tensor& seg_starts, const at::Tensor& seg_slots) {
  const char* op = "kvforge_cpp.add_lora: ";
  const at::ScalarType dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, op,
              "x must be float32 or bfloat16 (the model's dtype), got ", dtype);
  check_features(op, "x", x, dtype);
  check_features(op, "y", y, dtype);
  TORCH_CHECK(y.size(0) == x.size(0), op, "y must have one row per token of x (", x.size(0), "), got ", y.size(0));
  TORCH_CHECK(a.dim() == 3, op, "a must be [slots, R, in], got ", a.sizes());
  const int64_t slots = a.size(0), rank = a.size(1);
  check_adapter(op, "a", a, dtype, slots, rank, x.size(1), "in", "x");
  check_adapter(op, "b", b, dtype, slots, rank, y.size(1), "out", "y");
  check_segments(op, seg_starts, seg_slots, x.size(0), slots);
  const std::vector<Chunk> chunks =
      active_chunks(seg_starts.data_ptr<int64_t>(), seg_slots.data_ptr<int64_t>(), seg_slots.size(0));
  if (chunks.empty() || y.size(1) == 0) return;
  const LoraPath& path = lora_path_here();
  if (dtype == at::kFloat) {
    run(path.shrink_f32, path.expand_f32, y, x, a, b, chunks);
  } else {
    run(path.shrink_bf16, path.expand_bf16, y, x, a, b, chunks);
  }
}

// The instruction set add_lora runs with here and now ("avx512", "avx2" or "baseline").
std::string lora_path() { return lora_path_here().name; }

TORCH_LIBRARY_FRAGMENT(kvforge_cpp, m) {
  m.def("add_lora(Tensor(a!) y, Tensor x, Tensor a, Tensor b, Tensor seg_starts, Tensor seg_slots) -> ()");
  m.def("lora_path() -> str");
}

TORCH_LIBRARY_IMPL(kvforge_cpp, CPU, m) {
  m.impl("add_lora", &add_lora);
}

TORCH_LIBRARY_IMPL(kvforge_cpp, CompositeExplicitAutograd, m) {
  m.impl("lora_path", &lora_path);
}

}  // namespace kvforge_cpp
