// The sampler's inverse-CDF draw for CPUs, a torch.library custom op:
//
//   kvforge_cpp::inverse_cdf(probs, u) -> Tensor
//
// probs float32 [rows, vocab] (contiguous rows), u float64 [rows] in [0, 1).
// Row r's token is the first i whose cumulative sum cdf[i] = p[0] + ... + p[i],
// added left to right in float64, exceeds u[r] * cdf[vocab - 1]; none (rounding
// at the top) gives vocab - 1; a token of probability 0 there gives the row's
// argmax instead (its first maximum). These are the very sums and comparisons
// of `torch.cumsum(probs, -1, dtype=float64)` with `searchsorted(right=True)`,
// so the tokens are the ones that path draws, bit for bit, without writing a
// float64 CDF of rows x vocab: the running sums of eight rows advance side by
// side (eight independent additions hide the adder's latency), and each 64th
// sum is kept so the search rescans one stretch of 64 at most.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace kvforge_cpp {
namespace {

constexpr int64_t kRowsTogether = 8;
constexpr int64_t kStretch = 64;  // sums between two kept ones

// The token of one row, given its kept sums (kept[s] = cdf[(s + 1) * kStretch - 1],
// and the last one cdf[vocab - 1]).
int64_t draw_row(const float* p, int64_t vocab, const double* kept, double u) {
  const int64_t stretches = (vocab + kStretch - 1) / kStretch;
  const double threshold = u * kept[stretches - 1];
  // The first stretch whose last sum exceeds the threshold holds the token.
  const int64_t s = std::upper_bound(kept, kept + stretches, threshold) - kept;
  int64_t token = vocab - 1;
  if (s < stretches) {
    double sum = s > 0 ? kept[s - 1] : 0.0;  // exactly the running sum before the stretch
    const int64_t end = std::min(vocab, (s + 1) * kStretch);
    for (int64_t i = s * kStretch; i < end; ++i) {
      sum += static_cast<double>(p[i]);
      if (sum > threshold) {
        token = i;
        break;
      }
    }
  }
  if (p[token] == 0.f) token = std::max_element(p, p + vocab) - p;  // rounding landed on a masked token
  return token;
}

// Rows [r0, r0 + n), n <= kRowsTogether: the running sums side by side, then each row's draw.
void draw_rows(const float* probs, int64_t vocab, const double* u, int64_t r0, int64_t n, double* kept,
               int64_t* out) {
  const int64_t stretches = (vocab + kStretch - 1) / kStretch;
  double sum[kRowsTogether] = {};
  const float* row[kRowsTogether];
  for (int64_t r = 0; r < kRowsTogether; ++r) row[r] = probs + (r0 + std::min(r, n - 1)) * vocab;
  for (int64_t s = 0; s < stretches; ++s) {
    const int64_t end = std::min(vocab, (s + 1) * kStretch);
    for (int64_t i = s * kStretch; i < end; ++i) {
      for (int64_t r = 0; r < kRowsTogether; ++r) sum[r] += static_cast<double>(row[r][i]);
    }
    for (int64_t r = 0; r < kRowsTogether; ++r) kept[r * stretches + s] = sum[r];
  }
  for (int64_t r = 0; r < n; ++r) out[r0 + r] = draw_row(row[r], vocab, kept + r * stretches, u[r0 + r]);
}

}  // namespace

at::Tensor inverse_cdf(const at::Tensor& probs, const at::Tensor& u) {
  const char* op = "kvforge_cpp.inverse_cdf: ";
  TORCH_CHECK(probs.device().is_cpu() && u.device().is_cpu(), op, "tensors must be on the CPU");
  TORCH_CHECK(probs.dim() == 2 && probs.scalar_type() == at::kFloat && probs.is_contiguous() && probs.size(1) > 0,
              op, "probs must be a contiguous float32 [rows, vocab] with vocab > 0, got ", probs.scalar_type(), " ",
              probs.sizes());
  TORCH_CHECK(u.dim() == 1 && u.scalar_type() == at::kDouble && u.size(0) == probs.size(0), op,
              "u must be a float64 vector of one number per row (", probs.size(0), "), got ", u.scalar_type(), " ",
              u.sizes());
  const int64_t rows = probs.size(0), vocab = probs.size(1);
  at::Tensor out = at::empty({rows}, probs.options().dtype(at::kLong));
  const at::Tensor uc = u.contiguous();
  const float* p = probs.data_ptr<float>();
  const double* up = uc.data_ptr<double>();
  int64_t* o = out.data_ptr<int64_t>();
  const int64_t groups = (rows + kRowsTogether - 1) / kRowsTogether;
  const int64_t stretches = (vocab + kStretch - 1) / kStretch;
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    std::vector<double> kept(kRowsTogether * stretches);
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t r0 = g * kRowsTogether;
      draw_rows(p, vocab, up, r0, std::min(kRowsTogether, rows - r0), kept.data(), o);
    }
  });
  return out;
}

TORCH_LIBRARY_FRAGMENT(kvforge_cpp, m) {
  m.def("inverse_cdf(Tensor probs, Tensor u) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvforge_cpp, CPU, m) {
  m.impl("inverse_cdf", &inverse_cdf);
}

}  // namespace kvforge_cpp
