// y = x W^T + bias over float32 rows and a float32 weight packed [blocks, k, 16]
// (models/cpp_linear.py pack_weight's layout): linear.cpp's float32 register
// tiles, for the library's other kernels that pack such a weight on the fly
// (int8_linear.cpp dequantizes a prefill's weights into it).
#pragma once

#include <cstdint>

namespace kvforge_cpp {

// y[r * y_stride + c] for rows r < m and channels c < n; `bias` holds blocks * 16
// values in the packed order (zeros past n), or is null. Runs on the calling
// thread when called inside a parallel region.
void f32_packed_rows(const float* x, int64_t x_stride, int64_t m, int64_t k, const float* packed, int64_t blocks,
                     const float* bias, float* y, int64_t y_stride, int64_t n);

}  // namespace kvforge_cpp
