// Sixteen-lane float vectors and bfloat16 conversions shared by the bfloat16
// kernels (bf16_linear.cpp, rms_norm_rotary.cpp). GCC vector types: one zmm
// register under AVX-512, two ymm under AVX2, four SSE registers on the
// baseline, from one source. Included once per ISA namespace; it includes
// nothing itself.

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

// e^x lane by lane (Cephes' expf: range reduction by ln 2, degree-6
// polynomial, about 1 ulp), for SiLU. vector_kernels.h has the same for the
// attention's eight-lane vectors, but it needs the attention's own definitions
// around it; x is clamped to [-87.3, 88], where e^x stays a normal float.
inline vf16 exp16(vf16 x) {
  x = x > 88.0f ? vf16{} + 88.0f : x;
  x = x < -87.3f ? vf16{} - 87.3f : x;
  const vf16 fx = x * 1.44269504088896341f + 0.5f;
  vi16 n = __builtin_convertvector(fx, vi16);  // rounds toward zero ...
  n = __builtin_convertvector(n, vf16) > fx ? n - 1 : n;  // ... so step down to floor
  const vf16 nf = __builtin_convertvector(n, vf16);
  const vf16 z = (x - nf * 0.693359375f) - nf * -2.12194440e-4f;
  vf16 p = vf16{} + 1.9875691500e-4f;
  p = p * z + 1.3981999507e-3f;
  p = p * z + 8.3334519073e-3f;
  p = p * z + 4.1665795894e-2f;
  p = p * z + 1.6666665459e-1f;
  p = p * z + 5.0000001201e-1f;
  p = p * (z * z) + z + 1.0f;
  const vi16 scale_bits = (n + 127) << 23;  // 2^n as float bits
  return p * reinterpret_cast<const vf16&>(scale_bits);
}
