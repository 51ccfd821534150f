// The bfloat16 pieces of the batch-invariant tile of few rows (narrow_rows.h)
// with AVX-512 BF16: the same vdpbf16ps, on the same operands, as the prefill
// tile's lanes (prefill_bf16.h) compute a row's scores and value sums with, but
// with keys, then head dims, in the lanes.
//
// Included by paged_attention.cpp inside namespace avx512bf16, after
// transpose16.h and prefill_bf16.h.

// s[g * R + r] lane j = (unscaled) q_r . key 16g + j for G groups of 16 keys
// (bfloat16 rows at keys[16g + j]) and R rows of query pairs (qw, `words` =
// hs / 2 words a row): one vdpbf16ps per word, down the words in order, as
// prefill_scores_bf16 runs a lane. The groups go together, G * R chains of sums.
// Rows ahead[16g + j] are asked for beside them (transpose16).
template <int G, int R>
void narrow_scores_bf16(const uint32_t* __restrict__ qw, int64_t words, const c10::BFloat16* const* keys,
                        const char* const* ahead, __m512* s) {
  const float* rows[16 * G];
  for (int j = 0; j < 16 * G; ++j) rows[j] = reinterpret_cast<const float*>(keys[j]);
  __m512 a[G][R];
  for (int g = 0; g < G; ++g) {
    for (int r = 0; r < R; ++r) a[g][r] = _mm512_setzero_ps();
  }
  runs_at_least_once(words / 8);  // head sizes of 16 and more
  for (int64_t w0 = 0; w0 < words; w0 += 16) {
    const int64_t count = std::min<int64_t>(16, words - w0);  // 8 or 16
    for (int g = 0; g < G; ++g) {
      __m512 kt[16];
      transpose16(rows + 16 * g, w0, static_cast<__mmask16>((1u << count) - 1), ahead + 16 * g, kt);
      for (int64_t c = 0; c < count; ++c) {
        const __m512bh k = (__m512bh)kt[c];
        for (int r = 0; r < R; ++r) {
          const __m512bh q = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(qw[r * words + w0 + c]));
          a[g][r] = _mm512_dpbf16_ps(a[g][r], q, k);
        }
      }
    }
  }
  for (int g = 0; g < G; ++g) {
    for (int r = 0; r < R; ++r) s[g * R + r] = a[g][r];
  }
}

// acc[r] += pair jp's weights pw[r * w_stride + jp] . value pair jp, for jp < pairs
// in order, R rows: one vdpbf16ps per pair and 16 head dims, as
// prefill_values_bf16 runs a lane. Each 32 head dims d0 .. d0 + 31 of a row are
// kept as the two vectors the 16-bit interleave of the pair's value rows gives:
// at acc + d0 head dims d0 + {0-3, 8-11, 16-19, 24-27}, at acc + d0 + 16 the
// rest (narrow_rows.h puts them back in order); a last 16 in order. The same
// places of rows ahead[j] are asked for beside the loads (transpose16).
template <int RB, int NC>
inline void narrow_values_bf16_block(float* acc, int64_t hs, const uint32_t* pw, int64_t w_stride,
                                     const c10::BFloat16* const* values, const char* const* ahead, int64_t pairs,
                                     int64_t d0) {
  __m512 a[RB][2 * NC];
  for (int r = 0; r < RB; ++r) {
    for (int c = 0; c < 2 * NC; ++c) a[r][c] = _mm512_loadu_ps(acc + r * hs + d0 + 16 * c);
  }
  runs_at_least_once(pairs);
  for (int64_t jp = 0; jp < pairs; ++jp) {
    const c10::BFloat16* even = values[2 * jp] + d0;
    const c10::BFloat16* odd = values[2 * jp + 1] + d0;
    __m512bh v[2 * NC];
    for (int c = 0; c < NC; ++c) {
      const __m512i e = _mm512_loadu_si512(even + 32 * c), o = _mm512_loadu_si512(odd + 32 * c);
      _mm_prefetch(ahead[2 * jp] + 2 * d0 + 64 * c, _MM_HINT_T1);
      _mm_prefetch(ahead[2 * jp + 1] + 2 * d0 + 64 * c, _MM_HINT_T1);
      v[2 * c] = (__m512bh)_mm512_unpacklo_epi16(e, o);
      v[2 * c + 1] = (__m512bh)_mm512_unpackhi_epi16(e, o);
    }
    for (int r = 0; r < RB; ++r) {
      const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(pw[r * w_stride + jp]));
      for (int c = 0; c < 2 * NC; ++c) a[r][c] = _mm512_dpbf16_ps(a[r][c], w, v[c]);
    }
  }
  for (int r = 0; r < RB; ++r) {
    for (int c = 0; c < 2 * NC; ++c) _mm512_storeu_ps(acc + r * hs + d0 + 16 * c, a[r][c]);
  }
}

// The last 16 head dims of a head size that is an odd multiple of 16, in order.
template <int RB>
inline void narrow_values_bf16_tail(float* acc, int64_t hs, const uint32_t* pw, int64_t w_stride,
                                    const c10::BFloat16* const* values, const char* const* ahead, int64_t pairs,
                                    int64_t d0) {
  __m512 a[RB];
  for (int r = 0; r < RB; ++r) a[r] = _mm512_loadu_ps(acc + r * hs + d0);
  for (int64_t jp = 0; jp < pairs; ++jp) {
    const __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(values[2 * jp] + d0)));
    const __m512i hi =
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(values[2 * jp + 1] + d0)));
    _mm_prefetch(ahead[2 * jp] + 2 * d0, _MM_HINT_T1);
    _mm_prefetch(ahead[2 * jp + 1] + 2 * d0, _MM_HINT_T1);
    const __m512bh v = (__m512bh)_mm512_or_si512(lo, _mm512_slli_epi32(hi, 16));
    for (int r = 0; r < RB; ++r) {
      a[r] = _mm512_dpbf16_ps(a[r], (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(pw[r * w_stride + jp])), v);
    }
  }
  for (int r = 0; r < RB; ++r) _mm512_storeu_ps(acc + r * hs + d0, a[r]);
}

template <int RB>
inline void narrow_values_bf16_rows(float* acc, int64_t hs, const uint32_t* pw, int64_t w_stride,
                                    const c10::BFloat16* const* values, const char* const* ahead, int64_t pairs) {
  int64_t d = 0;
  for (; d + 64 <= hs; d += 64) narrow_values_bf16_block<RB, 2>(acc, hs, pw, w_stride, values, ahead, pairs, d);
  if (d + 32 <= hs) {
    narrow_values_bf16_block<RB, 1>(acc, hs, pw, w_stride, values, ahead, pairs, d);
    d += 32;
  }
  if (d < hs) narrow_values_bf16_tail<RB>(acc, hs, pw, w_stride, values, ahead, pairs, d);
}

// The float32 weights w[r * w_stride + j] (j < 2 * pairs <= 48) are rounded to
// bfloat16 pairs first, as probability_pairs rounds them.
template <int R>
void narrow_values_bf16(float* acc, int64_t hs, const float* w, int64_t w_stride, const c10::BFloat16* const* values,
                        const char* const* ahead, int64_t pairs) {
  constexpr int64_t kPairStride = 24;
  uint32_t pw[R * kPairStride];
  for (int r = 0; r < R; ++r) {
    for (int64_t jp = 0; jp < pairs; jp += 8) {
      const __m256bh b = _mm512_cvtneps_pbh(_mm512_loadu_ps(w + r * w_stride + 2 * jp));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(pw + r * kPairStride + jp), (__m256i)b);
    }
  }
  if constexpr (R > 4) {  // four rows at a time keep the accumulators in registers
    narrow_values_bf16_rows<4>(acc, hs, pw, kPairStride, values, ahead, pairs);
    narrow_values_bf16_rows<R - 4>(acc + 4 * hs, hs, pw + 4 * kPairStride, kPairStride, values, ahead, pairs);
  } else {
    narrow_values_bf16_rows<R>(acc, hs, pw, kPairStride, values, ahead, pairs);
  }
}

#define KVFORGE_NARROW_BF16(R)                                                                                  \
  template void narrow_scores_bf16<kNarrowGroups<R>, R>(const uint32_t*, int64_t, const c10::BFloat16* const*, \
                                                       const char* const*, __m512*);                          \
  template void narrow_values_bf16<R>(float*, int64_t, const float*, int64_t, const c10::BFloat16* const*,    \
                                      const char* const*, int64_t);
KVFORGE_NARROW_BF16(1)
KVFORGE_NARROW_BF16(2)
KVFORGE_NARROW_BF16(3)
KVFORGE_NARROW_BF16(4)
KVFORGE_NARROW_BF16(5)
KVFORGE_NARROW_BF16(6)
KVFORGE_NARROW_BF16(7)
KVFORGE_NARROW_BF16(8)
#undef KVFORGE_NARROW_BF16
