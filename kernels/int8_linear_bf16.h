// The bfloat16 register tile of the weight-only int8 linear, for CPUs with
// AVX-512 BF16: vdpbf16ps multiplies 32 bfloat16 pairs and adds each pair's
// sum into 16 float32 lanes, so bfloat16 rows of x are read as they are and
// every 32 weights need one instruction per row where float32 needs two.
// The int8 weights are widened to bfloat16 in registers (int8 -> float32 ->
// bfloat16, exact: bfloat16 holds every integer up to 256). The tiling of
// int8_linear_tile.h, with 8 x 2 batch tiles (below); included once, under the
// avx512bf16 target. Outputs are written as bfloat16 (a float32 result
// converted after the call cost an extra op and pass per layer).

inline __m512bh widen_w32(const int8_t* p) {
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  const __m512 hi =
      _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16))));
  return _mm512_cvtne2ps_pbh(hi, lo);  // lanes 0..15 from `lo`, 16..31 from `hi`: the weights in order
}

inline __m512bh load_x32(const c10::BFloat16* p) { return (__m512bh)_mm512_loadu_si512(p); }

// One output channel against MR bfloat16 rows; as int8_tile in
// int8_linear_tile.h: four sums per row, the channel read front to back.
template <int MR>
inline void bf16_tile(const c10::BFloat16* __restrict__ x, int64_t x_stride, const int8_t* __restrict__ w,
                      int64_t k, float scale, float bias, c10::BFloat16* __restrict__ y, int64_t y_stride) {
  __m512 acc[MR][4];
  for (int m = 0; m < MR; ++m) {
    for (int u = 0; u < 4; ++u) acc[m][u] = _mm512_setzero_ps();
  }
  int64_t d = 0;
  for (; d + 128 <= k; d += 128) {
    __builtin_prefetch(w + d + kWeightsAhead, 0, 2);  // these two lines, kWeightsAhead on
    __builtin_prefetch(w + d + 64 + kWeightsAhead, 0, 2);
    __m512bh wv[4];
    for (int u = 0; u < 4; ++u) wv[u] = widen_w32(w + d + 32 * u);
    for (int m = 0; m < MR; ++m) {
      const c10::BFloat16* row = x + m * x_stride + d;
      for (int u = 0; u < 4; ++u) acc[m][u] = _mm512_dpbf16_ps(acc[m][u], load_x32(row + 32 * u), wv[u]);
    }
  }
  for (; d + 32 <= k; d += 32) {
    const __m512bh wv = widen_w32(w + d);
    for (int m = 0; m < MR; ++m) acc[m][0] = _mm512_dpbf16_ps(acc[m][0], load_x32(x + m * x_stride + d), wv);
  }
  for (int m = 0; m < MR; ++m) {
    float sum = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[m][0], acc[m][1]),
                                                   _mm512_add_ps(acc[m][2], acc[m][3])));
    for (int64_t t = d; t < k; ++t) sum += static_cast<float>(x[m * x_stride + t]) * static_cast<float>(w[t]);
    y[m * y_stride] = c10::BFloat16(sum * scale + bias);  // rounded to nearest even, as torch
  }
}

// MR rows x NR channels of bfloat16 rows, for batches; as int8_tile_rc in
// int8_linear_tile.h: each widened weight vector serves MR rows.
template <int MR, int NR>
inline void bf16_tile_rc(const c10::BFloat16* __restrict__ x, int64_t x_stride, const int8_t* __restrict__ w,
                         int64_t k, const float* __restrict__ scale, const float* __restrict__ bias,
                         c10::BFloat16* __restrict__ y, int64_t y_stride) {
  __m512 acc[MR][NR];
  for (int m = 0; m < MR; ++m) {
    for (int n = 0; n < NR; ++n) acc[m][n] = _mm512_setzero_ps();
  }
  int64_t d = 0;
  for (; d + 32 <= k; d += 32) {
    if ((d & 63) == 0) {  // as int8_tile_rc: each channel's line kWeightsAhead on
      for (int n = 0; n < NR; ++n) __builtin_prefetch(w + n * k + d + kWeightsAhead, 0, 2);
    }
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
      y[m * y_stride + n] = c10::BFloat16(sum * scale[n] + (bias != nullptr ? bias[n] : 0.f));
    }
  }
}
// The batch tile: 8 rows x 2 channels. Widening 32 weights to bfloat16 pairs
// takes five instructions, against one vdpbf16ps per row: over 8 rows it costs
// 5 per 16 vdpbf16ps where 4 x 4 cost 20 per 16, so the widening hides behind
// the dot products (12 x 2, 8 x 3 and 16 x 1 timed slower; docs/quantization.md).
constexpr int kBf16TileRows = 8;
constexpr int kBf16TileChannels = 2;

// Channels [n0, n1) of all m rows, split as int8_linear_block splits them.
inline void bf16_linear_block(const c10::BFloat16* x, int64_t x_stride, int64_t m, const int8_t* w, int64_t k,
                              const float* scale, const float* bias, c10::BFloat16* y, int64_t y_stride, int64_t n0,
                              int64_t n1) {
  const int64_t grouped = m / kBf16TileRows * kBf16TileRows;
  const int64_t n_single = grouped > 0 ? n0 + (n1 - n0) / kBf16TileChannels * kBf16TileChannels : n0;
  for (int64_t r0 = 0; r0 < grouped; r0 += kBatchChunkRows) {
    const int64_t r1 = std::min(grouped, r0 + kBatchChunkRows);
    for (int64_t n = n0; n < n_single; n += kBf16TileChannels) {
      for (int64_t r = r0; r < r1; r += kBf16TileRows) {
        bf16_tile_rc<kBf16TileRows, kBf16TileChannels>(x + r * x_stride, x_stride, w + n * k, k, scale + n,
                                                       bias != nullptr ? bias + n : nullptr, y + r * y_stride + n,
                                                       y_stride);
      }
    }
  }
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* wn = w + n * k;
    const float s = scale[n], b = bias != nullptr ? bias[n] : 0.f;
    int64_t r = n < n_single ? grouped : 0;
    for (; r + 4 <= m; r += 4) bf16_tile<4>(x + r * x_stride, x_stride, wn, k, s, b, y + r * y_stride + n, y_stride);
    switch (m - r) {
      case 3: bf16_tile<3>(x + r * x_stride, x_stride, wn, k, s, b, y + r * y_stride + n, y_stride); break;
      case 2: bf16_tile<2>(x + r * x_stride, x_stride, wn, k, s, b, y + r * y_stride + n, y_stride); break;
      case 1: bf16_tile<1>(x + r * x_stride, x_stride, wn, k, s, b, y + r * y_stride + n, y_stride); break;
      default: break;
    }
  }
}
