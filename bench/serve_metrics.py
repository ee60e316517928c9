"""Benchmark results under `vllm bench serve`'s keys, computed from per-request samples.

A user who compares serving stacks reads `vllm bench serve --save-result` JSON; kvgate's own
benchmarks write the same keys beside their own (`serve_metrics(...)`), so our numbers can be put
beside theirs. The definitions follow vLLM's (`vllm/benchmarks/serve.py`, see
../shared/WIRE_FORMATS.md section 8):

- TTFT: first output chunk - request sent; E2EL: last output chunk - request sent;
- ITL: the gaps between successive output chunks (a chunk of several tokens is one gap);
- TPOT: (E2EL - TTFT) / (output tokens - 1), for requests of more than one output token;
- throughputs over the run's duration: completed requests, output tokens, prompt + output tokens;
  the output tokens of the busiest wall-clock second and the most requests in flight in a second;
- goodput (with SLOs in ms for ttft, tpot, e2el): completed requests within every SLO, per second.
Failed requests count in `failed` and nowhere else. Times are seconds in, milliseconds out.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

METRICS = ("ttft", "tpot", "itl", "e2el")
GOODPUT_METRICS = ("ttft", "tpot", "e2el")


@dataclass
class RequestSample:
    """One request as the client saw it (any clock, the same for every sample of a run)."""

    start_s: float  # when it was sent
    chunk_times_s: list[float] = field(default_factory=list)  # when each piece of output arrived
    output_tokens: int = 0
    prompt_tokens: int = 0
    success: bool = True

    @property
    def ttft(self) -> float:
        return self.chunk_times_s[0] - self.start_s

    @property
    def e2el(self) -> float:
        return self.chunk_times_s[-1] - self.start_s

    @property
    def itl(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times_s, self.chunk_times_s[1:])]

    @property
    def tpot(self) -> float:
        """0 for a request of one output token (vLLM's value in its goodput check)."""
        return (self.e2el - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else 0.0


def percentile(values: list[float], p: float) -> float:
    """numpy's default (linear between the closest ranks); 0 for no values, as vLLM reports."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = (len(ordered) - 1) * p / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summary_ms(name: str, values_s: list[float], percentiles=(99,)) -> dict[str, float]:
    """mean_/median_/std_/p<P>_<name>_ms (std: the population's, as numpy's)."""
    ms = [1000 * v for v in values_s]
    out = {f"mean_{name}_ms": statistics.fmean(ms) if ms else 0.0,
           f"median_{name}_ms": statistics.median(ms) if ms else 0.0,
           f"std_{name}_ms": statistics.pstdev(ms) if ms else 0.0}
    for p in percentiles:
        out[f"p{p:g}_{name}_ms"] = percentile(ms, p)
    return out


def serve_metrics(samples: list[RequestSample], duration_s: float, percentiles=(99,),
                  goodput_ms: dict[str, float] | None = None) -> dict:
    """The result keys of `vllm bench serve --save-result` for these requests (every metric:
    ttft, tpot, itl, e2el), over a run of `duration_s` seconds."""
    done = [s for s in samples if s.success and s.chunk_times_s]
    output = sum(s.output_tokens for s in done)
    prompt = sum(s.prompt_tokens for s in done)
    series = {"ttft": [s.ttft for s in done], "tpot": [s.tpot for s in done if s.output_tokens > 1],
              "itl": [gap for s in done for gap in s.itl], "e2el": [s.e2el for s in done]}
    result = {
        "duration": duration_s, "completed": len(done), "failed": len(samples) - len(done),
        "total_input_tokens": prompt, "total_output_tokens": output,
        "request_throughput": len(done) / duration_s,
        "request_goodput": _goodput(done, goodput_ms) / duration_s if goodput_ms else None,
        "output_throughput": output / duration_s,
        "total_token_throughput": (prompt + output) / duration_s,
        **_peaks(done),
    }
    for name in METRICS:
        result.update(summary_ms(name, series[name], percentiles))
    return result


def _goodput(done: list[RequestSample], slo_ms: dict[str, float]) -> int:
    unknown = sorted(set(slo_ms) - set(GOODPUT_METRICS))
    if unknown:
        raise ValueError(f"goodput SLOs are for {', '.join(GOODPUT_METRICS)}, not {', '.join(unknown)}")
    return sum(all(1000 * getattr(s, name) <= limit for name, limit in slo_ms.items()) for s in done)


def _peaks(done: list[RequestSample]) -> dict:
    """vLLM's per-second buckets from the first request's start: the most output tokens whose
    chunk arrived in one second (one token per chunk, as vLLM counts), and the most requests in
    flight during one second."""
    if not done:
        return {"max_output_tokens_per_s": 0.0, "max_concurrent_requests": 0}
    origin = min(s.start_s for s in done)
    buckets = int(math.ceil(max(s.chunk_times_s[-1] for s in done) - origin)) + 1
    tokens, in_flight = [0.0] * buckets, [0] * buckets
    for s in done:
        for t in s.chunk_times_s:
            tokens[int(t - origin)] += 1
        for second in range(int(s.start_s - origin), int(s.chunk_times_s[-1] - origin) + 1):
            in_flight[second] += 1
    return {"max_output_tokens_per_s": max(tokens), "max_concurrent_requests": max(in_flight)}
