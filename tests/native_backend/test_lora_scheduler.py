"""LoRA in the scheduler (issue 43): a request waits for an adapter slot (max_loras adapters
among the running requests, vLLM's rule), and the prefix cache never shares blocks across
adapters (vLLM keys blocks by adapter), with the fake KV runner of conftest checking outputs."""

from __future__ import annotations

import pytest

from native_backend.core.sampling_params import SamplingParams
from native_backend.core.sequence import Sequence

PROMPT = list(range(1, 14))  # three full blocks of 4 and one token


def seq(rid, lora, max_tokens=3, prompt=PROMPT):
    return Sequence(rid, list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True), lora_name=lora)


def test_a_request_waits_for_a_free_lora_slot(make_scheduler, kit):
    scheduler = make_scheduler(max_loras=1)
    runner = kit.FakeKVRunner(scheduler)
    for rid, lora in [("a", "x"), ("b", "x"), ("c", "y")]:
        scheduler.add(seq(rid, lora, prompt=[rid == "c"] + PROMPT))
    out, _ = runner.step()
    assert sorted(c.request_id for c in out.chunks) == ["a", "b"]  # c's adapter has no slot
    assert {c.lora_name for c in out.chunks} == {"x"}
    seen = set()
    while scheduler.has_unfinished():
        out, _ = runner.step()
        seen.add(frozenset(c.lora_name for c in out.chunks))
    assert frozenset({"y"}) in seen and all(len(s) == 1 for s in seen)  # never x and y in one step


def test_prefix_cache_is_keyed_by_adapter(make_scheduler, kit):
    scheduler = make_scheduler(max_loras=2)
    runner = kit.FakeKVRunner(scheduler)
    hits = {}
    for rid, lora in [("base", None), ("x1", "x"), ("y1", "y"), ("x2", "x"), ("base2", None)]:
        s = seq(rid, lora)
        scheduler.add(s)
        while scheduler.has_unfinished():
            runner.step()
        hits[rid] = s.num_cached_tokens
    assert hits == {"base": 0, "x1": 0, "y1": 0, "x2": 12, "base2": 12}


def test_an_adapter_on_an_engine_without_lora_is_refused(make_scheduler):
    with pytest.raises(ValueError, match="without enable_lora"):
        make_scheduler().add(seq("a", "x"))


def test_kv_events_name_the_adapter_of_stored_blocks(make_scheduler, kit):
    """vLLM's BlockStored carries lora_name: a router must not match an adapter's blocks to base prompts."""
    import msgspec

    from native_backend.core.kv_events import BlockStored
    from native_backend.process.kv_publisher import KVEventBatch, to_wire

    scheduler = make_scheduler(max_loras=1, record_kv_events=True)
    runner = kit.FakeKVRunner(scheduler)
    for rid, lora in [("x1", "x"), ("base", None)]:
        scheduler.add(seq(rid, lora, prompt=[rid == "base"] + PROMPT))
        while scheduler.has_unfinished():
            runner.step()
    stored = [e for e in scheduler.block_manager.take_kv_events() if isinstance(e, BlockStored)]
    names = [e.lora_name for e in stored]  # x1's blocks (one event per prefill chunk), then base's
    assert names == sorted(names, key=lambda n: n is None) and set(names) == {"x", None}
    wire = [msgspec.msgpack.decode(msgspec.msgpack.encode(KVEventBatch(0.0, [to_wire(e)])))["events"][0]
            for e in (stored[0], stored[-1])]
    assert wire[0]["lora_name"] == "x" and "lora_name" not in wire[1]
