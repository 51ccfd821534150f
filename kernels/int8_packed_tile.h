// The weight-only int8 linear over a packed weight (int8_packed_linear.cpp):
// the sums x w^T (unscaled: finish_blocks applies the scales, bias and
// epilogue) with w laid out [blocks][in][kPackChannels]
// (int8_pack_weight), so that one 64-byte line holds one input of 64
// channels and a block is one stream, read front to back.
//
// Included by int8_packed_linear.cpp once per ISA, each time after
// bf16_vectors.h (vf16, store_bf16x16, load1) and native_vectors.h (vw, kW),
// after defining `widen_w16` (16 int8 weights as floats), `widen_w` (kW int8
// weights as floats), `kPackedRows` (rows per tile: as many as the
// accumulators fit the registers) and `kPackedUnroll` (inputs per pass of a
// one-row tile). It includes nothing itself.
//
// The decode tile keeps its sums in `vw` (see native_vectors.h: in vf16 it
// read weights at a tenth of memory speed under AVX2).

constexpr int kV = kPackChannels / kW;  // vectors per 64-channel line

// MR rows of x (float32, or bfloat16 bits; x_stride apart) against one
// packed block of 64 channels (the last block's padding channels have zero
// weights): y[m * y_stride + c] = x_m . w_c for all 64.
// Each step widens the line of input d (64 channels, kV vectors) once and
// adds x[m][d] times it into kW channels per vector: the sums of 64 channels
// sit in kV MR registers, so no sum is ever folded across lanes.
template <int MR, typename X>
inline void packed_tile(const X* __restrict__ x, int64_t x_stride, const int8_t* __restrict__ block, int64_t k,
                        float* __restrict__ y, int64_t y_stride) {
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
      for (int i = 0; i < kUnroll; ++i) xv[m][i] = load1(x + m * x_stride + d + i);
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
      for (int m = 0; m < MR; ++m) acc[m][u] += load1(x + m * x_stride + d) * wv;
    }
  }
  for (int m = 0; m < MR; ++m) {
    for (int u = 0; u < kV; ++u) *reinterpret_cast<vw*>(y + m * y_stride + kW * u) = acc[m][u];
  }
}

// Channels of a quarter of a line, the vectors they take, and the inputs a
// walk takes at a time.
constexpr int64_t kQuarter = kPackChannels / 4;
constexpr int kQ = kQuarter / kW;
constexpr int64_t kWalkInputs = 16;

// Inputs [d0, d1) of MR rows against one packed block, P quarters at a time:
// each input's P quarter lines (16 P channels) widened once and multiplied
// into all MR rows' sums (kQ P MR registers), which wait in `sums` ([MR][64],
// rows sums_stride apart) from one chunk and pass to the next. Each sum adds
// input d, then d + 1, ..., as packed_tile's do, so a sum is one chain of
// multiply-adds: P = 2 for one or two rows keeps 8 of them in flight, as the
// FMA's latency needs (4 left it waiting).
template <int MR, int P, typename X>
inline void walk_chunk(const X* __restrict__ x, int64_t x_stride, const int8_t* __restrict__ block, int64_t d0,
                       int64_t d1, float* __restrict__ sums, int64_t sums_stride) {
  constexpr int V = kQ * P;  // vectors per pass
  for (int q = 0; q < 4; q += P) {
    vw acc[MR][V];
    for (int m = 0; m < MR; ++m) {
      for (int u = 0; u < V; ++u) {
        acc[m][u] = d0 == 0 ? vw{} : *reinterpret_cast<const vw*>(sums + m * sums_stride + q * kQuarter + kW * u);
      }
    }
    for (int64_t d = d0; d < d1; ++d) {
      const int8_t* line = block + d * kPackChannels + q * kQuarter;
      vw wv[V];
      for (int u = 0; u < V; ++u) wv[u] = widen_w(line + kW * u);
      for (int m = 0; m < MR; ++m) {
        const float xv = load1(x + m * x_stride + d);
        for (int u = 0; u < V; ++u) acc[m][u] += xv * wv[u];
      }
    }
    for (int m = 0; m < MR; ++m) {
      for (int u = 0; u < V; ++u) *reinterpret_cast<vw*>(sums + m * sums_stride + q * kQuarter + kW * u) = acc[m][u];
    }
  }
}

// Two rows or more against one packed block, where one row's sums of a whole
// line fill the registers (kPackedRows 1: packed_tile would widen every weight
// again for each row). A walk: the inputs in chunks of
// kWalkInputs lines (1 KiB, fetched non-temporally as packed_tile fetches its
// stream, and in L1 for the chunk), and in each chunk every group of at most
// kQuarterRows rows (near-equal groups) runs walk_chunk over it. So the block is
// read from memory once, front to back, and each weight widened once per group.
// The sums wait in y between chunks (k > 0: the op answers k = 0 itself). A row
// gets the bits it gets alone (packed_tile's order).
template <typename X>
inline void walk_rows(const X* x, int64_t x_stride, int64_t m, const int8_t* block, int64_t k, float* y,
                      int64_t y_stride) {
  const int64_t groups = (m + kQuarterRows - 1) / kQuarterRows;
  for (int64_t d0 = 0; d0 < k; d0 += kWalkInputs) {
    const int64_t d1 = std::min(k, d0 + kWalkInputs);
    for (int64_t d = d0; d < d1; ++d) __builtin_prefetch(block + d * kPackChannels + kWeightsAhead, 0, 0);
    for (int64_t g = 0, r = 0; g < groups; ++g) {
      const int64_t rows = (m - r) / (groups - g);
      const X* xr = x + r * x_stride;
      float* yr = y + r * y_stride;
      switch (rows) {
        case 6: walk_chunk<6, 1>(xr, x_stride, block, d0, d1, yr, y_stride); break;
        case 5: walk_chunk<5, 1>(xr, x_stride, block, d0, d1, yr, y_stride); break;
        case 4: walk_chunk<4, 1>(xr, x_stride, block, d0, d1, yr, y_stride); break;
        case 3: walk_chunk<3, 1>(xr, x_stride, block, d0, d1, yr, y_stride); break;
        case 2: walk_chunk<2, 2>(xr, x_stride, block, d0, d1, yr, y_stride); break;
        default: walk_chunk<1, 2>(xr, x_stride, block, d0, d1, yr, y_stride); break;
      }
      r += rows;
    }
  }
}

// packed_tile for `rows` rows (1 to MR): the tile of that many rows.
template <int MR, typename X>
inline void packed_tile_of(int64_t rows, const X* x, int64_t x_stride, const int8_t* block, int64_t k, float* y,
                           int64_t y_stride) {
  if constexpr (MR > 1) {
    if (rows < MR) return packed_tile_of<MR - 1>(rows, x, x_stride, block, k, y, y_stride);
  }
  packed_tile<MR>(x, x_stride, block, k, y, y_stride);
}

// All m rows against one packed block: on a path with kQuarterRows, two rows or
// more by walk_rows; else in near-equal groups of at most kPackedRows rows (the
// block, 64 k bytes, comes from memory for the first group and from cache
// after; 5 rows as 4 + 1 made each weight widened twice and the one-row pass as
// long as half the four-row one).
template <typename X>
inline void packed_rows(const X* x, int64_t x_stride, int64_t m, const int8_t* block, int64_t k, float* y,
                        int64_t y_stride) {
  if constexpr (kQuarterRows > 0) {
    if (m > 1) {
      walk_rows(x, x_stride, m, block, k, y, y_stride);
      return;
    }
  }
  const int64_t groups = (m + kPackedRows - 1) / kPackedRows;
  for (int64_t g = 0, r = 0; g < groups; ++g) {
    const int64_t rows = (m - r) / (groups - g);
    packed_tile_of<kPackedRows>(rows, x + r * x_stride, x_stride, block, k, y + r * y_stride, y_stride);
    r += rows;
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

// One packed block as widened_bf16_linear reads a weight, unscaled (every int8 is
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
