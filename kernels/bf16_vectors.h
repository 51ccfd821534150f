// Sixteen-lane float vectors and bfloat16 conversions shared by the bfloat16
// kernels (linear.cpp, rms_norm_rotary.cpp). GCC vector types: one zmm
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

inline vf16 load_bf16x16(const uint16_t* p) {
  const vu16 bits = __builtin_convertvector(*reinterpret_cast<const vh16*>(p), vu16) << 16;
  return reinterpret_cast<const vf16&>(bits);
}

// float_to_bf16 on sixteen lanes.
inline void store_bf16x16(uint16_t* p, vf16 v) {
  const vu16 bits = reinterpret_cast<const vu16&>(v);
  const vu16 rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  const vu16 nan = (bits & 0x7fffffffu) > 0x7f800000u;
  *reinterpret_cast<vh16*>(p) = __builtin_convertvector(nan ? vu16{} + 0x7fc0u : rounded, vh16);
}

inline float sum16(vf16 v) {
  float s = 0.f;
  for (int i = 0; i < 16; ++i) s += v[i];
  return s;
}

#include "vector_exp.h"

// e^x on sixteen lanes, for SiLU.
inline vf16 exp16(vf16 x) { return exp_of<vf16, vi16>(x); }
