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
// fixed order, its exponential sits in lane `position % 16` of the step's sum
// (keys the row does not see give exactly 0, so the same lanes hold the same
// values however many keys the tile loaded), and the weighted values are added
// key by key in position order. Rows still share each step's converted keys and
// values, so a prefill reads the cache once per tile, not once per row.
//
// Included by paged_attention.cpp in each ISA namespace after attention_tile.h;
// it includes nothing itself and holds no state.

constexpr int64_t kInvariantKeys = 16;  // keys per softmax step, at fixed absolute positions

// The tile's softmax steps: step `c` covers key positions [16 c, 16 c + 16).
// s.invariant holds one KV head's keys of a step transposed (kt[d * 16 + j]) and
// its values (values[j * head_size + d]), as float32 (dequantized when scaled).
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
  float* kt = s.invariant.data();
  float* values = kt + kKeys * hs;
  float* q = s.q.data();
  float* acc = s.acc.data();

  for (int64_t c0 = first / kKeys * kKeys; c0 <= last; c0 += kKeys) {
    const int64_t load0 = std::max(c0, first), load1 = std::min(c0 + kKeys, last + 1);  // keys any row sees
    for (int64_t h = 0; h < tile.kv_heads; ++h) {
      std::fill(kt, kt + kKeys * hs, 0.f);  // lanes not loaded stay finite; they are masked below
      for (int64_t key_pos = load0; key_pos < load1; ++key_pos) {
        const int64_t j = key_pos - c0, logical = key_pos / bs, offset = key_pos % bs;
        const K* slot = page_of<K>(p, tile, logical) + offset * slot_stride + h * hs;
        float key_scale = 1.f, value_scale = 1.f;
        if constexpr (kScaled<K>) {
          const float* scales = scales_of(p, tile, logical) + offset * heads + tile.kv_head + h;
          key_scale = scales[0];
          value_scale = scales[bs * heads];
        }
        for (int64_t d = 0; d < hs; ++d) kt[d * kKeys + j] = stored_value(slot[d]) * key_scale;
        to_float(values + j * hs, slot + bs * slot_stride, hs, value_scale);
      }
      for (int64_t rr = 0; rr < head_rows; ++rr) {
        const int64_t r = h * head_rows + rr;
        const int64_t pos = pos0 + rr / group;
        const int64_t seen0 = std::max(c0, p.window > 0 ? pos - p.window + 1 : int64_t{0});
        const int64_t seen1 = std::min(c0 + kKeys, pos + 1);
        if (seen0 >= seen1) continue;  // this row sees none of the step's keys
        const float* qr = q + r * hs;
        vf8 lo{}, hi{};
        for (int64_t d = 0; d < hs; ++d) {
          lo += qr[d] * load8(kt + d * kKeys);
          hi += qr[d] * load8(kt + d * kKeys + 8);
        }
        float score[kKeys];
        store8(score, lo);
        store8(score + 8, hi);
        float best = kNegInf;
        for (int64_t j = 0; j < kKeys; ++j) {
          const int64_t key_pos = c0 + j;
          float v = score[j];
          if (p.soft_cap > 0.f) v = p.soft_cap * std::tanh(v / p.soft_cap);
          if (p.alibi != nullptr) v += p.alibi[t.head_of(r)] * static_cast<float>(key_pos - pos);
          score[j] = key_pos >= seen0 && key_pos < seen1 ? v : kNegInf;
          best = std::max(best, score[j]);
        }
        const float new_max = std::max(s.row_max[r], best);
        const float rescale = std::exp(s.row_max[r] - new_max);  // 0 while the row was empty
        float* ar = acc + r * hs;
        if (rescale != 1.f) scale_in_place(ar, rescale, hs);
        const vf8 e_lo = exp8(load8(score) - splat(new_max)), e_hi = exp8(load8(score + 8) - splat(new_max));
        store8(score, e_lo);
        store8(score + 8, e_hi);
        s.row_sum[r] = s.row_sum[r] * rescale + hsum(e_lo + e_hi);
        s.row_max[r] = new_max;
        for (int64_t key_pos = seen0; key_pos < seen1; ++key_pos) {
          const int64_t j = key_pos - c0;
          const float w = score[j];
          const float* v = values + j * hs;
          int64_t d = 0;
          for (; d + 8 <= hs; d += 8) store8(ar + d, load8(ar + d) + w * load8(v + d));
          for (; d < hs; ++d) ar[d] += w * v[d];
        }
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
