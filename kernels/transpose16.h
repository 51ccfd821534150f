// A 16 x 16 transpose of 32-bit words in registers: out[c] lane j = word w0 + c
// of row j, for 16 rows (rows[j], read from word w0 on). Words whose bit is
// clear in `live` are not read (out[c] is 0 for those c): a row of 8 words
// (a bfloat16 head of 16) is read without passing its end. Beside the load of
// row j, the same place of row ahead[j] is asked for (into L2): the rows a
// later transpose reads, from blocks at random places that the hardware
// prefetchers do not follow (decode_tile.h's fetch_ahead, one request per load).
//
// Included by paged_attention.cpp inside namespace avx512 (float32 keys) and
// avx512bf16 (bfloat16 keys as pairs), for the batch-invariant tile of few rows
// (narrow_rows.h, narrow_bf16.h).

// Always inlined: a call would pass the 16 outputs through memory.
inline __attribute__((always_inline)) void transpose16(const float* const* rows, int64_t w0, __mmask16 live,
                                                       const char* const* ahead, __m512* out) {
  __m512 r[16], t[16];
  for (int j = 0; j < 16; ++j) {
    r[j] = _mm512_maskz_loadu_ps(live, rows[j] + w0);
    _mm_prefetch(ahead[j] + 4 * w0, _MM_HINT_T1);
  }
  for (int i = 0; i < 8; ++i) {  // 32-bit interleave within 128-bit lanes
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // r[4i + k], 128-bit lane L: word 4L + k of rows 4i .. 4i + 3
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
    out[k] = _mm512_shuffle_f32x4(a, c, 0x88);
    out[8 + k] = _mm512_shuffle_f32x4(a, c, 0xDD);
    out[4 + k] = _mm512_shuffle_f32x4(b, e, 0x88);
    out[12 + k] = _mm512_shuffle_f32x4(b, e, 0xDD);
  }
}

// How many groups of 16 keys the scores of the narrow tile's R rows take at once
// (transposed as above): all three of a key tile while their G * R sums and a
// transposed group fit in the registers, else one.
template <int R>
constexpr int kNarrowGroups = R <= 4 ? 3 : 1;
