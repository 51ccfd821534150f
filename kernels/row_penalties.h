// One decoding row's repetition, presence and frequency penalties with the
// token history they read, for decode bursts that sample in C++
// (decoder_stack.cpp's decode_sampled): the history grows by each pass's token
// without going back to Python.
//
// apply() edits a row of logits as engine/sampler.py's apply_penalties does,
// in the same float32 operations, so the same values: a token seen in the
// prompt or the output (and not banned, -inf) has its logit divided by the
// repetition penalty where positive, multiplied where negative, kept where 0,
// and held to float32's finite range; then every token loses
// frequency * (its count in the output) + presence * (1 if it is there). A
// token in neither is left as it is (the tensor ops subtract 0 from it).
// Compiled without FMA contraction (the library's baseline flags), as the
// tensor ops' separate multiply and add are.

#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

namespace kvforge_cpp {

struct RowPenalties {
  float repetition = 1.f, presence = 0.f, frequency = 0.f;
  std::vector<int32_t> output_count;  // per vocabulary entry
  std::vector<uint8_t> seen;          // in the prompt or the output
  std::vector<int64_t> touched;       // the entries seen, each once

  bool active() const { return repetition != 1.f || presence != 0.f || frequency != 0.f; }

  // A fresh history over `vocab` entries, penalties as float32 (what the tensors hold).
  void start(int64_t vocab, double repetition_penalty, double presence_penalty, double frequency_penalty) {
    repetition = static_cast<float>(repetition_penalty);
    presence = static_cast<float>(presence_penalty);
    frequency = static_cast<float>(frequency_penalty);
    output_count.assign(vocab, 0);
    seen.assign(vocab, 0);
    touched.clear();
  }

  // One token of the prompt (`output` false) or of the output; ids outside the vocabulary are ignored.
  void add(int64_t token, bool output) {
    if (token < 0 || token >= static_cast<int64_t>(seen.size())) return;
    if (!seen[token]) {
      seen[token] = 1;
      touched.push_back(token);
    }
    if (output) ++output_count[token];
  }

  void apply(float* logits) const {
    constexpr float kMax = std::numeric_limits<float>::max();
    constexpr float kNegInf = -std::numeric_limits<float>::infinity();
    for (const int64_t t : touched) {
      float y = logits[t];
      if (y != kNegInf) {
        float penalized = y > 0.f ? y / repetition : y * repetition;
        if (y == 0.f) penalized = y;
        y = std::min(std::max(penalized, -kMax), kMax);
      }
      const int32_t count = output_count[t];
      const float subtracted = frequency * static_cast<float>(count) + presence * (count > 0 ? 1.f : 0.f);
      logits[t] = y - subtracted;
    }
  }
};

}  // namespace kvforge_cpp
