// Register tiles of the weight-only int8 linear: y = x (w * scale)^T + bias,
// with x float32 and w int8 [out, in], each weight row (output channel)
// contiguous along the input dimension.
//
// Included by int8_linear.cpp once per ISA (baseline, AVX2, AVX-512), each time
// after defining `widen_w16` (16 int8 weights as floats) for that ISA: GCC 12
// widens an int8 vector one element at a time, so the x86 paths spell it with
// intrinsics. It therefore includes nothing itself. The sixteen-lane vectors
// are GCC vector types: one zmm register under AVX-512, two ymm under AVX2,
// four SSE registers on the baseline, from one source.
//
// A tile holds MR rows of x against NR output channels. Each step loads 16
// int8 weights of each channel, widens them to float32 in registers (never a
// float copy of the weight in memory) and multiplies them with 16 inputs of
// each row into MR x NR accumulators, so one widened weight vector serves MR
// rows and one input vector serves NR channels. The scale is applied once per
// output, after the sum: sum_k x_k (w_k s) = s sum_k x_k w_k.

inline vf16 load_x16(const float* p) { return *reinterpret_cast<const vf16*>(p); }
inline float sum16(vf16 v) {
  float s = 0.f;
  for (int i = 0; i < 16; ++i) s += v[i];
  return s;
}

// y[m * y_stride + n] = (x_m . w_n) * scale[n] + bias[n] (bias may be null),
// for m < MR and n < NR; x rows x_stride apart, weight rows k apart.
template <int MR, int NR>
inline void int8_tile(const float* __restrict__ x, int64_t x_stride, const int8_t* __restrict__ w, int64_t k,
                      const float* __restrict__ scale, const float* __restrict__ bias, float* __restrict__ y,
                      int64_t y_stride) {
  vf16 acc[MR][NR];
  for (int m = 0; m < MR; ++m) {
    for (int n = 0; n < NR; ++n) acc[m][n] = vf16{};
  }
  int64_t d = 0;
  for (; d + 16 <= k; d += 16) {
    vf16 wv[NR];
    for (int n = 0; n < NR; ++n) wv[n] = widen_w16(w + n * k + d);
    for (int m = 0; m < MR; ++m) {
      const vf16 xv = load_x16(x + m * x_stride + d);
      for (int n = 0; n < NR; ++n) acc[m][n] += xv * wv[n];
    }
  }
  for (int m = 0; m < MR; ++m) {
    for (int n = 0; n < NR; ++n) {
      float sum = sum16(acc[m][n]);
      for (int64_t t = d; t < k; ++t) sum += x[m * x_stride + t] * static_cast<float>(w[n * k + t]);
      y[m * y_stride + n] = sum * scale[n] + (bias != nullptr ? bias[n] : 0.f);
    }
  }
}

// Channels [n0, n1) of all m rows: NR channels at a time against every group
// of rows, so the NR weight rows stay in L1 while all the rows pass over them.
template <int NR>
inline void int8_channels(const float* x, int64_t x_stride, int64_t m, const int8_t* w, int64_t k,
                          const float* scale, const float* bias, float* y, int64_t y_stride, int64_t n0,
                          int64_t n1) {
  int64_t n = n0;
  for (; n + NR <= n1; n += NR) {
    const int8_t* wn = w + n * k;
    const float* bn = bias != nullptr ? bias + n : nullptr;
    int64_t r = 0;
    for (; r + 4 <= m; r += 4) int8_tile<4, NR>(x + r * x_stride, x_stride, wn, k, scale + n, bn, y + r * y_stride + n, y_stride);
    switch (m - r) {
      case 3: int8_tile<3, NR>(x + r * x_stride, x_stride, wn, k, scale + n, bn, y + r * y_stride + n, y_stride); break;
      case 2: int8_tile<2, NR>(x + r * x_stride, x_stride, wn, k, scale + n, bn, y + r * y_stride + n, y_stride); break;
      case 1: int8_tile<1, NR>(x + r * x_stride, x_stride, wn, k, scale + n, bn, y + r * y_stride + n, y_stride); break;
      default: break;
    }
  }
  for (; n < n1; ++n) {  // the last channels, fewer than NR
    const float* bn = bias != nullptr ? bias + n : nullptr;
    for (int64_t r = 0; r < m; ++r) {
      int8_tile<1, 1>(x + r * x_stride, x_stride, w + n * k, k, scale + n, bn, y + r * y_stride + n, y_stride);
    }
  }
}

// One block of output channels [n0, n1) for all rows (see int8_channels):
// a single row takes 8 channels per tile, for 8 independent sums in flight.
inline void int8_linear_block(const float* x, int64_t x_stride, int64_t m, const int8_t* w, int64_t k,
                              const float* scale, const float* bias, float* y, int64_t y_stride, int64_t n0,
                              int64_t n1) {
  if (m == 1) {
    int8_channels<8>(x, x_stride, m, w, k, scale, bias, y, y_stride, n0, n1);
  } else {
    int8_channels<4>(x, x_stride, m, w, k, scale, bias, y, y_stride, n0, n1);
  }
}
