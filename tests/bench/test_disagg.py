"""bench/disagg.py: both setups are configs/disaggregated.yaml's engines (the same settings, one
thread each, two engines), differing only in roles and KV connector; its figures come from the
samples as worked out by hand."""

import argparse
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import disagg  # noqa: E402
from serve_metrics import RequestSample  # noqa: E402

from gateway.config import parse_config  # noqa: E402

ARGS = argparse.Namespace(**{flag.lstrip("-").replace("-", "_"): v for flag, v in disagg.DEFAULTS.items()})


def engines(setup: str):
    config = parse_config(yaml.safe_dump(disagg.setup_config(setup, ARGS)))
    [model] = config.models
    return model, model.deployments


def test_the_setups_differ_only_in_roles_and_the_kv_connector():
    colocated, co = engines("colocated")
    disaggregated, dis = engines("disaggregated")
    assert [d.role for d in co] == ["colocated", "colocated"] and not colocated.disaggregated
    assert [d.role for d in dis] == ["prefill", "decode"]
    assert disaggregated.disaggregation.min_prompt_chars > 0
    assert colocated.policy == disaggregated.policy == "least_loaded"
    assert [d.settings.get("kv_role") for d in dis] == ["producer", "consumer"]
    engine = {k: v for k, v in co[0].settings.items()}
    assert engine["num_threads"] == 1 and engine["kv_cache_bytes"] == ARGS.kv_cache_bytes
    assert not any(disagg._connector_key(k) for k in engine)
    for d in [*co, *dis]:  # the same engine on the same cores, but for its connector
        assert {k: v for k, v in d.settings.items() if not disagg._connector_key(k)} == engine


def test_disaggregated_all_sends_every_prompt_through_the_prefill_hop_and_changes_nothing_else():
    disaggregated, dis = engines("disaggregated")
    every, every_deployments = engines("disaggregated-all")
    assert every.disaggregation.min_prompt_chars == 0
    assert [(d.role, d.settings) for d in every_deployments] == [(d.role, d.settings) for d in dis]
    assert every.policy == disaggregated.policy


def test_each_disaggregated_setup_is_compared_with_colocated_and_itl_tails_are_reported():
    gaps = [0.02] * 998 + [0.5, 2.0]  # 1000 gaps: two stalls, both past p99, one at p99.9
    stream = RequestSample(0.0, [0.1 + sum(gaps[:i]) for i in range(len(gaps) + 1)], output_tokens=1001)
    row = disagg.row_of("colocated", [stream], [], 60.0, ARGS)
    assert row["itl_p99_ms"] == pytest.approx(20) and row["itl_max_ms"] == pytest.approx(2000)
    assert 500 <= row["itl_p999_ms"] <= 2000
    rows = [{"setup": s, **{c: v for c in disagg.COLUMNS}} for s, v in
            (("colocated", 4.0), ("colocated", 2.0), ("disaggregated-all", 1.0))]
    table = disagg.medians(rows)
    assert list(table) == ["colocated", "disaggregated-all"] and table["colocated"]["itl_p99_ms"] == 3.0
    assert disagg.summarize(table) == {"disaggregated-all": {f"{c.removesuffix('_ms')}_ratio": pytest.approx(1 / 3)
                                                             for c in disagg.RATIOS}}


def test_a_row_takes_itl_from_the_streams_and_goodput_from_every_request():
    # streams: gaps 0.1, 0.1 and 0.1, 0.5; a long prompt of TTFT 12 s (over the 10 s SLO)
    streams = [RequestSample(0.0, [0.5, 0.6, 0.7], output_tokens=3, prompt_tokens=20),
               RequestSample(1.0, [1.2, 1.3, 1.8], output_tokens=3, prompt_tokens=20)]
    longs = [RequestSample(0.0, [12.0, 12.1], output_tokens=2, prompt_tokens=3000)]
    row = disagg.row_of("colocated", streams, longs, 20.0, ARGS)
    assert row["itl_p50_ms"] == pytest.approx(100) and row["itl_p99_ms"] == pytest.approx(100 + 0.97 * 400)
    assert row["long_ttft_p50_ms"] == pytest.approx(12000) and row["long_prompt_tokens"] == [3000, 3000]
    assert row["stream_ttft_p50_ms"] == pytest.approx(350)
    assert row["output_tok_s"] == pytest.approx(8 / 20)
    # the first stream (TPOT 100 ms) is good; the second's TPOT is 300 ms, the long one's TTFT 12 s
    assert row["goodput_req_s"] == pytest.approx(1 / 20) and row["good_fraction"] == pytest.approx(1 / 3)
    # under a looser TPOT SLO the second stream is good too; the long prompt's TTFT never is
    assert row["goodput_by_tpot_slo"]["400"] == pytest.approx(2 / 20)
    assert row["goodput_by_tpot_slo"]["100"] == pytest.approx(1 / 20)  # 100 ms exactly is within it
    # per gap: the second stream's one 500 ms gap fails "no gap over 150 ms" but not "over 500 ms"
    assert row["goodput_itl_req_s"] == pytest.approx(1 / 20)
    assert row["goodput_by_max_itl_slo"]["500"] == pytest.approx(2 / 20)
    assert [r["max_itl_s"] for r in row["requests"]] == pytest.approx([0.1, 0.5, 0.1])
