// Row kernels of RMSNorm and rotary embeddings (rms_norm_rotary.cpp) for
// float32 and bfloat16 rows, float32 math inside. Included once per ISA
// namespace after bf16_vectors.h; it includes nothing itself.

inline float load1(const float* p) { return *p; }
inline float load1(const uint16_t* p) { return bf16_to_float(*p); }
inline vf16 load16(const float* p) { return *reinterpret_cast<const vf16*>(p); }
inline vf16 load16(const uint16_t* p) { return load_bf16x16(p); }
inline void store1(float* p, float v) { *p = v; }
inline void store1(uint16_t* p, float v) { *p = float_to_bf16(v); }
inline void store16(float* p, vf16 v) { *reinterpret_cast<vf16*>(p) = v; }
inline void store16(uint16_t* p, vf16 v) { store_bf16x16(p, v); }

// v as the row's own dtype would hold it: bfloat16 rounds, float32 is as is.
inline float as_stored(float v, const float*) { return v; }
inline float as_stored(float v, const uint16_t*) { return bf16_to_float(float_to_bf16(v)); }
inline vf16 as_stored16(vf16 v, const float*) { return v; }
inline vf16 as_stored16(vf16 v, const uint16_t*) {
  alignas(64) uint16_t h[16];
  store_bf16x16(h, v);
  return load_bf16x16(h);
}

// y = (x * rsqrt(mean(x^2) + eps)) * w in Hugging Face's rounding order: the
// normalised row takes the row's dtype before the weight multiplies it.
template <typename T>
inline void rms_norm_row(const T* __restrict__ x, const T* __restrict__ w, int64_t d, float eps,
                         T* __restrict__ y) {
  vf16 acc = vf16{};
  int64_t i = 0;
  for (; i + 16 <= d; i += 16) {
    const vf16 v = load16(x + i);
    acc += v * v;
  }
  float squares = sum16(acc);
  for (; i < d; ++i) squares += load1(x + i) * load1(x + i);
  const float scale = 1.0f / std::sqrt(squares / static_cast<float>(d) + eps);
  for (i = 0; i + 16 <= d; i += 16) store16(y + i, as_stored16(load16(x + i) * scale, x) * load16(w + i));
  for (; i < d; ++i) store1(y + i, as_stored(load1(x + i) * scale, x) * load1(w + i));
}

// The rotate-half rotation of one head of `2 * half` values by one position's
// cos and sin (float32, `half` each): out1 = x1 c - x2 s, out2 = x2 c + x1 s.
template <typename T>
inline void rotary_row(const T* __restrict__ x, const float* __restrict__ cos, const float* __restrict__ sin,
                       int64_t half, T* __restrict__ out) {
  int64_t j = 0;
  for (; j + 16 <= half; j += 16) {
    const vf16 x1 = load16(x + j), x2 = load16(x + half + j);
    const vf16 c = *reinterpret_cast<const vf16*>(cos + j), s = *reinterpret_cast<const vf16*>(sin + j);
    store16(out + j, x1 * c - x2 * s);
    store16(out + half + j, x2 * c + x1 * s);
  }
  for (; j < half; ++j) {
    const float x1 = load1(x + j), x2 = load1(x + half + j);
    store1(out + j, x1 * cos[j] - x2 * sin[j]);
    store1(out + half + j, x2 * cos[j] + x1 * sin[j]);
  }
}
