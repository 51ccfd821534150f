// `vw`, the instruction set's own float vector (vwi, vwu and vwh its int32,
// uint32 and uint16 twins), and kW, its lanes: 16 bytes on
// the baseline, 32 under AVX2, 64 under AVX-512, as the includer says by
// defining KVFORGE_VW_BYTES before each include (inside an ISA namespace).
//
// GCC (12) keeps a GCC vector wider than the ISA's registers (vf16 under AVX2
// or SSE) in memory and splits every operation through the stack: a loop
// that keeps its sums in vf16 there runs at a fraction of the speed of the
// same loop in `vw`. Loops whose lanes never mix run in `vw` with the same
// per-lane arithmetic, hence the same bits, on every ISA.

typedef float vw __attribute__((vector_size(KVFORGE_VW_BYTES), aligned(4), may_alias));
typedef int32_t vwi __attribute__((vector_size(KVFORGE_VW_BYTES), aligned(4), may_alias));
typedef uint32_t vwu __attribute__((vector_size(KVFORGE_VW_BYTES), aligned(4), may_alias));
typedef uint16_t vwh __attribute__((vector_size(KVFORGE_VW_BYTES / 2), aligned(2), may_alias));
constexpr int kW = KVFORGE_VW_BYTES / 4;
#undef KVFORGE_VW_BYTES

// kW bfloat16 values (raw bits) at p as floats, and float_to_bf16 on every lane
// of v stored at p (bf16_vectors.h, included before this header).
inline vw load_bf16w(const uint16_t* p) { return load_bf16_lanes<vw, vwu, vwh>(p); }
inline void store_bf16w(uint16_t* p, vw v) { store_bf16_lanes<vw, vwu, vwh>(p, v); }

// kW float32 or bfloat16 values at p as floats, and back: one overload per dtype.
inline vw loadw(const float* p) { return *reinterpret_cast<const vw*>(p); }
inline vw loadw(const uint16_t* p) { return load_bf16w(p); }
inline void storew(float* p, vw v) { *reinterpret_cast<vw*>(p) = v; }
inline void storew(uint16_t* p, vw v) { store_bf16w(p, v); }
