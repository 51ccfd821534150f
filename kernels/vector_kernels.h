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

// out[r * out_stride + j] = q_r . key_j for r < R, j < count.
template <int R>
inline void scores(const float* __restrict__ q, int64_t hs, const float* __restrict__ keys, int64_t k_stride,
                   int64_t count, float* __restrict__ out, int64_t out_stride) {
  for (int64_t j = 0; j < count; ++j) {
    const float* k = keys + j * k_stride;
    vf8 even[R], odd[R];  // two chains per row hide the FMA latency
    for (int r = 0; r < R; ++r) even[r] = odd[r] = vf8{};  // not `= {}`: GCC zeroes that with rep stos
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

// acc_r += sum_j weights[r * w_stride + j] * value_j for r < R.
template <int R>
inline void accumulate(float* __restrict__ acc, int64_t hs, const float* __restrict__ weights, int64_t w_stride,
                       const float* __restrict__ values, int64_t v_stride, int64_t count) {
  int64_t d = 0;
  for (; d + 16 <= hs; d += 16) {  // two vectors per row: each broadcast weight feeds two FMAs
    vf8 a[R], b[R];
    for (int r = 0; r < R; ++r) {
      a[r] = load8(acc + r * hs + d);
      b[r] = load8(acc + r * hs + d + 8);
    }
    for (int64_t j = 0; j < count; ++j) {
      const vf8 v0 = load8(values + j * v_stride + d), v1 = load8(values + j * v_stride + d + 8);
      for (int r = 0; r < R; ++r) {
        const float w = weights[r * w_stride + j];
        a[r] += w * v0;
        b[r] += w * v1;
      }
    }
    for (int r = 0; r < R; ++r) {
      store8(acc + r * hs + d, a[r]);
      store8(acc + r * hs + d + 8, b[r]);
    }
  }
  for (; d + 8 <= hs; d += 8) {
    vf8 a[R];
    for (int r = 0; r < R; ++r) a[r] = load8(acc + r * hs + d);
    for (int64_t j = 0; j < count; ++j) {
      const vf8 v = load8(values + j * v_stride + d);
      for (int r = 0; r < R; ++r) a[r] += weights[r * w_stride + j] * v;
    }
    for (int r = 0; r < R; ++r) store8(acc + r * hs + d, a[r]);
  }
  for (; d < hs; ++d) {
    for (int64_t j = 0; j < count; ++j) {
      for (int r = 0; r < R; ++r) acc[r * hs + d] += weights[r * w_stride + j] * values[j * v_stride + d];
    }
  }
}
