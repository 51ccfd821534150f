// AVX-512 attention tile. The generic tile (attention_tile.h) spends a decode
// on horizontal sums, scalar masking and eight-wide vectors; here each row's
// scores for 16 keys come out as one 16-float vector (per-key partial sums
// folded together in four shuffle levels), masking is a bit mask per group of
// 16 keys, and the softmax and the value sums run sixteen wide. Measured faster
// than the generic tile at every tile size, prefill tiles of 64 rows included.
//
// Included by paged_attention.cpp inside namespace avx512, after
// vector_kernels.h and attention_tile.h, under
// `#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,fma,f16c")`. Serves
// head sizes that are a multiple of 16, without soft-cap or ALiBi (those tiles
// take the generic kernel); sliding windows are masks like causality.

typedef float vf16 __attribute__((vector_size(64), aligned(4), may_alias));
typedef int32_t vi16 __attribute__((vector_size(64), aligned(4), may_alias));

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 load16(const c10::BFloat16* p) {  // bfloat16 is the top half of a float32
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
// Quantized storage comes out before its scale, and float8 e4m3fn times 2^-8
// (kLoadUnit): both float8 formats widen to fp16 bit patterns, see to_float.
inline __m512 load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline __m512 load16(const c10::Float8_e5m2* p) {  // e5m2 is the top byte of an fp16
  const __m256i wide = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm512_cvtph_ps(_mm256_slli_epi16(wide, 8));
}
inline __m512 load16(const c10::Float8_e4m3fn* p) {  // as to_float does it, 16 at once
  const __m256i words = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i sign_once = _mm256_set1_epi16(static_cast<int16_t>(0xBFFF));
  return _mm512_cvtph_ps(_mm256_and_si256(_mm256_slli_epi16(words, 7), sign_once));
}
// What load16 of a K reads, as a multiple of the stored value: a quantized
// cache's scales are multiplied by it.
template <typename K>
constexpr float kLoadUnit = std::is_same_v<K, c10::Float8_e4m3fn> ? 256.f : 1.f;

// Whether slice c (16 elements) of a row starts a new cache line to fetch ahead:
// every slice for 16- and 32-bit types (as measured), every fourth for bytes.
template <typename K>
constexpr bool fetches_slice(int c) {
  return sizeof(K) >= 2 || c % 4 == 0;
}

// Asks for the line at `p` in L2 when Fetch. A tile with few query rows (a
// decode) reads each key once and computes little with it, so it waits on
// memory: its kernels interleave one such request with each load of the
// current group of keys, for the same place in the next group (on another
// block, at a random place, where the hardware prefetcher loses the stream).
// Out of DRAM this roughly halves a decode's time; spreading the requests over
// the loads beat fetching the next group all at once, into L1, or two groups
// ahead (figures: docs/cpp_backend.md, "Fetching ahead"). Tiles of many rows per
// KV head compute enough per key to hide the memory, and skip the requests.
template <bool Fetch, typename T>
inline void fetch_ahead(const T* p) {
  if constexpr (Fetch) _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T1);
}

// Folding 16 vectors of per-key partial sums into one vector of 16 sums, key j
// in lane j. Level 1 pairs keys within 128-bit lanes, level 2 makes each lane
// hold four keys' lane-local sums, levels 3 and 4 add across lanes.
inline __m512 fold_pair(__m512 a, __m512 b) {
  return _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
}
inline __m512 fold_quad(__m512 ab, __m512 cd) {
  return _mm512_add_ps(_mm512_shuffle_ps(ab, cd, 0x44), _mm512_shuffle_ps(ab, cd, 0xEE));
}
inline __m512 fold_lanes(__m512 x, __m512 y) {
  return _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x88), _mm512_shuffle_f32x4(x, y, 0xDD));
}

// Scores of RQ query rows (`q`, rows `hs` = 16 * C apart, held in registers)
// against keys [0, n) (n <= 16) at `keys`, `stride` elements apart: out[r]
// lane j is row r . key j; lanes from n on are 0. Keys come four at a time,
// every row's partial sums folded as they complete, so that the registers hold
// the rows, four partial sums per row and the folded quads. With Fetch, the
// ahead_n (<= 16) keys at `ahead` are asked for: key j's beside the load of key
// j, those past n on their own.
template <int C, int RQ, bool Fetch, typename T>
inline void scores16(const float* q, const T* keys, int64_t stride, int64_t n, __m512* out, const T* ahead,
                     int64_t ahead_n) {
  __m512 rows[RQ][C];
  for (int r = 0; r < RQ; ++r) {
    for (int c = 0; c < C; ++c) rows[r][c] = _mm512_loadu_ps(q + r * 16 * C + 16 * c);
  }
  __m512 quad[RQ][4];
  for (int i = 0; i < 4; ++i) {
    __m512 part[RQ][4];
    for (int k = 0; k < 4; ++k) {
      const T* key = keys + (4 * i + k) * stride;
      const T* next = ahead + (4 * i + k) * stride;
      const bool fetch = Fetch && 4 * i + k < ahead_n;
      if (4 * i + k >= n) {
        for (int r = 0; r < RQ; ++r) part[r][k] = _mm512_setzero_ps();
        for (int c = 0; c < C && fetch; ++c) {
          if (fetches_slice<T>(c)) fetch_ahead<true>(next + 16 * c);
        }
        continue;
      }
      if (fetch) fetch_ahead<true>(next);
      __m512 slice = load16(key);
      for (int r = 0; r < RQ; ++r) part[r][k] = _mm512_mul_ps(rows[r][0], slice);
      for (int c = 1; c < C; ++c) {
        if (fetch && fetches_slice<T>(c)) fetch_ahead<true>(next + 16 * c);
        slice = load16(key + 16 * c);
        for (int r = 0; r < RQ; ++r) part[r][k] = _mm512_fmadd_ps(rows[r][c], slice, part[r][k]);
      }
    }
    for (int r = 0; r < RQ; ++r) {
      quad[r][i] = fold_quad(fold_pair(part[r][0], part[r][1]), fold_pair(part[r][2], part[r][3]));
    }
  }
  for (int r = 0; r < RQ; ++r) out[r] = fold_lanes(fold_lanes(quad[r][0], quad[r][1]), fold_lanes(quad[r][2], quad[r][3]));
}

// scores16 for a head size known only at run time: two rows at once where the
// registers allow it.
template <int RQ, bool Fetch, typename T>
inline void scores16_any(const float* q, int64_t hs, const T* keys, int64_t stride, int64_t n, __m512* out,
                         const T* ahead, int64_t ahead_n) {
  switch (hs / 16) {
    case 4: scores16<4, RQ, Fetch>(q, keys, stride, n, out, ahead, ahead_n); return;
    case 5: scores16<5, RQ, Fetch>(q, keys, stride, n, out, ahead, ahead_n); return;
    case 6: scores16<6, RQ, Fetch>(q, keys, stride, n, out, ahead, ahead_n); return;
    case 8: scores16<8, RQ, Fetch>(q, keys, stride, n, out, ahead, ahead_n); return;
    default: break;
  }
  for (int r = 0; r < RQ; ++r) {  // other multiples of 16: one row at a time
    if (hs == 256) {
      scores16<16, 1, Fetch>(q + r * hs, keys, stride, n, out + r, ahead, ahead_n);
    } else {  // slice by slice, the slices' scores added up
      __m512 sum = _mm512_setzero_ps();
      for (int64_t d = 0; d < hs; d += 16) {
        __m512 lane_d;
        scores16<1, 1, Fetch>(q + r * hs + d, keys + d, stride, n, &lane_d, ahead + d, ahead_n);
        sum = _mm512_add_ps(sum, lane_d);
      }
      out[r] = sum;
    }
  }
}

inline __m512 exp16(__m512 x) {
  const vf16 e = exp_of<vf16, vi16>(reinterpret_cast<const vf16&>(x));
  return reinterpret_cast<const __m512&>(e);
}

// Bits of the keys [start, start + n) that position `pos` sees: causal, and
// within the window when there is one.
inline __mmask16 visible_keys(int64_t start, int64_t n, int64_t pos, int64_t window) {
  const int64_t lo = std::max(start, window > 0 ? pos - window + 1 : start);
  const int64_t hi = std::min(start + n - 1, pos);
  if (hi < lo) return 0;
  const uint32_t upto = (uint32_t{1} << (hi - start + 1)) - 1;  // hi - start + 1 <= 16
  return static_cast<__mmask16>(upto & ~((uint32_t{1} << (lo - start)) - 1));
}

// acc[r] += sum_j w[r * 16 + j] * value_j over R rows and n keys, for NC
// 16-float slices of the head at once: R * NC independent FMA chains, where one
// slice of one row would leave the FMA units waiting on each chain's latency.
// With Fetch, the ahead_n values at `ahead` are asked for as scores16 does.
template <int R, int NC, bool Fetch, typename T>
inline void accumulate16(float* __restrict__ acc, int64_t hs, const float* __restrict__ w, const T* values,
                         int64_t stride, int64_t n, const T* ahead, int64_t ahead_n) {
  __m512 a[R][NC];
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < NC; ++c) a[r][c] = _mm512_loadu_ps(acc + r * hs + 16 * c);
  }
  for (int64_t j = 0; j < n; ++j) {
    const bool fetch = Fetch && j < ahead_n;
    for (int c = 0; c < NC; ++c) {
      if (fetch && fetches_slice<T>(c)) fetch_ahead<true>(ahead + j * stride + 16 * c);
      const __m512 v = load16(values + j * stride + 16 * c);
      for (int r = 0; r < R; ++r) a[r][c] = _mm512_fmadd_ps(_mm512_set1_ps(w[r * 16 + j]), v, a[r][c]);
    }
  }
  for (int64_t j = n; Fetch && j < ahead_n; ++j) {
    for (int c = 0; c < NC; ++c) {
      if (fetches_slice<T>(c)) fetch_ahead<true>(ahead + j * stride + 16 * c);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(acc + r * hs + 16 * c, a[r][c]);
  }
}

// accumulate16 over the whole head: slices four at a time, then the rest.
template <int R, bool Fetch, typename T>
inline void accumulate_head(float* acc, int64_t hs, const float* w, const T* values, int64_t stride, int64_t n,
                            const T* ahead, int64_t ahead_n) {
  int64_t d = 0;
  for (; d + 64 <= hs; d += 64) accumulate16<R, 4, Fetch>(acc + d, hs, w, values + d, stride, n, ahead + d, ahead_n);
  switch ((hs - d) / 16) {
    case 3: accumulate16<R, 3, Fetch>(acc + d, hs, w, values + d, stride, n, ahead + d, ahead_n); break;
    case 2: accumulate16<R, 2, Fetch>(acc + d, hs, w, values + d, stride, n, ahead + d, ahead_n); break;
    case 1: accumulate16<R, 1, Fetch>(acc + d, hs, w, values + d, stride, n, ahead + d, ahead_n); break;
    default: break;
  }
}

// One group of 16 keys into row r's online softmax: the visible keys' weights
// go to w (the others 0), and the row's max, sum and accumulator are rescaled.
inline void softmax_step(__m512 score, __mmask16 seen, float& row_max, float& row_sum, float* acc, int64_t hs,
                         float* w) {
  if (seen == 0) {
    _mm512_storeu_ps(w, _mm512_setzero_ps());
    return;
  }
  score = _mm512_mask_blend_ps(seen, _mm512_set1_ps(-std::numeric_limits<float>::infinity()), score);
  const float new_max = std::max(row_max, _mm512_reduce_max_ps(score));
  const float rescale = std::exp(row_max - new_max);  // 0 while the row was empty
  const __m512 e = _mm512_maskz_mov_ps(seen, exp16(_mm512_sub_ps(score, _mm512_set1_ps(new_max))));
  _mm512_storeu_ps(w, e);
  row_sum = row_sum * rescale + _mm512_reduce_add_ps(e);
  row_max = new_max;
  if (rescale != 1.f) scale_in_place(acc, rescale, hs);
}

// The scales of n <= 16 consecutive slots of one KV head (`heads` floats apart)
// times `unit`, key j in lane j; lanes from n on are 0.
inline __m512 scales16(const float* scales, int64_t heads, int64_t n, float unit) {
  const __m512i index = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                           _mm512_set1_epi32(static_cast<int32_t>(heads)));
  const __mmask16 live = static_cast<__mmask16>((uint32_t{1} << n) - 1);
  const __m512 s = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), live, index, scales, 4);
  return _mm512_mul_ps(s, _mm512_set1_ps(unit));
}

// The tile of attend_tile (same contract). A quantized cache's scales are
// folded in per group of 16 keys, not per element: each row's 16 scores are
// multiplied by the keys' scales, and its 16 softmax weights (after the row's
// sum took them) by the values' scales.
// With Aligned (and a block size that is a multiple of 16), the groups of 16
// keys start at multiples of 16 whatever the tile's first key (a sliding
// window's start): a row's arithmetic then depends on the row alone, not on the
// other rows of its tile, which is what the batch-invariant kernel needs.
template <typename K, bool Fetch, bool Aligned = false>
void attend_tile_fast(const Problem& p, const Tile& tile, Scratch& s, const Tile* after = nullptr) {
  const TileRows t(p, tile);
  const int64_t group = t.group, head_rows = t.head_rows, pos0 = t.pos0, last = t.last;
  const int64_t first = Aligned ? t.first / 16 * 16 : t.first;  // keys before a row's window are masked
  const int64_t hs = p.head_size;
  const int64_t bs = p.block_size;
  begin_rows(p, t, s);
  float* q = s.q.data();
  float* acc = s.acc.data();
  float* weights = s.score.data();  // [head_rows, 16] for the current group of keys
  float* row_max = s.row_max.data();
  float* row_sum = s.row_sum.data();

  const int64_t heads = p.num_kv_heads;
  const int64_t slot_stride = heads * hs;
  for (int64_t logical = first / bs; logical <= last / bs; ++logical) {
    const K* page = page_of<K>(p, tile, logical);
    const int64_t block_start = logical * bs;
    const int64_t j_begin = std::max(first, block_start) - block_start;
    const int64_t j_end = std::min(last + 1, block_start + bs) - block_start;
    for (int64_t j0 = j_begin; j0 < j_end; j0 += 16) {
      const int64_t n = std::min<int64_t>(16, j_end - j0);
      const int64_t key0 = block_start + j0;  // position of the group's first key
      // The next group of keys (fetch_ahead): this tile's, else the first of the
      // tile `after` (as many KV heads), else none. A short context is one group,
      // and without the next tile's it would wait on every read. Exactly the
      // next group's keys are asked for, however many this group has: a last
      // group of 2 keys still fetches all 16 of the next tile's first group, and
      // a full group before a 2-key one fetches only those 2.
      const bool inside = key0 + n <= last;
      const bool onward = !inside && after != nullptr && after->kv_heads == tile.kv_heads;
      const Tile& ahead = onward ? *after : tile;
      const int64_t next0 = inside ? key0 + n : onward ? TileRows(p, *after).first : key0;
      const int64_t next_last = onward ? TileRows(p, *after).last : last;
      const int64_t next_n =
          inside || onward ? std::min<int64_t>({16, (next0 / bs + 1) * bs - next0, next_last + 1 - next0}) : 0;
      const K* next_page = page_of<K>(p, ahead, next0 / bs);
      const float* key_scales = nullptr;  // of the group's first key, at the tile's first KV head
      if constexpr (kScaled<K>) {
        key_scales = scales_of(p, tile, logical) + j0 * heads + tile.kv_head;
        if constexpr (Fetch) {  // the next group's scales, keys' and values', every head: a few lines
          const float* next_scales = scales_of(p, ahead, next0 / bs) + (next0 % bs) * heads;
          for (int64_t kv = 0; kv < 2; ++kv) {
            const char* from = reinterpret_cast<const char*>(next_scales + kv * bs * heads);
            for (int64_t b = 0; b < 16 * heads * int64_t{sizeof(float)}; b += 64) fetch_ahead<true>(from + b);
          }
        }
      }
      for (int64_t h = 0; h < tile.kv_heads; ++h) {
        const K* keys = page + j0 * slot_stride + h * hs;
        const K* values = page + (bs + j0) * slot_stride + h * hs;
        const K* next_keys = next_page + (next0 % bs) * slot_stride + h * hs;
        const K* next_values = next_page + (bs + next0 % bs) * slot_stride + h * hs;
        const int64_t r0 = h * head_rows;
        __m512 key_scale = _mm512_setzero_ps(), value_scale = _mm512_setzero_ps();
        if constexpr (kScaled<K>) {
          key_scale = scales16(key_scales + h, heads, n, kLoadUnit<K>);
          value_scale = scales16(key_scales + bs * heads + h, heads, n, kLoadUnit<K>);
        }
        bool any = false;
        for (int64_t rr = 0; rr < head_rows; rr += 2) {
          const int64_t pair = std::min<int64_t>(2, head_rows - rr);
          __mmask16 seen[2] = {visible_keys(key0, n, pos0 + rr / group, p.window), 0};
          if (pair == 2) seen[1] = visible_keys(key0, n, pos0 + (rr + 1) / group, p.window);
          if ((seen[0] | seen[1]) == 0) {
            for (int64_t i = 0; i < pair; ++i) _mm512_storeu_ps(weights + (rr + i) * 16, _mm512_setzero_ps());
            continue;
          }
          any = true;
          __m512 score[2];
          if (pair == 2) {
            scores16_any<2, Fetch>(q + (r0 + rr) * hs, hs, keys, slot_stride, n, score, next_keys, next_n);
          } else {
            scores16_any<1, Fetch>(q + (r0 + rr) * hs, hs, keys, slot_stride, n, score, next_keys, next_n);
          }
          for (int64_t i = 0; i < pair; ++i) {
            float* w = weights + (rr + i) * 16;
            if constexpr (kScaled<K>) score[i] = _mm512_mul_ps(score[i], key_scale);
            softmax_step(score[i], seen[i], row_max[r0 + rr + i], row_sum[r0 + rr + i], acc + (r0 + rr + i) * hs, hs,
                         w);
            if constexpr (kScaled<K>) _mm512_storeu_ps(w, _mm512_mul_ps(_mm512_loadu_ps(w), value_scale));
          }
        }
        if (!any) continue;
        for_row_groups(head_rows, [&](auto group_rows, int64_t rr) {
          constexpr int R = decltype(group_rows)::value;
          accumulate_head<R, Fetch>(acc + (r0 + rr) * hs, hs, weights + rr * 16, values, slot_stride, n, next_values,
                                    next_n);
        });
      }
    }
  }
  write_rows(p, t, s);
}
