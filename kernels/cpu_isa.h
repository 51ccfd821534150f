// Which x86 instruction set the kernels of this library run with: read once
// per call from the CPU's flags, capped by KVFORGE_CPP_ISA (baseline, avx2 or
// avx512; tests run every level), unless an IsaPin holds it.
// KVFORGE_CPP_PORTABLE=1 still means baseline. Shared by every translation
// unit of the library, so one cap governs them all.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <string>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)  // clang lacks `#pragma GCC target`
#define KVFORGE_HAS_X86_PATHS 1
#endif

// For a helper whose only work is prefetching (asking for lines ahead of use).
// GCC counts a prefetch as no effect at all, so a helper it does not inline
// early is found to do nothing and its calls are deleted, every prefetch with
// them; forced inline, the prefetches land in the caller's loop.
#define KVFORGE_PREFETCH_HELPER inline __attribute__((always_inline))

namespace kvforge_cpp {

enum class Isa { kBaseline, kAvx2, kAvx512 };

namespace detail {
// The level an IsaPin holds on this thread, or -1 when none does.
inline thread_local int pinned_isa = -1;
}  // namespace detail

inline Isa isa() {
  if (detail::pinned_isa >= 0) return static_cast<Isa>(detail::pinned_isa);
#ifdef KVFORGE_HAS_X86_PATHS
  static const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                           __builtin_cpu_supports("f16c");
  static const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                             __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
  const char* portable = std::getenv("KVFORGE_CPP_PORTABLE");
  const char* cap = std::getenv("KVFORGE_CPP_ISA");
  const std::string limit = portable != nullptr && portable[0] == '1' ? "baseline" : (cap != nullptr ? cap : "");
  if (limit == "baseline" || !avx2) return Isa::kBaseline;
  if (limit == "avx2" || !avx512) return Isa::kAvx2;
  return Isa::kAvx512;
#else
  return Isa::kBaseline;
#endif
}

// isa() read once and held on this thread for the pin's lifetime: for one call
// that runs many kernels (the decoder stack's forward), whose every kernel
// would otherwise read the environment again. Pins nest; each restores the
// one before it.
class IsaPin {
 public:
  IsaPin() : saved_(detail::pinned_isa) { detail::pinned_isa = static_cast<int>(isa()); }
  ~IsaPin() { detail::pinned_isa = saved_; }
  IsaPin(const IsaPin&) = delete;
  IsaPin& operator=(const IsaPin&) = delete;

 private:
  int saved_;
};

// AVX-512 BF16 (vdpbf16ps: bfloat16 pairs multiplied and summed into float32),
// used by the bfloat16 paths when isa() is kAvx512 and the CPU has it.
inline bool has_avx512_bf16() {
#ifdef KVFORGE_HAS_X86_PATHS
  static const bool bf16 = __builtin_cpu_supports("avx512bf16");
  return bf16;
#else
  return false;
#endif
}

// AVX-512 VNNI (vpdpbusd: unsigned times signed bytes, four at a time, summed
// into int32), used by W8A8's few-row path when isa() is kAvx512 and the CPU has it.
inline bool has_avx512_vnni() {
#ifdef KVFORGE_HAS_X86_PATHS
  static const bool vnni = __builtin_cpu_supports("avx512vnni");
  return vnni;
#else
  return false;
#endif
}

// Tells the compiler that a register tile's loop runs at least once (its caller
// guarantees it). Where the loop might run zero times, GCC keeps a copy of the
// tile's sums on the stack for that path: it zeroes them there and copies them
// through it on every call, which cost the float32 linears and the prefill
// attention a few percent.
inline void runs_at_least_once(int64_t count) {
  if (count < 1) __builtin_unreachable();
}

}  // namespace kvforge_cpp
