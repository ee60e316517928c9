"""bench/decode_settings.py's logic, not its speed: the engines take configs/default.yaml's settings,
each variant's own setting is in force for its rows, the order turns every other round, and the
summary's medians and ratios are the ones worked out by hand."""

import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import decode_settings  # noqa: E402
from decode_settings import Variant  # noqa: E402


def test_the_engines_take_make_serves_settings_with_prefix_caching_off():
    config = yaml.safe_load((ROOT / "configs/default.yaml").read_text())
    [native] = [d for m in config["models"] for d in m["deployments"] if d["backend"] == "native"]
    served = {k: v for k, v in native["settings"].items() if k != "model"}
    assert {**served, "enable_prefix_caching": False} == decode_settings.DEFAULT_SETTINGS


def test_each_variant_runs_its_rows_with_its_own_setting_in_force(monkeypatch):
    """One engine, two settings (fp8-fused's shape): a row must run after its own variant's enter."""
    engine = {"setting": None}
    seen = []

    def measure(row):
        def run(eng, *_):
            seen.append((row, eng["setting"]))
            return {"b1": 10.0, "c2": {"out_tok_s": 20.0}}[row]
        return run

    monkeypatch.setattr(decode_settings, "batch1", measure("b1"))
    monkeypatch.setattr(decode_settings, "c2", measure("c2"))
    variants = [Variant(name, engine, lambda name=name: engine.update(setting=name)) for name in ("python", "fused")]
    rows = decode_settings.one_round(decode_settings.round_order(variants, 1), {}, [1, 2, 3], 8)
    assert seen == [("b1", "fused"), ("b1", "python"), ("c2", "fused"), ("c2", "python")]
    assert rows == {"b1_decode_tok_s": {"fused": 10.0, "python": 10.0},
                    "c2_out_tok_s": {"fused": 20.0, "python": 20.0}}
    assert [v.name for v in decode_settings.round_order(variants, 0)] == ["python", "fused"]
    assert [v.name for v in decode_settings.round_order(variants, 2)] == ["python", "fused"]


def test_the_summary_takes_medians_and_the_median_of_per_round_ratios():
    rounds = [{"b1_decode_tok_s": {"float": 10.0, "int8": 15.0}},  # ratio 1.5
              {"b1_decode_tok_s": {"int8": 40.0, "float": 20.0}},  # ratio 2.0 (a quieter round, order reversed)
              {"b1_decode_tok_s": {"float": 12.0, "int8": 12.0}}]  # ratio 1.0
    row = decode_settings.summarize(rounds, ["float", "int8"])["b1_decode_tok_s"]
    assert row["float"] == 12.0 and row["int8"] == 15.0
    assert row["runs"] == {"float": [10.0, 20.0, 12.0], "int8": [15.0, 40.0, 12.0]}
    # the median of the rounds' ratios, not the ratio of the medians (15 / 12 = 1.25)
    assert row["int8_over_float"] == pytest.approx(1.5)
