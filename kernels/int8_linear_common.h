// What the int8 linear ops (int8_linear.cpp, int8_packed_linear.cpp,
// int8_dynamic_linear.cpp) share: how far ahead a decode's tiles fetch the
// weight, the packed weight layout, where the weight-only op widens the weight
// once per call, and the argument checks.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace kvforge_cpp {

// How far ahead of its reads a channel-by-channel tile (a decode's) asks for
// weights, in bytes: the channels lie one after another, so this is the same
// stream further on, reaching into the next channels (past the weight's end a
// prefetch is dropped: it never faults). The hardware prefetcher alone kept a
// batch-1 decode at half the bandwidth a float32 one reads at (docs/quantization.md).
constexpr int64_t kWeightsAhead = 8192;

// Output channels per block of the packed weight-only layout, as
// int8_pack_weight writes it: int8 [ceil(out / 64), in, 64], channel 64 b + c's
// input d at [b][d][c], the rest of the last block zero. One 64-byte line is
// one input of 64 channels, so a decode reads each block as one stream and
// sums 16 channels per vector lane by lane (int8_packed_tile.h).
constexpr int64_t kPackChannels = 64;

// Rows from which float32 rows take the dequantizing path (int8_linear.cpp).
// The tiles widen every weight again for each group of rows; the widening
// there is paid once per call, which from 32 rows on measured as fast or
// faster (docs/quantization.md).
constexpr int64_t kDequantizeRows = 32;
// Widened weights per channel group: each 64-row chunk of x, in L2, passes over
// a whole group before the next chunk (one 64-channel block at a time re-read
// x from L3 for every block).
constexpr int64_t kDequantizedBytes = 1 << 20;
// The same for bfloat16 rows on AVX-512 BF16 (the 8 x 2 tiles widen one
// weight vector per 8 rows; with whole blocks widened in registers
// (widen_block16_bf16), widening once measured as fast from 64 rows and faster
// from 128).
constexpr int64_t kWidenBf16Rows = 64;

// Output channels per group when each takes `channel_bytes` widened: about
// kDequantizedBytes a group, the number of groups a multiple of the threads
// (each thread then widens and runs as many), a multiple of `multiple` channels
// (16, or a packed weight's kPackChannels).
inline int64_t channel_group(int64_t n, int64_t channel_bytes, int64_t multiple = 16) {
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  int64_t groups = std::max<int64_t>(1, (n * channel_bytes + kDequantizedBytes - 1) / kDequantizedBytes);
  groups = (groups + threads - 1) / threads * threads;
  return ((n + groups - 1) / groups + multiple - 1) / multiple * multiple;
}

// Calls run(n0, n1, scale, bias) for the output channels in groups of `group`
// (a multiple of 16, channel_group), groups in parallel; scale and bias are the
// group's values padded with zeros to `group` (bias null without one).
template <typename Run>
void in_channel_groups(int64_t n, int64_t group, const float* scale, const float* bias, Run&& run) {
  at::parallel_for(0, (n + group - 1) / group, 1, [&](int64_t g0, int64_t g1) {
    std::vector<float> group_scale(group), group_bias(group);
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t n0 = g * group, n1 = std::min(n, n0 + group);
      std::fill(std::copy(scale + n0, scale + n1, group_scale.begin()), group_scale.end(), 0.f);
      if (bias != nullptr) std::fill(std::copy(bias + n0, bias + n1, group_bias.begin()), group_bias.end(), 0.f);
      run(n0, n1, group_scale.data(), bias != nullptr ? group_bias.data() : nullptr);
    }
  });
}

// The weight-only op over a weight packed by int8_pack_weight
// (int8_packed_linear.cpp); int8_weight_linear hands a 3-D weight to it.
// `mode`: epilogue_mode's.
at::Tensor int8_packed_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                              const std::optional<at::Tensor>& bias, int mode, const std::optional<at::Tensor>& other);

// The epilogues the int8 ops share with the packed linears (linear.cpp):
// epilogue_mode reads a name ("none" 0, "add" 1, "silu_mul" 2; `op` names the
// caller in the error), and finish_rows takes an op's outputs with its scales
// and bias applied (`sums` [m, width], float32 or bfloat16) through the
// packed linears' epilogue code into its result, an [m, n] tensor of
// `out_dtype`: "none" only converts them (`sums` itself when of that dtype),
// "add" adds `other` ([m, n] of `out_dtype`, a residual), "silu_mul" reads
// gate and up as alternating blocks of 16 channels (n = width / 2). With
// float32 sums the result is rounded once, at the end. It checks `other`
// (absent unless "add").
int epilogue_mode(const char* op, const std::string& name);
at::Tensor finish_rows(const char* op, const at::Tensor& sums, int mode, const std::optional<at::Tensor>& other,
                       at::ScalarType out_dtype);
// finish_rows for an op that makes its float32 sums a row at a time (W8A8's
// rescale), so that no [m, width] tensor of them is written and read back:
// rows in parallel, `row_sums(r, buffer)` returns row r's `width` sums, written
// into `buffer` (whole blocks of 16, zeros past `width`) or found elsewhere.
// Epilogues "add" and "silu_mul" (mode 1 or 2).
at::Tensor finish_each_row(const char* op, int64_t m, int64_t width, int mode, const std::optional<at::Tensor>& other,
                           at::ScalarType out_dtype, const std::function<const float*(int64_t, float*)>& row_sums);

// x float32 or bfloat16 [rows, in], weight a contiguous int8 [out, in], one
// float32 scale per output channel, an optional float bias of one value per
// channel. `op` names the op in the messages.

inline void check_int8_linear_inputs(const char* op, const at::Tensor& x, const at::Tensor& weight,
                                     const at::Tensor& scale, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu() && scale.device().is_cpu(), op,
              ": tensors must be on the CPU (move them, or use the widened path of Int8Linear on other devices)");
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16), op,
              ": x must be a 2-D float32 or bfloat16 tensor [rows, in], got ", x.scalar_type(), " ", x.sizes());
  if (weight.dim() == 3) {  // packed (int8_pack_weight): out is the scales' count
    const int64_t out = scale.numel();
    TORCH_CHECK(weight.scalar_type() == at::kChar && weight.is_contiguous() && weight.size(2) == kPackChannels &&
                    weight.size(0) == (out + kPackChannels - 1) / kPackChannels,
                op, ": a packed weight must be the contiguous int8 [ceil(out / ", kPackChannels, "), in, ",
                kPackChannels, "] that int8_pack_weight returns for the ", out, " output channels the scale has, got ",
                weight.scalar_type(), " ", weight.sizes());
    TORCH_CHECK(weight.size(1) == x.size(1), op, ": x has ", x.size(1), " input features but the weight ",
                weight.size(1));
    TORCH_CHECK(scale.scalar_type() == at::kFloat, op, ": scale must be float32, got ", scale.scalar_type());
    if (bias.has_value()) {
      TORCH_CHECK(bias->numel() == out && bias->is_floating_point(), op, ": bias must be a float tensor of ", out,
                  " values (one per output channel), got ", bias->scalar_type(), " ", bias->sizes());
    }
    return;
  }
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
