"""Text's one owner in the engine process: token ids in, text out (vLLM v1's output processor).

    EngineLoop ── add_request / abort / step ──> OutputProcessor ──> LLMEngine (the core: token ids)
    each CoreOutput ──IncrementalDetokenizer──> text ──StopStringMatcher──> RequestOutput (a text delta,
                                                                           logprobs with token strings)

A stop string found in a step's text ends the request in the core before the next step
(`LLMEngine.finish`), so no token is computed past it. The tokenizer is loaded once in the engine
process, by process.factory, and lives here; the core never sees text.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

from native_backend.core.engine import LLMEngine
from native_backend.core.interface import CoreOutput, EngineError, EngineRequest, EngineStats, RequestOutput, TokenLogprobs
from native_backend.text.detokenizer import IncrementalDetokenizer
from native_backend.text.stop import StopStringMatcher
from native_backend.text.tokenizer import Tokenizer

log = logging.getLogger("kvgate.engine")


@dataclass
class _RequestText:
    """One request's text so far: incremental detokenization, then stop-string holdback."""

    detokenizer: IncrementalDetokenizer
    stops: StopStringMatcher
    want_logprobs: bool
    # A special token that ends the request (an EOS, a stop_token_id) is not its text, even where
    # special tokens are kept (vLLM leaves the stop token out too).
    stop_ids: frozenset[int] = frozenset()


class OutputProcessor:
    """The engine core as the engine process drives it (EngineCoreProtocol), with text."""

    def __init__(self, core: LLMEngine, tokenizer: Tokenizer):
        self.core = core
        self.tokenizer = tokenizer
        self._texts: dict[str, _RequestText] = {}
        self.num_failed_requests = 0  # failed alone here, in their text, while the others went on

    def describe(self) -> str:
        return self.core.describe()

    def add_request(self, request: EngineRequest) -> None:
        self.core.add_request(request)  # raises EngineError to refuse it
        self._texts[request.request_id] = _RequestText(
            self._detokenizer(request),
            StopStringMatcher(request.sampling.stop),
            request.sampling.logprobs is not None,
            frozenset(t for t in (*self.tokenizer.eos_token_ids, *request.sampling.stop_token_ids)
                      if self.tokenizer.is_special(t)),
        )

    def _detokenizer(self, request: EngineRequest) -> IncrementalDetokenizer:
        """Special tokens out of the text (skip_special_tokens), but those kept for a tool parser."""
        kept = {self.tokenizer.special_token_id(text) for text in request.kept_special_tokens} - {None}
        if request.skip_special_tokens and kept:
            return IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids,
                                          dropped_ids=self.tokenizer.special_token_ids - kept)
        return IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids,
                                      skip_special_tokens=request.skip_special_tokens)

    def abort(self, request_id: str) -> None:
        self.core.abort(request_id)
        self._texts.pop(request_id, None)

    def release_kv(self, engine_id: str, request_id: str) -> None:
        self.core.release_kv(engine_id, request_id)

    def has_unfinished(self) -> bool:
        return self.core.has_unfinished()

    def reset_prefix_cache(self) -> None:
        self.core.reset_prefix_cache()

    def add_lora(self, name: str, path: str) -> None:
        self.core.add_lora(name, path)

    def remove_lora(self, name: str) -> None:
        self.core.remove_lora(name)

    def step(self) -> list[RequestOutput]:
        """One core step; each request's new tokens as a text delta."""
        return [self._to_output_or_error(out) for out in self.core.step() if out.request_id in self._texts]

    def stats(self) -> EngineStats:
        stats = self.core.stats()
        if not self.num_failed_requests:
            return stats
        return dataclasses.replace(stats, num_failed_requests=stats.num_failed_requests + self.num_failed_requests)

    def _to_output_or_error(self, out: CoreOutput) -> RequestOutput:
        """One request's output; a failure of its own text (its tokens, its stop strings) ends
        that request alone."""
        if out.error is not None:
            del self._texts[out.request_id]
            return _failed(out, out.error)
        try:
            return self._to_output(out)
        except Exception as exc:  # noqa: BLE001 - the request's tokens/stops are the cause
            message = f"output processing failed: {type(exc).__name__}: {exc}"
        log.warning("request %s failed alone: %s", out.request_id, message)
        self.num_failed_requests += 1
        self.core.finish(out.request_id, "abort")  # no-op if it already ended
        self._texts.pop(out.request_id, None)
        return _failed(out, EngineError("internal", message))

    def _to_output(self, out: CoreOutput) -> RequestOutput:
        state = self._texts[out.request_id]
        new_ids = out.new_token_ids
        if out.finish_reason == "stop" and new_ids and new_ids[-1] in state.stop_ids:
            new_ids = new_ids[:-1]
        text, stopped = state.stops.push(state.detokenizer.push(new_ids))
        finish_reason, timings = out.finish_reason, out.timings
        if stopped:
            if not out.finished:
                timings = self.core.finish(out.request_id, "stop")
            finish_reason = "stop"
        elif out.finished:
            tail, _ = state.stops.finish(state.detokenizer.flush())
            text += tail
        if finish_reason is not None:
            del self._texts[out.request_id]
        return RequestOutput(
            request_id=out.request_id,
            new_token_ids=list(out.new_token_ids),
            new_text=text,
            finish_reason=finish_reason,
            logprobs=self._logprobs(out) if state.want_logprobs else None,
            num_prompt_tokens=out.num_prompt_tokens,
            num_cached_tokens=out.num_cached_tokens,
            num_output_tokens=out.num_output_tokens,
            timings=timings,
            embedding=out.embedding,
            kv_transfer_params=out.kv_transfer_params,
        )

    def _logprobs(self, out: CoreOutput) -> list[TokenLogprobs] | None:
        if not out.logprobs:
            return None
        text = self.tokenizer.token_text
        return [TokenLogprobs(lp, text(lp.token_id), tuple(text(t) for t, _ in lp.top)) for lp in out.logprobs]


def _failed(out: CoreOutput, error: EngineError) -> RequestOutput:
    return RequestOutput(out.request_id, [], "", finish_reason="abort", num_prompt_tokens=out.num_prompt_tokens,
                         num_output_tokens=out.num_output_tokens, error=error)
