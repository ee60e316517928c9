"""Constrained decoding inside the engine's batch, on the real SmolLM2 and llguidance.

Constrained and unconstrained requests share batches under chunked prefill, prefix caching,
preemption by recompute, seeds and n-gram speculation; every constrained output must satisfy its
constraint (checked by `jsonschema` / Python's `re`, not by the library that enforced it), and
the unconstrained requests must come out exactly as they do alone (they pay nothing).
"""

import json
import re

import jsonschema
import pytest

from native_backend.config.engine import EngineConfig
from native_backend.core.interface import EngineError, EngineRequest
from native_backend.core.sampling_params import SamplingParams
from native_backend.model.loader import default_gguf_path
from native_backend.process.factory import make_engine_core
from native_backend.text.grammar_spec import GrammarSpec

pytestmark = pytest.mark.timeout(1200)

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0}},
          "required": ["name", "age"], "additionalProperties": False}
DIGITS = r"[0-9]{2,4}-[a-z]{2}"


@pytest.fixture(scope="module")
def make_engine(tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("tok"))

    def make(**overrides):
        settings = dict(max_num_batched_tokens=32, max_num_seqs=8) | overrides
        return make_engine_core(EngineConfig.build(path=default_gguf_path(), tokenizer_cache_dir=cache,
                                                   num_threads=2, **settings))

    return make


@pytest.fixture(scope="module")
def engine(make_engine):
    return make_engine()


def prompt(engine, text):
    return engine.tokenizer.apply_chat_template([{"role": "user", "content": text}])


def run(engine, requests):
    """Run requests to the end; request_id -> (text, finish_reason, error, token ids)."""
    results = {r.request_id: ["", None, None, []] for r in requests}
    for request in requests:
        engine.add_request(request)
    while engine.has_unfinished():
        for out in engine.step():
            result = results[out.request_id]
            result[0] += out.new_text
            result[3] += out.new_token_ids
            if out.finished:
                result[1], result[2] = out.finish_reason, out.error
    return {rid: tuple(r) for rid, r in results.items()}


def mixed_batch(engine, seed_base=0):
    person = GrammarSpec("json_schema", json.dumps(PERSON))
    ask = prompt(engine, "Describe a person as JSON. " * 3)  # a long prompt: chunked prefill
    return [
        EngineRequest("json-a", ask, SamplingParams(max_tokens=48, temperature=1.0, seed=seed_base + 1), grammar=person),
        EngineRequest("json-b", ask, SamplingParams(max_tokens=48, temperature=1.0, seed=seed_base + 2), grammar=person),
        EngineRequest("regex", prompt(engine, "A code please."), SamplingParams(max_tokens=16, temperature=1.0,
                      seed=seed_base + 3), grammar=GrammarSpec("regex", DIGITS)),
        EngineRequest("plain", prompt(engine, "Name three colours."), SamplingParams(max_tokens=24, temperature=0.0)),
    ]


def check_outputs(results):
    for rid in ("json-a", "json-b"):
        text, reason, error, _ = results[rid]
        assert error is None and reason == "stop", results[rid]
        jsonschema.validate(json.loads(text), PERSON)
    text, reason, error, _ = results["regex"]
    assert reason == "stop" and re.fullmatch(DIGITS, text), results["regex"]


def test_a_mixed_batch_is_valid_and_the_plain_row_pays_nothing(engine):
    results = run(engine, mixed_batch(engine))
    check_outputs(results)
    alone = run(engine, [mixed_batch(engine)[-1]])
    assert results["plain"][3] == alone["plain"][3]  # greedy, token for token


def test_seeds_reproduce_constrained_outputs(engine):
    first = run(engine, mixed_batch(engine, seed_base=10))
    again = run(engine, mixed_batch(engine, seed_base=10))
    assert {k: v[3] for k, v in first.items()} == {k: v[3] for k, v in again.items()}


def test_preemption_and_recompute_keep_the_grammar(make_engine):
    """A cache of 6 blocks of 16 tokens cannot hold the batch: requests are preempted, recompute
    their prompt and output, and go on where their grammar stood."""
    block_bytes = 16 * 30 * 2 * 3 * 64 * 4  # tokens x layers x (K, V) x KV heads x head dim x float32
    small = make_engine(kv_cache_bytes=6 * block_bytes, max_num_batched_tokens=64)
    batch = mixed_batch(small)
    # Each constraint compiled once first, so the whole batch joins the scheduler in one step: a compile
    # still running on a loaded box staggered the rows, and a cache that never filled preempted nobody.
    run(small, [EngineRequest(f"warm-{r.request_id}", prompt(small, "Hi"), SamplingParams(max_tokens=1),
                              grammar=r.grammar) for r in batch if r.grammar is not None])
    results = run(small, batch)
    assert small.stats().num_preemptions > 0
    check_outputs(results)


def test_ngram_speculation_skips_constrained_rows(make_engine):
    spec = make_engine(speculative={"method": "ngram", "num_speculative_tokens": 3})
    results = run(spec, mixed_batch(spec))
    check_outputs(results)
    assert spec.stats().spec_decode_num_drafts > 0  # the plain row speculated; the others could not


def test_a_refused_constraint_ends_its_request_before_any_token(engine):
    requests = mixed_batch(engine)[:1] + [
        EngineRequest("bad", prompt(engine, "Hi"), SamplingParams(max_tokens=8),
                      grammar=GrammarSpec("regex", "(unclosed", param="structured_outputs.regex"))]
    results = run(engine, requests)
    text, reason, error, tokens = results["bad"]
    assert reason == "abort" and tokens == [] and isinstance(error, EngineError)
    assert error.kind == "invalid" and error.message.startswith("structured_outputs.regex: ")
    text, reason, error, _ = results["json-a"]
    assert reason == "stop" and error is None
    jsonschema.validate(json.loads(text), PERSON)


def test_oversized_and_malformed_specs_are_refused_on_arrival(engine):
    with pytest.raises(EngineError, match="structured_outputs.choice: choice must be"):
        engine.add_request(EngineRequest("c", prompt(engine, "Hi"), SamplingParams(max_tokens=4),
                                         grammar=GrammarSpec("choice", "[]", param="structured_outputs.choice")))
    with pytest.raises(EngineError, match="over this server's limit of 1048576"):
        engine.add_request(EngineRequest("big", prompt(engine, "Hi"), SamplingParams(max_tokens=4),
                                         grammar=GrammarSpec("regex", "a" * (2 << 20))))
    assert not engine.has_unfinished()


def test_the_same_constraint_compiles_once(engine):
    before = engine.stats()
    run(engine, mixed_batch(engine, seed_base=20))
    after = engine.stats()
    assert after.grammar_compiles == before.grammar_compiles  # PERSON and DIGITS were compiled before
    assert after.grammar_cache_hits >= before.grammar_cache_hits + 3


def test_a_hostile_regex_is_a_400_naming_its_parameter_and_the_batch_goes_on(engine):
    """Issue 40 item 3: ^((x{100}){100}){100}$ compiles in milliseconds; its lexer is built in the
    compile worker now, where the fuel limit refuses it before any token (invalid: a 400 naming
    the parameter), while a plain request beside it runs to its end."""
    requests = [EngineRequest("hostile", prompt(engine, "x"), SamplingParams(max_tokens=8),
                              grammar=GrammarSpec("regex", r"^((x{100}){100}){100}$", param="structured_outputs.regex")),
                EngineRequest("plain", prompt(engine, "Name three colours."), SamplingParams(max_tokens=8))]
    results = run(engine, requests)
    _, reason, error, tokens = results["hostile"]
    assert reason == "abort" and tokens == [] and error.kind == "invalid"
    assert error.message.startswith("structured_outputs.regex: ") and "too complex" in error.message
    assert results["plain"][1] == "length" and results["plain"][2] is None


def test_a_matcher_past_its_limits_mid_stream_is_a_400_and_its_grammar_leaves_the_cache(engine, monkeypatch):
    """A grammar that passes its compile but whose matcher errors on a lexer limit later ends its
    request as the client's error naming the parameter (not a 500), and the cache drops it: the
    next request with that constraint compiles it afresh."""
    from native_backend.text.grammar import GrammarMatcher
    spec = GrammarSpec("regex", "[a-z]{2,6}", param="response_format.json_schema.schema")
    run(engine, [EngineRequest("warm", prompt(engine, "A word."), SamplingParams(max_tokens=4), grammar=spec)])
    compiles = engine.stats().grammar_compiles
    monkeypatch.setattr(GrammarMatcher, "accept", lambda self, token_id: False)
    monkeypatch.setattr(GrammarMatcher, "error", property(lambda self: "lexer error: too many expressions constructed"))
    _, reason, error, _ = run(engine, [EngineRequest("limit", prompt(engine, "A word."), SamplingParams(max_tokens=4),
                                                     grammar=spec)])["limit"]
    assert reason == "abort" and error.kind == "invalid"
    assert error.message.startswith("response_format.json_schema.schema: ") and "too complex" in error.message
    monkeypatch.undo()
    run(engine, [EngineRequest("again", prompt(engine, "A word."), SamplingParams(max_tokens=4), grammar=spec)])
    assert engine.stats().grammar_compiles == compiles + 1  # evicted: compiled again, not a cache hit
