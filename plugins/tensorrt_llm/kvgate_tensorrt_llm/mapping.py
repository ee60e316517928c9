"""Our sampling parameters and outputs in TensorRT-LLM's terms.

Names checked against NVIDIA/TensorRT-LLM release 1.2.1, tensorrt_llm/sampling_params.py
(`SamplingParams`, keyword-only) and tensorrt_llm/executor/result.py (`CompletionOutput`:
text_diff, token_ids_diff, logprobs_diff, finish_reason).
"""

from __future__ import annotations

import json

from gateway.backend import SamplingParams, TokenLogprob, TopLogprob

FINISH_REASONS = {"stop": "stop", "length": "length", "cancelled": "abort", "timeout": "abort"}


def sampling_kwargs(s: SamplingParams, max_tokens: int, top_k: int | None) -> dict:
    """Keyword arguments for `tensorrt_llm.SamplingParams`.

    max_tokens is always passed: TensorRT-LLM's default is 32, not "up to the context". top_k
    comes from `EngineLimits.top_k` (None: no filter). logprobs is at least 1 when asked for at
    all: the PyTorch backend returns logprobs only when `bool(logprobs)` (sampling_params.py
    `_get_output_config`), so 0 would return none. The rest only when they differ from the
    OpenAI defaults.
    """
    kw: dict = {"max_tokens": max_tokens, "temperature": s.temperature, "top_p": s.top_p}
    optional = {
        "top_k": top_k,
        "min_p": s.min_p or None,
        "seed": s.seed,
        "stop": list(s.stop) or None,
        "stop_token_ids": list(s.stop_token_ids) or None,
        "presence_penalty": s.presence_penalty or None,
        "frequency_penalty": s.frequency_penalty or None,
        "repetition_penalty": s.repetition_penalty if s.repetition_penalty != 1.0 else None,
        "ignore_eos": s.ignore_eos or None,
        "logprobs": None if s.logprobs is None else max(1, s.logprobs),
    }
    kw.update({k: v for k, v in optional.items() if v is not None})
    return kw


def finish_reason(reason) -> str | None:
    return FINISH_REASONS.get(reason, "stop") if reason else None


def engine_priority(priority: int) -> float:
    """Our int priority (lower first) as the [0, 1] float of newer TensorRT-LLM (higher first):
    0 -> 0.5 (its default), -1 -> 0.67, 1 -> 0.33, monotone and never reaching 0 or 1."""
    return 1.0 / (1.0 + 2.0 ** max(-60, min(60, priority)))


def logprobs(diff, token_ids, decode, k: int) -> tuple[TokenLogprob, ...]:
    """`logprobs_diff` (one entry per new token: {token_id: Logprob(logprob, rank)}, or a float)
    to ours, with OpenAI's top_logprobs: the k most likely tokens at that position.

    TensorRT-LLM's entry is its top-k *plus the sampled token when that is not among them*
    (executor/result.py `compute_logprobs`; the PyTorch sampler does the same), so the sampled
    token is listed in `top` only when it is one of the k best, and an extra entry is dropped.
    """
    if not diff:
        return ()
    out = []
    for token_id, entry in zip(token_ids, diff):
        if isinstance(entry, dict):
            top = tuple(TopLogprob(decode(t), _value(lp), t) for t, lp in _best(entry, k))
            out.append(TokenLogprob(decode(token_id), _value(entry.get(token_id)), token_id, top))
        else:
            out.append(TokenLogprob(decode(token_id), float(entry), token_id))
    return tuple(out)


def _best(entry: dict, k: int) -> list:
    """The k best (token_id, Logprob) pairs: by rank where the engine gives one, else by value."""
    def order(item):
        rank = getattr(item[1], "rank", None)
        return (rank if rank is not None else float("inf"), -_value(item[1]))
    return sorted(entry.items(), key=order)[:k]


def _value(lp) -> float:
    if lp is None:
        return float("-inf")
    return float(getattr(lp, "logprob", lp))


def kv_stats(stat) -> dict | None:
    """{running, queued, kv_cache_usage} from one iteration-stats entry: a dict in 1.2.x
    (executor/result.py `IterationResult.__anext__` returns `json.loads(...)`); JSON text, as
    older releases and trtllm-serve's /metrics give it, is read too."""
    if isinstance(stat, (str, bytes)):
        try:
            stat = json.loads(stat)
        except ValueError:
            return None
    if not isinstance(stat, dict):
        return None
    kv = stat.get("kvCacheStats") or {}
    max_blocks = kv.get("maxNumBlocks") or 0
    used = kv.get("usedNumBlocks")
    if used is None and "freeNumBlocks" in kv:
        used = max_blocks - kv["freeNumBlocks"]
    return {
        "running": int(stat.get("numActiveRequests") or 0),
        "queued": int(stat.get("numQueuedRequests") or 0),
        "kv_cache_usage": min(1.0, (used or 0) / max_blocks) if max_blocks else 0.0,
    }
