"""A tiny Llama checkpoint that says one scripted text, greedy, whatever it is asked: for driving
a real engine end to end where what the model writes matters (tool calls whose markers are
special tokens) and a real model would not write it.

Every layer's output projections are zero, so the last hidden state is the current token's
embedding (normalised); the LM head scores token j by the embedding of the token that comes before
j in the script. The next token then depends only on the current one: after `after` (the last
token of the chat template's generation prompt) comes the script's first token, then the rest of
it, each once, ending on the tokenizer's end-of-turn token. transformers' own greedy generation
of the saved checkpoint checks it says the script.
"""

from __future__ import annotations

import os
import shutil

import tokenizers
import torch
import transformers

HIDDEN = 64


def make_scripted_checkpoint(path: str, tokenizer_dir: str, script: str, *, after: str, special: list[str],
                             end: str = "<|im_end|>") -> list[int]:
    """Write the checkpoint and its tokenizer (`tokenizer_dir`'s, with `special` added as special
    tokens) to `path`; returns the script's token ids (`end` last)."""
    os.makedirs(path, exist_ok=True)
    for name in os.listdir(tokenizer_dir):
        shutil.copy(os.path.join(tokenizer_dir, name), path)
    tokenizer = tokenizers.Tokenizer.from_file(os.path.join(tokenizer_dir, "tokenizer.json"))
    tokenizer.add_special_tokens(special)
    tokenizer.save(os.path.join(path, "tokenizer.json"))
    ids = tokenizer.encode(script + end, add_special_tokens=False).ids
    start = tokenizer.encode(after, add_special_tokens=False).ids
    chain = start[-1:] + ids
    if len(set(chain)) != len(chain):
        raise ValueError(f"a one-token model cannot say a script that repeats a token: {script!r}")
    model = _model(tokenizer.get_vocab_size(), chain, eos=tokenizer.token_to_id(end))
    model.save_pretrained(path, safe_serialization=True)
    _check_says(model, start, ids)
    return ids


def _model(vocab: int, chain: list[int], eos: int) -> transformers.LlamaForCausalLM:
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=eos, pad_token_id=eos)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        embed = torch.randn(vocab, HIDDEN)
        model.model.embed_tokens.weight.copy_(embed)
        for layer in model.model.layers:  # nothing added to the residual stream
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.norm.weight.fill_(1.0)
        head = torch.zeros(vocab, HIDDEN)
        for prev, nxt in zip(chain, chain[1:]):
            head[nxt] = embed[prev] / embed[prev].pow(2).mean().sqrt()  # its score: ~64 against ~N(0, 8)
        model.lm_head.weight.copy_(head)
    return model


def _check_says(model, start: list[int], ids: list[int]) -> None:
    with torch.no_grad():
        out = model.generate(torch.tensor([start]), max_new_tokens=len(ids), do_sample=False)
    said = out[0, len(start):].tolist()
    if said != ids:
        raise AssertionError(f"the scripted model says {said}, not {ids}")

