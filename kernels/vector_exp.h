// A vectorised e^x for any GCC float vector type, shared by the attention
// kernels (vector_kernels.h) and the bfloat16 kernels (bf16_vectors.h).
// Deliberately without an include guard: the files that include it are
// themselves included once per ISA namespace, and each namespace needs its own
// copy compiled for its target. Include it once per namespace.

// e^x lane by lane for any float vector V with int32 twin VI (Cephes' expf:
// range reduction by ln 2, degree-6 polynomial, about 1 ulp); x below -87.3,
// and -inf, give exactly 0. The scalar expf call was a third of a prefill's time.
template <typename V, typename VI>
inline V exp_of(V x) {
  const V lowest = V{} + -87.3365478515625f;
  const VI underflow = x < lowest;
  x = x > V{} + 88.0f ? V{} + 88.0f : x;
  x = x < lowest ? lowest : x;
  const V fx = x * 1.44269504088896341f + 0.5f;
  VI n = __builtin_convertvector(fx, VI);  // rounds toward zero ...
  n = __builtin_convertvector(n, V) > fx ? n - 1 : n;  // ... so step down to floor
  const V nf = __builtin_convertvector(n, V);
  const V z = (x - nf * 0.693359375f) - nf * -2.12194440e-4f;
  V p = V{} + 1.9875691500e-4f;
  p = p * z + 1.3981999507e-3f;
  p = p * z + 8.3334519073e-3f;
  p = p * z + 4.1665795894e-2f;
  p = p * z + 1.6666665459e-1f;
  p = p * z + 5.0000001201e-1f;
  p = p * (z * z) + z + 1.0f;
  const VI scale_bits = (n + 127) << 23;  // 2^n as float bits
  const V result = p * reinterpret_cast<const V&>(scale_bits);
  return underflow ? V{} : result;
}
