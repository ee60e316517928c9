"""Reading a prompt's KV from a prefill engine against computing it (the native KV connector).

Two SmolLM2-135M engines in this process, a producer and a consumer (kv_role), TCP on loopback.
For each KV dtype: the consumer first computes a --tokens prompt itself (time to its first
token); then the producer runs the prefill hop of another prompt of the same length
(do_remote_decode, max_tokens 1) and the consumer decodes it from the producer's blocks (time to
its first token, and the read's bytes and seconds from the request's timings). Greedy, the same
pydoc text for both; one thread per engine.

    .venv/bin/python bench/kv_transfer.py --tokens 2000   # ~3 minutes on 2 cores; writes bench/results/kv_transfer.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from pydoc_data.topics import topics

from native_backend.config.cache_dir import tokenizer_cache_dir
from native_backend.config.default_model import default_gguf_path
from native_backend.config.engine import EngineConfig
from native_backend.core.interface import EngineRequest
from native_backend.core.sampling_params import SamplingParams
from native_backend.process.factory import make_engine_core

RESULTS = Path(__file__).parent / "results" / "kv_transfer.json"
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
PREFILL = SamplingParams(max_tokens=1, temperature=0.0)


def engine(role: str, kv_cache_dtype: str):
    return make_engine_core(EngineConfig.build(path=default_gguf_path(), kv_cache_bytes=512 << 20, kv_role=role,
                                               kv_cache_dtype=kv_cache_dtype, num_threads=1,
                                               tokenizer_cache_dir=str(tokenizer_cache_dir())))


def first_token(engine, request: EngineRequest):
    """(seconds to the request's first token, its last output)."""
    started, first, last = time.monotonic(), None, None
    engine.add_request(request)
    while engine.has_unfinished():
        for out in engine.step():
            if out.new_token_ids and first is None:
                first = time.monotonic() - started
            last = out
    return first, last


def measure(kv_cache_dtype: str, num_tokens: int) -> dict:
    producer, consumer = engine("producer", kv_cache_dtype), engine("consumer", kv_cache_dtype)
    ids = producer.tokenizer.encode(" ".join(topics.values()))
    local, remote = ids[:num_tokens], ids[3 * num_tokens:4 * num_tokens]
    computed_s, _ = first_token(consumer, EngineRequest("local", local, GREEDY))
    hop_s, last = first_token(producer, EngineRequest("remote", remote, PREFILL,
                                                      kv_transfer_params={"do_remote_decode": True}))
    read_first_s, last = first_token(consumer, EngineRequest("remote", remote, GREEDY,
                                                             kv_transfer_params=last.kv_transfer_params))
    t = last.timings
    read_s = t["kv_transfer_ended"] - t["kv_transfer_started"]
    return dict(kv_cache_dtype=kv_cache_dtype, tokens=num_tokens, ttft_computing_s=computed_s, prefill_hop_s=hop_s,
                ttft_reading_s=read_first_s, read_s=read_s, read_tokens=t["kv_transfer_tokens"],
                read_bytes=t["kv_transfer_bytes"], read_mib_per_s=t["kv_transfer_bytes"] / 2**20 / read_s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--kv-cache-dtypes", default="float32,fp8_e4m3")
    args = parser.parse_args()
    rows = [measure(dtype, args.tokens) for dtype in args.kv_cache_dtypes.split(",")]
    print("| KV | prompt | first token, computing it | prefill hop | first token, reading it | read | MiB/s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['kv_cache_dtype']} | {r['tokens']} | {r['ttft_computing_s']:.2f} s | {r['prefill_hop_s']:.2f} s | "
              f"{r['ttft_reading_s']:.2f} s | {r['read_bytes'] / 2**20:.1f} MiB in {r['read_s']:.3f} s | "
              f"{r['read_mib_per_s']:.0f} |")
    RESULTS.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
