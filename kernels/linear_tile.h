// Register tiles of the linear ops (linear.cpp) over their packed weight
// layouts, and the epilogue every tile shares.
//
// bfloat16: the packed weight is [blocks, pairs, 16, 2] bfloat16: sixteen output channels
// per block, and for each pair of inputs (2p, 2p + 1) the sixteen channels'
// two weights side by side. One 64-byte vector then holds the weights of 16
// channels for two inputs: AVX-512 BF16's vdpbf16ps multiplies it by the two
// inputs (broadcast) and adds both products into 16 float32 sums, with no
// horizontal reduction at the end, whatever the input width. Without that
// instruction each 32-bit word splits into its two weights as floats by a shift
// and a mask (a bfloat16 is the top half of a float32), again with no shuffle.
//
// float32: the packed weight is [blocks, in, 16]: for each input, sixteen
// channels' weights side by side, one vector an FMA multiplies by the input
// (broadcast) and adds into 16 float32 sums.
//
// Included by linear.cpp once per ISA namespace (baseline, AVX2, AVX-512,
// AVX-512 BF16), after bf16_vectors.h and native_vectors.h; it includes nothing itself.

constexpr int kLanes = 16;  // channels per block

// Every tile: acc[m * kMaxBlocks * 16 + b * 16 + j] = sum_d x[m][d] * w(channel 16 b + j of the tile, d),
// for m < MR, b < NB; `w` is the tile's first block, `k` the input width.
// k >= 1: the ops answer an empty input width before tiling (runs_at_least_once).
// Unless `ahead` is null, each step over the inputs (one input, or one pair)
// also prefetches `ahead + step * ahead_step` into L2: the driver spreads the
// next tile's weights over this tile's steps (run_tiles in linear.cpp).

// The prefetch of input step `d` (see above); a prefetch never faults.
inline void prefetch_step(const char* ahead, int64_t ahead_step, int64_t d) {
  if (ahead != nullptr) __builtin_prefetch(ahead + d * ahead_step, 0, 2);
}

// bfloat16; blocks lie `pairs * 32` values apart.
// The sums are kept in `vw`, as f32_tile's.
template <int MR, int NB>
inline void generic_tile(const uint16_t* __restrict__ x, int64_t x_stride, const uint16_t* __restrict__ w,
                         int64_t k, float* __restrict__ acc_out, const char* ahead, int64_t ahead_step) {
  constexpr int V = NB * kLanes / kW;  // vectors per row of the tile
  const int64_t pairs = (k + 1) / 2;
  vw acc[MR][V];
  for (int m = 0; m < MR; ++m) {
    for (int v = 0; v < V; ++v) acc[m][v] = vw{};
  }
  const int64_t full = k / 2;
  runs_at_least_once(k);
  for (int64_t p = 0; p < pairs; ++p) {
    prefetch_step(ahead, ahead_step, p);
    float x0[MR], x1[MR];
    for (int m = 0; m < MR; ++m) {
      x0[m] = bf16_to_float(x[m * x_stride + 2 * p]);
      // An odd width's last pair has no second input (and a zero weight): never read past the row.
      x1[m] = p < full ? bf16_to_float(x[m * x_stride + 2 * p + 1]) : 0.f;
    }
    // One weight vector split at a time, used by every row before the next: two
    // registers for the weights, so more rows' sums fit.
    for (int v = 0; v < V; ++v) {
      const int b = v * kW / kLanes, lane0 = v * kW % kLanes;
      const vwu words = *reinterpret_cast<const vwu*>(w + ((b * pairs + p) * kLanes + lane0) * 2);
      const vwu even = words << 16, odd = words & 0xffff0000u;
      const vw lo = reinterpret_cast<const vw&>(even), hi = reinterpret_cast<const vw&>(odd);
      // Input 2p then 2p + 1, one multiply-add each: the order (and bits) of f32_tile
      // over the same weights as floats (widen_bf16_blocks), and two operations, not three.
      for (int m = 0; m < MR; ++m) {
        acc[m][v] += x0[m] * lo;
        acc[m][v] += x1[m] * hi;
      }
    }
  }
  for (int m = 0; m < MR; ++m) {
    for (int v = 0; v < V; ++v) *reinterpret_cast<vw*>(acc_out + m * kMaxBlocks * kLanes + v * kW) = acc[m][v];
  }
}

// float32; blocks lie `k * 16` values apart. The sums are kept in `vw`, each
// block's 16 channels in kLanes / kW of them (native_vectors.h: in vf16 this
// tile ran at a tenth of its speed under AVX2). (GCC contracts the vector
// multiply-add into FMA.)
template <int MR, int NB>
inline void f32_tile(const float* __restrict__ x, int64_t x_stride, const float* __restrict__ w, int64_t k,
                     float* __restrict__ acc_out, const char* ahead, int64_t ahead_step) {
  constexpr int V = NB * kLanes / kW;  // vectors per row of the tile
  vw acc[MR][V];
  for (int m = 0; m < MR; ++m) {
    for (int v = 0; v < V; ++v) acc[m][v] = vw{};
  }
  runs_at_least_once(k);
  for (int64_t d = 0; d < k; ++d) {
    prefetch_step(ahead, ahead_step, d);
    vw wv[V];
    for (int v = 0; v < V; ++v) {
      const int b = v * kW / kLanes, lane0 = v * kW % kLanes;
      wv[v] = *reinterpret_cast<const vw*>(w + (b * k + d) * kLanes + lane0);
    }
    for (int m = 0; m < MR; ++m) {
      const float xv = x[m * x_stride + d];
      for (int v = 0; v < V; ++v) acc[m][v] += xv * wv[v];
    }
  }
  for (int m = 0; m < MR; ++m) {
    for (int v = 0; v < V; ++v) *reinterpret_cast<vw*>(acc_out + m * kMaxBlocks * kLanes + v * kW) = acc[m][v];
  }
}

// f32_tile's sums over NB blocks by a walk: the inputs in chunks of kWalkSteps,
// and in each chunk one block at a time, its MR rows of sums in registers while
// the other blocks' wait in `acc_out`. A tile of 4-7 rows and four blocks holds
// more sums than registers and spills them every step; a walk keeps the four
// weight streams and no spills. Each block's stream is fetched kWalkAhead bytes
// ahead (into L2): with a few rows' arithmetic per weight, reading and computing
// hardly overlapped without it (docs/models.md, "Walking four blocks for 4-7
// rows"). Each sum takes its products in the same order as in f32_tile, so the
// bits are the same.
constexpr int64_t kWalkSteps = 8;
constexpr int64_t kWalkAhead = 64 * 1024;

template <int MR, int NB>
inline void f32_walk(const float* __restrict__ x, int64_t x_stride, const float* __restrict__ w, int64_t k,
                     float* __restrict__ acc_out, const char* ahead, int64_t ahead_step) {
  constexpr int V = kLanes / kW;  // vectors per row of one block
  runs_at_least_once(k);
  for (int64_t d0 = 0; d0 < k; d0 += kWalkSteps) {
    const int64_t d1 = std::min<int64_t>(k, d0 + kWalkSteps);
    for (int b = 0; b < NB; ++b) {
      float* out = acc_out + b * kLanes;
      vw acc[MR][V];
      for (int m = 0; m < MR; ++m) {
        for (int v = 0; v < V; ++v) {
          acc[m][v] = d0 == 0 ? vw{} : *reinterpret_cast<const vw*>(out + m * kMaxBlocks * kLanes + v * kW);
        }
      }
      const float* block = w + b * k * kLanes;
      for (int64_t d = d0; d < d1; ++d) {
        if (b == 0) prefetch_step(ahead, ahead_step, d);
        __builtin_prefetch(reinterpret_cast<const char*>(block + d * kLanes) + kWalkAhead, 0, 2);
        vw wv[V];
        for (int v = 0; v < V; ++v) wv[v] = *reinterpret_cast<const vw*>(block + d * kLanes + v * kW);
        for (int m = 0; m < MR; ++m) {
          const float xv = x[m * x_stride + d];
          for (int v = 0; v < V; ++v) acc[m][v] += xv * wv[v];
        }
      }
      for (int m = 0; m < MR; ++m) {
        for (int v = 0; v < V; ++v) *reinterpret_cast<vw*>(out + m * kMaxBlocks * kLanes + v * kW) = acc[m][v];
      }
    }
  }
}

// Blocks [block0, block1) of a packed bfloat16 weight ([blocks, pairs, 16, 2]) as
// the float32 layout f32_tile reads ([blocks, 2 pairs, 16]): each pair's two
// inputs become two rows of 16 channels (exact; an odd width's padding input
// keeps its zero weights).
inline void widen_bf16_blocks(const uint16_t* __restrict__ w, int64_t pairs, int64_t block0, int64_t block1,
                              float* __restrict__ out) {
  for (int64_t b = block0; b < block1; ++b) {
    for (int64_t p = 0; p < pairs; ++p) {
      const uint16_t* from = w + (b * pairs + p) * kLanes * 2;
      float* to = out + (b * pairs + p) * kLanes * 2;
      for (int lane0 = 0; lane0 < kLanes; lane0 += kW) {
        const vwu words = *reinterpret_cast<const vwu*>(from + lane0 * 2);
        const vwu even = words << 16, odd = words & 0xffff0000u;
        *reinterpret_cast<vwu*>(to + lane0) = even;
        *reinterpret_cast<vwu*>(to + kLanes + lane0) = odd;
      }
    }
  }
}

// `Epilogue` (what the epilogue adds to the sums, and where it writes) is
// defined once in linear.cpp, outside the ISA namespaces.

// silu(g) = g / (1 + e^-g); a gate below -88 gives -0 or a tiny negative, as it should.
inline vw silu_w(vw g) { return g / (1.0f + exp_of<vw, vwi>(-g)); }

// The epilogue works in `vw` (native_vectors.h), kW channels at a time.
inline void store_w(const Epilogue& e, int64_t row, int64_t c0, vw v) {
  const int64_t count = std::min<int64_t>(kW, e.n - c0);
  if (count == kW) {
    if (e.y_float) {
      *reinterpret_cast<vw*>(static_cast<float*>(e.y) + row * e.y_stride + c0) = v;
    } else {
      store_bf16w(static_cast<uint16_t*>(e.y) + row * e.y_stride + c0, v);
    }
    return;
  }
  if (e.y_float) {
    float* y = static_cast<float*>(e.y) + row * e.y_stride + c0;
    for (int64_t j = 0; j < count; ++j) y[j] = v[j];
  } else {
    uint16_t* y = static_cast<uint16_t*>(e.y) + row * e.y_stride + c0;
    for (int64_t j = 0; j < count; ++j) y[j] = float_to_bf16(v[j]);
  }
}

// The residual's kW values from channel c0 (zeros past the last channel).
inline vw residual_w(const Epilogue& e, int64_t row, int64_t c0) {
  const int64_t count = std::min<int64_t>(kW, e.n - c0);
  vw v{};
  if (e.other_float) {
    const float* r = static_cast<const float*>(e.other) + row * e.other_stride + c0;
    if (count == kW) return *reinterpret_cast<const vw*>(r);
    for (int64_t j = 0; j < count; ++j) v[j] = r[j];
    return v;
  }
  const uint16_t* r = static_cast<const uint16_t*>(e.other) + row * e.other_stride + c0;
  if (count == kW) return load_bf16w(r);
  for (int64_t j = 0; j < count; ++j) v[j] = bf16_to_float(r[j]);
  return v;
}

// Rows [row0, row0 + mr) of blocks [block0, block0 + nb): the sums in `acc`
// (as generic_tile leaves them) through the epilogue into y.
inline void finish_tile(const float* acc, int mr, int nb, int64_t row0, int64_t block0, const Epilogue& e) {
  for (int m = 0; m < mr; ++m) {
    const int64_t row = row0 + m;
    for (int b = 0; b < nb; b += e.mode == 2 ? 2 : 1) {
      const int64_t block = block0 + b;
      for (int h = 0; h < kLanes; h += kW) {
        vw v = *reinterpret_cast<const vw*>(acc + m * kMaxBlocks * kLanes + b * kLanes + h);
        if (e.scale != nullptr) v *= *reinterpret_cast<const vw*>(e.scale + block * kLanes + h);
        if (e.bias != nullptr) v += *reinterpret_cast<const vw*>(e.bias + block * kLanes + h);
        if (e.mode == 2) {
          vw up = *reinterpret_cast<const vw*>(acc + m * kMaxBlocks * kLanes + (b + 1) * kLanes + h);
          if (e.scale != nullptr) up *= *reinterpret_cast<const vw*>(e.scale + (block + 1) * kLanes + h);
          if (e.bias != nullptr) up += *reinterpret_cast<const vw*>(e.bias + (block + 1) * kLanes + h);
          const int64_t c0 = block / 2 * kLanes + h;
          if (c0 < e.n) store_w(e, row, c0, silu_w(v) * up);
          continue;
        }
        const int64_t c0 = block * kLanes + h;
        if (c0 >= e.n) continue;
        if (e.mode == 1) v += residual_w(e, row, c0);
        store_w(e, row, c0, v);
      }
    }
  }
}
