// The bfloat16 register tile of the weight-only int8 linear, for CPUs with
// AVX-512 BF16: vdpbf16ps multiplies 32 bfloat16 pairs and adds each pair's
// sum into 16 float32 lanes, so bfloat16 rows of x are read as they are and
// every step needs one instruction per row and channel where float32 needs two.
// The int8 weights are widened to bfloat16 in registers (int8 -> float32 ->
// bfloat16, exact: bfloat16 holds every integer up to 256). Same tiling as
// int8_linear_tile.h; included once, under the avx512bf16 target.

inline __m512bh widen_w32(const int8_t* p) {
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  const __m512 hi =
      _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16))));
  return _mm512_cvtne2ps_pbh(hi, lo);  // lanes 0..15 from `lo`, 16..31 from `hi`: the weights in order
}

inline __m512bh load_x32(const c10::BFloat16* p) { return (__m512bh)_mm512_loadu_si512(p); }

template <int MR, int NR>
inline void bf16_tile(const c10::BFloat16* __restrict__ x, int64_t x_stride, const int8_t* __restrict__ w,
                      int64_t k, const float* __restrict__ scale, const float* __restrict__ bias,
                      float* __restrict__ y, int64_t y_stride) {
  __m512 acc[MR][NR];
  for (int m = 0; m < MR; ++m) {
    for (int n = 0; n < NR; ++n) acc[m][n] = _mm512_setzero_ps();
  }
  int64_t d = 0;
  for (; d + 32 <= k; d += 32) {
    __m512bh wv[NR];
    for (int n = 0; n < NR; ++n) wv[n] = widen_w32(w + n * k + d);
    for (int m = 0; m < MR; ++m) {
      const __m512bh xv = load_x32(x + m * x_stride + d);
      for (int n = 0; n < NR; ++n) acc[m][n] = _mm512_dpbf16_ps(acc[m][n], xv, wv[n]);
    }
  }
  for (int m = 0; m < MR; ++m) {
    for (int n = 0; n < NR; ++n) {
      float sum = _mm512_reduce_add_ps(acc[m][n]);
      for (int64_t t = d; t < k; ++t) sum += static_cast<float>(x[m * x_stride + t]) * static_cast<float>(w[n * k + t]);
      y[m * y_stride + n] = sum * scale[n] + (bias != nullptr ? bias[n] : 0.f);
    }
  }
}

template <int NR>
inline void bf16_channels(const c10::BFloat16* x, int64_t x_stride, int64_t m, const int8_t* w, int64_t k,
                          const float* scale, const float* bias, float* y, int64_t y_stride, int64_t n0,
                          int64_t n1) {
  int64_t n = n0;
  for (; n + NR <= n1; n += NR) {
    const int8_t* wn = w + n * k;
    const float* bn = bias != nullptr ? bias + n : nullptr;
    int64_t r = 0;
    for (; r + 4 <= m; r += 4) bf16_tile<4, NR>(x + r * x_stride, x_stride, wn, k, scale + n, bn, y + r * y_stride + n, y_stride);
    switch (m - r) {
      case 3: bf16_tile<3, NR>(x + r * x_stride, x_stride, wn, k, scale + n, bn, y + r * y_stride + n, y_stride); break;
      case 2: bf16_tile<2, NR>(x + r * x_stride, x_stride, wn, k, scale + n, bn, y + r * y_stride + n, y_stride); break;
      case 1: bf16_tile<1, NR>(x + r * x_stride, x_stride, wn, k, scale + n, bn, y + r * y_stride + n, y_stride); break;
      default: break;
    }
  }
  for (; n < n1; ++n) {
    const float* bn = bias != nullptr ? bias + n : nullptr;
    for (int64_t r = 0; r < m; ++r) {
      bf16_tile<1, 1>(x + r * x_stride, x_stride, w + n * k, k, scale + n, bn, y + r * y_stride + n, y_stride);
    }
  }
}

inline void bf16_linear_block(const c10::BFloat16* x, int64_t x_stride, int64_t m, const int8_t* w, int64_t k,
                              const float* scale, const float* bias, float* y, int64_t y_stride, int64_t n0,
                              int64_t n1) {
  if (m == 1) {
    bf16_channels<8>(x, x_stride, m, w, k, scale, bias, y, y_stride, n0, n1);
  } else {
    bf16_channels<4>(x, x_stride, m, w, k, scale, bias, y, y_stride, n0, n1);
  }
}
