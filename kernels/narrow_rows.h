// The batch-invariant prefill tile (attend_tile_prefill<K, true>) for tiles of
// few rows per KV head: decodes, and the last few tokens of a prompt chunk.
// The prefill tile puts rows in lanes, so a decode of G query heads per KV head
// fills G of its 16 lanes and runs its softmax one key at a time; here keys
// (scores, softmax) and head dims (value sums) fill the lanes instead, and
// every element a row's output depends on is computed by the very operations,
// in the very order, that row's lane of the prefill tile computes it with:
//
//   score   s[j]   = fma(q[d], k[j][d], s) for d = 0, 1, ...  (16 keys in lanes, the
//                    key tile transposed 16 x 16 in registers; bfloat16 pairs one
//                    vdpbf16ps per two head dims, narrow_bf16.h)
//   softmax        per key elementwise (scale, soft-cap, ALiBi, masks, exp16_fast)
//                  on 16 keys at once; a key tile's maximum (order-free) and the
//                  rescale from the row's running maximum as the lanes have them;
//                  the row's sum adds the exponentials one key at a time, in key order
//   values  acc[d] = fma(w[j], v[j][d], acc) for j = 0, 1, ...  (16 head dims in lanes;
//                    bfloat16 one vdpbf16ps per key pair)
//
// so a row gives the same bits here as in any prefill tile (kernels/prefill_tile.h,
// key tiles of kKeyTile keys at fixed positions), and a decode costs about what
// the fast decode tile costs. All KV heads of the tile go together per key tile,
// each block read as one run.
//
// Included by paged_attention.cpp inside namespace avx512, after prefill_tile.h
// and transpose16.h.

constexpr int64_t kNarrowRows = 8;  // tiles of at most this many rows per KV head take this tile

// s[g * R + r] lane j = q_r . key 16g + j for G groups of 16 keys (float32 rows
// at keys[16g + j]) and R rows of scaled queries (q, hs apart): fma down the
// head dims in order. The groups go together, G * R chains of sums. Rows
// ahead[16g + j] are asked for beside them (transpose16).
template <int G, int R>
inline void narrow_scores(const float* __restrict__ q, int64_t hs, const float* const* keys, const char* const* ahead,
                          __m512* s) {
  __m512 a[G][R];
  for (int g = 0; g < G; ++g) {
    for (int r = 0; r < R; ++r) a[g][r] = _mm512_setzero_ps();
  }
  runs_at_least_once(hs / 16);
  for (int64_t w0 = 0; w0 < hs; w0 += 16) {
    for (int g = 0; g < G; ++g) {
      __m512 kt[16];
      transpose16(keys + 16 * g, w0, 0xFFFF, ahead + 16 * g, kt);
      for (int c = 0; c < 16; ++c) {
        for (int r = 0; r < R; ++r) a[g][r] = _mm512_fmadd_ps(_mm512_set1_ps(q[r * hs + w0 + c]), kt[c], a[g][r]);
      }
    }
  }
  for (int g = 0; g < G; ++g) {
    for (int r = 0; r < R; ++r) s[g * R + r] = a[g][r];
  }
}

// acc[r][d0 ..] += w[r * kKeyTile + j] * values[j][d0 ..] for j < n in order, RB
// rows, NC slices of 16 head dims; the same places of rows ahead[j] asked for beside.
template <int RB, int NC>
inline void narrow_values_block(float* __restrict__ acc, int64_t hs, const float* __restrict__ w,
                                const float* const* values, const char* const* ahead, int64_t n, int64_t d0) {
  __m512 a[RB][NC];
  for (int r = 0; r < RB; ++r) {
    for (int c = 0; c < NC; ++c) a[r][c] = _mm512_loadu_ps(acc + r * hs + d0 + 16 * c);
  }
  runs_at_least_once(n);
  for (int64_t j = 0; j < n; ++j) {
    __m512 v[NC];
    for (int c = 0; c < NC; ++c) {
      v[c] = _mm512_loadu_ps(values[j] + d0 + 16 * c);
      _mm_prefetch(ahead[j] + 4 * (d0 + 16 * c), _MM_HINT_T1);
    }
    for (int r = 0; r < RB; ++r) {
      const __m512 x = _mm512_set1_ps(w[r * kKeyTile + j]);
      for (int c = 0; c < NC; ++c) a[r][c] = _mm512_fmadd_ps(x, v[c], a[r][c]);
    }
  }
  for (int r = 0; r < RB; ++r) {
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(acc + r * hs + d0 + 16 * c, a[r][c]);
  }
}

template <int RB>
inline void narrow_values_rows(float* acc, int64_t hs, const float* w, const float* const* values,
                               const char* const* ahead, int64_t n) {
  int64_t d = 0;
  for (; d + 64 <= hs; d += 64) narrow_values_block<RB, 4>(acc, hs, w, values, ahead, n, d);
  switch ((hs - d) / 16) {
    case 3: narrow_values_block<RB, 3>(acc, hs, w, values, ahead, n, d); break;
    case 2: narrow_values_block<RB, 2>(acc, hs, w, values, ahead, n, d); break;
    case 1: narrow_values_block<RB, 1>(acc, hs, w, values, ahead, n, d); break;
    default: break;
  }
}

template <int R>
inline void narrow_values(float* acc, int64_t hs, const float* w, const float* const* values,
                          const char* const* ahead, int64_t n) {
  if constexpr (R > 4) {  // four rows at a time keep the accumulators in registers
    narrow_values_rows<4>(acc, hs, w, values, ahead, n);
    narrow_values_rows<R - 4>(acc + 4 * hs, hs, w + 4 * kKeyTile, values, ahead, n);
  } else {
    narrow_values_rows<R>(acc, hs, w, values, ahead, n);
  }
}

// Keys and values [k0, k0 + n) of KV head `head` (of the tile's) where they lie,
// by row pointers; from n to kKeyTile, `zeros`.
template <typename K>
inline void narrow_rows_of(const Problem& p, const Tile& tile, int64_t head, int64_t k0, int64_t n, const K** keys,
                           const K** values, const K* zeros) {
  const int64_t hs = p.head_size, bs = p.block_size, slot_stride = p.num_kv_heads * hs;
  for (int64_t j = 0; j < n;) {
    const int64_t pos = k0 + j, slot = pos % bs, run = std::min(n - j, bs - slot);
    const K* page = page_of<K>(p, tile, pos / bs) + head * hs;
    for (int64_t i = 0; i < run; ++i) {
      keys[j + i] = page + (slot + i) * slot_stride;
      values[j + i] = page + (bs + slot + i) * slot_stride;
    }
    j += run;
  }
  for (int64_t j = n; j < kKeyTile; ++j) keys[j] = values[j] = zeros;
}

// Asks for keys and values [k0, k0 + n) of `heads` of the tile's KV heads from
// `head` on (into L2): blocks lie at random places, which the hardware
// prefetchers do not follow.
template <typename K>
inline void narrow_prefetch(const Problem& p, const Tile& tile, int64_t head, int64_t heads, int64_t k0, int64_t n) {
  const int64_t bs = p.block_size, slot_stride = p.num_kv_heads * p.head_size;
  const int64_t bytes = heads * p.head_size * static_cast<int64_t>(sizeof(K));
  for (int64_t j = 0; j < n;) {
    const int64_t pos = k0 + j, slot = pos % bs, run = std::min(n - j, bs - slot);
    const K* page = page_of<K>(p, tile, pos / bs) + head * p.head_size;
    prefetch_rows(page + slot * slot_stride, run, slot_stride, bytes);
    prefetch_rows(page + (bs + slot) * slot_stride, run, slot_stride, bytes);
    j += run;
  }
}

// The tile (attend_tile's contract) for R rows per KV head, any number of KV
// heads; the first keys of `after` (the tile this thread takes next) are asked
// for while its last key tile is computed.
template <typename K, int R>
void attend_tile_narrow_rows(const Problem& p, const Tile& tile, Scratch& scratch, const Tile* after) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  constexpr bool kBf16 = std::is_same_v<K, c10::BFloat16>;
  constexpr bool kInPlace = std::is_same_v<K, float>;
  const bool pairs = kBf16 && has_avx512_bf16();  // as attend_tile_prefill decides it
  const bool in_place = kInPlace || pairs;
  const TileRows t(p, tile);
  const int64_t hs = p.head_size, heads = tile.kv_heads, rows = R * heads, group = t.group;
  const int32_t window = static_cast<int32_t>(p.window);
  const bool capped = p.soft_cap > 0.f, has_alibi = p.alibi != nullptr;

  // The thread's buffers: queries (scaled float32, and bfloat16 pairs), the
  // accumulators, each row's running maximum and sum, one KV head's scores and
  // weights for a key tile, a zero row, and float32 key and value tiles for the
  // caches that are converted (as the prefill tile converts them).
  const int64_t zero_floats = std::max<int64_t>(hs, 32);
  const int64_t converted = in_place ? 0 : 2 * kKeyTile * hs;
  std::vector<float>& buffer = scratch.invariant;
  buffer.resize(std::max<size_t>(buffer.size(), rows * hs * 5 / 2 + 2 * rows + R * kKeyTile * 2 +
                                                    zero_floats + converted + 16));
  float* q = buffer.data();
  auto* qw = reinterpret_cast<uint32_t*>(q + rows * hs);
  float* acc = q + rows * hs * 3 / 2;
  float* row_max = acc + rows * hs;
  float* row_sum = row_max + rows;
  float* xs = row_sum + rows;
  float* w = xs + R * kKeyTile;
  float* zeros = w + R * kKeyTile;
  float* tile_keys = zeros + zero_floats;
  float* tile_values = tile_keys + kKeyTile * hs;
  std::fill(acc, acc + rows * hs, 0.f);
  std::fill(zeros, zeros + zero_floats, 0.f);
  for (int64_t r = 0; r < rows; ++r) {
    row_max[r] = kNegInf;
    row_sum[r] = 0.f;
    const int64_t offset = (t.q_row0 + t.token_of(r)) * p.q_token_stride + t.head_of(r) * p.q_head_stride;
    switch (p.dtype) {
      case at::ScalarType::Half: to_float(q + r * hs, static_cast<const c10::Half*>(p.query) + offset, hs, p.scale); break;
      case at::ScalarType::BFloat16:
        to_float(q + r * hs, static_cast<const c10::BFloat16*>(p.query) + offset, hs, p.scale);
        break;
      default: to_float(q + r * hs, static_cast<const float*>(p.query) + offset, hs, p.scale); break;
    }
    if constexpr (kBf16) {
      if (pairs) {  // unscaled (exact): the scale multiplies the scores
        const auto* src = reinterpret_cast<const uint16_t*>(static_cast<const c10::BFloat16*>(p.query) + offset);
        for (int64_t d = 0; d < hs; d += 2) qw[r * hs / 2 + d / 2] = src[d] | (uint32_t{src[d + 1]} << 16);
      }
    }
  }
  const K* key_rows[kKeyTile];
  const K* value_rows[kKeyTile];
  const K* ahead_keys[kKeyTile];
  const K* ahead_values[kKeyTile];
  const char* key_fetch[kKeyTile];
  const char* value_fetch[kKeyTile];
  std::fill(key_fetch, key_fetch + kKeyTile, reinterpret_cast<const char*>(zeros));
  std::fill(value_fetch, value_fetch + kKeyTile, reinterpret_cast<const char*>(zeros));
  const float* float_keys[kKeyTile];
  const float* float_values[kKeyTile];
  const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 cap = _mm512_set1_ps(p.soft_cap), inv_cap = _mm512_set1_ps(capped ? 1.f / p.soft_cap : 0.f);
  const __m512 score_scale = _mm512_set1_ps(p.scale);

  const int64_t first = t.first / kKeyTile * kKeyTile;  // the prefill tile's key tiles (Aligned)
  for (int64_t k0 = first; k0 <= t.last; k0 += kKeyTile) {
    const int64_t n = std::min<int64_t>(kKeyTile, t.last + 1 - k0);
    // A key tile no row sees is skipped, as the prefill tile skips it (a no-op for the row's sums).
    if (window > 0 && t.pos0 - window + 1 > k0 + n - 1) continue;
    const int64_t groups = (n + 15) / 16;
    // The keys asked for while this key tile is computed: the next key tile, or
    // after the last the first of `after`.
    const bool last_tile = k0 + kKeyTile > t.last;
    const Tile* next = last_tile ? after : &tile;
    int64_t next0 = k0 + kKeyTile, next_n = 0;
    if (next != nullptr) {
      const TileRows nt(p, *next);
      if (last_tile) next0 = nt.first / kKeyTile * kKeyTile;
      next_n = std::min(kKeyTile, nt.last + 1 - next0);
    }
    for (int64_t h = 0; h < heads; ++h) {
      const bool fetch = next_n > 0 && h < next->kv_heads;
      if constexpr (kInPlace || kBf16) {
        if (in_place) {  // asked for row by row beside the loads of this key tile's rows
          narrow_rows_of<K>(p, fetch ? *next : tile, h, next0, fetch ? next_n : 0, ahead_keys, ahead_values,
                            reinterpret_cast<const K*>(zeros));
          for (int64_t j = 0; j < kKeyTile; ++j) {
            key_fetch[j] = reinterpret_cast<const char*>(ahead_keys[j]);
            value_fetch[j] = reinterpret_cast<const char*>(ahead_values[j]);
          }
        }
      }
      if (!in_place && fetch) narrow_prefetch<K>(p, *next, h, 1, next0, next_n);
      if constexpr (kInPlace || kBf16) {
        if (in_place) narrow_rows_of<K>(p, tile, h, k0, n, key_rows, value_rows, reinterpret_cast<const K*>(zeros));
      }
      if (!in_place) {  // converted into float32 tiles, rows n .. pad_keys(n) zeroed
        const Tile one{tile.seq, tile.kv_head + h, 1, tile.q_begin, tile.q_end, tile.cost};
        load_key_tile<K>(p, one, k0, n, tile_keys, tile_values);
        for (int64_t j = 0; j < kKeyTile; ++j) {
          float_keys[j] = j < n ? tile_keys + j * hs : zeros;
          float_values[j] = j < n ? tile_values + j * hs : zeros;
        }
      } else if constexpr (kInPlace) {
        for (int64_t j = 0; j < kKeyTile; ++j) {
          float_keys[j] = key_rows[j];
          float_values[j] = value_rows[j];
        }
      }
      const float* qh = q + h * R * hs;
      float* ah = acc + h * R * hs;
      // Scores of all R rows, the key tile's three groups of 16 keys (padded with
      // zero rows, whose scores are masked), into xs[r][j].
      {
        constexpr int G = kNarrowGroups<R>;
        for (int64_t g0 = 0; g0 < groups; g0 += G) {
          __m512 s[G * R];
          if constexpr (kBf16) {
            if (pairs) {
              avx512bf16::narrow_scores_bf16<G, R>(qw + h * R * hs / 2, hs / 2, key_rows + 16 * g0, key_fetch + 16 * g0, s);
            } else {
              narrow_scores<G, R>(qh, hs, float_keys + 16 * g0, key_fetch + 16 * g0, s);
            }
          } else {
            narrow_scores<G, R>(qh, hs, float_keys + 16 * g0, key_fetch + 16 * g0, s);
          }
          for (int g = 0; g < G; ++g) {
            for (int r = 0; r < R; ++r) _mm512_storeu_ps(xs + r * kKeyTile + 16 * (g0 + g), s[g * R + r]);
          }
        }
      }
      // Each row's online softmax over the key tile, 16 keys at a time.
      for (int r = 0; r < R; ++r) {
        const int64_t row = h * R + r;
        const int32_t pos = static_cast<int32_t>(t.pos0 + r / group);
        const __m512i lane_pos = _mm512_set1_epi32(pos);
        const __m512i lane_floor = _mm512_set1_epi32(pos - window);
        const __m512 lane_slope = _mm512_set1_ps(has_alibi ? p.alibi[t.head_of(row)] : 0.f);
        __m512 x[3];
        __m512 top = _mm512_set1_ps(row_max[row]);
        for (int64_t g = 0; g < groups; ++g) {
          __m512 v = _mm512_loadu_ps(xs + r * kKeyTile + 16 * g);
          const __m512i key = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(k0 + 16 * g)), iota);
          if (pairs) v = _mm512_mul_ps(v, score_scale);
          if (capped) v = _mm512_mul_ps(cap, tanh16(_mm512_mul_ps(v, inv_cap)));
          if (has_alibi) v = _mm512_fmadd_ps(lane_slope, _mm512_cvtepi32_ps(_mm512_sub_epi32(key, lane_pos)), v);
          __mmask16 seen = _mm512_cmp_epi32_mask(key, lane_pos, _MM_CMPINT_LE);
          if (window > 0) seen &= _mm512_cmp_epi32_mask(key, lane_floor, _MM_CMPINT_NLE);
          if (16 * g + 16 > n) seen &= static_cast<__mmask16>((1u << (n - 16 * g)) - 1);  // keys past the tile's last
          x[g] = _mm512_mask_blend_ps(seen, _mm512_set1_ps(kNegInf), v);
          top = _mm512_max_ps(top, x[g]);
        }
        const float old_max = row_max[row], seen_max = _mm512_reduce_max_ps(top);
        const float best = seen_max > old_max + kMaxSlack ? seen_max : old_max;
        const float shift = best == kNegInf ? 0.f : best;  // no inf - inf while the row saw nothing
        const float factor = _mm512_cvtss_f32(exp16_fast(_mm512_set1_ps(old_max - shift)));
        alignas(64) float e[kKeyTile];
        for (int64_t g = 0; g < groups; ++g) {
          const __m512 ex = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x[g], _mm512_set1_ps(kNegInf), _CMP_NEQ_OQ),
                                                exp16_fast(_mm512_sub_ps(x[g], _mm512_set1_ps(shift))));
          _mm512_store_ps(e + 16 * g, ex);
          _mm512_storeu_ps(w + r * kKeyTile + 16 * g, ex);
        }
        for (int64_t g = groups; g < 3; ++g) _mm512_storeu_ps(w + r * kKeyTile + 16 * g, _mm512_setzero_ps());  // pad keys
        float sum = row_sum[row] * factor;
        asm("" : "+x"(sum));  // a product of its own, never fused into the first sum (as the lanes keep it)
        for (int64_t j = 0; j < n; ++j) sum += e[j];  // key order, as a lane sums them
        row_sum[row] = sum;
        row_max[row] = best;
        if (factor != 1.f) {
          const __m512 f = _mm512_set1_ps(factor);
          for (int64_t d = 0; d < hs; d += 16) _mm512_storeu_ps(ah + r * hs + d, _mm512_mul_ps(_mm512_loadu_ps(ah + r * hs + d), f));
        }
      }
      if constexpr (kBf16) {
        if (pairs) {
          avx512bf16::narrow_values_bf16<R>(ah, hs, w, kKeyTile, value_rows, value_fetch, pad_keys(n) / 2);
          continue;
        }
      }
      // Keys past n weigh exact zeros: adding them (as the lanes do) leaves a sum unchanged.
      narrow_values<R>(ah, hs, w, float_values, value_fetch, n);
    }
  }

  // Out, normalised (bfloat16 pairs' head dims put back in order).
  const __m512i lower = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i upper = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  alignas(64) float out_row[1024];
  for (int64_t r = 0; r < rows; ++r) {
    const float sum = row_sum[r];
    const __m512 scale = _mm512_set1_ps(sum > 0.f ? 1.f / sum : 0.f);
    const float* a = acc + r * hs;
    int64_t d = 0;
    if (pairs) {
      for (; d + 32 <= hs; d += 32) {
        const __m512 lo = _mm512_loadu_ps(a + d), hi = _mm512_loadu_ps(a + d + 16);
        _mm512_store_ps(out_row + d, _mm512_mul_ps(_mm512_permutex2var_ps(lo, lower, hi), scale));
        _mm512_store_ps(out_row + d + 16, _mm512_mul_ps(_mm512_permutex2var_ps(lo, upper, hi), scale));
      }
    }
    for (; d < hs; d += 16) _mm512_store_ps(out_row + d, _mm512_mul_ps(_mm512_loadu_ps(a + d), scale));
    const int64_t offset = (t.q_row0 + t.token_of(r)) * p.o_token_stride + t.head_of(r) * p.o_head_stride;
    switch (p.dtype) {
      case at::ScalarType::Half: {
        auto* dst = static_cast<c10::Half*>(p.out) + offset;
        for (int64_t i = 0; i < hs; ++i) dst[i] = static_cast<c10::Half>(out_row[i]);
        break;
      }
      case at::ScalarType::BFloat16: {
        auto* dst = static_cast<c10::BFloat16*>(p.out) + offset;
        for (int64_t i = 0; i < hs; ++i) dst[i] = static_cast<c10::BFloat16>(out_row[i]);
        break;
      }
      default: std::memcpy(static_cast<float*>(p.out) + offset, out_row, hs * sizeof(float)); break;
    }
  }
}

// attend_tile_narrow_rows for the tile's rows per KV head (1 .. kNarrowRows).
template <typename K>
void attend_tile_narrow(const Problem& p, const Tile& tile, Scratch& scratch, const Tile* after) {
  switch (TileRows(p, tile).head_rows) {
    case 1: attend_tile_narrow_rows<K, 1>(p, tile, scratch, after); break;
    case 2: attend_tile_narrow_rows<K, 2>(p, tile, scratch, after); break;
    case 3: attend_tile_narrow_rows<K, 3>(p, tile, scratch, after); break;
    case 4: attend_tile_narrow_rows<K, 4>(p, tile, scratch, after); break;
    case 5: attend_tile_narrow_rows<K, 5>(p, tile, scratch, after); break;
    case 6: attend_tile_narrow_rows<K, 6>(p, tile, scratch, after); break;
    case 7: attend_tile_narrow_rows<K, 7>(p, tile, scratch, after); break;
    default: attend_tile_narrow_rows<K, 8>(p, tile, scratch, after); break;
  }
}
