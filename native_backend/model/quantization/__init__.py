"""Int4 weight quantization: the AutoAWQ "GEMM" checkpoint format, its reference arithmetic, the
linear method that runs it, and the quantizers (round-to-nearest and AWQ) that write it.

    format.py     packing rules and the checkpoint's quantization_config (QuantConfig)
    reference.py  dequantize (q - z) * s per group, and the reference int4 linear
    method.py     AWQLinearMethod (and its GGUF Q4 offset variant): packed weights created, loaded
                  and applied (C kernel / Triton / torch)
    triton_int4.py  the CUDA kernel of both variants (one kernel, a constexpr switch)
    rtn.py        per-group asymmetric round-to-nearest (the quantizer both methods end with)
    awq.py        activation-aware scale search and clipping (Lin et al., 2023, as AutoAWQ runs it)
    quantize.py   a model in, an AutoAWQ GEMM checkpoint directory out (`kvgate quantize`)
"""
