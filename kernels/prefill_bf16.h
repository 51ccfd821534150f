// The prefill tile's scores from bfloat16 queries and keys with AVX-512 BF16:
// one vdpbf16ps multiplies two head dims of 16 rows by one key and adds both
// products into float32, half the instructions of converting and FMA-ing.
//
// Included by paged_attention.cpp inside namespace avx512bf16, compiled for
// avx512bf16 and called by prefill_tile.h only where has_avx512_bf16() holds.
// Queries arrive as pairs, qt2[d / 2][lane] = (q[lane][d], q[lane][d + 1]) in
// one 32-bit word; each key is read where it lies in the cache, two head dims
// (one 32-bit word) broadcast at a time, with no float copy of it.

constexpr int64_t kPairLanes = 64;  // lanes of a qt2 row: the prefill tile's kLanes

// st[j][lanes] = qt2 . key j (unscaled) for J keys at keys[j], RV row vectors.
template <int RV, int J>
void prefill_scores_bf16(const uint32_t* __restrict__ qt2, int64_t hs, const c10::BFloat16* const* keys,
                         float* __restrict__ st) {
  __m512 s[J][RV];
  for (int j = 0; j < J; ++j) {
    for (int v = 0; v < RV; ++v) s[j][v] = _mm512_setzero_ps();
  }
  for (int64_t d = 0; d < hs / 2; ++d) {
    __m512bh q[RV];
    for (int v = 0; v < RV; ++v) q[v] = (__m512bh)_mm512_loadu_si512(qt2 + d * kPairLanes + 16 * v);
    for (int j = 0; j < J; ++j) {
      uint32_t pair;
      std::memcpy(&pair, keys[j] + 2 * d, sizeof(pair));
      const __m512bh k = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(pair));
      for (int v = 0; v < RV; ++v) s[j][v] = _mm512_dpbf16_ps(s[j][v], q[v], k);
    }
  }
  for (int j = 0; j < J; ++j) {
    for (int v = 0; v < RV; ++v) _mm512_storeu_ps(st + j * kPairLanes + 16 * v, s[j][v]);
  }
}

template void prefill_scores_bf16<1, 8>(const uint32_t*, int64_t, const c10::BFloat16* const*, float*);
template void prefill_scores_bf16<2, 8>(const uint32_t*, int64_t, const c10::BFloat16* const*, float*);
template void prefill_scores_bf16<3, 6>(const uint32_t*, int64_t, const c10::BFloat16* const*, float*);
template void prefill_scores_bf16<4, 6>(const uint32_t*, int64_t, const c10::BFloat16* const*, float*);
