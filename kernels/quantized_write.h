// kvforge_cpp::write_quantized_kv: quantize each token's keys and values per KV
// head and store data and scale at its slot, for the built-in absmax formats
// only (kvforge.plugins.quantizers: int8 round-to-nearest within +-127,
// float8_e4m3fn within +-448, float8_e5m2 within +-57344). The backend calls it
// only for those quantizers; tests/test_attention_cpp_quantized.py proves its
// output bit-identical to theirs. Any other quantizer goes through Python.
//
// Included once by paged_attention.cpp, after its includes, inside namespace
// kvforge_cpp.

// Every step as the Python quantizer takes it, in float32: amax / max_value
// (a division), at least the smallest normal float, 1 for an all-zero group;
// x / scale (a division again: a multiply by the reciprocal would round
// differently), int8 rounded half to even, clamped, converted. The rounding adds
// and takes away 1.5 * 2^23, which leaves the nearest integer (ties to even)
// for |v| < 2^22, and |v| stays within a rounding step of 127 here; unlike
// nearbyint, a library call on the baseline ISA, it vectorises (figures:
// docs/cpp_backend.md, "write_kv").
template <typename Out, typename In>
inline void quantize_head(const In* __restrict__ x, int64_t n, float max_value, Out* __restrict__ data,
                          float* scale_out) {
  float amax = 0.f;
  for (int64_t d = 0; d < n; ++d) amax = std::max(amax, std::abs(static_cast<float>(x[d])));
  float scale = amax / max_value;
  scale = amax > 0.f ? std::max(scale, std::numeric_limits<float>::min()) : 1.f;
  for (int64_t d = 0; d < n; ++d) {
    float v = static_cast<float>(x[d]) / scale;
    if constexpr (std::is_same_v<Out, int8_t>) {
      constexpr float kRound = 12582912.f;  // 1.5 * 2^23
      v = (v + kRound) - kRound;
    }
    v = std::min(std::max(v, -max_value), max_value);
    data[d] = static_cast<Out>(v);
  }
  *scale_out = scale;
}

template <typename In>
inline bool all_finite(const at::Tensor& t) {
  const In* p = t.data_ptr<In>();
  bool finite = true;
  for (int64_t i = 0, n = t.numel(); i < n; ++i) finite &= std::isfinite(static_cast<float>(p[i]));
  return finite;
}

void write_quantized_kv(const at::Tensor& key, const at::Tensor& value, const at::Tensor& kv_data,
                        const at::Tensor& kv_scales, const at::Tensor& slot_mapping) {
  check_cache_layout(kv_data);
  check_scales(kv_scales, kv_data);
  const auto storage = kv_data.scalar_type();
  TORCH_CHECK(is_quantized_kv_dtype(storage), "kvforge_cpp: write_quantized_kv stores ", kQuantizedKvDtypes,
              ", got a ", storage, " cache");
  const int64_t num_blocks = kv_data.size(0), block_size = kv_data.size(2);
  const int64_t heads = kv_data.size(3), hs = kv_data.size(4);
  TORCH_CHECK(key.sizes() == value.sizes() && key.dim() == 3 && key.size(1) == heads && key.size(2) == hs,
              "kvforge_cpp: key and value must both be [num_tokens, ", heads, ", ", hs, "], got ", key.sizes(),
              " and ", value.sizes());
  const auto dtype = key.scalar_type();
  TORCH_CHECK(value.scalar_type() == dtype && (dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16),
              "kvforge_cpp: key and value must share one of float32, float16, bfloat16");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 && slot_mapping.size(0) == key.size(0),
              "kvforge_cpp: slot_mapping must be int64 [num_tokens]");
  TORCH_CHECK(key.device().is_cpu() && value.device().is_cpu() && kv_data.device().is_cpu() &&
                  slot_mapping.device().is_cpu(),
              "kvforge_cpp: tensors must be on the CPU");
  const at::Tensor k = key.contiguous(), v = value.contiguous(), slots = slot_mapping.contiguous();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t num_tokens = key.size(0);
  // Validate everything first: a bad slot or a NaN must not leave half a write.
  for (int64_t t = 0; t < num_tokens; ++t) {
    TORCH_CHECK(slot[t] >= -1 && slot[t] < num_blocks * block_size, "kvforge_cpp: slot_mapping[", t, "] = ", slot[t],
                " is outside the cache's ", num_blocks * block_size, " slots (-1 means skip)");
  }
  bool finite = true;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "write_quantized_kv", [&] {
    finite = all_finite<scalar_t>(k) && all_finite<scalar_t>(v);
  });
  TORCH_CHECK(finite, "kvforge_cpp: write_quantized_kv was given NaN or infinite keys or values");

  const float max_value = storage == at::kChar ? 127.f : storage == at::ScalarType::Float8_e4m3fn ? 448.f : 57344.f;
  const int64_t element = kv_data.element_size();
  auto* data = static_cast<char*>(kv_data.data_ptr());
  auto* scales = static_cast<char*>(kv_scales.data_ptr());
  const int64_t data_block = kv_data.stride(0) * element, scale_block = kv_scales.stride(0) * int64_t{sizeof(float)};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "write_quantized_kv", [&] {
    const scalar_t* sources[2] = {k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>()};
    at::parallel_for(0, num_tokens, 64, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        if (slot[t] < 0) continue;
        const int64_t block = slot[t] / block_size, offset = slot[t] % block_size;
        for (int64_t kv = 0; kv < 2; ++kv) {
          const int64_t row = (kv * block_size + offset) * heads;  // the slot's first head, in elements
          char* dst = data + block * data_block + row * hs * element;
          float* scale = reinterpret_cast<float*>(scales + block * scale_block) + row;
          for (int64_t h = 0; h < heads; ++h) {
            const scalar_t* x = sources[kv] + (t * heads + h) * hs;
            switch (storage) {
              case at::kChar:
                quantize_head(x, hs, max_value, reinterpret_cast<int8_t*>(dst) + h * hs, scale + h);
                break;
              case at::ScalarType::Float8_e4m3fn:
                quantize_head(x, hs, max_value, reinterpret_cast<c10::Float8_e4m3fn*>(dst) + h * hs, scale + h);
                break;
              default:
                quantize_head(x, hs, max_value, reinterpret_cast<c10::Float8_e5m2*>(dst) + h * hs, scale + h);
                break;
            }
          }
        }
      }
    });
  });
}
