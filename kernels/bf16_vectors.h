// Sixteen-lane float vectors, their sums and bfloat16 conversions, shared by
// the bfloat16 kernels (linear.cpp, rms_norm_rotary.cpp) and the int8 ones
// (int8_linear.cpp). GCC vector types: one zmm
// register under AVX-512, two ymm under AVX2, four SSE registers on the
// baseline, from one source. Included once per ISA namespace; it includes
// nothing but vector_exp.h (as unguarded).

typedef float vf16 __attribute__((vector_size(64), aligned(4), may_alias));
typedef int32_t vi16 __attribute__((vector_size(64), aligned(4), may_alias));
typedef uint32_t vu16 __attribute__((vector_size(64), aligned(4), may_alias));
typedef uint16_t vh16 __attribute__((vector_size(32), aligned(2), may_alias));

inline float bf16_to_float(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  __builtin_memcpy(&f, &bits, 4);
  return f;
}

// Round to nearest even, as torch's float -> bfloat16; NaN stays a quiet NaN.
inline uint16_t float_to_bf16(float f) {
  uint32_t bits;
  __builtin_memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  return static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

// One float32 or bfloat16 (raw bits) value as float32, and back: the row
// kernels' tails, one overload per dtype.
inline float load1(const float* p) { return *p; }
inline float load1(const uint16_t* p) { return bf16_to_float(*p); }
inline void store1(float* p, float v) { *p = v; }
inline void store1(uint16_t* p, float v) { *p = float_to_bf16(v); }

// bfloat16 bits at p as floats, and float_to_bf16 on every lane, for a float
// vector VF of any width with its uint32 and uint16 twins VU and VH (the
// sixteen-lane ones below; native_vectors.h's vw). A template argument loses
// the types' aligned(4) and aligned(2), so memory goes through memcpy: p need
// not be aligned to the vector.
template <typename VF, typename VU, typename VH>
inline VF load_bf16_lanes(const uint16_t* p) {
  VH half;
  __builtin_memcpy(&half, p, sizeof half);
  const VU bits = __builtin_convertvector(half, VU) << 16;
  VF v;
  __builtin_memcpy(&v, &bits, sizeof v);
  return v;
}

template <typename VF, typename VU, typename VH>
inline void store_bf16_lanes(uint16_t* p, VF v) {
  VU bits;
  __builtin_memcpy(&bits, &v, sizeof bits);
  const VU rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  // All ones in a NaN's lane: its magnitude lies above infinity's, so the
  // difference wraps and its top bit is set. Shifts and masks, not a compare
  // and select, which at sixteen lanes on AVX2 the compiler turns into scalar
  // code.
  const VU nan = VU{} - ((0x7f800000u - (bits & 0x7fffffffu)) >> 31);
  const VH half = __builtin_convertvector((rounded & ~nan) | (nan & 0x7fc0u), VH);
  __builtin_memcpy(p, &half, sizeof half);
}

inline vf16 load_bf16x16(const uint16_t* p) { return load_bf16_lanes<vf16, vu16, vh16>(p); }
inline void store_bf16x16(uint16_t* p, vf16 v) { store_bf16_lanes<vf16, vu16, vh16>(p, v); }

// The sum of v's lanes as a tree: four shuffles and additions, where a loop
// over the lanes is a chain of 16 dependent scalar additions (GCC keeps it).
inline float sum16(vf16 v) {
  v += __builtin_shuffle(v, vi16{8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
  v += __builtin_shuffle(v, vi16{4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11});
  v += __builtin_shuffle(v, vi16{2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13});
  v += __builtin_shuffle(v, vi16{1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14});
  return v[0];
}

// Sixteen vectors' sums at once: lane i of the result is the sum of v[i]'s
// lanes. Each level adds two shuffles of a pair of vectors, halving the
// vectors and doubling how much of a sum each lane holds (15 additions in
// all, where sum16 per vector takes 64).
inline vf16 fold16(const vf16 (&v)[16]) {
  // level 1: lane 2j + p holds v[2i + p]'s lanes 2j, 2j + 1
  vf16 t[8];
  for (int i = 0; i < 8; ++i) {
    t[i] = __builtin_shuffle(v[2 * i], v[2 * i + 1], vi16{0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30}) +
           __builtin_shuffle(v[2 * i], v[2 * i + 1], vi16{1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31});
  }
  // level 2: lane 4j + c holds v[4i + c]'s lanes 4j .. 4j + 3
  vf16 u[4];
  for (int i = 0; i < 4; ++i) {
    u[i] = __builtin_shuffle(t[2 * i], t[2 * i + 1], vi16{0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29}) +
           __builtin_shuffle(t[2 * i], t[2 * i + 1], vi16{2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31});
  }
  // level 3: lane 8j + c holds v[8i + c]'s lanes 8j .. 8j + 7
  vf16 w[2];
  for (int i = 0; i < 2; ++i) {
    w[i] = __builtin_shuffle(u[2 * i], u[2 * i + 1], vi16{0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27}) +
           __builtin_shuffle(u[2 * i], u[2 * i + 1], vi16{4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31});
  }
  // level 4: lane c holds all of v[c]
  return __builtin_shuffle(w[0], w[1], vi16{0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23}) +
         __builtin_shuffle(w[0], w[1], vi16{8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31});
}

#include "vector_exp.h"

// e^x on sixteen lanes, for SiLU.
inline vf16 exp16(vf16 x) { return exp_of<vf16, vi16>(x); }
