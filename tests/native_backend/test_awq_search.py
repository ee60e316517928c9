"""The AWQ search on a tiny random Llama: its float forward is transformers', folding a scale
leaves the float function as it was, the clip search finds a clip where an outlier costs the
rest of the group, and the searched model loses less to int4 rounding than plain RTN on tokens it
was not calibrated on. The calibration text is apart from the evaluation text."""

from __future__ import annotations

import copy

import pydoc_data.topics
import pytest
import torch

from native_backend.model.quantization import awq, rtn
from native_backend.model.quantization.calibration import calibration_text, calibration_tokens
from native_backend.model.quantization.checkpoint import decoder_linears
from native_backend.tools.quantize import load_float_model
from tests.support.data.llama_checkpoints import VOCAB, make_checkpoint

torch.set_num_threads(2)
GROUP = 16
B, T = 8, 64


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    path = tmp_path_factory.mktemp("float")
    hf, _ = make_checkpoint(path, tie=False, rope_scaling=None)
    tokens = torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(0))
    return hf, load_float_model(str(path)), tokens


def logits(model, tokens):
    """The calibration forward, all layers, then the head."""
    rope = awq.Rope(*model.model.rotary_emb(torch.arange(tokens.shape[1])))
    with torch.no_grad():
        h = model.model.embed_tokens(tokens.reshape(-1)).reshape(*tokens.shape, -1)
        for layer in model.model.layers:
            h, _ = awq.layer_forward(layer, h, rope)
        return model.lm_head(model.model.norm(h))


def fake_quantize_all(model):
    with torch.no_grad():
        for lin in decoder_linears(model).values():
            lin.weight.copy_(rtn.fake_quantize(lin.weight, GROUP))
    return model


def test_the_calibration_forward_is_transformers(models):
    hf, model, tokens = models
    with torch.no_grad():
        torch.testing.assert_close(logits(model, tokens), hf(tokens).logits, atol=1e-4, rtol=0)


def test_folded_scales_leave_the_float_layer_unchanged(models):
    _, model, tokens = models
    model = copy.deepcopy(model)
    layer = model.model.layers[0]
    rope = awq.Rope(*model.model.rotary_emb(torch.arange(T)))
    h = torch.randn(B, T, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before, inputs = awq.layer_forward(layer, h, rope)
        for group in awq.scale_groups(layer, rope):
            s = awq.search_scale(group, getattr(inputs, group.inputs), GROUP)
            assert not torch.allclose(s, torch.ones_like(s))
            awq.fold_scale(group, s)
        after, _ = awq.layer_forward(layer, h, rope)
    torch.testing.assert_close(after, before, atol=1e-4, rtol=1e-4)


def test_clip_search_clips_a_lone_outlier():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(8, 32, generator=g) * 0.1
    w[3, 5] = 2.0  # one outlier: 16 codes spread over it waste the resolution of the other 15 weights
    x = torch.randn(256, 32, generator=g)
    best = awq.search_clip(w, x, 16)  # (8, 2, 1)
    assert best[3, 0, 0] < 2.0 and torch.equal(best[3, 1], w[3, 16:].abs().amax(-1, keepdim=True))
    clipped = w.clone()
    wg = clipped.reshape(8, 2, 16)
    clipped = torch.clamp(wg, -best, best).reshape(8, 32)
    err = lambda v: float((x @ rtn.fake_quantize(v, 16).t() - x @ w.t()).pow(2).mean())  # noqa: E731
    assert err(clipped) < err(w)


def with_outlier_channels(model, channels=(3, 17, 40, 61), gain: float = 8.0):
    """A few input channels of every linear group made large, as trained LLMs have them (the
    activations AWQ protects). A random Llama has none: there the search only fits its own
    calibration tokens (measured: 0.87 of RTN's error on them, 0.96-0.99 on held-out tokens)."""
    with torch.no_grad():
        for layer in model.model.layers:
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight[list(channels)] *= gain
    return model


def test_awq_loses_less_to_int4_than_rtn_on_held_out_tokens(models):
    """Searched on the calibration tokens, judged on others. Measured with these outliers: AWQ's
    error 0.59 of RTN's on the calibration tokens, 0.51 on these held-out ones (0.60-0.65 on
    other seeds); without the search's scales and clips it is RTN's, 1.0."""
    _, model, tokens = models
    model = with_outlier_channels(copy.deepcopy(model))
    held_out = torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(7))
    searched = copy.deepcopy(model)
    awq.awq_search(searched, tokens, GROUP)
    rtn_error, awq_error = (float((logits(fake_quantize_all(m), held_out) - logits(model, held_out)).pow(2).mean())
                            for m in (copy.deepcopy(model), searched))
    print(f"held out: AWQ {awq_error:.3e}, RTN {rtn_error:.3e} ({awq_error / rtn_error:.3f})")
    assert awq_error < 0.8 * rtn_error, (awq_error, rtn_error)


def test_calibration_text_is_held_apart_from_the_evaluation_text():
    text = calibration_text()
    assert len(text) > 100_000
    topics = "\n".join(pydoc_data.topics.topics.values())
    paragraphs = [p for p in text.split("\n\n") if len(p) > 120]
    assert len(paragraphs) > 200 and not [p for p in paragraphs if p in topics]


def test_calibration_blocks_spread_over_the_text():
    ids = list(range(1000))
    blocks = calibration_tokens(ids, 4, 100)
    assert blocks.shape == (4, 100) and blocks[:, 0].tolist() == [0, 200, 500, 700]
    with pytest.raises(ValueError, match="not 20 samples of 100"):
        calibration_tokens(ids, 20, 100)
