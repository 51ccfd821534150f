// Vector building blocks of kvforge's CPU paged attention: eight-float vectors,
// a vectorised exp, and micro-kernels for scores and weighted value sums.
//
// Included twice by paged_attention.cpp (like attention_tile.h), once for the
// baseline ISA and once under `#pragma GCC target("avx2,fma,f16c")`; it
// therefore includes nothing but vector_exp.h (as unguarded) and holds no state.

// Eight floats as a GCC/Clang vector: lowered to one AVX register under the
// AVX2 target and to two SSE (or NEON) registers on the baseline, with no
// intrinsics, so this one source serves every build.
typedef float vf8 __attribute__((vector_size(32), aligned(4), may_alias));

inline vf8 load8(const float* p) { return *reinterpret_cast<const vf8*>(p); }
inline void store8(float* p, vf8 v) { *reinterpret_cast<vf8*>(p) = v; }
inline float hsum(vf8 v) { return ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7])); }

typedef int32_t vi8 __attribute__((vector_size(32), aligned(4), may_alias));

inline vf8 splat(float x) { return vf8{} + x; }

#include "vector_exp.h"

inline vf8 exp8(vf8 x) { return exp_of<vf8, vi8>(x); }

// Micro-kernels over R query rows at once: each key or value row loaded from
// the cache serves R rows while the R partial results stay in registers.

typedef float vf4 __attribute__((vector_size(16), aligned(4), may_alias));

// hsum of four vectors at once: {hsum(a), hsum(b), hsum(c), hsum(d)}, added in
// hsum's order, so a sum does not depend on which keys were summed beside it.
inline vf4 hsum4(vf8 a, vf8 b, vf8 c, vf8 d) {
  const vf4 xa = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  const vf4 xb = __builtin_shufflevector(b, b, 0, 1, 2, 3) + __builtin_shufflevector(b, b, 4, 5, 6, 7);
  const vf4 xc = __builtin_shufflevector(c, c, 0, 1, 2, 3) + __builtin_shufflevector(c, c, 4, 5, 6, 7);
  const vf4 xd = __builtin_shufflevector(d, d, 0, 1, 2, 3) + __builtin_shufflevector(d, d, 4, 5, 6, 7);
  const vf4 ab = __builtin_shufflevector(xa, xb, 0, 4, 1, 5) + __builtin_shufflevector(xa, xb, 2, 6, 3, 7);
  const vf4 cd = __builtin_shufflevector(xc, xd, 0, 4, 1, 5) + __builtin_shufflevector(xc, xd, 2, 6, 3, 7);
  return __builtin_shufflevector(ab, cd, 0, 1, 4, 5) + __builtin_shufflevector(ab, cd, 2, 3, 6, 7);
}

// Scores of J keys from `keys` (head size a multiple of 8) for R rows: one sum
// per row and key over the head in order, then hsum, whatever R and J are.
template <int R, int J>
inline void scores_of_keys(const float* __restrict__ q, int64_t hs, const float* __restrict__ keys, int64_t k_stride,
                           float* __restrict__ out, int64_t out_stride) {
  vf8 s[R][J];
  for (int r = 0; r < R; ++r) {
    for (int i = 0; i < J; ++i) s[r][i] = vf8{};  // not `= {}`: GCC zeroes that with rep stos
  }
  for (int64_t d = 0; d < hs; d += 8) {
    vf8 k[J];
    for (int i = 0; i < J; ++i) k[i] = load8(keys + i * k_stride + d);
    for (int r = 0; r < R; ++r) {
      const vf8 qd = load8(q + r * hs + d);
      for (int i = 0; i < J; ++i) s[r][i] += qd * k[i];
    }
  }
  for (int r = 0; r < R; ++r) {
    if constexpr (J == 4) {
      const vf4 sums = hsum4(s[r][0], s[r][1], s[r][2], s[r][3]);
      __builtin_memcpy(out + r * out_stride, &sums, sizeof(sums));
    } else {
      for (int i = 0; i < J; ++i) out[r * out_stride + i] = hsum(s[r][i]);
    }
  }
}

// out[r * out_stride + j] = q_r . key_j for r < R, j < count.
template <int R>
inline void scores(const float* __restrict__ q, int64_t hs, const float* __restrict__ keys, int64_t k_stride,
                   int64_t count, float* __restrict__ out, int64_t out_stride) {
  int64_t j = 0;
  if (hs % 8 == 0) {
    constexpr int J = R <= 2 ? 4 : 2;  // R * J sums, J keys and a query vector in 16 registers
    for (; j + J <= count; j += J) {
      scores_of_keys<R, J>(q, hs, keys + j * k_stride, k_stride, out + j, out_stride);
    }
    for (; j < count; ++j) {
      scores_of_keys<R, 1>(q, hs, keys + j * k_stride, k_stride, out + j, out_stride);
    }
  }
  for (; j < count; ++j) {
    const float* k = keys + j * k_stride;
    vf8 even[R], odd[R];  // two chains per row hide the FMA latency
    for (int r = 0; r < R; ++r) even[r] = odd[r] = vf8{};
    int64_t d = 0;
    for (; d + 16 <= hs; d += 16) {
      const vf8 k0 = load8(k + d), k1 = load8(k + d + 8);
      for (int r = 0; r < R; ++r) {
        even[r] += load8(q + r * hs + d) * k0;
        odd[r] += load8(q + r * hs + d + 8) * k1;
      }
    }
    for (; d + 8 <= hs; d += 8) {
      const vf8 k0 = load8(k + d);
      for (int r = 0; r < R; ++r) even[r] += load8(q + r * hs + d) * k0;
    }
    for (int r = 0; r < R; ++r) {
      float sum = hsum(even[r] + odd[r]);
      for (int64_t t = d; t < hs; ++t) sum += q[r * hs + t] * k[t];
      out[r * out_stride + j] = sum;
    }
  }
}

// The same scores from keys transposed to kt[d * kt_stride + j] (zero-padded to
// whole vectors): vectorised across 8 * NV keys, so no horizontal sums. Pays
// off when many rows share the block (prefill), which amortises the transpose.
template <int R, int NV>
inline void scores_transposed(const float* __restrict__ q, int64_t hs, const float* __restrict__ kt,
                              int64_t kt_stride, float* __restrict__ out, int64_t out_stride) {
  vf8 s[R][NV];
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < NV; ++v) s[r][v] = vf8{};
  }
  for (int64_t d = 0; d < hs; ++d) {
    vf8 k[NV];
    for (int v = 0; v < NV; ++v) k[v] = load8(kt + d * kt_stride + 8 * v);
    for (int r = 0; r < R; ++r) {
      const float qd = q[r * hs + d];
      for (int v = 0; v < NV; ++v) s[r][v] += qd * k[v];
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < NV; ++v) store8(out + r * out_stride + 8 * v, s[r][v]);
  }
}

// Keys of a quantized cache come out dequantized: key j times scales[j * scale_stride].
template <typename K>
inline void transpose_keys(float* __restrict__ kt, int64_t kt_stride, const K* __restrict__ keys, int64_t stride,
                           int64_t count, int64_t hs, const float* scales, int64_t scale_stride) {
  for (int64_t j = 0; j < count; ++j) {
    const K* k = keys + j * stride;
    if constexpr (kScaled<K>) {
      const float scale = scales[j * scale_stride];
      for (int64_t d = 0; d < hs; ++d) kt[d * kt_stride + j] = stored_value(k[d]) * scale;
    } else {
      for (int64_t d = 0; d < hs; ++d) kt[d * kt_stride + j] = stored_value(k[d]);
    }
  }
  for (int64_t d = 0; d < hs; ++d) {
    for (int64_t j = count; j < kt_stride; ++j) kt[d * kt_stride + j] = 0.f;
  }
}

// acc_r[d, d + 8C) += sum_j weights[r * w_stride + j] * value_j[d, d + 8C) for r < R,
// the R x C sums in registers over all `count` values.
template <int R, int C>
inline void accumulate_slice(float* __restrict__ acc, int64_t hs, int64_t d, const float* __restrict__ weights,
                             int64_t w_stride, const float* __restrict__ values, int64_t v_stride, int64_t count) {
  vf8 a[R][C];
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) a[r][c] = load8(acc + r * hs + d + 8 * c);
  }
  for (int64_t j = 0; j < count; ++j) {
    vf8 v[C];
    for (int c = 0; c < C; ++c) v[c] = load8(values + j * v_stride + d + 8 * c);
    for (int r = 0; r < R; ++r) {
      const float w = weights[r * w_stride + j];
      for (int c = 0; c < C; ++c) a[r][c] += w * v[c];
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) store8(acc + r * hs + d + 8 * c, a[r][c]);
  }
}

// acc_r += sum_j weights[r * w_stride + j] * value_j for r < R: slices as wide as
// the registers hold (each value row read in as few passes as that allows), each
// sum in j order whatever the slice.
template <int R>
inline void accumulate(float* __restrict__ acc, int64_t hs, const float* __restrict__ weights, int64_t w_stride,
                       const float* __restrict__ values, int64_t v_stride, int64_t count) {
  constexpr int C = R <= 2 ? 4 : 2;  // R * C sums, C value vectors and a weight in 16 registers
  int64_t d = 0;
  for (; d + 8 * C <= hs; d += 8 * C) {
    accumulate_slice<R, C>(acc, hs, d, weights, w_stride, values, v_stride, count);
  }
  for (; d + 8 <= hs; d += 8) accumulate_slice<R, 1>(acc, hs, d, weights, w_stride, values, v_stride, count);
  for (; d < hs; ++d) {
    for (int64_t j = 0; j < count; ++j) {
      for (int r = 0; r < R; ++r) acc[r * hs + d] += weights[r * w_stride + j] * values[j * v_stride + d];
    }
  }
}
