// AVX-512 prefill tile: many query rows of one KV head (a prompt or a chunk of
// one) against its keys, laid out "rows in lanes". The tile's queries are held
// transposed, qt[d][r] (row r of the tile in lane r % 16 of vector r / 16), so
//
//   scores  s[j][r]  = sum_d qt[d][r] * k[j][d]   (a vector of 16 rows per FMA,
//                                                  k[j][d] one broadcast)
//   softmax          per lane: max, exp and sum run down the keys, vertically
//   values  acc[d][r] += p[j][r] * v[j][d]        (again a broadcast per (j, d))
//
// so no horizontal sum, shuffle or scalar per-row loop is left in the hot path:
// each of the up to four row vectors (64 rows) reuses every key and value
// element it broadcasts, and the register blocks (6-8 keys or 4-8 head dims x
// up to 4 row vectors) keep 16-24 accumulators live. Key tiles of kKeyTile keys are
// read through the block table across block boundaries: a float32 cache where
// it lies, by row pointers; any other is converted to float32 into two small
// tile buffers first (a quantized cache times its scales); a key
// tile no row of a row vector sees is skipped for that row vector, so the
// causal upper triangle and everything left of a sliding window cost nothing.
// Soft-cap and ALiBi are applied per lane too, so this tile serves every
// feature the generic one does.
//
// With AVX-512 BF16 and a bfloat16 cache, the scores and the value sums come from
// prefill_bf16.h (two head dims, or two keys, per vdpbf16ps).
//
// Included by paged_attention.cpp inside namespace avx512, after decode_tile.h.

constexpr int64_t kKeyTile = 48;  // keys per softmax step (a multiple of kKeyPad)
constexpr int64_t kKeyPad = 24;  // key counts are padded to a multiple of every register block's keys (6 and 8)

// Keys per register block of the scores for RV row vectors: 6 x 4 or 6 x 3 or
// 8 x 2 or 8 x 1 accumulators.
template <int RV>
constexpr int kScoreKeys = RV >= 3 ? 6 : 8;

constexpr float kMaxSlack = 8.f;  // how far a score may pass its row's running maximum before the rescale

inline int64_t pad_keys(int64_t n) { return (n + kKeyPad - 1) / kKeyPad * kKeyPad; }
constexpr int64_t kLanes = 64;  // lanes of every transposed row: the tile's rows, padded

// st[j][lanes] = qt . key_j for J keys (float32 rows at keys[j]) and RV row vectors.
template <int RV, int J>
inline void prefill_scores(const float* __restrict__ qt, int64_t hs, const float* const* keys,
                           float* __restrict__ st) {
  const float* kf[J];
  for (int j = 0; j < J; ++j) kf[j] = keys[j];
  __m512 s[J][RV];
  for (int j = 0; j < J; ++j) {
    for (int v = 0; v < RV; ++v) s[j][v] = _mm512_setzero_ps();
  }
  runs_at_least_once(hs);  // prefill_tile_fits
  for (int64_t d = 0; d < hs; ++d) {
    __m512 q[RV];
    for (int v = 0; v < RV; ++v) q[v] = _mm512_loadu_ps(qt + d * kLanes + 16 * v);
    for (int j = 0; j < J; ++j) {
      const __m512 k = _mm512_set1_ps(kf[j][d]);
      for (int v = 0; v < RV; ++v) s[j][v] = _mm512_fmadd_ps(q[v], k, s[j][v]);
    }
  }
  for (int j = 0; j < J; ++j) {
    for (int v = 0; v < RV; ++v) _mm512_storeu_ps(st + j * kLanes + 16 * v, s[j][v]);
  }
}

// acct[d][lanes] += sum_j st[j][lanes] * values[j][d0 + d] for D head dims from `d0`.
template <int RV, int D>
inline void prefill_values(float* __restrict__ acct, const float* __restrict__ pt, const float* const* values,
                           int64_t d0, int64_t n) {
  __m512 a[D][RV];
  for (int d = 0; d < D; ++d) {
    for (int v = 0; v < RV; ++v) a[d][v] = _mm512_loadu_ps(acct + d * kLanes + 16 * v);
  }
  runs_at_least_once(n);  // a key tile holds at least one key
  for (int64_t j = 0; j < n; ++j) {
    __m512 w[RV];
    for (int v = 0; v < RV; ++v) w[v] = _mm512_loadu_ps(pt + j * kLanes + 16 * v);
    const float* vf = values[j] + d0;
    for (int d = 0; d < D; ++d) {
      const __m512 x = _mm512_set1_ps(vf[d]);
      for (int v = 0; v < RV; ++v) a[d][v] = _mm512_fmadd_ps(w[v], x, a[d][v]);
    }
  }
  for (int d = 0; d < D; ++d) {
    for (int v = 0; v < RV; ++v) _mm512_storeu_ps(acct + d * kLanes + 16 * v, a[d][v]);
  }
}

// e^x lane by lane in 10 instructions, 6 of them multiplies (where a degree-6
// polynomial took 9): x log2 e = k + i/16 + f with k an integer, i in 0..15 and
// |f| <= 1/32; 2^(i/16) from a register table by one vpermps, 2^f from a
// degree-3 polynomial (within 1e-8), 2^k by vscalefps. One FMA rounds x log2 e
// to sixteenths and leaves i in the low bits of the sum; f comes from another
// FMA, exact but for log2(e)'s own rounding, so the relative error grows with
// |x|: below 5e-7 above x = -30, 1.2e-6 at -87 (on a weight of e^-87). x is
// clamped at -87 (e^-87, a normal float just above the smallest, stands for
// anything below: no denormal results, which are slow, and no NaN from -inf;
// callers mask what must be exactly 0). exp(0) is exactly 1.
inline __m512 exp16_fast(__m512 x) {
  const __m512 log2e = _mm512_set1_ps(1.44269504088896341f);
  const __m512 magic = _mm512_set1_ps(786432.f);  // 1.5 * 2^19: its ulp is 1/16
  const __m512 table = _mm512_setr_ps(1.f, 1.04427378242741384f, 1.09050773266525766f, 1.13878863475669165f,
                                      1.18920711500272107f, 1.24185781207348405f, 1.29683955465100967f,
                                      1.35425554693689273f, 1.41421356237309505f, 1.47682614593949931f,
                                      1.54221082540794082f, 1.61049033194925431f, 1.68179283050742909f,
                                      1.75625216037329948f, 1.83400808640934246f, 1.91520656139714729f);
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 big = _mm512_fmadd_ps(x, log2e, magic);  // x log2 e rounded to 1/16, in the low bits
  const __m512 n = _mm512_sub_ps(big, magic);
  const __m512 f = _mm512_fmsub_ps(x, log2e, n);
  const __m512 t = _mm512_permutexvar_ps(_mm512_castps_si512(big), table);
  __m512 q = _mm512_fmadd_ps(_mm512_set1_ps(0.0555041086648215800f), f, _mm512_set1_ps(0.240226506959100712f));
  q = _mm512_fmadd_ps(q, f, _mm512_set1_ps(0.693147180559945309f));
  q = _mm512_mul_ps(q, f);
  return _mm512_scalef_ps(_mm512_fmadd_ps(t, q, t), n);
}

// tanh lane by lane as 1 - 2 / (e^2x + 1): exact at both ends, where exp_of clamps.
inline __m512 tanh16(__m512 x) {
  const __m512 e = exp16(_mm512_add_ps(x, x));
  return _mm512_sub_ps(_mm512_set1_ps(1.f), _mm512_div_ps(_mm512_set1_ps(2.f), _mm512_add_ps(e, _mm512_set1_ps(1.f))));
}

// Keys [k0, k0 + n) of the tile's KV head as float32 rows (hs apart) into
// `keys` and `values`, read through the block table; rows n .. pad_keys(n) zeroed.
// With `rows` (a float32 cache, or bfloat16 sums, prefill_bf16.h) keys and values stay where they are:
// rows[j] and value_rows[j] point at key j's, rows n .. pad_keys(n) at `zeros`,
// and neither `keys` nor `values` is written.
template <typename K>
inline void load_key_tile(const Problem& p, const Tile& tile, int64_t k0, int64_t n, float* keys, float* values,
                          const K** rows = nullptr, const K** value_rows = nullptr, const K* zeros = nullptr) {
  const int64_t hs = p.head_size, bs = p.block_size, heads = p.num_kv_heads, slot_stride = heads * hs;
  for (int64_t j = 0; j < n;) {
    const int64_t pos = k0 + j, logical = pos / bs, slot = pos % bs;
    const int64_t run = std::min(n - j, bs - slot);  // the keys of this block
    const K* page = page_of<K>(p, tile, logical);
    const float* scales = nullptr;
    if constexpr (kScaled<K>) scales = scales_of(p, tile, logical) + tile.kv_head;
    for (int64_t i = 0; i < run; ++i) {
      const K* k = page + (slot + i) * slot_stride;
      const K* v = page + (bs + slot + i) * slot_stride;
      float key_scale = 1.f, value_scale = 1.f;
      if constexpr (kScaled<K>) {
        key_scale = scales[(slot + i) * heads] * kLoadUnit<K>;
        value_scale = scales[(bs + slot + i) * heads] * kLoadUnit<K>;
      }
      float* kd = keys + (j + i) * hs;
      float* vd = values + (j + i) * hs;
      if (rows != nullptr) {
        rows[j + i] = k;
        value_rows[j + i] = v;
        continue;
      }
      for (int64_t d = 0; d < hs; d += 16) {
        __m512 kx = load16(k + d);
        if constexpr (kScaled<K>) kx = _mm512_mul_ps(kx, _mm512_set1_ps(key_scale));
        _mm512_storeu_ps(kd + d, kx);
      }
      for (int64_t d = 0; d < hs; d += 16) {
        __m512 vx = load16(v + d);
        if constexpr (kScaled<K>) vx = _mm512_mul_ps(vx, _mm512_set1_ps(value_scale));
        _mm512_storeu_ps(vd + d, vx);
      }
    }
    j += run;
  }
  const int64_t padded = pad_keys(n);
  if (rows != nullptr) {
    for (int64_t j = n; j < padded; ++j) rows[j] = value_rows[j] = zeros;
    return;
  }
  std::fill(keys + n * hs, keys + padded * hs, 0.f);
  std::fill(values + n * hs, values + padded * hs, 0.f);
}

// vt2[jp][d] = (v[2jp][d], v[2jp + 1][d]) as one 32-bit word, for the bfloat16
// value sums (prefill_bf16.h): `pairs` key pairs from bfloat16 rows where they lie.
inline void pair_value_rows(const c10::BFloat16* const* value_rows, int64_t pairs, int64_t hs, uint32_t* vt2) {
  for (int64_t jp = 0; jp < pairs; ++jp) {
    const auto* even = value_rows[2 * jp];
    const auto* odd = value_rows[2 * jp + 1];
    for (int64_t d = 0; d < hs; d += 16) {
      const __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(even + d)));
      const __m512i hi = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(odd + d)));
      _mm512_storeu_si512(vt2 + jp * hs + d, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
    }
  }
}

// The rows a float32 cache's tile reads in place (load_key_tile's `rows`), or for
// any other cache the rows of its float32 tile buffer.
template <typename K>
inline const float* const* float_rows(const K* const* in_place, const float* const* converted) {
  if constexpr (std::is_same_v<K, float>) {
    return in_place;
  } else {
    return converted;
  }
}

// Calls f(std::integral_constant<int, RV>) for RV = count in 1..4.
template <typename F>
inline void with_row_vectors(int64_t count, F&& f) {
  switch (count) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    default: f(std::integral_constant<int, 4>{}); break;
  }
}

// The tile of attend_tile (same contract) for one KV head and 16..kLanes rows,
// head size a multiple of 16. With Aligned its key tiles start at multiples of
// kKeyTile whatever the tile's first key (a sliding window's start): every lane's
// arithmetic (its scores down the head dims, its maxima, rescales, exponentials
// and sums per key tile, masked keys adding exact zeros) then depends on its row
// alone, not on the other lanes or the tile's extent, so a row gives the same
// bits in any tile of 1..kLanes rows (the batch-invariant kernel).
template <typename K, bool Aligned = false>
void attend_tile_prefill(const Problem& p, const Tile& tile, Scratch& scratch) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const TileRows t(p, tile);
  const int64_t hs = p.head_size, rows = t.head_rows, group = t.group;
  const int64_t vectors = (rows + 15) / 16;
  // The thread's buffers, made on its first prefill tile: qt and acct [hs][kLanes],
  // st [kKeyTile][kLanes], the key and value tiles [kKeyTile][hs].
  std::vector<float>& buffer = scratch.prefill;
  // A float32 cache is read where it lies (keys and values by row pointers, a
  // row of hs zero words padding key tiles); other caches are converted into the
  // key and value tiles, and the rows point there. With AVX-512 BF16 and a
  // bfloat16 cache, the queries are also kept as bfloat16 pairs (qt2 [hs / 2][kLanes]
  // words), the zero row pads key tiles, and the weights and values go as pairs
  // of keys (pt2 [kKeyTile / 2][kLanes], vt2 [kKeyTile / 2][hs] words) to the
  // bfloat16 value sums.
  constexpr bool kBf16 = std::is_same_v<K, c10::BFloat16>;
  constexpr bool kInPlace = std::is_same_v<K, float>;
  const bool pairs = kBf16 && has_avx512_bf16();
  buffer.resize(std::max<size_t>(buffer.size(), 2 * hs * kLanes + kKeyTile * kLanes + 2 * kKeyTile * hs +
                                                    hs / 2 * kLanes + hs + kKeyTile / 2 * (kLanes + hs)));
  float* qt = buffer.data();
  float* acct = qt + hs * kLanes;
  float* st = acct + hs * kLanes;
  float* tile_keys = st + kKeyTile * kLanes;
  float* tile_values = tile_keys + kKeyTile * hs;
  auto* qt2 = reinterpret_cast<uint32_t*>(tile_values + kKeyTile * hs);
  uint32_t* zero_words = qt2 + hs / 2 * kLanes;
  auto* zero_row = reinterpret_cast<const K*>(zero_words);
  uint32_t* pt2 = zero_words + hs;
  uint32_t* vt2 = pt2 + kKeyTile / 2 * kLanes;
  std::fill(zero_words, zero_words + hs, 0u);
  if (pairs) std::fill(qt2, zero_words, 0u);
  const K* key_rows[kKeyTile];
  const K* value_rows[kKeyTile];
  const bool by_rows = pairs || kInPlace;  // load_key_tile fills key_rows and value_rows
  // The float32 rows the scores and value sums read: the cache's own, or the tiles'.
  const float* tile_key_rows[kKeyTile];
  const float* tile_value_rows[kKeyTile];
  for (int64_t j = 0; j < kKeyTile; ++j) {
    tile_key_rows[j] = tile_keys + j * hs;
    tile_value_rows[j] = tile_values + j * hs;
  }
  const float* const* float_keys = float_rows<K>(key_rows, tile_key_rows);
  const float* const* float_values = float_rows<K>(value_rows, tile_value_rows);

  // Queries in, transposed and scaled; padded lanes get no position, so see nothing.
  alignas(64) int32_t pos[kLanes];
  alignas(64) float slope[kLanes];
  std::fill(qt, qt + hs * kLanes, 0.f);
  std::fill(acct, acct + hs * kLanes, 0.f);
  {
    // Ask for every query row first: one row at a time, each read waited on
    // memory while the transposing stores held up the next.
    const int64_t element = p.dtype == at::ScalarType::Float ? 4 : 2;
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t offset = (t.q_row0 + t.token_of(r)) * p.q_token_stride + t.head_of(r) * p.q_head_stride;
      prefetch_rows(static_cast<const char*>(p.query) + offset * element, 1, 0, hs * element);
    }
    alignas(64) float row[1024];  // head sizes up to 1024 (checked by the caller)
    for (int64_t r = 0; r < kLanes; ++r) {
      pos[r] = r < rows ? static_cast<int32_t>(t.pos0 + r / group) : -1;
      slope[r] = r < rows && p.alibi != nullptr ? p.alibi[t.head_of(r)] : 0.f;
      if (r >= rows) continue;
      const int64_t offset = (t.q_row0 + t.token_of(r)) * p.q_token_stride + t.head_of(r) * p.q_head_stride;
      switch (p.dtype) {
        case at::ScalarType::Half: to_float(row, static_cast<const c10::Half*>(p.query) + offset, hs, p.scale); break;
        case at::ScalarType::BFloat16:
          to_float(row, static_cast<const c10::BFloat16*>(p.query) + offset, hs, p.scale);
          break;
        default: to_float(row, static_cast<const float*>(p.query) + offset, hs, p.scale); break;
      }
      for (int64_t d = 0; d < hs; ++d) qt[d * kLanes + r] = row[d];
      if constexpr (kBf16) {
        if (pairs) {  // unscaled (exact): the scale multiplies the scores
          const auto* q = reinterpret_cast<const uint16_t*>(static_cast<const c10::BFloat16*>(p.query) + offset);
          for (int64_t d = 0; d < hs; d += 2) qt2[d / 2 * kLanes + r] = q[d] | (uint32_t{q[d + 1]} << 16);
        }
      }
    }
  }
  __m512 row_max[4], row_sum[4];
  for (int v = 0; v < 4; ++v) {
    row_max[v] = _mm512_set1_ps(kNegInf);
    row_sum[v] = _mm512_setzero_ps();
  }
  const int32_t window = static_cast<int32_t>(p.window);
  const __m512 cap = _mm512_set1_ps(p.soft_cap), inv_cap = _mm512_set1_ps(p.soft_cap > 0.f ? 1.f / p.soft_cap : 0.f);
  // Locals, not reads of `p` in the loops: the score stores could alias it, so each would be reloaded.
  const __m512 score_scale = _mm512_set1_ps(p.scale);
  const __m512 max_slack = _mm512_set1_ps(kMaxSlack);
  const bool capped = p.soft_cap > 0.f, has_alibi = p.alibi != nullptr;

  const int64_t first = Aligned ? t.first / kKeyTile * kKeyTile : t.first;  // keys before a lane's window are masked
  for (int64_t k0 = first; k0 <= t.last; k0 += kKeyTile) {
    const int64_t n = std::min<int64_t>(kKeyTile, t.last + 1 - k0);
    // The row vectors some lane of which sees a key of [k0, k0 + n): a contiguous
    // run, positions growing with the lane.
    int64_t v_lo = vectors, v_hi = 0;
    for (int64_t v = 0; v < vectors; ++v) {
      const int64_t low = pos[16 * v], high = pos[std::min<int64_t>(16 * v + 15, rows - 1)];
      const bool seen = high >= k0 && (window <= 0 || low - window + 1 <= k0 + n - 1);
      if (seen) {
        v_lo = std::min(v_lo, v);
        v_hi = v + 1;
      }
    }
    if (v_lo >= v_hi) continue;
    load_key_tile<K>(p, tile, k0, n, tile_keys, tile_values, by_rows ? key_rows : nullptr, value_rows, zero_row);
    if (k0 + kKeyTile <= t.last) prefetch_key_tile<K>(p, tile, k0 + kKeyTile, std::min(kKeyTile, t.last + 1 - k0 - kKeyTile));
    if constexpr (kBf16) {
      if (pairs) pair_value_rows(value_rows, pad_keys(n) / 2, hs, vt2);
    }
    const int64_t lane0 = 16 * v_lo;
    with_row_vectors(v_hi - v_lo, [&](auto count) {
      constexpr int RV = decltype(count)::value;
      constexpr int J = kScoreKeys<RV>;
      for (int64_t j = 0; j < n; j += J) {
        if constexpr (kBf16) {
          if (pairs) {
            avx512bf16::prefill_scores_bf16<RV, J>(qt2 + lane0, hs, key_rows + j, st + j * kLanes + lane0);
            continue;
          }
        }
        prefill_scores<RV, J>(qt + lane0, hs, float_keys + j, st + j * kLanes + lane0);
      }
    });
    for (int64_t v = v_lo; v < v_hi; ++v) {
      const __m512i lane_pos = _mm512_load_si512(pos + 16 * v);
      const __m512i lane_floor = _mm512_sub_epi32(lane_pos, _mm512_set1_epi32(window));  // keys above it are in the window
      const __m512 lane_slope = _mm512_load_ps(slope + 16 * v);
      // Every lane of the vector sees every key of the tile (below the diagonal,
      // inside the window): no masks, and scores that need nothing more are only read.
      const int64_t lane_last = std::min<int64_t>(16 * v + 15, rows - 1);
      const bool all_seen = pos[16 * v] >= k0 + n - 1 && lane_last == 16 * v + 15 &&
                            (window <= 0 || pos[lane_last] - window < k0);
      const bool rewrite = !all_seen || pairs || capped || has_alibi;
      __m512 best = row_max[v];
      for (int64_t j = 0; j < n; ++j) {
        float* sj = st + j * kLanes + 16 * v;
        __m512 x = _mm512_loadu_ps(sj);
        if (!rewrite) {
          best = _mm512_max_ps(best, x);
          continue;
        }
        const __m512i key = _mm512_set1_epi32(static_cast<int32_t>(k0 + j));
        if (pairs) x = _mm512_mul_ps(x, score_scale);
        if (capped) x = _mm512_mul_ps(cap, tanh16(_mm512_mul_ps(x, inv_cap)));
        if (has_alibi) {
          const __m512 distance = _mm512_cvtepi32_ps(_mm512_sub_epi32(key, lane_pos));
          x = _mm512_fmadd_ps(lane_slope, distance, x);
        }
        if (!all_seen) {
          __mmask16 seen = _mm512_cmp_epi32_mask(key, lane_pos, _MM_CMPINT_LE);
          if (window > 0) seen &= _mm512_cmp_epi32_mask(key, lane_floor, _MM_CMPINT_NLE);
          x = _mm512_mask_blend_ps(seen, _mm512_set1_ps(kNegInf), x);
        }
        _mm512_storeu_ps(sj, x);
        best = _mm512_max_ps(best, x);
      }
      // A lane's running maximum moves only when a score passes it by more than
      // kMaxSlack: weights up to e^kMaxSlack are harmless in float32 (and in the
      // bfloat16 weights, which have float32's range), and the accumulator is
      // rescaled a few times per row instead of on most key tiles.
      best = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(best, _mm512_add_ps(row_max[v], max_slack), _CMP_GT_OQ),
                                  row_max[v], best);
      // Lanes that saw nothing yet keep -inf; they subtract 0 instead, so no inf - inf.
      const __mmask16 empty = _mm512_cmp_ps_mask(best, _mm512_set1_ps(kNegInf), _CMP_EQ_OQ);
      const __m512 shift = _mm512_mask_blend_ps(empty, best, _mm512_setzero_ps());
      // e^-87 while a lane was empty, where its sum and accumulator are 0 anyway
      const __m512 factor = exp16_fast(_mm512_sub_ps(row_max[v], shift));
      __m512 sum = _mm512_mul_ps(row_sum[v], factor);
      for (int64_t j = 0; j < n; ++j) {
        float* sj = st + j * kLanes + 16 * v;
        const __m512 x = _mm512_loadu_ps(sj);
        __m512 e = exp16_fast(_mm512_sub_ps(x, shift));
        // a key not seen weighs exactly 0 (exp16_fast of -inf is e^-87)
        if (!all_seen) e = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(kNegInf), _CMP_NEQ_OQ), e);
        _mm512_storeu_ps(sj, e);
        sum = _mm512_add_ps(sum, e);
      }
      for (int64_t j = n; j < pad_keys(n); ++j) _mm512_storeu_ps(st + j * kLanes + 16 * v, _mm512_setzero_ps());
      row_sum[v] = sum;
      row_max[v] = best;
      if (pairs) avx512bf16::probability_pairs(st, pt2, 16 * v, pad_keys(n) / 2);
      if (_mm512_cmp_ps_mask(factor, _mm512_set1_ps(1.f), _CMP_NEQ_UQ) != 0) {
        for (int64_t d = 0; d < hs; ++d) {
          float* a = acct + d * kLanes + 16 * v;
          _mm512_storeu_ps(a, _mm512_mul_ps(_mm512_loadu_ps(a), factor));
        }
      }
    }
    with_row_vectors(v_hi - v_lo, [&](auto count) {
      constexpr int RV = decltype(count)::value;
      constexpr int D = RV >= 3 ? 4 : 8;
      for (int64_t d = 0; d < hs; d += D) {
        if constexpr (kBf16) {
          if (pairs) {
            avx512bf16::prefill_values_bf16<RV, D>(acct + d * kLanes + lane0, pt2 + lane0, vt2 + d, hs,
                                                   pad_keys(n) / 2);
            continue;
          }
        }
        prefill_values<RV, D>(acct + d * kLanes + lane0, st + lane0, float_values, d, pad_keys(n));
      }
    });
  }

  // Out, normalised and transposed back. Every row sees at least its own position.
  alignas(64) float inv[kLanes];
  for (int v = 0; v < 4; ++v) {
    const __m512 sum = row_sum[v];
    const __mmask16 live = _mm512_cmp_ps_mask(sum, _mm512_setzero_ps(), _CMP_GT_OQ);
    _mm512_store_ps(inv + 16 * v, _mm512_maskz_div_ps(live, _mm512_set1_ps(1.f), sum));
  }
  const __m512i kDownOneLane = _mm512_mullo_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), _mm512_set1_epi32(kLanes));
  alignas(64) float row[1024];
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 scale = _mm512_set1_ps(inv[r]);
    for (int64_t d = 0; d < hs; d += 16) {  // 16 head dims of row r, kLanes apart in acct
      _mm512_store_ps(row + d, _mm512_mul_ps(_mm512_i32gather_ps(kDownOneLane, acct + d * kLanes + r, 4), scale));
    }
    const int64_t offset = (t.q_row0 + t.token_of(r)) * p.o_token_stride + t.head_of(r) * p.o_head_stride;
    switch (p.dtype) {
      case at::ScalarType::Half: {
        auto* dst = static_cast<c10::Half*>(p.out) + offset;
        for (int64_t d = 0; d < hs; ++d) dst[d] = static_cast<c10::Half>(row[d]);
        break;
      }
      case at::ScalarType::BFloat16: {
        auto* dst = static_cast<c10::BFloat16*>(p.out) + offset;
        for (int64_t d = 0; d < hs; ++d) dst[d] = static_cast<c10::BFloat16>(row[d]);
        break;
      }
      default: std::memcpy(static_cast<float*>(p.out) + offset, row, hs * sizeof(float)); break;
    }
  }
}

// Whether a tile takes attend_tile_prefill: one KV head, at least kPrefillRows
// rows (fewer leave most lanes idle; the decode tile serves them), at most kLanes,
// and a head size of 16 to 1024 in steps of 16.
constexpr int64_t kPrefillRows = 16;
inline bool prefill_tile_fits(const Problem& p, const Tile& tile) {
  const int64_t rows = TileRows(p, tile).head_rows;
  return tile.kv_heads == 1 && rows >= kPrefillRows && rows <= kLanes && p.head_size % 16 == 0 &&
         p.head_size >= 16 && p.head_size <= 1024;
}
