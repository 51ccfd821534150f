// The prefill tile's arithmetic for a tile of few rows (a decode: one token's
// query heads of one KV head), with the lanes used fully. The prefill tile puts
// rows in lanes, so a decode of G query heads per KV head fills G of 16; here
// keys (scores) and head dims (value sums) fill the lanes instead, and each
// element is computed by the very operations, in the very order, the prefill
// tile's lane computes it with:
//
//   score  st[j][r]  = fma(q[r][d], k[j][d], s) for d = 0, 1, ...  (16 keys in lanes,
//                      the key tile transposed 16 x 16 first; with bfloat16 pairs
//                      one vdpbf16ps per two head dims, as prefill_bf16.h)
//   value  acc[r][d] = fma(w[j][r], v[j][d], acc) for j = 0, 1, ...  (16 head dims in lanes)
//
// so the invariant prefill tile gives a row the same bits whether it takes this
// path or the lanes. Accumulators are row-major here, acc[r * hs + d].
//
// Included inside namespace avx512 (float32) and avx512bf16 (pairs, with
// prefill_bf16.h): both need transpose16.

// Rows [0, 16) of 32-bit words `w0 .. w0 + 16` of 16 rows into kt[w0 + c][j] (16 words apart).
inline void transpose16(const float* const* rows, int64_t w0, float* __restrict__ kt) {
  __m512 r[16], t[16];
  for (int j = 0; j < 16; ++j) r[j] = _mm512_loadu_ps(rows[j] + w0);
  for (int i = 0; i < 8; ++i) {  // 32-bit interleave within 128-bit lanes
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // r[4i + k], lane L: word 4L + k of rows 4i .. 4i + 3
    r[4 * i + 0] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  for (int k = 0; k < 4; ++k) {
    // words k and 8 + k (0x88) or 4 + k and 12 + k (0xDD) of rows 0-7, then of rows 8-15
    const __m512 a = _mm512_shuffle_f32x4(r[k], r[4 + k], 0x88), b = _mm512_shuffle_f32x4(r[k], r[4 + k], 0xDD);
    const __m512 c = _mm512_shuffle_f32x4(r[8 + k], r[12 + k], 0x88),
                 e = _mm512_shuffle_f32x4(r[8 + k], r[12 + k], 0xDD);
    _mm512_storeu_ps(kt + (w0 + k) * 16, _mm512_shuffle_f32x4(a, c, 0x88));
    _mm512_storeu_ps(kt + (w0 + 8 + k) * 16, _mm512_shuffle_f32x4(a, c, 0xDD));
    _mm512_storeu_ps(kt + (w0 + 4 + k) * 16, _mm512_shuffle_f32x4(b, e, 0x88));
    _mm512_storeu_ps(kt + (w0 + 12 + k) * 16, _mm512_shuffle_f32x4(b, e, 0xDD));
  }
}

// st[j0 + j][r] for 16 keys (rows of `words` 32-bit words at keys[j]) and rows
// r < rows, from the queries' words qw[w][lane] (kLanes apart): `step(s, q, k)`
// adds one word's products the way the prefill tile's lanes do. kt: 16 * words floats.
template <typename Step>
inline void narrow_scores_with(const float* qw, int64_t words, const float* const* keys, int64_t rows,
                               float* __restrict__ kt, float* __restrict__ st, int64_t lanes, Step&& step) {
  for (int64_t w0 = 0; w0 < words; w0 += 16) transpose16(keys, w0, kt);
  alignas(64) float out[4][16];
  runs_at_least_once(words);
  for (int64_t r = 0; r < rows; r += 4) {
    __m512 s[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int64_t w = 0; w < words; ++w) {  // rows past `rows` compute padding, never read
      const __m512 k = _mm512_loadu_ps(kt + w * 16);
      for (int i = 0; i < 4; ++i) s[i] = step(s[i], _mm512_set1_ps(qw[w * lanes + r + i]), k);
    }
    for (int i = 0; i < 4; ++i) _mm512_store_ps(out[i], s[i]);
    for (int64_t i = 0; i < 4 && r + i < rows; ++i) {
      for (int j = 0; j < 16; ++j) st[j * lanes + r + i] = out[i][j];
    }
  }
}

// acc[r][d] += sum_j w(j, r) * value(j)[d] for rows r < rows, j < n, all hs head
// dims; `step(a, w, v)` adds one key's (or key pair's) product the prefill tile's way.
template <typename Weight, typename Value, typename Step>
inline void narrow_values_with(float* __restrict__ acc, int64_t hs, int64_t rows, int64_t n, Weight&& weight,
                               Value&& value, Step&& step) {
  for (int64_t r = 0; r < rows; r += 2) {
    const int64_t pair = std::min<int64_t>(2, rows - r);
    for (int64_t d = 0; d < hs; d += 64) {
      const int64_t slices = std::min<int64_t>(4, (hs - d) / 16);
      __m512 a[2][4];
      for (int64_t i = 0; i < 2; ++i) {
        for (int64_t c = 0; c < 4; ++c) {
          a[i][c] = i < pair && c < slices ? _mm512_loadu_ps(acc + (r + i) * hs + d + 16 * c) : _mm512_setzero_ps();
        }
      }
      for (int64_t j = 0; j < n; ++j) {
        const __m512 w0 = weight(j, r), w1 = weight(j, r + pair - 1);
        for (int64_t c = 0; c < slices; ++c) {
          const __m512 v = value(j, d + 16 * c);
          a[0][c] = step(a[0][c], w0, v);
          a[1][c] = step(a[1][c], w1, v);
        }
      }
      for (int64_t i = 0; i < pair; ++i) {
        for (int64_t c = 0; c < slices; ++c) _mm512_storeu_ps(acc + (r + i) * hs + d + 16 * c, a[i][c]);
      }
    }
  }
}
