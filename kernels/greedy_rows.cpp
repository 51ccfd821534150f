// The greedy token of each logit row and its finiteness in one pass, a
// torch.library custom op for CPUs:
//
//   kvforge_cpp::greedy_rows(logits) -> int[]
//
// logits float32 [rows, vocab] (contiguous rows, vocab > 0). Row r's entry is
// the index of its first maximum, the token `torch.argmax` (and numpy's argmax)
// picks, or -1 when the row holds a NaN or an infinity. The engine's plain
// steps (engine/step_sampling.py) call it right after the model: one call
// instead of a finiteness check and an argmax, and the answer comes back as
// Python integers, with no tensor made.
//
// A row is read twice: once for its maximum and finiteness, sixteen lanes side
// by side (AVX2 where the CPU has it, as `isa()` allows), then up to its first
// maximum.
// The maximum of finite numbers does not depend on the order they are compared
// in, and -0.0 == 0.0 in the second pass, so the index is the first entry equal
// to the maximum, as argmax's.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu_isa.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

namespace kvforge_cpp {
namespace {

// Float and int vectors of W lanes, W * 4 bytes: one SSE register (W = 4, the
// baseline) or one AVX register (W = 8, compiled under the AVX2 target).
template <int W>
struct Lanes {
  typedef float F __attribute__((vector_size(4 * W), aligned(4), may_alias));
  typedef int32_t I __attribute__((vector_size(4 * W), aligned(4), may_alias));
};

// The first maximum of a row, or -1 when it holds a NaN or an infinity, reading
// sixteen floats a round in 16 / W vectors. Always inlined, so each caller below
// compiles it for its own instruction set.
template <int W>
__attribute__((always_inline)) inline int64_t greedy_row(const float* p, int64_t vocab) {
  typedef typename Lanes<W>::F F;
  typedef typename Lanes<W>::I I;
  constexpr int kVectors = 16 / W;
  constexpr float kInf = std::numeric_limits<float>::infinity();
  F top[kVectors], probe[kVectors];  // probe: sums of v - v, 0 while every v is finite, else NaN
  for (int h = 0; h < kVectors; ++h) {
    top[h] = F{} - kInf;
    probe[h] = F{};
  }
  const int64_t full = vocab / 16 * 16;
  for (int64_t i = 0; i < full; i += 16) {
    for (int h = 0; h < kVectors; ++h) {
      const F v = *reinterpret_cast<const F*>(p + i + W * h);
      const I take = v > top[h];  // v > top ? v : top, in bit operations (SSE2 has no blend)
      top[h] = reinterpret_cast<F>((reinterpret_cast<I>(v) & take) | (reinterpret_cast<I>(top[h]) & ~take));
      probe[h] += v - v;
    }
  }
  float best = -kInf, check = 0.f;
  for (int h = 0; h < kVectors; ++h) {
    for (int l = 0; l < W; ++l) {
      best = top[h][l] > best ? top[h][l] : best;
      check += probe[h][l];
    }
  }
  for (int64_t i = full; i < vocab; ++i) {
    best = p[i] > best ? p[i] : best;
    check += p[i] - p[i];
  }
  if (check != 0.f) return -1;  // NaN: a NaN or an infinity somewhere in the row
  for (int64_t i = 0; i < full; i += 16) {  // the first run of sixteen holding the maximum, then its entry
    I hit = I{};
    for (int h = 0; h < kVectors; ++h) hit |= *reinterpret_cast<const F*>(p + i + W * h) == best;
    bool found = false;
    for (int l = 0; l < W; ++l) found |= hit[l] != 0;
    if (found) return std::find(p + i, p + i + 16, best) - p;
  }
  return std::find(p + full, p + vocab, best) - p;
}

int64_t greedy_row_baseline(const float* p, int64_t vocab) { return greedy_row<4>(p, vocab); }

#ifdef KVFORGE_HAS_X86_PATHS
__attribute__((target("avx2"))) int64_t greedy_row_avx2(const float* p, int64_t vocab) {
  return greedy_row<8>(p, vocab);
}
#endif

}  // namespace

std::vector<int64_t> greedy_rows(const at::Tensor& logits) {
  const char* op = "kvforge_cpp.greedy_rows: ";
  TORCH_CHECK(logits.device().is_cpu(), op, "logits must be on the CPU, got ", logits.device());
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous() && logits.size(1) > 0,
              op, "logits must be a contiguous float32 [rows, vocab] with vocab > 0, got ", logits.scalar_type(), " ",
              logits.sizes(), logits.is_contiguous() ? "" : " (not contiguous)");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  const float* x = logits.data_ptr<float>();
  std::vector<int64_t> out(rows);
  int64_t (*row_of)(const float*, int64_t) = greedy_row_baseline;
#ifdef KVFORGE_HAS_X86_PATHS
  if (isa() != Isa::kBaseline) row_of = greedy_row_avx2;
#endif
  // Rows split across threads only when there is enough to read (a batch of large vocabularies).
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / vocab);
  at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) out[r] = row_of(x + r * vocab, vocab);
  });
  return out;
}

TORCH_LIBRARY_FRAGMENT(kvforge_cpp, m) {
  m.def("greedy_rows(Tensor logits) -> int[]");
}

TORCH_LIBRARY_IMPL(kvforge_cpp, CPU, m) {
  m.impl("greedy_rows", &greedy_rows);
}

}  // namespace kvforge_cpp
