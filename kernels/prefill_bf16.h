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
  runs_at_least_once(hs / 2);  // prefill_tile_fits
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

// The value sums from bfloat16 too: the weights of keys 2jp and 2jp + 1 rounded
// to bfloat16 and paired per lane, pt2[jp][lane], against each value pair
// vt2[jp][d] = (v[2jp][d], v[2jp + 1][d]), one vdpbf16ps per two keys. The
// weights are rounded once, as FlashAttention rounds P before P.V; the softmax
// sums stay float32.

// pt2[jp][lanes of row vector v] = (bf16(st[2jp][lane]), bf16(st[2jp + 1][lane])) for jp < pairs.
void probability_pairs(const float* __restrict__ st, uint32_t* __restrict__ pt2, int64_t lane0, int64_t pairs) {
  for (int64_t jp = 0; jp < pairs; ++jp) {
    const __m256i even = (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(st + 2 * jp * kPairLanes + lane0));
    const __m256i odd = (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(st + (2 * jp + 1) * kPairLanes + lane0));
    const __m512i words = _mm512_or_si512(_mm512_cvtepu16_epi32(even),
                                          _mm512_slli_epi32(_mm512_cvtepu16_epi32(odd), 16));
    _mm512_storeu_si512(pt2 + jp * kPairLanes + lane0, words);
  }
}

// acct[d][lanes] += sum_jp pt2[jp][lanes] . vt2[jp][d] for D head dims (acct and vt2
// already offset to the first), RV row vectors, `pairs` key pairs.
template <int RV, int D>
void prefill_values_bf16(float* __restrict__ acct, const uint32_t* __restrict__ pt2, const uint32_t* __restrict__ vt2,
                         int64_t hs, int64_t pairs) {
  __m512 a[D][RV];
  for (int d = 0; d < D; ++d) {
    for (int v = 0; v < RV; ++v) a[d][v] = _mm512_loadu_ps(acct + d * kPairLanes + 16 * v);
  }
  runs_at_least_once(pairs);  // a key tile holds at least one key
  for (int64_t jp = 0; jp < pairs; ++jp) {
    __m512bh w[RV];
    for (int v = 0; v < RV; ++v) w[v] = (__m512bh)_mm512_loadu_si512(pt2 + jp * kPairLanes + 16 * v);
    for (int d = 0; d < D; ++d) {
      const __m512bh x = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(vt2[jp * hs + d]));
      for (int v = 0; v < RV; ++v) a[d][v] = _mm512_dpbf16_ps(a[d][v], w[v], x);
    }
  }
  for (int d = 0; d < D; ++d) {
    for (int v = 0; v < RV; ++v) _mm512_storeu_ps(acct + d * kPairLanes + 16 * v, a[d][v]);
  }
}

template void prefill_values_bf16<1, 8>(float*, const uint32_t*, const uint32_t*, int64_t, int64_t);
template void prefill_values_bf16<2, 8>(float*, const uint32_t*, const uint32_t*, int64_t, int64_t);
template void prefill_values_bf16<3, 4>(float*, const uint32_t*, const uint32_t*, int64_t, int64_t);
template void prefill_values_bf16<4, 4>(float*, const uint32_t*, const uint32_t*, int64_t, int64_t);
