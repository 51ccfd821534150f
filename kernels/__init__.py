"""kvforge's compiled CPU kernels: one C++ library, built just in time (see `build`).

The library registers `torch.ops.kvforge_cpp`: the paged attention and KV-write
kernels the `cpp` attention backend calls, and the weight-only int8 linear the
models' quantized layers call. It lives here, below both, so that a model never
imports a backend to reach a kernel.
"""
