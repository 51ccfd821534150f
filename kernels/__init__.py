"""kvforge's compiled CPU kernels: one C++ library, built just in time (see `build`).

The library registers `torch.ops.kvforge_cpp`: the paged attention and KV-write
kernels the `cpp` attention backend calls; the linear (float32, bfloat16, int8 weights),
RMSNorm, rotary and batched LoRA (`lora_ops.add_lora`) kernels the models call;
and the inverse-CDF draw of the engine's sampler. It lives here, below all of
them, so that a model never imports a backend to reach a kernel.
"""
