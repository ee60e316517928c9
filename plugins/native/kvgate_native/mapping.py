"""Between the gateway's requests and the engine's: prompts checked and bounded, sampling and
constraints mapped onto the engine's parameters, engine outputs turned into token events (tool
calls split out), and the engine's stats into the load and info the gateway shows.
"""

from __future__ import annotations

import dataclasses
import json



from gateway.backend import GenerationRequest, LoadSnapshot, TokenEvent, TokenLogprob, TopLogprob, Usage
from gateway.errors import InvalidRequestError
from kvgate_native.constraints import grammar_spec
from kvgate_native.tool_parsers import ToolParser
from kvgate_native.tool_parsers.base import HiddenMarkers
from native_backend.core.interface import RequestOutput
from native_backend.core.sampling_params import SamplingParams as EngineSampling
from native_backend.text.tokenizer import Tokenizer


MAX_CHARS_PER_TOKEN = 8  # issue 40 item 10's bound: a prompt over 8 characters per token of context


def text_chars(value) -> int:
    """Characters in every string of a chat's messages (contents, parts, tool calls), iteratively:
    the body parser already bounded its depth and size."""
    total, stack = 0, [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return total




def flat_stats(stats: dict) -> dict[str, float]:
    """Engine stats as LoadSnapshot.extra floats; a per-position tuple becomes name_pos_<j> keys."""
    extra = {}
    for key, value in stats.items():
        if isinstance(value, (tuple, list)):
            extra.update({f"{key}_pos_{j}": float(v) for j, v in enumerate(value)})
        elif isinstance(value, (int, float)):  # text (the KV cache's dtype) goes to LoadSnapshot.info
            extra[key] = float(value)
    return extra




def checked_token_ids(ids: list[int], vocab_size: int) -> list[int]:
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"token id {bad} is outside the vocabulary (0..{vocab_size - 1})")
    return list(ids)


def request_grammar(request: GenerationRequest, parser: type[ToolParser]):
    """The output's grammar: the tool calls' (tool_choice required or named, in the parser's
    format) or the request's response_format / structured_outputs; never both."""
    tools = parser.grammar(request.tools, request.tool_choice, request.parallel_tool_calls)
    constraint = grammar_spec(request)
    if tools is not None and constraint is not None:
        raise InvalidRequestError("tool_choice 'required' or a named function already constrains the output; "
                                  "it cannot be combined with response_format or structured_outputs.",
                                  param="tool_choice")
    return tools or constraint


def with_tool_calls(event: TokenEvent, parser: ToolParser,
                     hidden: HiddenMarkers | None = None) -> TokenEvent:
    """The event's text split into content and tool-call fragments, the markers kept only for the
    parser (`hidden`) out of the content; a request that called tools and stopped ends with
    finish_reason tool_calls."""
    text, deltas = parser.push(event.text)
    finish_reason = event.finish_reason
    if finish_reason is not None:
        tail, more = parser.finish()
        text, deltas = text + tail, deltas + more
        if finish_reason == "stop" and parser.num_calls:
            finish_reason = "tool_calls"
    if hidden is not None:
        text = hidden.push(text) + (hidden.finish() if finish_reason is not None else "")
    return dataclasses.replace(event, text=text, tool_calls=tuple(deltas), finish_reason=finish_reason)


def hidden_markers(parser: ToolParser, tokenizer: Tokenizer) -> HiddenMarkers | None:
    """The parser's markers that are special tokens of this model: kept in the engine's text for
    the parser, out of the content; None where it reads none of them (SmolLM2: all are text)."""
    markers = tuple(m for m in getattr(parser, "special_markers", ()) if tokenizer.special_token_id(m) is not None)
    return HiddenMarkers(markers) if markers else None


def skip_special_tokens(request: GenerationRequest) -> bool:
    """vLLM's skip_special_tokens extension (default true); the gateway checked it is a boolean."""
    value = request.extra.get("skip_special_tokens", True)
    if not isinstance(value, bool):
        raise InvalidRequestError(f"skip_special_tokens must be a boolean, got {value!r}.", param="skip_special_tokens")
    return value


def cache_salt(request: GenerationRequest) -> str | None:
    """vLLM's cache_salt (a non-empty string; absent or null: none), for the engine's first block hash."""
    value = request.extra.get("cache_salt")
    if value is not None and not (isinstance(value, str) and value):
        raise InvalidRequestError(f"cache_salt must be a non-empty string, got {json.dumps(value)}.", param="cache_salt")
    return value


def engine_sampling(request: GenerationRequest) -> EngineSampling:
    """The gateway's sampling parameters as the engine's, field for field: the two types have the
    same fields (tests/plugins/test_native_settings.py), so nothing is dropped on the way."""
    return EngineSampling(**dataclasses.asdict(request.sampling))


def token_event(out: RequestOutput, want_logprobs: bool, every_usage: bool = False) -> TokenEvent:
    """One engine output as a token event; usage on the last (or, with `every_usage`, on each:
    the counts so far)."""
    usage = None
    if out.finished or every_usage:
        usage = Usage(out.num_prompt_tokens, out.num_output_tokens, out.num_cached_tokens)
    logprobs = ()
    if want_logprobs and out.logprobs:
        logprobs = tuple(
            TokenLogprob(
                token=lp.token, logprob=lp.sampled.logprob, token_id=lp.sampled.token_id,
                top=tuple(TopLogprob(text, logprob, tid) for text, (tid, logprob) in zip(lp.top_tokens, lp.sampled.top)),
            )
            for lp in out.logprobs
        )
    return TokenEvent(
        text=out.new_text, token_ids=tuple(out.new_token_ids), logprobs=logprobs,
        finish_reason=out.finish_reason, usage=usage, timings=out.timings,
        kv_transfer_params=out.kv_transfer_params,
    )


def engine_info(stats: dict) -> dict[str, str]:
    """What does not change while it runs: the KV cache's configuration, the weights' format
    (`weights`, e.g. "int4 AWQ g64"), the CPU kernels' path (`cpu_kernels`: "avx512", "avx2";
    absent where none runs), prompt chunks' paths (`prefill`: "matmuls bf16, attention bf16") and
    the context length (`max_model_len`): /v1/models shows the last four."""
    info = cache_info(stats)
    for key in ("weights", "cpu_kernels", "prefill"):
        if stats.get(key):
            info[key] = stats[key]
    if stats.get("max_model_len"):
        info["max_model_len"] = str(stats["max_model_len"])
    return info


def cache_info(stats: dict) -> dict[str, str]:
    """The KV cache's configuration under vLLM's label names (`vllm:cache_config_info`)."""
    if not stats.get("kv_cache_dtype"):
        return {}
    return {"block_size": str(stats["block_size"]), "cache_dtype": stats["kv_cache_dtype"],
            "num_gpu_blocks": str(stats["kv_blocks_total"])}
