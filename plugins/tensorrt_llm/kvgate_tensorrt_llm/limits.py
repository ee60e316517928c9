"""What one request may ask of this engine, checked before it is submitted.

TensorRT-LLM's PyTorch backend checks little synchronously: `LLM._check_arguments`
(tensorrt_llm/llmapi/llm.py) refuses only a prompt over `max_num_tokens` without chunked
prefill. A prompt plus max_tokens over `max_seq_len`, or a token id outside the vocabulary, is
found by the executor (`_validate_request` in _torch/pyexecutor/py_executor.py) and comes back as
a `RequestError` from the result's iterator; a seed or top_k that the C++ `SamplingConfig` cannot
hold (uint64, int32) fails inside the executor worker. Checking here turns each into a 400 for the
client before anything reaches the GPU, and an id outside the vocabulary never reaches an
embedding lookup.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.backend import SamplingParams
from gateway.errors import ContextLengthExceeded, InvalidRequestError

UINT64_END = 2**64
INT32_END = 2**31


@dataclass(frozen=True)
class EngineLimits:
    max_seq_len: int | None = None  # prompt + output tokens; None: not known here
    max_num_tokens: int | None = None  # binds a prompt only without chunked prefill
    vocab_size: int | None = None

    @classmethod
    def of(cls, llm, settings) -> "EngineLimits":
        """From the started LLM's own arguments, falling back on our settings."""
        args = getattr(llm, "args", None)
        max_seq_len = getattr(args, "max_seq_len", None) or settings.max_seq_len
        chunked = getattr(args, "enable_chunked_prefill", settings.enable_chunked_prefill)
        max_num_tokens = None if chunked else (getattr(args, "max_num_tokens", None) or settings.max_num_tokens)
        return cls(max_seq_len, max_num_tokens, vocab_size(getattr(llm, "tokenizer", None)))

    def output_budget(self, prompt_len: int, requested: int | None, default: int) -> int:
        """max_tokens to submit: the requested number if it fits, else a 400; without one, the
        default capped by what the context has left (OpenAI's "up to the context")."""
        if self.max_num_tokens and prompt_len > self.max_num_tokens:
            raise ContextLengthExceeded(
                f"The prompt has {prompt_len} tokens; this deployment takes at most {self.max_num_tokens} "
                "in one prompt (max_num_tokens, without chunked prefill).", param="messages")
        room = None if self.max_seq_len is None else self.max_seq_len - prompt_len
        if room is not None and room < max(1, requested or 1):
            raise ContextLengthExceeded(
                f"This model's maximum context length is {self.max_seq_len} tokens. However, you requested "
                f"{prompt_len + (requested or 1)} tokens ({prompt_len} in the prompt, {requested or 1} for the "
                "completion). Please reduce the prompt or max_tokens.", param="max_tokens")
        if requested:
            return requested
        return default if room is None else min(default, room)

    def check_tokens(self, prompt_ids: list[int], sampling: SamplingParams) -> None:
        """Token ids inside the vocabulary; seed and top_k inside what the engine can hold."""
        vocab = self.vocab_size or INT32_END
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise InvalidRequestError(f"The prompt has a token id outside the vocabulary (0..{vocab - 1}).",
                                      param="prompt")
        if any(not 0 <= t < vocab for t in sampling.stop_token_ids):
            raise InvalidRequestError(f"A stop token id is outside the vocabulary (0..{vocab - 1}).",
                                      param="stop_token_ids")
        if sampling.seed is not None and not 0 <= sampling.seed < UINT64_END:
            raise InvalidRequestError("seed must be between 0 and 2**64 - 1 for this model.", param="seed")

    def top_k(self, top_k: int) -> int | None:
        """top_k for the engine: 0 or anything at least the vocabulary means no top-k filter
        (also keeps the value inside the int32 the engine stores)."""
        limit = min(self.vocab_size or INT32_END, INT32_END)
        return top_k if 0 < top_k < limit else None


def vocab_size(tokenizer) -> int | None:
    """Token ids the tokenizer knows: `len()` of the Hugging Face tokenizer that TensorRT-LLM's
    TransformersTokenizer wraps (`.tokenizer`), or of the tokenizer itself."""
    for candidate in (getattr(tokenizer, "tokenizer", None), tokenizer):
        try:
            size = len(candidate)
        except Exception:  # noqa: BLE001 - no usable length: not known
            continue
        if size > 0:
            return size
    return None
