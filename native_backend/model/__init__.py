"""The model, built in its final form: layers (linear methods, sharding, rotary, norms), the model
classes and their registry, the loader (HF safetensors and GGUF), int4 quantization, attention
(torch reference, CPU dispatch, Triton) and the KV cache it reads and writes.

May import config, kernels and text (the quantizer's calibration tokenizes). Never imports core,
execution or process: it knows nothing of requests or steps.
"""
