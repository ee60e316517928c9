"""How to build an engine, in plain validated parts (the shape of vLLM's configs):

    EngineConfig
      model:       ModelOptions        which checkpoint, dtype, device, threads, kernels
      cache:       CacheOptions        KV block size, dtype, budget, prefix caching
      scheduler:   SchedulerOptions    batch limits, context length
      parallel:    ParallelOptions     tensor-parallel size (1 so far)
      speculative: SpeculativeOptions | None

Each part checks itself once, in `__post_init__`, and raises ValueError naming the field; the
native plugin's settings map onto these fields one by one (tests/plugins hold the two in step).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

DTYPES = ("float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "fp8_e4m3", "fp8_e5m2", "int8")
KV_SCALES = ("auto", "calibrate", "unit")  # fp8's per-layer K/V scales: checkpoint else calibration | always calibrate | 1.0


def _positive(owner: str, **values) -> None:
    for name, value in values.items():
        if value is not None and value <= 0:
            raise ValueError(f"{owner}.{name} must be positive, got {value}")


def _one_of(owner: str, name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{owner}.{name}: {value!r} is not one of {', '.join(allowed)}")


@dataclass(frozen=True)
class ModelOptions:
    path: str  # a GGUF file or a Hugging Face directory (config.json + safetensors)
    dtype: str = "float32"  # weights and activations
    device: str = "cpu"  # cpu | cuda | cuda:N
    num_threads: int | None = None  # torch threads in the engine process; None: torch's default
    cpu_kernels: bool = True  # on CPU, kvgate's C kernels where they build
    tokenizer_cache_dir: str | None = None  # where a GGUF's tokenizer is unpacked once

    def __post_init__(self):
        if not self.path:
            raise ValueError("model.path: a GGUF file or a Hugging Face directory is required")
        _one_of("model", "dtype", self.dtype, DTYPES)
        if not (self.device == "cpu" or self.device == "cuda" or
                (self.device.startswith("cuda:") and self.device[5:].isdigit())):
            raise ValueError(f"model.device: {self.device!r} is not cpu, cuda or cuda:N")
        _positive("model", num_threads=self.num_threads)


@dataclass(frozen=True)
class CacheOptions:
    block_size: int = 16  # tokens per KV-cache block
    kv_cache_dtype: str = "auto"  # auto (= the model's dtype) | a float dtype | fp8_e4m3 | fp8_e5m2 | int8
    kv_cache_bytes: int | None = None  # KV-cache budget in bytes; None: memory_fraction decides
    memory_fraction: float = 0.9  # of device memory for weights + KV + activations (CUDA)
    cpu_kv_cache_bytes: int = 2 << 30  # default KV budget on CPU, where memory is shared
    enable_prefix_caching: bool = True
    kv_scales: str = "auto"  # fp8 only: auto (the checkpoint's, else calibrated) | calibrate | unit (1.0)

    def __post_init__(self):
        _positive("cache", block_size=self.block_size, kv_cache_bytes=self.kv_cache_bytes,
                  cpu_kv_cache_bytes=self.cpu_kv_cache_bytes)
        _one_of("cache", "kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        _one_of("cache", "kv_scales", self.kv_scales, KV_SCALES)
        if not 0.0 < self.memory_fraction <= 1.0:
            raise ValueError(f"cache.memory_fraction must be in (0, 1], got {self.memory_fraction}")


@dataclass(frozen=True)
class SchedulerOptions:
    max_num_seqs: int = 32  # requests running at once
    max_num_batched_tokens: int = 512  # token budget of one step (chunked prefill)
    max_model_len: int | None = None  # None: the model's own context length

    def __post_init__(self):
        _positive("scheduler", max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
                  max_model_len=self.max_model_len)


@dataclass(frozen=True)
class ParallelOptions:
    tensor_parallel_size: int = 1

    def __post_init__(self):
        if self.tensor_parallel_size != 1:
            raise ValueError(f"parallel.tensor_parallel_size: {self.tensor_parallel_size} ranks; this engine "
                             "runs on one device so far (use 1)")


@dataclass(frozen=True)
class SpeculativeOptions:
    """Reserved for speculative decoding; any value is refused until it lands."""

    method: str
    num_speculative_tokens: int = 1

    def __post_init__(self):
        raise ValueError(f"speculative.method: {self.method!r}: speculative decoding is not supported yet")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelOptions
    cache: CacheOptions = field(default_factory=CacheOptions)
    scheduler: SchedulerOptions = field(default_factory=SchedulerOptions)
    parallel: ParallelOptions = field(default_factory=ParallelOptions)
    speculative: SpeculativeOptions | None = None

    @property
    def kv_cache_dtype(self) -> str:
        """The KV cache's storage dtype with 'auto' resolved (the model's dtype)."""
        return self.model.dtype if self.cache.kv_cache_dtype == "auto" else self.cache.kv_cache_dtype

    @classmethod
    def build(cls, **settings) -> EngineConfig:
        """From flat setting names, each of which belongs to exactly one part (`FIELD_PARTS`);
        an unknown name raises instead of being dropped."""
        parts: dict[str, dict] = {name: {} for name in PARTS}
        for key, value in settings.items():
            if key not in FIELD_PARTS:
                raise TypeError(f"unknown engine setting {key!r}")
            parts[FIELD_PARTS[key]][key] = value
        return cls(**{name: PARTS[name](**values) for name, values in parts.items()})


PARTS = {"model": ModelOptions, "cache": CacheOptions, "scheduler": SchedulerOptions, "parallel": ParallelOptions}
# Flat setting name -> the part it belongs to (names are unique across parts).
FIELD_PARTS = {f.name: part for part, options in PARTS.items() for f in fields(options)}
assert len(FIELD_PARTS) == sum(len(fields(options)) for options in PARTS.values()), "a setting name in two parts"
