// y = x W^T + bias over rows and a weight packed as models/cpp_linear.py
// pack_weight packs it: linear.cpp's float32 and bfloat16 register tiles, for
// the library's other kernels that pack such a weight on the fly
// (int8_linear.cpp widens a prefill's int8 weights into it).
#pragma once

#include <cstdint>

namespace kvforge_cpp {

// y[r * y_stride + c] for rows r < m and channels c < n; `bias` holds blocks * 16
// values in the packed order (zeros past n), or is null. Runs on the calling
// thread when called inside a parallel region.
void f32_packed_rows(const float* x, int64_t x_stride, int64_t m, int64_t k, const float* packed, int64_t blocks,
                     const float* bias, float* y, int64_t y_stride, int64_t n);

// The same over bfloat16 rows and a bfloat16 weight packed [blocks, (k + 1) / 2,
// 16, 2] (raw bits), into bfloat16 y; `scale` (blocks * 16 values in the packed
// order, or null) multiplies the float32 sums before `bias` is added.
void bf16_packed_rows(const uint16_t* x, int64_t x_stride, int64_t m, int64_t k, const uint16_t* packed,
                      int64_t blocks, const float* scale, const float* bias, uint16_t* y, int64_t y_stride, int64_t n);

}  // namespace kvforge_cpp
