// The sampler's whole draw for CPUs, row by row, a torch.library custom op:
//
//   kvforge_cpp::sample_rows(logits, temperature, top_k, top_p, min_p, u) -> int[]
//
// logits float32 [rows, vocab] (contiguous rows, vocab > 0); one temperature,
// top_k, top_p and min_p per row (engine/sampling_params.py's meanings: top_k
// <= 0 or >= vocab keeps every token, top_p >= 1 and min_p <= 0 cut nothing);
// u float64 [rows] in [0, 1). Row r's token is drawn as engine/sampler.py
// defines it, in one pass of C++ instead of some twenty tensor ops:
//
//   temperature 0: the row's first maximum (a NaN counts as the maximum), as
//     torch.argmax; u is not read;
//   else y = logits / temperature (float32, as the tensor division), and
//     w_i = e^(y_i - max y), each token's weight relative to the most likely;
//   top-k keeps the k largest y; top-p then keeps the fewest of those, largest
//     first, whose weights reach top_p of the kept weights' sum (the nucleus:
//     the first token always, a token once the ones before it reach p, never);
//     tokens are ordered by y, ties by index (the lower first);
//   min-p drops every kept token with w_i < min_p (a probability below min_p
//     times the top one);
//   the token is the first, in vocabulary order, whose running sum of kept
//     weights exceeds u times their total (float64: the sums of blocks of 64
//     weights, then token by token inside the block that passes it).
//
// Sums are float64 and compare as the definition's exact arithmetic does, so
// the token is the definition's except where u, or top_p, falls within
// rounding of a boundary (tests/test_sample_rows_kernel.py checks the kernel
// against a float64 reference). No sort of the vocabulary: one pass puts each
// token in a bucket of (max y - y) of width 1/32 (the last bucket holds
// everything 16 or more below the maximum) with the bucket's count and weight;
// the buckets, largest values first, find the one where top-k or top-p cuts,
// and only that bucket's tokens are sorted. The cut is then a value and, among
// the tokens of exactly that value, the last index kept.
//
// The exponentials run on four-lane GCC vectors of the baseline instruction
// set (vector_exp.h), the same on every x86-64, so a seed draws the same
// tokens on any CPU. Rows split across threads when there are several.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#include "decoder_stack_ops.h"

namespace kvforge_cpp {
namespace {

// Four lanes: one SSE register. Wider GCC vectors are split on this instruction
// set, and their selects (in vector_exp.h) into one scalar per lane.
typedef float vf4 __attribute__((vector_size(16), aligned(4), may_alias));
typedef int32_t vi4 __attribute__((vector_size(16), aligned(4), may_alias));

#include "vector_exp.h"

constexpr int64_t kBuckets = 512;
constexpr float kBucketsPerUnit = 32.f;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Where a row's truncation cuts: every token with y > value is kept, and of
// those with y == value, the ones at index <= last_index.
struct Cut {
  float value = kNegInf;
  int64_t last_index = std::numeric_limits<int64_t>::max();

  bool keeps(float y, int64_t i) const { return y > value || (y == value && i <= last_index); }
};

struct RowSettings {
  double temperature, top_p, min_p;
  int64_t top_k;
};

// One thread's buffers, kept across calls (fresh ones each step would cost page
// faults on a large vocabulary) and grown to the largest vocabulary seen.
struct Scratch {
  std::vector<float> y, w;
  std::vector<uint16_t> bucket;
  std::vector<int64_t> count = std::vector<int64_t>(kBuckets);
  std::vector<double> mass = std::vector<double>(kBuckets);
  std::vector<std::pair<float, int64_t>> members, k_members;
  std::vector<double> block_sums;

  static Scratch& for_vocab(int64_t vocab) {
    thread_local Scratch scratch;
    if (static_cast<int64_t>(scratch.y.size()) < vocab) {
      scratch.y.resize(vocab);
      scratch.w.resize(vocab);
      scratch.bucket.resize(vocab);
    }
    return scratch;
  }
};

int64_t first_maximum(const float* x, int64_t vocab) {
  int64_t best = 0;
  for (int64_t i = 1; i < vocab; ++i) {
    if (std::isnan(x[best])) break;
    if (x[i] > x[best] || std::isnan(x[i])) best = i;
  }
  return best;
}

// The first `vocab % 4` lanes of a vector read past the last full one (the
// others `fill`), and the matching write: a row's tail, without reading past it.
vf4 load_tail(const float* p, int64_t n, float fill) {
  vf4 v = vf4{} + fill;
  for (int64_t l = 0; l < n; ++l) v[l] = p[l];
  return v;
}

void store_tail(float* p, int64_t n, vf4 v) {
  for (int64_t l = 0; l < n; ++l) p[l] = v[l];
}

// a where take, else b, in bit operations: a vector `?:` on floats is a max GCC
// splits into one scalar per lane on the baseline instruction set.
inline vf4 select(vi4 take, vf4 a, vf4 b) {
  return reinterpret_cast<vf4>((reinterpret_cast<vi4>(a) & take) | (reinterpret_cast<vi4>(b) & ~take));
}

// y = x / t (each lane an IEEE division, as the tensor division), and the largest y.
float scale_and_max(const float* x, int64_t vocab, float t, float* y) {
  const int64_t full = vocab / 4 * 4;
  vf4 top = vf4{} + kNegInf;
  for (int64_t i = 0; i < full; i += 4) {
    const vf4 v = *reinterpret_cast<const vf4*>(x + i) / t;
    *reinterpret_cast<vf4*>(y + i) = v;
    top = select(v > top, v, top);
  }
  if (full < vocab) {
    const vf4 v = load_tail(x + full, vocab - full, kNegInf) / t;
    store_tail(y + full, vocab - full, v);
    top = select(v > top, v, top);
  }
  float best = kNegInf;
  for (int l = 0; l < 4; ++l) best = std::max(best, top[l]);  // the maximum of any order of the same numbers
  return best;
}

// w = e^(y - top), four lanes at a time.
void weights(const float* y, float top, int64_t vocab, float* w) {
  const int64_t full = vocab / 4 * 4;
  for (int64_t i = 0; i < full; i += 4) {
    *reinterpret_cast<vf4*>(w + i) = exp_of<vf4, vi4>(*reinterpret_cast<const vf4*>(y + i) - top);
  }
  if (full < vocab) store_tail(w + full, vocab - full, exp_of<vf4, vi4>(load_tail(y + full, vocab - full, kNegInf) - top));
}

// The tokens of bucket b, largest y first, ties by index.
void sorted_members(const Scratch& s, int64_t vocab, int64_t b, std::vector<std::pair<float, int64_t>>& out) {
  out.clear();
  for (int64_t i = 0; i < vocab; ++i) {
    if (s.bucket[i] == b && s.y[i] > kNegInf) out.emplace_back(s.y[i], i);
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& c) {
    return a.first > c.first || (a.first == c.first && a.second < c.second);
  });
}

// Top-k, then top-p within it, over the row's y and w in `s`.
Cut truncation(Scratch& s, int64_t vocab, float top, int64_t k, double top_p) {
  std::fill(s.count.begin(), s.count.end(), 0);
  std::fill(s.mass.begin(), s.mass.end(), 0.0);
  int64_t finite = 0;
  for (int64_t i = 0; i < vocab; ++i) {
    if (!(s.y[i] > kNegInf)) {
      s.bucket[i] = kBuckets;  // a banned token: in no bucket, never kept by a cut
      continue;
    }
    const float depth = (top - s.y[i]) * kBucketsPerUnit;  // >= 0, and larger for smaller y
    const int64_t b = depth < static_cast<float>(kBuckets - 1) ? static_cast<int64_t>(depth) : kBuckets - 1;
    s.bucket[i] = static_cast<uint16_t>(b);
    ++s.count[b];
    s.mass[b] += s.w[i];
    ++finite;
  }
  Cut cut;
  // Top-k: the bucket where the count reaches k; the kept part of it, sorted.
  int64_t k_bucket = kBuckets, k_taken = 0;
  double kept_mass = 0.0, k_part_mass = 0.0;  // k_part_mass: of the tokens top-k keeps in k_bucket
  std::vector<std::pair<float, int64_t>>& k_members = s.k_members;
  if (k < finite) {
    int64_t before = 0;
    for (int64_t b = 0; b < kBuckets; ++b) {
      if (before + s.count[b] >= k) {
        k_bucket = b;
        k_taken = k - before;
        break;
      }
      before += s.count[b];
      kept_mass += s.mass[b];
    }
    sorted_members(s, vocab, k_bucket, k_members);
    for (int64_t j = 0; j < k_taken; ++j) k_part_mass += s.w[k_members[j].second];
    kept_mass += k_part_mass;
    cut.value = k_members[k_taken - 1].first;
    cut.last_index = k_members[k_taken - 1].second;
  } else {
    for (int64_t b = 0; b < kBuckets; ++b) kept_mass += s.mass[b];
  }
  if (!(top_p < 1.0)) return cut;
  // Top-p: the first bucket whose running weight reaches p of the kept weight; walked token by token.
  const double target = top_p * kept_mass;
  double reached = 0.0;
  for (int64_t b = 0; b <= std::min(k_bucket, kBuckets - 1); ++b) {
    const double bucket_mass = b == k_bucket ? k_part_mass : s.mass[b];
    if (reached + bucket_mass < target) {
      reached += bucket_mass;
      continue;
    }
    std::vector<std::pair<float, int64_t>>& members = s.members;
    if (b == k_bucket) {
      members.assign(k_members.begin(), k_members.begin() + k_taken);
    } else {
      sorted_members(s, vocab, b, members);
    }
    if (members.empty()) continue;
    // The last token kept is the one whose weight brings the running sum to the target
    // (rounding that leaves the sum short keeps the whole bucket).
    size_t last = members.size() - 1;
    for (size_t j = 0; j < members.size(); ++j) {
      reached += s.w[members[j].second];
      if (reached >= target) {
        last = j;
        break;
      }
    }
    cut.value = members[last].first;
    cut.last_index = members[last].second;
    return cut;
  }
  return cut;  // rounding kept the sum short of p everywhere: the top-k cut alone
}

// Sets to 0 the weight of every token the cut or min-p drops (and a NaN's).
void drop(float* w, const float* y, int64_t vocab, const Cut& cut, float floor) {
  int64_t i = 0;
  if (cut.value == kNegInf && cut.last_index >= vocab) {  // no cut (the usual case): min-p alone, four lanes at a time
    for (; i + 4 <= vocab; i += 4) {
      vf4& weight = *reinterpret_cast<vf4*>(w + i);
      weight = select((weight >= floor) & (weight > 0.f), weight, vf4{});
    }
  }
  for (; i < vocab; ++i) {
    if (!(cut.keeps(y[i], i) && w[i] >= floor && w[i] > 0.f)) w[i] = 0.f;
  }
}

constexpr int64_t kBlock = 64;  // weights summed together before the running sum looks inside

// The sum of w[begin, end) in float64: eight partial sums side by side, then a fixed tree.
double block_sum(const float* w, int64_t begin, int64_t end) {
  double lane[8] = {};
  int64_t i = begin;
  for (; i + 8 <= end; i += 8) {
    for (int l = 0; l < 8; ++l) lane[l] += static_cast<double>(w[i + l]);
  }
  for (int l = 0; i < end; ++i, ++l) lane[l] += static_cast<double>(w[i]);
  return ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
}

int64_t sample_row(const float* x, int64_t vocab, const RowSettings& settings, double u, Scratch& s) {
  if (settings.temperature == 0.0) return first_maximum(x, vocab);
  float* y = s.y.data();
  float* w = s.w.data();
  const float top = scale_and_max(x, vocab, static_cast<float>(settings.temperature), y);
  if (!(top > kNegInf)) return first_maximum(x, vocab);  // every token banned: nothing to draw from
  weights(y, top, vocab, w);
  const int64_t k = settings.top_k > 0 && settings.top_k < vocab ? settings.top_k : vocab;
  Cut cut;
  if (k < vocab || settings.top_p < 1.0) cut = truncation(s, vocab, top, k, settings.top_p);
  drop(w, y, vocab, cut, settings.min_p > 0.0 ? static_cast<float>(settings.min_p) : 0.f);
  // The token: the running sum block by block, then token by token inside the block that passes u * total.
  const int64_t blocks = (vocab + kBlock - 1) / kBlock;
  std::vector<double>& sums = s.block_sums;
  sums.resize(blocks);
  double total = 0.0;
  for (int64_t b = 0; b < blocks; ++b) {
    sums[b] = block_sum(w, b * kBlock, std::min(vocab, (b + 1) * kBlock));
    total += sums[b];
  }
  const double threshold = u * total;
  double running = 0.0;
  for (int64_t b = 0; b < blocks; ++b) {
    if (running + sums[b] > threshold) {
      double sum = running;  // token by token (rounding that keeps it short moves on to the next block)
      for (int64_t i = b * kBlock; i < std::min(vocab, (b + 1) * kBlock); ++i) {
        sum += static_cast<double>(w[i]);
        if (w[i] > 0.f && sum > threshold) return i;
      }
    }
    running += sums[b];
  }
  return first_maximum(y, vocab);  // rounding at the very top of the sum: the most likely token
}

}  // namespace

std::vector<int64_t> sample_rows(const at::Tensor& logits, at::ArrayRef<double> temperature,
                                 at::ArrayRef<int64_t> top_k, at::ArrayRef<double> top_p,
                                 at::ArrayRef<double> min_p, const at::Tensor& u) {
  const char* op = "kvforge_cpp.sample_rows: ";
  TORCH_CHECK(logits.device().is_cpu() && u.device().is_cpu(), op, "tensors must be on the CPU");
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous() &&
                  logits.size(1) > 0,
              op, "logits must be a contiguous float32 [rows, vocab] with vocab > 0, got ", logits.scalar_type(),
              " ", logits.sizes());
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK(vocab < (int64_t{1} << 31), op, "a vocabulary of ", vocab, " entries is too large");
  TORCH_CHECK(u.dim() == 1 && u.scalar_type() == at::kDouble && u.size(0) == rows, op,
              "u must be a float64 vector of one number per row (", rows, "), got ", u.scalar_type(), " ", u.sizes());
  const auto given = [&](size_t n) { return static_cast<int64_t>(n) == rows; };
  TORCH_CHECK(given(temperature.size()) && given(top_k.size()) && given(top_p.size()) && given(min_p.size()), op,
              "temperature, top_k, top_p and min_p must hold one value per row (", rows, "), got ",
              temperature.size(), ", ", top_k.size(), ", ", top_p.size(), " and ", min_p.size());
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(temperature[r] >= 0.0, op, "row ", r, ": temperature must be >= 0, got ", temperature[r]);
  }
  const at::Tensor uc = u.contiguous();
  const float* x = logits.data_ptr<float>();
  const double* draws = uc.data_ptr<double>();
  std::vector<int64_t> out(rows);
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    Scratch& scratch = Scratch::for_vocab(vocab);
    for (int64_t r = r0; r < r1; ++r) {
      out[r] = sample_row(x + r * vocab, vocab, RowSettings{temperature[r], top_p[r], min_p[r], top_k[r]}, draws[r],
                          scratch);
    }
  });
  return out;
}

TORCH_LIBRARY_FRAGMENT(kvforge_cpp, m) {
  m.def("sample_rows(Tensor logits, float[] temperature, int[] top_k, float[] top_p, float[] min_p, Tensor u) "
        "-> int[]");
}

TORCH_LIBRARY_IMPL(kvforge_cpp, CPU, m) {
  m.impl("sample_rows", &sample_rows);
}

}  // namespace kvforge_cpp
