// The register tile of the bfloat16 linear for CPUs with AVX-512 BF16: one
// vdpbf16ps per (row, block, input pair) adds x[2p] w[2p] + x[2p+1] w[2p+1]
// into the block's 16 float32 sums (layout: linear_tile.h). The inputs
// pair is broadcast as one 32-bit word; the weights are read as packed.
// Included once, under the avx512bf16 target, after linear_tile.h.

// Inputs 2p and 2p + 1 as one 32-bit word in every lane (one broadcast load).
inline __m512bh x_pair(const uint16_t* p) {
  int32_t word;
  __builtin_memcpy(&word, p, 4);
  return (__m512bh)_mm512_set1_epi32(word);
}

// An odd width's last input alone, the other half zero: never read past the row.
inline __m512bh x_last(const uint16_t* p) { return (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(p[0])); }

template <int MR, int NB>
inline void dpbf16_tile(const uint16_t* __restrict__ x, int64_t x_stride, const uint16_t* __restrict__ w,
                        int64_t k, float* __restrict__ acc_out, const char* ahead, int64_t ahead_step) {
  const int64_t pairs = (k + 1) / 2;
  __m512 acc[MR][NB] = {};
  const int64_t full = k / 2;
  for (int64_t p = 0; p < full; ++p) {
    prefetch_step(ahead, ahead_step, p);
    __m512bh wv[NB];
    for (int b = 0; b < NB; ++b) wv[b] = (__m512bh)_mm512_loadu_si512(w + (b * pairs + p) * 2 * kLanes);
    for (int m = 0; m < MR; ++m) {
      const __m512bh xv = x_pair(x + m * x_stride + 2 * p);
      for (int b = 0; b < NB; ++b) acc[m][b] = _mm512_dpbf16_ps(acc[m][b], xv, wv[b]);
    }
  }
  if (full < pairs) {  // an odd width: the last input alone, never read past the row
    __m512bh wv[NB];
    for (int b = 0; b < NB; ++b) wv[b] = (__m512bh)_mm512_loadu_si512(w + (b * pairs + full) * 2 * kLanes);
    for (int m = 0; m < MR; ++m) {
      const __m512bh xv = x_last(x + m * x_stride + 2 * full);
      for (int b = 0; b < NB; ++b) acc[m][b] = _mm512_dpbf16_ps(acc[m][b], xv, wv[b]);
    }
  }
  for (int m = 0; m < MR; ++m) {
    for (int b = 0; b < NB; ++b) _mm512_storeu_ps(acc_out + m * kMaxBlocks * kLanes + b * kLanes, acc[m][b]);
  }
}
