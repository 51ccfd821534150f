// The weight-only int8 linear over a packed weight, and the packing itself:
//
//   kvforge_cpp::int8_pack_weight(weight) -> Tensor       int8 [out, in] -> [ceil(out / 64), in, 64]
//   kvforge_cpp::int8_unpack_weight(packed, out) -> Tensor  back to [out, in]
//
// `int8_weight_linear(x, packed, scale, bias)` (int8_linear.cpp) hands a packed
// (3-D) weight to int8_packed_linear below; Int8Linear packs its weight once,
// when the layer is made. The layout (int8_linear_common.h, kPackChannels)
// puts one input of 64 channels in one line, so:
//
// - Up to kDequantizeRows rows (decodes, small batches) run int8_packed_tile.h:
//   a block of 64 channels is one stream, each line widened once per group of
//   rows and multiplied into 16 channels per vector, the sums never folded
//   across lanes. On AVX2, where one row's sums of a line fill the
//   registers, two rows or more walk the block a quarter line at a time
//   (walk_rows). float32 and bfloat16 rows alike, read as they are. Each
//   block's sums go straight to linear.cpp's epilogue (finish_blocks): the
//   per-channel scales, the bias and any residual add or SiLU x up, rounded
//   once.
// - More rows widen the weight once per call as int8_linear.cpp does for an
//   unpacked one, a line at a time without a transpose: float32 times the
//   scales into widened_linear (the epilogue in its tiles), or (bfloat16 rows
//   on AVX-512 BF16, from kWidenBf16Rows) bfloat16 pairs into
//   widened_bf16_linear, the scales and epilogue in its tiles.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>

#include "cpu_isa.h"
#include "f32_packed_rows.h"
#include "int8_linear_common.h"

#ifdef KVFORGE_HAS_X86_PATHS
#include <immintrin.h>
#endif

namespace kvforge_cpp {

namespace packed_base {
#include "bf16_vectors.h"
inline vf16 widen_w16(const int8_t* p) {
  vf16 v;
  for (int i = 0; i < 16; ++i) v[i] = static_cast<float>(p[i]);
  return v;
}
#define KVFORGE_VW_BYTES 16
#include "native_vectors.h"
inline vw widen_w(const int8_t* p) { return vw{float(p[0]), float(p[1]), float(p[2]), float(p[3])}; }
constexpr int kPackedRows = 1;  // 16 of the 16 SSE registers hold one row's sums
constexpr int kPackedUnroll = 1;  // no register is left for more inputs' x
constexpr int64_t kQuarterRows = 0;  // packed_tile one row at a time (no walk measured here)
#include "int8_packed_tile.h"
}  // namespace packed_base

#ifdef KVFORGE_HAS_X86_PATHS
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace packed_avx2 {
#include "bf16_vectors.h"
inline vf16 widen_w16(const int8_t* p) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
  const __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(bytes, 8)));
  return vf16{lo[0], lo[1], lo[2], lo[3], lo[4], lo[5], lo[6], lo[7],
              hi[0], hi[1], hi[2], hi[3], hi[4], hi[5], hi[6], hi[7]};
}
#define KVFORGE_VW_BYTES 32
#include "native_vectors.h"
inline vw widen_w(const int8_t* p) {
  return (vw)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
constexpr int kPackedRows = 1;  // 8 of the 16 ymm registers hold one row's sums
constexpr int kPackedUnroll = 4;  // with one input per pass the loop itself bound the tile
// Two rows or more walk the block (walk_rows), up to 6 rows at once: 12 sums, 2
// weight vectors and the input in the 16 registers.
constexpr int64_t kQuarterRows = 6;
#include "int8_packed_tile.h"
}  // namespace packed_avx2
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")
namespace packed_avx512 {
#include "bf16_vectors.h"
inline vf16 widen_w16(const int8_t* p) {
  return (vf16)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
#define KVFORGE_VW_BYTES 64
#include "native_vectors.h"
inline vw widen_w(const int8_t* p) { return widen_w16(p); }
constexpr int kPackedRows = 6;  // 24 of the 32 zmm registers hold the sums (a step verifying up to 5 drafts: one tile)
constexpr int kPackedUnroll = 4;
constexpr int64_t kQuarterRows = 0;  // packed_tile holds 4 rows of whole lines (no walk)
#include "int8_packed_tile.h"
}  // namespace packed_avx512
#pragma GCC pop_options
#endif

namespace {

// The functions of one ISA level.
struct PackedKernels {
  void (*rows_f32)(const float*, int64_t, int64_t, const int8_t*, int64_t, float*, int64_t);
  void (*rows_bf16)(const uint16_t*, int64_t, int64_t, const int8_t*, int64_t, float*, int64_t);
  void (*dequantize)(const int8_t*, int64_t, const float*, float*);
};

const PackedKernels& kernels_for(Isa level) {
  static const PackedKernels base{&packed_base::packed_rows<float>, &packed_base::packed_rows<uint16_t>,
                                  &packed_base::dequantize_packed_block};
#ifdef KVFORGE_HAS_X86_PATHS
  static const PackedKernels avx2{&packed_avx2::packed_rows<float>, &packed_avx2::packed_rows<uint16_t>,
                                  &packed_avx2::dequantize_packed_block};
  static const PackedKernels avx512{&packed_avx512::packed_rows<float>, &packed_avx512::packed_rows<uint16_t>,
                                    &packed_avx512::dequantize_packed_block};
  switch (level) {
    case Isa::kAvx512: return avx512;
    case Isa::kAvx2: return avx2;
    case Isa::kBaseline: break;
  }
#endif
  return base;
}

}  // namespace

at::Tensor int8_packed_linear(const at::Tensor& x_in, const at::Tensor& packed, const at::Tensor& scale_in,
                              const std::optional<at::Tensor>& bias_in, int mode,
                              const std::optional<at::Tensor>& other) {
  const char* op = "kvforge_cpp.int8_weight_linear: ";
  const int64_t m = x_in.size(0), k = x_in.size(1), n = scale_in.numel();
  const at::Tensor scale = scale_in.reshape({n}).contiguous();
  const at::Tensor bias = bias_in.has_value() ? bias_in->reshape({n}).to(at::kFloat).contiguous() : at::Tensor();
  const float* scale_ptr = scale.data_ptr<float>();
  const float* bias_ptr = bias.defined() ? bias.data_ptr<float>() : nullptr;
  const int8_t* w = packed.data_ptr<int8_t>();
  if (m == 0 || n == 0) return finish_rows(op, at::empty({m, n}, x_in.options()), mode, other, x_in.scalar_type());
  const Isa level = isa();
  const PackedKernels& kernels = kernels_for(level);
  const bool bf16_in = x_in.scalar_type() == at::kBFloat16;
  const int64_t block_bytes = k * kPackChannels;

#ifdef KVFORGE_HAS_X86_PATHS
  if (bf16_in && m >= kWidenBf16Rows && level == Isa::kAvx512 && has_avx512_bf16()) {
    const at::Tensor x = x_in.stride(1) == 1 ? x_in : x_in.contiguous();
    return widened_bf16_linear(op, reinterpret_cast<const uint16_t*>(x.data_ptr()), x.stride(0), m, k, n,
                               kPackChannels, scale_ptr, bias_ptr, mode, other,
                               [&](int64_t n0, int64_t n1, uint16_t* widened) {
                                 const int64_t pairs = (k + 1) / 2;
                                 for (int64_t c = n0; c < n1; c += kPackChannels) {
                                   packed_avx512::widen_packed_block_bf16(w + c / kPackChannels * block_bytes, k,
                                                                          widened + (c - n0) * pairs * 2);
                                 }
                               });
  }
#endif
  if (m >= kDequantizeRows) {
    // float32 rows as they are; bfloat16 rows widened once (rows x in: small next to the weight).
    const bool usable = x_in.scalar_type() == at::kFloat && x_in.stride(1) == 1;
    const at::Tensor x = usable ? x_in : x_in.to(at::kFloat).contiguous();
    return widened_linear(op, x.data_ptr<float>(), x.stride(0), m, k, n, kPackChannels, scale_ptr, bias_ptr, mode,
                          other, x_in.scalar_type(), [&](int64_t n0, int64_t n1, const float* s, float* widened) {
                            for (int64_t c = n0; c < n1; c += kPackChannels) {
                              kernels.dequantize(w + c / kPackChannels * block_bytes, k, s + (c - n0),
                                                 widened + (c - n0) * k);
                            }
                          });
  }
  // Each block's sums, the rows read as they are (bfloat16 widened as the tile reads them), through
  // the epilogue: the scales, bias and any residual or SiLU, rounded once.
  static_assert(kSumsBlock == kPackChannels, "finish_blocks takes one packed block's sums at a time");
  const at::Tensor x = x_in.stride(1) == 1 ? x_in : x_in.contiguous();
  return finish_blocks(op, m, n, scale_ptr, bias_ptr, mode, other, x_in.scalar_type(), [&](int64_t b, float* sums) {
    if (bf16_in) {
      kernels.rows_bf16(reinterpret_cast<const uint16_t*>(x.data_ptr()), x.stride(0), m, w + b * block_bytes, k,
                        sums, kPackChannels);
    } else {
      kernels.rows_f32(x.data_ptr<float>(), x.stride(0), m, w + b * block_bytes, k, sums, kPackChannels);
    }
  });
}

at::Tensor int8_pack_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kChar,
              "kvforge_cpp.int8_pack_weight: weight must be a 2-D int8 tensor [out, in], got ", weight.scalar_type(),
              " ", weight.sizes());
  const at::Tensor w = weight.contiguous();
  const int64_t n = w.size(0), k = w.size(1), blocks = (n + kPackChannels - 1) / kPackChannels;
  at::Tensor packed = at::zeros({blocks, k, kPackChannels}, w.options());
  const int8_t* src = w.data_ptr<int8_t>();
  int8_t* dst = packed.data_ptr<int8_t>();
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      for (int64_t c = b * kPackChannels; c < std::min(n, (b + 1) * kPackChannels); ++c) {
        for (int64_t d = 0; d < k; ++d) dst[(b * k + d) * kPackChannels + c % kPackChannels] = src[c * k + d];
      }
    }
  });
  return packed;
}

at::Tensor int8_unpack_weight(const at::Tensor& packed, int64_t out_features) {
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kChar && packed.size(2) == kPackChannels &&
                  packed.size(0) == (out_features + kPackChannels - 1) / kPackChannels,
              "kvforge_cpp.int8_unpack_weight: expected the int8 [ceil(", out_features, " / ", kPackChannels,
              "), in, ", kPackChannels, "] of int8_pack_weight, got ", packed.scalar_type(), " ", packed.sizes());
  const int64_t k = packed.size(1);
  return packed.permute({0, 2, 1}).reshape({-1, k}).narrow(0, 0, out_features).contiguous();
}

TORCH_LIBRARY_FRAGMENT(kvforge_cpp, m) {
  m.def("int8_pack_weight(Tensor weight) -> Tensor");
  m.def("int8_unpack_weight(Tensor packed, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvforge_cpp, CPU, m) {
  m.impl("int8_pack_weight", &int8_pack_weight);
  m.impl("int8_unpack_weight", &int8_unpack_weight);
}

}  // namespace kvforge_cpp
