// Row kernels of RMSNorm and rotary embeddings (rms_norm_rotary.cpp) for
// float32 and bfloat16 rows, float32 math inside. Included once per ISA
// namespace after bf16_vectors.h (load1, store1) and native_vectors.h (vw,
// kW, loadw, storew, load_bf16w, store_bf16w); it includes nothing itself.


// v as the row's own dtype would hold it: bfloat16 rounds, float32 is as is.
inline float as_stored(float v, const float*) { return v; }
inline float as_stored(float v, const uint16_t*) { return bf16_to_float(float_to_bf16(v)); }
inline vw as_storedw(vw v, const float*) { return v; }
inline vw as_storedw(vw v, const uint16_t*) {
  alignas(64) uint16_t h[kW];
  store_bf16w(h, v);
  return load_bf16w(h);
}

// y = (x * rsqrt(mean(x^2) + eps)) * w in Hugging Face's rounding order: the
// normalised row takes the row's dtype before the weight multiplies it. The
// squares are summed in sixteen lanes on every ISA (the same bits everywhere),
// held as 16 / kW native vectors: a vf16 sum under AVX2 would live in memory.
template <typename T>
inline void rms_norm_row(const T* __restrict__ x, const T* __restrict__ w, int64_t d, float eps,
                         T* __restrict__ y) {
  constexpr int kParts = 16 / kW;
  vw acc[kParts] = {};
  int64_t i = 0;
  for (; i + 16 <= d; i += 16) {
    for (int p = 0; p < kParts; ++p) {
      const vw v = loadw(x + i + p * kW);
      acc[p] += v * v;
    }
  }
  vf16 lanes;
  __builtin_memcpy(&lanes, acc, sizeof lanes);
  float squares = sum16(lanes);
  for (; i < d; ++i) squares += load1(x + i) * load1(x + i);
  const float scale = 1.0f / std::sqrt(squares / static_cast<float>(d) + eps);
  for (i = 0; i + kW <= d; i += kW) storew(y + i, as_storedw(loadw(x + i) * scale, x) * loadw(w + i));
  for (; i < d; ++i) store1(y + i, as_stored(load1(x + i) * scale, x) * load1(w + i));
}

// The rotate-half rotation of one head of `2 * half` values by one position's
// cos and sin (float32, `half` each): out1 = x1 c - x2 s, out2 = x2 c + x1 s.
// Sixteen values a step as 16 / kW native vectors, the tail one at a time.
template <typename T>
inline void rotary_row(const T* __restrict__ x, const float* __restrict__ cos, const float* __restrict__ sin,
                       int64_t half, T* __restrict__ out) {
  int64_t j = 0;
  for (; j + 16 <= half; j += 16) {
    for (int64_t k = j; k < j + 16; k += kW) {
      const vw x1 = loadw(x + k), x2 = loadw(x + half + k);
      const vw c = loadw(cos + k), s = loadw(sin + k);
      storew(out + k, x1 * c - x2 * s);
      storew(out + half + k, x2 * c + x1 * s);
    }
  }
  for (; j < half; ++j) {
    const float x1 = load1(x + j), x2 = load1(x + half + j);
    store1(out + j, x1 * cos[j] - x2 * sin[j]);
    store1(out + half + j, x2 * cos[j] + x1 * sin[j]);
  }
}
