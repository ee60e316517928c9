"""The AWQ search on the real model: SmolLM2-135M quantized to int4 g64 by `kvgate quantize`'s
two methods (the AWQ search on the shipped calibration text, and plain round-to-nearest), each
checkpoint loaded and run by the engine's model runner, scored teacher-forced on held-out text
(`pydoc_data.topics`, which shares no paragraph with the calibration text). AWQ must predict it
better than RTN by a measured margin: a search that only fitted its calibration tokens, or scales
and clips lost on the way to the checkpoint, lands at RTN's perplexity or above.

Slow tier: the whole test is ~510 s of CPU (the AWQ search 411 s): ~4-5 minutes on two idle
cores (measured on a shared box: 41 minutes of wall clock at a load average of ~18)."""

from __future__ import annotations

import resource
import time

import pytest

from native_backend.config.cache_dir import tokenizer_cache_dir
from native_backend.model.loader import default_gguf_path, load_model
from native_backend.text.tokenizer import Tokenizer
from native_backend.tools.quantize import QuantizeOptions, quantize_model
from tests.support.checks.perplexity import held_out_windows, score

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]
GROUP = 64
# 8 x 128 calibration tokens (the default is 16 x 256): the paper finds AWQ barely moves from 16
# samples up, and on 2 cores this keeps the search near 3 minutes.
CALIBRATION = {"calib_samples": 8, "calib_seq_len": 128}


def cpu_seconds() -> float:
    """This process's CPU time: on a shared machine, what the wall clock would be on idle cores (x threads)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    out = {}
    for method in ("rtn", "awq"):
        path = str(tmp_path_factory.mktemp(f"smollm2-{method}"))
        started, cpu = time.perf_counter(), cpu_seconds()
        quantize_model(default_gguf_path(), path, QuantizeOptions(method=method, group_size=GROUP, **CALIBRATION))
        print(f"{method}: quantized in {time.perf_counter() - started:.0f} s ({cpu_seconds() - cpu:.0f} s of CPU)",
              flush=True)
        out[method] = path
    return out


def test_awq_predicts_held_out_text_better_than_rtn(checkpoints):
    """Measured on 1,020 held-out tokens (4 windows of 256): fp32 11.965, RTN 15.762, AWQ 13.422:
    AWQ is 0.85 of RTN's perplexity and closes 62 % of its gap to fp32 (bench/awq.py on 20,440
    tokens with the default calibration: 52 %). The bounds keep half of each margin."""
    cpu = cpu_seconds()
    tokenizer = Tokenizer.from_pretrained(default_gguf_path(), cache_dir=tokenizer_cache_dir())
    windows = held_out_windows(tokenizer, count=4, length=256)
    fp32 = score(load_model(default_gguf_path()), windows).perplexity
    rtn = score(load_model(checkpoints["rtn"]), windows).perplexity
    awq = score(load_model(checkpoints["awq"]), windows).perplexity
    closed = (rtn - awq) / (rtn - fp32)
    print(f"held out: fp32 {fp32:.3f}, RTN {rtn:.3f}, AWQ {awq:.3f}: AWQ closes {closed:.0%} of RTN's gap "
          f"(scored with {cpu_seconds() - cpu:.0f} s of CPU)")
    assert fp32 < awq, "AWQ's int4 model predicts as well as fp32: were its weights rounded at all?"
    assert awq <= 0.93 * rtn and closed >= 0.3, (fp32, rtn, awq)
