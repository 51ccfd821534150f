// The inner kernel of kvforge's CPU paged attention: one tile of query rows of
// one sequence against the keys and values of some of its KV heads, and the
// loop that runs every tile on the thread pool.
//
// Included twice by paged_attention.cpp, inside two namespaces: once compiled
// for the baseline ISA and once under `#pragma GCC target("avx2,fma,f16c")`,
// so one portable build runs fast on newer x86 CPUs without -march=native. It
// therefore includes nothing itself and holds no state; it uses the helpers of
// vector_kernels.h, included just before it.

// Calls f(std::integral_constant<int, R>, first_row) over `rows` in groups of 4,
// then the remainder, so every group gets a micro-kernel with constant R.
template <typename F>
inline void for_row_groups(int64_t rows, F&& f) {
  int64_t r = 0;
  for (; r + 4 <= rows; r += 4) f(std::integral_constant<int, 4>{}, r);
  switch (rows - r) {
    case 3: f(std::integral_constant<int, 3>{}, r); break;
    case 2: f(std::integral_constant<int, 2>{}, r); break;
    case 1: f(std::integral_constant<int, 1>{}, r); break;
    default: break;
  }
}

// Asks for `count` rows of `bytes` each, `stride` elements apart, ahead of use:
// blocks sit at random places in the cache, which defeats the hardware prefetcher.
// Its callers are the AVX-512 tiles (prefill_tile.h, narrow_rows.h). It is not
// KVFORGE_PREFETCH_HELPER (cpu_isa.h), so GCC may delete the calls it does not
// inline: forced in, the AVX2 tiles' decode read long contexts slower and their
// prefill no faster, and the AVX-512 tiles have not been timed that way.
template <typename T>
inline void prefetch_rows(const T* rows, int64_t count, int64_t stride, int64_t bytes) {
  for (int64_t j = 0; j < count; ++j) {
    const char* row = reinterpret_cast<const char*>(rows + j * stride);
    for (int64_t offset = 0; offset < bytes; offset += 64) __builtin_prefetch(row + offset, 0, 2);  // into L2
  }
}

inline void scale_in_place(float* __restrict__ y, float a, int64_t n) {
  for (int64_t d = 0; d < n; ++d) y[d] *= a;
}

// dst[d] = value(src[d]) * scale for n stored elements of any cache dtype.
template <typename T>
inline void to_float(float* __restrict__ dst, const T* __restrict__ src, int64_t n, float scale) {
  int64_t d = 0;
#ifdef KVFORGE_F16C
  // The portable conversions do not vectorise; F16C and AVX2 convert 8 at once.
  // Both float8 formats widen to fp16 bit patterns: e5m2 is an fp16's top byte;
  // e4m3fn's exponent and mantissa, shifted into an fp16's (b & 0x7F) << 7, sign
  // on bit 15, read as that value times 2^-8 (normals and subnormals alike: the
  // exponent fields line up and only the biases, 7 and 15, differ), so 256
  // joins the scale. (e4m3fn's NaN, 0x7F, would read as 480; quantizers never
  // store it.)
  if constexpr (std::is_same_v<T, c10::Half> || kScaled<T>) {  // float32 and bfloat16 vectorise below
    const __m256 factor = _mm256_set1_ps(std::is_same_v<T, c10::Float8_e4m3fn> ? scale * 256.f : scale);
    for (; d + 8 <= n; d += 8) {
      __m256 x;
      if constexpr (std::is_same_v<T, c10::Half>) {
        x = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + d)));
      } else if constexpr (std::is_same_v<T, int8_t>) {
        x = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + d))));
      } else if constexpr (std::is_same_v<T, c10::Float8_e5m2>) {
        const __m128i bytes = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + d)));
        x = _mm256_cvtph_ps(_mm_slli_epi16(bytes, 8));
      } else {
        static_assert(std::is_same_v<T, c10::Float8_e4m3fn>);
        // Sign-extended and shifted by 7, the sign lands on bit 15 and again on
        // bit 14, which the mask clears: ((b & 0x7F) << 7) | ((b & 0x80) << 8).
        const __m128i words = _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + d)));
        x = _mm256_cvtph_ps(_mm_and_si128(_mm_slli_epi16(words, 7), _mm_set1_epi16(static_cast<int16_t>(0xBFFF))));
      }
      _mm256_storeu_ps(dst + d, _mm256_mul_ps(x, factor));
    }
  }
#endif
  for (; d < n; ++d) dst[d] = stored_value(src[d]) * scale;
}

// Rows of `count` slots starting at `src` (slot stride `stride`) as float32: the
// cache row itself when it already is float32, else a converted copy, each row
// times its scale (scales[j * scale_stride]) when the cache is quantized.
template <typename K>
inline const float* rows_as_float(const K* src, int64_t count, int64_t stride, int64_t head_size,
                                  const float* scales, int64_t scale_stride, float* buffer, int64_t& row_stride) {
  if constexpr (std::is_same_v<K, float>) {
    row_stride = stride;
    return src;
  } else {
    for (int64_t j = 0; j < count; ++j) {
      const float scale = kScaled<K> ? scales[j * scale_stride] : 1.f;
      to_float(buffer + j * head_size, src + j * stride, head_size, scale);
    }
    row_stride = head_size;
    return buffer;
  }
}

// A tile's rows: row r is token token_of(r) of the tile and query head
// head_of(r); the head_rows rows of one KV head are contiguous.
struct TileRows {
  int64_t group, head_rows, rows, q_row0, pos0, last, first, kv_head;

  TileRows(const Problem& p, const Tile& tile)
      : group(p.queries_per_kv),
        head_rows((tile.q_end - tile.q_begin) * p.queries_per_kv),
        rows(head_rows * tile.kv_heads),
        q_row0(p.query_start[tile.seq] + tile.q_begin),
        pos0(p.context_lens[tile.seq] + tile.q_begin),  // position of the tile's first token
        last(pos0 + tile.q_end - tile.q_begin - 1),
        first(p.window > 0 ? std::max<int64_t>(0, pos0 - p.window + 1) : 0),  // first key any row sees
        kv_head(tile.kv_head) {}
  int64_t head_of(int64_t r) const { return (kv_head + r / head_rows) * group + r % group; }
  int64_t token_of(int64_t r) const { return (r % head_rows) / group; }
};

// Where block `logical` of the tile's sequence begins, at the tile's first KV
// head: its keys are block_size slots from here, its values the block_size after.
template <typename K>
inline const K* page_of(const Problem& p, const Tile& tile, int64_t logical) {
  const int64_t block = p.block_table[tile.seq * p.block_table_stride + logical];
  return reinterpret_cast<const K*>(p.cache + block * p.block_bytes) + tile.kv_head * p.head_size;
}

// The scales of block `logical` of a quantized cache, [2, block_size, num_kv_heads]:
// key slot j of KV head h at [j * num_kv_heads + h], its value block_size slots on.
inline const float* scales_of(const Problem& p, const Tile& tile, int64_t logical) {
  const int64_t block = p.block_table[tile.seq * p.block_table_stride + logical];
  return reinterpret_cast<const float*>(p.scales + block * p.scale_block_bytes);
}

// Asks for keys and values [k0, k0 + n) of the tile's KV head (into L2) while the
// tile before them is computed: a tile reads rows scattered over blocks, which
// the hardware prefetchers do not follow.
template <typename K>
inline void prefetch_key_tile(const Problem& p, const Tile& tile, int64_t k0, int64_t n) {
  const int64_t bs = p.block_size, slot_stride = p.num_kv_heads * p.head_size;
  const int64_t head_bytes = p.head_size * static_cast<int64_t>(sizeof(K));
  for (int64_t j = 0; j < n;) {
    const int64_t pos = k0 + j, slot = pos % bs, run = std::min(n - j, bs - slot);
    const K* page = page_of<K>(p, tile, pos / bs);
    prefetch_rows(page + slot * slot_stride, run, slot_stride, head_bytes);
    prefetch_rows(page + (bs + slot) * slot_stride, run, slot_stride, head_bytes);
    j += run;
  }
}

// The tile's queries, scaled, into s.q as float32; its softmax state emptied.
template <typename T>
inline void begin_rows_as(const Problem& p, const TileRows& t, Scratch& s) {
  const int64_t hs = p.head_size;
  const T* query = static_cast<const T*>(p.query);
  for (int64_t r = 0; r < t.rows; ++r) {
    const T* src = query + (t.q_row0 + t.token_of(r)) * p.q_token_stride + t.head_of(r) * p.q_head_stride;
    to_float(s.q.data() + r * hs, src, hs, p.scale);
    s.row_max[r] = -std::numeric_limits<float>::infinity();
    s.row_sum[r] = 0.f;
  }
  std::fill(s.acc.data(), s.acc.data() + t.rows * hs, 0.f);
}

// The tile's normalised rows (s.acc / s.row_sum) into `out`.
template <typename T>
inline void write_rows_as(const Problem& p, const TileRows& t, const Scratch& s) {
  T* out = static_cast<T*>(p.out);
  const int64_t hs = p.head_size;
  for (int64_t r = 0; r < t.rows; ++r) {
    T* dst = out + (t.q_row0 + t.token_of(r)) * p.o_token_stride + t.head_of(r) * p.o_head_stride;
    // row_sum > 0 always: a query always sees its own position.
    const float inv = s.row_sum[r] > 0.f ? 1.f / s.row_sum[r] : 0.f;
    const float* a = s.acc.data() + r * hs;
    for (int64_t d = 0; d < hs; ++d) dst[d] = static_cast<T>(a[d] * inv);
  }
}

// begin_rows_as and write_rows_as for the query's dtype, chosen per tile: the
// tiles are compiled once per cache dtype, not once per (query, cache) pair.
inline void begin_rows(const Problem& p, const TileRows& t, Scratch& s) {
  switch (p.dtype) {
    case at::ScalarType::Half: begin_rows_as<c10::Half>(p, t, s); return;
    case at::ScalarType::BFloat16: begin_rows_as<c10::BFloat16>(p, t, s); return;
    default: begin_rows_as<float>(p, t, s); return;  // paged_attention admits only these three
  }
}

inline void write_rows(const Problem& p, const TileRows& t, const Scratch& s) {
  switch (p.dtype) {
    case at::ScalarType::Half: write_rows_as<c10::Half>(p, t, s); return;
    case at::ScalarType::BFloat16: write_rows_as<c10::BFloat16>(p, t, s); return;
    default: write_rows_as<float>(p, t, s); return;
  }
}

// Attends query tokens [tile.q_begin, tile.q_end) of sequence tile.seq, for
// every query head of KV heads [tile.kv_head, tile.kv_head + tile.kv_heads),
// with an online softmax over the blocks the tile may see. Each block is visited
// once for all of the tile's KV heads: with several heads per tile the reads of
// a block are one contiguous run instead of head-strided pieces.
template <typename K>
void attend_tile(const Problem& p, const Tile& tile, Scratch& s) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const TileRows t(p, tile);
  const int64_t group = t.group, head_rows = t.head_rows, pos0 = t.pos0, last = t.last, first = t.first;
  const int64_t hs = p.head_size;
  const int64_t bs = p.block_size;
  begin_rows(p, t, s);
  float* q = s.q.data();
  float* acc = s.acc.data();
  float* score = s.score.data();  // [head_rows, ss], reused per KV head
  const int64_t ss = (bs + 7) / 8 * 8;  // score row stride: whole vectors
  // Transposed keys when enough rows share each block to amortise the transpose.
  const bool transposed = head_rows >= kTransposeRows && bs >= 8;
  float* row_max = s.row_max.data();
  float* row_sum = s.row_sum.data();

  const int64_t heads = p.num_kv_heads;
  const int64_t slot_stride = heads * hs;  // between consecutive slots of one block
  for (int64_t logical = first / bs; logical <= last / bs; ++logical) {
    const int64_t start = logical * bs;
    const int64_t j0 = std::max(first, start) - start;
    const int64_t j1 = std::min(last + 1, start + bs) - start;
    const int64_t count = j1 - j0;
    const K* page = page_of<K>(p, tile, logical);
    const float* key_scales = nullptr;  // this block's, from slot j0 on
    const float* value_scales = nullptr;
    if constexpr (kScaled<K>) {
      key_scales = scales_of(p, tile, logical) + j0 * heads + tile.kv_head;
      value_scales = key_scales + bs * heads;
    }
    for (int64_t h = 0; h < tile.kv_heads; ++h) {
      const int64_t r0 = h * head_rows;
      int64_t v_stride = 0;
      const float* values = rows_as_float(page + (bs + j0) * slot_stride + h * hs, count, slot_stride, hs,
                                          kScaled<K> ? value_scales + h : nullptr, heads, s.values.data(), v_stride);
      if (transposed) {
        const int64_t kt_stride = (count + 7) / 8 * 8;
        transpose_keys(s.keys.data(), kt_stride, page + j0 * slot_stride + h * hs, slot_stride, count, hs,
                       kScaled<K> ? key_scales + h : nullptr, heads);
        for (int64_t v0 = 0; v0 < kt_stride; v0 += 16) {
          const float* kt = s.keys.data() + v0;
          for_row_groups(head_rows, [&](auto group_rows, int64_t r) {
            constexpr int R = decltype(group_rows)::value;
            float* dst = score + r * ss + v0;
            if (kt_stride - v0 >= 16) {
              scores_transposed<R, 2>(q + (r0 + r) * hs, hs, kt, kt_stride, dst, ss);
            } else {
              scores_transposed<R, 1>(q + (r0 + r) * hs, hs, kt, kt_stride, dst, ss);
            }
          });
        }
      } else {
        int64_t k_stride = 0;
        const float* keys = rows_as_float(page + j0 * slot_stride + h * hs, count, slot_stride, hs,
                                          kScaled<K> ? key_scales + h : nullptr, heads, s.keys.data(), k_stride);
        for_row_groups(head_rows, [&](auto group_rows, int64_t r) {
          scores<decltype(group_rows)::value>(q + (r0 + r) * hs, hs, keys, k_stride, count, score + r * ss, ss);
        });
      }

      for (int64_t rr = 0; rr < head_rows; ++rr) {
        const int64_t r = r0 + rr;
        const int64_t pos = pos0 + rr / group;
        float* sr = score + rr * ss;
        float best = kNegInf;
        for (int64_t j = 0; j < count; ++j) {
          const int64_t key_pos = start + j0 + j;
          float v = sr[j];
          if (p.soft_cap > 0.f) v = p.soft_cap * std::tanh(v / p.soft_cap);
          if (p.alibi != nullptr) v += p.alibi[t.head_of(r)] * static_cast<float>(key_pos - pos);
          const bool visible = key_pos <= pos && (p.window <= 0 || key_pos > pos - p.window);
          sr[j] = visible ? v : kNegInf;
          best = std::max(best, sr[j]);
        }
        if (best == kNegInf) {
          for (int64_t j = 0; j < count; ++j) sr[j] = 0.f;  // nothing visible in this block
          continue;
        }
        const float new_max = std::max(row_max[r], best);
        const float rescale = std::exp(row_max[r] - new_max);  // 0 while the row was empty
        float sum = row_sum[r] * rescale;
        if (rescale != 1.f) scale_in_place(acc + r * hs, rescale, hs);
        int64_t j = 0;
        vf8 sums{};
        for (; j + 8 <= count; j += 8) {
          const vf8 e = exp8(load8(sr + j) - splat(new_max));
          store8(sr + j, e);
          sums += e;
        }
        sum += hsum(sums);
        for (; j < count; ++j) {
          sr[j] = std::exp(sr[j] - new_max);
          sum += sr[j];
        }
        row_max[r] = new_max;
        row_sum[r] = sum;
      }

      for_row_groups(head_rows, [&](auto group_rows, int64_t r) {
        accumulate<decltype(group_rows)::value>(acc + (r0 + r) * hs, hs, score + r * ss, ss, values, v_stride, count);
      });
    }
  }

  write_rows(p, t, s);
}

// Runs attend(tile, scratch, TypeTag<K>{}, after) for every tile on the thread
// pool, K the type of the stored keys and values. A tile for which
// fetches_ahead(tile) holds (a decode's) claims the next queued tile before it
// runs and gets it as `after`: the tile this thread takes next, whose first keys
// it can ask for while it computes. Others get no `after` and claim their
// successor only when done, which keeps the longest-first order's balance.
template <typename Attend, typename FetchesAhead>
inline void run_tiles_with(const Problem& p, const std::vector<Tile>& tiles, int64_t rows_max, Attend&& attend,
                           FetchesAhead&& fetches_ahead) {
  std::atomic<int64_t> next{0};
  const int64_t n = static_cast<int64_t>(tiles.size());
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n));
  // One chunk per thread that then pulls tiles dynamically: at::parallel_for
  // splits statically, and prefill tiles cost far more than decode ones.
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    Scratch s(rows_max, p.head_size, p.block_size);
    for (int64_t i = next.fetch_add(1); i < n;) {
      const int64_t claimed = fetches_ahead(tiles[i]) ? next.fetch_add(1) : -1;
      const Tile* after = claimed >= 0 && claimed < n ? &tiles[claimed] : nullptr;
      switch (p.kv_dtype) {
        case at::ScalarType::Float: attend(tiles[i], s, TypeTag<float>{}, after); break;
        case at::ScalarType::Half: attend(tiles[i], s, TypeTag<c10::Half>{}, after); break;
        case at::ScalarType::BFloat16: attend(tiles[i], s, TypeTag<c10::BFloat16>{}, after); break;
        case at::ScalarType::Char: attend(tiles[i], s, TypeTag<int8_t>{}, after); break;
        case at::ScalarType::Float8_e4m3fn: attend(tiles[i], s, TypeTag<c10::Float8_e4m3fn>{}, after); break;
        case at::ScalarType::Float8_e5m2: attend(tiles[i], s, TypeTag<c10::Float8_e5m2>{}, after); break;
        default: TORCH_CHECK(false, "kvforge_cpp: unsupported KV cache dtype ", p.kv_dtype);
      }
      i = claimed >= 0 ? claimed : next.fetch_add(1);
    }
  });
}

inline void run_tiles(const Problem& p, const std::vector<Tile>& tiles, int64_t rows_max) {
  run_tiles_with(
      p, tiles, rows_max,
      [&](const Tile& tile, Scratch& s, auto type, const Tile*) {
        attend_tile<typename decltype(type)::type>(p, tile, s);
      },
      [](const Tile&) { return false; });
}
