// Register tiles of the weight-only int8 linear: y = x (w * scale)^T + bias,
// with x float32 and w int8 [out, in], each weight row (output channel)
// contiguous along the input dimension.
//
// Included by int8_linear.cpp once per ISA (baseline, AVX2, AVX-512), each time
// after bf16_vectors.h (vf16, sum16, fold16) and after defining `widen_w16`
// (16 int8 weights as floats) for that ISA: GCC 12
// widens an int8 vector one element at a time, so the x86 paths spell it with
// intrinsics. It therefore includes nothing itself. The sixteen-lane vectors
// are GCC vector types: one zmm register under AVX-512, two ymm under AVX2,
// four SSE registers on the baseline, from one source.
//
// The tiles load int8 weights, widen them to float32 in registers (never a
// float copy of the weight in memory) and multiply them with the rows' inputs.
// The scale is applied once per output, after the sum:
// sum_k x_k (w_k s) = s sum_k x_k w_k.

inline vf16 load_x16(const float* p) { return *reinterpret_cast<const vf16*>(p); }

// y[m * y_stride] = (x_m . w) * scale + bias for m < MR: one output channel
// `w` (k int8 weights) against MR rows of x, x_stride apart. Four independent
// sums per row (64 inputs a step) hide the FMA latency, and the channel's
// weights are read front to back, one stream the hardware prefetcher follows:
// a tile over several channels at once reads several short interleaved
// streams, which it does not (measured: docs/quantization.md).
template <int MR>
inline void int8_tile(const float* __restrict__ x, int64_t x_stride, const int8_t* __restrict__ w, int64_t k,
                      float scale, float bias, float* __restrict__ y, int64_t y_stride) {
  vf16 acc[MR][4];
  for (int m = 0; m < MR; ++m) {
    for (int u = 0; u < 4; ++u) acc[m][u] = vf16{};
  }
  int64_t d = 0;
  for (; d + 64 <= k; d += 64) {
    __builtin_prefetch(w + d + kWeightsAhead, 0, 2);  // this line, kWeightsAhead on
    vf16 wv[4];
    for (int u = 0; u < 4; ++u) wv[u] = widen_w16(w + d + 16 * u);
    for (int m = 0; m < MR; ++m) {
      for (int u = 0; u < 4; ++u) acc[m][u] += load_x16(x + m * x_stride + d + 16 * u) * wv[u];
    }
  }
  for (; d + 16 <= k; d += 16) {
    const vf16 wv = widen_w16(w + d);
    for (int m = 0; m < MR; ++m) acc[m][0] += load_x16(x + m * x_stride + d) * wv;
  }
  for (int m = 0; m < MR; ++m) {
    float sum = sum16((acc[m][0] + acc[m][1]) + (acc[m][2] + acc[m][3]));
    for (int64_t t = d; t < k; ++t) sum += x[m * x_stride + t] * static_cast<float>(w[t]);
    y[m * y_stride] = sum * scale + bias;
  }
}

// y[m * y_stride + n] = (x_m . w_n) * scale[n] + bias[n] (bias may be null)
// for m < MR and n < NR: NR channels against MR rows, for batches, where the
// work is arithmetic, not reading weights: each widened weight vector serves
// MR rows and each input vector NR channels, so the widening costs 1/MR of
// the multiply-adds (int8_tile, for decodes, widens one per four).
template <int MR, int NR>
inline void int8_tile_rc(const float* __restrict__ x, int64_t x_stride, const int8_t* __restrict__ w, int64_t k,
                         const float* __restrict__ scale, const float* __restrict__ bias, float* __restrict__ y,
                         int64_t y_stride) {
  vf16 acc[MR][NR];
  for (int m = 0; m < MR; ++m) {
    for (int n = 0; n < NR; ++n) acc[m][n] = vf16{};
  }
  int64_t d = 0;
  for (; d + 16 <= k; d += 16) {
    if ((d & 63) == 0) {  // each channel's line kWeightsAhead on: NR interleaved streams the hardware misses
      for (int n = 0; n < NR; ++n) __builtin_prefetch(w + n * k + d + kWeightsAhead, 0, 2);
    }
    vf16 wv[NR];
    for (int n = 0; n < NR; ++n) wv[n] = widen_w16(w + n * k + d);
    for (int m = 0; m < MR; ++m) {
      const vf16 xv = load_x16(x + m * x_stride + d);
      for (int n = 0; n < NR; ++n) acc[m][n] += xv * wv[n];
    }
  }
  static_assert(MR * NR == 16, "the sums are folded as sixteen vectors");
  const vf16 sums = fold16(reinterpret_cast<const vf16(&)[16]>(acc));  // lane m * NR + n
  for (int m = 0; m < MR; ++m) {
    for (int n = 0; n < NR; ++n) {
      float sum = sums[m * NR + n];
      for (int64_t t = d; t < k; ++t) sum += x[m * x_stride + t] * static_cast<float>(w[n * k + t]);
      y[m * y_stride + n] = sum * scale[n] + (bias != nullptr ? bias[n] : 0.f);
    }
  }
}

// The batch tile: 4 rows x 4 channels (16 accumulators, 4 weight vectors,
// one input vector); other shapes measured no faster (docs/models.md).
constexpr int kTileRows = 4;
constexpr int kTileChannels = 4;

// Output channels [n0, n1) of all m rows. Rows in groups of four take
// int8_tile_rc over four channels at a time, a chunk of kBatchChunkRows rows (in
// L2) at a time: every four channels' weights (in L1) pass over the chunk,
// and the block's weights stay in L2 for the next chunk. The rest (all of a
// decode of up to 3 rows, where reading the weights is the cost) take
// int8_tile, one channel at a time.
inline void int8_linear_block(const float* x, int64_t x_stride, int64_t m, const int8_t* w, int64_t k,
                              const float* scale, const float* bias, float* y, int64_t y_stride, int64_t n0,
                              int64_t n1) {
  const int64_t grouped = m / kTileRows * kTileRows;
  const int64_t n_single = grouped > 0 ? n0 + (n1 - n0) / kTileChannels * kTileChannels : n0;  // past the batch tiles
  for (int64_t r0 = 0; r0 < grouped; r0 += kBatchChunkRows) {
    const int64_t r1 = std::min(grouped, r0 + kBatchChunkRows);
    for (int64_t n = n0; n < n_single; n += kTileChannels) {
      const float* bn = bias != nullptr ? bias + n : nullptr;
      for (int64_t r = r0; r < r1; r += kTileRows) {
        int8_tile_rc<kTileRows, kTileChannels>(x + r * x_stride, x_stride, w + n * k, k, scale + n, bn,
                                               y + r * y_stride + n, y_stride);
      }
    }
  }
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* wn = w + n * k;
    const float s = scale[n], b = bias != nullptr ? bias[n] : 0.f;
    int64_t r = n < n_single ? grouped : 0;
    for (; r + 4 <= m; r += 4) int8_tile<4>(x + r * x_stride, x_stride, wn, k, s, b, y + r * y_stride + n, y_stride);
    switch (m - r) {
      case 3: int8_tile<3>(x + r * x_stride, x_stride, wn, k, s, b, y + r * y_stride + n, y_stride); break;
      case 2: int8_tile<2>(x + r * x_stride, x_stride, wn, k, s, b, y + r * y_stride + n, y_stride); break;
      case 1: int8_tile<1>(x + r * x_stride, x_stride, wn, k, s, b, y + r * y_stride + n, y_stride); break;
      default: break;
    }
  }
}

// One step of transpose16: rows r and r + B (r with bit B clear) swap their
// off-diagonal blocks of B lanes.
template <int B>
inline void swap_blocks(vf16 (&t)[16]) {
  vi16 low, high;  // the new row r and row r + B, picked from (row r, row r + B)
  for (int c = 0; c < 16; ++c) {
    low[c] = (c & B) == 0 ? c : 16 + c - B;
    high[c] = (c & B) == 0 ? c + B : 16 + c;
  }
  for (int r = 0; r < 16; ++r) {
    if ((r & B) != 0) continue;
    const vf16 a = t[r], b = t[r + B];
    t[r] = __builtin_shuffle(a, b, low);
    t[r + B] = __builtin_shuffle(a, b, high);
  }
}

// t[r][c] becomes t[c][r]: four rounds of block swaps, 64 two-vector shuffles.
inline void transpose16(vf16 (&t)[16]) {
  swap_blocks<8>(t);
  swap_blocks<4>(t);
  swap_blocks<2>(t);
  swap_blocks<1>(t);
}

// Sixteen channels of int8 weights (channel c at w + c * k) times their
// scales, as f32_packed_rows reads one block of a weight: packed[d * 16 + c] =
// w[c * k + d] * scale[c]. Sixteen inputs of the sixteen channels at a time
// are widened and transposed in registers (a scalar loop with strided
// stores took about two cycles a weight).
// t[j][c] = w[c * k + d + j]: inputs d .. d + 15 of sixteen channels (channel
// c at w + c * k), widened and transposed. Also asks for the next block's
// 16 k bytes, four lines a step: its sixteen short streams are ones the
// hardware prefetcher does not follow.
inline void widened_columns16(const int8_t* w, int64_t k, int64_t d, vf16 (&t)[16]) {
  for (int line = 0; line < 4; ++line) __builtin_prefetch(w + 16 * k + (d / 4 + line) * 64, 0, 3);
  for (int c = 0; c < 16; ++c) t[c] = widen_w16(w + c * k + d);
  transpose16(t);
}

inline void widen_block16(const int8_t* w, int64_t k, const float* scale, float* packed) {
  const vf16 s = load_x16(scale);
  int64_t d = 0;
  for (; d + 16 <= k; d += 16) {
    vf16 t[16];
    widened_columns16(w, k, d, t);
    for (int j = 0; j < 16; ++j) *reinterpret_cast<vf16*>(packed + (d + j) * 16) = t[j] * s;
  }
  for (; d < k; ++d) {
    for (int c = 0; c < 16; ++c) packed[d * 16 + c] = static_cast<float>(w[c * k + d]) * scale[c];
  }
}

// Sixteen channels as widened_bf16_linear reads one block, unscaled (every int8
// is exactly a bfloat16; the scales go to the epilogue): packed[(p * 16 + c) *
// 2 + i] = w[c * k + 2 p + i], the missing second input of an odd k zero.
// Inputs 2p and 2p + 1 of the sixteen channels are interleaved from two
// transposed rows.
inline void widen_block16_bf16(const int8_t* w, int64_t k, uint16_t* packed) {
  int64_t d = 0;
  for (; d + 16 <= k; d += 16) {
    vf16 t[16];
    widened_columns16(w, k, d, t);
    for (int i = 0; i < 8; ++i) {  // pair d / 2 + i
      uint16_t* dst = packed + (d / 2 + i) * 32;
      store_bf16x16(dst, __builtin_shuffle(t[2 * i], t[2 * i + 1],
                                           vi16{0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23}));
      store_bf16x16(dst + 16, __builtin_shuffle(t[2 * i], t[2 * i + 1],
                                                vi16{8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31}));
    }
  }
  for (; d < k; d += 2) {
    for (int c = 0; c < 16; ++c) {
      uint16_t* dst = packed + (d / 2 * 16 + c) * 2;
      dst[0] = float_to_bf16(static_cast<float>(w[c * k + d]));
      dst[1] = d + 1 < k ? float_to_bf16(static_cast<float>(w[c * k + d + 1])) : 0;
    }
  }
}
