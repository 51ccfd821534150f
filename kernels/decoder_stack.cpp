// A Llama-family model's decoder layers for one step, in C++: a torch custom
// class that holds each layer's weights (registered once at load by
// models/cpp_decoder_stack.py) and runs every layer of a step in one call.
//
//   stack = torch.classes.kvforge_cpp.DecoderStack()
//   stack.add_layer(tensors, ints, floats)          # once per layer, in order
//   stack.set_ends(embedding, norm, eps)            # once: the token embedding and the final RMSNorm
//   h = stack.forward_tokens(input_ids, positions, cos_table, sin_table, kv_caches, plans, slot_mapping,
//                            rows, last_plan, batch_invariant)
//   stack.set_head(tensors, ints)                   # once: the LM head, for the bursts
//   tokens = stack.decode_greedy(input_ids, positions, cos_table, sin_table, kv_caches, plans, slot_mapping,
//                                steps, block_size, stop_ids, batch_invariant, max_seconds)
//   tokens = stack.decode_sampled(<decode_greedy's arguments>, temperature, top_k, top_p, min_p, u,
//                                 repetition, presence, frequency, prompt_tokens, output_tokens)
//
// forward_tokens is the model's forward from token ids to the final norm's
// output: the embedding rows, the positions' rows of the rotary tables, every
// layer (forward, on hidden states), then the final RMSNorm. decode_greedy
// runs several greedy decode steps of a plain decode batch in one call (a
// multi-step burst, engine/decode_bursts.py): forward_tokens, the LM head and
// each row's greedy token, fed back as the next step's input; decode_sampled
// the same with each row's token drawn as the sampler draws it (sample_rows).
//
// Each layer calls the same C++ functions the per-layer torch ops run
// (decoder_stack_ops.h) in the same order with the same arguments, so its
// output is bitwise the per-layer path's; what it saves is the Python and the
// dispatch around some ten ops per layer. The layer (models/llama.py's
// LlamaDecoderLayer with C++ linears, RMSNorm, rotary and the cpp attention
// backend over a float cache):
//
//   h = rms_norm(x); qkv = linear(h); q, k = rotary(q, k) (q/k RMSNorm first when set)
//   write_kv(k, v); a = paged_attention(q[rows])
//   x = o_proj(a) + x[rows]; h = rms_norm(x); x = down(silu(gate(h)) * up(h)) + x
//
// `rows` (the step's output rows, or None) applies to the last layer only:
// it writes every token's keys and values, then computes those rows alone with
// `last_plan`'s attention metadata.

#include <ATen/ATen.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "cpu_isa.h"
#include "decoder_stack_ops.h"
#include "row_penalties.h"

namespace kvforge_cpp {

namespace {

// How a linear layer's weight is held (models/cpp_decoder_stack.py's LINEAR_KINDS).
enum LinearKind : int64_t {
  kPacked = 0,      // cpp_linear.CppLinear / CppGateUp: f32_linear or bf16_linear by the weight's dtype
  kInt8Weight = 1,  // quantized_linear.Int8Linear, activations "none": int8_weight_linear
  kInt8Dynamic = 2, // quantized_linear.Int8Linear, activations "int8" (W8A8): int8_dynamic_linear
  kPlain = 3,       // the LM head only: a float weight [out, in] through at::linear, as F.linear
};

struct Linear {
  int64_t kind = kPacked, out_features = 0;
  bool float_out = false;  // a bfloat16 packed weight's output in float32 (CppLinear's float_out: the LM head)
  at::Tensor weight, scale;
  std::optional<at::Tensor> bias;

  // x W^T + b, then "add" (+ other, a residual) or "silu_mul" (packed gate and up only).
  at::Tensor operator()(const at::Tensor& x, const char* epilogue = "none",
                        const std::optional<at::Tensor>& other = std::nullopt) const {
    if (kind == kPacked) {
      if (weight.scalar_type() == at::kFloat) return f32_linear(x, weight, out_features, bias, epilogue, other);
      return bf16_linear(x, weight, out_features, bias, epilogue, other, float_out);
    }
    if (kind == kPlain) return at::linear(x, weight);
    // Int8Linear (Int8GateUp for silu_mul): the same epilogues, after the int8 kernel.
    return kind == kInt8Weight ? int8_weight_linear(x, weight, scale, bias, epilogue, other)
                               : int8_dynamic_linear(x, weight, scale, bias, epilogue, other);
  }
};

struct Layer {
  at::Tensor input_norm, post_norm, q_norm, k_norm;
  double input_eps, post_eps, q_eps, k_eps, scale, soft_cap;
  int64_t heads, kv_heads, head, window, plan_index;
  bool qk_norm, fused_gate_up;
  Linear qkv, o, gate, up, down;  // gate: the packed gate-and-up when fused_gate_up (up unused)
};

// The step's attention metadata for one layer spec: CppPlan's four int32 tensors.
struct Meta {
  const at::Tensor *query_start, *seq_lens, *context_lens, *block_table;
};

Meta meta_at(const std::vector<at::Tensor>& plans, int64_t index) {
  TORCH_CHECK(static_cast<int64_t>(plans.size()) >= 4 * (index + 1), "kvforge_cpp.DecoderStack: plans holds ",
              plans.size(), " tensors, but a layer reads plan ", index, " (4 tensors per layer spec)");
  return {&plans[4 * index], &plans[4 * index + 1], &plans[4 * index + 2], &plans[4 * index + 3]};
}

}  // namespace

class DecoderStack : public torch::CustomClassHolder {
 public:
  // One layer, appended. tensors: input_norm, post_norm, q_norm, k_norm, then
  // (weight, bias, scale) of qkv, o, gate (or gate-and-up), up, down: 19
  // tensors, absent ones any placeholder. ints: heads, kv_heads, head, window
  // (0: none), qk_norm, plan_index, fused_gate_up, then (kind, out_features,
  // has_bias) of the five linears: 22. floats: the four RMSNorm eps, the
  // softmax scale, the logit soft cap (0: none): 6.
  void add_layer(std::vector<at::Tensor> tensors, std::vector<int64_t> ints, std::vector<double> floats) {
    const char* op = "kvforge_cpp.DecoderStack.add_layer: ";
    TORCH_CHECK(tensors.size() == 19 && ints.size() == 22 && floats.size() == 6, op,
                "expects 19 tensors, 22 ints and 6 floats (see models/cpp_decoder_stack.py), got ", tensors.size(),
                ", ", ints.size(), " and ", floats.size());
    Layer l;
    l.input_norm = tensors[0];
    l.post_norm = tensors[1];
    l.q_norm = tensors[2];
    l.k_norm = tensors[3];
    l.heads = ints[0];
    l.kv_heads = ints[1];
    l.head = ints[2];
    l.window = ints[3];
    l.qk_norm = ints[4] != 0;
    l.plan_index = ints[5];
    l.fused_gate_up = ints[6] != 0;
    Linear* linears[] = {&l.qkv, &l.o, &l.gate, &l.up, &l.down};
    for (int i = 0; i < 5; ++i) {
      Linear& lin = *linears[i];
      lin.kind = ints[7 + 3 * i];
      lin.out_features = ints[8 + 3 * i];
      TORCH_CHECK(lin.kind >= kPacked && lin.kind <= kInt8Dynamic, op, "linear kind must be 0 (packed), 1 (int8 "
                  "weight-only) or 2 (W8A8), got ", lin.kind);
      lin.weight = tensors[4 + 3 * i];
      if (ints[9 + 3 * i] != 0) lin.bias = tensors[5 + 3 * i];
      lin.scale = tensors[6 + 3 * i];
    }
    l.input_eps = floats[0];
    l.post_eps = floats[1];
    l.q_eps = floats[2];
    l.k_eps = floats[3];
    l.scale = floats[4];
    l.soft_cap = floats[5];
    layers_.push_back(std::move(l));
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // The token embedding [vocab, hidden] and the final RMSNorm that forward_tokens runs around the layers.
  void set_ends(at::Tensor embedding, at::Tensor norm, double eps) {
    TORCH_CHECK(embedding.dim() == 2 && norm.dim() == 1 && norm.size(0) == embedding.size(1),
                "kvforge_cpp.DecoderStack.set_ends: expects an embedding [vocab, hidden] and a norm weight "
                "[hidden], got ", embedding.sizes(), " and ", norm.sizes());
    embedding_ = embedding;
    norm_ = norm;
    norm_eps_ = eps;
  }

  // The model's forward on token ids (int64 [tokens]) at positions (int64 [tokens]):
  // the embedding (torch.embedding's rows), the positions' rows of the float32
  // rotary tables [N, head / 2], forward, then the final RMSNorm.
  at::Tensor forward_tokens(at::Tensor input_ids, at::Tensor positions, at::Tensor cos_table, at::Tensor sin_table,
                            std::vector<at::Tensor> kv_caches, std::vector<at::Tensor> plans,
                            at::Tensor slot_mapping, std::optional<at::Tensor> rows, std::vector<at::Tensor> last_plan,
                            bool batch_invariant) {
    TORCH_CHECK(embedding_.defined(), "kvforge_cpp.DecoderStack.forward_tokens: call set_ends first");
    const IsaPin pin;  // one read of the environment for every kernel of the forward
    at::Tensor x = at::embedding(embedding_, input_ids);
    x = forward(x, cos_table.index_select(0, positions), sin_table.index_select(0, positions),
                std::move(kv_caches), std::move(plans), std::move(slot_mapping), std::move(rows),
                std::move(last_plan), batch_invariant);
    return rms_norm(x, norm_, norm_eps_);
  }

  // The LM head that decode_greedy runs after the final norm, as the model's
  // compute_logits does: tensors (weight, bias, scale), ints (kind, out_features,
  // has_bias, float_out); kind kPlain is a float weight [vocab, hidden] (a tied
  // embedding, or a head the C++ linears do not hold) through at::linear.
  void set_head(std::vector<at::Tensor> tensors, std::vector<int64_t> ints) {
    const char* op = "kvforge_cpp.DecoderStack.set_head: ";
    TORCH_CHECK(tensors.size() == 3 && ints.size() == 4, op, "expects 3 tensors (weight, bias, scale) and 4 ints "
                "(kind, out_features, has_bias, float_out), got ", tensors.size(), " and ", ints.size());
    TORCH_CHECK(ints[0] >= kPacked && ints[0] <= kPlain, op, "kind must be 0 (packed), 1 (int8 weight-only), 2 "
                "(W8A8) or 3 (a float weight through at::linear), got ", ints[0]);
    head_.kind = ints[0];
    head_.out_features = ints[1];
    head_.weight = tensors[0];
    head_.bias = ints[2] != 0 ? std::optional<at::Tensor>(tensors[1]) : std::nullopt;
    head_.scale = tensors[2];
    head_.float_out = ints[3] != 0;
    has_head_ = true;
  }

  // Up to `steps` greedy decode steps of a plain decode batch (one token per
  // sequence, every row sampled): forward_tokens, the head, then each row's
  // greedy token (greedy_rows), fed back as the next step's input one position
  // further on. Step s reads the plans' seq_lens and context_lens plus s and
  // writes each row's key and value at block_table[row][p / block_size] *
  // block_size + p % block_size (the block table of plans' first spec, whose
  // blocks for every step must be reserved); the rotary tables must hold the
  // last position. Every step computes what the same step run alone computes.
  // Returns the tokens, step after step (rows per step); it stops after a step
  // in which every row sampled one of `stop_ids`, and before a step in which a
  // row's logits hold a NaN or an infinity (whose tokens are not returned),
  // and after the step that brings the call's time to `max_seconds` (> 0).
  std::vector<int64_t> decode_greedy(at::Tensor input_ids, at::Tensor positions, at::Tensor cos_table,
                                     at::Tensor sin_table, std::vector<at::Tensor> kv_caches,
                                     std::vector<at::Tensor> plans, at::Tensor slot_mapping, int64_t steps,
                                     int64_t block_size, std::vector<int64_t> stop_ids, bool batch_invariant,
                                     double max_seconds) {
    return decode("kvforge_cpp.DecoderStack.decode_greedy: ", input_ids, positions, cos_table, sin_table, kv_caches,
                  plans, slot_mapping, steps, block_size, stop_ids, batch_invariant, max_seconds,
                  [](const at::Tensor&, std::vector<int64_t> greedy, int64_t) { return greedy; });
  }

  // decode_greedy's burst, each row's token drawn by sample_rows (sample_rows.cpp)
  // with its temperature (0: greedy), top_k, top_p and min_p, and step s's
  // uniform number u[s][row] (float64 [steps, rows]): the tokens sample_rows
  // draws from each step's logits with those numbers. A row with a repetition,
  // presence or frequency penalty (1, 0 and 0 are none) has them applied to its
  // logits first (row_penalties.h) over its prompt_tokens and output_tokens
  // (int64, the request's so far) and the tokens of the burst's earlier steps.
  std::vector<int64_t> decode_sampled(at::Tensor input_ids, at::Tensor positions, at::Tensor cos_table,
                                      at::Tensor sin_table, std::vector<at::Tensor> kv_caches,
                                      std::vector<at::Tensor> plans, at::Tensor slot_mapping, int64_t steps,
                                      int64_t block_size, std::vector<int64_t> stop_ids, bool batch_invariant,
                                      double max_seconds, std::vector<double> temperature, std::vector<int64_t> top_k,
                                      std::vector<double> top_p, std::vector<double> min_p, at::Tensor u,
                                      std::vector<double> repetition, std::vector<double> presence,
                                      std::vector<double> frequency, std::vector<at::Tensor> prompt_tokens,
                                      std::vector<at::Tensor> output_tokens) {
    const char* op = "kvforge_cpp.DecoderStack.decode_sampled: ";
    const int64_t rows = input_ids.size(0);
    TORCH_CHECK(u.dim() == 2 && u.size(0) >= steps && u.size(1) == rows && u.scalar_type() == at::kDouble, op,
                "u must be float64 [steps, rows] = [", steps, ", ", rows, "], got ", u.scalar_type(), " ", u.sizes());
    const auto per_row = [&](size_t n) { return static_cast<int64_t>(n) == rows; };
    TORCH_CHECK(per_row(repetition.size()) && per_row(presence.size()) && per_row(frequency.size()) &&
                    per_row(prompt_tokens.size()) && per_row(output_tokens.size()),
                op, "repetition, presence, frequency, prompt_tokens and output_tokens must hold one entry per row (",
                rows, ")");
    std::vector<RowPenalties> penalties(rows);
    for (int64_t r = 0; r < rows; ++r) {
      if (repetition[r] == 1.0 && presence[r] == 0.0 && frequency[r] == 0.0) continue;
      penalties[r].start(head_.out_features, repetition[r], presence[r], frequency[r]);
      for (const auto& [tokens, output] : {std::pair{&prompt_tokens[r], false}, std::pair{&output_tokens[r], true}}) {
        const at::Tensor ids = tokens->to(at::kLong).contiguous();
        const int64_t* id = ids.data_ptr<int64_t>();
        for (int64_t i = 0; i < ids.numel(); ++i) penalties[r].add(id[i], output);
      }
    }
    return decode(op, input_ids, positions, cos_table, sin_table, kv_caches, plans, slot_mapping, steps, block_size,
                  stop_ids, batch_invariant, max_seconds,
                  [&](const at::Tensor& logits, std::vector<int64_t>, int64_t s) {
                    float* row = logits.data_ptr<float>();
                    for (int64_t r = 0; r < rows; ++r) {
                      if (!penalties[r].active()) continue;
                      TORCH_CHECK(static_cast<int64_t>(penalties[r].seen.size()) == logits.size(1), op, "the head gives ",
                                  logits.size(1), " logits, its out_features are ", penalties[r].seen.size());
                      penalties[r].apply(row + r * logits.size(1));
                    }
                    std::vector<int64_t> tokens = sample_rows(logits, temperature, top_k, top_p, min_p, u[s]);
                    for (int64_t r = 0; r < rows; ++r) {
                      if (penalties[r].active()) penalties[r].add(tokens[r], true);
                    }
                    return tokens;
                  });
  }

  // Every layer on `x` [tokens, hidden]; the hidden states after the last one
  // ([rows, hidden] with `rows`). cos, sin: float32 [tokens, head / 2] (cpp
  // rotary tables); kv_caches: one float cache per layer; plans: 4 tensors per
  // layer spec (a layer reads those of its plan_index); slot_mapping: int64;
  // last_plan: the 4 tensors of the last layer's rows (empty when rows is empty).
  at::Tensor forward(at::Tensor x, at::Tensor cos, at::Tensor sin, std::vector<at::Tensor> kv_caches,
                     std::vector<at::Tensor> plans, at::Tensor slot_mapping, std::optional<at::Tensor> rows,
                     std::vector<at::Tensor> last_plan, bool batch_invariant) {
    TORCH_CHECK(kv_caches.size() == layers_.size(), "kvforge_cpp.DecoderStack.forward: ", kv_caches.size(),
                " KV caches for ", layers_.size(), " layers");
    const int64_t last = num_layers() - 1;
    for (int64_t i = 0; i <= last; ++i) {
      const bool select = i == last && rows.has_value();
      x = run_layer(layers_[i], x, cos, sin, kv_caches[i],
                    select && !last_plan.empty() ? meta_at(last_plan, 0) : meta_at(plans, layers_[i].plan_index),
                    slot_mapping, select ? rows : std::nullopt, batch_invariant);
    }
    return x;
  }

 private:
  // The burst loop of decode_greedy and decode_sampled: `pick(logits, greedy, s)`
  // gives step s's tokens from its finite logits and their greedy tokens.
  template <typename Pick>
  std::vector<int64_t> decode(const char* op, const at::Tensor& input_ids, const at::Tensor& positions,
                              const at::Tensor& cos_table, const at::Tensor& sin_table,
                              const std::vector<at::Tensor>& kv_caches, const std::vector<at::Tensor>& plans,
                              const at::Tensor& slot_mapping, int64_t steps, int64_t block_size,
                              const std::vector<int64_t>& stop_ids, bool batch_invariant, double max_seconds,
                              Pick pick) {
    const auto began = std::chrono::steady_clock::now();
    TORCH_CHECK(has_head_, op, "call set_head first");
    TORCH_CHECK(max_seconds > 0, op, "max_seconds must be > 0, got ", max_seconds);
    const int64_t rows = input_ids.size(0);
    TORCH_CHECK(input_ids.dim() == 1 && positions.sizes() == input_ids.sizes() &&
                    slot_mapping.sizes() == input_ids.sizes() && !plans.empty() && plans.size() % 4 == 0 &&
                    block_size > 0,
                op, "expects one token per sequence (input_ids, positions and slot_mapping [rows]), 4 plan "
                "tensors per layer spec and a block size > 0");
    for (size_t i = 0; i < plans.size(); i += 4) {
      TORCH_CHECK(plans[i].numel() == rows + 1 && plans[i + 1].numel() == rows && plans[i + 2].numel() == rows,
                  op, "every plan must hold ", rows, " sequences of one token each");
    }
    const at::Tensor block_table = plans[3].contiguous();
    const auto table = block_table.accessor<int32_t, 2>();
    const at::Tensor first_positions = positions.to(at::kLong).contiguous();
    const int64_t* first = first_positions.data_ptr<int64_t>();
    std::vector<int64_t> out, next(rows);
    out.reserve(static_cast<size_t>(std::max<int64_t>(steps, 0) * rows));
    std::vector<bool> stopped(rows, false);
    at::Tensor ids = input_ids, pos = positions, slots = slot_mapping;
    std::vector<at::Tensor> metas = plans;
    for (int64_t s = 0; s < steps; ++s) {
      if (s > 0) {
        ids = at::from_blob(next.data(), {rows}, at::kLong).clone();
        pos = first_positions + s;
        slots = at::empty({rows}, at::kLong);
        int64_t* slot = slots.data_ptr<int64_t>();
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t p = first[r] + s;
          TORCH_CHECK(p / block_size < table.size(1), op, "position ", p, " of row ", r, " lies past its ",
                      table.size(1), " reserved blocks");
          slot[r] = static_cast<int64_t>(table[r][p / block_size]) * block_size + p % block_size;
        }
        for (size_t i = 0; i < plans.size(); i += 4) {
          metas[i + 1] = plans[i + 1] + s;
          metas[i + 2] = plans[i + 2] + s;
        }
      }
      const at::Tensor hidden = forward_tokens(ids, pos, cos_table, sin_table, kv_caches, metas, slots, std::nullopt,
                                               {}, batch_invariant);
      const at::Tensor logits = head_(hidden).to(at::kFloat).contiguous();
      std::vector<int64_t> greedy = greedy_rows(logits);
      if (std::find(greedy.begin(), greedy.end(), int64_t{-1}) != greedy.end()) break;
      const std::vector<int64_t> tokens = pick(logits, std::move(greedy), s);
      bool all_stopped = true;
      for (int64_t r = 0; r < rows; ++r) {
        out.push_back(tokens[r]);
        next[r] = tokens[r];
        stopped[r] = stopped[r] || std::find(stop_ids.begin(), stop_ids.end(), tokens[r]) != stop_ids.end();
        all_stopped = all_stopped && stopped[r];
      }
      if (all_stopped) break;
      if (std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count() >= max_seconds) break;
    }
    return out;
  }

  static at::Tensor run_layer(const Layer& l, const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                              const at::Tensor& kv_cache, const Meta& meta, const at::Tensor& slot_mapping,
                              const std::optional<at::Tensor>& rows, bool batch_invariant) {
    const int64_t tokens = x.size(0), h = l.heads, kvh = l.kv_heads;
    // Attention (LlamaAttention.forward)
    const at::Tensor qkv = l.qkv(rms_norm(x, l.input_norm, l.input_eps)).view({tokens, h + 2 * kvh, l.head});
    const at::Tensor v = qkv.slice(1, h + kvh);
    at::Tensor q, k;
    if (l.qk_norm) {
      q = rotary(rms_norm(qkv.slice(1, 0, h), l.q_norm, l.q_eps), cos, sin);
      k = rotary(rms_norm(qkv.slice(1, h, h + kvh), l.k_norm, l.k_eps), cos, sin);
    } else {  // q and k side by side: one rotation for both
      const at::Tensor qk = rotary(qkv.slice(1, 0, h + kvh), cos, sin);
      q = qk.slice(1, 0, h);
      k = qk.slice(1, h, h + kvh);
    }
    // PagedAttention.forward and CppAttentionBackend.write_kv / attend (float cache)
    write_kv(k, v, kv_cache, slot_mapping);
    at::Tensor attended;
    if (rows.has_value() && rows->numel() == 0) {  // a step that samples nothing: the write was all
      attended = q.slice(0, 0, 0);
    } else {
      at::Tensor query = rows.has_value() ? q.index({*rows}) : q;
      if (query.stride(-1) != 1) query = query.contiguous();
      attended = at::empty_like(query);
      paged_attention(query, kv_cache, *meta.query_start, *meta.seq_lens, *meta.context_lens, *meta.block_table,
                      l.scale, l.window, l.soft_cap, std::nullopt, attended, std::nullopt, batch_invariant);
    }
    const at::Tensor residual = rows.has_value() ? x.index({*rows}) : x;
    const at::Tensor y = l.o(attended.reshape({attended.size(0), h * l.head}), "add", residual);
    // MLP (LlamaMLP.forward)
    const at::Tensor hn = rms_norm(y, l.post_norm, l.post_eps);
    at::Tensor gated;
    if (l.fused_gate_up) {
      gated = l.gate(hn, "silu_mul");
    } else {  // packed_linear.linear_mul(up, x, linear_act(gate, x, "silu")): up(x).mul_(silu(gate(x)))
      const at::Tensor activated = at::silu(l.gate(hn));
      gated = l.up(hn).mul_(activated);
    }
    return l.down(gated, "add", y);
  }

  std::vector<Layer> layers_;
  at::Tensor embedding_, norm_;
  double norm_eps_ = 0.0;
  Linear head_;
  bool has_head_ = false;
};

TORCH_LIBRARY_FRAGMENT(kvforge_cpp, m) {
  m.class_<DecoderStack>("DecoderStack")
      .def(torch::init<>())
      .def("add_layer", &DecoderStack::add_layer)
      .def("num_layers", &DecoderStack::num_layers)
      .def("set_ends", &DecoderStack::set_ends)
      .def("forward_tokens", &DecoderStack::forward_tokens)
      .def("set_head", &DecoderStack::set_head)
      .def("decode_greedy", &DecoderStack::decode_greedy)
      .def("decode_sampled", &DecoderStack::decode_sampled);
}

}  // namespace kvforge_cpp
