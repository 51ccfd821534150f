// What the two int8 linear ops (int8_linear.cpp, int8_dynamic_linear.cpp)
// share: how far ahead a decode's tiles fetch the weight, and the argument
// checks.
#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace kvforge_cpp {

// How far ahead of its reads a channel-by-channel tile (a decode's) asks for
// weights, in bytes: the channels lie one after another, so this is the same
// stream further on, reaching into the next channels (past the weight's end a
// prefetch is dropped: it never faults). The hardware prefetcher alone kept a
// batch-1 decode at half the bandwidth a float32 one reads at (docs/quantization.md).
constexpr int64_t kWeightsAhead = 8192;

// x float32 or bfloat16 [rows, in], weight a contiguous int8 [out, in], one
// float32 scale per output channel, an optional float bias of one value per
// channel. `op` names the op in the messages.

inline void check_int8_linear_inputs(const char* op, const at::Tensor& x, const at::Tensor& weight,
                                     const at::Tensor& scale, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu() && scale.device().is_cpu(), op,
              ": tensors must be on the CPU (move them, or use the widened path of Int8Linear on other devices)");
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16), op,
              ": x must be a 2-D float32 or bfloat16 tensor [rows, in], got ", x.scalar_type(), " ", x.sizes());
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kChar && weight.is_contiguous(), op,
              ": weight must be a contiguous int8 [out, in], got ", weight.scalar_type(), " ", weight.sizes(),
              weight.is_contiguous() ? "" : " (not contiguous)");
  TORCH_CHECK(weight.size(1) == x.size(1), op, ": x has ", x.size(1), " input features but the weight ",
              weight.size(1));
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == weight.size(0), op,
              ": scale must be float32 with one value per output channel (", weight.size(0), "), got ",
              scale.scalar_type(), " ", scale.sizes());
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == weight.size(0) && bias->is_floating_point(), op, ": bias must be a float tensor of ",
                weight.size(0), " values (one per output channel), got ", bias->scalar_type(), " ", bias->sizes());
  }
}

}  // namespace kvforge_cpp
