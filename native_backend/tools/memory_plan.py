"""Will it fit? The memory arithmetic operators do by hand before deploying a model (`kvgate plan`).

Pure Python (no torch), so a plan can be made on any laptop. Per GPU (per rank under tensor
parallelism), the same budget the engine uses (`kv_cache.plan_kv_cache`):

    usable      = gpu_memory * memory_fraction
    kv_budget   = usable - weights/rank - activations - reserve
    bytes/token = 2 (K and V) * layers * kv_heads/rank * (head_dim * bytes/element + scale bytes)
    blocks      = kv_budget // (bytes/token * block_size)
    sequences of n tokens = blocks // ceil(n / block_size)

Under tensor parallelism each rank holds its slice of every sequence's KV, so the sequences one
rank's blocks hold are the sequences the whole group holds. KV heads split across ranks when
there are at least as many as ranks, and are replicated (one per rank) when there are fewer.

Under pipeline parallelism (pp stages of tp ranks) a rank holds its stage's layers only (the
engine's split: layers/stages.py), the embedding on the first stage and the LM head on the last;
every stage's ranks hold the blocks the engine agrees on, the fewest any stage's budget buys, so
the plan is the tightest stage's. `propose_layouts` lists every tp x pp for a number of GPUs.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field, replace

from native_backend.config.engine import CUDA_RESERVE_BYTES
from native_backend.config.formats import KV_FORMATS, PREFILL_MATMULS, WEIGHT_FORMATS, KVFormat, WeightFormat
from native_backend.config.model import ModelConfig
from native_backend.execution.parallel.validate import kv_heads_per_rank, split_problems, valid_tp_sizes
from native_backend.model.layers.stages import partition_layers

GiB = 1 << 30
MiB = 1 << 20
LOGITS_BYTES = 4  # samplers read logits as float32


class PlanError(ValueError):
    """Input the plan cannot use: the message says what was wrong and what is accepted."""


# ------------------------------------------------------------------------------ tables


def _llama(layers, heads, kv_heads, hidden, intermediate, vocab, context, **extra) -> ModelConfig:
    return ModelConfig(vocab_size=vocab, hidden_size=hidden, num_layers=layers, num_heads=heads,
                       num_kv_heads=kv_heads, head_dim=hidden // heads, intermediate_size=intermediate,
                       max_position_embeddings=context, **extra)


# From each model's published config.json on the Hugging Face Hub.
KNOWN_MODELS: dict[str, ModelConfig] = {
    "Llama-2-7B": _llama(32, 32, 32, 4096, 11008, 32000, 4096),
    "Llama-2-13B": _llama(40, 40, 40, 5120, 13824, 32000, 4096),
    "Llama-2-70B": _llama(80, 64, 8, 8192, 28672, 32000, 4096),
    "Llama-3-8B": _llama(32, 32, 8, 4096, 14336, 128256, 8192, rope_theta=500000.0),
    "Llama-3-70B": _llama(80, 64, 8, 8192, 28672, 128256, 8192, rope_theta=500000.0),
    "Qwen2-7B": _llama(28, 28, 4, 3584, 18944, 152064, 131072, rope_theta=1000000.0, attention_bias=True),
    "SmolLM2-135M": _llama(30, 9, 3, 576, 1536, 49152, 8192, rope_theta=100000.0, tie_word_embeddings=True),
}

# Total memory as nvidia-smi reports it (MiB), which is what a CUDA process can see.
GPUS: dict[str, int] = {
    "H200": 143771 * MiB,
    "H100-80G": 81559 * MiB,
    "A100-80G": 81920 * MiB,
    "A100-40G": 40960 * MiB,
    "L40S": 46068 * MiB,
    "A10G": 23028 * MiB,
    "L4": 23034 * MiB,
    "RTX-4090": 24564 * MiB,
}


def lookup(table: dict, name: str, what: str):
    """Case-insensitive table lookup whose error lists every known name."""
    by_lower = {key.lower(): value for key, value in table.items()}
    if name.lower() not in by_lower:
        raise PlanError(f"unknown {what} {name!r}; known: {', '.join(table)}")
    return by_lower[name.lower()]


# ------------------------------------------------------------------------------ tensor parallelism


def check_tp(config: ModelConfig, tp: int, model_name: str, group_size: int | None = None) -> None:
    """The engine's own rule (parallel.validate: heads, KV heads split or replicated, MLP and
    vocabulary; with `group_size`, packed int4 linears cut in whole int32 words and groups), so
    the plan never calls a size valid that the engine refuses."""
    problems = split_problems(config, tp, group_size) if tp >= 1 else ["a size below 1"]
    if problems:
        raise PlanError(
            f"--tp {tp} does not split {model_name}: {'; '.join(problems)}; valid sizes: "
            + ", ".join(map(str, valid_tp_sizes(config, group_size))))


# ------------------------------------------------------------------------------ the arithmetic


@dataclass(frozen=True)
class Stage:
    """A pipeline stage's share of the model: its layers, and whether it holds the embedding
    (the first; the last too with a tied head) and the LM head and final norm (the last)."""

    layers: int
    first: bool = True
    last: bool = True


def stages(config: ModelConfig, pp: int) -> list[Stage]:
    """The engine's split of the layers into pp stages (one stage: the whole model)."""
    try:
        counts = partition_layers(config.num_layers, pp)
    except ValueError as exc:
        raise PlanError(f"--pp {pp}: {exc}") from None
    return [Stage(n, i == 0, i == pp - 1) for i, n in enumerate(counts)]


def kv_bytes_per_token(config: ModelConfig, kv: KVFormat, *, tp: int = 1, gqa: bool = True,
                       layers: int | None = None) -> int:
    """K and V, every layer (of a stage: `layers`), one token, on one rank. `gqa=False` is the
    textbook 2 x L x d x bytes: as if every query head had its own K and V."""
    heads = kv_heads_per_rank(config.num_kv_heads if gqa else config.num_heads, tp)
    layers = config.num_layers if layers is None else layers
    return 2 * layers * heads * (config.head_dim * kv.bytes_per_element + kv.scale_bytes_per_head)


def linear_params_per_rank(config: ModelConfig, tp: int) -> int:
    """Weights of every decoder layer's q/k/v/o and MLP on one rank; a replicated KV head brings
    its k/v projection rows along."""
    c, kv_rows = config, kv_heads_per_rank(config.num_kv_heads, tp) * config.head_dim
    q_rows = c.num_heads // tp * c.head_dim
    attention = c.hidden_size * (2 * q_rows + 2 * kv_rows)  # q and o; k and v
    mlp = 3 * c.hidden_size * (c.intermediate_size // tp)  # gate, up, down
    return c.num_layers * (attention + mlp)


def other_params_per_rank(config: ModelConfig, tp: int, stage: Stage | None = None) -> int:
    """Embedding and LM head (split by vocabulary, as vLLM does), norms and biases (replicated),
    of a stage's share (`stage`; None: the whole model)."""
    c = config
    stage = stage or Stage(c.num_layers)
    vocab_rows = math.ceil(c.vocab_size / tp) * c.hidden_size
    embedding = vocab_rows if stage.first or (stage.last and c.tie_word_embeddings) else 0
    head = vocab_rows if stage.last and not c.tie_word_embeddings else 0
    norms = (2 * stage.layers + stage.last) * c.hidden_size
    bias = stage.layers * (c.num_heads // tp + 2 * kv_heads_per_rank(c.num_kv_heads, tp)) * c.head_dim
    return embedding + head + norms + (bias if c.attention_bias else 0)


def weights_bytes_per_rank(config: ModelConfig, fmt: WeightFormat, tp: int = 1, stage: Stage | None = None) -> int:
    linear = linear_params_per_rank(config, tp) * (stage.layers if stage else config.num_layers) // config.num_layers
    bits = linear * fmt.linear_bits
    if fmt.group_size:
        bits += math.ceil(linear / fmt.group_size) * fmt.group_bits
    return math.ceil(bits / 8) + other_params_per_rank(config, tp, stage) * fmt.other_bytes


def activation_bytes(config: ModelConfig, fmt: WeightFormat, *, tp: int, tokens: int, seqs: int) -> int:
    """A rough peak for one step of `tokens` tokens: the residual stream and its normed copy, the
    q/k/v and attention outputs, the MLP's gate, up and product on this rank, and float32 logits
    for the `seqs` rows that are sampled. (vLLM measures this with a profiling run instead.)"""
    c = config
    per_token = 4 * c.hidden_size + 3 * (c.intermediate_size // tp)
    return tokens * per_token * fmt.activation_bytes + min(seqs, tokens) * c.vocab_size * LOGITS_BYTES


def prefill_copy_bytes(config: ModelConfig, tp: int) -> int:
    """`prefill_matmul: bf16`'s resident bf16 copy of every decoder linear on one rank
    (model/layers/prefill_matmul.py): 2 bytes a weight, whatever the weights are stored in."""
    return 2 * linear_params_per_rank(config, tp)


def counts_bf16_prefill(inputs, fmt: WeightFormat) -> bool:
    """bf16 prefill asked for, or `auto` with int4 weights (where the engine may choose it)."""
    return inputs.prefill_matmul == "bf16" or (inputs.prefill_matmul == "auto" and fmt.group_size is not None)


# ------------------------------------------------------------------------------ the plan


@dataclass(frozen=True)
class PlanInputs:
    """What `kvgate plan` was asked. Memory comes from a GPU name, a size, or a KV budget."""

    model: str
    weights: str = "fp16"
    kv_cache_dtype: str = "auto"
    gpu: str | None = None
    memory_gib: float | None = None
    kv_cache_gib: float | None = None  # an explicit KV budget per rank, like the engine's kv_cache_bytes
    tp: int = 1
    pp: int = 1  # pipeline stages (tp ranks each)
    max_model_len: int | None = None
    block_size: int = 16
    memory_fraction: float = 0.9
    max_num_batched_tokens: int = 512  # the native engine's defaults
    max_num_seqs: int = 32
    gqa: bool = True
    prefill_matmul: str = "fp32"  # the engine's setting: bf16 (or auto with int4 weights) adds its bf16 copy


@dataclass(frozen=True)
class SequenceFit:
    tokens: int
    bytes_per_sequence: int  # on one rank
    sequences: int


@dataclass(frozen=True)
class MemoryPlan:
    inputs: PlanInputs
    model: ModelConfig
    weights_format: str
    kv_cache_dtype: str
    kv_heads_per_rank: int
    gpu_memory_bytes: int | None  # None when an explicit KV budget was given
    usable_bytes: int | None
    weights_bytes: int  # per rank, bf16 prefill's copy included
    prefill_copy_bytes: int  # of which bf16 prefill's copy of the linears (0 with fp32 prefill)
    activation_bytes: int
    reserve_bytes: int
    kv_budget_bytes: int
    kv_bytes_per_token: int  # per rank
    textbook_kv_bytes_per_token: int  # GQA ignored: 2 x layers x hidden-wide K/V x bytes
    real_kv_bytes_per_token: int  # GQA counted
    block_size: int
    bytes_per_block: int
    num_blocks: int
    max_model_len: int
    fits: list[SequenceFit] = field(default_factory=list)
    real_fits: list[SequenceFit] = field(default_factory=list)  # GQA counted (== fits unless --no-gqa)
    stage_layers: int = 0  # the decoder layers on this plan's ranks (under PP: the tightest stage's)

    def to_dict(self) -> dict:
        return asdict(self)


def make_plan(inputs: PlanInputs, config: ModelConfig) -> MemoryPlan:
    """Raises PlanError for an unknown name, a TP that does not split the heads, a PP with more
    stages than layers, or a model whose weights leave no room for a single block (on some stage)."""
    fmt = lookup(WEIGHT_FORMATS, inputs.weights, "weight format")
    kv = lookup(KV_FORMATS, fmt.auto_kv_dtype if inputs.kv_cache_dtype == "auto" else inputs.kv_cache_dtype,
                "KV cache dtype")
    _check_numbers(inputs)
    check_tp(config, inputs.tp, inputs.model, fmt.group_size)
    memory = _gpu_memory(inputs)
    activations = activation_bytes(config, fmt, tp=inputs.tp, tokens=inputs.max_num_batched_tokens,
                                   seqs=inputs.max_num_seqs) if memory else 0
    reserve = CUDA_RESERVE_BYTES if memory else 0
    usable = int(memory * inputs.memory_fraction) if memory else None
    plans = [_stage_plan(inputs, config, fmt, kv, stage, usable, activations, reserve)
             for stage in stages(config, inputs.pp)]
    # the tightest stage (fewest blocks; of equals, the most weights): its blocks are all the engine uses
    return min(plans, key=lambda p: (p.num_blocks, -p.weights_bytes))


def _stage_plan(inputs: PlanInputs, config: ModelConfig, fmt: WeightFormat, kv: KVFormat, stage: Stage,
                usable: int | None, activations: int, reserve: int) -> MemoryPlan:
    """One stage's ranks (the whole model with one stage)."""
    copy = prefill_copy_bytes(config, inputs.tp) * stage.layers // config.num_layers \
        if counts_bf16_prefill(inputs, fmt) else 0
    weights = weights_bytes_per_rank(config, fmt, inputs.tp, stage) + copy
    memory = None if usable is None else _gpu_memory(inputs)  # the GPU's whole memory, for the plan
    budget = int(inputs.kv_cache_gib * GiB) if usable is None else usable - weights - activations - reserve
    per_token = kv_bytes_per_token(config, kv, tp=inputs.tp, gqa=inputs.gqa, layers=stage.layers)
    per_block = per_token * inputs.block_size
    if budget < per_block:
        raise PlanError(_no_room(inputs, config, per_block, weights, usable))
    max_len = inputs.max_model_len or config.max_position_embeddings
    real_per_token = kv_bytes_per_token(config, kv, tp=inputs.tp, gqa=True, layers=stage.layers)
    return MemoryPlan(
        inputs=inputs, model=config, weights_format=fmt.name, kv_cache_dtype=kv.name,
        kv_heads_per_rank=kv_heads_per_rank(config.num_kv_heads if inputs.gqa else config.num_heads, inputs.tp),
        gpu_memory_bytes=memory, usable_bytes=usable, weights_bytes=weights, prefill_copy_bytes=copy,
        activation_bytes=activations, reserve_bytes=reserve, kv_budget_bytes=budget, kv_bytes_per_token=per_token,
        textbook_kv_bytes_per_token=kv_bytes_per_token(config, kv, tp=inputs.tp, gqa=False, layers=stage.layers),
        real_kv_bytes_per_token=real_per_token, block_size=inputs.block_size, bytes_per_block=per_block,
        num_blocks=budget // per_block, max_model_len=max_len,
        fits=_fits(max_len, per_token, budget, inputs.block_size),
        real_fits=_fits(max_len, real_per_token, budget, inputs.block_size), stage_layers=stage.layers,
    )


@dataclass(frozen=True)
class Layout:
    """One way to spread a model over `gpus` GPUs: tp x pp, and its plan or why it cannot run."""

    tp: int
    pp: int
    plan: MemoryPlan | None
    problem: str = ""


def propose_layouts(inputs: PlanInputs, config: ModelConfig, gpus: int) -> list[Layout]:
    """Every tp x pp = gpus with a tp that splits the model and no more stages than layers, TP
    largest first (TP belongs inside a node's NVLink domain, PP across nodes)."""
    if gpus < 1:
        raise PlanError(f"--gpus must be positive, got {gpus}")
    group = lookup(WEIGHT_FORMATS, inputs.weights, "weight format").group_size
    layouts = []
    for tp in sorted((t for t in range(1, gpus + 1) if gpus % t == 0), reverse=True):
        pp = gpus // tp
        if split_problems(config, tp, group) or pp > config.num_layers:
            continue
        try:
            layouts.append(Layout(tp, pp, make_plan(replace(inputs, tp=tp, pp=pp), config)))
        except PlanError as exc:
            layouts.append(Layout(tp, pp, None, str(exc)))
    return layouts


def _check_numbers(inputs: PlanInputs) -> None:
    for name in ("block_size", "max_model_len", "max_num_batched_tokens", "max_num_seqs",
                 "memory_gib", "kv_cache_gib"):
        value = getattr(inputs, name)
        if value is not None and value <= 0:
            raise PlanError(f"--{name.replace('_', '-')} must be positive, got {value}")
    if not 0 < inputs.memory_fraction <= 1:
        raise PlanError(f"--memory-fraction must be in (0, 1], got {inputs.memory_fraction}")
    if inputs.prefill_matmul not in PREFILL_MATMULS:
        raise PlanError(f"--prefill-matmul: {inputs.prefill_matmul!r} is not one of {', '.join(PREFILL_MATMULS)}")


def _gpu_memory(inputs: PlanInputs) -> int | None:
    given = [x for x in (inputs.gpu, inputs.memory_gib, inputs.kv_cache_gib) if x is not None]
    if len(given) != 1:
        raise PlanError("give exactly one of --gpu, --memory-gib and --kv-cache-gib")
    if inputs.gpu is not None:
        return lookup(GPUS, inputs.gpu, "GPU")
    if inputs.memory_gib is not None:
        return int(inputs.memory_gib * GiB)
    return None


def _no_room(inputs: PlanInputs, config: ModelConfig, per_block: int, weights: int, usable: int | None) -> str:
    if usable is None:
        return f"a KV budget of {inputs.kv_cache_gib} GiB is below one block ({fmt_bytes(per_block)})"
    return (f"{inputs.model} ({inputs.weights}) does not fit: {fmt_bytes(weights)} of weights per rank, plus "
            f"activations and reserve, leave no room for KV in {fmt_bytes(usable)} usable "
            f"({inputs.memory_fraction:.0%} of the GPU); {_what_would_fit(inputs, config)}")


def _what_would_fit(inputs: PlanInputs, config: ModelConfig) -> str:
    """The smallest valid larger TP that leaves room for KV, if any does."""
    group = lookup(WEIGHT_FORMATS, inputs.weights, "weight format").group_size
    for tp in (n for n in valid_tp_sizes(config, group) if n > inputs.tp):
        try:
            make_plan(replace(inputs, tp=tp), config)
            return f"--tp {tp} fits"
        except PlanError:
            continue
    return "no valid --tp fits; try quantized --weights (awq-int4, fp8)"


def context_lengths(max_len: int, block_size: int, count: int = 4) -> list[int]:
    """Full context, then halvings (4096, 2048, 1024, 512), none shorter than a block."""
    lengths = [max_len]
    while len(lengths) < count and lengths[-1] // 2 >= block_size:
        lengths.append(lengths[-1] // 2)
    return lengths


def _fits(max_len: int, per_token: int, budget: int, block_size: int) -> list[SequenceFit]:
    """Whole blocks only: a sequence of n tokens holds ceil(n / block_size) of them."""
    blocks = budget // (per_token * block_size)
    fits = []
    for tokens in context_lengths(max_len, block_size):
        blocks_per_seq = math.ceil(tokens / block_size)
        fits.append(SequenceFit(tokens, blocks_per_seq * block_size * per_token, blocks // blocks_per_seq))
    return fits


def fmt_bytes(n: int | float) -> str:
    """Binary units, as CUDA reports memory: 320 KiB, 2.50 MiB, 128.5 GiB."""
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", 1024)):
        if n >= size:
            value = n / size
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.{1 if value >= 10 else 2}f} {unit}"
    return f"{int(n)} B"


# ------------------------------------------------------------------------------ the model's shape


def model_shape(spec: str) -> ModelConfig:
    """A GGUF file, a Hugging Face directory (config.json), or a name from KNOWN_MODELS."""
    if os.path.isdir(spec):
        return _read(lambda: ModelConfig.from_hf_dir(spec), spec)
    if os.path.isfile(spec):
        return _read(lambda: _gguf_shape(spec), spec)
    if os.sep in spec or spec.endswith((".gguf", ".json")):
        raise PlanError(f"model file {spec!r} does not exist")
    if spec.lower() not in {name.lower() for name in KNOWN_MODELS}:
        raise PlanError(f"unknown model {spec!r}: no such file or directory, and not a built-in name; "
                        f"built-in: {', '.join(KNOWN_MODELS)}")
    return lookup(KNOWN_MODELS, spec, "model")


def _gguf_shape(path: str) -> ModelConfig:
    import gguf  # numpy only, no torch; imported here so the table works without it

    return ModelConfig.from_gguf(gguf.GGUFReader(path))


def _read(load, spec: str) -> ModelConfig:
    """A file that exists but is not a model is the user's mistake, not a crash."""
    try:
        return load()
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise PlanError(f"cannot read a model's shape from {spec!r}: {type(exc).__name__}: {exc}") from None
