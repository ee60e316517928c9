"""The grammar parts alone: llguidance against SmolLM2's real tokenizer, the compile service
(cache, sharing, failures, deadline) and the bitmask applied to logits."""

import json
import re
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from native_backend.config.engine import GrammarOptions
from native_backend.core.grammars import GrammarService
from native_backend.execution.token_mask import apply_token_bitmasks, unpack_bitmask
from native_backend.model.loader import default_gguf_path
from native_backend.text.grammar import GrammarCompiler
from native_backend.text.grammar_spec import GrammarError, GrammarSpec
from native_backend.text.tokenizer import Tokenizer

VOCAB = 49152  # SmolLM2's LM head


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return Tokenizer.from_pretrained(default_gguf_path(), cache_dir=str(tmp_path_factory.mktemp("tok")))


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, VOCAB, tokenizer.eos_token_ids[0])


def allowed_ids(matcher) -> set[int]:
    row = np.zeros(matcher.num_words, dtype=np.int32)
    matcher.fill_bitmask(row)
    return set(np.flatnonzero(unpack_bitmask(row[None], VOCAB, "cpu")[0].numpy()).tolist())


def test_a_choice_walks_to_its_end_and_stops(compiler, tokenizer):
    matcher = compiler.compile(GrammarSpec("choice", json.dumps(["yes", "no"]))).matcher()
    first = allowed_ids(matcher)
    texts = {tokenizer.decode([t]) for t in first}
    assert texts and all("yes".startswith(t) or "no".startswith(t) for t in texts)
    for token in tokenizer.encode("no", add_special_tokens=False):
        assert matcher.accept(token)
    assert allowed_ids(matcher) == {tokenizer.eos_token_ids[0]}  # only the end may follow
    assert matcher.accept(tokenizer.eos_token_ids[0]) and matcher.is_terminated


def test_a_refused_token_puts_the_matcher_in_error(compiler, tokenizer):
    matcher = compiler.compile(GrammarSpec("regex", "[0-9]+")).matcher()
    assert not matcher.accept(tokenizer.encode("abc", add_special_tokens=False)[0])
    assert matcher.error


@pytest.mark.parametrize("spec, reason", [
    (GrammarSpec("regex", "(unclosed", param="structured_outputs.regex"), "unclosed group"),
    (GrammarSpec("json_schema", '{"type": "bogus"}', param="response_format.json_schema.schema"), "bogus"),
    (GrammarSpec("grammar", "root ::= missing", param="structured_outputs.grammar"), "missing"),
])
def test_refusals_name_the_parameter_and_the_reason(compiler, spec, reason):
    with pytest.raises(GrammarError) as caught:
        compiler.compile(spec)
    assert str(caught.value).startswith(spec.param + ": ") and reason in str(caught.value)


def test_the_service_compiles_a_spec_once_and_counts_hits(compiler):
    service = GrammarService(lambda: compiler)
    spec = GrammarSpec("regex", "[a-z]{3}")
    first, second = service.submit(spec), service.submit(spec)  # the second shares the first's compile
    assert first.result(timeout=30) is second.result(timeout=30)
    third = service.submit(GrammarSpec("regex", "[a-z]{3}", param="structured_outputs.regex"))
    assert third.done() and third.result() is first.result()
    assert (service.stats.compiles, service.stats.cache_hits) == (1, 2)
    service.shutdown()


def test_the_cache_is_bounded(compiler):
    service = GrammarService(lambda: compiler, GrammarOptions(cache_size=2))
    specs = [GrammarSpec("regex", f"x{i}") for i in range(3)]
    for spec in specs:
        service.submit(spec).result(timeout=30)
    service.submit(specs[0]).result(timeout=30)  # evicted by the third: compiled again
    assert (service.stats.compiles, service.stats.cache_hits) == (4, 0)
    service.shutdown()


def test_a_failed_compile_is_not_cached(compiler):
    service = GrammarService(lambda: compiler)
    bad = GrammarSpec("regex", "(")
    for _ in range(2):
        with pytest.raises(GrammarError):
            service.submit(bad).result(timeout=30)
    assert service.stats.failures == 2 and service.stats.compiles == 0
    service.shutdown()


def test_a_slow_compile_does_not_block_submit(compiler):
    """The compiler is built on the worker thread; submit returns at once either way."""
    gate = threading.Event()

    def slow_compiler():
        gate.wait(10)
        return compiler

    service = GrammarService(slow_compiler)
    # A submit that waited for the compiler would return after gate.wait's 10 s with the grammar
    # compiled: not done here is the proof, with no clock to read on a loaded box.
    future = service.submit(GrammarSpec("regex", "[0-9]"))
    assert not future.done()
    gate.set()
    assert future.result(timeout=30).spec.text == "[0-9]"
    service.shutdown()


def test_apply_masks_only_the_constrained_rows():
    logits = torch.randn(3, 70)
    mask = np.zeros(3, dtype=np.int32)  # 96 bits for 70 tokens
    mask[0] = 1 << 5
    mask[2] = 1 << 1  # token 65
    out = apply_token_bitmasks(logits, [None, mask, None])
    assert torch.equal(out[0], logits[0]) and torch.equal(out[2], logits[2])
    assert torch.isfinite(out[1]).nonzero().flatten().tolist() == [5, 65]
    assert out[1, 5] == logits[1, 5]
    assert apply_token_bitmasks(logits, [None, None, None]) is logits  # unconstrained: no copy


def test_tokens_past_the_mask_are_never_allowed():
    mask = np.full((1, 1), -1, dtype=np.int32)  # 32 tokens allowed, the logits have 40
    allowed = unpack_bitmask(mask, 40, "cpu")[0]
    assert allowed[:32].all() and not allowed[32:].any()


# --- a hostile grammar (issue 40 item 3) --------------------------------------------------------

HOSTILE = r"^((x{100}){100}){100}$"  # compiles in milliseconds; its lexer is the cost


def test_a_hostile_regex_fails_its_compile_on_the_lexer_limit_naming_the_parameter(compiler):
    """The lexer llguidance builds lazily is built in the compile (the worker), where its limit
    fails the compile with a message naming the parameter (a 400), instead of the request's
    first mask and token on the step loop (a 500 after seconds of stall)."""
    service = GrammarService(lambda: compiler)
    with pytest.raises(GrammarError) as refused:
        service.submit(GrammarSpec("regex", HOSTILE, param="response_format.json_schema.schema")).result(timeout=60)
    message = str(refused.value)
    assert message.startswith("response_format.json_schema.schema: ") and "too complex" in message
    assert len(message) < 500
    assert service.stats.failures == 1 and service.stats.compiles == 0 and service.cached_bytes == 0
    service.shutdown()


def test_a_compiled_grammar_has_its_first_mask_built_before_the_step_loop_asks(compiler, tokenizer):
    """warm() builds the first mask in the worker and leaves the grammar at its start: a request's
    copy still allows exactly the pattern's first characters, and the grammar is charged bytes."""
    service = GrammarService(lambda: compiler)
    grammar = service.submit(GrammarSpec("regex", "[a-z]{3,20}@[a-z]+\\.com")).result(timeout=60)
    assert grammar.nbytes > 0 and service.cached_bytes == grammar.nbytes
    first = allowed_ids(grammar.matcher())
    assert first and all(tokenizer.decode([t]).strip() and tokenizer.decode([t])[0].islower() for t in first)
    service.shutdown()


def test_the_cache_is_bounded_in_bytes(compiler):
    """Each grammar is charged at least MIN_CHARGE_BYTES: a budget of one charge keeps one."""
    from native_backend.core.grammars import MIN_CHARGE_BYTES
    service = GrammarService(lambda: compiler, GrammarOptions(cache_bytes=MIN_CHARGE_BYTES))
    specs = [GrammarSpec("regex", f"y{i}") for i in range(2)]
    for spec in specs:
        service.submit(spec).result(timeout=30)
    assert service.cached_bytes <= MIN_CHARGE_BYTES and len(service._done) <= 1
    compiles = service.stats.compiles
    service.submit(specs[0]).result(timeout=30)  # dropped for the second: compiled again
    assert service.stats.compiles == compiles + 1
    service.shutdown()


def test_an_evicted_grammar_is_compiled_afresh(compiler):
    service = GrammarService(lambda: compiler)
    spec = GrammarSpec("regex", "[0-9]{2}")
    first = service.submit(spec).result(timeout=30)
    service.evict(spec)
    assert service.submit(spec).result(timeout=30) is not first
    assert (service.stats.compiles, service.stats.evictions, service.cached_bytes > 0) == (2, 1, True)
    service.shutdown()


class GatedCompiler:
    """A compiler whose compiles of specs named 'slow...' wait for a gate."""

    def __init__(self, compiler):
        self.compiler, self.gate, self.started = compiler, threading.Event(), []

    def compile(self, spec):
        self.started.append(spec.text)
        if spec.text.startswith("slow"):
            assert self.gate.wait(30)
        return self.compiler.compile(spec)


def test_two_workers_so_a_slow_compile_does_not_hold_the_next(compiler):
    gated = GatedCompiler(compiler)
    service = GrammarService(lambda: gated)
    slow = service.submit(GrammarSpec("regex", "slow[0-9]"))
    fast = service.submit(GrammarSpec("regex", "fast[0-9]"))
    try:
        assert fast.result(timeout=30).spec.text == "fast[0-9]" and not slow.done()
    finally:
        gated.gate.set()
    slow.result(timeout=30)
    service.shutdown()


def test_an_abort_cancels_a_queued_compile_and_its_clock_starts_with_the_compile(compiler):
    """Two slow compiles take both workers; a third waits in the queue: its deadline has not
    started (it is not expired however long it waits), and once its only waiter is released it
    is cancelled, never compiled. A compile with two waiters is not cancelled by one release."""
    gated = GatedCompiler(compiler)
    service = GrammarService(lambda: gated, GrammarOptions(compile_timeout_s=0.01))
    busy = [service.submit(GrammarSpec("regex", f"slow{i}")) for i in range(2)]
    queued = GrammarSpec("regex", "queued[0-9]")
    future = service.submit(queued)
    shared = GrammarSpec("regex", "shared[0-9]")
    shared_future = service.submit(shared)
    service.submit(shared)
    try:
        assert wait_for(lambda: len(gated.started) == 2)  # both slow specs hold both workers
        time.sleep(0.05)  # five deadlines' worth of waiting in the queue
        assert not service.expired(queued, time.monotonic())
        assert service.expired(GrammarSpec("regex", "slow0"), time.monotonic())  # running past its deadline
        service.release(queued)
        service.release(shared)
        assert future.cancelled() and not shared_future.cancelled()
    finally:
        gated.gate.set()
    assert shared_future.result(timeout=30).spec.text == "shared[0-9]"
    assert "queued[0-9]" not in gated.started and service.stats.cancelled == 1
    for f in busy:
        f.result(timeout=30)
    service.shutdown()


def wait_for(condition, wait_s: float = 30.0) -> bool:
    deadline = time.monotonic() + wait_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


def test_a_refused_grammar_logs_and_answers_a_few_hundred_characters_not_the_schema(compiler, caplog):
    schema = json.dumps({"type": "object", "properties": {f"p{i}": {"type": "nonsense"} for i in range(5000)}})
    service = GrammarService(lambda: compiler)
    with caplog.at_level("INFO", logger="kvgate.engine.grammar"), pytest.raises(GrammarError) as refused:
        service.submit(GrammarSpec("json_schema", schema, param="response_format")).result(timeout=60)
    assert len(schema) > 100_000
    assert len(str(refused.value)) < 400 and all(len(r.getMessage()) < 500 for r in caplog.records)
    service.shutdown()


def test_the_structured_battery_compiles_and_masks_under_the_lexer_limits(compiler, tokenizer, monkeypatch):
    """The fuel limits refuse the hostile regex, not ordinary constraints: every schema, tool
    parameter schema, regex and choice of bench/structured_battery.py that compiles under
    llguidance's default limits compiles here too, warms (first mask and one step) and allows
    some first token; one the library refuses either way (e.g. uniqueItems) is refused alike."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    from structured_battery import CHOICES, REGEXES, SCHEMAS, TOOLS
    import native_backend.text.grammar as grammar_module
    monkeypatch.setattr(grammar_module, "PARSER_LIMITS", dict(step_lexer_fuel=200_000, step_max_items=50_000,
                                                             initial_lexer_fuel=1_000_000, max_grammar_size=500_000))
    defaults = GrammarCompiler(tokenizer, VOCAB, tokenizer.eos_token_ids[0])
    specs = [GrammarSpec("json_schema", json.dumps(schema)) for _, schema, _ in SCHEMAS]
    specs += [GrammarSpec("json_schema", json.dumps(t["function"]["parameters"]))
              for t in TOOLS if t["function"].get("parameters")]
    specs += [GrammarSpec("regex", pattern) for _, pattern, _ in REGEXES]
    specs += [GrammarSpec("choice", json.dumps(choices)) for _, choices, _ in CHOICES]
    compiled = 0
    for spec in specs:
        try:
            defaults.compile(spec)
        except GrammarError as refused:
            with pytest.raises(GrammarError, match=re.escape(str(refused))):
                compiler.compile(spec)
            continue
        grammar = compiler.compile(spec)
        grammar.warm()
        assert allowed_ids(grammar.matcher()), spec.text[:80]
        compiled += 1
    assert compiled >= 0.9 * len(specs)
