// AVX2 prefill tile: prefill_tile.h's "rows in lanes" scheme on 8-float
// vectors. Many query rows of one KV head (a prompt or a chunk of one) against
// its keys, the tile's queries held transposed, qt[d][r] (row r in lane r % 8
// of vector r / 8), so that
//
//   scores  s[j][r]  = sum_d qt[d][r] * k[j][d]   (8 rows per FMA, k[j][d] one broadcast)
//   softmax          per lane: max, exp and sum run down the keys, vertically
//   values  acc[d][r] += p[j][r] * v[j][d]        (again a broadcast per (j, d))
//
// with no horizontal sum or per-row scalar loop in the hot path. Register
// blocks of up to three row vectors (24 rows) by four keys or head dims keep 12
// sums live beside their operands in AVX2's 16 registers: an FMA's result is
// ready about 5 cycles after it issues and two issue a cycle, so blocks of 8
// sums (4 x 2, 2 x 4) would leave the FMA units idle a fifth of the time.
// Keys come in tiles of kKeyTile, read through the block table across block
// boundaries and copied as float32 into two small tile buffers
// (a quantized cache times its scales).
// A key tile no lane of a row vector sees is skipped for that row vector, so
// the causal upper triangle and everything left of a sliding window cost
// nothing; soft-cap and ALiBi are applied per lane.
//
// The generic tile (attention_tile.h) takes one row at a time through the
// softmax and rescales its sums whenever a row's maximum grows; this one moves
// a lane's maximum only when a score passes it by kMaxSlack.
//
// Included by paged_attention.cpp inside namespace avx2, after vector_kernels.h
// and attention_tile.h.

constexpr int64_t kLanes = 64;     // lanes of every transposed row: the tile's rows, padded
constexpr int64_t kKeyTile = 32;   // keys per softmax step (a multiple of kKeyPad)
constexpr int64_t kKeyPad = 4;     // key counts are padded to a multiple of every score block's keys
constexpr float kMaxSlack = 8.f;   // how far a score may pass its lane's running maximum before the rescale

// Keys (or head dims) per register block: RV row vectors x kBlockWidth sums.
constexpr int kBlockWidth = 4;

inline int64_t pad_keys(int64_t n) { return (n + kKeyPad - 1) / kKeyPad * kKeyPad; }

// *p in every lane by one load (splat's `vf8{} + x` costs an add and a shuffle on top).
inline vf8 broadcast8(const float* p) { return (vf8)_mm256_broadcast_ss(p); }

// st[j][lanes] = qt . key_j for J keys (float32 rows at keys[j]) and RV row vectors.
template <int RV, int J>
inline void lane_scores(const float* __restrict__ qt, int64_t hs, const float* const* keys, float* __restrict__ st) {
  const float* kf[J];
  for (int j = 0; j < J; ++j) kf[j] = keys[j];
  vf8 s[J][RV];
  for (int j = 0; j < J; ++j) {
    for (int v = 0; v < RV; ++v) s[j][v] = vf8{};
  }
  runs_at_least_once(hs);  // prefill_tile_fits
  for (int64_t d = 0; d < hs; ++d) {
    vf8 q[RV];
    for (int v = 0; v < RV; ++v) q[v] = load8(qt + d * kLanes + 8 * v);
    for (int j = 0; j < J; ++j) {
      const vf8 k = broadcast8(kf[j] + d);
      for (int v = 0; v < RV; ++v) s[j][v] += q[v] * k;
    }
  }
  for (int j = 0; j < J; ++j) {
    for (int v = 0; v < RV; ++v) store8(st + j * kLanes + 8 * v, s[j][v]);
  }
}

// acct[d][lanes] += sum_j pt[j][lanes] * values[j][d0 + d] for D head dims from d0.
template <int RV, int D>
inline void lane_values(float* __restrict__ acct, const float* __restrict__ pt, const float* const* values,
                        int64_t d0, int64_t n) {
  vf8 a[D][RV];
  for (int d = 0; d < D; ++d) {
    for (int v = 0; v < RV; ++v) a[d][v] = load8(acct + d * kLanes + 8 * v);
  }
  runs_at_least_once(n);  // a key tile holds at least one key
  for (int64_t j = 0; j < n; ++j) {
    vf8 w[RV];
    for (int v = 0; v < RV; ++v) w[v] = load8(pt + j * kLanes + 8 * v);
    const float* vf = values[j] + d0;
    for (int d = 0; d < D; ++d) {
      const vf8 x = broadcast8(vf + d);
      for (int v = 0; v < RV; ++v) a[d][v] += w[v] * x;
    }
  }
  for (int d = 0; d < D; ++d) {
    for (int v = 0; v < RV; ++v) store8(acct + d * kLanes + 8 * v, a[d][v]);
  }
}

// Calls f(std::integral_constant<int, RV>, first_vector) over row vectors
// [v_lo, v_hi) in groups of up to three.
template <typename F>
inline void for_row_vectors(int64_t v_lo, int64_t v_hi, F&& f) {
  for (int64_t v = v_lo; v < v_hi; v += 3) {
    switch (std::min<int64_t>(3, v_hi - v)) {
      case 1: f(std::integral_constant<int, 1>{}, v); break;
      case 2: f(std::integral_constant<int, 2>{}, v); break;
      default: f(std::integral_constant<int, 3>{}, v); break;
    }
  }
}

// Keys and values [k0, k0 + n) of the tile's KV head as float32 rows copied
// into `keys` and `values`, hs apart (times the scales of a quantized cache);
// rows n .. pad_keys(n) point at `zeros`. A float32 cache is copied too: read
// where they lie, a key tile's rows sit a slot (all KV heads) apart, and with
// 4 KV heads of 64 its keys and values fill every way of the few L1 sets those
// strides reach.
template <typename K>
inline void lane_key_rows(const Problem& p, const Tile& tile, int64_t k0, int64_t n, float* keys, float* values,
                          const float** key_rows, const float** value_rows, const float* zeros) {
  const int64_t hs = p.head_size, bs = p.block_size, heads = p.num_kv_heads, slot_stride = heads * hs;
  for (int64_t j = 0; j < n;) {
    const int64_t pos = k0 + j, logical = pos / bs, slot = pos % bs;
    const int64_t run = std::min(n - j, bs - slot);  // the keys of this block
    const K* page = page_of<K>(p, tile, logical);
    for (int64_t i = 0; i < run; ++i) {
      const K* k = page + (slot + i) * slot_stride;
      const K* v = page + (bs + slot + i) * slot_stride;
      float key_scale = 1.f, value_scale = 1.f;
      if constexpr (kScaled<K>) {
        const float* scales = scales_of(p, tile, logical) + tile.kv_head;
        key_scale = scales[(slot + i) * heads];
        value_scale = scales[(bs + slot + i) * heads];
      }
      float* kd = keys + (j + i) * hs;
      float* vd = values + (j + i) * hs;
      to_float(kd, k, hs, key_scale);
      to_float(vd, v, hs, value_scale);
      key_rows[j + i] = kd;
      value_rows[j + i] = vd;
    }
    j += run;
  }
  for (int64_t j = n; j < pad_keys(n); ++j) key_rows[j] = value_rows[j] = zeros;
}

// tanh lane by lane as 1 - 2 / (e^2x + 1): exact at both ends, where exp8 clamps.
inline vf8 tanh8(vf8 x) { return splat(1.f) - splat(2.f) / (exp8(x + x) + 1.f); }

// The tile of attend_tile (same contract) for one KV head and kPrefillRows..kLanes
// rows, a head size that is a multiple of 8.
template <typename K>
void attend_tile_prefill(const Problem& p, const Tile& tile, Scratch& s) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const TileRows t(p, tile);
  const int64_t hs = p.head_size, rows = t.head_rows, group = t.group;
  const int64_t vectors = (rows + 7) / 8;
  // The thread's buffers: qt and acct [hs][kLanes], st [kKeyTile][kLanes], the
  // key and value tiles [kKeyTile][hs], a zero row.
  std::vector<float>& buffer = s.prefill;
  buffer.resize(std::max<size_t>(buffer.size(), 2 * hs * kLanes + kKeyTile * kLanes + 2 * kKeyTile * hs + hs + 16));
  // From a 64-byte boundary: a vector load that straddles two cache lines costs two.
  float* qt = buffer.data() + (-(reinterpret_cast<uintptr_t>(buffer.data()) / sizeof(float)) & 15);
  float* acct = qt + hs * kLanes;
  float* st = acct + hs * kLanes;
  float* tile_keys = st + kKeyTile * kLanes;
  float* tile_values = tile_keys + kKeyTile * hs;
  float* zeros = tile_values + kKeyTile * hs;
  std::fill(zeros, zeros + hs, 0.f);
  const float* key_rows[kKeyTile];
  const float* value_rows[kKeyTile];

  // Queries in, scaled (s.q, row by row), then transposed; padded lanes get no
  // position, so they see nothing.
  begin_rows(p, t, s);
  alignas(32) int32_t pos[kLanes];
  alignas(32) float slope[kLanes];
  std::fill(qt, qt + hs * kLanes, 0.f);
  std::fill(acct, acct + hs * kLanes, 0.f);
  for (int64_t r = 0; r < kLanes; ++r) {
    pos[r] = r < rows ? static_cast<int32_t>(t.pos0 + r / group) : -1;
    slope[r] = r < rows && p.alibi != nullptr ? p.alibi[t.head_of(r)] : 0.f;
    if (r >= rows) continue;
    const float* q = s.q.data() + r * hs;
    for (int64_t d = 0; d < hs; ++d) qt[d * kLanes + r] = q[d];
  }
  vf8 row_max[kLanes / 8], row_sum[kLanes / 8];
  for (int64_t v = 0; v < kLanes / 8; ++v) {
    row_max[v] = splat(kNegInf);
    row_sum[v] = vf8{};
  }
  const int32_t window = static_cast<int32_t>(p.window);
  const float soft_cap = p.soft_cap;
  const bool capped = soft_cap > 0.f, has_alibi = p.alibi != nullptr;

  for (int64_t k0 = t.first; k0 <= t.last; k0 += kKeyTile) {
    const int64_t n = std::min<int64_t>(kKeyTile, t.last + 1 - k0);
    // The row vectors some lane of which sees a key of [k0, k0 + n): a
    // contiguous run, positions growing with the lane.
    int64_t v_lo = vectors, v_hi = 0;
    for (int64_t v = 0; v < vectors; ++v) {
      const int64_t low = pos[8 * v], high = pos[std::min<int64_t>(8 * v + 7, rows - 1)];
      if (high >= k0 && (window <= 0 || low - window + 1 <= k0 + n - 1)) {
        v_lo = std::min(v_lo, v);
        v_hi = v + 1;
      }
    }
    if (v_lo >= v_hi) continue;
    lane_key_rows<K>(p, tile, k0, n, tile_keys, tile_values, key_rows, value_rows, zeros);
    for_row_vectors(v_lo, v_hi, [&](auto count, int64_t v0) {
      constexpr int RV = decltype(count)::value;
      constexpr int J = kBlockWidth;
      for (int64_t j = 0; j < n; j += J) {
        lane_scores<RV, J>(qt + 8 * v0, hs, key_rows + j, st + j * kLanes + 8 * v0);
      }
    });
    for (int64_t v = v_lo; v < v_hi; ++v) {
      const vi8 lane_pos = *reinterpret_cast<const vi8*>(pos + 8 * v);
      const vi8 lane_floor = lane_pos - window;  // keys above it are in the window
      const vf8 lane_slope = load8(slope + 8 * v);
      // Every lane sees every key of the tile (below the diagonal, inside the
      // window): no masks, and scores that need nothing more are only read.
      const int64_t lane_last = std::min<int64_t>(8 * v + 7, rows - 1);
      const bool all_seen = pos[8 * v] >= k0 + n - 1 && lane_last == 8 * v + 7 &&
                            (window <= 0 || pos[lane_last] - window < k0);
      const bool rewrite = !all_seen || capped || has_alibi;
      vf8 best = row_max[v];
      for (int64_t j = 0; j < n; ++j) {
        float* sj = st + j * kLanes + 8 * v;
        vf8 x = load8(sj);
        if (rewrite) {
          const vi8 key = vi8{} + static_cast<int32_t>(k0 + j);
          if (capped) x = soft_cap * tanh8(x / soft_cap);
          if (has_alibi) x += lane_slope * __builtin_convertvector(key - lane_pos, vf8);
          if (!all_seen) {
            const vi8 seen = window > 0 ? (key <= lane_pos) & (key > lane_floor) : key <= lane_pos;
            x = seen ? x : splat(kNegInf);
          }
          store8(sj, x);
        }
        best = best > x ? best : x;
      }
      // A lane's running maximum moves only when a score passes it by more than
      // kMaxSlack: weights up to e^kMaxSlack are harmless in float32, and the
      // sums are rescaled a few times per row instead of on most key tiles.
      best = best > row_max[v] + kMaxSlack ? best : row_max[v];
      // Lanes that saw nothing yet keep -inf; they subtract 0 instead, so no inf - inf.
      const vf8 shift = best == splat(kNegInf) ? vf8{} : best;
      const vf8 factor = exp8(row_max[v] - shift);  // 0 while a lane was empty, whose sums are 0 anyway
      vf8 sum = row_sum[v] * factor;
      for (int64_t j = 0; j < n; ++j) {
        float* sj = st + j * kLanes + 8 * v;
        const vf8 e = exp8(load8(sj) - shift);  // a key not seen (-inf) weighs exactly 0
        store8(sj, e);
        sum += e;
      }
      row_sum[v] = sum;
      row_max[v] = best;
      bool rescale = false;
      for (int i = 0; i < 8; ++i) rescale |= factor[i] != 1.f;
      if (rescale) {
        for (int64_t d = 0; d < hs; ++d) store8(acct + d * kLanes + 8 * v, load8(acct + d * kLanes + 8 * v) * factor);
      }
    }
    for_row_vectors(v_lo, v_hi, [&](auto count, int64_t v0) {
      constexpr int RV = decltype(count)::value;
      constexpr int D = kBlockWidth;
      for (int64_t d = 0; d < hs; d += D) {
        lane_values<RV, D>(acct + d * kLanes + 8 * v0, st + 8 * v0, value_rows, d, n);
      }
    });
  }

  // Out: the sums transposed back into s.acc and the lanes' sums into
  // s.row_sum, written as attend_tile writes them. Every row sees at least its
  // own position.
  for (int64_t r = 0; r < rows; ++r) {
    float* a = s.acc.data() + r * hs;
    for (int64_t d = 0; d < hs; ++d) a[d] = acct[d * kLanes + r];
    s.row_sum[r] = row_sum[r / 8][r % 8];
  }
  write_rows(p, t, s);
}

// Whether a tile takes attend_tile_prefill: one KV head, at least kPrefillRows
// rows (fewer leave most lanes idle), at most kLanes, and a head size of 8 to
// 1024 in steps of 8.
constexpr int64_t kPrefillRows = 16;
inline bool prefill_tile_fits(const Problem& p, const Tile& tile) {
  const int64_t rows = TileRows(p, tile).head_rows;
  return tile.kv_heads == 1 && rows >= kPrefillRows && rows <= kLanes && p.head_size % 8 == 0 &&
         p.head_size >= 8 && p.head_size <= 1024;
}

// Prompt tiles on the prefill tile, the rest on attend_tile.
inline void run_tiles_prefill(const Problem& p, const std::vector<Tile>& tiles, int64_t rows_max) {
  run_tiles_with(
      p, tiles, rows_max,
      [&](const Tile& tile, Scratch& s, auto type, const Tile*) {
        using K = typename decltype(type)::type;
        if (prefill_tile_fits(p, tile)) {
          attend_tile_prefill<K>(p, tile, s);
        } else {
          attend_tile<K>(p, tile, s);
        }
      },
      [](const Tile&) { return false; });
}
