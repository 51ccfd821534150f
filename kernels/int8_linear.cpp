// kvforge's weight-only int8 linear for CPUs, a torch.library custom op:
//
//   kvforge_cpp::int8_weight_linear(x, weight, scale, bias=None, epilogue="none",
//                                   other=None) -> Tensor
//
// y = x (weight * scale[:, None])^T + bias, with x float32 or bfloat16 [rows, in],
// weight int8 [out, in] (or packed by int8_pack_weight: int8_packed_linear.cpp,
// the layout Int8Linear keeps), scale float32 [out] (one per output channel), bias
// [out] or None; y has x's dtype. Activations stay float (W8A16 in vLLM's
// words): only the weight is quantized. Decodes and small batches widen it to
// float inside the register tiles (int8_linear_tile.h), never a float copy in
// memory, so a decode step reads one byte per weight where float32 reads four;
// output channels are split into blocks that run in parallel (at::parallel_for).
// From kDequantizeRows rows (batches, prefills) the arithmetic is the cost, not
// the reading: groups of about 1 MiB of the weight are widened once into the
// layout of linear.cpp's tiles, which then run over every row
// (f32_packed_rows.h), groups in parallel: float32 times the scales for float32
// rows, the epilogue in the tiles (widened_linear); for bfloat16 rows on
// AVX-512 BF16, bfloat16 as it is (exact), the scales applied to the sums in
// the epilogue.
// `epilogue` "add" (+ other, a residual of x's dtype) or "silu_mul" (silu(gate)
// * up, their rows alternating in blocks of 16: models/quantized_linear.py's
// Int8GateUp) runs linear.cpp's epilogue on the float32 outputs before the one
// rounding: in the tiles for many float32 rows (widened_linear), else over the
// float32 outputs after (finish_rows; on AVX-512 BF16 many bfloat16 rows hand
// it their float32 sums, and few take the float32 rows' path).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
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

// Rows per chunk of the batch tiles (both tile headers): 64 rows of x stay in
// L2 while every channel of a block passes over them. Over all m rows at
// once, each four channels' pass read x from L3 again.
constexpr int64_t kBatchChunkRows = 64;

namespace linear_base {
#include "bf16_vectors.h"
inline vf16 widen_w16(const int8_t* p) {
  vf16 v;
  for (int i = 0; i < 16; ++i) v[i] = static_cast<float>(p[i]);
  return v;
}
#include "int8_linear_tile.h"
}  // namespace linear_base

#ifdef KVFORGE_HAS_X86_PATHS
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace linear_avx2 {
#include "bf16_vectors.h"
inline vf16 widen_w16(const int8_t* p) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
  const __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(bytes, 8)));
  return vf16{lo[0], lo[1], lo[2], lo[3], lo[4], lo[5], lo[6], lo[7],
              hi[0], hi[1], hi[2], hi[3], hi[4], hi[5], hi[6], hi[7]};
}
#include "int8_linear_tile.h"
}  // namespace linear_avx2
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")
namespace linear_avx512 {
#include "bf16_vectors.h"
inline vf16 widen_w16(const int8_t* p) {
  return (vf16)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
#include "int8_linear_tile.h"
}  // namespace linear_avx512
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,avx2,fma,f16c")
namespace linear_avx512_bf16 {
#include "int8_linear_bf16.h"
}  // namespace linear_avx512_bf16
#pragma GCC pop_options
#endif

namespace {

// Output channels per parallel task: small enough that a decode of the
// smallest layers still feeds every thread.
constexpr int64_t kChannelBlock = 64;

using WidenBlock = void (*)(const int8_t*, int64_t, const float*, float*);

WidenBlock widen_block_for(Isa level) {
#ifdef KVFORGE_HAS_X86_PATHS
  switch (level) {
    case Isa::kAvx512: return &linear_avx512::widen_block16;
    case Isa::kAvx2: return &linear_avx2::widen_block16;
    case Isa::kBaseline: break;
  }
#endif
  return &linear_base::widen_block16;
}

// Channels [n0, n1) of `w` times their scales (`scale[c]` for channel n0 + c),
// as f32_packed_rows reads a weight: [blocks][k][16], channel 16 b + c of the
// range at packed[(b k + d) 16 + c], the rest of the last block zero. Whole
// blocks of 16 channels take `widen` (widen_block16 of the ISA in use).
void dequantize_group(const int8_t* w, int64_t k, const float* scale, int64_t n0, int64_t n1, float* packed,
                      WidenBlock widen) {
  const int64_t blocks = (n1 - n0 + 15) / 16, whole = (n1 - n0) / 16;
  for (int64_t b = 0; b < whole; ++b) widen(w + (n0 + 16 * b) * k, k, scale + 16 * b, packed + b * k * 16);
  for (int64_t b = whole; b < blocks; ++b) {
    for (int64_t c = 0; c < 16; ++c) {
      const int64_t channel = n0 + 16 * b + c;
      float* dst = packed + b * k * 16 + c;
      if (channel >= n1) {
        for (int64_t d = 0; d < k; ++d) dst[d * 16] = 0.f;
        continue;
      }
      const int8_t* row = w + channel * k;
      const float s = scale[channel - n0];
      for (int64_t d = 0; d < k; ++d) dst[d * 16] = static_cast<float>(row[d]) * s;
    }
  }
}

// Channels [n0, n1) of `w` as widened_bf16_linear reads a weight, unscaled (every
// int8 is exactly a bfloat16; the scales go to the epilogue, so the products
// stay exact): [blocks][(k + 1) / 2][16][2], the two inputs of a pair side by
// side, the rest of the last block and the missing second input of an odd k zero.
void widen_group_bf16(const int8_t* w, int64_t k, int64_t n0, int64_t n1, uint16_t* packed) {
  const auto bf16 = [](int8_t v) {
    const float f = v;
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    return static_cast<uint16_t>(bits >> 16);  // exact: the low half of a small integer's float is zero
  };
  const int64_t blocks = (n1 - n0 + 15) / 16, pairs = (k + 1) / 2;
  int64_t whole = 0;  // blocks of 16 channels widened in registers
#ifdef KVFORGE_HAS_X86_PATHS
  whole = (n1 - n0) / 16;  // only the AVX-512 BF16 path widens to bfloat16
  for (int64_t b = 0; b < whole; ++b) {
    linear_avx512::widen_block16_bf16(w + (n0 + 16 * b) * k, k, packed + b * pairs * 32);
  }
#endif
  for (int64_t b = whole; b < blocks; ++b) {
    for (int64_t c = 0; c < 16; ++c) {
      const int64_t channel = n0 + 16 * b + c;
      uint16_t* dst = packed + (b * pairs * 16 + c) * 2;
      if (channel >= n1) {
        for (int64_t p = 0; p < pairs; ++p) dst[p * 32] = dst[p * 32 + 1] = 0;
        continue;
      }
      const int8_t* row = w + channel * k;
      for (int64_t p = 0; p < pairs; ++p) {
        dst[p * 32] = bf16(row[2 * p]);
        dst[p * 32 + 1] = 2 * p + 1 < k ? bf16(row[2 * p + 1]) : 0;
      }
    }
  }
}

using FloatBlock = void (*)(const float*, int64_t, int64_t, const int8_t*, int64_t, const float*, const float*,
                            float*, int64_t, int64_t, int64_t);

FloatBlock float_block_for(Isa level) {
#ifdef KVFORGE_HAS_X86_PATHS
  switch (level) {
    case Isa::kAvx512: return &linear_avx512::int8_linear_block;
    case Isa::kAvx2: return &linear_avx2::int8_linear_block;
    case Isa::kBaseline: break;
  }
#endif
  return &linear_base::int8_linear_block;
}

}  // namespace

at::Tensor int8_weight_linear(const at::Tensor& x_in, const at::Tensor& weight, const at::Tensor& scale_in,
                              const std::optional<at::Tensor>& bias_in, const std::string& epilogue,
                              const std::optional<at::Tensor>& other) {
  const char* op = "kvforge_cpp.int8_weight_linear: ";
  const int mode = epilogue_mode(op, epilogue);
  check_int8_linear_inputs("kvforge_cpp.int8_weight_linear", x_in, weight, scale_in, bias_in);
  if (x_in.size(1) == 0) {  // no inputs: every sum is zero; the bias and the epilogue still apply
    const int64_t width = scale_in.numel();
    at::Tensor sums = at::zeros({x_in.size(0), width}, x_in.options().dtype(at::kFloat));
    if (bias_in.has_value()) sums.add_(bias_in->reshape({width}).to(at::kFloat));
    return finish_rows(op, sums, mode, other, x_in.scalar_type());
  }
  // int8_pack_weight's layout
  if (weight.dim() == 3) return int8_packed_linear(x_in, weight, scale_in, bias_in, mode, other);
  const int64_t m = x_in.size(0), k = x_in.size(1), n = weight.size(0);
  const at::Tensor scale = scale_in.reshape({n}).contiguous();
  const at::Tensor bias = bias_in.has_value() ? bias_in->reshape({n}).to(at::kFloat).contiguous() : at::Tensor();
  const float* scale_ptr = scale.data_ptr<float>();
  const float* bias_ptr = bias.defined() ? bias.data_ptr<float>() : nullptr;
  const int8_t* w = weight.data_ptr<int8_t>();
  if (m == 0 || n == 0) return finish_rows(op, at::empty({m, n}, x_in.options()), mode, other, x_in.scalar_type());
  const int64_t blocks = (n + kChannelBlock - 1) / kChannelBlock;
  const Isa level = isa();

  // bfloat16 rows on AVX-512 BF16: bfloat16 products, from kWidenBf16Rows rows over weights
  // widened once with the scales and epilogue in the tiles (rounded once); fewer rows with an
  // epilogue take the float32 rows' path below.
  const bool bf16_dot = x_in.scalar_type() == at::kBFloat16 && level == Isa::kAvx512 && has_avx512_bf16();
  if (bf16_dot && (m >= kWidenBf16Rows || mode == 0)) {
#ifdef KVFORGE_HAS_X86_PATHS
    const at::Tensor x = x_in.stride(1) == 1 ? x_in : x_in.contiguous();
    const auto* x_ptr = reinterpret_cast<const c10::BFloat16*>(x.data_ptr());
    if (m >= kWidenBf16Rows) {
      return widened_bf16_linear(op, reinterpret_cast<const uint16_t*>(x_ptr), x.stride(0), m, k, n, 16, scale_ptr,
                                 bias_ptr, mode, other, [&](int64_t n0, int64_t n1, uint16_t* widened) {
                                   widen_group_bf16(w, k, n0, n1, widened);
                                 });
    }
    at::Tensor out = at::empty({m, n}, x_in.options());  // bfloat16 (no epilogue)
    auto* out_ptr = reinterpret_cast<c10::BFloat16*>(out.data_ptr());
    at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        linear_avx512_bf16::bf16_linear_block(x_ptr, x.stride(0), m, w, k, scale_ptr, bias_ptr, out_ptr, n,
                                              b * kChannelBlock, std::min(n, (b + 1) * kChannelBlock));
      }
    });
    return out;
#endif
  }
  // float32 rows as they are; bfloat16 rows widened once (rows x in: small next to the weight).
  const bool usable = x_in.scalar_type() == at::kFloat && x_in.stride(1) == 1;
  const at::Tensor x = usable ? x_in : x_in.to(at::kFloat).contiguous();
  const float* x_ptr = x.data_ptr<float>();
  if (m >= kDequantizeRows) {
    const WidenBlock widen = widen_block_for(level);
    return widened_linear(op, x_ptr, x.stride(0), m, k, n, 16, scale_ptr, bias_ptr, mode, other, x_in.scalar_type(),
                          [&](int64_t n0, int64_t n1, const float* s, float* packed) {
                            dequantize_group(w, k, s, n0, n1, packed, widen);  // the scales go into the weights
                          });
  }
  at::Tensor y = at::empty({m, n}, x_in.options().dtype(at::kFloat));
  float* y_ptr = y.data_ptr<float>();
  const FloatBlock block = float_block_for(level);
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      block(x_ptr, x.stride(0), m, w, k, scale_ptr, bias_ptr, y_ptr, n, b * kChannelBlock,
            std::min(n, (b + 1) * kChannelBlock));
    }
  });
  return finish_rows(op, y, mode, other, x_in.scalar_type());
}

// Which path int8_weight_linear takes for `dtype` here and now ("avx512_bf16",
// "avx512", "avx2" or "baseline"), for tests and benchmarks.
std::string int8_linear_path(const std::string& dtype) {
  const Isa level = isa();
  if (dtype == "bfloat16" && level == Isa::kAvx512 && has_avx512_bf16()) return "avx512_bf16";
  switch (level) {
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx2: return "avx2";
    case Isa::kBaseline: break;
  }
  return "baseline";
}

TORCH_LIBRARY_FRAGMENT(kvforge_cpp, m) {
  m.def("int8_weight_linear(Tensor x, Tensor weight, Tensor scale, Tensor? bias=None, str epilogue=\"none\", "
        "Tensor? other=None) -> Tensor");
  m.def("int8_linear_path(str dtype) -> str");
}

TORCH_LIBRARY_IMPL(kvforge_cpp, CPU, m) {
  m.impl("int8_weight_linear", &int8_weight_linear);
}

TORCH_LIBRARY_IMPL(kvforge_cpp, CompositeExplicitAutograd, m) {
  m.impl("int8_linear_path", &int8_linear_path);
}

}  // namespace kvforge_cpp
