// RMSNorm and rotary embeddings for CPU models, one pass each with float32
// math inside (torch.library custom ops):
//
//   kvforge_cpp::rms_norm(x, weight, eps) -> Tensor
//   kvforge_cpp::rotary(x, cos, sin) -> Tensor
//
// x is float32 or bfloat16, 2-D [rows, d] or 3-D [tokens, heads, d] with unit
// stride along d (views into a fused q/k/v output are fine); the output is a
// new contiguous tensor of x's shape and dtype. rms_norm's weight [d] has x's
// dtype; rotary's cos and sin are float32 [tokens, d / 2] (both halves of a
// head share them, the Hugging Face rotate-half layout). In torch, a bfloat16
// RMSNorm is six ops and two dtype copies, and a rotation four ops, each a
// pass over memory and a dispatch; here each is one.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>

#include "cpu_isa.h"

namespace kvforge_cpp {

namespace rows_base {
#include "bf16_vectors.h"
#define KVFORGE_VW_BYTES 16
#include "native_vectors.h"
#include "rms_norm_rotary_rows.h"
}  // namespace rows_base

#ifdef KVFORGE_HAS_X86_PATHS
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace rows_avx2 {
#include "bf16_vectors.h"
#define KVFORGE_VW_BYTES 32
#include "native_vectors.h"
#include "rms_norm_rotary_rows.h"
}  // namespace rows_avx2
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")
namespace rows_avx512 {
#include "bf16_vectors.h"
#define KVFORGE_VW_BYTES 64
#include "native_vectors.h"
#include "rms_norm_rotary_rows.h"
}  // namespace rows_avx512
#pragma GCC pop_options
#endif

namespace {

// Rows of x as (outer, inner) pairs: 2-D x has one inner row per outer.
struct Rows {
  int64_t outer, inner, outer_stride, inner_stride, d;
};

Rows rows_of(const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.device().is_cpu(), op, "x must be on the CPU");
  TORCH_CHECK((x.dim() == 2 || x.dim() == 3) && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
                  (x.stride(-1) == 1 || x.size(-1) <= 1),
              op, "x must be a 2-D [rows, d] or 3-D [tokens, heads, d] float32 or bfloat16 tensor with unit stride "
              "along d, got ", x.scalar_type(), " ", x.sizes(), " strides ", x.strides());
  if (x.dim() == 2) return {x.size(0), 1, x.stride(0), 0, x.size(1)};
  return {x.size(0), x.size(1), x.stride(0), x.stride(1), x.size(2)};
}

template <typename Fn>
void for_each_row(const Rows& r, Fn fn) {
  at::parallel_for(0, r.outer * r.inner, 64, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) fn(i / r.inner, i % r.inner, i);
  });
}

// The ISA's row kernels for element type T (float, or uint16_t for bfloat16).
template <typename T>
struct RowKernels {
  void (*norm)(const T*, const T*, int64_t, float, T*);
  void (*rotary)(const T*, const float*, const float*, int64_t, T*);
};

template <typename T>
RowKernels<T> kernels_here() {
#ifdef KVFORGE_HAS_X86_PATHS
  switch (isa()) {
    case Isa::kAvx512: return {&rows_avx512::rms_norm_row<T>, &rows_avx512::rotary_row<T>};
    case Isa::kAvx2: return {&rows_avx2::rms_norm_row<T>, &rows_avx2::rotary_row<T>};
    case Isa::kBaseline: break;
  }
#endif
  return {&rows_base::rms_norm_row<T>, &rows_base::rotary_row<T>};
}

template <typename T>
const T* ptr(const at::Tensor& t) { return reinterpret_cast<const T*>(t.data_ptr()); }

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const char* op = "kvforge_cpp.rms_norm: ";
  const Rows r = rows_of(x, op);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == r.d && weight.scalar_type() == x.scalar_type() &&
                  weight.is_contiguous() && weight.device().is_cpu(), op,
              "weight must be a contiguous CPU tensor of ", r.d, " values in x's dtype (", x.scalar_type(), "), got ",
              weight.scalar_type(), " ", weight.sizes());
  at::Tensor y = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  if (y.numel() == 0) return y;
  auto run = [&](auto tag) {
    using T = decltype(tag);
    const auto norm = kernels_here<T>().norm;
    const T* xp = ptr<T>(x);
    const T* wp = ptr<T>(weight);
    T* yp = reinterpret_cast<T*>(y.data_ptr());
    for_each_row(r, [&](int64_t o, int64_t i, int64_t row) {
      norm(xp + o * r.outer_stride + i * r.inner_stride, wp, r.d, static_cast<float>(eps), yp + row * r.d);
    });
  };
  if (x.scalar_type() == at::kFloat) run(float{}); else run(uint16_t{});
  return y;
}

at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const char* op = "kvforge_cpp.rotary: ";
  const Rows r = rows_of(x, op);
  TORCH_CHECK(r.d % 2 == 0, op, "the head size must be even (rotate-half), got ", r.d);
  const int64_t half = r.d / 2;
  for (const at::Tensor* t : {&cos, &sin}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->device().is_cpu() &&
                    t->numel() == r.outer * half, op,
                "cos and sin must be contiguous float32 CPU tensors of [tokens, d / 2] = [", r.outer, ", ", half,
                "] values, got ", t->scalar_type(), " ", t->sizes());
  }
  at::Tensor y = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  if (y.numel() == 0) return y;
  auto run = [&](auto tag) {
    using T = decltype(tag);
    const auto rotate = kernels_here<T>().rotary;
    const T* xp = ptr<T>(x);
    const float* cp = cos.data_ptr<float>();
    const float* sp = sin.data_ptr<float>();
    T* yp = reinterpret_cast<T*>(y.data_ptr());
    for_each_row(r, [&](int64_t o, int64_t i, int64_t row) {
      rotate(xp + o * r.outer_stride + i * r.inner_stride, cp + o * half, sp + o * half, half, yp + row * r.d);
    });
  };
  if (x.scalar_type() == at::kFloat) run(float{}); else run(uint16_t{});
  return y;
}

TORCH_LIBRARY_FRAGMENT(kvforge_cpp, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("rotary(Tensor x, Tensor cos, Tensor sin) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvforge_cpp, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("rotary", &rotary);
}

}  // namespace kvforge_cpp
