// The batch-invariant tile of kvforge's CPU paged attention: every query row's
// output is a function of that row alone (its query, its position and the keys
// and values it sees), bit for bit, whatever else shares its tile, its step or
// its sequence's query chunk, and whatever the cache's block size.
//
// The other tiles are faster but not so: how a row's keys are split into steps
// of its online softmax follows the cache's blocks and the tile's key range (a
// prefill row sums a block's exponentials in other lanes than the same row as a
// decode), and the prefill tile computes its exponentials another way. Here a
// row's softmax walks its keys in steps of kInvariantKeys at fixed absolute
// positions (0-15, 16-31, ...): each key's score is summed over head_size in one
// fixed order (the `scores` micro-kernel, whose arithmetic per row and key does
// not depend on how many rows it runs at once), its exponential sits in lane
// `position % 16` of the step's sum (keys the row does not see give exactly 0,
// so the same lanes hold the same values however many keys the tile loaded), and
// the weighted values are added key by key in position order (`accumulate`; a
// key the row does not see adds an exact zero). Rows still share each step's
// keys and values, so a prefill reads the cache once per tile, not once per row.
//
// Included by paged_attention.cpp in each ISA namespace after attention_tile.h;
// it includes nothing itself and holds no state.

constexpr int64_t kInvariantKeys = 16;  // keys per softmax step, at fixed absolute positions

// One stretch of a step's keys that lies in one block: `count` slots from step
// lane `lane` on, read as float32 rows `stride` apart (the cache itself for a
// float32 cache, else converted into the tile's buffers).
struct KeyRun {
  int64_t lane, count, k_stride, v_stride;
  const float* keys;
  const float* values;
};

template <typename K>
void attend_tile_invariant(const Problem& p, const Tile& tile, Scratch& s) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  constexpr int64_t kKeys = kInvariantKeys;
  const TileRows t(p, tile);
  const int64_t group = t.group, head_rows = t.head_rows, pos0 = t.pos0, last = t.last, first = t.first;
  const int64_t hs = p.head_size, bs = p.block_size, heads = p.num_kv_heads;
  const int64_t slot_stride = heads * hs;
  begin_rows(p, t, s);
  if (static_cast<int64_t>(s.invariant.size()) < 2 * kKeys * hs) s.invariant.resize(2 * kKeys * hs);
  float* key_buffer = s.invariant.data();  // [16, head_size]: a step's keys of one KV head, when converted
  float* value_buffer = key_buffer + kKeys * hs;
  float* q = s.q.data();
  float* acc = s.acc.data();
  float* weights = s.score.data();  // [head_rows, 16]: scores, then each row's exponentials
  KeyRun runs[kKeys];

  for (int64_t c0 = first / kKeys * kKeys; c0 <= last; c0 += kKeys) {
    const int64_t load0 = std::max(c0, first), load1 = std::min(c0 + kKeys, last + 1);  // keys any row sees
    for (int64_t h = 0; h < tile.kv_heads; ++h) {
      const int64_t r0 = h * head_rows;
      int64_t num_runs = 0;
      for (int64_t key_pos = load0; key_pos < load1;) {
        const int64_t logical = key_pos / bs, offset = key_pos % bs;
        const int64_t count = std::min(load1 - key_pos, bs - offset), lane = key_pos - c0;
        const K* slots = page_of<K>(p, tile, logical) + offset * slot_stride + h * hs;
        const float* key_scales = nullptr;
        if constexpr (kScaled<K>) key_scales = scales_of(p, tile, logical) + offset * heads + tile.kv_head + h;
        KeyRun& run = runs[num_runs++];
        run.lane = lane;
        run.count = count;
        run.keys = rows_as_float(slots, count, slot_stride, hs, key_scales, heads, key_buffer + lane * hs,
                                 run.k_stride);
        run.values = rows_as_float(slots + bs * slot_stride, count, slot_stride, hs,
                                   kScaled<K> ? key_scales + bs * heads : nullptr, heads, value_buffer + lane * hs,
                                   run.v_stride);
        for_row_groups(head_rows, [&](auto group_rows, int64_t r) {
          scores<decltype(group_rows)::value>(q + (r0 + r) * hs, hs, run.keys, run.k_stride, count,
                                              weights + r * kKeys + lane, kKeys);
        });
        key_pos += count;
      }
      for (int64_t rr = 0; rr < head_rows; ++rr) {
        const int64_t r = r0 + rr;
        const int64_t pos = pos0 + rr / group;
        const int64_t seen0 = std::max(c0, p.window > 0 ? pos - p.window + 1 : int64_t{0});
        const int64_t seen1 = std::min(c0 + kKeys, pos + 1);
        float* w = weights + rr * kKeys;
        if (seen0 >= seen1) {  // this row sees none of the step's keys: it adds zeros below
          std::fill(w, w + kKeys, 0.f);
          continue;
        }
        float best = kNegInf;
        for (int64_t j = 0; j < kKeys; ++j) {
          const int64_t key_pos = c0 + j;
          float v = w[j];
          if (p.soft_cap > 0.f) v = p.soft_cap * std::tanh(v / p.soft_cap);
          if (p.alibi != nullptr) v += p.alibi[t.head_of(r)] * static_cast<float>(key_pos - pos);
          w[j] = key_pos >= seen0 && key_pos < seen1 ? v : kNegInf;  // lanes never loaded are masked here too
          best = std::max(best, w[j]);
        }
        const float new_max = std::max(s.row_max[r], best);
        const float rescale = std::exp(s.row_max[r] - new_max);  // 0 while the row was empty
        if (rescale != 1.f) scale_in_place(acc + r * hs, rescale, hs);
        const vf8 e_lo = exp8(load8(w) - splat(new_max)), e_hi = exp8(load8(w + 8) - splat(new_max));
        store8(w, e_lo);
        store8(w + 8, e_hi);
        s.row_sum[r] = s.row_sum[r] * rescale + hsum(e_lo + e_hi);
        s.row_max[r] = new_max;
      }
      for (int64_t i = 0; i < num_runs; ++i) {
        const KeyRun& run = runs[i];
        for_row_groups(head_rows, [&](auto group_rows, int64_t r) {
          accumulate<decltype(group_rows)::value>(acc + (r0 + r) * hs, hs, weights + r * kKeys + run.lane, kKeys,
                                                  run.values, run.v_stride, run.count);
        });
      }
    }
  }
  write_rows(p, t, s);
}

inline void run_tiles_invariant(const Problem& p, const std::vector<Tile>& tiles, int64_t rows_max) {
  run_tiles_with(
      p, tiles, rows_max,
      [&](const Tile& tile, Scratch& s, auto type, const Tile*) {
        attend_tile_invariant<typename decltype(type)::type>(p, tile, s);
      },
      [](const Tile&) { return false; });
}
