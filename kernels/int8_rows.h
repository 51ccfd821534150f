// The row-wise parts of W8A8 (int8_dynamic_linear.cpp): each activation row
// rounded to int8 with its own absmax scale, and the int32 sums of the int8
// GEMM turned back into float outputs. The same arithmetic as
// `quantize_rows` and `_int8_gemm` in models/quantized_linear.py, operation
// for operation, so both give the same bits.
//
// Included once per ISA namespace after bf16_vectors.h (vf16, vi16,
// load_bf16x16, store_bf16x16, load1, store1); it includes
// nothing, and ends with that namespace's kRowKernels (Int8RowKernels, declared
// in int8_dynamic_linear.cpp).

// Adding and then subtracting 1.5 * 2^23 rounds a float below 2^22 in
// magnitude to the nearest integer, ties to even, as torch.round does (the
// quantized values lie within [-127, 127]). The build has no -ffast-math,
// which could fold the two away.
constexpr float kRoundToEven = 12582912.f;
constexpr float kInt8Max = 127.f;

inline vf16 load16(const float* p) { return *reinterpret_cast<const vf16*>(p); }
inline vf16 load16(const uint16_t* p) { return load_bf16x16(p); }
inline void store16(float* p, vf16 v) { *reinterpret_cast<vf16*>(p) = v; }
inline void store16(uint16_t* p, vf16 v) { store_bf16x16(p, v); }

// The bits of |v|. For non-negative floats their order as integers is the
// float order, and every NaN's bits lie above infinity's.
inline int32_t magnitude_bits(float v) {
  int32_t bits;
  __builtin_memcpy(&bits, &v, 4);
  return bits & 0x7fffffff;
}

// The largest |x_i| of a row, NaN if any x_i is NaN (a NaN row then gives NaN
// outputs, as the torch path does, never finite garbage): the integer max of
// magnitude_bits, which the compiler vectorises (a float compare-and-select
// that keeps NaN would not be).
template <typename T>
inline float row_absmax(const T* x, int64_t k) {
  int32_t top = 0;
  for (int64_t i = 0; i < k; ++i) top = std::max(top, magnitude_bits(load1(x + i)));
  float absmax;
  __builtin_memcpy(&absmax, &top, 4);
  return absmax;
}

// q = round(x / scale) with scale = max(absmax / 127, tiny) (a zero row gives
// zeros and a positive scale); returns the scale. A plain loop: the compiler
// vectorises it, narrowing the int32 lanes to bytes with packs.
template <typename T>
inline float quantize_row(const T* x, int64_t k, int8_t* q, float tiny) {
  const float absmax = row_absmax(x, k) / kInt8Max;
  const float scale = absmax < tiny ? tiny : absmax;  // NaN stays NaN
  for (int64_t i = 0; i < k; ++i) {
    q[i] = static_cast<int8_t>(static_cast<int32_t>((load1(x + i) / scale + kRoundToEven) - kRoundToEven));
  }
  return scale;
}

// out = acc * row_scale * scale[n] (+ bias[n]), in float32, then stored as T
// (bfloat16 rounds once, after the bias). Each operation rounds on its own, as
// torch's do: no fused multiply-add of the last product and the bias.
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
template <typename T>
inline void rescale_row(const int32_t* acc, int64_t n, float row_scale, const float* scale, const float* bias,
                        T* out) {
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    vf16 v = __builtin_convertvector(*reinterpret_cast<const vi16*>(acc + j), vf16) * row_scale * load16(scale + j);
    if (bias != nullptr) v += load16(bias + j);
    store16(out + j, v);
  }
  for (; j < n; ++j) {
    float v = static_cast<float>(acc[j]) * row_scale * scale[j];
    if (bias != nullptr) v += bias[j];
    store1(out + j, v);
  }
}
#pragma GCC pop_options

constexpr Int8RowKernels kRowKernels{&quantize_row<float>, &quantize_row<uint16_t>, &rescale_row<float>,
                                     &rescale_row<uint16_t>};
