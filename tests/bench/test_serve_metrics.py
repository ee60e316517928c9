"""bench/serve_metrics.py: `vllm bench serve`'s result keys from per-request samples, checked
against numbers worked out by hand and against numpy's percentile and std (vLLM's)."""

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from serve_metrics import RequestSample, percentile, serve_metrics  # noqa: E402

# Two requests and a failure over a 4-second run:
# a: sent at 0, chunks at 0.5, 0.7, 1.0 (3 tokens)   -> ttft 0.5, e2el 1.0, itl 0.2, 0.3, tpot 0.25
# b: sent at 1, chunks at 1.2, 2.2, 3.1 (4 tokens)   -> ttft 0.2, e2el 2.1, itl 1.0, 0.9, tpot 1.9/3
SAMPLES = [RequestSample(0.0, [0.5, 0.7, 1.0], output_tokens=3, prompt_tokens=10),
           RequestSample(1.0, [1.2, 2.2, 3.1], output_tokens=4, prompt_tokens=20),
           RequestSample(1.5, [], success=False)]

VLLM_KEYS = {"duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
             "request_throughput", "request_goodput", "output_throughput", "total_token_throughput",
             "max_output_tokens_per_s", "max_concurrent_requests"} | {
    f"{stat}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for stat in ("mean", "median", "std", "p99")}


def test_the_keys_are_vllm_bench_serves():
    assert set(serve_metrics(SAMPLES, 4.0)) == VLLM_KEYS


def test_counts_and_throughputs_leave_the_failure_out():
    r = serve_metrics(SAMPLES, 4.0)
    assert (r["completed"], r["failed"]) == (2, 1)
    assert (r["total_input_tokens"], r["total_output_tokens"]) == (30, 7)
    assert r["request_throughput"] == pytest.approx(0.5)
    assert r["output_throughput"] == pytest.approx(7 / 4)
    assert r["total_token_throughput"] == pytest.approx(37 / 4)
    assert r["request_goodput"] is None


def test_latencies_are_in_milliseconds_with_numpys_statistics():
    r = serve_metrics(SAMPLES, 4.0)
    assert r["mean_ttft_ms"] == pytest.approx(350)
    assert r["median_e2el_ms"] == pytest.approx(1550)
    assert r["mean_tpot_ms"] == pytest.approx((250 + 1900 / 3) / 2)
    itl = [200, 300, 1000, 900]
    assert r["mean_itl_ms"] == pytest.approx(np.mean(itl))
    assert r["std_itl_ms"] == pytest.approx(np.std(itl))
    assert r["p99_itl_ms"] == pytest.approx(np.percentile(itl, 99))


def test_peaks_per_wall_clock_second():
    r = serve_metrics(SAMPLES, 4.0)
    assert r["max_output_tokens_per_s"] == 2  # 0.5, 0.7 in second 0; 1.0, 1.2 in second 1; then 1 and 1
    assert r["max_concurrent_requests"] == 2  # both in flight during second 1


def test_goodput_counts_requests_within_every_slo():
    assert serve_metrics(SAMPLES, 4.0, goodput_ms={"ttft": 400})["request_goodput"] == pytest.approx(1 / 4)
    assert serve_metrics(SAMPLES, 4.0, goodput_ms={"ttft": 600, "e2el": 2000})["request_goodput"] == pytest.approx(1 / 4)
    assert serve_metrics(SAMPLES, 4.0, goodput_ms={"tpot": 1000})["request_goodput"] == pytest.approx(2 / 4)


def test_goodput_on_an_unknown_metric_is_refused_naming_it():
    with pytest.raises(ValueError, match="itl"):
        serve_metrics(SAMPLES, 4.0, goodput_ms={"itl": 10})


@pytest.mark.parametrize("p", [0, 25, 50, 90, 99, 100])
def test_percentile_is_numpys_linear(p):
    values = [3.0, 1.0, 4.0, 1.5, 9.0, 2.6]
    assert percentile(values, p) == pytest.approx(np.percentile(values, p))


def test_other_percentiles_and_a_run_with_no_success():
    r = serve_metrics([RequestSample(0.0, [], success=False)], 1.0, percentiles=(50, 99.9))
    assert r["completed"] == 0 and r["failed"] == 1
    assert r["p99.9_ttft_ms"] == 0.0 and r["p50_itl_ms"] == 0.0 and r["max_concurrent_requests"] == 0
