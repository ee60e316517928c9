"""kvgate's C kernels for x86-64 CPUs: the sources (csrc/), their build (compiled once, cached,
loaded with ctypes) and the calls the CPU path makes (cpu_kernels).

May import config (where the built library is cached). The Triton kernels live beside their torch
references in model/attention and model/quantization: they take the model's own types.
"""
