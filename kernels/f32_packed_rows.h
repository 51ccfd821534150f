// linear.cpp's float32 and bfloat16 register tiles over a weight packed as
// models/cpp_linear.py pack_weight packs it, and their epilogue, for the
// library's other kernels: the int8 linears widen a prefill's int8 weights
// into the tiles' layout, and hand a decode's sums to the epilogue.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <optional>

namespace kvforge_cpp {

// The weight-only int8 ops' result for many rows: the weight widened to the
// float32 tiles' layout one channel group at a time (`widen(n0, n1, scale,
// out)` writes channels [n0, n1) with `scale`, the group's scales, applied;
// channel_group's groups of a multiple of `multiple` channels, in parallel),
// and the float32 tiles run over each group with `bias` and the epilogue `mode`
// (epilogue_mode's) in them, as the float linears run theirs: no pass over the
// sums after. An [m, n] result (n / 2 for "silu_mul") of `out_dtype`; x is
// float32 [m, k], rows x_stride apart.
at::Tensor widened_linear(const char* op, const float* x, int64_t x_stride, int64_t m, int64_t k, int64_t n,
                          int64_t multiple, const float* scale, const float* bias, int mode,
                          const std::optional<at::Tensor>& other, at::ScalarType out_dtype,
                          const std::function<void(int64_t, int64_t, const float*, float*)>& widen);

// The same for bfloat16 rows on AVX-512 BF16 (x [m, k], rows x_stride apart):
// `widen(n0, n1, out)` writes channels [n0, n1) unscaled as a bfloat16 weight
// is packed ([blocks, (k + 1) / 2, 16, 2], raw bits), and the bfloat16 tiles
// run over each group with its scales multiplying the float32 sums first, then
// `bias` and the epilogue, rounded to bfloat16 once; a bfloat16 result.
at::Tensor widened_bf16_linear(const char* op, const uint16_t* x, int64_t x_stride, int64_t m, int64_t k, int64_t n,
                               int64_t multiple, const float* scale, const float* bias, int mode,
                               const std::optional<at::Tensor>& other,
                               const std::function<void(int64_t, int64_t, uint16_t*)>& widen);

// The epilogue over sums an op makes kSumsBlock channels at a time (the int8
// packed decode tiles, a block each): `block_sums(b, sums)` writes the m rows'
// unscaled float32 sums of channels [kSumsBlock b, kSumsBlock (b + 1)) into
// sums ([m][kSumsBlock], zeros past `width`), and each block then takes
// `scale`, `bias` (null or `width` values) and the epilogue `mode` as the
// tiles' own sums do, rounded once into an [m, width] result of `out_dtype`
// (width / 2 for "silu_mul"); blocks in parallel. It checks `other`.
constexpr int64_t kSumsBlock = 64;
at::Tensor finish_blocks(const char* op, int64_t m, int64_t width, const float* scale, const float* bias, int mode,
                         const std::optional<at::Tensor>& other, at::ScalarType out_dtype,
                         const std::function<void(int64_t, float*)>& block_sums);

}  // namespace kvforge_cpp
