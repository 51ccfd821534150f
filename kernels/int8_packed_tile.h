// The weight-only int8 linear over a packed weight (int8_packed_linear.cpp):
// y = x (w * scale)^T + bias with w laid out [blocks][in][kPackChannels]
// (int8_pack_weight), so that one 64-byte line holds one input of 64
// channels and a block is one stream, read front to back.
//
// Included by int8_packed_linear.cpp once per ISA, each time after
// bf16_vectors.h (vf16, store_bf16x16, store1) and native_vectors.h (vw, kW,
// storew), after
// defining `widen_w16` (16 int8 weights as floats), `widen_w` (kW int8
// weights as floats), `kPackedRows` (rows per tile: as many as the
// accumulators fit the registers) and `kPackedUnroll` (inputs per pass of a
// one-row tile). It includes nothing itself.
//
// The decode tile keeps its sums in `vw` (see native_vectors.h: in vf16 it
// read weights at a tenth of memory speed under AVX2).

constexpr int kV = kPackChannels / kW;  // vectors per 64-channel line

// MR rows of x (x_stride apart) against one packed block of 64 channels,
// `channels` of which are real (the rest of the last block is padding):
// y[m * y_stride + c] = (x_m . w_c) * scale[c] + bias[c] (bias may be null).
// Each step widens the line of input d (64 channels, kV vectors) once and
// adds x[m][d] times it into kW channels per vector: the sums of 64 channels
// sit in kV MR registers, so no sum is ever folded across lanes, and the
// scales multiply them once at the end.
template <int MR, typename Out>
inline void packed_tile(const float* __restrict__ x, int64_t x_stride, const int8_t* __restrict__ block, int64_t k,
                        const float* __restrict__ scale, const float* __restrict__ bias, int64_t channels,
                        Out* __restrict__ y, int64_t y_stride) {
  vw acc[MR][kV];
  for (int m = 0; m < MR; ++m) {
    for (int u = 0; u < kV; ++u) acc[m][u] = vw{};
  }
  // One row takes kUnroll inputs per pass (the loop's own work was a third of
  // each input's); the sums still add input d, then d + 1, ..., so the bits do
  // not change. Each widened vector is used by every row as soon as it is made:
  // with all kV of a line widened first, AVX2's 16 registers could not also
  // hold the 8 sums, and GCC kept one on the stack, its multiply-add then
  // waiting on a store and a load every input.
  constexpr int kUnroll = MR == 1 ? kPackedUnroll : 1;
  int64_t d = 0;
  for (; d + kUnroll <= k; d += kUnroll) {
    const int8_t* lines = block + d * kPackChannels;
    // The same stream kWeightsAhead on, non-temporal: a model's weights streaming
    // through L2 and L3 evicted the rest of a decode step's data there (the
    // engine's and the interpreter's, activations, the KV cache) every step.
    for (int i = 0; i < kUnroll; ++i) __builtin_prefetch(lines + i * kPackChannels + kWeightsAhead, 0, 0);
    float xv[MR][kUnroll];
    for (int m = 0; m < MR; ++m) {
      for (int i = 0; i < kUnroll; ++i) xv[m][i] = x[m * x_stride + d + i];
    }
    for (int u = 0; u < kV; ++u) {
      for (int i = 0; i < kUnroll; ++i) {
        const vw wv = widen_w(lines + i * kPackChannels + kW * u);
        for (int m = 0; m < MR; ++m) acc[m][u] += xv[m][i] * wv;
      }
    }
  }
  for (; d < k; ++d) {  // the last k % kUnroll inputs
    const int8_t* line = block + d * kPackChannels;
    for (int u = 0; u < kV; ++u) {
      const vw wv = widen_w(line + kW * u);
      for (int m = 0; m < MR; ++m) acc[m][u] += x[m * x_stride + d] * wv;
    }
  }
  for (int u = 0; u < kV; ++u) {
    const int64_t c0 = kW * u;
    if (c0 + kW <= channels) {
      const vw s = *reinterpret_cast<const vw*>(scale + c0);
      const vw b = bias != nullptr ? *reinterpret_cast<const vw*>(bias + c0) : vw{};
      for (int m = 0; m < MR; ++m) storew(y + m * y_stride + c0, acc[m][u] * s + b);
      continue;
    }
    for (int64_t c = c0; c < channels; ++c) {  // the last block's real channels
      for (int m = 0; m < MR; ++m) {
        store1(y + m * y_stride + c, acc[m][u][c - c0] * scale[c] + (bias != nullptr ? bias[c] : 0.f));
      }
    }
  }
}

// All m rows against one packed block, kPackedRows rows at a time (the block,
// 64 k bytes, comes from memory for the first rows and from cache after).
template <typename Out>
inline void packed_rows(const float* x, int64_t x_stride, int64_t m, const int8_t* block, int64_t k,
                        const float* scale, const float* bias, int64_t channels, Out* y, int64_t y_stride) {
  for (int64_t r = 0; r < m;) {
    const float* xr = x + r * x_stride;
    Out* yr = y + r * y_stride;
    switch (std::min<int64_t>(m - r, kPackedRows)) {
      case 4: packed_tile<4>(xr, x_stride, block, k, scale, bias, channels, yr, y_stride); r += 4; break;
      case 3: packed_tile<3>(xr, x_stride, block, k, scale, bias, channels, yr, y_stride); r += 3; break;
      case 2: packed_tile<2>(xr, x_stride, block, k, scale, bias, channels, yr, y_stride); r += 2; break;
      default: packed_tile<1>(xr, x_stride, block, k, scale, bias, channels, yr, y_stride); r += 1; break;
    }
  }
}

// One packed block times its 64 scales (padded with zeros) in the layout
// f32_packed_rows reads: out[(u k + d) 16 + c] = w[16 u + c][d] * scale[16 u + c].
// No transpose: each line already holds sixteen channels of one input.
inline void dequantize_packed_block(const int8_t* block, int64_t k, const float* scale, float* out) {
  vf16 s[4];
  for (int u = 0; u < 4; ++u) s[u] = *reinterpret_cast<const vf16*>(scale + 16 * u);
  for (int64_t d = 0; d < k; ++d) {
    const int8_t* line = block + d * kPackChannels;
    __builtin_prefetch(line + kWeightsAhead, 0, 2);
    for (int u = 0; u < 4; ++u) *reinterpret_cast<vf16*>(out + (u * k + d) * 16) = widen_w16(line + 16 * u) * s[u];
  }
}

// One packed block as bf16_packed_rows reads a weight, unscaled (every int8 is
// exactly a bfloat16): out[((u pairs + p) 16 + c) 2 + i] = w[16 u + c][2 p + i],
// pairs = (k + 1) / 2, the missing second input of an odd k zero. Two lines'
// sixteen channels interleave into pairs.
inline void widen_packed_block_bf16(const int8_t* block, int64_t k, uint16_t* out) {
  const int64_t pairs = (k + 1) / 2;
  for (int64_t p = 0; p < pairs; ++p) {
    const int8_t* line = block + 2 * p * kPackChannels;
    __builtin_prefetch(line + kWeightsAhead, 0, 2);
    for (int u = 0; u < 4; ++u) {
      const vf16 a = widen_w16(line + 16 * u);
      const vf16 b = 2 * p + 1 < k ? widen_w16(line + kPackChannels + 16 * u) : vf16{};
      uint16_t* dst = out + (u * pairs + p) * 32;
      store_bf16x16(dst, __builtin_shuffle(a, b, vi16{0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23}));
      store_bf16x16(dst + 16,
                    __builtin_shuffle(a, b, vi16{8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31}));
    }
  }
}
