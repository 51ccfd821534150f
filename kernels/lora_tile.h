// Register tiles of the batched LoRA op (lora.cpp): shrink (x @ a[s]^T into a
// float32 buffer of rank R) and expand (y += buffer @ b[s], one rounding to y's
// dtype), for float32 and bfloat16 operands, float32 sums.
//
// Shrink is a dot product along `in` for both operands (x [T, in], a [R, in]),
// so a tile of MT tokens x MR ranks keeps MT x MR vectors of sums and folds
// each once at the end. Expand is an axpy along `out` (b [R, out]): a tile of MT
// tokens x NV column vectors keeps its sums in registers over all R ranks, then
// adds them to y and rounds once.
//
// Vectors are the ISA's own width (native_vectors.h's vw, kW floats: 4 SSE, 8
// AVX2, 16 AVX-512): GCC keeps a loop's sums of wider generic vectors in memory
// where it must split them into several registers.
//
// Included by lora.cpp once per ISA namespace, after bf16_vectors.h (the scalar
// bfloat16 conversions, load1 and store1), native_vectors.h (vw, kW, loadw and
// storew) and that namespace's tile sizes (kShrinkTokens, kShrinkRanks,
// kExpandTokens, kExpandVectors, each 1 to 4).

inline float lane_sum(vw v) {
  float sum = 0.f;
  for (int j = 0; j < kW; ++j) sum += v[j];
  return sum;
}

// out[t * R + r] = x[t] . a[r] for t < MT, r < MR; `k` the input width.
template <typename T, int MT, int MR>
void shrink_tile(const T* __restrict__ x, int64_t x_stride, const T* __restrict__ a, int64_t k,
                 float* __restrict__ out, int64_t rank) {
  vw acc[MT][MR] = {};
  int64_t i = 0;
  for (; i + kW <= k; i += kW) {
    vw av[MR];
    for (int r = 0; r < MR; ++r) av[r] = loadw(a + r * k + i);
    for (int t = 0; t < MT; ++t) {
      const vw xv = loadw(x + t * x_stride + i);
      for (int r = 0; r < MR; ++r) acc[t][r] += xv * av[r];
    }
  }
  for (int t = 0; t < MT; ++t) {
    for (int r = 0; r < MR; ++r) {
      float sum = lane_sum(acc[t][r]);
      for (int64_t j = i; j < k; ++j) sum += load1(x + t * x_stride + j) * load1(a + r * k + j);
      out[t * rank + r] = sum;
    }
  }
}

// y[t][kW v + j] += sum_r s[t * R + r] * b[r * n + kW v + j] for t < MT, v < NV.
template <typename T, int MT, int NV>
void expand_tile(const float* __restrict__ s, int64_t rank, const T* __restrict__ b, int64_t n,
                 T* __restrict__ y, int64_t y_stride) {
  vw acc[MT][NV] = {};
  for (int64_t r = 0; r < rank; ++r) {
    vw bv[NV];
    for (int v = 0; v < NV; ++v) bv[v] = loadw(b + r * n + kW * v);
    for (int t = 0; t < MT; ++t) {
      const float w = s[t * rank + r];
      for (int v = 0; v < NV; ++v) acc[t][v] += w * bv[v];
    }
  }
  for (int t = 0; t < MT; ++t) {
    for (int v = 0; v < NV; ++v) {
      T* p = y + t * y_stride + kW * v;
      storew(p, loadw(p) + acc[t][v]);  // the update's sum first, then y: the reference's order
    }
  }
}

// The columns past the last whole vector, one at a time.
template <typename T>
void expand_columns(const float* s, int64_t rank, const T* b, int64_t n, T* y, int64_t y_stride, int64_t tokens,
                    int64_t columns) {
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t c = 0; c < columns; ++c) {
      float sum = 0.f;
      for (int64_t r = 0; r < rank; ++r) sum += s[t * rank + r] * load1(b + r * n + c);
      store1(y + t * y_stride + c, load1(y + t * y_stride + c) + sum);
    }
  }
}

// A tile's size chosen at run time (a tail), as the compile-time one.
template <typename T, int MT>
void shrink_tokens(int mr, const T* x, int64_t x_stride, const T* a, int64_t k, float* out, int64_t rank) {
  switch (mr) {
    case 1: return shrink_tile<T, MT, 1>(x, x_stride, a, k, out, rank);
    case 2: return shrink_tile<T, MT, 2>(x, x_stride, a, k, out, rank);
    case 3: return shrink_tile<T, MT, 3>(x, x_stride, a, k, out, rank);
    default: return shrink_tile<T, MT, kShrinkRanks>(x, x_stride, a, k, out, rank);
  }
}

template <typename T, int MT>
void expand_tokens(int nv, const float* s, int64_t rank, const T* b, int64_t n, T* y, int64_t y_stride) {
  switch (nv) {
    case 1: return expand_tile<T, MT, 1>(s, rank, b, n, y, y_stride);
    case 2: return expand_tile<T, MT, 2>(s, rank, b, n, y, y_stride);
    case 3: return expand_tile<T, MT, 3>(s, rank, b, n, y, y_stride);
    default: return expand_tile<T, MT, kExpandVectors>(s, rank, b, n, y, y_stride);
  }
}

// Shrink of `tokens` rows of x (one segment's, or part of it) against ranks
// [r0, r1) of its adapter `a` ([R, k]), into out[t * R + r].
template <typename T>
void shrink_rows(const T* x, int64_t x_stride, int64_t tokens, const T* a, int64_t k, int64_t rank, int64_t r0,
                 int64_t r1, float* out) {
  for (int64_t t = 0; t < tokens; t += kShrinkTokens) {
    const int mt = static_cast<int>(std::min<int64_t>(kShrinkTokens, tokens - t));
    for (int64_t r = r0; r < r1; r += kShrinkRanks) {
      const int mr = static_cast<int>(std::min<int64_t>(kShrinkRanks, r1 - r));
      const T* xt = x + t * x_stride;
      const T* ar = a + r * k;
      float* o = out + t * rank + r;
      switch (mt) {
        case 1: shrink_tokens<T, 1>(mr, xt, x_stride, ar, k, o, rank); break;
        case 2: shrink_tokens<T, 2>(mr, xt, x_stride, ar, k, o, rank); break;
        case 3: shrink_tokens<T, 3>(mr, xt, x_stride, ar, k, o, rank); break;
        default: shrink_tokens<T, kShrinkTokens>(mr, xt, x_stride, ar, k, o, rank);
      }
    }
  }
}

// Expand of `tokens` rows of the buffer `s` ([tokens, R]) into columns
// [c0, c1) of y, through their adapter `b` ([R, n]).
template <typename T>
void expand_rows(const float* s, int64_t rank, const T* b, int64_t n, T* y, int64_t y_stride, int64_t tokens,
                 int64_t c0, int64_t c1) {
  const int64_t vectors = (c1 - c0) / kW;
  for (int64_t t = 0; t < tokens; t += kExpandTokens) {
    const int mt = static_cast<int>(std::min<int64_t>(kExpandTokens, tokens - t));
    const float* st = s + t * rank;
    T* yt = y + t * y_stride;
    for (int64_t v = 0; v < vectors; v += kExpandVectors) {
      const int nv = static_cast<int>(std::min<int64_t>(kExpandVectors, vectors - v));
      const int64_t c = c0 + kW * v;
      switch (mt) {
        case 1: expand_tokens<T, 1>(nv, st, rank, b + c, n, yt + c, y_stride); break;
        case 2: expand_tokens<T, 2>(nv, st, rank, b + c, n, yt + c, y_stride); break;
        case 3: expand_tokens<T, 3>(nv, st, rank, b + c, n, yt + c, y_stride); break;
        default: expand_tokens<T, kExpandTokens>(nv, st, rank, b + c, n, yt + c, y_stride);
      }
    }
    const int64_t done = c0 + kW * vectors;
    expand_columns(st, rank, b + done, n, yt + done, y_stride, mt, c1 - done);
  }
}
