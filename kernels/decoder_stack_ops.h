// The C++ entry functions of kvforge's kernels, as the other sources define
// them (linear.cpp, rms_norm_rotary.cpp, int8_linear.cpp,
// int8_dynamic_linear.cpp, paged_attention.cpp, greedy_rows.cpp,
// sample_rows.cpp): what decoder_stack.cpp calls directly, without the
// dispatcher, so a layer run there computes exactly what the per-layer torch
// ops compute. A change of one of these signatures must be made here too (the
// library then fails to link, not to compute).

#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <string>
#include <vector>

namespace kvforge_cpp {

at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                       const std::optional<at::Tensor>& bias, const std::string& epilogue,
                       const std::optional<at::Tensor>& other, bool float_out);
at::Tensor f32_linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                      const std::optional<at::Tensor>& bias, const std::string& epilogue,
                      const std::optional<at::Tensor>& other);
at::Tensor int8_weight_linear(const at::Tensor& x_in, const at::Tensor& weight, const at::Tensor& scale_in,
                              const std::optional<at::Tensor>& bias_in, const std::string& epilogue,
                              const std::optional<at::Tensor>& other);
at::Tensor int8_dynamic_linear(const at::Tensor& x_in, const at::Tensor& weight, const at::Tensor& scale_in,
                               const std::optional<at::Tensor>& bias_in, const std::string& epilogue,
                               const std::optional<at::Tensor>& other);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
void paged_attention(const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& query_start_loc,
                     const at::Tensor& seq_lens, const at::Tensor& context_lens, const at::Tensor& block_table,
                     double scale, int64_t sliding_window, double logit_soft_cap,
                     const std::optional<at::Tensor>& alibi_slopes, const at::Tensor& out,
                     const std::optional<at::Tensor>& kv_scales, bool batch_invariant);
void write_kv(const at::Tensor& key, const at::Tensor& value, const at::Tensor& kv_cache,
              const at::Tensor& slot_mapping);
std::vector<int64_t> greedy_rows(const at::Tensor& logits);
std::vector<int64_t> sample_rows(const at::Tensor& logits, at::ArrayRef<double> temperature,
                                 at::ArrayRef<int64_t> top_k, at::ArrayRef<double> top_p,
                                 at::ArrayRef<double> min_p, const at::Tensor& u);

}  // namespace kvforge_cpp
