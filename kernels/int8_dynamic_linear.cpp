// W8A8 linear for CPUs (dynamic per-token int8 activations), a torch.library custom op:
//
//   kvforge_cpp::int8_dynamic_linear(x, weight, scale, bias=None, epilogue="none",
//                                    other=None) -> Tensor
//
// y = (q_x @ weight^T) * s_x * scale + bias, with x float32 or bfloat16
// [rows, in], weight int8 [out, in], scale float32 [out] (one per output
// channel), bias [out] or None; y has x's dtype. Each row of x is rounded to
// int8 with its own absmax scale s_x (so a row's result never depends on the
// rest of the batch), the int8 x int8 -> int32 product is AVX-512 VNNI dot
// products for up to kVnniRows rows (w8a8_vnni below) and oneDNN's
// `at::_int_mm` above, and the int32 sums become floats in one pass
// (int8_rows.h). One call where the torch ops it replaces were ten
// (quantize_rows and the rescale in models/quantized_linear.py, which stay the
// path without this library and the reference the tests hold it to).
// `epilogue` as int8_weight_linear's (int8_linear.cpp), on the float32 outputs,
// each row rescaled straight into it (finish_each_row).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "cpu_isa.h"
#include "int8_linear_common.h"

#ifdef KVFORGE_HAS_X86_PATHS
#include <immintrin.h>
#endif

namespace kvforge_cpp {

// The row kernels of one instruction set, for float32 and bfloat16 (uint16_t)
// rows: each ISA namespace's int8_rows.h defines its kRowKernels.
struct Int8RowKernels {
  float (*quantize_f32)(const float*, int64_t, int8_t*, float);
  float (*quantize_bf16)(const uint16_t*, int64_t, int8_t*, float);
  void (*rescale_f32)(const int32_t*, int64_t, float, const float*, const float*, float*);
  void (*rescale_bf16)(const int32_t*, int64_t, float, const float*, const float*, uint16_t*);
};

namespace w8a8_base {
#include "bf16_vectors.h"
#include "int8_rows.h"
}  // namespace w8a8_base

#ifdef KVFORGE_HAS_X86_PATHS
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace w8a8_avx2 {
#include "bf16_vectors.h"
#include "int8_rows.h"
}  // namespace w8a8_avx2
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")
namespace w8a8_avx512 {
#include "bf16_vectors.h"
#include "int8_rows.h"
}  // namespace w8a8_avx512
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")
namespace w8a8_vnni {
// acc[r * n + c] = sum_d q_r[d] w_c[d] for rows r < MR and channels c in [c0, c1),
// from the rows as unsigned bytes (xu = q + 128, [MR, k]): vpdpbusd multiplies
// unsigned by signed bytes, so sum (q + 128) w - 128 sum w, the second sum
// taken by the same instruction against ones. Exact while 255 * 127 * k fits
// int32. Channel after channel, each one stream the prefetch runs ahead of:
// few rows are bound by reading the weight, where oneDNN's GEMM read it at
// about half the bandwidth (docs/quantization.md).
template <int MR>
void dot_channels(const uint8_t* xu, int64_t k, const int8_t* w, int64_t n, int64_t c0, int64_t c1, int32_t* acc) {
  const __m512i ones = _mm512_set1_epi8(1);
  const int64_t whole = k / 64 * 64;
  const __mmask64 tail = k == whole ? 0 : ~0ULL >> (64 - (k - whole));
  for (int64_t c = c0; c < c1; ++c) {
    const int8_t* wc = w + c * k;
    __m512i sum[MR], wsum = _mm512_setzero_si512();
    for (int r = 0; r < MR; ++r) sum[r] = _mm512_setzero_si512();
    for (int64_t d = 0; d < whole; d += 64) {
      __builtin_prefetch(wc + d + kWeightsAhead, 0, 2);
      const __m512i wv = _mm512_loadu_si512(wc + d);
      wsum = _mm512_dpbusd_epi32(wsum, ones, wv);
      for (int r = 0; r < MR; ++r) sum[r] = _mm512_dpbusd_epi32(sum[r], _mm512_loadu_si512(xu + r * k + d), wv);
    }
    if (tail != 0) {  // masked loads read nothing past the end and give zeros there
      const __m512i wv = _mm512_maskz_loadu_epi8(tail, wc + whole);
      wsum = _mm512_dpbusd_epi32(wsum, ones, wv);
      for (int r = 0; r < MR; ++r) {
        sum[r] = _mm512_dpbusd_epi32(sum[r], _mm512_maskz_loadu_epi8(tail, xu + r * k + whole), wv);
      }
    }
    const int32_t correction = 128 * _mm512_reduce_add_epi32(wsum);
    for (int r = 0; r < MR; ++r) acc[r * n + c] = _mm512_reduce_add_epi32(sum[r]) - correction;
  }
}
}  // namespace w8a8_vnni
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace w8a8_avx2_dot {
// As w8a8_vnni::dot_channels, on AVX2: the rows come widened to int16 (xw, [MR, k]),
// each 16 weights are widened the same way and vpmaddwd sums their products in
// pairs into int32 lanes. Exact for any int8 values while 2 * 128 * 128 * k / 2
// fits int32 (k <= kDotMaxIn).
template <int MR>
void dot_channels(const int16_t* xw, int64_t k, const int8_t* w, int64_t n, int64_t c0, int64_t c1, int32_t* acc) {
  const int64_t whole = k / 16 * 16;
  for (int64_t c = c0; c < c1; ++c) {
    const int8_t* wc = w + c * k;
    __m256i sum[MR];
    for (int r = 0; r < MR; ++r) sum[r] = _mm256_setzero_si256();
    for (int64_t d = 0; d < whole; d += 16) {
      __builtin_prefetch(wc + d + kWeightsAhead, 0, 0);  // non-temporal, as int8_packed_tile.h
      const __m256i wv = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wc + d)));
      for (int r = 0; r < MR; ++r) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xw + r * k + d));
        sum[r] = _mm256_add_epi32(sum[r], _mm256_madd_epi16(xv, wv));
      }
    }
    for (int r = 0; r < MR; ++r) {
      const __m128i half = _mm_add_epi32(_mm256_castsi256_si128(sum[r]), _mm256_extracti128_si256(sum[r], 1));
      const __m128i pairs = _mm_add_epi32(half, _mm_shuffle_epi32(half, 0x4e));
      int32_t total = _mm_cvtsi128_si32(_mm_add_epi32(pairs, _mm_shuffle_epi32(pairs, 0xb1)));
      for (int64_t d = whole; d < k; ++d) total += int32_t{xw[r * k + d]} * int32_t{wc[d]};
      acc[r * n + c] = total;
    }
  }
}
}  // namespace w8a8_avx2_dot
#pragma GCC pop_options
#endif

namespace {

constexpr const char* kOp = "kvforge_cpp.int8_dynamic_linear";
constexpr const char* kOpPrefix = "kvforge_cpp.int8_dynamic_linear: ";  // for the messages of finish_rows
// Values per parallel task of the row passes: fewer and a thread's start costs more than its work.
constexpr int64_t kValuesPerTask = 16384;

const Int8RowKernels& row_kernels(Isa level) {
#ifdef KVFORGE_HAS_X86_PATHS
  switch (level) {
    case Isa::kAvx512: return w8a8_avx512::kRowKernels;
    case Isa::kAvx2: return w8a8_avx2::kRowKernels;
    case Isa::kBaseline: break;
  }
#endif
  return w8a8_base::kRowKernels;
}

int64_t rows_per_task(int64_t values_per_row) {
  return std::max<int64_t>(1, kValuesPerTask / std::max<int64_t>(1, values_per_row));
}

// Rows up to which W8A8 takes w8a8_vnni::dot_channels (AVX-512 VNNI), not
// oneDNN: with the weight in memory, faster at every count up to 24 and slower
// from 28 (docs/quantization.md).
constexpr int64_t kVnniRows = 24;
// Input features up to which those sums stay exact in int32 (255 * 127 * k < 2^31).
constexpr int64_t kVnniMaxIn = 65536;
// Output channels per parallel task of the VNNI path.
constexpr int64_t kChannelBlock = 64;

bool takes_vnni(int64_t m, int64_t k) {
  return m <= kVnniRows && k <= kVnniMaxIn && isa() == Isa::kAvx512 && has_avx512_vnni();
}

// Input features up to which w8a8_avx2_dot::dot_channels's sums stay exact. On a
// CPU whose best level is AVX2 it takes every row count: oneDNN's int8 GEMM
// there measured 7-50x slower at 1-16 rows and no faster above
// (docs/quantization.md).
constexpr int64_t kDotMaxIn = 65536;

bool takes_avx2_dot(int64_t k) { return k <= kDotMaxIn && isa() == Isa::kAvx2; }

// Channel blocks in parallel, four rows at a time: a block's weights come from
// memory for the first four rows, from cache after. `x` is the rows as the dot
// kernel takes them ([m, k] of T), dots[i] its kernel for i + 1 rows.
template <typename T>
at::Tensor dot_channel_blocks(const std::vector<T>& x, int64_t m, int64_t k, const at::Tensor& weight,
                              void (*const dots[4])(const T*, int64_t, const int8_t*, int64_t, int64_t, int64_t,
                                                    int32_t*)) {
  const int64_t n = weight.size(0);
  at::Tensor acc = at::empty({m, n}, weight.options().dtype(at::kInt));
  int32_t* acc_ptr = acc.data_ptr<int32_t>();
  const int8_t* w = weight.data_ptr<int8_t>();
  at::parallel_for(0, (n + kChannelBlock - 1) / kChannelBlock, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t c0 = b * kChannelBlock, c1 = std::min(n, c0 + kChannelBlock);
      for (int64_t r = 0; r < m; r += 4) dots[std::min<int64_t>(4, m - r) - 1](x.data() + r * k, k, w, n, c0, c1,
                                                                              acc_ptr + r * n);
    }
  });
  return acc;
}

// q [m, k] times weight [n, k] transposed, as int32 sums [m, n]. torch._int_mm
// on CPU returns wrong sums when k is 1 (seen with torch 2.13), so that case is
// an outer product.
at::Tensor int8_matmul(const at::Tensor& q, const at::Tensor& weight) {
  const int64_t m = q.size(0), k = q.size(1), n = weight.size(0);
#ifdef KVFORGE_HAS_X86_PATHS
  const int8_t* q_ptr = q.data_ptr<int8_t>();
  if (takes_vnni(m, k)) {
    std::vector<uint8_t> xu(m * k);
    for (int64_t i = 0; i < m * k; ++i) xu[i] = static_cast<uint8_t>(q_ptr[i] ^ 0x80);  // q + 128
    using Dot = void (*)(const uint8_t*, int64_t, const int8_t*, int64_t, int64_t, int64_t, int32_t*);
    static constexpr Dot kDots[] = {&w8a8_vnni::dot_channels<1>, &w8a8_vnni::dot_channels<2>,
                                    &w8a8_vnni::dot_channels<3>, &w8a8_vnni::dot_channels<4>};
    return dot_channel_blocks(xu, m, k, weight, kDots);
  }
  if (takes_avx2_dot(k)) {
    const std::vector<int16_t> xw(q_ptr, q_ptr + m * k);
    using Dot = void (*)(const int16_t*, int64_t, const int8_t*, int64_t, int64_t, int64_t, int32_t*);
    static constexpr Dot kDots[] = {&w8a8_avx2_dot::dot_channels<1>, &w8a8_avx2_dot::dot_channels<2>,
                                    &w8a8_avx2_dot::dot_channels<3>, &w8a8_avx2_dot::dot_channels<4>};
    return dot_channel_blocks(xw, m, k, weight, kDots);
  }
#endif
  if (k == 1) return at::mul(q.to(at::kInt), weight.t().to(at::kInt));
  return at::_int_mm(q, weight.t());
}

}  // namespace

at::Tensor int8_dynamic_linear(const at::Tensor& x_in, const at::Tensor& weight, const at::Tensor& scale_in,
                               const std::optional<at::Tensor>& bias_in, const std::string& epilogue,
                               const std::optional<at::Tensor>& other) {
  const int mode = epilogue_mode(kOpPrefix, epilogue);
  TORCH_CHECK(weight.dim() == 2, kOp, ": weight must be the int8 [out, in] (not packed by int8_pack_weight, which "
              "only int8_weight_linear reads), got ", weight.scalar_type(), " ", weight.sizes());
  check_int8_linear_inputs(kOp, x_in, weight, scale_in, bias_in);
  const int64_t m = x_in.size(0), k = x_in.size(1), n = weight.size(0);
  TORCH_CHECK(k > 0, kOp, ": the weight has no input features");
  const bool bf16 = x_in.scalar_type() == at::kBFloat16;
  const bool bf16_out = bf16 && mode == 0;  // an epilogue takes float32 outputs, rounded once after it
  const at::Tensor x = x_in.stride(1) == 1 ? x_in : x_in.contiguous();
  const at::Tensor scale = scale_in.reshape({n}).contiguous();
  const at::Tensor bias = bias_in.has_value() ? bias_in->reshape({n}).to(at::kFloat).contiguous() : at::Tensor();
  const at::TensorOptions out_options = x_in.options().dtype(bf16_out ? at::kBFloat16 : at::kFloat);
  if (m == 0 || n == 0) return finish_rows(kOpPrefix, at::empty({m, n}, out_options), mode, other, x_in.scalar_type());

  const Int8RowKernels& rows = row_kernels(isa());
  const float tiny = std::numeric_limits<float>::min();
  at::Tensor q = at::empty({m, k}, x_in.options().dtype(at::kChar));
  std::vector<float> row_scale(m);
  int8_t* q_ptr = q.data_ptr<int8_t>();
  const int64_t x_stride = x.stride(0);
  at::parallel_for(0, m, rows_per_task(k), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      row_scale[r] = bf16 ? rows.quantize_bf16(reinterpret_cast<const uint16_t*>(x.data_ptr()) + r * x_stride, k,
                                               q_ptr + r * k, tiny)
                          : rows.quantize_f32(x.data_ptr<float>() + r * x_stride, k, q_ptr + r * k, tiny);
    }
  });

  const at::Tensor acc = int8_matmul(q, weight);  // int32 [m, n], exact
  const int32_t* acc_ptr = acc.data_ptr<int32_t>();
  const float* scale_ptr = scale.data_ptr<float>();
  const float* bias_ptr = bias.defined() ? bias.data_ptr<float>() : nullptr;
  if (mode != 0) {  // each row rescaled straight into the epilogue
    return finish_each_row(kOpPrefix, m, n, mode, other, x_in.scalar_type(), [&](int64_t r, float* row) {
      rows.rescale_f32(acc_ptr + r * n, n, row_scale[r], scale_ptr, bias_ptr, row);
      return static_cast<const float*>(row);
    });
  }
  at::Tensor out = at::empty({m, n}, out_options);
  at::parallel_for(0, m, rows_per_task(n), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      if (bf16_out) {
        rows.rescale_bf16(acc_ptr + r * n, n, row_scale[r], scale_ptr, bias_ptr,
                          reinterpret_cast<uint16_t*>(out.data_ptr()) + r * n);
      } else {
        rows.rescale_f32(acc_ptr + r * n, n, row_scale[r], scale_ptr, bias_ptr, out.data_ptr<float>() + r * n);
      }
    }
  });
  return finish_rows(kOpPrefix, out, mode, other, x_in.scalar_type());
}

// Which product int8_dynamic_linear takes for `rows` x `in_features` here and
// now ("avx512_vnni", "avx2_dot", "outer_product" or "onednn"), for tests and benchmarks.
std::string int8_dynamic_linear_path(int64_t rows, int64_t in_features) {
  if (takes_vnni(rows, in_features)) return "avx512_vnni";
  if (takes_avx2_dot(in_features)) return "avx2_dot";
  return in_features == 1 ? "outer_product" : "onednn";
}

TORCH_LIBRARY_FRAGMENT(kvforge_cpp, m) {
  m.def("int8_dynamic_linear(Tensor x, Tensor weight, Tensor scale, Tensor? bias=None, str epilogue=\"none\", "
        "Tensor? other=None) -> Tensor");
  m.def("int8_dynamic_linear_path(int rows, int in_features) -> str");
}

TORCH_LIBRARY_IMPL(kvforge_cpp, CPU, m) {
  m.impl("int8_dynamic_linear", &int8_dynamic_linear);
}

TORCH_LIBRARY_IMPL(kvforge_cpp, CompositeExplicitAutograd, m) {
  m.impl("int8_dynamic_linear_path", &int8_dynamic_linear_path);
}

}  // namespace kvforge_cpp
