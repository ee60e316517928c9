"""The grammar parts alone: llguidance against SmolLM2's real tokenizer, the compile service
(cache, sharing, failures, deadline) and the bitmask applied to logits."""

import json
import threading

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
